"""A notice's acknowledgement travels with it but is no part of the event it describes."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime

import pytest

from spotguard.notice import Acknowledgement, Kind, Notice, event_id_for
from spotguard.providers.base import FIRST_SEEN_KEPT, Acknowledgements, MonitorError, PolledMonitor

DEADLINE = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)


def notice(acknowledgement: Acknowledgement | None = None) -> Notice:
    return Notice(
        provider="azure",
        kind=Kind.TERMINATE,
        deadline=DEADLINE,
        event_id=event_id_for("azure", Kind.TERMINATE, "E1"),
        raw={"EventId": "E1"},
        acknowledgement=acknowledgement,
    )


def recording(sent: list[str], what: str) -> Acknowledgement:
    async def send() -> None:
        sent.append(what)

    return Acknowledgement(f"test: {what}", send)


def test_the_acknowledgement_is_not_part_of_equality_hash_event_id_or_json() -> None:
    sent: list[str] = []
    plain, acknowledged = notice(), notice(recording(sent, "ack"))
    assert plain == acknowledged and hash(plain) == hash(acknowledged)
    assert plain.event_id == acknowledged.event_id
    assert len({plain, acknowledged}) == 1
    assert acknowledged.to_dict() == plain.to_dict() | {"received": acknowledged.received.isoformat()}
    assert "acknowledgement" not in acknowledged.to_dict() and "ack" not in repr(acknowledged)
    restored = Notice.from_dict(acknowledged.to_dict())
    assert restored == acknowledged and restored.acknowledgement is None  # a restart carries no live handle
    assert sent == []


def test_the_book_sends_the_latest_acknowledgement_of_an_event_and_logs_a_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sent: list[str] = []
    book = Acknowledgements()
    book.remember(notice(recording(sent, "first poll")))
    book.remember(notice())  # a notice without one (restored from the log) forgets nothing
    book.remember(notice(recording(sent, "latest poll")))
    asyncio.run(book.send(notice().event_id))
    asyncio.run(book.send("some-other-event"))
    assert sent == ["latest poll"]

    async def fail() -> None:
        raise MonitorError("azure: posting StartRequests for E1: HTTP 500")

    book.remember(notice(Acknowledgement("test: failing", fail)))
    with caplog.at_level(logging.WARNING):
        asyncio.run(book.send(notice().event_id))
    assert "HTTP 500" in caplog.text


def event(number: int, acknowledgement: Acknowledgement) -> Notice:
    event_id = event_id_for("azure", Kind.MAINTENANCE, f"E{number}")
    return Notice("azure", Kind.MAINTENANCE, DEADLINE, event_id, acknowledgement=acknowledgement)


def test_the_book_keeps_the_latest_events_only_and_one_polled_again_stays() -> None:
    """A daemon outlives many events that carry an acknowledgement (each of Azure's): the book keeps
    the latest, and an event still in the metadata (polled again) is among them however old."""
    sent: list[str] = []
    book = Acknowledgements()
    book.remember(event(0, recording(sent, "E0")))
    for number in range(1, 3 * FIRST_SEEN_KEPT):
        book.remember(event(number, recording(sent, f"E{number}")))
        book.remember(event(0, recording(sent, "E0")))  # still pending: every poll names it
    asyncio.run(book.send(event(1, recording(sent, "")).event_id))  # long gone
    asyncio.run(book.send(event(0, recording(sent, "")).event_id))
    last = 3 * FIRST_SEEN_KEPT - 1
    asyncio.run(book.send(event(last, recording(sent, "")).event_id))
    assert sent == ["E0", f"E{last}"]
    assert len(book._by_event) == FIRST_SEEN_KEPT


def test_a_monitor_remembers_when_it_first_saw_the_latest_events_only() -> None:
    """A deadline a cloud gives as "from now" is fixed at the event's first poll, and stays fixed while the
    event is polled, however many come and go meanwhile; the first sightings of events gone are forgotten."""
    ticks = iter(range(10_000))
    monitor = PolledMonitor(None, "http://127.0.0.1:9", clock=lambda: datetime.fromtimestamp(next(ticks), UTC))  # type: ignore[arg-type]
    first = monitor.first_seen("gcp:maintenance:1")
    for number in range(2, 3 * FIRST_SEEN_KEPT):
        monitor.first_seen(f"gcp:maintenance:{number}")
        assert monitor.first_seen("gcp:maintenance:1") == first  # still in the metadata: polled every time
    latest = monitor.first_seen(f"gcp:maintenance:{3 * FIRST_SEEN_KEPT - 1}")
    assert monitor.first_seen(f"gcp:maintenance:{3 * FIRST_SEEN_KEPT - 1}") == latest
    assert monitor.first_seen("gcp:maintenance:2") > latest  # forgotten, so seen anew
    assert len(monitor._first_seen) == FIRST_SEEN_KEPT
