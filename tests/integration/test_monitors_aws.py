"""AwsMonitor against the real IMDS emulator on 127.0.0.1, with faults."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from spotguard.config import DaemonConfig
from spotguard.daemon.app import Daemon
from spotguard.emulate.aws import iso_z
from spotguard.emulate.common import RunningEmulator
from spotguard.notice import Kind, Notice
from spotguard.providers.aws import V2_RETRY_AFTER, AwsMonitor
from spotguard.providers.base import Monitor, MonitorError
from tests.emulators import (
    FakeClock,
    FakeMonotonic,
    count_requests,
    emulator,
    http_session,
    poll_outcomes,
    raw_http,
    run,
)


def http(method: str, url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    status, _, body = raw_http(method, url, headers)
    return status, body


@pytest.mark.parametrize("ttl", [None, "0", "21601", "abc"])
def test_aws_emulator_rejects_bad_token_ttl(ttl: str | None) -> None:
    with emulator("aws") as emu:
        headers = {} if ttl is None else {"X-aws-ec2-metadata-token-ttl-seconds": ttl}
        status, _ = http("PUT", emu.url + "/latest/api/token", headers)
        assert status == 400


def test_aws_emulator_is_imdsv2_only_unless_told() -> None:
    path = "/latest/meta-data/spot/instance-action"
    with emulator("aws") as emu:
        assert http("GET", emu.url + path)[0] == 401
        assert http("GET", emu.url + path, {"X-aws-ec2-metadata-token": "forged"})[0] == 401
        status, token = http("PUT", emu.url + "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "60"})
        assert status == 200
        assert http("GET", emu.url + path, {"X-aws-ec2-metadata-token": token})[0] == 404
    with emulator("aws", imds_v1=True) as emu:
        assert http("GET", emu.url + path)[0] == 404


def test_aws_monitor_is_a_monitor_and_sees_nothing_before_a_notice() -> None:
    async def scenario() -> None:
        with emulator("aws") as emu:
            async with http_session() as session:
                monitor = AwsMonitor(session, emu.url, interval=0.5, timeout=1.0)
                assert isinstance(monitor, Monitor)
                assert await monitor.check() is None
                assert await monitor.check_all() == []
                puts = [r for r in emu.requests() if r["method"] == "PUT"]
                gets = [r for r in emu.requests() if r["method"] == "GET"]
                assert len(puts) == 1
                assert puts[0]["headers"]["X-aws-ec2-metadata-token-ttl-seconds"] == "21600"
                assert len(gets) == 8
                assert all(g["headers"].get("X-aws-ec2-metadata-token") for g in gets)

    run(scenario())


@pytest.mark.parametrize(("action", "kind"), [("terminate", Kind.TERMINATE), ("stop", Kind.STOP)])
def test_aws_spot_notice_has_announced_deadline_and_stable_id(action: str, kind: Kind) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        with emulator("aws") as emu:
            async with http_session() as session:
                monitor = AwsMonitor(session, emu.url, clock=clock)
                announced = clock() + timedelta(seconds=90)
                emu.trigger(kind="spot", action=action, time=announced.strftime("%Y-%m-%dT%H:%M:%SZ"))
                notices = [await monitor.check() for _ in range(3)]
                assert all(n is not None and n.kind is kind for n in notices)
                assert {n.event_id for n in notices if n} == {notices[0].event_id if notices[0] else ""}
                assert notices[0] is not None
                assert notices[0].deadline == announced.replace(microsecond=0)
                assert notices[0].is_hard

    run(scenario())


@pytest.mark.parametrize(
    ("action", "kind", "deadline"),
    [
        # EC2 promises hibernation no warning time: the untimed window from when it was first seen.
        ("hibernate", Kind.HIBERNATE, datetime(2026, 11, 22, 4, 0, 30, tzinfo=UTC)),
        # EC2 announces the others two minutes ahead: a "time" years away says this VM's clock is behind
        # EC2's, and a plan counting on it would choose a route that cannot make the real deadline.
        ("terminate", Kind.TERMINATE, datetime(2026, 11, 22, 4, 2, tzinfo=UTC)),
    ],
)
def test_aws_spot_deadline_far_off_is_bounded_from_first_seen_and_does_not_drift(
    action: str, kind: Kind, deadline: datetime
) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        with emulator("aws") as emu:
            async with http_session() as session:
                monitor = AwsMonitor(session, emu.url, clock=clock)
                emu.trigger(kind="spot", action=action, time="2099-01-01T00:00:00Z")
                first = await monitor.check()
                clock.advance(7)
                second = await monitor.check()
                assert first is not None and second is not None
                assert first.kind is kind
                assert first.deadline == second.deadline == deadline
                assert first.event_id == second.event_id

    run(scenario())


def test_aws_check_returns_hard_before_soft_and_check_all_lists_all() -> None:
    async def scenario() -> None:
        with emulator("aws") as emu:
            async with http_session() as session:
                monitor = AwsMonitor(session, emu.url)
                emu.trigger(kind="rebalance", time="2030-01-01T00:00:00Z")
                emu.trigger(kind="maintenance", event_id="instance-event-0d59937288b749b32", **{"in": 60})
                soft = await monitor.check_all()
                # Both soft: the earlier deadline first (maintenance in 60 s, the rebalance years away).
                assert [n.kind for n in soft] == [Kind.MAINTENANCE, Kind.REBALANCE]
                assert not any(n.is_hard for n in soft)
                emu.trigger(kind="spot", action="terminate", time="2031-01-01T00:00:00Z")
                emu.trigger(kind="lifecycle", state="Terminated")
                every = await monitor.check_all()
                assert len(every) == 4
                assert [n.is_hard for n in every] == [True, True, False, False]
                top = await monitor.check()
                assert top is not None and top.event_id == every[0].event_id

    run(scenario())


def test_aws_rebalance_and_maintenance_ids_come_from_the_event() -> None:
    async def scenario() -> None:
        with emulator("aws") as emu:
            async with http_session() as session:
                monitor = AwsMonitor(session, emu.url)
                emu.trigger(kind="maintenance", event_id="instance-event-1", **{"in": 3600})
                first = await monitor.check()
                # The same event re-announced with another time keeps its id (it is the same event).
                emu.trigger(kind="maintenance", event_id="instance-event-1", **{"in": 7200})
                moved = await monitor.check()
                assert first is not None and moved is not None
                assert first.kind is Kind.MAINTENANCE
                assert first.event_id == moved.event_id
                assert moved.deadline > first.deadline

    run(scenario())


@pytest.mark.parametrize("state", ["completed", "canceled"])
def test_aws_ignores_finished_maintenance(state: str) -> None:
    async def scenario() -> None:
        with emulator("aws") as emu:
            async with http_session() as session:
                monitor = AwsMonitor(session, emu.url)
                emu.trigger(kind="maintenance", event_id="instance-event-2", state=state)
                assert await monitor.check() is None

    run(scenario())


def test_aws_lifecycle_inservice_is_nothing_terminated_is_hard() -> None:
    async def scenario() -> None:
        with emulator("aws") as emu:
            async with http_session() as session:
                monitor = AwsMonitor(session, emu.url)
                emu.trigger(kind="lifecycle", state="Warmed:Stopped")
                assert await monitor.check() is None
                emu.trigger(kind="lifecycle", state="Terminated")
                notice = await monitor.check()
                assert notice is not None and notice.kind is Kind.TERMINATE

    run(scenario())


def test_aws_monitor_refreshes_token_on_401() -> None:
    async def scenario() -> None:
        with emulator("aws") as emu:
            async with http_session() as session:
                monitor = AwsMonitor(session, emu.url)
                assert await monitor.check() is None
                emu.control("POST", "expire-tokens", {})
                emu.trigger(kind="spot", action="terminate")
                notice = await monitor.check()
                assert notice is not None and notice.kind is Kind.TERMINATE
                assert count_requests(emu, "PUT", "/latest/api/token") == 2

    run(scenario())


def test_aws_monitor_refreshes_token_before_it_expires() -> None:
    async def scenario() -> None:
        monotonic = FakeMonotonic()
        with emulator("aws") as emu:
            async with http_session() as session:
                monitor = AwsMonitor(session, emu.url, token_ttl=600, monotonic=monotonic)
                await monitor.check()
                monotonic.now += 500  # 100 s left: still more than the 60 s margin
                await monitor.check()
                assert count_requests(emu, "PUT", "token") == 1
                monotonic.now += 50  # 50 s left: renew now rather than risk a 401 mid-incident
                await monitor.check()
                assert count_requests(emu, "PUT", "token") == 2
                # Renewed ahead of time: no request was refused and retried (3 polls x 4 paths).
                assert count_requests(emu, "GET", "/latest/meta-data/") == 12

    run(scenario())


def test_aws_no_silent_imdsv1_fallback() -> None:
    async def scenario() -> None:
        with emulator("aws", imds_v1=True) as emu:
            emu.inject({"kind": "status", "status": 403, "path": "/latest/api/token"})
            emu.trigger(kind="spot", action="terminate")
            async with http_session() as session:
                strict = AwsMonitor(session, emu.url)
                with pytest.raises(MonitorError, match="IMDSv2 token"):
                    await strict.check()
                assert count_requests(emu, "GET", "/latest/meta-data/") == 0
                lenient = AwsMonitor(session, emu.url, imds_v1_fallback=True)
                notice = await lenient.check()
                assert notice is not None and notice.kind is Kind.TERMINATE
                gets = [r for r in emu.requests() if r["method"] == "GET"]
                assert gets and not any("X-aws-ec2-metadata-token" in r["headers"] for r in gets)

    run(scenario())


def test_aws_monitor_garbage_body_is_error_not_notice() -> None:
    async def scenario() -> None:
        with emulator("aws") as emu:
            async with http_session() as session:
                monitor = AwsMonitor(session, emu.url)
                for path in ("instance-action", "rebalance", "maintenance/scheduled", "target-lifecycle-state"):
                    emu.inject({"kind": "garbage", "count": 1, "path": path})
                    with pytest.raises(MonitorError, match="aws: reading"):
                        await monitor.check()
                emu.inject({"kind": "garbage", "count": 1, "path": "/latest/api/token"})
                emu.control("POST", "expire-tokens", {})
                with pytest.raises(MonitorError, match="token"):
                    await monitor.check()
                assert await monitor.check() is None

    run(scenario())


def test_aws_a_hostile_answer_on_one_path_hides_no_notice_on_another() -> None:
    """A rebalance dated at the calendar's end (its deadline overflowed) and a maintenance answer
    nested 20,000 deep (RecursionError) used to end the whole poll, the spot notice beside them with it."""
    hostile = {
        "rebalance": '{"noticeTime": "9999-12-31T23:59:59Z"}',
        "maintenance/scheduled": "[" * 20_000 + "]" * 20_000,
        "target-lifecycle-state": "Terminated" * 10,
    }

    async def scenario() -> None:
        with emulator("aws") as emu:
            async with http_session() as session:
                monitor = AwsMonitor(session, emu.url)
                emu.trigger(kind="spot", action="terminate")
                emu.inject(*({"kind": "garbage", "path": path, "body": body} for path, body in hostile.items()))
                notices = await monitor.check_all()
                assert [(n.kind, n.raw.get("instance-action", {}).get("action")) for n in notices] == [
                    (Kind.TERMINATE, "terminate")
                ]
                # The same answers with no notice beside them are the monitor's error, not a crash.
                emu.clear()
                with pytest.raises(MonitorError, match="aws: reading"):
                    await monitor.check_all()

    run(scenario())


def test_aws_timeouts_5xx_and_dropped_connections_are_errors() -> None:
    async def scenario() -> None:
        with emulator("aws") as emu:
            async with http_session() as session:
                monitor = AwsMonitor(session, emu.url, timeout=0.2)
                await monitor.check()  # token in hand
                emu.inject({"kind": "latency", "seconds": 0.5, "count": 1, "path": "instance-action"})
                with pytest.raises(MonitorError, match="spot/instance-action") as timed_out:
                    await monitor.check()
                assert isinstance(timed_out.value.__cause__, TimeoutError)
                emu.inject({"kind": "status", "status": 500, "count": 1, "path": "rebalance"})
                with pytest.raises(MonitorError, match="HTTP 500"):
                    await monitor.check()
                # aiohttp retries an idempotent request once on a dropped keep-alive connection, so drop two.
                emu.inject({"kind": "drop", "count": 2, "path": "scheduled"})
                with pytest.raises(MonitorError, match="maintenance/scheduled"):
                    await monitor.check()
                assert await monitor.check() is None

    run(scenario())


def test_aws_error_on_one_path_does_not_hide_a_notice_on_another() -> None:
    async def scenario() -> None:
        with emulator("aws") as emu:
            async with http_session() as session:
                monitor = AwsMonitor(session, emu.url)
                emu.trigger(kind="spot", action="terminate")
                emu.inject({"kind": "status", "status": 500, "path": "rebalance"})
                notice = await monitor.check()
                assert notice is not None and notice.kind is Kind.TERMINATE

    run(scenario())


def test_aws_fault_mix_no_notice_before_same_id_after() -> None:
    faults = [
        {"kind": "status", "status": 500, "count": 3},
        {"kind": "status", "status": 503, "count": 2, "path": "instance-action"},
        {"kind": "garbage", "count": 3, "path": "instance-action"},
        {"kind": "drop", "count": 2, "path": "instance-action"},
        {"kind": "latency", "seconds": 0.4, "count": 2, "path": "instance-action"},
    ]

    async def scenario() -> None:
        with emulator("aws") as emu:
            async with http_session() as session:
                monitor = AwsMonitor(session, emu.url, timeout=0.2)
                emu.inject(*faults)
                before = await poll_outcomes(monitor.check, 8)
                emu.control("POST", "expire-tokens", {})
                before += await poll_outcomes(monitor.check, 4)
                assert "error" in before
                assert not [o for o in before if o not in (None, "error")]

                emu.trigger(kind="spot", action="terminate")
                emu.inject(*faults)
                after = await poll_outcomes(monitor.check, 8)
                emu.control("POST", "expire-tokens", {})
                after += await poll_outcomes(monitor.check, 4)
                notices = [o for o in after if o not in (None, "error")]
                assert "error" in after
                assert None not in after
                assert len(notices) >= 3
                assert len({n.event_id for n in notices if not isinstance(n, str) and n}) == 1

    run(scenario())


def test_aws_imdsv1_fallback_goes_back_to_tokens_once_they_can_be_had() -> None:
    """With the fallback allowed, one failed token request must not keep the daemon on IMDSv1 for the
    months it runs: a token is asked for again after ``V2_RETRY_AFTER`` seconds, and used once had."""

    def tokened_gets(emu: RunningEmulator) -> int:
        gets = [r for r in emu.requests() if r["method"] == "GET"]
        return sum(1 for r in gets if "X-aws-ec2-metadata-token" in r["headers"])

    async def scenario() -> None:
        monotonic = FakeMonotonic()
        with emulator("aws", imds_v1=True) as emu:
            emu.inject({"kind": "status", "status": 403, "path": "/latest/api/token", "count": 1})
            async with http_session() as session:
                monitor = AwsMonitor(session, emu.url, imds_v1_fallback=True, monotonic=monotonic)
                assert await monitor.check() is None  # on IMDSv1: the one token request failed
                assert count_requests(emu, "PUT", "token") == 1 and tokened_gets(emu) == 0
                monotonic.now += V2_RETRY_AFTER - 1
                assert await monitor.check() is None
                assert count_requests(emu, "PUT", "token") == 1 and tokened_gets(emu) == 0  # not yet
                monotonic.now += 2
                emu.trigger(kind="spot", action="terminate")
                notice = await monitor.check()
                assert notice is not None and notice.kind is Kind.TERMINATE
                assert count_requests(emu, "PUT", "token") == 2 and tokened_gets(emu) > 0

    run(scenario())


def test_a_rebalance_recommendation_is_acted_on_once_and_never_again_once_a_day_old(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """EC2 keeps a rebalance recommendation in the metadata for the instance's life. The event log
    forgets a notice a day past its deadline, and the daemon used to act on the same recommendation
    again then: after every restart, and after any other notice recorded (a drill here)."""

    def daemon() -> Daemon:
        config = DaemonConfig(
            provider="aws", socket=tmp_path / "s.sock", checkpoint_dir=tmp_path / "nvme", state_dir=tmp_path / "state"
        )
        return Daemon(config, provider="aws")

    async def acted(monitor: AwsMonitor, on: Daemon) -> list[bool]:
        return [await on.on_notice(n) for n in await monitor.check_all()]

    async def scenario() -> None:
        with emulator("aws") as emu:
            async with http_session() as session:
                monitor = AwsMonitor(session, emu.url)
                recent = iso_z(datetime.now(UTC) - timedelta(hours=23))
                emu.trigger(kind="rebalance", time=recent)
                first = daemon()
                try:
                    assert await acted(monitor, first) == [True]
                    assert await acted(monitor, first) == [False]
                finally:
                    first.events.close()
                restarted = daemon()
                try:
                    assert await acted(monitor, restarted) == [False]  # the log remembers it
                finally:
                    restarted.events.close()

                day_old = iso_z(datetime.now(UTC) - timedelta(hours=26))
                emu.trigger(kind="rebalance", time=day_old)  # what the log has forgotten by now
                for _ in range(2):
                    again = daemon()
                    try:
                        assert await acted(monitor, again) == [False]
                        assert await again.on_notice(Notice.in_seconds("none", Kind.DRILL, 60, f"drill-{_}")) is True
                        assert await acted(monitor, again) == [False]
                        assert again.last_notice is not None and again.last_notice["kind"] == "drill"
                    finally:
                        again.events.close()

    with caplog.at_level(logging.INFO, logger="spotguard.daemon"):
        run(scenario())
    said = [r.getMessage() for r in caplog.records if "not acted on" in r.getMessage()]
    assert len(said) == 2, said  # once per daemon (each restart says it once), not at every poll
    assert all("rebalance" in line and "h past" in line for line in said), said
