"""What the stall watch keeps per connected trainer stays one notice's worth, however many notices come."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

import pytest

from spotguard.daemon.events import EventBus, TrainerStalled
from spotguard.daemon.server import Peer
from spotguard.daemon.stall import StallWatch
from spotguard.notice import Action, Kind, Notice, utcnow


def test_a_trainer_connected_through_many_notices_keeps_only_the_pending_ones_and_stalls_are_still_found(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="spotguard.daemon")
    trainer = Peer(id=1, pid=4242, uid=0, gid=0, writer=None, hello={"rank": 0})  # type: ignore[arg-type]
    pending: list[tuple[Notice, Action] | None] = [None]
    bus = EventBus()
    reported: list[TrainerStalled] = []
    bus.subscribe(TrainerStalled, reported.append)
    watch = StallWatch(min_seconds=0, fraction=0, trainers=lambda: [trainer], pending=lambda: pending[0], bus=bus)

    async def months_of_rebalances() -> None:
        for number in range(200):
            notice = Notice("aws", Kind.REBALANCE, utcnow() + timedelta(minutes=2), f"aws:rebalance:{number}")
            pending[0] = (notice, Action.CHECKPOINT)
            watch.mark_told([trainer], notice)
            if number % 2:
                watch.acted(trainer, notice.event_id, "committed a checkpoint")
            watch.check()  # the bound is 0 s: a trainer that has not acted is reported at once
            pending[0] = None
            watch.check()

    asyncio.run(months_of_rebalances())
    assert list(trainer.told) == ["aws:rebalance:199"] and trainer.acted == {"aws:rebalance:199"}
    # The even notices went unanswered and were reported; the odd ones were acted on first.
    assert sorted(int(event.report["event_id"].rpartition(":")[2]) for event in reported) == list(range(0, 200, 2))
