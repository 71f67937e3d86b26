"""GcpMonitor against the real GCE metadata emulator on 127.0.0.1: long-polls, ETags, faults."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import pytest

from spotguard.emulate.common import RunningEmulator
from spotguard.notice import Kind, Notice
from spotguard.providers.base import Monitor, MonitorError
from spotguard.providers.gcp import GcpMonitor
from tests.emulators import (
    FakeClock,
    emulator,
    eventually,
    http_session,
    poll_outcomes,
    raw_http,
    run,
)

INSTANCE = "/computeMetadata/v1/instance/"


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
    return raw_http("GET", url, headers)


def test_gcp_emulator_requires_flavor_and_answers_etags() -> None:
    with emulator("gcp") as emu:
        assert get(emu.url + INSTANCE + "preempted")[0] == 403
        status, headers, body = get(emu.url + INSTANCE + "preempted", {"Metadata-Flavor": "Google"})
        assert (status, body, headers["Metadata-Flavor"]) == (200, "FALSE", "Google")
        assert headers["ETag"]
        _, _, event = get(emu.url + INSTANCE + "maintenance-event", {"Metadata-Flavor": "Google"})
        assert event == "NONE"


def test_gcp_emulator_wait_for_change_times_out_with_the_same_value() -> None:
    with emulator("gcp") as emu:
        url = emu.url + INSTANCE + "preempted"
        _, headers, _ = get(url, {"Metadata-Flavor": "Google"})
        started = time.monotonic()
        status, again, body = get(
            f"{url}?wait_for_change=true&last_etag={headers['ETag']}&timeout_sec=1", {"Metadata-Flavor": "Google"}
        )
        assert time.monotonic() - started >= 0.9
        assert (status, body, again["ETag"]) == (200, "FALSE", headers["ETag"])
        # A stale ETag answers at once.
        started = time.monotonic()
        assert get(f"{url}?wait_for_change=true&last_etag=stale&timeout_sec=5", {"Metadata-Flavor": "Google"})[0] == 200
        assert time.monotonic() - started < 1


async def start_long_poll(monitor: GcpMonitor, emu: RunningEmulator) -> asyncio.Task[Notice | None]:
    """Start ``check`` and return once the emulator holds its long-poll."""
    task = asyncio.create_task(monitor.check())
    await eventually(lambda: emu.state()["waiting"] == 1 or task.done(), timeout=5)
    assert not task.done(), "check() returned instead of long-polling"
    return task


def test_gcp_first_check_is_immediate_then_long_polls_to_a_preemption() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        with emulator("gcp") as emu:
            async with http_session() as session:
                monitor = GcpMonitor(session, emu.url, long_poll_timeout=10, clock=clock, boot_id="boot-1")
                assert isinstance(monitor, Monitor)
                assert monitor.interval == 0
                assert await monitor.check() is None
                task = await start_long_poll(monitor, emu)
                emu.trigger(preempted=True)
                notice = await task
                assert notice is not None and notice.kind is Kind.TERMINATE and notice.is_hard
                assert notice.deadline == clock.now + timedelta(seconds=30)
                long_polls = [r for r in emu.requests() if r["query"].get("wait_for_change") == "true"]
                assert long_polls and long_polls[0]["query"]["last_etag"]
                assert long_polls[0]["query"]["recursive"] == "true"
                assert long_polls[0]["query"]["timeout_sec"] == "10"
                assert all(r["headers"].get("Metadata-Flavor") == "Google" for r in emu.requests())

    run(scenario())


def test_gcp_long_poll_sees_flip_within_150ms() -> None:
    async def scenario() -> None:
        with emulator("gcp") as emu:
            async with http_session() as session:
                monitor = GcpMonitor(session, emu.url, long_poll_timeout=10)
                await monitor.check()
                latencies = []
                for flip in range(100):
                    task = await start_long_poll(monitor, emu)
                    started = time.monotonic()
                    emu.trigger(preempted=flip % 2 == 0)
                    notice = await task
                    latencies.append(time.monotonic() - started)
                    assert (notice is not None) == (flip % 2 == 0)
                latencies.sort()
                # p99 of 100 flips (the typical flip takes 1-5 ms on loopback); the max is bounded
                # loosely so one scheduler hiccup on a busy shared box does not fail the suite.
                assert latencies[98] < 0.150, latencies
                assert latencies[-1] < 1.0, latencies

    run(scenario())


def test_gcp_change_between_polls_is_not_missed() -> None:
    async def scenario() -> None:
        with emulator("gcp") as emu:
            async with http_session() as session:
                monitor = GcpMonitor(session, emu.url, long_poll_timeout=30)
                assert await monitor.check() is None
                emu.trigger(preempted=True)  # while no long-poll is in flight
                started = time.monotonic()
                notice = await monitor.check()
                assert notice is not None and notice.kind is Kind.TERMINATE
                assert time.monotonic() - started < 1

    run(scenario())


def test_gcp_notice_repeats_with_same_id_and_deadline_across_polls_and_restarts() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        with emulator("gcp") as emu:
            emu.trigger(preempted=True)
            async with http_session() as session:
                monitor = GcpMonitor(session, emu.url, long_poll_timeout=1, clock=clock, boot_id="boot-1")
                first = await monitor.check()
                clock.advance(5)
                second = await monitor.check()  # long-poll times out, state unchanged
                assert first is not None and second is not None
                assert (first.event_id, first.deadline) == (second.event_id, second.deadline)
                restarted = GcpMonitor(session, emu.url, clock=clock, boot_id="boot-1")
                again = await restarted.check()
                assert again is not None and again.event_id == first.event_id
                next_boot = GcpMonitor(session, emu.url, clock=clock, boot_id="boot-2")
                other = await next_boot.check()
                assert other is not None and other.event_id != first.event_id

    run(scenario())


@pytest.mark.parametrize(
    ("value", "terminates"), [("MIGRATE_ON_HOST_MAINTENANCE", False), ("TERMINATE_ON_HOST_MAINTENANCE", True)]
)
def test_gcp_maintenance_event_is_soft_and_says_whether_it_terminates(value: str, terminates: bool) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        with emulator("gcp") as emu:
            emu.trigger(maintenance_event=value)
            async with http_session() as session:
                monitor = GcpMonitor(session, emu.url, clock=clock)
                notice = await monitor.check()
                assert notice is not None and notice.kind is Kind.MAINTENANCE and not notice.is_hard
                assert notice.raw["terminates"] is terminates
                assert notice.deadline == clock.now + timedelta(seconds=60)
                emu.trigger(preempted=True)
                both = await monitor.check_all()
                assert [n.kind for n in both] == [Kind.TERMINATE, Kind.MAINTENANCE]

    run(scenario())


def test_gcp_monitor_rejects_response_without_metadata_flavor() -> None:
    async def scenario() -> None:
        with emulator("gcp") as emu:
            emu.trigger(preempted=True)
            emu.inject({"kind": "no_flavor", "count": 1})
            async with http_session() as session:
                monitor = GcpMonitor(session, emu.url, interval=0.01)
                with pytest.raises(MonitorError, match="Metadata-Flavor"):
                    await monitor.check()
                notice = await monitor.check()
                assert notice is not None and notice.kind is Kind.TERMINATE

    run(scenario())


def test_gcp_503_is_retried_after_a_pause() -> None:
    async def scenario() -> None:
        with emulator("gcp") as emu:
            emu.inject({"kind": "status", "status": 503, "count": 2})
            async with http_session() as session:
                monitor = GcpMonitor(session, emu.url, retry_delay=0.05, max_retries=3)
                started = time.monotonic()
                assert await monitor.check() is None
                assert time.monotonic() - started >= 0.1
                assert sum(1 for r in emu.requests() if r["path"] == INSTANCE) == 3
                emu.inject({"kind": "status", "status": 503, "count": 4})
                with pytest.raises(MonitorError, match="HTTP 503"):
                    await monitor.check()

    run(scenario())


def test_gcp_garbage_timeouts_and_drops_are_errors_not_notices() -> None:
    async def scenario() -> None:
        with emulator("gcp") as emu:
            async with http_session() as session:
                monitor = GcpMonitor(session, emu.url, interval=0.01, timeout=0.2, long_poll=False)
                emu.inject({"kind": "garbage", "count": 1})
                with pytest.raises(MonitorError, match=r"not UTF-8|not JSON"):
                    await monitor.check()
                emu.inject({"kind": "latency", "seconds": 0.5, "count": 1})
                with pytest.raises(MonitorError, match="gcp: reading instance/"):
                    await monitor.check()
                emu.inject({"kind": "drop", "count": 2})
                with pytest.raises(MonitorError, match="gcp: reading instance/"):
                    await monitor.check()
                emu.inject({"kind": "status", "status": 500, "count": 1})
                with pytest.raises(MonitorError, match="HTTP 500"):
                    await monitor.check()
                assert await monitor.check() is None

    run(scenario())


def test_gcp_fault_mix_no_notice_before_same_id_after() -> None:
    faults = [
        {"kind": "status", "status": 503, "count": 5},  # more than the retries: an error
        {"kind": "status", "status": 503, "count": 1},  # retried: a good answer
        {"kind": "garbage", "count": 1},
        {"kind": "no_flavor", "count": 1},
        {"kind": "drop", "count": 2},
        {"kind": "status", "status": 500, "count": 1},
    ]

    async def poll_through_faults(
        monitor: GcpMonitor, emu: RunningEmulator, clean_polls: int
    ) -> list[Notice | str | None]:
        outcomes: list[Notice | str | None] = []
        for fault in faults:
            emu.inject(fault)
            outcomes += await poll_outcomes(monitor.check, 1)
        emu.clear_faults()
        # Clean long-polls on an unchanged state each last timeout_sec (1 s): keep them few.
        return outcomes + await poll_outcomes(monitor.check, clean_polls)

    async def scenario() -> None:
        with emulator("gcp") as emu:
            async with http_session() as session:
                monitor = GcpMonitor(
                    session, emu.url, interval=0.01, timeout=0.2, long_poll_timeout=1, retry_delay=0.01
                )
                before = await poll_through_faults(monitor, emu, clean_polls=1)
                assert before.count("error") >= 4
                assert not [o for o in before if o not in (None, "error")]
                emu.trigger(preempted=True)
                after = await poll_through_faults(monitor, emu, clean_polls=2)
                notices = [o for o in after if isinstance(o, Notice)]
                assert after.count("error") >= 4 and None not in after
                assert len(notices) >= 3
                assert len({n.event_id for n in notices}) == 1

    run(scenario())


def test_the_maintenance_key_is_read_on_its_own_at_the_first_check_and_after_each_event() -> None:
    """GCE gives its 60 s maintenance warning only to a VM that read ``maintenance-event`` itself since
    the last event; the monitor's one recursive long-poll is not documented to count."""

    def direct_reads(emu: RunningEmulator) -> int:
        return sum(1 for r in emu.requests() if r["path"].endswith("/instance/maintenance-event"))

    async def scenario() -> None:
        with emulator("gcp") as emu:
            async with http_session() as session:
                monitor = GcpMonitor(session, emu.url, long_poll_timeout=10, boot_id="boot-1")
                assert await monitor.check() is None
                assert direct_reads(emu) == 1
                for value in ("MIGRATE_ON_HOST_MAINTENANCE", "NONE"):
                    task = await start_long_poll(monitor, emu)
                    emu.trigger(maintenance_event=value)
                    await task
                assert direct_reads(emu) == 2  # at the first check, then once the event had ended
                task = await start_long_poll(monitor, emu)
                emu.trigger(preempted=True)
                assert (await task) is not None
                assert direct_reads(emu) == 2  # not at every check, and never beside a notice
                reads = [r for r in emu.requests() if r["path"].endswith("/instance/maintenance-event")]
                assert all(r["headers"].get("Metadata-Flavor") == "Google" for r in reads)

    run(scenario())


def test_a_failed_read_of_the_maintenance_key_fails_no_check() -> None:
    async def scenario() -> None:
        with emulator("gcp") as emu:
            emu.inject({"kind": "status", "status": 500, "count": 1, "path": "maintenance-event"})
            async with http_session() as session:
                monitor = GcpMonitor(session, emu.url, long_poll_timeout=10, boot_id="boot-1")
                assert await monitor.check() is None
                emu.trigger(preempted=True)
                notice = await monitor.check()
                assert notice is not None and notice.kind is Kind.TERMINATE

    run(scenario())
