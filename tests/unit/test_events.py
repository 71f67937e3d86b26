"""The daemon's event stream: who is told, in which order, and what a failing observer costs."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from spotguard.daemon.events import (
    Event,
    EventBus,
    MonitorFailed,
    NoticeMoved,
    NoticeSeen,
    PlanChanged,
    SaveFailed,
    UploadFailed,
)
from spotguard.daemon.notices import EventLog, NoticeBook
from spotguard.daemon.plan import Planner
from spotguard.notice import Action, Kind, Notice


def drill(identity: str = "x") -> Notice:
    return Notice.in_seconds("none", Kind.DRILL, 30.0, identity=identity)


def test_observers_are_told_in_subscription_order_and_only_of_their_kind() -> None:
    bus = EventBus()
    told: list[str] = []
    bus.subscribe(SaveFailed, lambda e: told.append(f"first {e.failure['step']}"))
    bus.subscribe(MonitorFailed, lambda e: told.append(f"monitor {e.monitor}"))
    bus.subscribe(Event, lambda e: told.append(f"all {type(e).__name__}"))
    bus.subscribe(SaveFailed, lambda e: told.append(f"last {e.failure['step']}"))
    bus.emit(SaveFailed({"step": 3}))
    assert told == ["first 3", "all SaveFailed", "last 3"]
    told.clear()
    bus.emit(MonitorFailed("aws", RuntimeError("timeout")))
    assert told == ["monitor aws", "all MonitorFailed"]


def test_a_failing_observer_is_logged_and_the_others_are_still_told(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="spotguard.daemon")
    bus = EventBus()
    told: list[str] = []

    def broken(event: UploadFailed) -> None:
        raise KeyError("bug in an observer")

    bus.subscribe(UploadFailed, lambda e: told.append("before"))
    bus.subscribe(UploadFailed, broken)
    bus.subscribe(UploadFailed, lambda e: told.append("after"))
    bus.emit(UploadFailed("step-000000007", OSError("reset")))  # the emitter never sees the KeyError
    assert told == ["before", "after"]
    failed = [r for r in caplog.records if "an observer failed" in r.getMessage()]
    assert len(failed) == 1
    assert "UploadFailed of step-000000007" in failed[0].getMessage()
    assert failed[0].exc_info is not None and isinstance(failed[0].exc_info[1], KeyError)


def test_emit_async_finishes_each_observer_before_the_next(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="spotguard.daemon")
    notice = drill()

    async def scenario() -> list[str]:
        bus = EventBus()
        told: list[str] = []
        gate = asyncio.Event()
        started = asyncio.Event()

        async def slow(event: NoticeSeen) -> None:
            told.append("slow started")
            started.set()
            await gate.wait()
            told.append("slow done")

        async def failing(event: NoticeSeen) -> None:
            await asyncio.sleep(0)
            raise RuntimeError("webhook bug")

        bus.subscribe(NoticeSeen, slow)
        bus.subscribe(NoticeSeen, failing)
        bus.subscribe(NoticeSeen, lambda e: told.append(f"plain {e.notice.event_id}"))
        emitting = asyncio.create_task(bus.emit_async(NoticeSeen(notice, Action.STOP)))
        await asyncio.wait_for(started.wait(), 5)
        assert told == ["slow started"]  # the next observer waits for this one
        gate.set()
        await asyncio.wait_for(emitting, 5)
        return told

    assert asyncio.run(scenario()) == ["slow started", "slow done", f"plain {notice.event_id}"]
    assert any(f"NoticeSeen of {notice.event_id}" in r.getMessage() for r in caplog.records)


def test_emit_from_plain_code_runs_a_coroutine_observer_on_the_loop(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="spotguard.daemon")

    async def scenario() -> list[str]:
        bus = EventBus()
        told: list[str] = []
        done = asyncio.Event()

        async def later(event: SaveFailed) -> None:
            told.append("coroutine")
            done.set()

        async def broken(event: SaveFailed) -> None:
            raise ValueError("broken observer")

        bus.subscribe(SaveFailed, later)
        bus.subscribe(SaveFailed, broken)
        bus.subscribe(SaveFailed, lambda e: told.append("plain"))
        bus.emit(SaveFailed({"step": 1}))
        assert told == ["plain"]  # the coroutine runs as a task, after emit() returned
        await asyncio.wait_for(done.wait(), 5)
        for _ in range(10):  # let the broken task finish and log
            await asyncio.sleep(0)
        return told

    assert asyncio.run(scenario()) == ["plain", "coroutine"]
    assert [r.exc_info[1].__class__ for r in caplog.records if r.exc_info] == [ValueError]


def test_the_services_emit_on_the_bus_they_are_given(tmp_path: Path) -> None:
    bus = EventBus()
    told: list[str] = []
    bus.subscribe(NoticeMoved, lambda e: told.append(f"moved {e.old}->{e.tracked.state}"))
    bus.subscribe(PlanChanged, lambda e: told.append(f"plan {e.plan.route}"))
    book = NoticeBook(EventLog(tmp_path / "state", tmp_path / "root"), grace=0.0, bus=bus)
    planner = Planner(bus=bus)
    notice = drill("y")
    book.open(notice, Action.CHECKPOINT)
    planner.plan(notice)
    book.checkpointed(notice.event_id, saved_step=4)
    assert told == ["plan bucket", "moved pending->over"]


def test_a_failing_observer_of_the_daemon_does_not_keep_metrics_from_a_notice(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from prometheus_client import CollectorRegistry

    from spotguard.config import DaemonConfig
    from spotguard.daemon.app import Daemon
    from spotguard.daemon.metrics import DaemonMetrics

    caplog.set_level(logging.ERROR, logger="spotguard.daemon")
    config = DaemonConfig(
        provider="none", socket=tmp_path / "s.sock", checkpoint_dir=tmp_path / "nvme", state_dir=tmp_path / "state"
    )
    daemon = Daemon(config, provider="none")

    def broken(event: NoticeSeen) -> None:
        raise RuntimeError("observer bug")

    daemon.bus.subscribe(NoticeSeen, broken)  # before metrics: they must still be told
    registry = CollectorRegistry()
    DaemonMetrics(registry).attach(daemon)
    notice = drill("z")
    try:
        assert asyncio.run(daemon.on_notice(notice)) is True
    finally:
        daemon.events.close()
    labels = {"provider": "none", "kind": str(Kind.DRILL), "action": str(daemon.action_for(notice))}
    assert registry.get_sample_value("spotguard_notices_total", labels) == 1
    assert daemon.last_notice is not None and daemon.last_notice["event_id"] == notice.event_id
    assert any(f"NoticeSeen of {notice.event_id}" in r.getMessage() for r in caplog.records)
