"""What the stall watch keeps per connected trainer stays one notice's worth, however many notices come."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

import pytest

from spotguard.daemon.events import EventBus, TrainerStalled
from spotguard.daemon.server import Peer
from spotguard.daemon.stall import STALL_CHECK_INTERVAL, StallWatch
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


def test_the_watch_looks_only_while_a_notice_is_live_and_drops_its_reports_once_it_is_over() -> None:
    """Between notices (a daemon's months) the watch waits for one instead of looking four times a
    second; a notice wakes it, the unacted trainer is reported, and the report goes with the notice."""
    trainer = Peer(id=1, pid=4242, uid=0, gid=0, writer=None, hello={"rank": 0})  # type: ignore[arg-type]
    pending: list[tuple[Notice, Action] | None] = [None]
    looks = [0]

    def what_is_pending() -> tuple[Notice, Action] | None:
        looks[0] += 1
        return pending[0]

    watch = StallWatch(min_seconds=0, fraction=0, trainers=lambda: [trainer], pending=what_is_pending, bus=EventBus())

    async def scenario() -> None:
        stopping, live = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(watch.watch(stopping, live))
        await asyncio.sleep(4 * STALL_CHECK_INTERVAL)
        assert looks[0] == 1  # one look at its start, then it waits for a notice
        notice = Notice("aws", Kind.REBALANCE, utcnow() + timedelta(minutes=2), "aws:rebalance:1")
        pending[0] = (notice, Action.CHECKPOINT)
        watch.mark_told([trainer], notice)
        live.set()
        async with asyncio.timeout(5):
            while not watch.stalled:
                await asyncio.sleep(0.01)
        pending[0] = None
        live.clear()
        async with asyncio.timeout(5):
            while watch.stalled:
                await asyncio.sleep(0.01)
        settled = looks[0]
        await asyncio.sleep(4 * STALL_CHECK_INTERVAL)
        assert looks[0] == settled  # waiting again
        stopping.set()
        live.set()  # the loop sees stopping at its next turn
        await asyncio.wait_for(task, 5)

    asyncio.run(scenario())
