"""Received files of the peer tier, written range by range and checked against a manifest.

Both ends that receive a checkpoint use these: a receiver taking a replica from a sender
(spotguard/peer/receiver.py) and a fresh VM fetching one back (spotguard/peer/fetch.py). Each data
frame's range is written in a thread (``pwrite``) while the next frame is read, and its CRC32C is
noted, so that a file whose ranges tile it exactly is verified without reading it back.
"""

from __future__ import annotations

import asyncio
import bisect
import ctypes
import errno
import fcntl
import os
from collections.abc import Awaitable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

from spotguard.crc32c import crc32c_combine, crc32c_hex_to_int, crc32c_of_bytes, crc32c_of_file
from spotguard.manifest import MAX_KEY_BYTES, FileEntry, Manifest, ManifestError, check_relpath, parse_step_dir
from spotguard.peer import wire
from spotguard.storage.base import split_bucket_url

# Disk writes of one replica in flight while its flows' next frames are read (memory, where frames
# are received in-process: one more than this x the frame size, at most MAX_DATA: 72 MiB).
WRITES_IN_FLIGHT = 8

Ranges = dict[str, list[tuple[int, int, int]]]  # per file, (offset, length, CRC32C) of every range written

# What a file or a directory takes on disk at least: one filesystem block. A replica's reservation
# counts its files' and directories' blocks, not their bytes, so that empty files in fresh
# directories cost what they take.
BLOCK = 4096


def data_header(header: dict[str, Any]) -> tuple[str, int, int, int]:
    """A ``data`` frame's (file, file size, offset, length), the name checked to stay inside the
    step directory; raises :class:`~spotguard.peer.wire.PeerError`."""
    try:
        rel = check_relpath(wire.field(header, "name", str))
    except ManifestError as exc:
        raise wire.PeerError("bad-path", str(exc)) from None
    size, offset, length = (wire.field(header, key, int) for key in ("size", "offset", "len"))
    return rel, size, offset, length


def check_bucket_key(bucket: str, step: str, rel: str) -> None:
    """``rel`` of checkpoint ``step`` must make a key the bucket ``bucket`` takes: with the bucket's
    prefix, at most :data:`~spotguard.manifest.MAX_KEY_BYTES` (a key it refuses would make the
    replica's upload fail on every try, and hold its slot). A name alone is bounded without the
    prefix (``check_relpath``)."""
    scheme = urlsplit(bucket).scheme
    if scheme not in ("s3", "gs"):
        return  # a directory: its names are bounded as the filesystem's are
    _, prefix = split_bucket_url(bucket, scheme)
    size = len(f"{prefix}{step}/{rel}".encode())
    if size > MAX_KEY_BYTES:
        too_long = f"{rel[:64]}...: its key in {bucket} would be {size} bytes, over {MAX_KEY_BYTES}"
        raise wire.PeerError("bad-path", too_long)


def check_range(rel: str, size: int, offset: int, length: int) -> None:
    """A data frame's range must lie inside its file and carry at most one frame's bytes."""
    if not (0 <= length <= wire.MAX_DATA and offset >= 0 and offset + length <= size):
        raise wire.PeerError("bad-field", f"{rel}: a range [{offset}, +{length}) outside 0..{size}")


def parse_manifest(text: str, name: str) -> Manifest:
    """The manifest a peer sent for the step directory ``name``: it must be one, of that step."""
    try:
        manifest = Manifest.from_json(text.encode())
    except ManifestError as exc:
        raise wire.PeerError("bad-manifest", str(exc)) from None
    if parse_step_dir(name) != manifest.step:
        raise wire.PeerError("bad-manifest", f"{name}: the manifest says step {manifest.step}")
    return manifest


def on_disk(size: int) -> int:
    """What a file of ``size`` bytes takes on disk at least: whole blocks, one for an empty file."""
    return max(1, -(-size // BLOCK)) * BLOCK


def new_file_on_disk(rel: str, size: int, made: set[str]) -> tuple[int, list[str]]:
    """What the file ``rel`` of ``size`` bytes takes on disk at least, with the directories it goes
    into that are not in ``made`` yet (one block each); and those directories (``made`` is left as it is)."""
    parents = [str(parent) for parent in PurePosixPath(rel).parents][:-1]  # all but "."
    fresh = [parent for parent in parents if parent not in made]
    return on_disk(size) + BLOCK * len(fresh), fresh


def footprint(files: Mapping[str, FileEntry]) -> int:
    """What the files of a manifest and their directories take on disk at least."""
    made: set[str] = set()
    total = 0
    for rel, entry in files.items():
        taken, fresh = new_file_on_disk(rel, entry.size, made)
        made.update(fresh)
        total += taken
    return total


def make_parent(step_dir: Path, rel: str) -> None:
    """The directory ``rel`` goes into (once per file), which must not lead out of ``step_dir``."""
    path = step_dir / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.parent.resolve().is_relative_to(step_dir.resolve()):
        raise wire.PeerError("bad-path", f"{rel} leaves the replica")


def create_exclusive(step_dir: Path, rel: str, mode: int) -> None:
    """Create the file ``rel`` empty, with ``mode`` set on its descriptor: never one that exists, never
    through a link."""
    fd = os.open(step_dir / rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def write_at(path: Path | str, offset: int, data: bytes | memoryview) -> int:
    """pwrite ``data`` at ``offset`` of ``path`` (created if need be, never through a link); its
    CRC32C. Writes to one file take turns (``flock``): writers of one file contend for its inode's lock
    in the kernel, which spins while the holder runs; measured, 8 threads writing one file spent twice
    the CPU of the same writes taken in turns, in the same time. Other files still write in parallel."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)  # and the lock with it
    # google-crc32c takes no bytearray nor memoryview (only buffers that need no release); a ctypes
    # array over the same memory is one, without a copy.
    if isinstance(data, memoryview):  # a receiver's reused buffer (writable)
        crc = crc32c_of_bytes((ctypes.c_char * len(data)).from_buffer(data))  # type: ignore[arg-type]
    else:
        crc = crc32c_of_bytes(data)
    return crc32c_hex_to_int(crc)


def write_range(
    step_dir: Path, rel: str, offset: int, data: bytes | memoryview, ranges: list[tuple[int, int, int]]
) -> None:
    """:func:`write_at` one range (in a thread) and note its CRC32C in ``ranges`` (a list append is atomic)."""
    ranges.append((offset, len(data), write_at(step_dir / rel, offset, data)))


async def disk_write(write: Awaitable[None], what: str) -> None:
    """A replica's disk write, whose failure of this node's disk (the errno the write got) is told as
    such: the sender hears ``no-space`` (a full disk) or ``disk``, and the log names the disk, where
    the OSError read as the connection lost and the sender saw the connection close mid-record."""
    try:
        await write
    except OSError as exc:
        if not exc.errno:  # not the disk's answer (a worker gone): the caller's own handling
            raise
        code = "no-space" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "disk"
        raise wire.PeerError(code, f"writing {what} on this node failed: {exc.strerror or exc}") from exc


async def make_room(writes: set[asyncio.Future[None]]) -> None:
    """Wait until fewer than :data:`WRITES_IN_FLIGHT` of ``writes`` are going on; raise the first
    finished one that failed."""
    while len(writes) >= WRITES_IN_FLIGHT:
        done, _ = await asyncio.wait(writes, return_when=asyncio.FIRST_COMPLETED)
        for finished in done:
            writes.discard(finished)
            finished.result()


class Extents:
    """The union of byte ranges ``[start, end)`` seen so far, kept merged and sorted: whether a new
    range overlaps any of them is a look at its two neighbours."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, start: int, end: int) -> bool:
        """Take in ``[start, end)``; whether it overlapped what was there."""
        first = bisect.bisect_left(self._ends, start)  # the first extent not wholly before it
        last = bisect.bisect_right(self._starts, end)  # past the last extent not wholly after it
        overlaps = any(self._starts[i] < end and start < self._ends[i] for i in range(first, last))
        if first < last:  # merge the touching or overlapping extents into one
            start, end = min(start, self._starts[first]), max(end, self._ends[last - 1])
        self._starts[first:last], self._ends[first:last] = [start], [end]
        return overlaps


def combined_crc(ranges: list[tuple[int, int, int]], size: int) -> str | None:
    """The file's CRC32C from its ranges' when they tile ``[0, size)`` exactly; else None (read it)."""
    crc, end = 0, 0
    for offset, length, part in sorted(ranges):
        if offset != end:
            return None  # a gap or an overlap: only the file itself can say
        crc = crc32c_combine(crc, part, length)
        end += length
    return f"{crc:08x}" if end == size else None


def missing_range(ranges: list[tuple[int, int, int]], size: int) -> tuple[int, int] | None:
    """The first range ``[start, end)`` of a ``size``-byte file that no received range covered;
    None when every byte arrived (ranges sent again may overlap)."""
    end = 0
    for offset, length, _ in sorted(ranges):
        if end >= size:
            break
        if offset > end:
            return end, min(offset, size)
        end = max(end, offset + length)
    return (end, size) if end < size else None


def check_files(
    step_dir: Path, files: dict[str, FileEntry] | Any, received: dict[str, int], ranges: Ranges
) -> list[str]:
    """What is wrong with the received files against the manifest (empty: every one matches)."""
    problems = [f"{rel}: received but not in the manifest" for rel in sorted(set(received) - set(files))]
    for rel, entry in sorted(files.items()):
        path = step_dir / rel
        if not path.is_file() or path.is_symlink():
            problems.append(f"{rel}: never received")
        elif path.stat().st_size != entry.size:
            problems.append(f"{rel}: {path.stat().st_size} bytes, the manifest says {entry.size}")
        elif (gap := missing_range(ranges.get(rel, []), entry.size)) is not None:
            # A file is never completed from what the disk holds where nothing arrived: a hole of a
            # sparse file reads as zeros, which a manifest may well match, and the bucket would then
            # get every byte of its declared size.
            problems.append(f"{rel}: bytes [{gap[0]}, {gap[1]}) of {entry.size} never received")
        elif (crc := combined_crc(ranges.get(rel, []), entry.size) or crc32c_of_file(path)) != entry.crc32c:
            # Read back only where ranges overlap (sent again): every byte of it came in a data frame.
            problems.append(f"{rel}: crc32c {crc}, the manifest says {entry.crc32c}")
    return problems


__all__ = [
    "BLOCK",
    "WRITES_IN_FLIGHT",
    "Ranges",
    "check_bucket_key",
    "check_files",
    "check_range",
    "Extents",
    "combined_crc",
    "create_exclusive",
    "data_header",
    "footprint",
    "make_parent",
    "make_room",
    "missing_range",
    "new_file_on_disk",
    "on_disk",
    "write_at",
    "parse_manifest",
    "write_range",
]
