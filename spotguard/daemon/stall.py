"""Trainers told of a notice that do not reach a checkpoint point in time: found, reported once, forgotten."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

from spotguard.daemon.events import EventBus, TrainerStalled
from spotguard.daemon.server import Peer
from spotguard.notice import Action, Notice

logger = logging.getLogger("spotguard.daemon")

STALL_CHECK_INTERVAL = 0.25  # seconds between looks for stalled trainers while a notice is pending


class StallWatch:
    """Which told trainers have not acted on the pending notice within the bound.

    ``trainers`` and ``pending`` are asked on every look: the connected trainers and the notice they
    are told about now (None when none is pending). Each report is told on ``bus`` as a
    :class:`~spotguard.daemon.events.TrainerStalled`.
    """

    def __init__(
        self,
        *,
        min_seconds: float,
        fraction: float,
        trainers: Callable[[], Sequence[Peer]],
        pending: Callable[[], tuple[Notice, Action] | None],
        bus: EventBus,
    ) -> None:
        self.min_seconds = min_seconds
        self.fraction = fraction
        self._trainers = trainers
        self._pending = pending
        self.stalled: dict[int, dict[str, Any]] = {}  # peer id -> its report, while it stays stalled
        self.bus = bus

    def bound(self, notice: Notice) -> float:
        """Seconds a told trainer may take to reach a checkpoint point before it is reported."""
        window = (notice.deadline - notice.received).total_seconds()
        return max(self.min_seconds, self.fraction * window)

    def mark_told(self, peers: Sequence[Peer], notice: Notice) -> None:
        now = asyncio.get_running_loop().time()
        for peer in peers:
            # Only the pending notice's entries are ever read: a trainer connected for months is told
            # of many (rebalances, maintenance, drills), and would keep every one.
            for event_id in peer.told.keys() - {notice.event_id}:
                del peer.told[event_id]
            peer.acted &= {notice.event_id}
            peer.told.setdefault(notice.event_id, now)

    def acted(self, peer: Peer, event_id: str, what: str) -> None:
        peer.acted.add(event_id)
        report = self.stalled.pop(peer.id, None)
        if report is not None and report["event_id"] == event_id:
            waited = asyncio.get_running_loop().time() - peer.told.get(event_id, 0.0)
            logger.warning("trainer pid %d %s after all, %.1f s after it was told", peer.pid, what, waited)

    def forget(self, peer: Peer) -> None:
        self.stalled.pop(peer.id, None)

    def check(self) -> None:
        """Report (once) each trainer told of the pending notice that has not acted on it within the bound."""
        pending = self._pending()
        if pending is None:
            self.stalled.clear()
            return
        notice, action = pending
        now = asyncio.get_running_loop().time()
        bound = self.bound(notice)
        for peer in self._trainers():
            told = peer.told.get(notice.event_id)
            if told is None or notice.event_id in peer.acted or now - told < bound:
                continue
            waited, left = now - told, notice.seconds_left()
            report = self.stalled.get(peer.id)
            if report is not None:
                report.update(seconds=round(waited, 1), deadline_s=round(left, 1))
                continue
            self._report(peer, notice, action, waited=waited, left=left, bound=bound)

    def _report(self, peer: Peer, notice: Notice, action: Action, *, waited: float, left: float, bound: float) -> None:
        message = (
            f"trainer pid {peer.pid} has not reached a checkpoint point for {waited:.0f} s; "
            f"the deadline is in {left:.0f} s"
        )
        report = {
            "pid": peer.pid,
            "rank": peer.hello["rank"] if peer.hello else None,
            "event_id": notice.event_id,
            "seconds": round(waited, 1),
            "bound_s": round(bound, 1),
            "deadline_s": round(left, 1),
            "message": message,
        }
        self.stalled[peer.id] = report
        logger.error(
            "%s (told of %s notice %s; the bound is %.0f s): is the loop calling should_checkpoint?",
            message,
            notice.kind,
            notice.event_id,
            bound,
        )
        self.bus.emit(TrainerStalled(notice, action, report))

    async def watch(self, stopping: asyncio.Event, notice_live: asyncio.Event) -> None:
        """Look every :data:`STALL_CHECK_INTERVAL` while ``notice_live`` is set (a notice is pending
        or held), and once more after it is cleared (the reports go with the notice); between
        notices, wait for it: a daemon spends months without one."""
        while not stopping.is_set():
            self.check()
            await notice_live.wait()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), STALL_CHECK_INTERVAL)
