"""The notice lifecycle (pending -> held -> over) with a clock the test moves; the event log is real."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest

from spotguard import cloudclock
from spotguard.daemon.events import NoticeMoved
from spotguard.daemon.notices import CLOCK_AHEAD_AFTER, EventLog, NoticeBook, NoticeState, clock_checked
from spotguard.notice import UNTIMED_NOTICE_WINDOW, Action, Kind, Notice, steady_now, utcnow
from tests.diskspace import fill


class Clock:
    """The wall clock's time, which the test's notices are dated by, and the steady clock's, which
    the book counts their time on: the test moves both."""

    def __init__(self) -> None:
        self.now = utcnow()
        self.steady = steady_now()

    def __call__(self) -> float:
        return self.steady

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)
        self.steady += seconds


def book(tmp_path: Path, clock: Clock, grace: float = 60.0) -> NoticeBook:
    return NoticeBook(EventLog(tmp_path / "state", tmp_path / "root"), grace=grace, clock=clock)


def notice(clock: Clock, seconds: float, kind: Kind = Kind.DRILL, identity: str = "1") -> Notice:
    return Notice(
        provider="none",
        kind=kind,
        deadline=clock.now + timedelta(seconds=seconds),
        event_id=f"none-{kind}-{identity}",
        received=clock.now,
    )


def test_a_hard_notice_is_pending_then_held_then_over_after_deadline_plus_grace(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="spotguard.daemon")
    clock = Clock()
    notices = book(tmp_path, clock, grace=60)
    moves: list[tuple[str, str]] = []
    notices.bus.subscribe(NoticeMoved, lambda e: moves.append((str(e.old), str(e.tracked.state))))
    drill = notices.open(notice(clock, 3), Action.STOP)
    assert notices.current() is drill and drill.state is NoticeState.PENDING
    notices.checkpointed(drill.event_id, saved_step=7)
    assert drill.state is NoticeState.HELD and notices.current() is drill
    clock.advance(3 + 59)
    assert notices.current() is drill  # past the deadline, within the grace: still held
    assert notices.seconds_to_next_change() == pytest.approx(1.0, abs=0.01)  # the notice was dated by the real clocks
    clock.advance(1)
    assert notices.current() is None and drill.state is NoticeState.OVER
    assert moves == [("pending", "held"), ("held", "over")]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "outlived its deadline by 60 s" in warnings[0]
    notices.expire()
    assert len(moves) == 2  # over is final: one move, one warning


def test_a_hard_notice_nothing_was_saved_for_is_over_at_the_same_time(tmp_path: Path) -> None:
    clock = Clock()
    notices = book(tmp_path, clock, grace=10)
    drill = notices.open(notice(clock, 5), Action.STOP)
    clock.advance(14.9)
    assert notices.current() is drill and drill.state is NoticeState.PENDING
    clock.advance(0.2)
    assert notices.current() is None and drill.state is NoticeState.OVER


def test_a_soft_notice_is_over_once_checkpointed_for_or_at_its_deadline(tmp_path: Path) -> None:
    clock = Clock()
    notices = book(tmp_path, clock)
    saved = notices.open(notice(clock, 600, Kind.REBALANCE, "a"), Action.CHECKPOINT)
    notices.checkpointed(saved.event_id, saved_step=3)
    assert saved.state is NoticeState.OVER and notices.current() is None
    late = notices.open(notice(clock, 5, Kind.MAINTENANCE, "b"), Action.CHECKPOINT)
    assert notices.current() is late
    clock.advance(5)
    assert notices.current() is None and late.state is NoticeState.OVER


def test_a_pending_hard_notice_outranks_a_held_one_and_a_soft_one(tmp_path: Path) -> None:
    clock = Clock()
    notices = book(tmp_path, clock)
    soft = notices.open(notice(clock, 10, Kind.REBALANCE, "soft"), Action.CHECKPOINT)
    assert notices.current() is soft
    held = notices.open(notice(clock, 20, Kind.DRILL, "drill"), Action.STOP)
    notices.checkpointed(held.event_id, saved_step=1)
    assert notices.current() is held
    real = notices.open(notice(clock, 120, Kind.TERMINATE, "real"), Action.STOP)
    assert notices.current() is real


def test_after_a_restart_handled_notices_are_held_and_over_ones_stay_over(tmp_path: Path) -> None:
    clock = Clock()
    before = book(tmp_path, clock, grace=30)
    handled = before.open(notice(clock, 100, Kind.DRILL, "handled"), Action.STOP)
    before.checkpointed(handled.event_id, saved_step=4)
    waiting = before.open(notice(clock, 100, Kind.TERMINATE, "waiting"), Action.STOP)
    ended = before.open(notice(clock, 1, Kind.DRILL, "ended"), Action.STOP)
    clock.advance(40)
    assert before.current() is waiting and ended.state is NoticeState.OVER
    before.log.flush()  # the log is written by its own thread; a restart reads what reached the disk

    after = book(tmp_path, clock, grace=30)
    restored = {t.event_id: t.state for t in after.restore()}
    assert restored == {handled.event_id: NoticeState.HELD, waiting.event_id: NoticeState.PENDING}


def test_a_log_written_before_states_existed_honours_saved_step_and_committed(tmp_path: Path) -> None:
    clock = Clock()
    log = EventLog(tmp_path / "state", tmp_path / "root")
    saved = notice(clock, 100, Kind.DRILL, "saved")
    uploaded = notice(clock, 100, Kind.REBALANCE, "uploaded")
    log.record(saved, action="stop", saved_step=9)
    log.record(uploaded, action="checkpoint", committed="step-000000009")
    log.flush()
    after = book(tmp_path, clock)
    assert [(t.event_id, t.state) for t in after.restore()] == [(saved.event_id, NoticeState.HELD)]
    after.log.flush()
    entry = json.loads(log.path.read_text())["events"][uploaded.event_id]
    assert entry["state"] == "over"


def test_event_logs_are_one_file_per_root_and_ignore_another_roots_file(tmp_path: Path) -> None:
    state = tmp_path / "state"
    clock = Clock()
    a = EventLog(state, tmp_path / "a")
    a.record(notice(clock, 100), action="stop")
    a.flush()
    assert EventLog(state, tmp_path / "b").events == {}
    assert EventLog(state, tmp_path / "a").events.keys() == a.events.keys()
    # A file that names another root (copied by hand, say) is not taken for this root's.
    EventLog.path_for(state, tmp_path / "b").write_bytes(a.path.read_bytes())
    assert EventLog(state, tmp_path / "b").events == {}


def test_an_entry_this_version_cannot_read_is_ignored_and_its_notice_handled_anew(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An action written by a newer spotguard (a fleet rolled back), or an entry edited by hand, stopped
    every start of the daemon with ValueError: 'drain' is not a valid Action."""
    clock = Clock()
    log = EventLog(tmp_path / "state", tmp_path / "root")
    good, newer, edited = (notice(clock, 100, Kind.DRILL, name) for name in ("good", "newer", "edited"))
    log.record(good, action="stop")
    log.record(newer, action="stop")
    log.record(edited, action="stop")
    log.close()
    document = json.loads(log.path.read_text())
    document["events"][newer.event_id]["action"] = "drain"
    document["events"][edited.event_id]["notice"] = 5
    document["events"]["junk"] = [1, 2]
    log.path.write_text(json.dumps(document))
    with caplog.at_level(logging.WARNING):
        after = book(tmp_path, clock)
    assert [t.event_id for t in after.restore()] == [good.event_id]
    assert not after.seen(newer.event_id) and not after.seen(edited.event_id)  # handled when still posted
    ignored = [r.getMessage() for r in caplog.records if "ignoring the entry of" in r.getMessage()]
    assert len(ignored) == 3 and "'drain' is not a valid Action" in ignored[0] and str(log.path) in ignored[0]


def test_a_hard_notice_behind_the_clock_gets_the_untimed_window_and_others_keep_their_deadline() -> None:
    clock = Clock()
    behind = notice(clock, -200, Kind.TERMINATE, "behind")
    checked = clock_checked(behind, clock.now)
    assert checked.deadline == clock.now + UNTIMED_NOTICE_WINDOW
    assert (checked.event_id, checked.kind, checked.provider) == (behind.event_id, behind.kind, behind.provider)
    late_poll = notice(clock, -CLOCK_AHEAD_AFTER, Kind.TERMINATE, "late")  # a slow poll, not a wrong clock
    old_rebalance = notice(clock, -3600, Kind.REBALANCE, "old")  # soft: long over, as it says
    assert clock_checked(late_poll, clock.now) is late_poll and clock_checked(old_rebalance, clock.now) is old_rebalance


def test_a_hard_notice_behind_a_clock_already_corrected_blames_the_date_header_or_the_notice(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A Date header hours in the future reads as this VM's clock hours behind, and moves a true
    deadline hours into the past: the warning must not send the operator to a clock that is right."""
    clock = Clock()
    cloudclock.note_ahead(-7200.0)
    with caplog.at_level(logging.WARNING):
        checked = clock_checked(notice(clock, -7170, Kind.TERMINATE, "moved"), clock.now)
    assert checked.deadline == clock.now + UNTIMED_NOTICE_WINDOW
    [warning] = [r.getMessage() for r in caplog.records]
    assert "counted on the cloud's time (its Date header: this clock 7200 s behind it), the notice or" in warning
    assert "chronyd" not in warning


def test_recording_does_not_wait_for_the_disk_and_writes_keep_their_order(tmp_path: Path) -> None:
    """The daemon records a notice on its event loop just before telling the trainers: no fsync there."""
    import threading

    clock = Clock()
    log = EventLog(tmp_path / "state", tmp_path / "root")
    disk_free = threading.Event()
    log._writes.submit(disk_free.wait)  # a disk that takes its time
    first = notice(clock, 100, Kind.DRILL, "first")
    log.record(first, action="stop")  # returns at once, though nothing can be written yet
    log.record(first, action="stop", saved_step=3)
    assert not log.path.exists()
    disk_free.set()
    log.close()
    assert json.loads(log.path.read_text())["events"][first.event_id]["saved_step"] == 3  # the newer record won


def test_a_running_daemon_forgets_notices_a_day_past_their_deadline_at_its_next_record(tmp_path: Path) -> None:
    """They were forgotten only when the daemon started; one running for months kept every drill and
    notice in the log it writes whole at each record."""
    log = EventLog(tmp_path / "state", tmp_path / "root")
    clock = Clock()
    clock.advance(-2 * 86400)
    old = notice(clock, 30, identity="old")
    log.record(old, state="over")
    clock.advance(2 * 86400)
    log.record(notice(clock, 30, identity="new"), state="pending")
    log.flush()
    assert old.event_id not in log
    assert list(json.loads(log.path.read_bytes())["events"]) == ["none-drill-new"]


def test_a_record_of_a_notice_past_the_horizon_keeps_what_was_recorded_of_it(tmp_path: Path) -> None:
    """A commit recorded for a notice more than a day past its deadline (an upload that took that long):
    the record used to forget the entry first and make it anew without its action, and a restarted
    daemon then read the notice back as ignored."""
    log = EventLog(tmp_path / "state", tmp_path / "root")
    clock = Clock()
    clock.advance(-2 * 86400)
    late = notice(clock, 30, kind=Kind.TERMINATE, identity="late")
    log.record(late, action="stop", state="held")
    log.record(late, committed="step-000000007")
    log.close()
    assert json.loads(log.path.read_bytes())["events"][late.event_id] == {
        "notice": late.to_dict(),
        "action": "stop",
        "state": "held",
        "committed": "step-000000007",
    }


def test_a_full_state_directory_keeps_the_log_in_the_spare_until_it_takes_writes_again(
    tmpfs: Callable[[int], Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The state directory is on the root disk, which a VM running for months fills. The log used to be
    lost then, and a daemon restarted in that state acted on its notices again."""
    state, spare, root = tmpfs(64 * 1024), tmp_path / "run", tmp_path / "root"
    filler = fill(state, leave=0)
    clock = Clock()
    caplog.set_level(logging.INFO, logger="spotguard.daemon")
    log = EventLog(state, root, spare_dir=spare)
    handled = notice(clock, 100, identity="handled")
    log.record(handled, action="stop", saved_step=4)
    log.record(handled, action="stop", saved_step=4, state="held")
    log.flush()
    assert not log.path.exists() and log.spare is not None and log.spare.exists()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(log.spare) in warnings[0], warnings  # once for the outage

    # A daemon restarted while the disk is still full reads the spare: the notice stays handled.
    restarted = EventLog(state, root, spare_dir=spare)
    assert restarted.events[handled.event_id]["state"] == "held"
    restarted.close()

    # Room again: the next write goes to the state directory, and the spare goes.
    filler.unlink()
    later = notice(clock, 200, identity="later")
    log.record(later, action="checkpoint")
    log.close()
    assert log.path.exists() and not log.spare.exists()
    assert set(json.loads(log.path.read_text())["events"]) == {handled.event_id, later.event_id}
    assert any("written to" in r.getMessage() and "again" in r.getMessage() for r in caplog.records)


def test_a_start_reads_the_newer_of_the_state_directory_and_the_spare(tmp_path: Path) -> None:
    """A spare left behind (the daemon was killed before its next write reached the state directory)
    must not win over a newer log there, nor an older log there over a newer spare."""
    state, spare, root = tmp_path / "state", tmp_path / "run", tmp_path / "root"
    clock = Clock()
    log = EventLog(state, root, spare_dir=spare)
    log.record(notice(clock, 100, identity="first"), action="stop")
    log.close()
    assert log.spare is not None
    older = json.loads(log.path.read_text())
    newer = dict(older, write=older["write"] + 1, events={})
    log.spare.parent.mkdir(parents=True)
    log.spare.write_text(json.dumps(newer))
    assert EventLog(state, root, spare_dir=spare).events == {}
    log.spare.write_text(json.dumps(dict(older, write=older["write"] - 1, events={})))
    assert EventLog(state, root, spare_dir=spare).events.keys() == older["events"].keys()


def test_a_notice_counts_its_time_on_the_boot_clock_which_runs_on_through_a_suspend() -> None:
    # time.monotonic() stands still while the VM is suspended or hibernated: a VM resumed days after
    # an AWS hibernation notice would find it still pending. CLOCK_BOOTTIME runs on.
    before = time.clock_gettime(time.CLOCK_BOOTTIME)
    steady = steady_now()
    assert before <= steady <= time.clock_gettime(time.CLOCK_BOOTTIME)
    drill = Notice.in_seconds("none", Kind.DRILL, 30, "boot-clock")
    assert drill.steady_deadline - steady_now() == pytest.approx(30, abs=0.5)
    assert drill.monotonic_deadline - time.monotonic() == pytest.approx(drill.seconds_left(), abs=0.01)
