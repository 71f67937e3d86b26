"""The daemon's notices: the ones it has acted on, and where each is in its lifecycle.

A notice the daemon acts on moves, in one direction only:

- **pending**: trainers must checkpoint (and stop, for a hard notice); one that (re)connects is
  told at once;
- **held** (hard notices): a checkpoint was committed for it; the VM is still going away, so a
  trainer that starts now is still told to stop, until the deadline plus ``grace``;
- **over**: the VM outlived its notice (one warning), or a soft notice was checkpointed for or
  reached its deadline. Training goes back to normal and the uploader forgets the deadline.

A hard notice that nothing was saved for goes from pending straight to over, at the same time.
:meth:`NoticeBook._move` is the one place a state changes: one log line per move, recorded in
the event log so that a restarted daemon picks each notice up where it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from spotguard.cloudclock import CLOCK_OFF, how_far, measured_lead
from spotguard.daemon.events import EventBus, NoticeMoved
from spotguard.daemon.lifecycle import NoticeState, TrackedNotice
from spotguard.jsontext import parse_json
from spotguard.notice import UNTIMED_NOTICE_WINDOW, Action, Notice, steady_now, utcnow
from spotguard.repeats import Latest
from spotguard.safefile import SpareFile, replace_file

logger = logging.getLogger("spotguard.daemon")


#: How long past its deadline the event log keeps a notice. A soft notice older than this when met is
#: not acted on (:meth:`NoticeBook.outlived`): the log no longer remembers whether it was.
FORGET_AFTER = timedelta(days=1)
#: Notices met past :data:`FORGET_AFTER` remembered as already logged (each is logged once).
MAX_OUTLIVED_SAID = 64


class EventLog:
    """Event ids the daemon has acted on, kept in ``state_dir`` so a restart does not act twice.

    One file per checkpoint root (named by a hash of the resolved root, which the file also
    records): every daemon on a host shares ``state_dir``, and a notice is only ever replayed to
    a daemon restarted for the same root, never to another job's daemon next to it.

    ``state_dir`` is on the root disk, the disk a VM running for months fills. While it cannot be
    written, the log goes to ``spare_dir`` (the daemon's runtime directory, in memory: it outlives
    a restart of the daemon, not a reboot) and back to ``state_dir`` at the first write that takes.
    Each write is numbered, and a start reads the newer of the two.
    """

    def __init__(self, state_dir: Path, root: Path, spare_dir: Path | None = None) -> None:
        self.root = str(root.resolve())
        spare = None if spare_dir is None else self.path_for(spare_dir, root)
        self.file = SpareFile(self.path_for(state_dir, root), spare, "the event log", logger)
        self.path, self.spare = self.file.path, self.file.spare
        self.events: dict[str, dict[str, Any]] = {}
        self._writes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spotguard-events")
        self._lock = threading.Lock()
        self._latest: bytes | None = None  # the newest log not yet handed to the writer
        self._number = 0  # of the newest write, counted on from the log read at start
        newest: dict[str, Any] | None = None
        newest_path = self.path
        for path in self.file.places():
            loaded = self._read(path)
            if loaded is not None and (newest is None or _write_number(loaded) > _write_number(newest)):
                newest, newest_path = loaded, path
        if newest is not None:
            self._number = _write_number(newest)
            events = newest.get("events")
            for event_id, entry in events.items() if isinstance(events, dict) else ():
                why = _unusable(entry)
                if why is None:
                    self.events[event_id] = entry
                else:
                    logger.warning(
                        "%s: ignoring the entry of %r (%s); a notice still posted is handled as a new one",
                        newest_path,
                        event_id,
                        why,
                    )
        self._forget_old()

    def _read(self, path: Path) -> dict[str, Any] | None:
        try:
            loaded = parse_json(path.read_bytes())
            if not isinstance(loaded, dict) or loaded.get("root") != self.root:
                raise ValueError(f"it is not the event log of {self.root}")
            return loaded
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            logger.warning("ignoring unreadable %s: %s", path, exc)
            return None

    @staticmethod
    def path_for(state_dir: Path, root: Path) -> Path:
        digest = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]
        return state_dir / f"events-{digest}.json"

    def _forget_old(self, keep: str | None = None) -> None:
        horizon = utcnow() - FORGET_AFTER
        for event_id, entry in list(self.events.items()):
            with contextlib.suppress(ValueError, KeyError):
                if event_id != keep and Notice.from_dict(entry["notice"]).deadline < horizon:
                    del self.events[event_id]

    def __contains__(self, event_id: object) -> bool:
        return event_id in self.events

    def record(self, notice: Notice, **fields: Any) -> None:
        """Remember ``fields`` for the notice; the file is written off the caller's thread (see :meth:`_save`).
        Notices a day past their deadline are forgotten here too, not only at start: a daemon runs for
        months, and the whole log is written at every record."""
        self._forget_old(keep=notice.event_id)  # what is recorded now keeps its action and state
        entry = self.events.setdefault(notice.event_id, {"notice": notice.to_dict()})
        entry.update(fields)
        self._save()

    def _save(self) -> None:
        """Queue the current log for writing by the log's own thread.

        The daemon records a notice on its event loop just before telling the trainers: an fsync
        there (tens of ms, seconds on a sick disk) would delay every trainer's news. Writes keep
        their order, and one still queued is replaced by the newer log rather than written twice.
        """
        with self._lock:
            self._number += 1
            data = json.dumps({"root": self.root, "write": self._number, "events": self.events}, indent=1).encode()
            queued = self._latest is not None
            self._latest = data
        if not queued:
            self._writes.submit(self._write_latest)

    def _write_latest(self) -> None:
        with self._lock:
            data, self._latest = self._latest, None
        if data is None:
            return
        try:
            self.file.write(replace_file, data, whole=True)
        except OSError as exc:
            why = "a restarted daemon may act on its notices again"
            logger.warning("cannot write %s nor its spare: %s; %s", self.path, exc, why)

    def flush(self) -> None:
        """Wait until everything recorded so far is on disk."""
        self._writes.submit(lambda: None).result()

    def close(self) -> None:
        self.flush()
        self._writes.shutdown()

    def entries(self) -> Iterator[tuple[Notice, dict[str, Any]]]:
        for entry in self.events.values():
            with contextlib.suppress(ValueError):
                yield Notice.from_dict(entry["notice"]), entry


# A hard notice first seen more than this long after its own deadline, on a VM that still runs, says
# the VM's clock runs ahead of the cloud's (an NTP that never synced, a drift over months): a spot
# interruption's "time" 200 s behind the clock was taken as a notice long over, and training went on
# until the VM was gone. It is acted on as an untimed one is (AWS hibernation, an Auto Scaling
# Terminated state): UNTIMED_NOTICE_WINDOW from when it was seen.
CLOCK_AHEAD_AFTER = 10.0


def clock_checked(notice: Notice, now: datetime | None = None) -> Notice:
    """``notice``, or, a hard one whose deadline lies more than :data:`CLOCK_AHEAD_AFTER` seconds behind
    this VM's clock, the same notice with :data:`~spotguard.notice.UNTIMED_NOTICE_WINDOW` from ``now`` (logged)."""
    now = now or utcnow()
    behind = -notice.seconds_left(now)
    if not notice.is_hard or behind <= CLOCK_AHEAD_AFTER:
        return notice
    lead = measured_lead()
    if lead is not None and abs(lead) > CLOCK_OFF:
        # Already moved onto this clock by the measured lead: the Date header and the notice disagree.
        header = f"its Date header: this clock {how_far(lead)} it"
        why = f"counted on the cloud's time ({header}), the notice or that header is off"
    else:
        why = "the clock is likely ahead of the cloud's (check chronyd or NTP)"
    logger.warning(
        "%s %s notice %s: its deadline %s is %.0f s behind this VM's clock, yet the VM runs: %s; acting as if "
        "%.0f s were left",
        notice.provider,
        notice.kind,
        notice.event_id,
        notice.deadline.isoformat(),
        behind,
        why,
        UNTIMED_NOTICE_WINDOW.total_seconds(),
    )
    return dataclasses.replace(notice, deadline=now + UNTIMED_NOTICE_WINDOW)


def _unusable(entry: Any) -> str | None:
    """Why an entry of the event log cannot be restored, or None. An entry with an action this version
    does not know (written by a newer one, and the fleet rolled back) stopped every start of the daemon
    with ValueError, and so did one edited by hand; kept unreadable, it would also make its notice
    "seen" for good."""
    if not isinstance(entry, dict) or "notice" not in entry:
        return "not a notice's entry"
    try:
        Notice.from_dict(entry["notice"])
        Action(entry.get("action", str(Action.IGNORE)))
    except (ValueError, TypeError) as exc:
        return str(exc)
    return None


def _write_number(log: dict[str, Any]) -> int:
    """Which of two logs was written last; a log written before writes were numbered counts 0."""
    number = log.get("write")
    return number if isinstance(number, int) and not isinstance(number, bool) else 0


class NoticeBook:
    """The lifecycle of every notice the daemon acts on. Their time is counted on ``clock``, the
    steady one (:func:`spotguard.notice.steady_now`, as :attr:`Notice.steady_deadline
    <spotguard.notice.Notice.steady_deadline>` is): a step of the wall clock neither ends a race early
    nor holds a notice over. Tests inject a clock of their own. Each move is told on ``bus`` as a
    :class:`~spotguard.daemon.events.NoticeMoved`."""

    def __init__(
        self, log: EventLog, *, grace: float, bus: EventBus | None = None, clock: Callable[[], float] = steady_now
    ) -> None:
        self.log = log
        self.grace = grace
        self.bus = bus if bus is not None else EventBus()
        self.clock = clock
        self._live: dict[str, TrackedNotice] = {}  # pending or held
        self._outlived_said: Latest[str, None] = Latest(MAX_OUTLIVED_SAID)  # each logged once

    def seen(self, event_id: str) -> bool:
        return event_id in self.log

    def outlived(self, notice: Notice, now: datetime | None = None) -> bool:
        """Whether ``notice`` is a soft one whose deadline lies more than :data:`FORGET_AFTER` back: a
        signal the cloud keeps posting long after it sent it (EC2 keeps a rebalance recommendation in
        the metadata for the instance's life). Acted on within that time, it has left the log since:
        a checkpoint for it now, or a stop under ``on_rebalance = stop``, would answer a day-old signal
        again after every restart, and after any other notice recorded. Logged once per event. A hard
        notice is never outlived: one past its deadline on a VM that runs says the clock is off
        (:func:`clock_checked`)."""
        behind = -notice.seconds_left(now or utcnow())
        if notice.is_hard or behind <= FORGET_AFTER.total_seconds():
            return False
        if notice.event_id not in self._outlived_said:
            self._outlived_said.put(notice.event_id, None)
            logger.info(
                "%s %s notice %s: its deadline %s is %.1f h past; not acted on (any action on it was taken then)",
                notice.provider,
                notice.kind,
                notice.event_id,
                notice.deadline.isoformat(),
                behind / 3600,
            )
        return True

    def ignore(self, notice: Notice) -> None:
        self.log.record(notice, action=str(Action.IGNORE))

    def open(self, notice: Notice, action: Action) -> TrackedNotice:
        """A new notice the trainers must act on."""
        tracked = TrackedNotice(notice, action, NoticeState.PENDING, self._after_deadline(action))
        self._live[notice.event_id] = tracked
        self.log.record(notice, action=str(action), state=str(NoticeState.PENDING))
        return tracked

    def _after_deadline(self, action: Action) -> float:
        # The VM outlives a hard notice only by accident: hold it a grace past the deadline first.
        return self.grace if action is Action.STOP else 0.0

    def checkpointed(self, event_id: object, **fields: Any) -> TrackedNotice | None:
        """A checkpoint was committed for this notice (locally: ``saved_step``; in the bucket: ``committed``)."""
        if not isinstance(event_id, str) or event_id not in self.log:
            return None
        entry = self.log.events[event_id]
        self.log.record(Notice.from_dict(entry["notice"]), **fields)
        tracked = self._live.get(event_id)
        if tracked is not None and tracked.state is NoticeState.PENDING:
            if tracked.action is Action.STOP:
                self._move(tracked, NoticeState.HELD, f"a checkpoint is committed for it ({_fields(fields)})")
            else:
                self._move(tracked, NoticeState.OVER, f"checkpointed for ({_fields(fields)})")
        return tracked

    def restore(self) -> list[TrackedNotice]:
        """After a restart: every notice not over, in the state the log says; handled ones held."""
        restored = []
        for notice, entry in self.log.entries():
            action = Action(entry.get("action", str(Action.IGNORE)))
            if action is Action.IGNORE or entry.get("state") == NoticeState.OVER:
                continue
            handled = entry.get("saved_step") is not None or entry.get("committed") is not None
            state = NoticeState.HELD if entry.get("state") == NoticeState.HELD or handled else NoticeState.PENDING
            tracked = TrackedNotice(notice, action, state, self._after_deadline(action))
            if handled and action is not Action.STOP:
                self._move(tracked, NoticeState.OVER, "checkpointed for before a restart")
                continue
            self._live[notice.event_id] = tracked
            restored.append(tracked)
        self.expire()
        return [t for t in restored if t.state is not NoticeState.OVER]

    def expire(self) -> None:
        """Move every notice whose time is up to over."""
        now = self.clock()
        for tracked in list(self._live.values()):
            if tracked.seconds_to_end(now) <= 0 and tracked.event_id in self._live:
                late = now - tracked.notice.steady_deadline
                if tracked.action is not Action.STOP:
                    why = "its time passed"
                elif tracked.state is NoticeState.HELD:
                    why = f"the VM outlived its deadline by {late:.0f} s; training goes back to normal"
                else:
                    why = (
                        f"the VM outlived its deadline by {late:.0f} s and no checkpoint was committed for it; "
                        "training goes back to normal"
                    )
                self._move(tracked, NoticeState.OVER, why)

    def current(self) -> TrackedNotice | None:
        """The notice trainers are told about now (pending or held), if any."""
        self.expire()
        return self.peek()

    def peek(self) -> TrackedNotice | None:
        """:meth:`current` without ending what is due first (for observers of a move)."""
        return min(self._live.values(), key=TrackedNotice.rank, default=None)

    def get(self, event_id: str) -> TrackedNotice | None:
        return self._live.get(event_id)

    def seconds_to_next_change(self) -> float | None:
        """Until the next notice is over by time; None when none is live."""
        if not self._live:
            return None
        now = self.clock()
        return max(0.0, min(t.seconds_to_end(now) for t in self._live.values()))

    def _move(self, tracked: TrackedNotice, state: NoticeState, why: str) -> None:
        old = tracked.state
        tracked.state = state
        if state is NoticeState.OVER:
            self._live.pop(tracked.event_id, None)
        self.log.record(tracked.notice, state=str(state), **{f"{state}_at": utcnow().isoformat()})
        log = logger.warning if state is NoticeState.OVER and tracked.action is Action.STOP else logger.info
        log("%s notice %s: %s -> %s: %s", tracked.notice.kind, tracked.event_id, old, state, why)
        self.bus.emit(NoticeMoved(tracked, old))


def _fields(fields: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in fields.items())


__all__ = [
    "CLOCK_AHEAD_AFTER",
    "FORGET_AFTER",
    "EventLog",
    "NoticeBook",
    "NoticeState",
    "TrackedNotice",
    "clock_checked",
]
