"""When a periodic checkpoint is due: every N steps, every S seconds, or both (whichever comes first)."""

from __future__ import annotations

import time


def check_periodic(every_steps: int | None, every_seconds: float | None) -> None:
    if every_steps is not None and every_steps < 1:
        raise ValueError(f"every_steps must be >= 1, got {every_steps}")
    if every_seconds is not None and every_seconds <= 0:
        raise ValueError(f"every_seconds must be > 0, got {every_seconds}")


class Periodic:
    """The periodic clock: restarted by every save taken (urgent ones too) and by a resume."""

    def __init__(self, every_steps: int | None, every_seconds: float | None) -> None:
        check_periodic(every_steps, every_seconds)
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.last_step: int | None = None  # the step of the last save (or resume): never saved twice
        self.last_time = time.monotonic()

    def due(self, step: int) -> bool:
        if step == self.last_step:
            return False
        if self.every_steps is not None and step % self.every_steps == 0:
            return True
        return self.every_seconds is not None and time.monotonic() - self.last_time >= self.every_seconds

    def restart(self, step: int) -> None:
        self.last_step = step
        self.last_time = time.monotonic()
