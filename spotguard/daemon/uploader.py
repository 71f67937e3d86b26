"""Background uploads of committed checkpoints, restart-safe and deadline-aware.

What is left to do is derived, never remembered: at start and every
``scan_interval`` the uploader compares the complete checkpoints under the
local root with the complete ones in the bucket. Urgent checkpoints jump the
queue and cancel a periodic upload in flight (it is picked up again later;
the files it already sent are not sent twice). Blocking storage calls run in
threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from spotguard.daemon.events import CommittedListener, UploadFailureListener
from spotguard.localstore import prune_local, scan_local
from spotguard.manifest import MANIFEST, FileEntry, Manifest, node_holdings, parse_step_dir
from spotguard.notice import utcnow
from spotguard.safefile import SymlinkRefused, is_unlinked, open_nofollow
from spotguard.storage.base import ChecksumMismatch, ObjectInfo, Storage, StorageError
from spotguard.storage.checkpoints import (
    CommitLost,
    UploadCancelled,
    UploadProgress,
    commit_remote,
    files_difference,
    list_remote,
    prune_remote,
    put_with_retry,
    upload_files,
    wait_for_other_nodes,
)
from spotguard.storage.stream import Streaming, UploadStream

logger = logging.getLogger("spotguard.uploader")


@dataclass(order=True)
class _Job:
    priority: int  # 0 urgent, 1 periodic
    neg_step: int  # newest first within a priority
    name: str = field(compare=False)


@dataclass
class _Stream:
    """A file of a checkpoint being written, uploading as its ranges are announced."""

    name: str  # the checkpoint
    rel: str
    tmp: str  # where it is being written, relative to the step directory
    size: int
    owner: int | None  # the connection announcing it
    fd: int  # opened once at the first range: still the file after the writer renames it
    upload: UploadStream


@dataclass
class _Current:
    name: str
    urgent: bool
    progress: UploadProgress
    cancel: threading.Event
    started_wall: datetime


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
        retry_after: float = 2.0,
        retry_max: float = 60.0,
        alert_after: int = 5,
        forecast_interval: float = 5.0,
    ) -> None:
        self.storage = storage
        self.root = root
        self.keep_local = keep_local
        self.keep_remote = keep_remote
        self.incomplete_grace = timedelta(seconds=incomplete_grace)
        self.concurrency = concurrency
        self.scan_interval = scan_interval
        self.retry_after = retry_after  # the first wait after a failed upload; doubled per failure in a row
        self.retry_max = retry_max  # ... up to this
        self.alert_after = alert_after  # failures in a row of one checkpoint before an error-level alert
        self.forecast_interval = forecast_interval
        self.committed: set[str] = set()  # complete in the bucket
        self.shares_uploaded: set[str] = set()  # multi-node: this node's share is in the bucket
        # Another writer committed a different checkpoint under the same name: never sent again.
        self.conflicts: set[str] = set()
        self.other_nodes_timeout = 600.0  # how long node 0 waits for the others' shares (without a notice)
        self.on_committed: list[CommittedListener] = []
        self.on_failure: list[UploadFailureListener] = []
        self.last_committed: dict[str, Any] | None = None
        self.failures: list[dict[str, Any]] = []
        # Checkpoints not retried until a restart: the store answers wrong checksums for their bytes
        # (a backend raises ChecksumMismatch only once its own bounded attempts are spent).
        self.refused: dict[str, str] = {}
        self._queued: dict[str, _Job] = {}
        self._urgent: set[str] = set()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._current: _Current | None = None
        self._deadline: datetime | None = None  # the pending notice's, if any
        self._not_before: dict[str, float] = {}  # backoff after a failed attempt
        self._failed_in_a_row: dict[str, int] = {}  # per checkpoint, until it is committed
        # Files of checkpoints still being written, uploading ahead of the commit.
        self._early: dict[str, list[asyncio.Task[None]]] = {}
        self._early_slots = asyncio.Semaphore(concurrency)
        self._manifest_seen: dict[str, asyncio.Future[ObjectInfo | None]] = {}  # per checkpoint uploading early
        # Files still being written whose parts go up as they are announced (by checkpoint, file).
        self._streams: dict[tuple[str, str], _Stream] = {}
        self._aborting: set[asyncio.Task[None]] = set()
        # Early uploads (at most `concurrency`) and the one checkpoint job; more would only wait.
        self._executor = ThreadPoolExecutor(max_workers=concurrency + 1, thread_name_prefix="upload")
        # What is in the bucket of each checkpoint not yet committed there, early uploads included.
        self._progress: dict[str, UploadProgress] = {}
        self._late_logged: set[str] = set()  # checkpoints already reported as past the deadline

    # --- what to upload --------------------------------------------------------------------

    def submit(self, step_dir: Path, *, urgent: bool) -> None:
        name = step_dir.name
        if self.storage is None or name in self.committed or name in self.refused:
            return
        step = parse_step_dir(name)
        if step is None:
            return
        if urgent:
            self._urgent.add(name)
        job = _Job(0 if name in self._urgent else 1, -step, name)
        self._queued[name] = min(job, self._queued.get(name, job))
        current = self._current
        if urgent and current is not None and not current.urgent:
            logger.info("urgent %s: cancelling the periodic upload of %s", name, current.name)
            current.cancel.set()
        self._idle.clear()
        self._wake.set()

    def file_ready(self, step_dir: Path, rel: str, entry: FileEntry, *, urgent: bool) -> None:
        """Start uploading one finished file of a checkpoint that is still being written.

        Only the data file goes now; the manifest waits for the commit (``submit``), and the
        checkpoint's upload job first waits for these early uploads, then skips what they sent.
        """
        if self.storage is None or step_dir.name in self.committed:
            return
        self._progress_of(step_dir.name).expect(rel, entry.size)
        stream = self._streams.pop((step_dir.name, rel), None)
        if stream is not None:
            work = self._finish_stream(step_dir, stream, entry)
        else:
            work = self._early_upload(step_dir, rel, entry)
        task = asyncio.create_task(work, name=f"early-{step_dir.name}/{rel}")
        self._early.setdefault(step_dir.name, []).append(task)
        if urgent:
            self._urgent.add(step_dir.name)

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
        if not isinstance(storage, Streaming) or step_dir.name in self.committed or step_dir.name in self.conflicts:
            return
        stream = self._streams.get((step_dir.name, rel))
        if stream is None:
            stream = self._begin_stream(storage, step_dir, rel, tmp=tmp, size=size, owner=owner)
            if stream is None:
                return
        elif (stream.tmp, stream.size) != (tmp, size):
            raise ValueError(
                f"{step_dir.name}/{rel}: announced as {stream.tmp} of {stream.size} bytes, now as {tmp} of {size}"
            )
        if urgent:
            self._urgent.add(step_dir.name)
        stream.upload.add(offset, length)

    def _begin_stream(
        self, storage: Streaming, step_dir: Path, rel: str, *, tmp: str, size: int, owner: int | None
    ) -> _Stream | None:
        # Opened once, here: refusing a symlink, and following the file across the writer's rename.
        fd = open_nofollow(step_dir / tmp)
        try:
            progress = self._progress_of(step_dir.name)
            progress.expect(rel, size)
            upload = storage.begin_stream(f"{step_dir.name}/{rel}", size, fd, progress=progress.sender(rel))
        except BaseException:
            os.close(fd)
            raise
        if upload is None:
            os.close(fd)
            return None
        stream = _Stream(step_dir.name, rel, tmp, size, owner, fd, upload)
        self._streams[(step_dir.name, rel)] = stream
        logger.debug("%s/%s: streaming its upload as it is written (%d bytes)", step_dir.name, rel, size)
        return stream

    async def close_streams(self) -> None:
        """At shutdown: abort every streamed upload whose file is not finished, and wait for it."""
        self.abort_streams("the daemon is stopping", every=True)
        await asyncio.gather(*self._aborting, return_exceptions=True)

    def abort_streams(
        self, why: str, *, name: str | None = None, owner: int | None = None, every: bool = False
    ) -> None:
        """Abort the streamed uploads of files that will never be finished: of checkpoint ``name``,
        of the connection ``owner``, or (neither given) those whose temporary file is gone (the
        writer removed it: a failed or cancelled save, a leftover cleared by the next save)."""
        for key, stream in list(self._streams.items()):
            if name is not None and stream.name != name:
                continue
            if owner is not None and stream.owner != owner:
                continue
            if name is None and owner is None and not every and not is_unlinked(stream.fd):
                continue
            del self._streams[key]
            logger.info("%s/%s: aborting its streamed upload: %s", stream.name, stream.rel, why)
            task = asyncio.create_task(self._abort_stream(stream), name=f"abort-{stream.name}/{stream.rel}")
            self._aborting.add(task)
            task.add_done_callback(self._aborting.discard)

    async def discard(self, name: str, why: str) -> list[str]:
        """A save of ``name`` failed: nothing of it will ever be committed. Abort its streamed uploads,
        let its uploads ahead of the commit settle, and remove from the bucket every file of it this
        daemon sent (never another node's share, and nothing once a manifest is there: a committed
        checkpoint of that name is not ours to touch). Returns the keys removed."""
        self.abort_streams(why, name=name)
        self._queued.pop(name, None)
        self._urgent.discard(name)
        progress = self._progress.pop(name, None)
        # A transfer in a thread cannot be cancelled: wait for it, then remove what it left.
        await asyncio.gather(*self._early.pop(name, []), *self._aborting, return_exceptions=True)
        storage = self.storage
        if storage is None or progress is None or name in self.committed:
            return []
        keys = [f"{name}/{rel}" for rel in progress.files()]

        def remove() -> list[str]:
            # A save of the same step begun again meanwhile owns these names now: leave them to it.
            if name in self._progress or storage.stat(f"{name}/{MANIFEST}") is not None:
                return []
            present = [key for key in keys if storage.stat(key) is not None]
            storage.delete(present)
            return present

        try:
            removed = await self._in_upload_thread(remove)
        except (StorageError, OSError) as exc:
            logger.warning("%s: cannot remove the files of the failed save from the bucket: %s", name, exc)
            return []
        if removed:
            logger.info("%s: removed %d file(s) of the failed save from the bucket", name, len(removed))
        return removed

    async def _abort_stream(self, stream: _Stream) -> None:
        try:
            await asyncio.to_thread(stream.upload.abort)
        except Exception:
            logger.exception("%s/%s: aborting its streamed upload failed", stream.name, stream.rel)
        finally:
            os.close(stream.fd)

    async def _finish_stream(self, step_dir: Path, stream: _Stream, entry: FileEntry) -> None:
        """The file is finished: complete its streamed upload, or send it whole if that fails."""
        key = f"{stream.name}/{stream.rel}"
        progress = self._progress_of(stream.name)
        try:
            if await self._committed_elsewhere(stream.name):
                await asyncio.to_thread(stream.upload.abort)
                return
            if entry.size != stream.size:
                await asyncio.to_thread(stream.upload.abort)
                raise StorageError(f"{key}: finished with {entry.size} bytes, announced as {stream.size}")
            await self._in_upload_thread(stream.upload.finish, entry.crc32c)
            progress.present(stream.rel)
            progress.mark_sent(stream.rel)
            return
        except (StorageError, OSError) as exc:
            # finish() aborted the multipart upload: nothing of it is visible or left open.
            logger.info("the stream of %s was not completed (%s); sending the file whole", key, exc)
        finally:
            os.close(stream.fd)
        await self._early_upload(step_dir, stream.rel, entry)

    async def _early_upload(self, step_dir: Path, rel: str, entry: FileEntry) -> None:
        assert self.storage is not None
        key = f"{step_dir.name}/{rel}"
        progress = self._progress_of(step_dir.name)
        async with self._early_slots:
            try:
                if await self._committed_elsewhere(step_dir.name):
                    return  # another writer's checkpoint has this name: the commit decides, ours sends nothing
                await self._in_upload_thread(
                    put_with_retry,
                    self.storage,
                    step_dir,
                    rel,
                    entry,
                    progress=progress,
                    what="uploading ahead of its commit",
                )
            except (StorageError, OSError) as exc:
                # Not fatal: the checkpoint's own upload job sends whatever is missing.
                logger.info("early upload of %s failed (%s); it goes with the checkpoint", key, exc)

    async def _committed_elsewhere(self, name: str) -> bool:
        """Whether the bucket held a manifest under ``name`` before this checkpoint's first file
        went up ahead of its commit (asked once per checkpoint): then those files are someone
        else's, and sending ours would mix two checkpoints under one manifest."""
        if name not in self._manifest_seen:
            assert self.storage is not None
            self._manifest_seen[name] = asyncio.ensure_future(
                asyncio.to_thread(self.storage.stat, f"{name}/{MANIFEST}")
            )
        return await asyncio.shield(self._manifest_seen[name]) is not None

    async def _in_upload_thread(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run a long blocking transfer in the uploader's own threads: on the loop's default
        executor (a handful of threads) nine files in flight would queue every short blocking
        call of the daemon behind them, a trainer's commit included."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def _progress_of(self, name: str) -> UploadProgress:
        return self._progress.setdefault(name, UploadProgress())

    def in_flight(self) -> frozenset[str]:
        """The checkpoint being uploaded now, if any (not to be deleted under it)."""
        current = self._current
        return frozenset() if current is None else frozenset({current.name})

    def set_deadline(self, deadline: datetime | None) -> None:
        self._deadline = deadline
        # The store's own retries (SDK attempts and timeouts) must fit in what is left too.
        set_storage_deadline = getattr(self.storage, "set_deadline", None)
        if set_storage_deadline is not None:
            left = None if deadline is None else (deadline - utcnow()).total_seconds()
            set_storage_deadline(None if left is None else time.monotonic() + left)

    async def rescan(self) -> None:
        """Queue every complete local checkpoint not yet complete in the bucket."""
        if self.storage is None:
            return
        storage = self.storage
        self.abort_streams("its temporary file was removed before it was finished")
        self._early = {name: [t for t in tasks if not t.done()] for name, tasks in self._early.items()}
        self._early = {name: tasks for name, tasks in self._early.items() if tasks}
        remote = {
            info.name: info for info in await asyncio.to_thread(list_remote, storage) if info.status == "complete"
        }
        self.committed = set(remote)
        for name in self.committed & set(self._failed_in_a_row):  # committed by another writer meanwhile
            del self._failed_in_a_row[name]
        for info in await asyncio.to_thread(scan_local, self.root):
            theirs = remote[info.name].manifest if info.name in remote else None
            if info.manifest is not None and theirs is not None and info.name not in self.conflicts:
                difference = files_difference(info.manifest, theirs)
                if difference is not None:
                    self._conflict(info.name, f"{storage.url} holds another writer's checkpoint there ({difference})")
            uploading = self._current is not None and self._current.name == info.name
            committed_here = info.status == "complete" or (
                info.node_files is not None and info.name not in self.shares_uploaded
            )
            settled = self.committed | self.conflicts | set(self._queued)
            if committed_here and info.name not in settled and not uploading:
                self.submit(self.root / info.name, urgent=False)

    # --- the loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        if self.storage is None:
            self._idle.set()
            return
        watcher = asyncio.create_task(self.watch_deadline(), name="upload-deadline-watch")
        try:
            await self._rescan_logged()
            next_scan = time.monotonic() + self.scan_interval
            while True:
                job = self._next_job()
                if job is None:
                    if not self._queued:
                        self._idle.set()
                    timeout = max(0.0, next_scan - time.monotonic())
                    if self._not_before:
                        timeout = min(timeout, max(0.0, min(self._not_before.values()) - time.monotonic()))
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), timeout)
                    if time.monotonic() >= next_scan:
                        await self._rescan_logged()
                        next_scan = time.monotonic() + self.scan_interval
                    continue
                await self._upload(job)
        finally:
            watcher.cancel()

    async def _rescan_logged(self) -> None:
        try:
            await self.rescan()
        except (StorageError, OSError) as exc:
            logger.warning("cannot list %s: %s (will retry)", self.storage.url if self.storage else "-", exc)

    def _next_job(self) -> _Job | None:
        now = time.monotonic()
        ready = [job for job in self._queued.values() if self._not_before.get(job.name, 0) <= now]
        if not ready:
            return None
        job = min(ready)
        del self._queued[job.name]
        return job

    async def _upload(self, job: _Job) -> None:
        assert self.storage is not None
        step_dir = self.root / job.name
        early = self._early.pop(job.name, [])
        if early:
            await asyncio.gather(*early, return_exceptions=True)
        manifest, share = await asyncio.to_thread(node_holdings, step_dir)  # disk reads: off the loop
        if await self._settle_streams(step_dir, share if share is not None else manifest.files if manifest else {}):
            # Streams whose file message never came but whose file the commit lists: finished now.
            early = self._early.pop(job.name, [])
            await asyncio.gather(*early, return_exceptions=True)
        if manifest is None and share is None:
            logger.warning("not uploading %s: neither a complete checkpoint nor a node's committed share", job.name)
            return
        files = share if share is not None else manifest.files if manifest is not None else {}
        total = sum(entry.size for entry in files.values())
        current = _Current(job.name, job.priority == 0, self._progress_of(job.name), threading.Event(), utcnow())
        self._current = current
        deadline = None
        if self._deadline is not None:
            deadline = time.monotonic() + (self._deadline - utcnow()).total_seconds()
        logger.info("uploading %s (%d bytes, %s)", job.name, total, "urgent" if current.urgent else "periodic")
        try:
            await self._in_upload_thread(
                self._send, step_dir, files, manifest, multi_node=share is not None, deadline=deadline, current=current
            )
        except UploadCancelled:
            self._queued.setdefault(job.name, _Job(1, job.neg_step, job.name))
            return
        except SymlinkRefused as exc:
            # Retrying cannot help, and the checkpoint is not what its manifest claims.
            logger.error("not uploading %s: %s", job.name, exc)
            return
        except CommitLost as exc:
            self._conflict(job.name, str(exc))
            self._progress.pop(job.name, None)
            self._urgent.discard(job.name)
            return
        except (StorageError, OSError) as exc:
            self._record_failure(job, exc)
            return
        finally:
            self._current = None
        if manifest is None:
            self._progress.pop(job.name, None)
            self.shares_uploaded.add(job.name)  # node 0's daemon commits once every node's share is there
            logger.info("%s: this node's share is in the bucket (%d bytes)", job.name, total)
            return
        # From the first byte sent, files sent ahead of the commit included.
        await self._committed(job.name, manifest, current.progress.elapsed())

    async def _settle_streams(self, step_dir: Path, files: Mapping[str, FileEntry]) -> bool:
        """At the commit, a file still streaming is finished if the commit lists it, else aborted
        (a file the writer gave up on). True if any was finished."""
        left = [stream for stream in self._streams.values() if stream.name == step_dir.name]
        finished = False
        for stream in left:
            entry = files.get(stream.rel)
            if entry is None:
                continue
            finished = True
            self.file_ready(step_dir, stream.rel, entry, urgent=step_dir.name in self._urgent)
        self.abort_streams("the committed checkpoint does not list it", name=step_dir.name)
        return finished

    def _send(
        self,
        step_dir: Path,
        files: Mapping[str, FileEntry],
        manifest: Manifest | None,
        *,
        multi_node: bool,
        deadline: float | None,
        current: _Current,
    ) -> None:
        """Blocking, in a thread: this disk's files, then (if this node holds it) the manifest."""
        assert self.storage is not None
        upload_files(
            self.storage,
            step_dir,
            files,
            concurrency=self.concurrency,
            deadline=deadline,
            cancel=current.cancel,
            progress=current.progress,
        )
        if manifest is None:
            return
        if multi_node:
            wait = deadline if deadline is not None else time.monotonic() + self.other_nodes_timeout
            wait_for_other_nodes(self.storage, manifest, step_dir.name, deadline=wait, cancel=current.cancel)
        if current.cancel.is_set():
            raise UploadCancelled(f"{step_dir.name}: upload cancelled before commit")
        commit_remote(self.storage, step_dir, deadline=deadline)

    def retry_delay(self, name: str) -> float:
        """How long to wait after the last of ``failed`` failures in a row of ``name``.

        An urgent checkpoint racing a deadline keeps the short wait (the deadline bounds it);
        any other doubles it per failure up to ``retry_max``, jittered so that many VMs whose
        bucket failed at once do not come back in step.
        """
        if name in self._urgent and self._deadline is not None:
            return self.retry_after
        failed = self._failed_in_a_row.get(name, 1)
        delay = min(self.retry_max, self.retry_after * 2 ** (failed - 1))
        return random.uniform(delay / 2, delay)

    def failing_streak(self) -> int:
        """The most failures in a row of any checkpoint still to upload (0: none is failing)."""
        return max(self._failed_in_a_row.values(), default=0)

    def _conflict(self, name: str, why: str) -> None:
        """Another writer shares the prefix and committed its own checkpoint under ``name``: ours is
        never sent (nor retried); local retention treats it like an uploaded one."""
        logger.warning("not committing %s: %s", name, why)
        self.conflicts.add(name)
        self._manifest_seen.pop(name, None)

    def _record_failure(self, job: _Job, exc: BaseException) -> None:
        refused = isinstance(exc, ChecksumMismatch)
        failed = self._failed_in_a_row[job.name] = self._failed_in_a_row.get(job.name, 0) + 1
        delay = self.retry_delay(job.name)
        if refused:
            logger.error(
                "upload of %s failed: %s; not retried: the store answers the same for the same bytes", job.name, exc
            )
            self.refused[job.name] = str(exc)
        else:
            logger.error("upload of %s failed (%d in a row): %s; retrying in %.1f s", job.name, failed, exc, delay)
        if failed == self.alert_after:
            logger.error(
                "ALERT: the upload of %s has failed %d times in a row; it is retried every %.0f s at most, "
                "and nothing newer is safe in %s until it succeeds: check the bucket, the credentials and the link",
                job.name,
                failed,
                self.retry_max,
                self.storage.url if self.storage else "the bucket",
            )
        self.failures.append({"name": job.name, "error": str(exc), "at": utcnow().isoformat(), "in_a_row": failed})
        del self.failures[:-20]
        for callback in self.on_failure:
            try:
                callback(job.name, exc)
            except Exception:
                logger.exception("a failure listener failed for %s", job.name)
        if not refused:
            self._not_before[job.name] = time.monotonic() + delay
            self._queued.setdefault(job.name, job)

    async def _committed(self, name: str, manifest: Manifest, elapsed: float) -> None:
        assert self.storage is not None
        self.committed.add(name)
        self._progress.pop(name, None)
        self._manifest_seen.pop(name, None)
        self._urgent.discard(name)
        self._not_before.pop(name, None)
        self._failed_in_a_row.pop(name, None)
        now = utcnow()
        margin = (self._deadline - now).total_seconds() if self._deadline else None
        self.last_committed = {
            "name": name,
            "step": manifest.step,
            "bytes": manifest.total_bytes,
            "seconds": round(elapsed, 3),
            "at": now.isoformat(),
            "deadline_margin_s": None if margin is None else round(margin, 3),
        }
        if margin is not None and margin < 0:
            logger.error("%s committed in the bucket %.1f s AFTER the deadline", name, -margin)
        else:
            logger.info(
                "%s committed in %s in %.2f s (%.1f MB/s)%s",
                name,
                self.storage.url,
                elapsed,
                manifest.total_bytes / max(elapsed, 1e-9) / 1e6,
                "" if margin is None else f", {margin:.1f} s before the deadline",
            )
        for callback in self.on_committed:
            try:
                await callback(name, manifest, elapsed)
            except Exception:
                logger.exception("a commit listener failed for %s", name)
        await self._retention()

    async def _retention(self) -> None:
        assert self.storage is not None
        storage = self.storage
        in_flight = frozenset(self._queued) | ({self._current.name} if self._current else set())
        try:
            removed = await asyncio.to_thread(
                prune_remote, storage, self.keep_remote, protected=in_flight, grace=self.incomplete_grace
            )
            if removed:
                logger.info("bucket retention removed %s", ", ".join(removed))
        except (StorageError, OSError) as exc:
            logger.warning("bucket retention failed: %s", exc)
        # Locally, never delete what is not yet safe in the bucket.
        settled = self.committed | self.conflicts

        def prune() -> None:
            local = scan_local(self.root)
            not_uploaded = frozenset(
                info.name for info in local if info.status == "complete" and info.name not in settled
            )
            prune_local(self.root, self.keep_local, protected=not_uploaded)

        await asyncio.to_thread(prune)

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
        while self._queued or self._current is not None:
            self._idle.clear()
            await self._idle.wait()

    def forecast(self) -> dict[str, Any] | None:
        """The checkpoint being uploaded now (an urgent one first, early uploads included): how
        much is in the bucket, at what rate, and whether it will be in before the deadline."""
        current = self._current
        if current is not None:
            name, urgent, progress = current.name, current.urgent, current.progress
        else:
            early = [n for n, tasks in self._early.items() if any(not t.done() for t in tasks) and n in self._progress]
            early += [stream.name for stream in self._streams.values() if stream.name in self._progress]
            if not early:
                return None
            name = max(early, key=lambda n: (n in self._urgent, n))
            urgent, progress = name in self._urgent, self._progress[name]
        rate, eta, total = progress.rate(), progress.eta(), progress.total
        report: dict[str, Any] = {
            "name": name,
            "urgent": urgent,
            "bytes_done": progress.done,
            "bytes_total": total,
            # Before the commit the trainer may still be writing files nobody has announced yet.
            "total_known": current is not None,
            "rate_bytes_s": None if rate is None else round(rate),
            "eta_s": None if eta is None else round(eta, 2),
        }
        if self._deadline is not None and urgent:
            left = (self._deadline - utcnow()).total_seconds()
            report["deadline_s_left"] = round(left, 2)
            report["will_meet_deadline"] = None if eta is None else eta <= left
        return report

    async def watch_deadline(self) -> None:
        """Log, every ``forecast_interval`` while an urgent upload races a deadline, whether it
        will make it at the rate so far; say once when the deadline passed with it unfinished."""
        while True:
            await asyncio.sleep(self.forecast_interval)
            report = self.forecast()
            if report is None or "deadline_s_left" not in report:
                continue
            name, left = report["name"], report["deadline_s_left"]
            where = f"{name}: {_mib(report['bytes_done'])} of {_mib(report['bytes_total'])} MiB in the bucket"
            rate = report["rate_bytes_s"]
            if left <= 0:
                if name not in self._late_logged:
                    self._late_logged.add(name)
                    logger.error("deadline passed %.1f s ago with %s still uploading (%s)", -left, name, where)
                continue
            if rate is None:
                logger.info("%s; no rate yet, deadline in %.1f s", where, left)
            elif report["will_meet_deadline"]:
                logger.info(
                    "%s at %.0f MB/s; done in ~%.1f s, deadline in %.1f s: on track",
                    where,
                    rate / 1e6,
                    report["eta_s"],
                    left,
                )
            else:
                logger.warning(
                    "%s at %.0f MB/s; done in ~%.1f s, deadline in %.1f s: will MISS it by ~%.1f s",
                    where,
                    rate / 1e6,
                    report["eta_s"],
                    left,
                    report["eta_s"] - left,
                )

    def status(self) -> dict[str, Any]:
        return {
            "bucket": self.storage.url if self.storage else None,
            "current": self.forecast(),
            "queued": sorted(self._queued),
            "committed": sorted(self.committed)[-5:],
            "last_committed": self.last_committed,
            "failures": self.failures[-5:],
            "failing_streak": self.failing_streak(),
            "conflicts": sorted(self.conflicts)[-5:],
        }


def _mib(count: int) -> str:
    return f"{count / (1 << 20):.0f}"
