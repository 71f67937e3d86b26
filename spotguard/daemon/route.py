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


class SizeFrom(StrEnum):
    """Where a plan's ``bytes`` came from: the larger of what the connected trainers announced of their
    state and the last checkpoint's size, or, once the race runs, the urgent checkpoint's own files
    when they are more; ``unknown`` when nothing is known (the plan is then a guess)."""

    UNKNOWN = "unknown"
    ANNOUNCED = "announced"
    CHECKPOINT = "checkpoint"
    BOTH = "announced+checkpoint"
    URGENT = "urgent-checkpoint"

    @staticmethod
    def of(announced: int | None, checkpoint: int | None) -> SizeFrom:
        if announced is not None and checkpoint is not None:
            return SizeFrom.BOTH
        if announced is not None:
            return SizeFrom.ANNOUNCED
        return SizeFrom.UNKNOWN if checkpoint is None else SizeFrom.CHECKPOINT


UNKNOWN_SIZE = "size unknown: no trainer announced its state and no checkpoint exists yet"


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
    size_from: SizeFrom = SizeFrom.CHECKPOINT

    @property
    def size_known(self) -> bool:
        return self.size_from is not SizeFrom.UNKNOWN

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
            "size_from": str(self.size_from),
        }

    def describe(self) -> str:
        rate = "no rate measured yet" if self.rate_bytes_s is None else f"{self.rate_bytes_s / 1e6:.1f} MB/s"
        needed = "?" if self.seconds_needed is None else f"{self.seconds_needed:.1f}"
        size = f"{self.bytes / (1 << 20):.0f} MiB ({self.size_from})" if self.size_known else "? MiB"
        return f"route {self.route}: {size} at {rate} needs {needed} s, {self.seconds_left:.1f} s left ({self.why})"


def choose_route(
    size: int,
    rate: float | None,
    seconds_left: float,
    *,
    peer_available: bool,
    bucket: bool = True,
    size_from: SizeFrom = SizeFrom.CHECKPOINT,
) -> Plan:
    """The route for ``size`` bytes at ``rate`` bytes/s with ``seconds_left`` to the deadline.

    With ``size_from`` unknown the size is a guess: the bucket is tried (it costs nothing), the plan
    says so and claims nothing about the time it needs."""
    guess = size_from is SizeFrom.UNKNOWN
    needed = None if guess else _needed(size, rate)
    route, why = Route.BUCKET, "the bucket makes the deadline"
    if not bucket:
        route, why = Route.LOCAL, "no bucket is configured"
    elif guess:
        why = f"{UNKNOWN_SIZE}: trying the bucket"
    elif needed is None:
        why = "no upload rate measured yet: trying the bucket"
    elif needed > FIT_FRACTION * seconds_left and peer_available:
        route, why = Route.PEER, "the bucket cannot make the deadline; a peer can"
    elif needed > FIT_FRACTION * seconds_left:
        route = Route.LOCAL
        why = (
            "neither the bucket nor a peer makes the deadline: the newest complete checkpoint in the bucket "
            "is the resume point"
        )
    return Plan(route, size, rate, needed, seconds_left, why, size_from=size_from)


def _needed(size: int, rate: float | None) -> float | None:
    return 0.0 if size == 0 else (size / rate if rate else None)


__all__ = ["FIT_FRACTION", "UNKNOWN_SIZE", "Plan", "Route", "SizeFrom", "choose_route"]
