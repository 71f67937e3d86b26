"""The trainer's notice flags over a job's months: notices handled and acknowledged are remembered so
that a repeat is not saved for twice, and only the latest are kept."""

from __future__ import annotations

from typing import Any

from spotguard.trainer.notices import HANDLED_KEPT, NoticeFlags


def checkpoint_now(event: int, *, stop: bool = False) -> dict[str, Any]:
    notice = {"event_id": f"rebalance-{event}", "kind": "rebalance", "deadline": "2026-11-27T00:00:00Z"}
    return {"type": "checkpoint-now", "notice": notice, "stop": stop, "deadline_s": 120.0}


def handle(flags: NoticeFlags, message: dict[str, Any]) -> None:
    flags.on_daemon_message(message)
    assert flags.pending is message
    assert flags.to_acknowledge() == message["notice"]["event_id"]
    assert flags.to_acknowledge() is None  # acknowledged once
    flags.saved(message)
    assert flags.pending is None


def test_a_notice_handled_is_not_taken_again_when_the_daemon_repeats_it() -> None:
    flags = NoticeFlags()
    handle(flags, checkpoint_now(1))
    flags.on_daemon_message(checkpoint_now(1))  # a reconnect, the next poll: the same event
    assert flags.pending is None
    handle(flags, checkpoint_now(2))  # a new event is


def test_a_job_that_sees_thousands_of_notices_keeps_only_the_latest() -> None:
    flags = NoticeFlags()
    for event in range(1000):
        handle(flags, checkpoint_now(event))
    for event in range(1000 - HANDLED_KEPT, 1000):  # the latest are still known: repeats are ignored
        flags.on_daemon_message(checkpoint_now(event))
        assert flags.pending is None
    # The oldest are forgotten (the daemon, which keeps its own latest 64, no longer sends them): one
    # coming back counts as new, and is acknowledged again.
    handle(flags, checkpoint_now(0))
