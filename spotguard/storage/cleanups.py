"""What a store could not clean up while it was failing (an abort of a multipart upload, a delete of
an upload's part objects), tried again now and then: a daemon runs for months between restarts, and
what stays behind is billed (and, hidden from listings, seen by no retention) until a restart's sweep.
Stdlib only."""

from __future__ import annotations

import threading
import time
from typing import Generic, TypeVar

T = TypeVar("T")


class FailedCleanups(Generic[T]):
    """Cleanups that failed, by key, each with what it takes to try again: all of them handed out
    again at most every ``interval`` seconds; at most ``bound`` remembered (the rest is left to a
    start-up's sweep by age)."""

    def __init__(self, interval: float, bound: int = 10_000) -> None:
        self.interval = interval
        self._bound = bound
        self._failed: dict[str, T] = {}
        self._lock = threading.Lock()
        self._retry_at = 0.0  # time.monotonic()

    def failed(self, key: str, value: T) -> bool:
        """Note that cleaning up ``key`` failed; whether it had failed before."""
        with self._lock:
            if key in self._failed:
                return True
            if len(self._failed) < self._bound:
                if not self._failed:
                    self._retry_at = time.monotonic() + self.interval
                self._failed[key] = value
            return False

    def cleaned(self, key: str) -> None:
        with self._lock:
            self._failed.pop(key, None)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._failed

    def due(self) -> list[tuple[str, T]]:
        """Every failed cleanup, once ``interval`` has passed since the last time they were handed out
        (or since the first failed); else none."""
        with self._lock:
            if not self._failed or time.monotonic() < self._retry_at:
                return []
            self._retry_at = time.monotonic() + self.interval
            return list(self._failed.items())


__all__ = ["FailedCleanups"]
