"""Prometheus metrics for the daemon (off unless ``metrics_port`` is set).

Every metric lives in the registry passed in (tests build a fresh ``CollectorRegistry()``);
only :func:`spotguard.daemon.app.build_and_run` builds the real one.

``/metrics`` is served by an aiohttp handler on the daemon's own event loop, not by
``prometheus_client.start_http_server``:

* two values (trainers connected, seconds left on the pending notice) are read from the
  daemon's state when scraped; on the loop thread that needs no locks, whereas the client
  library's server thread would read the daemon's dicts while the loop changes them;
* the server starts and stops with the daemon and no extra thread is left behind;
* aiohttp is already the daemon's HTTP stack. (A scrape does wait for a busy loop, but the
  loop must never be busy for long anyway: blocking work runs in threads.)

A port that cannot be bound is logged and the daemon runs on without metrics: losing a
checkpoint over a monitoring port would be the wrong trade.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

from spotguard.cloudclock import measured_lead
from spotguard.daemon.events import (
    CheckpointSaved,
    DaemonEvents,
    Event,
    MonitorFailed,
    NoticeSeen,
    SaveFailed,
    TrainerStalled,
    UploadCommitted,
    UploadFailed,
)
from spotguard.manifest import REASONS
from spotguard.notice import Action
from spotguard.peer.replicas import ReplicaState
from spotguard.protocol import SAVE_FAILURES

if TYPE_CHECKING:
    from aiohttp import web


logger = logging.getLogger("spotguard.metrics")

MiB = 1024 * 1024
# 1 MiB .. 1 TiB in steps of 4x: a toy model to a large sharded one.
SIZE_BUCKETS = tuple(float(MiB * 4**k) for k in range(11))
# Around the notice windows: GCP/Azure 30 s, AWS 120 s.
SECONDS_BUCKETS = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0)


class _LiveCollector:
    """Values read from the daemon at scrape time rather than pushed on every change."""

    def __init__(self) -> None:
        self.trainers: Callable[[], int] = lambda: 0
        self.other_versions: Callable[[], int] = lambda: 0
        self.pending_seconds: Callable[[], float | None] = lambda: None
        self.stalled: Callable[[], int] = lambda: 0
        self.plan: Callable[[], dict[str, Any] | None] = lambda: None
        self.measured_rate: Callable[[], float | None] = lambda: None
        self.peers: Callable[[], dict[str, Any] | None] = lambda: None
        self.newest_in_bucket: Callable[[], float | None] = lambda: None

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "spotguard_trainers_connected", "Trainer hooks connected to the daemon's socket", value=self.trainers()
        )
        yield GaugeMetricFamily(
            "spotguard_trainers_on_another_version",
            "Trainer hooks connected whose spotguard version is not the daemon's (or that do not say theirs): "
            "a fleet half upgraded; upgrade the older side",
            value=self.other_versions(),
        )
        pending = GaugeMetricFamily(
            "spotguard_pending_notice_seconds_left",
            "Seconds until the deadline of the notice trainers must act on (negative once passed); "
            "absent when no notice is pending",
        )
        seconds = self.pending_seconds()
        if seconds is not None:
            pending.add_metric([], seconds)
        yield pending
        yield GaugeMetricFamily(
            "spotguard_trainers_stalled",
            "Trainers told of the pending notice that have not reached a checkpoint point within the bound",
            value=self.stalled(),
        )
        clock = GaugeMetricFamily(
            "spotguard_clock_ahead_seconds",
            "Seconds this VM's clock runs ahead of the metadata service's Date header (negative: behind), "
            "as last measured; absent without a metadata service",
        )
        if (lead := measured_lead()) is not None:
            clock.add_metric([], lead)
        yield clock
        newest = GaugeMetricFamily(
            "spotguard_newest_bucket_checkpoint_timestamp_seconds",
            "When the newest complete checkpoint in the bucket was made (its manifest's time, Unix seconds): "
            "what a replacement VM resumes from; absent until the daemon has listed the bucket or committed one",
        )
        if (made := self.newest_in_bucket()) is not None:
            newest.add_metric([], made)
        yield newest
        yield from self._plan_families()
        yield from _peer_families(self.peers())

    def _plan_families(self) -> Iterator[Metric]:
        """The deadline plan of the pending notice; every family is empty while none is pending."""
        plan = self.plan()
        route = GaugeMetricFamily(
            "spotguard_plan_route",
            "The pending notice's deadline plan: 1 for its route (bucket, peer, local)",
            labels=["route"],
        )
        families = {
            "bytes": GaugeMetricFamily("spotguard_plan_bytes", "The state's size the deadline plan counts with"),
            "rate_bytes_s": GaugeMetricFamily(
                "spotguard_plan_rate_bytes_per_second", "The upload rate the deadline plan counts with"
            ),
            "seconds_needed": GaugeMetricFamily(
                "spotguard_plan_seconds_needed", "Seconds the deadline plan expects the bucket upload to take"
            ),
            "seconds_left": GaugeMetricFamily(
                "spotguard_plan_seconds_left", "Seconds to the deadline when the plan was last revised"
            ),
        }
        known = GaugeMetricFamily(
            "spotguard_plan_size_known",
            "1 when the deadline plan's size is known (source: announced, checkpoint, announced+checkpoint, "
            "urgent-checkpoint), 0 when it is a guess (source: unknown)",
            labels=["source"],
        )
        if plan is not None:
            route.add_metric([plan["route"]], 1)
            for key, family in families.items():
                if plan[key] is not None:
                    family.add_metric([], plan[key])
            known.add_metric([plan["size_from"]], 0 if plan["size_from"] == "unknown" else 1)
        yield route
        yield from families.values()
        yield known
        measured = GaugeMetricFamily(
            "spotguard_upload_rate_bytes_per_second",
            "Upload rate of recent uploads and the start-up probe (absent before any was measured)",
        )
        rate = self.measured_rate()
        if rate is not None:
            measured.add_metric([], rate)
        yield measured


def _peer_families(peers: dict[str, Any] | None) -> Iterator[Metric]:
    """The peer tier, from its status: absent where it is off, the receiver's where this daemon
    listens. During a token rotation, ``count by (token) (spotguard_peer_token_info)`` says how many VMs
    run each token, and a receiver whose previous-token handshakes stop growing is asked by nobody
    with the old token any more (docs/security.md, "Rotating")."""
    if peers is None:
        return
    if peers.get("token") is not None:
        info = GaugeMetricFamily(
            "spotguard_peer_token_info",
            "The peer token this daemon uses and, during a rotation, the one it accepts besides it "
            "(fingerprints: 8 hex digits of a salted SHA-256; previous_token empty when none)",
            labels=["token", "previous_token"],
        )
        info.add_metric([peers["token"], peers.get("previous_token") or ""], 1)
        yield info
    handoff = peers.get("handoff")
    if handoff is not None:  # this daemon hands over to peers
        handoffs = CounterMetricFamily(
            "spotguard_peer_handoffs",
            "Handoffs of an urgent checkpoint to a peer that ended, by outcome (handed: a peer verified it; "
            "failed: none did, and the bucket upload went on alone)",
            labels=["outcome"],
        )
        for outcome in ("handed", "failed"):
            handoffs.add_metric([outcome], handoff["totals"][outcome])
        yield handoffs
        yield CounterMetricFamily(
            "spotguard_peer_handoff_moves",
            "Peers a handoff left once bytes had gone to them (its disk filled, it went away), sending the "
            "replica again to the next",
            value=handoff["totals"]["moves"],
        )
    if "handshakes" not in peers:  # this daemon does not listen
        return
    handshakes = CounterMetricFamily(
        "spotguard_peer_handshakes",
        "Peer connections this daemon's receiver authenticated, by the token they proved (current, previous)",
        labels=["token"],
    )
    handshakes.add_metric(["current"], peers["handshakes"]["token"])
    handshakes.add_metric(["previous"], peers["handshakes"]["previous_token"])
    yield handshakes
    yield CounterMetricFamily(
        "spotguard_peer_connections_refused",
        "Peer connections refused: a failed handshake (a wrong token, a stranger), a broken protocol, too slow",
        value=peers["refused"],
    )
    replicas = GaugeMetricFamily(
        "spotguard_peer_replicas", "Replicas of other VMs' checkpoints this daemon holds, by state", labels=["state"]
    )
    for state in map(str, ReplicaState):
        replicas.add_metric([state], sum(1 for replica in peers["replicas"] if replica["state"] == state))
    yield replicas


class DaemonMetrics:
    """The daemon's metrics, registered in ``registry``; :meth:`attach` feeds them from a daemon.

    >>> registry = CollectorRegistry()
    >>> metrics = DaemonMetrics(registry)
    >>> metrics.attach(daemon)                      # one observer of the daemon's event stream
    >>> server = MetricsServer(registry, "127.0.0.1", 9464)
    >>> url = await server.start()                  # http://127.0.0.1:9464/metrics
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._register_trainer_metrics(registry)
        self._register_upload_metrics(registry)
        self._live = _LiveCollector()
        registry.register(self._live)
        self._margin_of_last_commit: Callable[[], float | None] = lambda: None

    def _register_trainer_metrics(self, registry: CollectorRegistry) -> None:
        """Notices, the trainers' saves and stalls, the monitors' errors."""
        self.notices = Counter(
            "spotguard_notices",
            "Notices seen (once per event id), by provider, kind and the action taken",
            ["provider", "kind", "action"],
            registry=registry,
        )
        self.checkpoints_saved = Counter(
            "spotguard_checkpoints_saved",
            "Checkpoints trainers committed locally, by reason (urgent, periodic, soft, final)",
            ["reason"],
            registry=registry,
        )
        self.checkpoint_bytes = Gauge(
            "spotguard_checkpoint_bytes", "Size of the last checkpoint a trainer committed locally", registry=registry
        )
        self.monitor_errors = Counter(
            "spotguard_monitor_errors", "Failed metadata checks, by monitor", ["monitor"], registry=registry
        )
        self.trainer_stalls = Counter(
            "spotguard_trainer_stalls",
            "Trainers reported for not reaching a checkpoint point within the bound after a notice",
            registry=registry,
        )
        self.save_failures = Counter(
            "spotguard_save_failures",
            "Checkpoints a trainer failed to write locally, by reason (urgent, periodic, ...) and error "
            "(disk-full, write-failed)",
            ["reason", "error"],
            registry=registry,
        )

    def _register_upload_metrics(self, registry: CollectorRegistry) -> None:
        """The bucket: sizes, durations, the margin at the deadline, failures."""
        self.upload_bytes = Histogram(
            "spotguard_upload_bytes",
            "Size of each checkpoint committed in the bucket",
            buckets=SIZE_BUCKETS,
            registry=registry,
        )
        self.upload_seconds = Histogram(
            "spotguard_upload_duration_seconds",
            "Time from the start of a checkpoint's upload to its manifest being committed in the bucket",
            buckets=SECONDS_BUCKETS,
            registry=registry,
        )
        self.deadline_margin = Gauge(
            "spotguard_deadline_margin_seconds",
            "Seconds to spare at the deadline for the last checkpoint committed while a notice was pending "
            "(negative: committed after the deadline)",
            registry=registry,
        )
        self.upload_failures = Counter(
            "spotguard_upload_failures", "Failed upload attempts (each is retried)", registry=registry
        )
        self.upload_failing_streak = Gauge(
            "spotguard_upload_failing_streak",
            "Failed attempts in a row of the checkpoint failing most among those still to upload "
            "(alert at upload_alert_after, 5 by default; 0 when none is failing)",
            registry=registry,
        )

    def attach(self, daemon: DaemonEvents) -> None:
        uploader = daemon.uploader
        self.upload_failing_streak.set_function(uploader.failing_streak)
        self._margin_of_last_commit = lambda: (uploader.last_committed or {}).get("deadline_margin_s")
        daemon.bus.subscribe(Event, self.observe)

        def pending_seconds() -> float | None:
            pending = daemon.pending
            if pending is None:
                return None
            left = pending[0].seconds_left()
            # A soft notice is over once its time has passed; a hard one holds (the daemon keeps it).
            return left if left > 0 or pending[1] is Action.STOP else None

        self._live.trainers = daemon.trainer_count
        self._live.other_versions = daemon.trainers_on_another_version
        self._live.pending_seconds = pending_seconds
        self._live.stalled = lambda: len(daemon.stalled)
        self._live.plan = daemon.plan_status
        self._live.measured_rate = daemon.measured_rate
        self._live.peers = daemon.peer_status
        self._live.newest_in_bucket = uploader.newest_in_bucket

    # --- the event stream (on the daemon's loop; never blocks) ----------------------------

    def observe(self, event: Event) -> None:
        """Count what ``event`` tells; the kinds no metric counts pass by."""
        match event:
            case NoticeSeen(notice=notice, action=action):
                self.notices.labels(notice.provider, str(notice.kind), str(action)).inc()
            case CheckpointSaved(manifest=manifest):
                # The manifest's reason is what its writer put on disk: bounded as a socket client's are.
                self.checkpoints_saved.labels(manifest.reason if manifest.reason in REASONS else "other").inc()
                self.checkpoint_bytes.set(manifest.total_bytes)
            case UploadCommitted(manifest=manifest, seconds=seconds):
                self.upload_bytes.observe(manifest.total_bytes)
                self.upload_seconds.observe(seconds)
                margin = self._margin_of_last_commit()
                if margin is not None:
                    self.deadline_margin.set(margin)
            case UploadFailed():
                self.upload_failures.inc()
            case MonitorFailed(monitor=monitor):
                self.monitor_errors.labels(monitor).inc()
            case TrainerStalled():
                self.trainer_stalls.inc()
            case SaveFailed(failure=failure):
                # Label values from a socket client are bounded: any other string would be a series of its own.
                reason = failure["reason"] if failure["reason"] in REASONS else "other"
                error = failure["error"] if failure["error"] in SAVE_FAILURES else "other"
                self.save_failures.labels(reason, error).inc()


class MetricsServer:
    """``GET /metrics`` for one registry, on the running event loop (see the module docstring)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self.registry = registry
        self.host = host
        self.port = port
        self.url: str | None = None
        self._runner: web.AppRunner | None = None

    async def start(self) -> str | None:
        """Start serving; returns the URL, or None (logged) when the address cannot be bound."""
        from aiohttp import web

        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port).start()
        except OSError as exc:
            logger.error("metrics: cannot listen on %s port %d: %s; running without metrics", self.host, self.port, exc)
            await runner.cleanup()
            return None
        self._runner = runner
        port = runner.addresses[0][1]  # the real one when 0 was asked for
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{port}/metrics"
        logger.info("metrics on %s", self.url)
        return self.url

    async def _metrics(self, request: web.Request) -> web.Response:
        from aiohttp import web

        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encoder(self.registry), headers={"Content-Type": content_type})

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


__all__ = ["DaemonMetrics", "MetricsServer"]
