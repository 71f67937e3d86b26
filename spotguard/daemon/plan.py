"""The deadline plan: at notice time, will the state reach the bucket before the deadline?

From the state's size and the measured upload rate
(recent uploads, and a small probe at start so the first notice has a number) the daemon picks a
route:

* ``bucket``: it fits (``seconds_needed <= FIT_FRACTION x seconds_left``);
* ``peer``: it does not, and a peer can take it (peers are configured and one is free);
* ``local``: neither; the newest complete checkpoint in the bucket stays the resume point.

The state's size is the larger of two numbers, and the plan says which it knew (``size_from``):

* ``announced``: what the connected trainers said their state takes (``hello``'s ``state_bytes``, then
  ``state-size`` as it changes; the hook measures it from ``resume``, each save and, every 30 s, the
  state it remembers). A job's first notice often comes before its first save: this is then the
  only number. This node's estimate is the sum over its trainers when any holds sharded state (each
  rank writes its share), else the largest one (replicated state is written once per node);
* ``checkpoint``: the last checkpoint a trainer committed, or the newest one on local disk; in a
  multi-node job this node's share of it, which is all this node uploads.

With neither (``unknown``) the plan is a guess, and says so.

The bucket upload runs on every route (it costs nothing to try). The plan is revised while the race
runs from the uploader's live forecast (rate and time left of the urgent upload): an upload falling
behind turns ``bucket`` into ``peer`` (or ``local``). Once the peer route has started it is kept
(a replica on a peer never hurts) unless it fails: no free peer, a broken handoff. Each plan is
logged once per change of route; its numbers are in ``spotguard status --json`` (``plan``), the
metrics and the webhook.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from spotguard.cloudclock import cloud_now
from spotguard.daemon.events import EventBus, PlanChanged
from spotguard.daemon.route import FIT_FRACTION, UNKNOWN_SIZE, Plan, Route, SizeFrom, choose_route
from spotguard.localstore import scan_local
from spotguard.notice import Notice
from spotguard.storage.base import Storage, put_bytes

logger = logging.getLogger("spotguard.plan")

PROBE_BYTES = 1 << 20
PROBE_PREFIX = ".spotguard-rate-probe"  # never a step directory: listings and retention ignore it
_SAMPLES = 5  # recent uploads the rate is measured over


class RateMeter:
    """Upload rate over the last few transfers, weighted by bytes (one tiny upload cannot swing it)."""

    def __init__(self, keep: int = _SAMPLES) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=keep)

    def add(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self._samples.append((nbytes, seconds))

    def rate(self) -> float | None:
        seconds = sum(s for _, s in self._samples)
        return sum(b for b, _ in self._samples) / seconds if seconds > 0 else None


class AnnouncedSizes:
    """What each connected trainer last said its state takes, and the node's estimate of them."""

    def __init__(self) -> None:
        self._sizes: dict[int, tuple[int, bool]] = {}  # connection id -> (bytes, sharded)

    def set(self, trainer: int, nbytes: int, *, sharded: bool) -> None:
        self._sizes[trainer] = (nbytes, sharded)

    def drop(self, trainer: int) -> None:
        self._sizes.pop(trainer, None)

    def of(self, trainer: int) -> tuple[int, bool] | None:
        return self._sizes.get(trainer)

    def estimate(self) -> int | None:
        """Bytes this node writes of the state: every rank's share when any is sharded; else the
        largest, since replicated state is written once per node (DCP deduplicates it). None when no
        trainer announced."""
        if not self._sizes:
            return None
        if any(sharded for _, sharded in self._sizes.values()):
            return sum(nbytes for nbytes, _ in self._sizes.values())
        return max(nbytes for nbytes, _ in self._sizes.values())


class Planner:
    """Keeps what a plan is made of (size, rate) and the plan of the notice being raced; each plan
    and each change of its route is told on ``bus`` as a :class:`~spotguard.daemon.events.PlanChanged`."""

    def __init__(
        self, *, peer_available: Callable[[], bool] = lambda: False, bucket: bool = True, bus: EventBus | None = None
    ) -> None:
        self.bucket = bucket
        self.bus = bus if bus is not None else EventBus()
        self.meter = RateMeter()
        self.state_bytes: int | None = None  # the last checkpoint's (this node's share of it)
        self.announced = AnnouncedSizes()
        self.peer_available = peer_available
        self.current: Plan | None = None
        self._notice: Notice | None = None
        # Sizes of the files trainers finished, per checkpoint and file, this notice (a file told twice counts once).
        self._announced: dict[str, dict[str, int]] = {}

    def observe_size(self, nbytes: int) -> None:
        self.state_bytes = nbytes

    def observe_file(self, name: str, rel: str, nbytes: int) -> None:
        """A trainer finished the file ``rel`` of checkpoint ``name`` while the notice is pending."""
        self._announced.setdefault(name, {})[rel] = nbytes

    def observe_upload(self, nbytes: int, seconds: float) -> None:
        self.meter.add(nbytes, seconds)

    def size_from_disk(self, root: Path) -> None:
        """What this node uploaded of its newest local checkpoint, when no trainer has told one yet
        (blocking): a complete checkpoint's bytes, or in a multi-node job this node's share's."""
        if self.state_bytes is not None:
            return
        committed = [info for info in scan_local(root) if info.held]
        if committed and self.state_bytes is None:
            newest = committed[-1]
            share = newest.node_files if newest.status != "complete" else None
            self.state_bytes = newest.bytes if share is None else sum(entry.size for entry in share.values())

    def size(self) -> tuple[int, SizeFrom]:
        """The state's size a plan counts with: the larger of the trainers' announced estimate and the
        last checkpoint's, and which of them were known (0 and ``unknown`` when neither)."""
        announced = self.announced.estimate()
        return max(announced or 0, self.state_bytes or 0), SizeFrom.of(announced, self.state_bytes)

    def plan(self, notice: Notice) -> Plan:
        """The plan at notice time (replacing any earlier notice's)."""
        size, size_from = self.size()
        made = choose_route(
            size,
            self.meter.rate(),
            notice.seconds_left(),
            peer_available=self.peer_available(),
            bucket=self.bucket,
            size_from=size_from,
        )
        self._notice = notice
        self.current = replace(made, event_id=notice.event_id)
        logger.warning("deadline plan for %s: %s", notice.event_id, self.current.describe())
        if size_from is SizeFrom.UNKNOWN:
            logger.warning("deadline plan for %s is a guess: %s", notice.event_id, UNKNOWN_SIZE)
        self.bus.emit(PlanChanged(notice, self.current))
        return self.current

    def revise(self, forecast: dict[str, Any] | None) -> Plan | None:
        """Update the current plan from the uploader's forecast of the urgent upload; the route moves
        only towards more safety (bucket -> peer or local, local -> peer), never back."""
        if self.current is None or self._notice is None:
            return None
        notice, old = self._notice, self.current
        left = notice.seconds_left()
        # The urgent checkpoint's own size once it is known: announced files, or its commit.
        newest = max((sum(files.values()) for files in self._announced.values()), default=0)
        size, size_from = self.size()
        if old.bytes > size:  # e.g. the trainer that announced it has gone: its number still stands
            size, size_from = old.bytes, old.size_from
        done, rate, urgent = 0, self.meter.rate(), newest
        if forecast is not None and forecast.get("urgent"):
            # What the trainer has written so far is a better size than the last checkpoint's (there
            # may be none); the live rate, once a part is in, is better than the recent uploads' one.
            urgent, done = max(urgent, int(forecast["bytes_total"])), int(forecast["bytes_done"])
            if forecast.get("rate_bytes_s") and done >= PROBE_BYTES:  # a few small files say little of a rate
                rate = float(forecast["rate_bytes_s"])
        if urgent > size:
            size, size_from = urgent, SizeFrom.URGENT
        made = choose_route(
            max(0, size - done),
            rate,
            left,
            peer_available=self.peer_available(),
            bucket=self.bucket,
            size_from=size_from,
        )
        made = replace(made, bytes=size)
        route = old.route
        if made.route is Route.PEER or (made.route is Route.LOCAL and old.route is Route.BUCKET):
            route = made.route
        elif old.route is Route.PEER and not self.peer_available():
            route = made.route  # the peer route failed (no free peer, a broken handoff)
        why = made.why if route is made.route else old.why
        revision = old.revision + (route is not old.route)
        self.current = replace(made, route=route, why=why, event_id=old.event_id, revision=revision)
        if route is not old.route:
            logger.warning("deadline plan for %s revised: %s", notice.event_id, self.current.describe())
            self.bus.emit(PlanChanged(notice, self.current))
        return self.current

    def end(self) -> None:
        self.current = None
        self._notice = None
        self._announced.clear()


def probe_upload(storage: Storage, size: int = PROBE_BYTES) -> tuple[int, float]:
    """Upload ``size`` random bytes under ``.spotguard-rate-probe/``, time it, delete it (blocking).

    One object on one stream: a lower bound of what the uploader's parallel streams get, which is
    the safe side for a plan."""
    key = f"{PROBE_PREFIX}/{uuid.uuid4().hex}.bin"
    started = time.monotonic()  # the scratch file it goes through costs nothing beside the upload
    try:
        put_bytes(storage, key, os.urandom(size))
        return size, time.monotonic() - started
    finally:
        storage.delete([key])


def sweep_rate_probes(storage: Storage, older_than: timedelta, now: datetime | None = None) -> int:
    """Delete the probe objects (and a file:// store's temporary copies of them) untouched for
    ``older_than``; how many. A daemon killed between a probe's upload and its delete leaves its
    object for good; a younger one may be another daemon's probe under way (a fleet starts at once)."""
    now = now or cloud_now()  # the store's stamps are the cloud's time (spotguard/cloudclock.py)
    prefix = f"{PROBE_PREFIX}/"
    objects, temporaries = storage.listing(prefix)
    found = objects + temporaries
    stale = [obj.key for obj in found if obj.modified is not None and obj.modified + older_than <= now]
    if stale:
        storage.delete(stale)
    return len(stale)


__all__ = [
    "FIT_FRACTION",
    "PROBE_PREFIX",
    "AnnouncedSizes",
    "Plan",
    "Planner",
    "RateMeter",
    "Route",
    "SizeFrom",
    "choose_route",
    "probe_upload",
    "sweep_rate_probes",
]
