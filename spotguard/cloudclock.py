"""The cloud's time as this VM best knows it: what objects in the bucket are aged by, and where the
cloud's deadlines and the peer registry's heartbeats fall on this VM's clock.

The bucket stamps its objects with the cloud's clock; the daemon deletes some of them by age (an
incomplete checkpoint untouched for ``incomplete_grace``, multipart uploads older than
``stale_upload_age``, upload-rate probes). Measured against this VM's clock, a clock an hour ahead of
the cloud's takes another node's upload in flight for a leftover and deletes it. The metadata
service's answers carry the cloud's time (their ``Date`` header; the monitors compare it with this
VM's clock at every poll, spotguard.providers.base.note_clock): while they say this VM's clock runs
ahead, ages are counted from the cloud's time instead. A clock behind the cloud's makes objects look
younger, which only keeps them longer, and is left as it is.

The deadlines the cloud gives (a spot interruption's ``time``, an event's ``NotBefore``) are in the
cloud's time too: on a clock off by more than :data:`CLOCK_OFF` they are moved onto this VM's clock
(:func:`on_this_clock`), so that a VM whose clock runs 200 s ahead races its notice's true two
minutes, not the 30 s window a notice dated in the VM's past got; never later than the longest
notice the event's kind gets, which a ``Date`` header dated hours back would otherwise override.

Stdlib only: the monitors, the stores and the peer registry import it.
"""

from __future__ import annotations

import threading
from datetime import datetime, timedelta

from spotguard.notice import steady_now, utcnow

#: How long a measurement stands without a newer one (a monitor that stopped answering, a daemon
#: without one): after that, this VM's clock is taken as it is, as before any measurement.
MEASUREMENT_LASTS = 3600.0
#: A clock further than this from the metadata service's is off (and warned about): a deadline the
#: cloud gives is moved onto it. Closer, the two are taken to agree (a Date header has whole seconds).
CLOCK_OFF = 30.0
#: What a Date header's whole seconds (and the answer's way back) add to the lead measured at most.
DATE_RESOLUTION = 1.0

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


def measured_lead() -> float | None:
    """Seconds this VM's clock was last seen ahead of the cloud's (negative: behind), within
    :data:`MEASUREMENT_LASTS`; None without such a measurement."""
    with _lock:
        ahead = _ahead
    if ahead is None or steady_now() - ahead[1] > MEASUREMENT_LASTS:
        return None
    return ahead[0]


def how_far(lead: float) -> str:
    """A measured lead in words: ``"200 s ahead of"`` or ``"200 s behind"`` (the metadata service's, ...)."""
    return f"{abs(lead):.0f} s {'ahead of' if lead > 0 else 'behind'}"


def on_this_clock(cloud_time: datetime, *, no_later_than: datetime | None = None) -> datetime:
    """A time the cloud gave (a notice's deadline) on this VM's clock: later by how far this clock was
    last seen ahead of the cloud's, earlier by how far behind, where that is past :data:`CLOCK_OFF`.
    Less :data:`DATE_RESOLUTION`, by which the measurement may overstate the lead: the deadline may
    come a second early on this clock, never late.

    ``no_later_than``: the latest the deadline can truly be (when the event was first seen, plus the
    longest notice the cloud gives for its kind). The lead is measured from a ``Date`` header, which a
    proxy or a broken metadata host could date hours in the past; a correction past that bound would
    have the daemon plan on time the VM does not have, so it stops there (never earlier than the
    cloud's own time, which a bound cannot contradict)."""
    lead = measured_lead()
    if lead is None or abs(lead) <= CLOCK_OFF:
        return cloud_time
    moved = cloud_time + timedelta(seconds=lead - DATE_RESOLUTION)
    if no_later_than is not None and moved > no_later_than:
        return max(cloud_time, no_later_than)
    return moved


def cloud_time() -> datetime:
    """Now on the cloud's clock as last measured, either way: what the peer registry's heartbeats are
    written and compared on, so that VMs whose clocks disagree still agree on them. Not for deciding
    what to delete: a ``Date`` header from the future would make everything look old (see
    :func:`cloud_now`)."""
    lead, now = measured_lead(), utcnow()
    return now if lead is None else now - timedelta(seconds=lead)


def cloud_now() -> datetime:
    """Now on the cloud's clock as far as this VM knows: its own clock, less how far it was last seen
    ahead of the metadata service's (within :data:`MEASUREMENT_LASTS`); never later than its own."""
    return min(utcnow(), cloud_time())


__all__ = [
    "CLOCK_OFF",
    "DATE_RESOLUTION",
    "MEASUREMENT_LASTS",
    "cloud_now",
    "cloud_time",
    "forget",
    "how_far",
    "measured_lead",
    "note_ahead",
    "on_this_clock",
]
