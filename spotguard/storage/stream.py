"""The one part engine: every multipart upload, of a finished file or of one still being written.

A backend plans the parts of a file (``(number, offset, length)``, in offset order) and implements
:class:`PartUpload`, the calls of one upload open in its store; this engine does the rest: it opens
the upload before the first part (``initiate``, a factory the backend hands in), sends parts in the
backend's shared pool (``put_part``), checks the part CRC32Cs combined against the file's and only
then completes the object (``complete``), and on any failure or cancel removes what was sent
(``abort``): nothing half-written is ever visible, nothing stays open in the store.

Two ways in, one engine:

* a finished file: :func:`send_file` (every part goes at once);
* a file still being written: the writer announces byte ranges of a file whose final size it knows
  (:meth:`PartStream.add`); every part whose bytes are all announced is sent at once, read from a
  descriptor the caller opened on the file being written (it stays valid across the writer's
  rename); :meth:`PartStream.finish` sends whatever is left. A backend that can do this declares
  :attr:`~spotguard.storage.base.Capability.STREAMING` and returns a :class:`PartStream` from
  ``begin_stream``.

A streamed file's parts come from :func:`streamed_plan`: big parts for most of the file, smaller ones
toward its end (down to the store's minimum for the last one), so that what is left to send once the
writer has written the file's last byte is one small part rather than one big one.

The call sequence is the one of fsspec's buffered files and of torch DCP's storage writers:
initiate, parts (in parallel, any order), complete or abort, exactly once.
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from spotguard.crc32c import crc32c_combine
from spotguard.crc32c import crc32c_hex_to_int as _hex_to_int
from spotguard.safefile import open_nofollow
from spotguard.storage.base import Progress, StorageError, UploadStream

__all__ = ["PartStream", "PartUpload", "Plan", "StreamPool", "UploadStream", "send_file", "streamed_plan"]

Plan = list[tuple[int, int, int]]  # (part number, offset, length), in offset order

_TAPER_QUANTUM = 1 << 20  # tapered part lengths are whole MiB


def streamed_plan(size: int, part: int, *, min_part: int, streams: int, first: int = 1) -> Plan:
    """The parts of a file sent while it is written: parts of ``part`` bytes, except toward the end,
    where a part that ends ``d`` bytes before the file's end is ``min_part + d / streams`` bytes
    (whole MiB, at most ``part``): the last part is ``min_part``, and the ones before it grow.

    Why that length: a part can go only once its last byte is written, then crosses one connection.
    While the upload keeps up with the writer (the writer at most as fast as ``streams`` connections
    together), the part ending ``d`` bytes before the end takes at most ``min_part / rate + d /
    (streams * rate)`` seconds on its connection, which is at most ``min_part`` / one connection's rate
    more than the writer takes to write the ``d`` bytes after it: every part is sent at most about one
    smallest part's transfer (plus the rounding to whole MiB) after the file's last byte is written.
    The taper covers about ``streams * (part - min_part)`` bytes at the file's end, in about
    ``streams * ln(part / min_part)`` parts; the rest of the file keeps the big parts (few requests).
    Every part but the last is at least ``min_part`` (S3's minimum); numbers start at ``first``,
    consecutive, in offset order."""
    tail: list[int] = []  # lengths, from the file's end backwards
    end = size
    while end > 0:
        length = min(part, -(-(min_part + (size - end) // max(streams, 1)) // _TAPER_QUANTUM) * _TAPER_QUANTUM)
        if length >= part:
            break
        if end - length < min_part:
            length = end  # what would be left before it is too small to be a part of its own
        tail.append(length)
        end -= length
    lengths = [part] * (end // part)
    rest = end - len(lengths) * part
    if rest and (rest >= min_part or not tail):
        lengths.append(rest)
    elif rest:
        tail[-1] += rest  # too small to stand before a tapered part: the nearest one takes it
    lengths.extend(reversed(tail))
    plan: Plan = []
    offset = 0
    for number, length in enumerate(lengths, first):
        plan.append((number, offset, length))
        offset += length
    return plan


class PartUpload(Protocol):
    """One multipart upload open in a store (made by the backend's ``initiate`` factory, which opens
    it). The engine calls ``put_part`` for every part of the plan, from pool threads, in any order;
    then exactly one of ``complete`` (parts' tokens in plan order) or ``abort``."""

    def put_part(self, number: int, offset: int, length: int) -> tuple[int, Any]:
        """Send one part (its bytes read by the upload from its file); its CRC32C and what
        ``complete`` needs of it (an ETag, a part object)."""
        ...

    def complete(self, tokens: list[Any], crc: int) -> None:
        """Make the object visible from its parts, whose CRC32Cs combine to ``crc`` (checked by the
        engine); verified where the store can say. Nothing is left to abort once this returns."""
        ...

    def abort(self) -> None:
        """Remove what was sent; nothing of the upload stays open in the store."""
        ...


class PartStream:
    """The engine for one upload: coverage per part, parts sent in a shared pool, the CRC32C check,
    failure and abort. The store's side is the :class:`PartUpload` that ``initiate`` opens (at the
    first part, from a pool thread, or at ``finish``)."""

    def __init__(
        self,
        what: str,
        size: int,
        plan: Plan,
        pool: cf.Executor,
        initiate: Callable[[], PartUpload],
        *,
        progress: Progress | None = None,
    ) -> None:
        self.what = what
        self._initiate = initiate
        self._upload: PartUpload | None = None
        self.size = size
        self._plan = plan
        self._pool = pool
        self._progress = progress
        self._lock = threading.Lock()
        self._covered = [0] * len(plan)
        self._starts = [start for _, start, _ in plan]
        self._ranges: list[tuple[int, int]] = []  # announced (offset, length), sorted
        self._futures: dict[int, cf.Future[tuple[int, Any]]] = {}  # by index into the plan
        self._start_lock = threading.Lock()
        self._started = False
        self._failed: BaseException | None = None
        self._finishing = False  # no more ranges: finish() sends what is left
        self._aborted = False

    # --- for the caller -------------------------------------------------------------------

    def add(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ValueError(f"{self.what}: range [{offset}, {offset + length}) outside the file's {self.size} bytes")
        with self._lock:
            if self._finishing or self._aborted:
                return
            if length == 0:
                return
            # Ranges never overlap (or a part would be sent before its bytes are final): checked
            # against the announced ones, kept sorted by offset.
            at = bisect.bisect(self._ranges, (offset, length))
            before = self._ranges[at - 1] if at else None
            after = self._ranges[at] if at < len(self._ranges) else None
            if (before and before[0] + before[1] > offset) or (after and offset + length > after[0]):
                raise ValueError(f"{self.what}: range [{offset}, {offset + length}) overlaps one announced before")
            self._ranges.insert(at, (offset, length))
            first = bisect.bisect_right(self._starts, offset) - 1
            for index in range(first, len(self._plan)):
                _, start, part_length = self._plan[index]
                if start >= offset + length:
                    break
                self._covered[index] += min(offset + length, start + part_length) - max(offset, start)
                if self._covered[index] == part_length:
                    self._submit(index)

    def finish(self, crc32c: str) -> None:
        expected = _hex_to_int(crc32c)
        try:
            with self._lock:
                if self._aborted:
                    raise StorageError(f"{self.what}: the upload was aborted")
                self._finishing = True
                # The file is complete on disk: a part whose bytes were never announced goes now.
                for index in range(len(self._plan)):
                    if index not in self._futures:
                        self._submit(index)
                futures = [self._futures[i] for i in range(len(self._plan))]
            results = [future.result() for future in futures]
            self._ensure_started()  # an upload of no parts still needs opening
            combined = 0  # the CRC32C of nothing; combining it with a part's gives that part's
            for (_, _, length), (crc, _) in zip(self._plan, results, strict=True):
                combined = crc32c_combine(combined, crc, length)
            if combined != expected:
                raise StorageError(
                    f"{self.what}: CRC32C of the bytes sent {combined:08x} != the file's {expected:08x}; not completed"
                )
            assert self._upload is not None
            self._upload.complete([token for _, token in results], expected)
            self._upload = None  # completed: nothing left to abort
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            futures = list(self._futures.values())
        for future in futures:
            future.cancel()
        cf.wait(futures)
        with self._start_lock:
            upload, self._upload = self._upload, None
        if upload is not None:
            upload.abort()

    # --- internals ------------------------------------------------------------------------

    def _submit(self, index: int) -> None:
        self._futures[index] = self._pool.submit(self._run_part, *self._plan[index])

    def _ensure_started(self) -> None:
        with self._start_lock:
            if self._aborted:
                raise StorageError(f"{self.what}: the upload was aborted")
            if not self._started:
                self._upload = self._initiate()
                self._started = True

    def _run_part(self, number: int, offset: int, length: int) -> tuple[int, Any]:
        if self._failed is not None:
            raise StorageError(f"{self.what}: not sending part {number}: an earlier part failed") from self._failed
        try:
            self._ensure_started()
            assert self._upload is not None
            result = self._upload.put_part(number, offset, length)
        except BaseException as exc:
            self._failed = self._failed or exc
            raise
        if self._progress is not None:
            self._progress(length)
        return result


def send_file(
    local: Path,
    size: int,
    crc32c: str,
    *,
    what: str,
    plan: Plan,
    pool: cf.Executor,
    initiate: Callable[[int], PartUpload],
    progress: Progress | None = None,
) -> None:
    """Upload the finished file ``local`` in the parts of ``plan``: ``initiate`` gets the descriptor
    the parts are read from (opened without following links, closed when this returns)."""
    fd = open_nofollow(local)
    try:
        PartStream(what, size, plan, pool, lambda: initiate(fd), progress=progress).finish(crc32c)
    finally:
        os.close(fd)


class StreamPool:
    """The one pool a backend instance sends streamed parts in, made at first use: a pool per file
    would multiply threads by the files in flight (the parts wait for the backend's budget anyway)."""

    def __init__(self, workers: int, prefix: str) -> None:
        self._workers = workers
        self._prefix = prefix
        self._lock = threading.Lock()
        self._pool: cf.ThreadPoolExecutor | None = None

    def get(self) -> cf.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix=self._prefix)
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
