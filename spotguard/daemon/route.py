"""A deadline plan and how its route is chosen (the planner that keeps it: spotguard/daemon/plan.py).

Plain data below both the planner and the event stream that tells observers of each plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

# The bucket route is chosen only with room to spare: a link's rate wobbles, and the last files
# still need their commit after the data.
FIT_FRACTION = 0.8


class Route(StrEnum):
    BUCKET = "bucket"
    PEER = "peer"
    LOCAL = "local"


@dataclass(frozen=True)
class Plan:
    route: Route
    bytes: int
    rate_bytes_s: float | None  # None: nothing measured yet
    seconds_needed: float | None  # None: unknown (no rate)
    seconds_left: float
    why: str
    event_id: str = ""
    revision: int = 0  # 0 at notice time, +1 per change of route while the race runs

    def to_dict(self) -> dict[str, Any]:
        return {
            "route": str(self.route),
            "bytes": self.bytes,
            "rate_bytes_s": None if self.rate_bytes_s is None else round(self.rate_bytes_s),
            "seconds_needed": None if self.seconds_needed is None else round(self.seconds_needed, 2),
            "seconds_left": round(self.seconds_left, 2),
            "why": self.why,
            "event_id": self.event_id,
            "revision": self.revision,
        }

    def describe(self) -> str:
        rate = "no rate measured yet" if self.rate_bytes_s is None else f"{self.rate_bytes_s / 1e6:.1f} MB/s"
        needed = "?" if self.seconds_needed is None else f"{self.seconds_needed:.1f}"
        return (
            f"route {self.route}: {self.bytes / (1 << 20):.0f} MiB at {rate} needs {needed} s, "
            f"{self.seconds_left:.1f} s left ({self.why})"
        )


def choose_route(
    size: int, rate: float | None, seconds_left: float, *, peer_available: bool, bucket: bool = True
) -> Plan:
    """The route for ``size`` bytes at ``rate`` bytes/s with ``seconds_left`` to the deadline."""
    needed = 0.0 if size == 0 else (size / rate if rate else None)
    if not bucket:
        return Plan(Route.LOCAL, size, rate, needed, seconds_left, "no bucket is configured")
    if needed is None:
        return Plan(Route.BUCKET, size, rate, None, seconds_left, "no upload rate measured yet: trying the bucket")
    if needed <= FIT_FRACTION * seconds_left:
        return Plan(Route.BUCKET, size, rate, needed, seconds_left, "the bucket makes the deadline")
    if peer_available:
        return Plan(Route.PEER, size, rate, needed, seconds_left, "the bucket cannot make the deadline; a peer can")
    return Plan(
        Route.LOCAL,
        size,
        rate,
        needed,
        seconds_left,
        "neither the bucket nor a peer makes the deadline: the newest complete checkpoint in the bucket "
        "is the resume point",
    )


__all__ = ["FIT_FRACTION", "Plan", "Route", "choose_route"]
