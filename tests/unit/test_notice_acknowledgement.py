"""A notice's acknowledgement travels with it but is no part of the event it describes."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime

import pytest

from spotguard.notice import Acknowledgement, Kind, Notice, event_id_for
from spotguard.providers.base import Acknowledgements, MonitorError

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
