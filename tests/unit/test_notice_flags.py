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
