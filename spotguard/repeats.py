"""Errors that may come at every poll or reconnect for months (a metadata service that keeps failing,
a daemon that keeps refusing the hook): logged when they first come or change, then once a period."""

from __future__ import annotations

import time


class RepeatedErrors:
    """Per source, whether an error is due to be logged: a new or changed one, or the same one last
    logged ``every`` seconds ago or more."""

    def __init__(self, every: float) -> None:
        self.every = every
        self._logged: dict[str, tuple[str, float]] = {}  # source -> (its error last logged, when)

    def due(self, source: str, error: str) -> bool:
        now = time.monotonic()
        last = self._logged.get(source)
        if last is not None and last[0] == error and now - last[1] < self.every:
            return False
        self._logged[source] = (error, now)
        return True

    def clear(self, source: str) -> None:
        """``source`` works again: its next error is logged at once."""
        self._logged.pop(source, None)


__all__ = ["RepeatedErrors"]
