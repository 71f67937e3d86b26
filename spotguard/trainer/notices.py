"""What the daemon and signals told this rank, and what every rank agreed on at the last step boundary.

The daemon's client thread and the SIGTERM handler set flags here; the training loop reads them only at
step boundaries, where every rank agrees on them (one all-reduce), so all ranks save the same step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from spotguard.notice import parse_iso
from spotguard.repeats import Latest
from spotguard.trainer import dist

logger = logging.getLogger("spotguard.trainer")

#: A ``checkpoint-now`` message from the daemon (``notice``, ``stop``, ``deadline_s``).
Message = dict[str, Any]

# Notices remembered as handled (or acknowledged), the latest ones: the daemon sends one again only
# while its event is still current (a reconnect, the next poll), and keeps no more than its own latest
# 64 (providers.base.FIRST_SEEN_KEPT); a job that runs for months sees a notice at every rebalance.
HANDLED_KEPT = 64


class NoticeFlags:
    """The pending notice, SIGTERM, and the agreed urgent/stop flags of one Guard."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._notice: Message | None = None  # the checkpoint-now message not yet saved for
        self._handled_events: Latest[str, None] = Latest(HANDLED_KEPT)
        self._acknowledged: Latest[str, None] = Latest(HANDLED_KEPT)  # notices the daemon was told we act on
        self.sigterm = False  # set by a signal handler: a plain store, safe there
        self.stop_agreed = False
        self.urgent_agreed = False
        # Several ranks: the reason and notice of the save the last agreement decided on, until taken.
        self._agreed: tuple[str, Message | None] | None = None
        self.timeline: dict[str, float] = {}  # wall-clock times of the last urgent save, for reports

    def on_daemon_message(self, message: Message) -> None:
        """From the client's thread: a new ``checkpoint-now`` becomes the pending notice, unless a hard
        one is pending and this one is soft. AWS may post a rebalance recommendation with, or after, a
        spot interruption: the hard notice's save answers both, and the loop must still stop after it."""
        if message["type"] != "checkpoint-now":
            return
        message = _checked(message)
        event_id = message["notice"]["event_id"]
        with self._lock:
            current = self._notice
            if event_id in self._handled_events or (current and current["notice"]["event_id"] == event_id):
                return
            behind_a_hard_one = current is not None and current["stop"] and not message["stop"]
            if behind_a_hard_one:
                self._handled_events.put(event_id, None)  # the save of the hard one answers it
            else:
                self._notice = message
                self.timeline = {"told": time.time()}
        logger.warning(
            "spotguard: %s notice (%s), %.0f s to the deadline: %s",
            message["notice"].get("kind"),
            "stop" if message["stop"] else "keep training",
            message["deadline_s"],
            "the pending stop's checkpoint answers it too" if behind_a_hard_one else "checkpointing at the next step",
        )

    @property
    def pending(self) -> Message | None:
        with self._lock:
            return self._notice

    def deadline(self) -> datetime | None:
        notice = self.pending
        return parse_iso(notice["notice"]["deadline"]) if notice else None

    def local(self) -> tuple[bool, bool]:
        """(urgent, stop) as this rank alone sees them; a stop is always urgent."""
        notice = self.pending
        # Read once: SIGTERM's handler may run between any two bytecodes, and a "stop" seen without
        # the "urgent" read just before it would end the loop without the save it asks for.
        sigterm = self.sigterm
        return notice is not None or sigterm, bool(notice and notice["stop"]) or sigterm

    def agree(self, periodic_due: bool) -> tuple[bool, bool]:
        """(urgent, periodic) as every rank agrees on them; a stop, once agreed, stays. Collective.

        With several ranks, the save they agreed on keeps its reason and notice until it is taken
        (:meth:`save_reason`): a SIGTERM or a notice reaching one rank between this agreement and its
        save made that rank's save urgent and the others' periodic, whose collectives then never
        matched (a hang at the very moment the VM goes away). What comes later is agreed on at the
        next step boundary."""
        notice = self.pending
        urgent, stop = self.local()
        urgent, stop, periodic = dist.agree_any([urgent, stop, periodic_due])
        self.urgent_agreed = urgent
        self.stop_agreed = self.stop_agreed or stop
        if dist.active():
            reason = "urgent" if stop else "soft" if urgent else "periodic" if periodic else None
            self._agreed = None if reason is None else (reason, notice)
        return urgent, periodic

    def to_acknowledge(self) -> str | None:
        """The pending notice's event id, the first time it is asked for; else None."""
        notice = self.pending
        if notice is None:
            return None
        event_id = str(notice["notice"]["event_id"])
        if event_id in self._acknowledged:
            return None
        self._acknowledged.put(event_id, None)
        return event_id

    def save_reason(self) -> tuple[str, Message | None]:
        """The manifest ``reason`` of a save taken now, and the notice it answers: ``soft`` only for a
        soft notice alone (a SIGTERM or a stop agreed with another rank makes the save urgent). With
        several ranks, what their last agreement decided, until that save is taken."""
        if self._agreed is not None:
            return self._agreed
        notice = self.pending
        if self.sigterm or self.stop_agreed or (notice is not None and notice["stop"]):
            return "urgent", notice
        if notice is not None:
            return "soft", notice
        return ("urgent" if self.urgent_agreed else "periodic"), notice

    def stop_if_hard(self, notice: Message | None) -> None:
        """A hard notice (or SIGTERM) ends the loop after its save, even a failed one. With several
        ranks only an agreement stops it (:meth:`agree`, at every step boundary): one rank that left
        on a signal come after the last agreement stranded the others in their next collective."""
        if dist.active():
            return
        if (notice is not None and notice["stop"]) or self.sigterm:
            self.stop_agreed = True

    def saved(self, notice: Message | None) -> None:
        """The save answering ``notice`` is taken: it is handled, and no longer pending."""
        with self._lock:
            if notice is not None:
                self._handled_events.put(str(notice["notice"]["event_id"]), None)
                if self._notice is notice:
                    self._notice = None
        self._agreed = None
        self.urgent_agreed = False
        self.stop_if_hard(notice)

    def committed_locally(self) -> None:
        with self._lock:
            self.timeline["committed_local"] = time.time()


def _checked(message: Message) -> Message:
    """``message`` as the training thread may read it: its notice's ``event_id`` a non-empty text (one
    without is named by its content, so that the daemon sending it again is still one notice) and its
    ``deadline`` a time (else ``deadline_s`` from now), each logged. The protocol checks the message's
    own fields, not the notice's, and the training thread reads both."""
    notice = message["notice"]
    event_id = notice.get("event_id")
    if not isinstance(event_id, str) or not event_id:
        text = json.dumps(notice, sort_keys=True, default=repr)
        named = f"unnamed-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
        logger.warning(
            "spotguard: a checkpoint-now whose notice has no event id (%.200s): acting on it as %s", text, named
        )
        notice = {**notice, "event_id": named}
    try:
        parse_iso(str(notice.get("deadline")))
    except ValueError:
        seconds = float(message["deadline_s"])
        seconds = min(max(seconds, 0.0), 86400.0) if math.isfinite(seconds) else 0.0
        logger.warning(
            "spotguard: a checkpoint-now whose notice has no readable deadline (%.80r): taking %.0f s from now",
            notice.get("deadline"),
            seconds,
        )
        notice = {**notice, "deadline": (datetime.now(UTC) + timedelta(seconds=seconds)).isoformat()}
    return message if notice is message["notice"] else {**message, "notice": notice}
