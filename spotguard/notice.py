"""The notice model: one immutable value for "this VM is going away (or may)".

Stdlib only: both the daemon and the trainer hook import it.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any


class Kind(StrEnum):
    TERMINATE = "terminate"
    STOP = "stop"
    HIBERNATE = "hibernate"
    REBALANCE = "rebalance"
    MAINTENANCE = "maintenance"
    DRILL = "drill"
    SIGTERM = "sigterm"


#: Kinds that stop training by default. Soft kinds (rebalance, maintenance) only
#: trigger an early, non-stopping checkpoint unless the daemon's policy says otherwise.
HARD_KINDS = frozenset({Kind.TERMINATE, Kind.STOP, Kind.HIBERNATE, Kind.DRILL, Kind.SIGTERM})
# The window a hard notice gets when it names no usable deadline: AWS hibernation and an Auto Scaling
# `Terminated` state promise no warning time, and a deadline already behind this VM's clock says the
# clock is wrong (spotguard.daemon.notices.clock_checked). A deadline of "now" would leave the urgent
# upload no retry budget at all, yet the VM still runs its shutdown for a while; this window (GCP's
# preemption notice) is the budget they get.
UNTIMED_NOTICE_WINDOW = timedelta(seconds=30)
#: A training script's exit status once a hard notice stopped its loop (``sys.exit(guard.exit_code)``;
#: sysexits' EX_TEMPFAIL): the run is not over and goes on elsewhere, from the checkpoint just saved.
#: Exiting 0 there, a Kubernetes Job counted the run complete and started no replacement pod
#: (kubernetes/example-trainer/job.yaml ignores this status in its podFailurePolicy, so one is started).
EXIT_STOPPED = 75


class Action(StrEnum):
    """What the daemon does about a notice."""

    STOP = "stop"  # urgent checkpoint, then training stops
    CHECKPOINT = "checkpoint"  # early checkpoint, training goes on
    IGNORE = "ignore"


def event_id_for(provider: str, kind: Kind | str, identity: str) -> str:
    """A stable id for one event.

    ``identity`` must be what stays the same across polls of the same event
    (AWS: the action and its announced time; Azure: ``EventId``; GCP: the
    instance's preemption), never a timestamp taken at poll time.
    """
    digest = hashlib.sha256(f"{provider}\0{kind}\0{identity}".encode()).hexdigest()
    return f"{provider}-{kind}-{digest[:16]}"


def utcnow() -> datetime:
    return datetime.now(UTC)


def _boot_clock() -> int | None:
    """CLOCK_BOOTTIME where the OS has it (Linux), else None."""
    clock: int | None = getattr(time, "CLOCK_BOOTTIME", None)
    if clock is None:
        return None
    try:
        time.clock_gettime(clock)
    except OSError:  # a kernel or sandbox without it
        return None
    return clock


_BOOT_CLOCK = _boot_clock()


def steady_now() -> float:
    """Seconds on the clock a notice's time is counted on: one no step of the wall clock moves, and
    that runs on while the VM is suspended or hibernated (CLOCK_BOOTTIME), where ``time.monotonic()``
    stands still; a VM resumed days after an AWS hibernation notice finds that notice long over, as
    the cloud does. ``time.monotonic()`` where the OS has no such clock."""
    return time.monotonic() if _BOOT_CLOCK is None else time.clock_gettime(_BOOT_CLOCK)


@dataclass(frozen=True)
class Acknowledgement:
    """What the source of a notice must be told once the notice's checkpoint is safe in the bucket.

    Azure's ``StartRequests`` for the event, Auto Scaling's ``CompleteLifecycleAction``: the monitor that
    produced the notice attaches it, as aws-node-termination-handler's interruption events carry their
    post-drain task, so the daemon needs no knowledge of the cloud to send it.

    >>> Acknowledgement("azure: StartRequests for 5D2B...", lambda: monitor.start_requests("5D2B..."))
    """

    description: str  # for the log: what will be sent, to whom
    send: Callable[[], Awaitable[None]]  # raises the monitor's error when it fails


@dataclass(frozen=True)
class Notice:
    provider: str
    kind: Kind
    deadline: datetime
    event_id: str
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False)
    received: datetime = field(default_factory=utcnow, compare=False)
    #: Not part of the event (equality, hash, ``to_dict``): a live handle that no restart carries over.
    acknowledgement: Acknowledgement | None = field(default=None, compare=False, repr=False)
    #: ``deadline`` and ``received`` on :func:`steady_now`'s clock, read against the wall clock once,
    #: when the notice is made. The time left is counted on it: a step of the wall clock during a
    #: race (NTP stepping a clock it found off, a VM thawed after a pause) moves neither the deadline
    #: nor anything decided from it. A notice restored after a restart is read against the wall
    #: clock again, then.
    steady_deadline: float = field(init=False, compare=False, repr=False)
    steady_received: float = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.deadline.tzinfo is None:
            raise ValueError("Notice.deadline must be timezone-aware (UTC)")
        object.__setattr__(self, "kind", Kind(self.kind))
        steady, wall = steady_now(), utcnow()
        object.__setattr__(self, "steady_deadline", steady + (self.deadline - wall).total_seconds())
        object.__setattr__(self, "steady_received", steady + (self.received - wall).total_seconds())

    @property
    def is_hard(self) -> bool:
        return self.kind in HARD_KINDS

    def seconds_left(self, now: datetime | None = None) -> float:
        """Seconds to the deadline: on the steady clock (see :attr:`steady_deadline`), or from
        ``now`` on the wall clock."""
        if now is None:
            return self.steady_deadline - steady_now()
        return (self.deadline - now).total_seconds()

    def seconds_since_received(self) -> float:
        """Seconds since the notice was received, on the steady clock."""
        return steady_now() - self.steady_received

    @property
    def monotonic_deadline(self) -> float:
        """The deadline on ``time.monotonic()``'s clock, which the store's calls and the peer handoff
        count on, as of now (the two clocks part only while the VM is suspended)."""
        return time.monotonic() + self.seconds_left()

    def to_dict(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "kind": str(self.kind),
            "deadline": self.deadline.isoformat(),
            "event_id": self.event_id,
            "received": self.received.isoformat(),
            "raw": json.loads(json.dumps(dict(self.raw), default=str)),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Notice:
        try:
            return cls(
                provider=str(data["provider"]),
                kind=Kind(data["kind"]),
                deadline=parse_iso(str(data["deadline"])),
                event_id=str(data["event_id"]),
                raw=dict(data.get("raw") or {}),
                received=parse_iso(str(data["received"])) if data.get("received") else utcnow(),
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise ValueError(f"not a notice: {exc}") from exc

    @classmethod
    def in_seconds(
        cls, provider: str, kind: Kind, seconds: float, identity: str, raw: Mapping[str, Any] | None = None
    ) -> Notice:
        """A notice whose deadline is ``seconds`` from now (GCP, drills, SIGTERM)."""
        return cls(
            provider=provider,
            kind=kind,
            deadline=utcnow() + timedelta(seconds=seconds),
            event_id=event_id_for(provider, kind, identity),
            raw=raw or {},
        )


# Times a notice's deadline can be. Near the calendar's ends arithmetic on a time (a notice window
# added, a deadline moved to another clock) raises OverflowError far from where it was read: a
# rebalance dated 9999-12-31 ended the AWS monitor's poll with it, hiding a spot notice. The lower
# bound leaves room for a VM whose clock starts at 1970 before it is synchronized.
EARLIEST = datetime(1900, 1, 1, tzinfo=UTC)
LATEST = datetime(9000, 1, 1, tzinfo=UTC)


def plausible_time(value: datetime, text: str) -> datetime:
    """``value`` (read from ``text``), if it lies between :data:`EARLIEST` and :data:`LATEST`; else
    ``ValueError``."""
    if not EARLIEST <= value < LATEST:
        raise ValueError(f"{text[:64]!r} is not a plausible time (years {EARLIEST.year}-{LATEST.year - 1})")
    return value


def parse_iso(text: str) -> datetime:
    """Parse an ISO-8601 time (``Z`` accepted); naive times are taken as UTC. ``ValueError`` for
    anything else, a time outside :func:`plausible_time`'s years included."""
    value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return plausible_time(value if value.tzinfo else value.replace(tzinfo=UTC), text)
