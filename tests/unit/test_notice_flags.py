"""The trainer's notice flags over a job's months: notices handled and acknowledged are remembered so
that a repeat is not saved for twice, and only the latest are kept."""

from __future__ import annotations

from datetime import UTC, datetime
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


class SignalOnSecondLook(NoticeFlags):
    """SIGTERM's handler runs between bytecodes of the main thread: here it lands right after the
    first read of the flag (a tight loop spends most of its time asking should_checkpoint)."""

    def __init__(self) -> None:
        self.looks = 0
        super().__init__()

    @property  # type: ignore[override]
    def sigterm(self) -> bool:
        self.looks += 1
        return self.looks > 1

    @sigterm.setter
    def sigterm(self, value: bool) -> None:
        pass


def test_a_sigterm_landing_while_the_flags_are_read_never_stops_the_loop_without_its_save() -> None:
    """Read twice, the flag said "not urgent" and then "stop": the loop left without the checkpoint
    SIGTERM asked for, and the trainer exited 0 with nothing saved."""
    flags = SignalOnSecondLook()
    urgent, _ = flags.agree(False)
    assert urgent or not flags.stop_agreed  # a stop agreed comes with its urgent save
    urgent, _ = flags.agree(False)
    assert urgent and flags.stop_agreed


def spot(event: int) -> dict[str, Any]:
    notice = {"event_id": f"spot-{event}", "kind": "terminate", "deadline": "2026-11-27T00:00:00Z"}
    return {"type": "checkpoint-now", "notice": notice, "stop": True, "deadline_s": 120.0}


def test_a_soft_notice_behind_a_hard_one_leaves_the_hard_one_pending_and_the_loop_stops() -> None:
    """AWS may post a rebalance recommendation with, or after, a spot interruption. The soft notice
    replaced the hard one: the save was labelled soft and the loop never stopped."""
    flags = NoticeFlags()
    hard, soft = spot(1), checkpoint_now(1)
    flags.on_daemon_message(hard)
    flags.on_daemon_message(soft)
    assert flags.pending is hard
    assert flags.local() == (True, True)
    assert flags.save_reason() == ("urgent", hard)
    flags.saved(hard)
    assert flags.stop_agreed and flags.pending is None
    flags.on_daemon_message(soft)  # the daemon sends it again (a reconnect): answered already
    assert flags.pending is None


def test_a_hard_notice_behind_a_soft_one_takes_its_place() -> None:
    flags = NoticeFlags()
    soft, hard = checkpoint_now(2), spot(2)
    flags.on_daemon_message(soft)
    flags.on_daemon_message(hard)
    assert flags.pending is hard and flags.save_reason() == ("urgent", hard)


def test_a_sigterm_beside_a_soft_notice_makes_the_save_urgent() -> None:
    flags = NoticeFlags()
    soft = checkpoint_now(3)
    flags.on_daemon_message(soft)
    assert flags.save_reason() == ("soft", soft)
    flags.sigterm = True
    assert flags.save_reason() == ("urgent", soft)
    flags.saved(soft)
    assert flags.stop_agreed


def test_a_notice_without_an_event_id_or_a_readable_deadline_is_still_acted_on_once() -> None:
    """Only the message's own fields are checked by the protocol; the training thread read the notice's
    ``event_id`` by index and a daemon's notice without one raised KeyError in ``should_checkpoint``."""
    flags = NoticeFlags()
    odd = {"type": "checkpoint-now", "notice": {"kind": "terminate"}, "stop": True, "deadline_s": 30.0}
    flags.on_daemon_message(odd)
    pending = flags.pending
    assert pending is not None
    named = pending["notice"]["event_id"]
    assert named.startswith("unnamed-")
    deadline = flags.deadline()
    assert deadline is not None and 0 < (deadline - datetime.now(UTC)).total_seconds() <= 30
    assert flags.to_acknowledge() == named
    flags.saved(pending)
    flags.on_daemon_message({**odd, "deadline_s": 20.0})  # sent again: the same notice, answered
    assert flags.pending is None
