"""Uploads of a checkpoint's files ahead of its commit.

A file the trainer has finished goes up whole; a file still being written, on a backend that
can stream, goes up part by part as its ranges are announced, and is completed when it is
finished. The checkpoint's own upload job then waits for these and skips what they sent.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotguard.manifest import MANIFEST, FileEntry
from spotguard.safefile import is_unlinked, open_nofollow
from spotguard.storage.base import ObjectInfo, Storage, StorageError
from spotguard.storage.checkpoints import UploadProgress, put_with_retry
from spotguard.storage.stream import UploadStream

logger = logging.getLogger("spotguard.uploader")

RunInThread = Callable[..., Awaitable[Any]]


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


class EarlyUploads:
    """The files of checkpoints still being written, uploading ahead of their commit.

    ``progress`` (what is in the bucket of each checkpoint not yet committed there) is shared
    with the uploader; ``run_in_thread`` runs a long blocking transfer in the uploader's threads.
    """

    def __init__(
        self, storage: Storage | None, progress: dict[str, UploadProgress], run_in_thread: RunInThread, *, slots: int
    ) -> None:
        self.storage = storage
        self.progress = progress
        self.run_in_thread = run_in_thread
        self.tasks: dict[str, list[asyncio.Task[None]]] = {}  # by checkpoint
        self.slots = asyncio.Semaphore(slots)
        self.manifest_seen: dict[str, asyncio.Future[ObjectInfo | None]] = {}  # per checkpoint uploading early
        # Files still being written whose parts go up as they are announced (by checkpoint, file).
        self.streams: dict[tuple[str, str], _Stream] = {}
        self.aborting: set[asyncio.Task[None]] = set()

    def progress_of(self, name: str) -> UploadProgress:
        return self.progress.setdefault(name, UploadProgress())

    def file_ready(self, step_dir: Path, rel: str, entry: FileEntry) -> None:
        """Finish the streamed upload of ``rel``, or send it whole if it was not streamed; nothing if
        this file as ``entry`` says is on its way already."""
        progress = self.progress_of(step_dir.name)
        taken = progress.take_ahead(rel, entry)
        stream = self.streams.pop((step_dir.name, rel), None)
        if stream is None and not taken:
            # The commit's job finished its stream before the file's own message was read (a rescan
            # found the manifest first), or the message came twice: sending it whole would put the
            # same bytes up a second time, in the race with the deadline.
            logger.info("%s/%s: already going up ahead of its commit; nothing more to send", step_dir.name, rel)
            return
        progress.expect(rel, entry.size)
        if stream is not None:
            work = self._finish_stream(step_dir, stream, entry)
        else:
            work = self._early_upload(step_dir, rel, entry)
        task = asyncio.create_task(work, name=f"early-{step_dir.name}/{rel}")
        self.tasks.setdefault(step_dir.name, []).append(task)

    def stream_of(
        self, storage: Storage, step_dir: Path, rel: str, *, tmp: str, size: int, owner: int | None
    ) -> UploadStream | None:
        """The streamed upload of ``rel``, begun at its first range; None if it goes whole instead.
        Raises ValueError if ``tmp`` or ``size`` contradict what was announced of it before."""
        stream = self.streams.get((step_dir.name, rel))
        if stream is None:
            stream = self._begin_stream(storage, step_dir, rel, tmp=tmp, size=size, owner=owner)
            return None if stream is None else stream.upload
        if (stream.tmp, stream.size) != (tmp, size):
            raise ValueError(
                f"{step_dir.name}/{rel}: announced as {stream.tmp} of {stream.size} bytes, now as {tmp} of {size}"
            )
        return stream.upload

    def _begin_stream(
        self, storage: Storage, step_dir: Path, rel: str, *, tmp: str, size: int, owner: int | None
    ) -> _Stream | None:
        # Opened once, here: refusing a symlink, and following the file across the writer's rename.
        fd = open_nofollow(step_dir / tmp)
        try:
            progress = self.progress_of(step_dir.name)
            progress.expect(rel, size)
            upload = storage.begin_stream(f"{step_dir.name}/{rel}", size, fd, progress=progress.sender(rel))
        except BaseException:
            os.close(fd)
            raise
        if upload is None:
            os.close(fd)
            return None
        stream = _Stream(step_dir.name, rel, tmp, size, owner, fd, upload)
        self.streams[(step_dir.name, rel)] = stream
        logger.debug("%s/%s: streaming its upload as it is written (%d bytes)", step_dir.name, rel, size)
        return stream

    async def close(self) -> None:
        """Abort every streamed upload whose file is not finished, and wait for it."""
        self.abort("the daemon is stopping", every=True)
        await asyncio.gather(*self.aborting, return_exceptions=True)

    def abort(self, why: str, *, name: str | None = None, owner: int | None = None, every: bool = False) -> None:
        """Abort the streamed uploads of files that will never be finished: of checkpoint ``name``,
        of the connection ``owner``, or (neither given) those whose temporary file is gone."""
        for key, stream in list(self.streams.items()):
            if name is not None and stream.name != name:
                continue
            if owner is not None and stream.owner != owner:
                continue
            if name is None and owner is None and not every and not is_unlinked(stream.fd):
                continue
            del self.streams[key]
            logger.info("%s/%s: aborting its streamed upload: %s", stream.name, stream.rel, why)
            task = asyncio.create_task(self._abort_stream(stream), name=f"abort-{stream.name}/{stream.rel}")
            self.aborting.add(task)
            task.add_done_callback(self.aborting.discard)

    async def _abort_stream(self, stream: _Stream) -> None:
        try:
            await asyncio.to_thread(stream.upload.abort)
        except Exception:
            logger.exception("%s/%s: aborting its streamed upload failed", stream.name, stream.rel)
        finally:
            os.close(stream.fd)

    async def discard(self, name: str, why: str, committed: Callable[[str], bool]) -> list[str]:
        """A save of ``name`` failed: abort its streamed uploads, let its uploads ahead of the commit
        settle, and remove from the bucket every file of it sent here, unless ``committed(name)``
        or a manifest is there by then. Returns the keys removed."""
        self.abort(why, name=name)
        progress = self.progress.pop(name, None)
        # A transfer in a thread cannot be cancelled: wait for it, then remove what it left.
        await asyncio.gather(*self.tasks.pop(name, []), *self.aborting, return_exceptions=True)
        storage = self.storage
        if storage is None or progress is None or committed(name):
            return []
        keys = [f"{name}/{rel}" for rel in progress.files()]

        def remove() -> list[str]:
            # A save of the same step begun again meanwhile owns these names now: leave them to it.
            if name in self.progress or storage.stat(f"{name}/{MANIFEST}") is not None:
                return []
            present = [key for key in keys if storage.stat(key) is not None]
            storage.delete(present)
            return present

        try:
            removed: list[str] = await self.run_in_thread(remove)
        except (StorageError, OSError) as exc:
            logger.warning("%s: cannot remove the files of the failed save from the bucket: %s", name, exc)
            return []
        if removed:
            logger.info("%s: removed %d file(s) of the failed save from the bucket", name, len(removed))
        return removed

    async def _finish_stream(self, step_dir: Path, stream: _Stream, entry: FileEntry) -> None:
        """The file is finished: complete its streamed upload, or send it whole if that fails."""
        key = f"{stream.name}/{stream.rel}"
        progress = self.progress_of(stream.name)
        try:
            if await self._committed_elsewhere(stream.name):
                await asyncio.to_thread(stream.upload.abort)
                return
            if entry.size != stream.size:
                await asyncio.to_thread(stream.upload.abort)
                raise StorageError(f"{key}: finished with {entry.size} bytes, announced as {stream.size}")
            await self.run_in_thread(stream.upload.finish, entry.crc32c)
            progress.present(stream.rel)
            progress.mark_sent(stream.rel, entry)
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
        progress = self.progress_of(step_dir.name)
        async with self.slots:
            try:
                if await self._committed_elsewhere(step_dir.name):
                    return  # another writer's checkpoint has this name: the commit decides, ours sends nothing
                await self.run_in_thread(
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
        if name not in self.manifest_seen:
            assert self.storage is not None
            self.manifest_seen[name] = asyncio.ensure_future(asyncio.to_thread(self.storage.stat, f"{name}/{MANIFEST}"))
        return await asyncio.shield(self.manifest_seen[name]) is not None

    def settle(self, step_dir: Path, files: Mapping[str, FileEntry], *, committed: bool) -> bool:
        """At the commit, a file still streaming is finished if the commit lists it (unless the
        checkpoint is ``committed`` already), else aborted (a file the writer gave up on). True if
        the commit lists any."""
        left = [stream for stream in self.streams.values() if stream.name == step_dir.name]
        finished = False
        for stream in left:
            entry = files.get(stream.rel)
            if entry is None:
                continue
            finished = True
            if not committed:
                self.file_ready(step_dir, stream.rel, entry)
        self.abort("the committed checkpoint does not list it", name=step_dir.name)
        return finished

    def forget_done(self) -> None:
        """Drop the finished uploads from ``tasks``."""
        for name, tasks in list(self.tasks.items()):
            pending = [task for task in tasks if not task.done()]
            if pending:
                self.tasks[name] = pending
            else:
                del self.tasks[name]

    def forget_gone(self, keep: set[str]) -> set[str]:
        """Forget the progress of checkpoints not in ``keep`` and with no files uploading ahead of their
        commit (an upload that failed until local retention removed its checkpoint left it behind);
        ``keep`` with those checkpoints added."""
        keep = keep | set(self.tasks) | {stream.name for stream in self.streams.values()}
        for memo in (self.progress, self.manifest_seen):
            for name in memo.keys() - keep:
                del memo[name]
        return keep

    def uploading(self) -> list[str]:
        """The checkpoints with files uploading ahead of their commit (a name may repeat)."""
        names = [n for n, tasks in self.tasks.items() if any(not t.done() for t in tasks) and n in self.progress]
        names += [stream.name for stream in self.streams.values() if stream.name in self.progress]
        return names
