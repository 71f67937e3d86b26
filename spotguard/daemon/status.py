"""What ``spotguard status`` shows: the daemon's state as one JSON-ready dict."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

from spotguard.cloudclock import measured_lead
from spotguard.daemon.notices import NoticeBook, TrackedNotice
from spotguard.daemon.plan import Planner
from spotguard.daemon.server import Peer, SocketServer
from spotguard.daemon.uploader import Uploader
from spotguard.notice import steady_now
from spotguard.providers.base import Monitor
from spotguard.version import __version__


class StatusSource(Protocol):
    """The parts of the daemon its status is read from."""

    provider: str
    monitors: list[Monitor]
    monitor_errors: dict[str, str]
    root: Path
    server: SocketServer
    notices: NoticeBook
    last_notice: dict[str, Any] | None
    stalled: dict[int, dict[str, Any]]
    uploader: Uploader
    save_failures: list[dict[str, Any]]
    metrics_url: str | None
    planner: Planner

    def plan_status(self) -> dict[str, Any] | None: ...

    def measured_rate(self) -> float | None: ...


def render_status(source: StatusSource, *, peers: dict[str, Any] | None, stopping: bool) -> dict[str, Any]:
    current = source.notices.current()
    return {
        "version": __version__,
        "pid": os.getpid(),
        "provider": source.provider,
        "monitors": [monitor.name for monitor in source.monitors],
        "monitor_errors": dict(source.monitor_errors),
        "checkpoint_dir": str(source.root),
        "trainers": [trainer_status(p, source.planner) for p in source.server.trainers() if p.hello is not None],
        "pending": None if current is None else notice_status(current),
        "last_notice": source.last_notice,
        "stalled": list(source.stalled.values()),
        "uploads": source.uploader.status(),
        "save_failures": source.save_failures[-5:],
        "plan": source.plan_status(),
        "upload_rate_bytes_s": None if (rate := source.measured_rate()) is None else round(rate),
        "peers": peers,
        "stopping": stopping,
        "metrics_url": source.metrics_url,
        # Seconds this VM's clock runs ahead of the metadata service's (its Date header), last measured.
        "clock_ahead_s": None if (lead := measured_lead()) is None else round(lead, 1),
    }


def trainer_status(peer: Peer, planner: Planner) -> dict[str, Any]:
    """A connected trainer: who it is, and what it announced its state takes (null: nothing yet)."""
    hello, announced = peer.hello or {}, planner.announced.of(peer.id)
    return {
        "pid": peer.pid,
        "uid": peer.uid,
        "rank": hello.get("rank"),
        "world_size": hello.get("world_size"),
        "state_bytes": None if announced is None else announced[0],
        "sharded": None if announced is None else announced[1],
        "version": hello.get("version"),  # the hook's spotguard (null: one from before hooks said it)
    }


def notice_status(tracked: TrackedNotice) -> dict[str, Any]:
    return {
        **tracked.notice.to_dict(),
        "action": str(tracked.action),
        "state": str(tracked.state),
        "seconds_left": round(max(0.0, tracked.notice.seconds_left()), 3),
        "over_in_s": round(max(0.0, tracked.seconds_to_end(steady_now())), 3),
    }


def plan_status_of(planner: Planner, notices: NoticeBook) -> dict[str, Any] | None:
    """The deadline plan of the pending notice (None when none is pending)."""
    plan = planner.current
    return None if plan is None or notices.current() is None else plan.to_dict()
