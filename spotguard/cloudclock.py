"""The cloud's time as this VM best knows it, for telling how old an object in the bucket is.

The bucket stamps its objects with the cloud's clock; the daemon deletes some of them by age (an
incomplete checkpoint untouched for ``incomplete_grace``, multipart uploads older than
``stale_upload_age``, upload-rate probes). Measured against this VM's clock, a clock an hour ahead of
the cloud's takes another node's upload in flight for a leftover and deletes it. The metadata
service's answers carry the cloud's time (their ``Date`` header; the monitors compare it with this
VM's clock at every poll, spotguard.providers.base.note_clock): while they say this VM's clock runs
ahead, ages are counted from the cloud's time instead. A clock behind the cloud's makes objects look
younger, which only keeps them longer, and is left as it is.

Stdlib only: the stores import it.
"""

from __future__ import annotations

import threading
from datetime import datetime, timedelta

from spotguard.notice import steady_now, utcnow

#: How long a measurement stands without a newer one (a monitor that stopped answering, a daemon
#: without one): after that, this VM's clock is taken as it is, as before any measurement.
MEASUREMENT_LASTS = 3600.0

_lock = threading.Lock()
_ahead: tuple[float, float] | None = None  # (seconds this VM's clock is ahead of the cloud's, steady_now() then)


def note_ahead(seconds: float) -> None:
    """This VM's clock was just found ``seconds`` ahead of the cloud's (negative: behind)."""
    global _ahead
    with _lock:
        _ahead = (seconds, steady_now())


def forget() -> None:
    """Drop the measurement (a test's, or a daemon's that stops)."""
    global _ahead
    with _lock:
        _ahead = None


def cloud_now() -> datetime:
    """Now on the cloud's clock as far as this VM knows: its own clock, less how far it was last seen
    ahead of the metadata service's (within :data:`MEASUREMENT_LASTS`); never later than its own."""
    with _lock:
        ahead = _ahead
    now = utcnow()
    if ahead is None or ahead[0] <= 0 or steady_now() - ahead[1] > MEASUREMENT_LASTS:
        return now
    return now - timedelta(seconds=ahead[0])


__all__ = ["MEASUREMENT_LASTS", "cloud_now", "forget", "note_ahead"]
