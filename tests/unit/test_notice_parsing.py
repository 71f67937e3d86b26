"""The metadata formats of the three clouds -> Notices: date formats and event-id stability."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from spotguard import cloudclock
from spotguard.notice import Kind, event_id_for, parse_iso
from spotguard.providers.aws import (
    REBALANCE_HORIZON,
    UNTIMED_NOTICE_WINDOW,
    parse_instance_action,
    parse_lifecycle,
    parse_maintenance,
    parse_maintenance_time,
    parse_rebalance,
)
from spotguard.providers.azure import events_for_vm, kind_for, parse_not_before
from spotguard.providers.gcp import parse_instance

NOW = datetime(2026, 11, 22, 4, 30, tzinfo=UTC)


def test_iso_times_with_z_are_utc() -> None:
    assert parse_iso("2017-09-18T08:22:00Z") == datetime(2017, 9, 18, 8, 22, tzinfo=UTC)


def test_aws_maintenance_time_format() -> None:
    assert parse_maintenance_time("21 Jan 2019 09:00:43 GMT") == datetime(2019, 1, 21, 9, 0, 43, tzinfo=UTC)


def test_azure_not_before_format() -> None:
    assert parse_not_before("Mon, 19 Sep 2016 18:29:47 GMT") == datetime(2016, 9, 19, 18, 29, 47, tzinfo=UTC)


@pytest.mark.parametrize("text", ["", "yesterday", "2019-01-21T09:00:43Z", "32 Jan 2019 09:00:43 GMT"])
def test_bad_dates_raise_value_error(text: str) -> None:
    with pytest.raises(ValueError, match="not a"):
        parse_maintenance_time(text)
    with pytest.raises(ValueError, match="not a"):
        parse_not_before(text)


def test_event_id_is_stable_and_depends_on_identity_only() -> None:
    first = event_id_for("aws", Kind.TERMINATE, "terminate@2017-09-18T08:22:00Z")
    assert first == event_id_for("aws", "terminate", "terminate@2017-09-18T08:22:00Z")
    assert first != event_id_for("aws", Kind.TERMINATE, "terminate@2017-09-18T08:24:00Z")
    assert first != event_id_for("gcp", Kind.TERMINATE, "terminate@2017-09-18T08:22:00Z")
    assert first.startswith("aws-terminate-")


def test_aws_instance_action_deadline_and_id_do_not_depend_on_poll_time() -> None:
    body = '{"action": "terminate", "time": "2017-09-18T08:22:00Z"}'
    one = parse_instance_action(body, NOW)
    two = parse_instance_action(body, NOW + timedelta(seconds=5))
    assert one.kind is Kind.TERMINATE
    assert one.deadline == two.deadline == datetime(2017, 9, 18, 8, 22, tzinfo=UTC)
    assert one.event_id == two.event_id
    stop = parse_instance_action('{"action": "stop", "time": "2017-09-18T08:22:00Z"}', NOW)
    assert stop.kind is Kind.STOP and stop.event_id != one.event_id


def test_aws_hibernate_gets_the_default_window_not_a_deadline_of_now() -> None:
    notice = parse_instance_action('{"action": "hibernate", "time": "2099-01-01T00:00:00Z"}', NOW)
    assert notice.kind is Kind.HIBERNATE and notice.deadline == NOW + UNTIMED_NOTICE_WINDOW
    assert timedelta(seconds=30) == UNTIMED_NOTICE_WINDOW  # the documented default
    sooner = parse_instance_action('{"action": "hibernate", "time": "2017-09-18T08:22:00Z"}', NOW)
    assert sooner.deadline == datetime(2017, 9, 18, 8, 22, tzinfo=UTC)  # an announced earlier time wins


@pytest.mark.parametrize(
    "body",
    ["", "not json", "[]", '{"action": "explode", "time": "2017-09-18T08:22:00Z"}', '{"action": "stop"}'],
)
def test_aws_bad_instance_action_is_value_error(body: str) -> None:
    with pytest.raises(ValueError):
        parse_instance_action(body, NOW)


def test_aws_rebalance_id_from_notice_time() -> None:
    notice = parse_rebalance('{"noticeTime": "2020-10-27T08:22:00Z"}', NOW)
    assert notice.kind is Kind.REBALANCE and not notice.is_hard
    assert notice.deadline == datetime(2020, 10, 27, 8, 24, tzinfo=UTC)
    assert notice.event_id == parse_rebalance('{"noticeTime": "2020-10-27T08:22:00Z"}', NOW).event_id


def test_aws_rebalance_is_dated_no_later_than_first_seen_whatever_the_date_header_says() -> None:
    """A Date header two hours behind reads as this VM's clock two hours ahead; moved by that much,
    a recommendation posted ten seconds ago would hold for two hours more than EC2's horizon."""
    cloudclock.note_ahead(7200.0)
    posted = (NOW - timedelta(seconds=10)).strftime("%Y-%m-%dT%H:%M:%SZ")
    notice = parse_rebalance(json.dumps({"noticeTime": posted}), NOW)
    assert notice.deadline == NOW + REBALANCE_HORIZON


def test_aws_maintenance_skips_finished_events_and_keys_on_event_id() -> None:
    events = [
        {
            "NotBefore": "21 Jan 2019 09:00:43 GMT",
            "Code": "system-reboot",
            "Description": "scheduled reboot",
            "EventId": "instance-event-0d59937288b749b32",
            "NotAfter": "21 Jan 2019 09:17:23 GMT",
            "State": "active",
        },
        {"NotBefore": "1 Jan 2019 09:00:00 GMT", "EventId": "instance-event-old", "State": "completed"},
        {"NotBefore": "1 Jan 2019 09:00:00 GMT", "EventId": "instance-event-x", "Description": "[Canceled] x"},
    ]
    (notice,) = parse_maintenance(json.dumps(events))
    assert notice.kind is Kind.MAINTENANCE
    assert notice.deadline == datetime(2019, 1, 21, 9, 0, 43, tzinfo=UTC)
    assert notice.event_id == event_id_for("aws", Kind.MAINTENANCE, "instance-event-0d59937288b749b32")
    assert parse_maintenance("[]") == []
    with pytest.raises(ValueError):
        parse_maintenance('{"EventId": "x"}')


def test_aws_lifecycle_states() -> None:
    assert parse_lifecycle("InService", NOW) is None
    assert parse_lifecycle("Warmed:Hibernated\n", NOW) is None
    terminated = parse_lifecycle("Terminated", NOW)
    assert terminated is not None and terminated.kind is Kind.TERMINATE
    assert terminated.deadline == NOW + UNTIMED_NOTICE_WINDOW
    later = parse_lifecycle("Terminated", NOW + timedelta(seconds=1))
    assert later is not None and later.event_id == terminated.event_id
    with pytest.raises(ValueError):
        parse_lifecycle("<html>", NOW)


def test_gcp_instance_document() -> None:
    doc = {"id": 123, "preempted": "TRUE", "maintenanceEvent": "NONE"}
    assert parse_instance(json.dumps(doc)) == ("123", True, "NONE")
    for bad in (
        "TRUE",
        "[]",
        json.dumps({"preempted": "MAYBE", "maintenanceEvent": "NONE"}),
        json.dumps({"preempted": "FALSE", "maintenanceEvent": 7}),
    ):
        with pytest.raises(ValueError):
            parse_instance(bad)


def test_a_gcp_document_without_a_readable_maintenance_event_still_says_preempted() -> None:
    """GCE documents ``maintenanceEvent`` as filled only on VMs that migrate or have a GPU; a document
    without it (or with a value that cannot be read) was refused whole, preemption and all."""
    assert parse_instance(json.dumps({"id": 5, "preempted": "FALSE"})) == ("5", False, "NONE")
    for maintenance in (None, "", 7):
        doc = {"id": 5, "preempted": "TRUE", "maintenanceEvent": maintenance}
        assert parse_instance(json.dumps(doc)) == ("5", True, "NONE")


def test_azure_events_for_this_vm_only() -> None:
    doc = {
        "DocumentIncarnation": 7,
        "Events": [
            {"EventId": "A", "EventType": "Preempt", "Resources": ["Train-0"], "EventStatus": "Scheduled"},
            {"EventId": "B", "EventType": "Reboot", "Resources": ["train-1"], "EventStatus": "Scheduled"},
            {"EventId": "C", "EventType": "Freeze", "Resources": [], "EventStatus": "Scheduled"},
        ],
    }
    incarnation, mine = events_for_vm(json.dumps(doc), "train-0")
    assert incarnation == 7 and [e["EventId"] for e in mine] == ["A"]
    assert kind_for("Preempt") is Kind.TERMINATE and kind_for("Terminate") is Kind.TERMINATE
    assert {kind_for(t) for t in ("Reboot", "Redeploy", "Freeze", "SomethingNew")} == {Kind.MAINTENANCE}
    with pytest.raises(ValueError):
        events_for_vm('{"Events": "none"}', "train-0")


def test_the_clock_is_read_against_the_date_header_and_a_garbled_or_absent_one_is_no_reading() -> None:
    from spotguard.providers.base import note_clock

    date = "Sun, 22 Nov 2026 04:00:00 GMT"
    assert note_clock("test-clock", date, datetime(2026, 11, 22, 4, 3, 20, tzinfo=UTC)) == 200  # ahead
    assert note_clock("test-clock", date, datetime(2026, 11, 22, 3, 59, 50, tzinfo=UTC)) == -10  # behind
    assert note_clock("test-clock", None) is None and note_clock("test-clock", "yesterday") is None
