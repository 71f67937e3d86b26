"""Background uploads of committed checkpoints, restart-safe and deadline-aware.

What is left to do is derived, never remembered: at start and every
``scan_interval`` the uploader compares the complete checkpoints under the
local root with the complete ones in the bucket. The bucket is listed at most
every ``bucket_scan_interval``, and at once when the local root holds a checkpoint
not yet settled; each manifest in it is read once (:class:`KnownManifests`). Urgent checkpoints jump the
queue and cancel a periodic upload in flight (it is picked up again later;
the files it already sent are not sent twice). Blocking storage calls run in
threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from spotguard.daemon.events import EventBus, UploadCommitted
from spotguard.daemon.forecast import commit_report, forecast_report, watch_deadline
from spotguard.daemon.jobs import Job, JobQueue
from spotguard.daemon.retention import apply_retention
from spotguard.daemon.shares import NodeShares
from spotguard.daemon.streams import EarlyUploads
from spotguard.daemon.upload_failures import UploadFailures
from spotguard.localstore import scan_local
from spotguard.manifest import CheckpointInfo, FileEntry, Manifest, node_holdings, parse_step_dir
from spotguard.repeats import RepeatedErrors
from spotguard.safefile import SymlinkRefused
from spotguard.storage.base import Capability, Storage, StorageError
from spotguard.storage.checkpoints import (
    CommitLost,
    KnownManifests,
    UploadCancelled,
    UploadProgress,
    commit_remote,
    files_difference,
    list_remote,
    upload_files,
    wait_for_other_nodes,
)

logger = logging.getLogger("spotguard.uploader")
LIST_WARN_EVERY = 600.0  # seconds before the same listing error is logged again


@dataclass
class _Current:
    name: str
    urgent: bool
    progress: UploadProgress
    cancel: threading.Event


def _send(
    storage: Storage,
    step_dir: Path,
    files: Mapping[str, FileEntry],
    manifest: Manifest | None,
    *,
    multi_node: bool,
    deadline: float | None,
    current: _Current,
    concurrency: int,
    other_nodes_wait: float,
) -> None:
    """Blocking, in an upload thread: this disk's files, then (if this node holds it) the manifest,
    once every node's files are in (waiting up to the deadline, else ``other_nodes_wait`` seconds)."""
    upload_files(
        storage,
        step_dir,
        files,
        concurrency=concurrency,
        deadline=deadline,
        cancel=current.cancel,
        progress=current.progress,
    )
    if manifest is None:
        return
    if multi_node:
        wait = deadline if deadline is not None else time.monotonic() + other_nodes_wait
        wait_for_other_nodes(storage, manifest, step_dir.name, deadline=wait, cancel=current.cancel)
    if current.cancel.is_set():
        raise UploadCancelled(f"{step_dir.name}: upload cancelled before commit")
    commit_remote(storage, step_dir, deadline=deadline)


#: A complete checkpoint's step, and when it was made (Unix time; None where its manifest's time does not convert).
Newest = tuple[int, float | None]


def _newer(newest: Newest | None, step: int, created: str | None) -> Newest | None:
    """``newest``, or the checkpoint of ``step`` made at ``created`` (its manifest's time) where that one is newer."""
    if newest is not None and step <= newest[0]:
        return newest
    try:
        at = datetime.fromisoformat(created).timestamp() if created else None
    except (ValueError, OverflowError, OSError):  # a manifest's time is its writer's to get wrong
        at = None
    return (step, at)


class BucketListings:
    """When the uploader lists the bucket next, the manifests it has read there, and the log of a
    listing that keeps failing (a bucket down for a weekend: a new or changed error, then every
    :data:`LIST_WARN_EVERY` seconds, and once when it answers again)."""

    def __init__(self, interval: float, bus: EventBus) -> None:
        self.interval = interval
        self.manifests = KnownManifests()
        self.count = 0
        self._at = -interval  # monotonic time of the last listing
        self._warnings = RepeatedErrors(LIST_WARN_EVERY)
        # The newest complete checkpoint in the bucket (listed or committed): what a replacement VM resumes from.
        self.newest: Newest | None = None
        self._committed_meanwhile: Newest | None = None  # commits since the listing under way began
        bus.subscribe(UploadCommitted, self._committed)

    def _committed(self, event: UploadCommitted) -> None:
        step, created = event.manifest.step, event.manifest.created
        self.newest = _newer(self.newest, step, created)
        self._committed_meanwhile = _newer(self._committed_meanwhile, step, created)

    def newest_created(self) -> float | None:
        """When the newest complete checkpoint in the bucket was made (Unix time), as last listed or committed."""
        return None if self.newest is None else self.newest[1]

    def status(self) -> dict[str, Any]:
        newest = None
        if self.newest is not None:
            made = self.newest[1]
            newest = {
                "step": self.newest[0],
                "made": None if made is None else datetime.fromtimestamp(made, UTC).isoformat(),
            }
        return {"bucket_listings": self.count, "manifests_read": self.manifests.reads, "newest_in_bucket": newest}

    def failed(self, url: str, exc: Exception) -> None:
        error = f"cannot list {url}: {exc}"
        if self._warnings.due("bucket", error):
            logger.warning("%s (will retry)", error)
        else:
            logger.debug("%s (still failing)", error)

    def due(self) -> bool:
        return time.monotonic() - self._at >= self.interval

    async def complete(self, storage: Storage) -> dict[str, CheckpointInfo]:
        """List the bucket now; its complete checkpoints by name."""
        self._committed_meanwhile = None
        listing = await asyncio.to_thread(list_remote, storage, known=self.manifests)
        self._at = time.monotonic()
        self.count += 1
        if self._warnings.clear("bucket"):
            logger.info("%s answers listings again", storage.url)
        complete = {info.name: info for info in listing if info.status == "complete"}
        # What the bucket holds now (a job started over in its prefix, or deleted there), plus what was
        # committed while the listing ran, which it may not show.
        newest = self._committed_meanwhile
        for info in complete.values():
            newest = _newer(newest, info.step, info.created)
        self.newest = newest
        return complete


class Uploader:
    def __init__(
        self,
        storage: Storage | None,
        root: Path,
        *,
        keep_local: int = 2,
        keep_remote: int = 3,
        incomplete_grace: float = 3600.0,
        concurrency: int = 8,
        scan_interval: float = 2.0,
        bucket_scan_interval: float = 60.0,
        retry_after: float = 2.0,
        retry_max: float = 60.0,
        alert_after: int = 5,
        forecast_interval: float = 5.0,
        bus: EventBus | None = None,
    ) -> None:
        self.storage = storage
        # Each commit (UploadCommitted, observers awaited in turn) and each failed attempt (UploadFailed).
        self.bus = bus if bus is not None else EventBus()
        self.root = root
        self.keep_local = keep_local
        self.keep_remote = keep_remote
        self.incomplete_grace = timedelta(seconds=incomplete_grace)
        self.concurrency = concurrency
        self.scan_interval = scan_interval
        self.listings = BucketListings(bucket_scan_interval, self.bus)
        self.newest_in_bucket = self.listings.newest_created
        self.rescans = 0  # of the local root
        self.forecast_interval = forecast_interval
        self.committed: set[str] = set()  # complete in the bucket
        self.shares = NodeShares()  # multi-node checkpoints: this node's share sent, others' missing
        # Another writer committed a different checkpoint under the same name: never sent again.
        self.conflicts: set[str] = set()
        self.last_committed: dict[str, Any] | None = None
        self._failures = UploadFailures(
            retry_after=retry_after, retry_max=retry_max, alert_after=alert_after, bus=self.bus
        )
        self.failures = self._failures.recent
        self.refused = self._failures.refused  # checkpoints not retried until a restart
        self._queue = JobQueue()
        self._wake = asyncio.Event()
        self.idle = asyncio.Event()  # set while nothing is queued or uploading
        self._current: _Current | None = None
        self._deadline: float | None = None  # the pending notice's, if any, on time.monotonic()'s clock
        # Early uploads (at most `concurrency`) and the one checkpoint job; more would only wait.
        self._executor = ThreadPoolExecutor(max_workers=concurrency + 1, thread_name_prefix="upload")
        # What is in the bucket of each checkpoint not yet committed there, early uploads included.
        self._progress: dict[str, UploadProgress] = {}
        # Files of checkpoints still being written, uploading ahead of the commit.
        self._ahead = EarlyUploads(storage, self._progress, self._in_upload_thread, slots=concurrency)

    # --- what to upload --------------------------------------------------------------------

    def submit(self, step_dir: Path, *, urgent: bool) -> None:
        name = step_dir.name
        if self.storage is None or name in self.committed or name in self.refused:
            return
        step = parse_step_dir(name)
        if step is None:
            return
        if urgent:
            self._queue.urgent.add(name)
        current = self._current
        if current is not None and current.name == name:
            # Uploading already: a notice's save that found this periodic checkpoint on disk (the same
            # step). It goes on, urgent now; cancelling it would send its files again in the deadline.
            current.urgent = current.urgent or urgent
            return
        self._queue.add(name, step)
        if urgent and current is not None and not current.urgent:
            logger.info("urgent %s: cancelling the periodic upload of %s", name, current.name)
            current.cancel.set()
        self.idle.clear()
        self._wake.set()

    def file_ready(self, step_dir: Path, rel: str, entry: FileEntry, *, urgent: bool) -> None:
        """Start uploading one finished file of a checkpoint that is still being written.

        Only the data file goes now; the manifest waits for the commit (``submit``), and the
        checkpoint's upload job first waits for these early uploads, then skips what they sent.
        """
        if self.storage is None or step_dir.name in self.committed:
            return
        self._ahead.file_ready(step_dir, rel, entry)
        if urgent:
            self._queue.urgent.add(step_dir.name)

    def file_range(
        self,
        step_dir: Path,
        rel: str,
        *,
        tmp: str,
        size: int,
        offset: int,
        length: int,
        owner: int | None,
        urgent: bool,
    ) -> None:
        """Bytes ``[offset, offset + length)`` of ``rel`` (final size ``size``), being written under
        ``tmp``, are on disk: upload every part they complete now. Raises ValueError for a range
        that contradicts what was announced of the file before, OSError if ``tmp`` cannot be opened.

        Backends that cannot stream, and files too small to be worth it, go whole at ``file_ready``.
        """
        storage = self.storage
        if storage is None or Capability.STREAMING not in storage.capabilities:
            return
        if step_dir.name in self.committed or step_dir.name in self.conflicts:
            return
        upload = self._ahead.stream_of(storage, step_dir, rel, tmp=tmp, size=size, owner=owner)
        if upload is None:
            return
        if urgent:
            self._queue.urgent.add(step_dir.name)
        upload.add(offset, length)

    async def close_streams(self) -> None:
        """At shutdown: abort every streamed upload whose file is not finished, and wait for it."""
        await self._ahead.close()

    def abort_streams(
        self, why: str, *, name: str | None = None, owner: int | None = None, every: bool = False
    ) -> None:
        """Abort the streamed uploads of files that will never be finished: of checkpoint ``name``,
        of the connection ``owner``, or (neither given) those whose temporary file is gone (the
        writer removed it: a failed or cancelled save, a leftover cleared by the next save)."""
        self._ahead.abort(why, name=name, owner=owner, every=every)

    async def discard(self, name: str, why: str) -> list[str]:
        """A save of ``name`` failed or was cancelled: nothing of it will ever be committed. Abort its
        streamed uploads, let its uploads ahead of the commit settle, and remove from the bucket every
        file of it this daemon sent (never another node's share, and nothing once a manifest is there:
        a committed checkpoint of that name is not ours to touch). Returns the keys removed."""
        self._queue.drop(name)
        self._failures.forget(name)
        return await self._ahead.discard(name, why, lambda checkpoint: checkpoint in self.committed)

    async def _in_upload_thread(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run a long blocking transfer in the uploader's own threads: on the loop's default
        executor (a handful of threads) nine files in flight would queue every short blocking
        call of the daemon behind them, a trainer's commit included."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def in_flight(self) -> frozenset[str]:
        """The checkpoint being uploaded now, if any (not to be deleted under it)."""
        current = self._current
        return frozenset() if current is None else frozenset({current.name})

    def set_deadline(self, deadline: float | None) -> None:  # a notice's monotonic_deadline, or None
        self._deadline = deadline
        # The store's own retries (SDK attempts and timeouts) must fit in what is left too.
        if self.storage is not None:
            self.storage.set_deadline(deadline)

    async def rescan(self, *, bucket: bool = True) -> None:
        """Queue every complete local checkpoint not yet complete in the bucket. The bucket is listed
        when ``bucket`` is set, when the last listing is ``bucket_scan_interval`` old, or when a local
        checkpoint is not settled yet; otherwise what the last listing (and the commits since) said
        stands. Listing every 2 s cost a LIST and a GET per checkpoint in the bucket each time."""
        if self.storage is None:
            return
        self.abort_streams("its temporary file was removed before it was finished")
        self._ahead.forget_done()
        self.rescans += 1
        local = await asyncio.to_thread(scan_local, self.root)
        self._forget_gone({info.name for info in local})
        if self._deadline is None:  # housekeeping waits while a notice's checkpoint races its deadline
            await asyncio.to_thread(self.storage.retry_aborts)
        if bucket or self.listings.due() or self._unsettled(local):
            await self._list_bucket(local)
        for info in self._unsettled(local):
            self.submit(self.root / info.name, urgent=False)

    async def _list_bucket(self, local: list[CheckpointInfo]) -> None:
        assert self.storage is not None
        storage = self.storage
        before = set(self.committed)
        remote = await self.listings.complete(storage)
        # Plus what was committed while it ran: a listing taken before a commit would have it sent again.
        self.committed = set(remote) | (self.committed - before)
        self._failures.forget(*self.committed)  # those committed by another writer meanwhile fail no more
        for info in local:
            theirs = remote[info.name].manifest if info.name in remote else None
            if info.manifest is not None and theirs is not None and info.name not in self.conflicts:
                difference = files_difference(info.manifest, theirs)
                if difference is not None:
                    self._conflict(info.name, f"{storage.url} holds another writer's checkpoint there ({difference})")

    def _unsettled(self, local: list[CheckpointInfo]) -> list[CheckpointInfo]:
        """The checkpoints held here that nothing has decided about yet: not in the bucket, not queued,
        not uploading, not refused, not in conflict, not a share already sent."""
        settled = self.committed | self.conflicts | self.refused.keys() | set(self._queue) | self.shares.settled()
        settled |= self.in_flight()
        return [info for info in local if info.held and info.name not in settled]

    def _forget_gone(self, here: set[str]) -> None:
        """Drop what is remembered per checkpoint for those gone from this disk (pruned, removed) and
        not in the queue: a name a save, for the months the daemon runs, otherwise. A checkpoint
        written again under a refused or conflicting name is judged afresh."""
        keep = self._ahead.forget_gone(here | set(self._queue) | self.in_flight())
        self.shares.keep_only(keep)
        self.conflicts &= keep
        self._queue.urgent &= keep
        self._failures.forget_refused(self.refused.keys() - keep)

    # --- the loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        if self.storage is None:
            self.idle.set()
            return
        watcher = asyncio.create_task(self.watch_deadline(), name="upload-deadline-watch")
        try:
            await self._rescan_logged()
            next_scan = time.monotonic() + self.scan_interval
            while True:
                job = self._queue.next(self._failures.not_before, time.monotonic())
                if job is None:
                    if not self._queue:
                        self.idle.set()
                    retry = self._failures.next_retry(self._queue)
                    timeout = max(0.0, min(next_scan, retry if retry is not None else next_scan) - time.monotonic())
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), timeout)
                    if time.monotonic() >= next_scan:
                        await self._rescan_logged(bucket=False)
                        next_scan = time.monotonic() + self.scan_interval
                    continue
                await self._upload(job)
        finally:
            watcher.cancel()

    async def _rescan_logged(self, *, bucket: bool = True) -> None:
        try:
            await self.rescan(bucket=bucket)
        except (StorageError, OSError) as exc:
            self.listings.failed(self.storage.url if self.storage else "-", exc)

    async def _upload(self, job: Job) -> None:
        assert self.storage is not None
        step_dir = self.root / job.name
        early = self._ahead.tasks.pop(job.name, [])
        if early:
            await asyncio.gather(*early, return_exceptions=True)
        manifest, share = await asyncio.to_thread(node_holdings, step_dir)  # disk reads: off the loop
        listed = share if share is not None else manifest.files if manifest else {}
        if self._ahead.settle(step_dir, listed, committed=job.name in self.committed):
            # Streams whose file message never came but whose file the commit lists: finished now.
            early = self._ahead.tasks.pop(job.name, [])
            await asyncio.gather(*early, return_exceptions=True)
        if manifest is None and share is None:
            logger.warning("not uploading %s: neither a complete checkpoint nor a node's committed share", job.name)
            self._failures.forget(job.name)  # removed meanwhile (local retention, a disk-full save): not retried
            return
        files = share if share is not None else manifest.files if manifest is not None else {}
        total = sum(entry.size for entry in files.values())
        current = _Current(job.name, job.priority == 0, self._ahead.progress_of(job.name), threading.Event())
        self._current = current
        deadline = self._deadline
        logger.info("uploading %s (%d bytes, %s)", job.name, total, "urgent" if current.urgent else "periodic")
        try:
            await self._in_upload_thread(
                _send, self.storage, step_dir, files, manifest, multi_node=share is not None, deadline=deadline,
                current=current, concurrency=self.concurrency, other_nodes_wait=self.shares.wait_for(job.name),
            )  # fmt: skip
        except UploadCancelled:
            self._queue.again(job, urgent=False)
            return
        except SymlinkRefused as exc:
            # Retrying cannot help, and the checkpoint is not what its manifest claims.
            logger.error("not uploading %s: %s", job.name, exc)
            self._failures.forget(job.name)
            return
        except CommitLost as exc:
            self._conflict(job.name, str(exc))
            return
        except (StorageError, OSError) as exc:
            self.shares.failed(job.name, exc)
            racing = job.name in self._queue.urgent and self._deadline is not None
            if self._failures.record(job.name, exc, racing=racing, bucket=self.storage.url):
                self._queue.again(job, urgent=current.urgent or job.priority == 0)
            return
        finally:
            self._current = None
        if manifest is None:
            self._progress.pop(job.name, None)
            self.shares.uploaded.add(job.name)  # node 0's daemon commits once every node's share is there
            self._failures.succeeded(job.name)
            logger.info("%s: this node's share is in the bucket (%d bytes)", job.name, total)
            await self._retention(bucket=False)  # node 0 prunes the bucket; this disk is ours to prune
            return
        # From the first byte sent, files sent ahead of the commit included.
        await self._committed(job.name, manifest, current.progress.elapsed())

    def retry_delay(self, name: str) -> float:
        """How long to wait after the last failure in a row of ``name`` (see ``UploadFailures``)."""
        return self._failures.retry_delay(name, racing=name in self._queue.urgent and self._deadline is not None)

    def failing_streak(self) -> int:
        """The most failures in a row of any checkpoint still to upload (0: none is failing)."""
        return self._failures.streak()

    def _conflict(self, name: str, why: str) -> None:
        """Another writer shares the prefix and committed its own checkpoint under ``name``: ours is
        never sent (nor retried, nor counted as failing); local retention treats it like an uploaded one."""
        logger.warning("not committing %s: %s", name, why)
        self.conflicts.add(name)
        self._ahead.manifest_seen.pop(name, None)
        self._failures.forget(name)
        self._progress.pop(name, None)
        self._queue.urgent.discard(name)

    async def _committed(self, name: str, manifest: Manifest, elapsed: float) -> None:
        assert self.storage is not None
        self.committed.add(name)
        for given_up in self.shares.committed(name):
            self._queue.drop(given_up)
            self._failures.forget(given_up)
        self._progress.pop(name, None)
        self._ahead.manifest_seen.pop(name, None)
        self._queue.urgent.discard(name)
        self._failures.succeeded(name)
        self.last_committed = commit_report(name, manifest, elapsed, deadline=self._deadline, bucket=self.storage.url)
        await self.bus.emit_async(UploadCommitted(name, manifest, elapsed))
        await self._retention()

    async def _retention(self, *, bucket: bool = True) -> None:
        assert self.storage is not None
        await apply_retention(
            self.storage,
            self.root,
            keep_remote=self.keep_remote,
            keep_local=self.keep_local,
            grace=self.incomplete_grace,
            in_flight=frozenset(self._queue) | ({self._current.name} if self._current else set()),
            settled=lambda: self.committed | self.conflicts | self.shares.settled(),
            bucket=bucket,
            known=self.listings.manifests,
        )

    # --- shutdown and status -----------------------------------------------------------

    async def drain(self, timeout: float) -> bool:
        """Wait until nothing is left to upload (after a final rescan) or ``timeout``; True if drained."""
        if self.storage is None:
            return True
        await self._rescan_logged()
        self._wake.set()
        try:
            await asyncio.wait_for(self._wait_idle(), timeout)
        except TimeoutError:
            return False
        return True

    async def _wait_idle(self) -> None:
        while self._queue or self._current is not None:
            self.idle.clear()
            await self.idle.wait()

    def forecast(self) -> dict[str, Any] | None:
        """The checkpoint being uploaded now (an urgent one first, early uploads included): how
        much is in the bucket, at what rate, and whether it will be in before the deadline."""
        current = self._current
        if current is not None:
            name, urgent, progress = current.name, current.urgent, current.progress
        else:
            early = self._ahead.uploading()
            if not early:
                return None
            name = max(early, key=lambda n: (n in self._queue.urgent, n))
            urgent, progress = name in self._queue.urgent, self._progress[name]
        return forecast_report(name, urgent, progress, total_known=current is not None, deadline=self._deadline)

    async def watch_deadline(self) -> None:
        """Log, every ``forecast_interval`` while an urgent upload races a deadline, whether it
        will make it at the rate so far; say once when the deadline passed with it unfinished."""
        await watch_deadline(self.forecast, lambda: self.forecast_interval)

    def status(self) -> dict[str, Any]:
        return {
            "bucket": self.storage.url if self.storage else None,
            "current": self.forecast(),
            "queued": sorted(self._queue),
            "committed": sorted(self.committed)[-5:],
            "last_committed": self.last_committed,
            "failures": self.failures[-5:],
            "failing_streak": self.failing_streak(),
            "conflicts": sorted(self.conflicts)[-5:],
            **self.listings.status(),
        }
