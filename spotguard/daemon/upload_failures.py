"""Failed uploads of checkpoints: how long to wait before the next attempt, and who to tell."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from spotguard.backoff import backoff_delay
from spotguard.daemon.events import EventBus, UploadFailed
from spotguard.notice import utcnow
from spotguard.storage.base import ChecksumMismatch

logger = logging.getLogger("spotguard.uploader")


class UploadFailures:
    """Failures in a row per checkpoint (until it is committed), the backoff they earn, the
    checkpoints never retried, and the latest failures for the status. Each failure is told on
    ``bus`` as an :class:`~spotguard.daemon.events.UploadFailed`."""

    def __init__(self, *, retry_after: float, retry_max: float, alert_after: int, bus: EventBus) -> None:
        self.retry_after = retry_after  # the first wait after a failed upload; doubled per failure in a row
        self.retry_max = retry_max  # ... up to this
        self.alert_after = alert_after  # failures in a row of one checkpoint before an error-level alert
        self.bus = bus
        self.in_a_row: dict[str, int] = {}
        self.not_before: dict[str, float] = {}  # backoff after a failed attempt
        self.recent: list[dict[str, Any]] = []
        # Checkpoints not retried until a restart: the store answers wrong checksums for their bytes
        # (a backend raises ChecksumMismatch only once its own bounded attempts are spent).
        self.refused: dict[str, str] = {}

    def retry_delay(self, name: str, *, racing: bool) -> float:
        """How long to wait after the last failure in a row of ``name``.

        A checkpoint ``racing`` a deadline keeps the short wait (the deadline bounds it); any
        other doubles it per failure up to ``retry_max``, jittered so that many VMs whose bucket
        failed at once do not come back in step.
        """
        if racing:
            return self.retry_after
        return backoff_delay(self.in_a_row.get(name, 1), self.retry_after, self.retry_max)

    def streak(self) -> int:
        """The most failures in a row of any checkpoint still to upload (0: none is failing)."""
        return max(self.in_a_row.values(), default=0)

    def succeeded(self, name: str) -> None:
        self.forget(name)

    def forget(self, *names: str) -> None:
        """``names`` are not to be retried: committed, their directory gone, their save failed, or the
        store refuses them. Their backoff and streak go with them; a backoff left behind would keep the
        uploader's wait at zero (a spin), and a streak would keep the failing-streak alert up for the
        daemon's life."""
        for name in names:
            self.not_before.pop(name, None)
            self.in_a_row.pop(name, None)

    def forget_refused(self, names: Iterable[str]) -> None:
        """``names`` left the disk: one written again under such a name is tried afresh."""
        for name in names:
            self.refused.pop(name, None)

    def next_retry(self, names: Iterable[str]) -> float | None:
        """The soonest time (monotonic) any of ``names`` may be tried again after a failure; None if none
        of them is waiting out a backoff."""
        return min((self.not_before[name] for name in names if name in self.not_before), default=None)

    def record(self, name: str, exc: BaseException, *, racing: bool, bucket: str) -> bool:
        """Count, log and announce a failed upload of ``name``; True if it is to be retried (not
        before ``not_before[name]``), False if the store refuses its bytes."""
        refused = isinstance(exc, ChecksumMismatch)
        failed = self.in_a_row[name] = self.in_a_row.get(name, 0) + 1
        delay = self.retry_delay(name, racing=racing)
        if refused:
            logger.error(
                "upload of %s failed: %s; not retried: the store answers the same for the same bytes", name, exc
            )
            self.refused[name] = str(exc)
        else:
            logger.error("upload of %s failed (%d in a row): %s; retrying in %.1f s", name, failed, exc, delay)
        if failed == self.alert_after:
            logger.error(
                "ALERT: the upload of %s has failed %d times in a row; it is retried every %.0f s at most, "
                "and nothing newer is safe in %s until it succeeds: check the bucket, the credentials and the link",
                name,
                failed,
                self.retry_max,
                bucket,
            )
        self.recent.append({"name": name, "error": str(exc), "at": utcnow().isoformat(), "in_a_row": failed})
        del self.recent[:-20]
        self.bus.emit(UploadFailed(name, exc))
        if refused:
            self.forget(name)  # never retried: what it failed with stays in ``refused`` and ``recent``
            return False
        self.not_before[name] = time.monotonic() + delay
        return True
