"""Parallel ranged downloads of many objects at once, CRC32C-verified while the bytes arrive.

Every byte range of every file goes through one pool of ``streams`` workers, the way the upload
side shares one budget of streams across files: a connection is capped (S3 gives each tens of
MB/s), so the number of streams in flight decides the speed, not how the bytes fall into files.
Ranges are sized so that the whole set needs about one range per stream (never under
``min_range``, S3's advice being 8-16 MB, nor over ``max_range``): eight 128 MiB files on 16
streams go as two ranges each, one 1 GiB file as sixteen. Fewer, larger requests cost less per
byte than many small ones wherever the first byte is slow.

Integrity without a second read: each range's CRC32C is computed as it is written (``pwrite`` at
its offset, so ranges land in any order), the ranges' CRCs are combined, and the file is renamed
into place only when the result equals the manifest's. A transient failure restarts just that
range; one that keeps failing, or a mismatch, fails the file and leaves nothing under its name.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import google_crc32c

from spotguard.crc32c import crc32c_combine, crc32c_hex
from spotguard.safefile import fsync_dir
from spotguard.storage.base import ObjectInfo, ObjectNotFound, Progress, Storage, TransientStorageError, retry

MiB = 1024 * 1024
MISSING = "missing"


@dataclass(frozen=True)
class Download:
    """One object to fetch: its key, what the manifest says of it, and where it goes
    (``local=None``: check it only, write nothing, as ``verify`` does)."""

    key: str
    size: int
    crc32c: str | None  # hex, as in manifest.json; None: the size alone is checked
    local: Path | None = None


class RangeSink:
    """Where a backend's ``read_range`` writes: at ``offset`` in an open file (or nowhere), with a
    running CRC32C and byte count. A file-like ``write`` so SDKs that download into a file object
    (google-cloud-storage) can write into it directly."""

    def __init__(self, fd: int | None, offset: int, limit: int) -> None:
        self._fd = fd
        self._offset = offset
        self._limit = limit
        self.crc = 0
        self.count = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        chunk = bytes(data)  # google-crc32c takes bytes only
        if self.count + len(chunk) > self._limit:
            raise TransientStorageError(f"the store sent more than the {self._limit} bytes asked for")
        if self._fd is not None:
            view = memoryview(chunk)
            while view:
                written = os.pwrite(self._fd, view, self._offset + self.count)
                self.count += written
                view = view[written:]
        else:
            self.count += len(chunk)
        self.crc = int(google_crc32c.extend(self.crc, chunk))
        return len(chunk)


def range_size(total: int, streams: int, min_range: int = 16 * MiB, max_range: int = 256 * MiB) -> int:
    """About one range per stream for ``total`` bytes, within [min_range, max_range], whole MiB."""
    per_stream = -(-total // max(streams, 1))
    size = min(max(per_stream, min_range), max_range)
    return -(-size // MiB) * MiB


@dataclass
class _File:
    item: Download
    ranges: int  # ranges not yet done; the file is finished (or dropped) by whoever ends the last
    tmp: Path | None = None
    fd: int | None = None
    crcs: dict[int, tuple[int, int]] = field(default_factory=dict)  # offset -> (crc, length)
    failed: bool = False
    problem: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


def download_files(
    storage: Storage,
    items: Sequence[Download],
    *,
    streams: int = 16,
    min_range: int = 16 * MiB,
    max_range: int = 256 * MiB,
    progress: Progress | None = None,
    deadline: float | None = None,
    attempts: int = 6,
) -> list[str]:
    """Fetch ``items`` through one pool of ``streams`` ranged reads; returns the problems found.

    A file whose bytes do not match its size and CRC32C is a problem (and is not written); so is
    one that is missing. A transient failure that outlasts its retries (or ``deadline``, a
    ``time.monotonic()`` value) raises :class:`StorageError`, as does a fatal one; files renamed
    into place before that stay.

    Open files stay within ``streams + 1``, however many files there are: a file is opened when
    its first range starts and finished (checked, made durable, renamed, closed) when its last one
    ends, and the pool starts ranges in order, file after file.
    """
    chunk = range_size(sum(item.size for item in items), streams, min_range, max_range)
    # The long files start first.
    files = [_File(item, -(-item.size // chunk)) for item in sorted(items, key=lambda i: -i.size)]
    try:

        def fetch(entry: _File, offset: int, length: int) -> None:
            _fetch_range(storage, entry, offset, length, deadline=deadline, attempts=attempts, progress=progress)

        jobs = [(f, off, min(chunk, f.item.size - off)) for f in files for off in range(0, f.item.size, chunk)]
        missing = _run_ranges(jobs, streams, fetch)
        for entry in files:
            if entry.ranges == 0 and entry.item.size == 0:  # nothing to fetch; made once the rest arrived
                _open(entry)
                entry.problem = _finish(entry)
        return [f"{key}: {MISSING}" for key in missing] + [
            entry.problem for entry in files if entry.problem and entry.item.key not in missing
        ]
    finally:
        for entry in files:
            _discard(entry)


def _fetch_range(
    storage: Storage,
    entry: _File,
    offset: int,
    length: int,
    *,
    deadline: float | None,
    attempts: int,
    progress: Progress | None,
) -> None:
    """One range of one file, retried; the file is opened by its first range and finished by its last."""
    with entry.lock:
        if entry.fd is None and entry.tmp is None and not entry.failed:
            _open(entry)

    def attempt() -> RangeSink:
        sink = RangeSink(entry.fd, offset, length)
        storage.read_range(entry.item.key, offset, length, sink)
        if sink.count != length:
            raise TransientStorageError(f"{entry.item.key}: got {sink.count} of {length} bytes at {offset}")
        return sink

    try:
        sink = retry(
            attempt,
            is_transient=lambda exc: isinstance(exc, TransientStorageError) or storage.is_transient(exc),
            deadline=deadline,
            attempts=attempts,
            what=f"downloading {entry.item.key} bytes {offset}-{offset + length - 1}",
        )
    except BaseException:
        entry.failed = True
        raise
    finally:
        with entry.lock:
            entry.ranges -= 1
            last = entry.ranges == 0
        if last and entry.failed:
            _discard(entry)  # its descriptor goes back to the budget now, not at the end
    with entry.lock:
        entry.crcs[offset] = (sink.crc, length)
    if progress:
        progress(length)
    if last:
        entry.problem = _finish(entry)


def _run_ranges(
    jobs: list[tuple[_File, int, int]], streams: int, fetch: Callable[[_File, int, int], None]
) -> list[str]:
    """Run every range in one pool of ``streams`` threads; returns the keys of files the store no longer
    has (one file gone is a finding about that file: the others still count). Any other failure raises,
    and the ranges not started are cancelled."""
    with cf.ThreadPoolExecutor(max_workers=max(1, min(streams, len(jobs) or 1)), thread_name_prefix="get") as pool:
        futures = {pool.submit(fetch, *job): job[0] for job in jobs}
        missing: list[str] = []
        try:
            for future in cf.as_completed(futures):
                exc = future.exception()
                if exc is None:
                    continue
                if isinstance(exc, ObjectNotFound):
                    key = futures[future].item.key
                    if key not in missing:
                        missing.append(key)
                    continue
                raise exc
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    return missing


def fetch_object(storage: Storage, info: ObjectInfo, local: Path, *, streams: int, min_range: int) -> None:
    """One object to ``local``, for a backend's ``get_file``: ``info`` is what the store reports
    of it (size, CRC32C if any); a mismatch is transient (the bytes were damaged on the way)."""
    problems = download_files(
        storage, [Download(info.key, info.size, info.crc32c, local)], streams=streams, min_range=min_range
    )
    if problems == [f"{info.key}: {MISSING}"]:
        raise ObjectNotFound(f"{storage.url}/{info.key}: not found")
    if problems:
        raise TransientStorageError(f"{storage.url}: {problems[0]}")


def _open(entry: _File) -> None:
    item = entry.item
    if item.local is None:
        return
    item.local.parent.mkdir(parents=True, exist_ok=True)
    tmp = item.local.with_name(f".{item.local.name}.{uuid.uuid4().hex[:8]}.part")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    entry.tmp, entry.fd = tmp, fd
    os.ftruncate(fd, item.size)  # ranges land in any order; on failure _discard removes the file


def _finish(entry: _File) -> str | None:
    """Combine the ranges' CRCs; on a match make the file durable and rename it into place."""
    crc = 0
    for offset in sorted(entry.crcs):
        part_crc, length = entry.crcs[offset]
        crc = crc32c_combine(crc, part_crc, length)
    got = sum(length for _, length in entry.crcs.values())
    item = entry.item
    if got != item.size:
        return f"{item.key}: {got} bytes, manifest says {item.size}"
    if item.crc32c is not None and crc32c_hex(crc) != item.crc32c:
        return f"{item.key}: crc32c {crc32c_hex(crc)}, manifest says {item.crc32c}"
    if entry.fd is not None and entry.tmp is not None and item.local is not None:
        os.fsync(entry.fd)
        os.close(entry.fd)
        entry.fd = None
        os.replace(entry.tmp, item.local)
        entry.tmp = None
        fsync_dir(item.local.parent)
    return None


def _discard(entry: _File) -> None:
    if entry.fd is not None:
        os.close(entry.fd)
        entry.fd = None
    if entry.tmp is not None:
        with contextlib.suppress(FileNotFoundError):
            entry.tmp.unlink()
        entry.tmp = None


__all__ = ["Download", "RangeSink", "download_files", "fetch_object", "range_size"]
