"""Property tests of every parser of text from outside the process (the trainer socket, the clouds'
metadata services, manifests in a bucket): whatever arrives, each raises only its own error, the one
its callers catch, and what it accepts can be computed with (integers that fit 64 bits, finite
floats, times whose arithmetic cannot overflow).

The examples are the texts that used to escape: nesting past the recursion limit (RecursionError),
integers past Python's 4,300-digit limit (a plain ValueError where a caller caught JSONDecodeError),
dates at the calendar's ends (OverflowError once a notice window was added)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from spotguard import protocol
from spotguard.jsontext import parse_json
from spotguard.manifest import Manifest, ManifestError, foreign_format
from spotguard.notice import EARLIEST, LATEST, parse_iso
from spotguard.providers import aws, azure, gcp
from spotguard.providers.base import parse_http_date

NOW = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)
NESTED = "[" * 20_000 + "]" * 20_000
DIGITS = '{"v": 1, "type": "hello", "rank": ' + "7" * 5000 + ', "world_size": 1, "pid": 1}'
CALENDAR_ENDS = [
    "9999-12-31T23:59:59Z",
    "9999-12-31T23:59:59-12:00",
    "0001-01-01T00:00:00+01:00",
    "Fri, 31 Dec 9999 23:59:59 -1200",
    "Mon, 01 Jan 0001 00:00:00 +1200",
]
# The field names the parsers look for, so that generated documents get past their first checks.
KEYS = [
    "v", "type", "rank", "world_size", "pid", "state_bytes", "bytes", "sharded", "deadline_s", "path", "name",
    "size", "offset", "length", "tmp", "step", "reason", "action", "time", "noticeTime", "EventId", "NotBefore",
    "State", "Events", "Resources", "EventType", "EventStatus", "DocumentIncarnation", "preempted",
    "maintenanceEvent", "format", "files", "crc32c", "world_size", "created",
]  # fmt: skip
WORDS = [
    "hello", "state-size", "drill", "file-range", "saved", "terminate", "hibernate", "Preempt", "Freeze",
    "spotguard-vm", "TRUE", "FALSE", "NONE", "spotguard/1", "00000000", *CALENDAR_ENDS,
]  # fmt: skip
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=2**62, max_value=2**70),
    st.floats(),
    st.text(max_size=12),
    st.sampled_from(WORDS),
    st.datetimes(timezones=st.just(UTC)).map(lambda moment: moment.isoformat()),
)
documents = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(KEYS), inner, max_size=8)),
    max_leaves=24,
)
texts = st.one_of(documents.map(json.dumps), st.text(max_size=64))


def times_usable(moment: datetime) -> None:
    """A time a parser accepted survives what the daemon does with it."""
    assert EARLIEST <= moment < LATEST
    moment + timedelta(days=366)
    moment - timedelta(days=366)
    moment.astimezone(UTC)


@settings(max_examples=400, deadline=None)
@given(texts)
@example(NESTED)
@example(DIGITS)
@example('{"v": 1, "type": "hello", "rank": 0, "world_size": 1, "pid": 1, "state_bytes": 1' + "0" * 400 + "}")
@example('{"v": 1, "type": "drill", "deadline_s": NaN}')
def test_the_socket_protocol_raises_only_its_own_error_and_accepts_only_numbers_one_can_compute_with(
    text: str,
) -> None:
    try:
        message = protocol.decode(text.encode("utf-8", "surrogatepass"))
    except protocol.ProtocolError:
        return
    for value in message.values():
        if isinstance(value, int) and not isinstance(value, bool):
            assert -(2**63) <= value < 2**63
        if isinstance(value, float):
            assert value == value and abs(value) != float("inf")


@settings(max_examples=400, deadline=None)
@given(texts)
@example(NESTED)
@example('{"format": "spotguard/1", "step": 2' + "0" * 5000 + "}")
@example('{"format": "spotguard/' + "9" * 5000 + '"}')
def test_a_manifest_read_from_anywhere_raises_only_manifest_error(text: str) -> None:
    data = text.encode("utf-8", "surrogatepass")
    with contextlib.suppress(ManifestError):
        Manifest.from_json(data)
    found = foreign_format(data)  # never raises: a listing asks it of every object
    assert found is None or isinstance(found, str)


def _azure_times(text: str) -> list[datetime]:
    return [
        azure.parse_not_before(event["NotBefore"])
        for event in azure.events_for_vm(text, "spotguard-vm")[1]
        if isinstance(event.get("NotBefore"), str) and event["NotBefore"].strip()
    ]


def _gcp_times(text: str) -> list[datetime]:
    gcp.parse_instance(text)  # no time in it: the deadline is counted from when it is first seen
    return []


METADATA_PARSERS: dict[str, Callable[[str], list[datetime]]] = {
    "aws instance-action": lambda text: [aws.parse_instance_action(text, NOW).deadline],
    "aws rebalance": lambda text: [aws.parse_rebalance(text, NOW).deadline],
    "aws maintenance": lambda text: [notice.deadline for notice in aws.parse_maintenance(text)],
    "aws lifecycle": lambda text: [notice.deadline for notice in [aws.parse_lifecycle(text, NOW)] if notice],
    "gcp instance": _gcp_times,
    "azure events": _azure_times,
}


@pytest.mark.parametrize("parser", sorted(METADATA_PARSERS))
@settings(max_examples=300, deadline=None)
@given(text=texts)
@example(text=NESTED)
@example(text='{"noticeTime": "9999-12-31T23:59:59Z"}')
@example(text='{"action": "hibernate", "time": "9999-12-31T23:59:59Z"}')
@example(text='[{"EventId": "x", "NotBefore": "Fri, 31 Dec 9999 23:59:59 -1200"}]')
@example(text='{"Events": [], "DocumentIncarnation": 1e999}')
@example(text='{"action": {"a": 1}, "time": "2026-11-27T12:00:00Z"}')
def test_a_metadata_answer_raises_only_value_error_and_dates_only_usable_times(parser: str, text: str) -> None:
    try:
        deadlines = METADATA_PARSERS[parser](text)
    except ValueError:
        return
    for deadline in deadlines:
        times_usable(deadline)


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.text(max_size=40), st.sampled_from(CALENDAR_ENDS), st.datetimes().map(str)))
def test_times_read_from_outside_are_usable_or_value_error(text: str) -> None:
    for parse in (parse_iso, lambda value: parse_http_date(value, "time")):
        try:
            moment = parse(text)
        except ValueError:
            continue
        times_usable(moment)


@settings(max_examples=300, deadline=None)
@given(st.one_of(texts, st.binary(max_size=64)))
@example(NESTED)
@example(DIGITS)
def test_json_from_outside_is_a_document_or_value_error(data: str | bytes) -> None:
    with contextlib.suppress(ValueError):
        parse_json(data)
