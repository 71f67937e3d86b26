"""The daemon: monitors -> notices -> trainers, saved checkpoints -> uploader.

The only place real clients (HTTP session, storage backend) are built is
:func:`build_and_run`; :class:`Daemon` takes them as arguments so tests can
hand in their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from spotguard.config import ConfigError, DaemonConfig
from spotguard.daemon import heap
from spotguard.daemon.events import (
    EventBus,
    MonitorFailed,
    NoticeMoved,
    NoticeSeen,
    PlanChanged,
    UploadCommitted,
)
from spotguard.daemon.lock import hold_daemon_lock
from spotguard.daemon.notices import EventLog, NoticeBook, TrackedNotice, clock_checked
from spotguard.daemon.notify import SystemdNotifier, watchdog_loop
from spotguard.daemon.peering import Peering
from spotguard.daemon.plan import Planner, probe_upload, sweep_rate_probes
from spotguard.daemon.requests import RequestHandler, checkpoint_now
from spotguard.daemon.server import SocketServer
from spotguard.daemon.stall import StallWatch
from spotguard.daemon.status import plan_status_of, render_status
from spotguard.daemon.supervise import keep_running
from spotguard.daemon.uploader import Uploader
from spotguard.notice import Action, Notice, steady_now, utcnow
from spotguard.peer.discovery import PeerRegistry
from spotguard.peer.handoff import Handoff
from spotguard.peer.receiver import PeerReceiver
from spotguard.peer.tokens import JobToken, token_weakness
from spotguard.peer.wire import load_job_token
from spotguard.providers.base import Acknowledgements, Monitor, MonitorError
from spotguard.repeats import RepeatedErrors
from spotguard.storage.base import Capability, Storage, StorageError
from spotguard.storage.journal import UploadJournal
from spotguard.version import __version__

logger = logging.getLogger("spotguard.daemon")

_PLAN_REVISE_INTERVAL = 1.0  # seconds between revisions of the deadline plan while a notice is pending
# A metadata service that keeps failing (a container's IMDS hop limit, a blocked route) fails every
# poll for the daemon's life: its error is logged when it first comes or changes, then again this
# often, not at every poll (86,400 lines a day at the default interval).
MONITOR_WARN_EVERY = 600.0


def _build_uploader(config: DaemonConfig, storage: Storage | None, root: Path, bus: EventBus) -> Uploader:
    return Uploader(
        storage,
        root,
        keep_local=config.keep_local,
        keep_remote=config.keep_remote,
        incomplete_grace=config.incomplete_grace,
        concurrency=config.upload_concurrency,
        retry_max=config.upload_retry_max,
        alert_after=config.upload_alert_after,
        scan_interval=config.scan_interval,
        bucket_scan_interval=config.bucket_scan_interval,
        forecast_interval=config.forecast_interval,
        bus=bus,
    )


class Daemon:
    def __init__(
        self,
        config: DaemonConfig,
        *,
        provider: str,
        monitors: Sequence[Monitor] = (),
        storage: Storage | None = None,
        notifier: SystemdNotifier | None = None,
        peer_token: JobToken | None = None,
    ) -> None:
        self.config = config
        self.notifier = notifier or SystemdNotifier({})
        self.provider = provider
        self.monitors = list(monitors)
        self.acknowledgements = Acknowledgements()  # sent once a notice's checkpoint is in the bucket
        self.storage = storage
        self.root = config.checkpoint_dir.absolute()
        # The one event stream: every service emits on it; the daemon's own handlers subscribe first
        # (a commit is acknowledged before metrics and webhook hear of it), observers in attach().
        self.bus = EventBus()
        self.events = EventLog(config.state_dir, self.root, spare_dir=config.socket.parent)
        self.notices = NoticeBook(self.events, grace=config.notice_grace, bus=self.bus)
        self.bus.subscribe(NoticeMoved, self._notice_moved)
        self._notices_changed = asyncio.Event()  # wakes the task that ends notices on time
        # Set while a notice is pending or held: the loops that only work then (the plan's revisions,
        # the stall watch) wait for it instead of waking several times a second for months.
        self._notice_live = asyncio.Event()
        self.uploader = _build_uploader(config, storage, self.root, self.bus)
        self.bus.subscribe(UploadCommitted, self._on_committed)
        self.peering = Peering(
            config,
            storage=storage,
            root=self.root,
            token=peer_token,  # the job's shared secret: never logged, never in status
            submit=lambda path: self.uploader.submit(path, urgent=False),
        )
        # The deadline plan: what it is made of (state size, upload rate) is fed from the event stream.
        self.planner = Planner(peer_available=self.peering.available, bucket=storage is not None, bus=self.bus)
        self.bus.subscribe(PlanChanged, lambda event: self.peering.follow_plan(event.notice, event.plan))
        self.bus.subscribe(UploadCommitted, self._measure_upload)
        self._stopping = asyncio.Event()
        self.heap_trims = 0  # the heaps' free pages given back while idle (_trim_heap)
        self.requests = RequestHandler(self, stopping=self._stopping.is_set)
        self.server = SocketServer(
            config.socket,
            self.requests.handle,
            allowed_uids=config.allowed_uids,
            allowed_gids=config.allowed_gids,
            trainer_uids=config.trainer_uids,
            max_message_bytes=config.max_message_bytes,
            max_connections=config.max_connections,
            on_disconnect=self.requests.on_disconnect,
        )
        self._init_observed_state()

    def _init_observed_state(self) -> None:
        """What the daemon shows (status, metrics, webhook; observers subscribe to ``bus``)."""
        self.last_notice: dict[str, Any] | None = None  # its timeline, for status and reports
        self.stalls = StallWatch(
            min_seconds=self.config.stall_min_seconds,
            fraction=self.config.stall_fraction,
            trainers=self.server.trainers,
            pending=lambda: self.pending,
            bus=self.bus,
        )
        self.stalled = self.stalls.stalled  # peer id -> its report, while it stays stalled
        self.save_failures: list[dict[str, Any]] = []  # the last few, newest last
        self.metrics_url: str | None = None  # set by build_and_run when metrics are served
        self.monitor_errors: dict[str, str] = {}
        self._monitor_warnings = RepeatedErrors(MONITOR_WARN_EVERY)
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def peer_receiver(self) -> PeerReceiver | None:
        return self.peering.receiver

    @property
    def registry(self) -> PeerRegistry | None:
        return self.peering.registry

    @property
    def handoff(self) -> Handoff | None:
        return self.peering.handoff

    @property
    def bucket_url(self) -> str | None:
        return self.storage.url if self.storage is not None else None

    def trainer_count(self) -> int:
        return len(self.server.trainers())

    def trainers_on_another_version(self) -> int:
        return sum(1 for peer in self.server.trainers() if (peer.hello or {}).get("version") != __version__)

    # --- notices -----------------------------------------------------------------------

    def action_for(self, notice: Notice) -> Action:
        # GCP TERMINATE_ON_HOST_MAINTENANCE: GPU VMs cannot live-migrate, so it ends the VM.
        if notice.is_hard or notice.raw.get("terminates") is True:
            return Action.STOP
        return self.config.action_for_soft(str(notice.kind))

    async def on_notice(self, notice: Notice) -> bool:
        """Act on a notice once per event id (also across restarts). True if it was acted on now."""
        self.acknowledgements.remember(notice)
        if self.notices.seen(notice.event_id) or self.notices.outlived(notice):
            return False
        notice = clock_checked(notice)
        action = self.action_for(notice)
        if action is Action.IGNORE:
            self.notices.ignore(notice)
            logger.info("ignoring %s notice %s (policy)", notice.kind, notice.event_id)
            await self.bus.emit_async(NoticeSeen(notice, action))
            return True
        logger.warning(
            "%s %s notice %s: deadline %s (%.0f s); telling %d trainer(s) to %s",
            notice.provider,
            notice.kind,
            notice.event_id,
            notice.deadline.isoformat(),
            notice.seconds_left(),
            len(self.server.trainers()),
            "checkpoint and stop" if action is Action.STOP else "checkpoint",
        )
        self._start_timeline(self.notices.open(notice, action))
        message_type, fields = checkpoint_now(notice, action)
        self.stalls.mark_told(self.server.trainers(), notice)
        told = await self.server.broadcast(message_type, **fields)
        if self.last_notice is not None:
            self.last_notice["told_at"] = utcnow().isoformat()
            self.last_notice["trainers_told"] = told
        # After the trainers are told (they must not wait for it), before the observers hear of it.
        self.planner.plan(notice)
        await self.bus.emit_async(NoticeSeen(notice, action))
        return True

    def _start_timeline(self, tracked: TrackedNotice) -> None:
        notice = tracked.notice
        self.last_notice = {
            "event_id": notice.event_id,
            "provider": notice.provider,
            "kind": str(notice.kind),
            "action": str(tracked.action),
            "deadline": notice.deadline.isoformat(),
            "received_at": notice.received.isoformat(),
            "state": str(tracked.state),
        }
        self._notice_moved(NoticeMoved(tracked, tracked.state))

    def _notice_moved(self, event: NoticeMoved) -> None:
        """After every change of notice state (and when its timeline starts): the timeline shows it;
        the uploader races the current notice's deadline, or none once every notice is over."""
        tracked, old = event.tracked, event.old
        if self.last_notice is not None and self.last_notice.get("event_id") == tracked.event_id:
            self.last_notice["state"] = str(tracked.state)
            if tracked.state is not old:
                self.last_notice[f"{tracked.state}_at"] = utcnow().isoformat()
        current = self.notices.peek()
        self.uploader.set_deadline(None if current is None else current.notice.monotonic_deadline)
        if self.notices.current() is None:
            self._notice_live.clear()
            self.planner.end()
            if self.handoff is not None:
                self.handoff.reset()
        else:
            self._notice_live.set()
        self._notices_changed.set()

    @property
    def pending(self) -> tuple[Notice, Action] | None:
        """The notice trainers are told about now (pending or held), if any."""
        current = self.notices.current()
        return None if current is None else (current.notice, current.action)

    async def _end_notices_on_time(self) -> None:
        """Move notices to over when their time is up, even if nobody asks the daemon anything."""
        while True:
            self._notices_changed.clear()
            self.notices.expire()
            wait = self.notices.seconds_to_next_change()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._notices_changed.wait(), None if wait is None else wait + 0.01)

    # --- trainers that do not act on a notice ------------------------------------------

    def stall_bound(self, notice: Notice) -> float:
        """Seconds a told trainer may take to reach a checkpoint point before it is reported."""
        return self.stalls.bound(notice)

    async def _on_committed(self, event: UploadCommitted) -> None:
        name, event_id = event.name, event.manifest.meta.get("event_id")
        if self.last_notice is not None and self.last_notice.get("checkpoint") == name:
            self.last_notice["committed_at"] = utcnow().isoformat()
        if isinstance(event_id, str) and event_id in self.events:
            self.notices.checkpointed(event_id, committed=name)
            await self.acknowledgements.send(event_id)

    # --- status ------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return render_status(self, peers=self.peer_status(), stopping=self._stopping.is_set())

    def hard_notice_pending(self) -> bool:
        """What a peer asks before it hands this daemon a checkpoint: a VM going away is no rescue."""
        pending = self.pending
        return pending is not None and pending[1] is Action.STOP

    def plan_status(self) -> dict[str, Any] | None:
        """The deadline plan of the pending notice (None when none is pending)."""
        return plan_status_of(self.planner, self.notices)

    def measured_rate(self) -> float | None:
        """Bytes per second recent uploads (and the start-up probe) reached."""
        return self.planner.meter.rate()

    def peer_status(self) -> dict[str, Any] | None:
        """The peer tier's part of the status (None where it is off)."""
        return self.peering.status()

    def _measure_upload(self, event: UploadCommitted) -> None:
        self.planner.observe_upload(event.manifest.total_bytes, event.seconds)

    async def _revise_plan(self) -> None:
        """While a notice is pending, revise its plan from the uploader's live forecast."""
        while not self._stopping.is_set():
            await self._notice_live.wait()
            if self.notices.current() is not None:
                self.planner.revise(self.uploader.forecast())
            await self._pause(_PLAN_REVISE_INTERVAL)

    async def _probe_rate(self) -> None:
        """A small upload at start, so that the first notice's plan has a rate to go on."""
        await asyncio.to_thread(self.planner.size_from_disk, self.root)
        if self.storage is None:
            return
        try:
            nbytes, seconds = await asyncio.to_thread(probe_upload, self.storage)
        except (StorageError, OSError) as exc:
            logger.warning("the upload-rate probe failed: %s; plans use the next upload's rate", exc)
            return
        self.planner.observe_upload(nbytes, seconds)
        logger.info("upload-rate probe: %d bytes in %.2f s (%.1f MB/s)", nbytes, seconds, nbytes / seconds / 1e6)

    # --- lifetime ----------------------------------------------------------------------

    async def _check_once(self, monitor: Monitor) -> None:
        try:
            notices = await monitor.check_all()
        except MonitorError as exc:
            if self._monitor_failed(monitor.name, str(exc), exc):
                logger.warning("%s", exc)
            return
        except Exception as exc:  # a monitor bug must not stop the others or the daemon
            if self._monitor_failed(monitor.name, repr(exc), exc):
                logger.exception("%s monitor failed", monitor.name)
            return
        if self.monitor_errors.pop(monitor.name, None) is not None:
            self._monitor_warnings.clear(monitor.name)
            logger.info("%s: the metadata service answers again", monitor.name)
        for notice in notices:
            await self.on_notice(notice)

    def _monitor_failed(self, name: str, error: str, exc: Exception) -> bool:
        """Note a failed check (status, metric); whether to log it: a new or changed error, or the same
        one last logged :data:`MONITOR_WARN_EVERY` seconds ago."""
        self.monitor_errors[name] = error
        self.bus.emit(MonitorFailed(name, exc))
        if self._monitor_warnings.due(name, error):
            return True
        logger.debug("%s (still failing)", error)
        return False

    async def _watch(self, monitor: Monitor) -> None:
        while not self._stopping.is_set():
            started = asyncio.get_running_loop().time()
            await self._check_once(monitor)
            spent = asyncio.get_running_loop().time() - started
            await self._pause(max(0.0, monitor.interval - spent))

    async def _pause(self, seconds: float) -> None:
        """Wait ``seconds``, or until the daemon is stopping if that comes first."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    async def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for tracked in self.notices.restore():
            # Restarted mid-incident: the notice still holds for trainers that (re)connect.
            logger.warning(
                "a %s notice (%s) is still %s from before a restart",
                tracked.notice.kind,
                tracked.event_id,
                tracked.state,
            )
            self._start_timeline(tracked)
        # Before the socket: whoever sees the daemon answer sees its peer receiver listening too.
        await self.peering.start_receiver(self.hard_notice_pending)
        if self.peering.receiver is not None:  # room kept for this node's own next checkpoint: its state's size
            # (the larger of what the trainers announce and the last checkpoint's; None: read the disk)
            self.peering.receiver.store.admission.own_bytes = lambda: self.planner.size()[0] or None
        await self.server.start()
        # Restarted in the middle of an incident? Ask every source once before declaring READY.
        first_checks = asyncio.gather(*(self._check_once(m) for m in self.monitors))
        try:
            await asyncio.wait_for(first_checks, self.config.http_timeout * 2 + 1)
        except TimeoutError:
            logger.warning("the first metadata check took longer than %.0f s", self.config.http_timeout * 2 + 1)
        if self.storage is not None:
            await _sweep_store(self.storage, self.config)
        await asyncio.to_thread(self.events.flush)  # what READY promises is on disk too
        services: dict[str, Callable[[], Awaitable[None]]] = {
            "uploader": self.uploader.run,
            "stall-watch": lambda: self.stalls.watch(self._stopping, self._notice_live),
            "notice-lifecycle": self._end_notices_on_time,
            "rate-probe": self._probe_rate,
            "plan-revise": self._revise_plan,
            "heap-trim": self._trim_heap,
            **{f"monitor-{m.name}": functools.partial(self._watch, m) for m in self.monitors},
            "watchdog": lambda: watchdog_loop(self.notifier, self.notifier.watchdog_interval()),
        }
        self._tasks = [asyncio.create_task(keep_running(name, run), name=name) for name, run in services.items()]

    def request_stop(self) -> None:
        self._stopping.set()

    async def _trim_heap(self) -> None:
        """Every :data:`~spotguard.daemon.heap.TRIM_INTERVAL`, while no notice is pending and nothing
        is uploading, give the heaps' free pages back (spotguard/daemon/heap.py): a daemon runs for
        months, and what one upload's buffers left in them is no use until the next."""
        while not self._stopping.is_set():
            await self._pause(heap.TRIM_INTERVAL)
            if self.may_trim_heap() and not self._stopping.is_set():
                await asyncio.to_thread(heap.release_free_memory)
                self.heap_trims += 1

    def may_trim_heap(self) -> bool:
        """Nothing in a hurry: a trim mid-race would only make the next buffers fault their pages in again."""
        return self.pending is None and self.uploader.idle.is_set()

    async def serve_until_stopped(self) -> int:
        await self.start()
        monitors = ", ".join(m.name for m in self.monitors) or "drills and SIGTERM only"
        logger.info("spotguard %s ready (provider %s: %s)", __version__, self.provider, monitors)
        self.notifier.ready(f"watching {self.provider} ({monitors}); bucket {self.config.bucket or 'none'}")
        await self._stopping.wait()
        return await self.shutdown()

    async def shutdown(self) -> int:
        """Stop taking new work, finish uploads until the pending deadline (or the grace time), exit."""
        self._stopping.set()
        await self.server.stop_accepting()
        await self.peering.stop_registry()
        current = self.notices.current()
        budget = self.config.shutdown_grace
        if current is not None:
            # Up to the deadline; past it (held), what is left of the grace: the VM is still here.
            left = current.notice.seconds_left()
            if left <= 0:
                left = current.seconds_to_end(steady_now())
            budget = max(0.0, min(budget, left))
        logger.info("shutting down: finishing uploads for up to %.0f s", budget)
        self.notifier.stopping(f"finishing uploads for up to {budget:.0f} s")
        self.notifier.extend_timeout(int((budget + 10) * 1e6))
        drained = await self.uploader.drain(budget)
        if not drained:
            logger.error(
                "shutdown: uploads still unfinished after %.0f s: %s", budget, self.uploader.status()["queued"]
            )
        for task in self._tasks:
            task.cancel("daemon shutting down")
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.uploader.close_streams()  # nothing left open in the bucket for files never finished
        await self.server.close()
        await self.peering.close()
        for monitor in self.monitors:
            with contextlib.suppress(Exception):
                await monitor.close()
        if self.storage is not None:
            await asyncio.to_thread(self.storage.close)
        await asyncio.to_thread(self.events.close)  # the last moves of the notices are on disk
        return 0


async def _prepare_store(storage: Storage, config: DaemonConfig) -> None:
    """Before the first notice: credentials and connections (not at notice time), and the multipart
    uploads a killed predecessor of this daemon opened (billed; nobody resumes them) aborted."""
    await asyncio.to_thread(storage.warm)
    if Capability.STALE_SWEEP not in storage.capabilities:
        return
    # Exactly the uploads a killed predecessor opened, however young: they are ours to abort.
    root = config.checkpoint_dir.absolute()
    journal = UploadJournal(
        UploadJournal.path_for(config.state_dir, storage.url, root),
        spare=UploadJournal.path_for(config.socket.parent, storage.url, root),  # while state_dir refuses writes
    )
    aborted = await asyncio.to_thread(storage.keep_journal, journal)
    if aborted:
        logger.info("aborted %d multipart upload(s) an earlier run of this daemon left open", aborted)


async def _sweep_store(storage: Storage, config: DaemonConfig) -> None:
    """What earlier runs left in the bucket, removed by age: upload-rate probes, and others' multipart
    uploads (only old ones: the other nodes of a job share the prefix and may be uploading right now).
    After the first metadata check: ages are counted on the cloud's time (spotguard/cloudclock.py)."""
    try:
        swept = await asyncio.to_thread(
            sweep_rate_probes, storage, older_than=timedelta(seconds=config.incomplete_grace)
        )
    except (StorageError, OSError) as exc:  # the next start tries again; nothing here is urgent
        logger.warning("could not sweep old upload-rate probes from %s: %s", storage.url, exc)
    else:
        if swept:
            logger.info("removed %d upload-rate probe object(s) an earlier run left in the bucket", swept)
    if Capability.STALE_SWEEP not in storage.capabilities:
        return
    try:
        aborted = await asyncio.to_thread(
            storage.abort_stale_multipart_uploads, older_than=timedelta(seconds=config.stale_upload_age)
        )
    except (StorageError, OSError) as exc:  # a daemon that does not start watches for no notice
        logger.warning(
            "could not sweep unfinished multipart uploads from %s: %s (the next start tries again; a refusal "
            "means the role lacks the listing of multipart uploads)",
            storage.url,
            exc,
        )
        return
    if aborted:
        logger.info("aborted %d unfinished multipart upload(s) left by an earlier run", aborted)


def _hangup_ignored() -> None:
    logger.warning(
        "SIGHUP: the configuration is read at start only, and this daemon keeps running; restart it to apply "
        "a change (systemctl restart spotguard: uploads left open are finished or aborted by the next start)"
    )


async def build_and_run(config: DaemonConfig) -> int:
    """Build the real parts from ``config`` and run until SIGTERM/SIGINT; :class:`DaemonRunning`
    at once if another daemon of this host has this checkpoint root's state."""
    # Before the journal, the event log or the bucket is touched: they are the other daemon's.
    with hold_daemon_lock(config.state_dir, config.checkpoint_dir, spare_dir=config.socket.parent):
        return await _build_and_serve(config)


async def _build_and_serve(config: DaemonConfig) -> int:
    from spotguard.storage import open_storage

    storage = None
    if config.bucket:
        storage = open_storage(config.bucket, **config.storage_options())
    if storage is not None:
        await _prepare_store(storage, config)
    peer_token = None
    if config.peer_listen or config.peers:
        try:
            peer_token = load_job_token(os.environ, config.peer_token_file, config.peer_token_previous_file)
        except ValueError as exc:
            raise ConfigError("peer_token", str(exc)) from None
        if (weakness := token_weakness(peer_token.current)) is not None:
            logger.warning("peers: the job's peer token is weak (%s); make one with `spotguard peer-token`", weakness)
        if peer_token.previous is not None:
            logger.warning(
                "peers: the previous peer token is accepted too while the job's token is rotated; remove it "
                "once every VM of the job has the new one (docs/security.md)"
            )
    provider, monitors, session = await _build_monitors(config)
    daemon = Daemon(
        config,
        provider=provider,
        monitors=monitors,
        storage=storage,
        notifier=SystemdNotifier(os.environ),
        peer_token=peer_token,
    )
    closers = await _build_metrics_and_webhook(config, daemon)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, daemon.request_stop)
    # SIGHUP's default ends the process at once, its uploads unfinished, where tools and admins send it
    # to mean "reload". The configuration is read at start only: say so, and keep watching.
    loop.add_signal_handler(signal.SIGHUP, _hangup_ignored)
    try:
        return await daemon.serve_until_stopped()
    finally:
        # After the shutdown drain, so the outcome of an upload finished there still goes out.
        for close in closers:
            await close()
        if session is not None:
            await session.close()


async def _build_metrics_and_webhook(config: DaemonConfig, daemon: Daemon) -> list[Callable[[], Awaitable[None]]]:
    """Metrics (``metrics_port``) and webhook (``webhook_url``), each only when configured."""
    closers: list[Callable[[], Awaitable[None]]] = []
    if config.metrics_port is not None:
        from prometheus_client import CollectorRegistry

        from spotguard.daemon.metrics import DaemonMetrics, MetricsServer

        registry = CollectorRegistry()
        DaemonMetrics(registry).attach(daemon)
        metrics_server = MetricsServer(registry, config.metrics_host, config.metrics_port)
        daemon.metrics_url = await metrics_server.start()
        closers.append(metrics_server.close)
    if config.webhook_url is not None:
        import socket

        import aiohttp

        from spotguard.config import parse_webhook_template
        from spotguard.daemon.webhook import WebhookNotifier

        webhook_session = aiohttp.ClientSession()
        template = parse_webhook_template(config.webhook_template) if config.webhook_template else None
        webhook = WebhookNotifier(
            config.webhook_url, session=webhook_session, host=config.vm_name or socket.gethostname(), template=template
        )
        webhook.attach(daemon)

        async def close_webhook() -> None:
            await webhook.close()
            await webhook_session.close()

        closers.append(close_webhook)
    return closers


async def _build_monitors(config: DaemonConfig) -> tuple[str, list[Monitor], Any]:
    if config.provider == "none":
        return "none", [], None
    import aiohttp

    from spotguard.providers.registry import build_monitors, resolve

    provider = resolve(config.provider)
    if provider == "none":
        return "none", [], None
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=config.http_timeout))
    return provider, build_monitors(provider, config.monitor_settings(), session), session


__all__ = ["Daemon", "EventLog", "build_and_run"]
