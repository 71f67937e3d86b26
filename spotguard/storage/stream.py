"""Uploading a file while it is still being written: parts go up as soon as their bytes are there.

The writer announces byte ranges of a file whose final size it knows (``add``); every part of the
backend's plan whose bytes are all announced is sent at once, read from a descriptor the caller
opened on the file being written (it stays valid across the writer's rename). ``finish`` sends
whatever is left, checks the part CRC32Cs combined against the file's and only then completes the
object; ``abort`` (or a failed ``finish``) leaves nothing visible and nothing open in the store.

A backend that can stream has ``begin_stream``; one without it uploads the finished file whole.
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import threading
from typing import Any, Protocol, runtime_checkable

from spotguard.crc32c import crc32c_combine
from spotguard.crc32c import crc32c_hex_to_int as _hex_to_int
from spotguard.storage.base import Progress, StorageError

Plan = list[tuple[int, int, int]]  # (part number, offset, length), in offset order


class UploadStream(Protocol):
    def add(self, offset: int, length: int) -> None:
        """Bytes ``[offset, offset + length)`` are written; never blocks (parts go up in threads)."""
        ...

    def finish(self, crc32c: str) -> None:
        """The whole file is written and its CRC32C is ``crc32c``: send the rest, check, complete.
        Blocking. On failure the upload is aborted before this raises."""
        ...

    def abort(self) -> None:
        """Drop the upload: nothing completed, nothing left open. Blocking; idempotent."""
        ...


@runtime_checkable
class Streaming(Protocol):
    def begin_stream(self, key: str, size: int, fd: int, *, progress: Progress | None = None) -> UploadStream | None:
        """A stream for ``key`` of ``size`` bytes read from ``fd`` (the caller closes it after
        ``finish``/``abort``), or None for a file too small to be worth it (it goes whole)."""
        ...


class PartStream:
    """The bookkeeping every backend's stream shares: coverage per part, parts sent in a shared
    pool, failure and abort. A backend fills in ``_start``, ``_send_part``, ``_complete`` and
    ``_abort_upload`` (called from the pool's threads, or from ``finish``/``abort``)."""

    def __init__(
        self, what: str, size: int, plan: Plan, pool: cf.Executor, *, progress: Progress | None = None
    ) -> None:
        self.what = what
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
            self._complete([token for _, token in results], expected)
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
            if self._started:
                self._started = False
                self._abort_upload()

    # --- for the backend ------------------------------------------------------------------

    def _start(self) -> None:
        """Open the upload in the store (before the first part)."""

    def _send_part(self, number: int, offset: int, length: int) -> tuple[int, Any]:
        """Send one part; return its CRC32C and what ``_complete`` needs of it."""
        raise NotImplementedError

    def _complete(self, tokens: list[Any], crc: int) -> None:
        """Make the object visible from its parts (in plan order), verified."""
        raise NotImplementedError

    def _abort_upload(self) -> None:
        """Remove what was sent; called once, after ``_start`` succeeded."""

    # --- internals ------------------------------------------------------------------------

    def _submit(self, index: int) -> None:
        self._futures[index] = self._pool.submit(self._run_part, *self._plan[index])

    def _ensure_started(self) -> None:
        with self._start_lock:
            if self._aborted:
                raise StorageError(f"{self.what}: the upload was aborted")
            if not self._started:
                self._start()
                self._started = True

    def _run_part(self, number: int, offset: int, length: int) -> tuple[int, Any]:
        if self._failed is not None:
            raise StorageError(f"{self.what}: not sending part {number}: an earlier part failed") from self._failed
        try:
            self._ensure_started()
            result = self._send_part(number, offset, length)
        except BaseException as exc:
            self._failed = self._failed or exc
            raise
        if self._progress is not None:
            self._progress(length)
        return result


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
