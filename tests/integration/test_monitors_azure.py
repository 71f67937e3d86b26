"""AzureMonitor against the real Scheduled Events emulator on 127.0.0.1, with faults."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime, timedelta

import pytest

from spotguard.notice import Kind, Notice
from spotguard.providers.azure import AzureMonitor
from spotguard.providers.base import Monitor, MonitorError
from tests.emulators import (
    FakeClock,
    count_requests,
    emulator,
    eventually,
    http_session,
    poll_outcomes,
    raw_http,
    run,
)

EVENTS = "/metadata/scheduledevents?api-version=2020-07-01"


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    status, _, body = raw_http("GET", url, headers)
    return status, body


def test_azure_emulator_requires_metadata_header_and_bumps_incarnation() -> None:
    with emulator("azure") as emu:
        assert get(emu.url + EVENTS)[0] == 400
        assert get(emu.url + "/metadata/scheduledevents", {"Metadata": "true"})[0] == 400
        status, body = get(emu.url + EVENTS, {"Metadata": "true"})
        assert status == 200
        first = json.loads(body)
        assert first["Events"] == []
        emu.trigger(type="Reboot")
        second = json.loads(get(emu.url + EVENTS, {"Metadata": "true"})[1])
        assert second["DocumentIncarnation"] == first["DocumentIncarnation"] + 1
        assert second["Events"][0]["EventType"] == "Reboot"


def test_azure_preempt_is_hard_with_not_before_deadline_and_stable_id() -> None:
    async def scenario() -> None:
        with emulator("azure") as emu:
            async with http_session() as session:
                monitor = AzureMonitor(session, emu.url, vm_name="spotguard-vm")
                assert isinstance(monitor, Monitor)
                assert await monitor.check() is None
                event = emu.trigger(type="Preempt", event_id="F0E1D2C3-0000-4000-8000-000000000001", **{"in": 30})
                notices = [await monitor.check() for _ in range(3)]
                assert all(n is not None and n.kind is Kind.TERMINATE for n in notices)
                assert len({n.event_id for n in notices if n}) == 1
                first = notices[0]
                assert first is not None
                assert first.deadline.strftime("%a, %d %b %Y %H:%M:%S GMT") == event["NotBefore"]
                assert first.raw["EventId"] == "F0E1D2C3-0000-4000-8000-000000000001"

    run(scenario())


def test_a_date_header_hours_in_the_past_gives_a_preemption_no_more_than_its_30_seconds() -> None:
    """Azure's Date header two hours behind its own NotBefore (a proxy's, a broken host's clock) reads
    as this VM's clock two hours ahead. Moved by that much, a spot eviction's NotBefore gave the plan
    two hours; Azure gives a Preempt 30 s, counted from when the event is first seen."""

    async def scenario() -> None:
        with emulator("azure") as emu:
            emu.inject({"kind": "skew", "seconds": 7200})
            async with http_session() as session:
                monitor = AzureMonitor(session, emu.url, vm_name="spotguard-vm")
                assert await monitor.check() is None  # the first answer measures the lead
                emu.trigger(type="Preempt", **{"in": 30})
                notice = await monitor.check()
                assert notice is not None and notice.kind is Kind.TERMINATE
                assert 25 < notice.seconds_left() <= 30
                emu.trigger(type="Reboot", **{"in": 300})
                reboot = [n for n in await monitor.check_all() if n.kind is Kind.MAINTENANCE]
                assert len(reboot) == 1 and 14 * 60 < reboot[0].seconds_left() <= 15 * 60  # its longest notice

    run(scenario())


@pytest.mark.parametrize(
    ("event_type", "kind"),
    [
        ("Terminate", Kind.TERMINATE),
        ("Reboot", Kind.MAINTENANCE),
        ("Redeploy", Kind.MAINTENANCE),
        ("Freeze", Kind.MAINTENANCE),
    ],
)
def test_azure_event_types_map_to_kinds(event_type: str, kind: Kind) -> None:
    async def scenario() -> None:
        with emulator("azure") as emu:
            emu.trigger(type=event_type)
            async with http_session() as session:
                notice = await AzureMonitor(session, emu.url, vm_name="spotguard-vm").check()
                assert notice is not None and notice.kind is kind

    run(scenario())


def test_azure_check_prefers_hard_events_and_check_all_lists_all() -> None:
    async def scenario() -> None:
        with emulator("azure") as emu:
            emu.trigger(type="Freeze", **{"in": 5})
            emu.trigger(type="Preempt", **{"in": 60})
            async with http_session() as session:
                monitor = AzureMonitor(session, emu.url, vm_name="spotguard-vm")
                every = await monitor.check_all()
                assert [n.kind for n in every] == [Kind.TERMINATE, Kind.MAINTENANCE]
                top = await monitor.check()
                assert top is not None and top.kind is Kind.TERMINATE

    run(scenario())


def test_azure_ignores_events_for_other_vms() -> None:
    async def scenario() -> None:
        with emulator("azure", vm_name="train-0") as emu:
            emu.trigger(type="Preempt", resources=["train-1", "train-2"])
            async with http_session() as session:
                monitor = AzureMonitor(session, emu.url)
                assert await monitor.check() is None
                assert await monitor.vm_name() == "train-0"
                emu.trigger(type="Preempt", resources=["train-1", "TRAIN-0"])
                notice = await monitor.check()
                assert notice is not None and notice.kind is Kind.TERMINATE
                assert count_requests(emu, "GET", "/metadata/instance/compute/name") == 1

    run(scenario())


def test_azure_acknowledge_posts_start_requests() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        with emulator("azure") as emu:
            async with http_session() as session:
                monitor = AzureMonitor(session, emu.url, vm_name="spotguard-vm", clock=clock)
                emu.trigger(type="Preempt", event_id="A1B2C3D4-0000-4000-8000-000000000002")
                notice = await monitor.check()
                assert notice is not None and notice.acknowledgement is not None
                await notice.acknowledgement.send()
                assert emu.control("GET", "acks") == [
                    {"StartRequests": [{"EventId": "A1B2C3D4-0000-4000-8000-000000000002"}]}
                ]
                posts = [r for r in emu.requests() if r["method"] == "POST"]
                assert posts[0]["headers"]["Metadata"] == "true"
                started = await monitor.check()
                clock.advance(3)
                later = await monitor.check()
                assert started is not None and later is not None
                assert started.raw["EventStatus"] == "Started"
                assert started.event_id == later.event_id == notice.event_id
                # Blank NotBefore: a hard event goes any moment, planned as 30 s from when it was first
                # seen started (not 0 s, which would stop the upload's retries at once); it stays put.
                first_seen_started = datetime(2026, 11, 22, 4, 0, tzinfo=UTC)
                assert started.deadline == later.deadline == first_seen_started + timedelta(seconds=30)

    run(scenario())


@pytest.mark.parametrize(("event_type", "window"), [("Preempt", 30), ("Terminate", 30), ("Reboot", 0), ("Freeze", 0)])
def test_an_event_first_seen_started_gives_a_hard_notice_30_s_and_a_soft_one_none(event_type: str, window: int) -> None:
    """An event already ``Started`` when first read (a host failure; a daemon restarted, or IMDS down,
    for the whole of a Preempt's 30 s)."""

    async def scenario() -> None:
        clock = FakeClock()
        with emulator("azure") as emu:
            async with http_session() as session:
                monitor = AzureMonitor(session, emu.url, vm_name="spotguard-vm", clock=clock)
                emu.trigger(type=event_type, status="Started")
                first = await monitor.check()
                clock.advance(5)
                again = await monitor.check()
                assert first is not None and again is not None and first.event_id == again.event_id
                assert (
                    first.deadline
                    == again.deadline
                    == datetime(2026, 11, 22, 4, 0, tzinfo=UTC) + timedelta(seconds=window)
                )
                assert first.is_hard is (window > 0)

    run(scenario())


def test_an_event_that_names_other_vms_too_is_never_acknowledged(caplog: pytest.LogCaptureFixture) -> None:
    """Azure starts an approved event for every VM it names: this VM's checkpoint must not approve an
    availability set's Reboot for the others, whose uploads may still run."""

    async def scenario() -> None:
        with emulator("azure", vm_name="train-0") as emu:
            shared, own_id = "5A4E0000-0000-4000-8000-000000000001", "5A4E0000-0000-4000-8000-000000000002"
            emu.trigger(type="Reboot", event_id=shared, resources=["train-0", "train-1"])
            emu.trigger(type="Preempt", event_id=own_id, resources=["TRAIN-0"])
            async with http_session() as session:
                monitor = AzureMonitor(session, emu.url)
                for _ in range(3):
                    notices = {n.raw["EventId"]: n for n in await monitor.check_all()}
                    assert notices[shared].acknowledgement is None
                    own = notices[own_id].acknowledgement
                    assert own is not None  # naming this VM alone (in another case): still approved
                await own.send()
                assert emu.control("GET", "acks") == [{"StartRequests": [{"EventId": own_id}]}]
                assert [e["EventStatus"] for e in emu.state()["Events"]] == ["Scheduled", "Started"]

    with caplog.at_level(logging.INFO, logger="spotguard.providers.azure"):
        run(scenario())
    said = [r.getMessage() for r in caplog.records if "also names" in r.getMessage()]
    assert said == [
        "azure: event 5A4E0000-0000-4000-8000-000000000001 also names train-1: not approved early (Azure would "
        "start it for every VM it names); it goes ahead at its NotBefore"
    ]

    run(scenario())


def test_azure_started_event_disappears_after_it_is_done() -> None:
    async def scenario() -> None:
        with emulator("azure", remove_started_after=0.05) as emu:
            emu.trigger(type="Reboot")
            async with http_session() as session:
                monitor = AzureMonitor(session, emu.url, vm_name="spotguard-vm")
                notice = await monitor.check()
                assert notice is not None and notice.acknowledgement is not None
                await notice.acknowledgement.send()
                await eventually(lambda: emu.state()["Events"] == [])
                assert await monitor.check() is None

    run(scenario())


def test_azure_acknowledge_failure_is_an_error() -> None:
    async def scenario() -> None:
        with emulator("azure") as emu:
            emu.trigger(type="Preempt")
            async with http_session() as session:
                monitor = AzureMonitor(session, emu.url, vm_name="spotguard-vm")
                notice = await monitor.check()
                assert notice is not None and notice.acknowledgement is not None
                emu.inject({"kind": "status", "status": 500, "count": 1})
                with pytest.raises(MonitorError, match="StartRequests"):
                    await notice.acknowledgement.send()
                assert emu.control("GET", "acks") == []

    run(scenario())


def test_azure_vm_name_lookup_failure_is_an_error() -> None:
    async def scenario() -> None:
        with emulator("azure") as emu:
            emu.inject({"kind": "garbage", "count": 1, "path": "compute/name"})
            emu.trigger(type="Preempt")
            async with http_session() as session:
                monitor = AzureMonitor(session, emu.url)
                with pytest.raises(MonitorError, match="compute/name"):
                    await monitor.check()
                notice = await monitor.check()
                assert notice is not None and notice.kind is Kind.TERMINATE

    run(scenario())


def test_azure_fault_mix_no_notice_before_same_id_after() -> None:
    faults = [
        {"kind": "status", "status": 500, "count": 2},
        {"kind": "garbage", "count": 2},
        {"kind": "drop", "count": 2},
        {"kind": "latency", "seconds": 0.4, "count": 1},
        {"kind": "status", "status": 503, "count": 1},
    ]

    async def scenario() -> None:
        with emulator("azure") as emu:
            async with http_session() as session:
                monitor = AzureMonitor(session, emu.url, vm_name="spotguard-vm", timeout=0.2)
                emu.inject(*faults)
                before = await poll_outcomes(monitor.check, 10)
                assert before.count("error") >= 5
                assert not [o for o in before if o not in (None, "error")]
                emu.trigger(type="Preempt")
                emu.inject(*faults)
                after = await poll_outcomes(monitor.check, 10)
                notices = [o for o in after if isinstance(o, Notice)]
                assert after.count("error") >= 5 and None not in after
                assert len(notices) >= 3
                assert len({n.event_id for n in notices}) == 1

    run(scenario())


def test_azure_a_malformed_event_of_another_vm_hides_no_eviction_of_this_one() -> None:
    """The document lists every VM's events in an availability set: one of another VM's without an
    EventId, or a DocumentIncarnation past any integer, used to cost this VM its Preempt."""

    async def scenario() -> None:
        with emulator("azure") as emu:
            async with http_session() as session:
                monitor = AzureMonitor(session, emu.url, vm_name="spotguard-vm")
                emu.trigger(type="Preempt", event_id="F0E1D2C3-0000-4000-8000-000000000002", **{"in": 30})
                status, body = get(emu.url + EVENTS, {"Metadata": "true"})
                assert status == 200
                document = json.loads(body)
                document["Events"] += [
                    {"EventType": "Preempt", "Resources": ["other-vm"], "NotBefore": "soon"},
                    {"EventId": "X", "Resources": "other-vm"},
                    "not an event",
                ]
                hostile = json.dumps(document).replace(
                    f'"DocumentIncarnation": {document["DocumentIncarnation"]}', '"DocumentIncarnation": 1e999'
                )
                assert "1e999" in hostile
                emu.inject({"kind": "garbage", "path": "scheduledevents", "body": hostile})
                notice = await monitor.check()
                assert notice is not None and notice.kind is Kind.TERMINATE
                assert notice.raw["EventId"] == "F0E1D2C3-0000-4000-8000-000000000002"
                # This VM's own event malformed is still the monitor's error: it cannot be acted on.
                document["Events"][0]["NotBefore"] = "soon"
                emu.clear_faults()
                emu.inject({"kind": "garbage", "path": "scheduledevents", "body": json.dumps(document)})
                with pytest.raises(MonitorError, match="NotBefore"):
                    await monitor.check()

    run(scenario())
