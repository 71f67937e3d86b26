"""``file:///path``: a directory as a bucket (NFS, Lustre, tests, the embedded default)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import ClassVar
from urllib.parse import urlparse

import google_crc32c

from spotguard.crc32c import crc32c_of_file
from spotguard.safefile import TMP_MARK, atomic_file, fsync_dir, open_nofollow
from spotguard.storage.base import Capability, Listing, ObjectInfo, Progress, Sink, StoreDefaults, read_exactly
from spotguard.storage.errors import ObjectExists, ObjectNotFound, StorageError
from spotguard.storage.stream import PartStream, StreamPool

_COPY_CHUNK = 8 * 1024 * 1024
# Errors a shared filesystem (NFS) can clear up by itself.
_TRANSIENT_ERRNOS = frozenset({errno.EAGAIN, errno.EINTR, errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.EBUSY})


class FileStorage(StoreDefaults):
    capabilities: ClassVar[frozenset[Capability]] = frozenset({Capability.STREAMING})

    def __init__(self, url: str) -> None:
        parsed = urlparse(url)
        if parsed.scheme != "file" or parsed.netloc:
            raise ValueError(f"{url!r} is not a file:///absolute/path URL")
        self.url = url
        self.root = Path(parsed.path)
        self._stream_pool = StreamPool(4, "file-stream")

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if not path.is_relative_to(self.root.resolve()):
            raise StorageError(f"key {key!r} escapes {self.url}")
        return path

    def put_file(self, local: Path, key: str, *, crc32c: str, progress: Progress | None = None) -> None:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(open_nofollow(local), "rb") as source, atomic_file(target) as out:
            while chunk := source.read(_COPY_CHUNK):
                out.write(chunk)
                if progress:
                    progress(len(chunk))
        if out.crc32c != crc32c:
            target.unlink(missing_ok=True)
            raise StorageError(f"{key}: crc32c {out.crc32c} while copying, expected {crc32c}")
        fsync_dir(target.parent)

    def begin_stream(self, key: str, size: int, fd: int, *, progress: Progress | None = None) -> PartStream:
        """Chunks copied into a temporary file beside ``key`` as the file is written; renamed into
        place once the whole is checked."""
        target = self._path(key)
        plan = [(i + 1, off, min(_COPY_CHUNK, size - off)) for i, off in enumerate(range(0, size, _COPY_CHUNK))]
        return PartStream(
            str(target), size, plan, self._stream_pool.get(), lambda: _FileUpload(target, fd), progress=progress
        )

    def put_bytes_if_absent(self, key: str, data: bytes, *, crc32c: str) -> None:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        # Written whole under a private name, then hard-linked into place: link(2) fails if the
        # name exists (the lock-file idiom that holds on NFS too); a rename would silently replace
        # the other writer's. A retried link that reports EEXIST for our own is told apart by the
        # caller, which compares what is there.
        tmp = target.with_name(f".{target.name}{TMP_MARK}{uuid.uuid4().hex[:8]}")
        try:
            with atomic_file(tmp) as out:
                out.write(data)
            if out.crc32c != crc32c:
                raise StorageError(f"{key}: crc32c {out.crc32c} of the bytes given, expected {crc32c}")
            try:
                os.link(tmp, target)
            except FileExistsError:
                raise ObjectExists(f"{self.url}/{key}: already exists") from None
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(target.parent)

    def get_file(self, key: str, local: Path) -> None:
        source = self._path(key)
        local.parent.mkdir(parents=True, exist_ok=True)
        try:
            with source.open("rb") as handle, atomic_file(local) as out:
                shutil.copyfileobj(handle, out, _COPY_CHUNK)
        except FileNotFoundError:
            raise ObjectNotFound(f"{self.url}/{key}") from None

    def read_range(self, key: str, offset: int, length: int, sink: Sink) -> None:
        try:
            with self._path(key).open("rb") as handle:
                handle.seek(offset)
                while length > 0 and (chunk := handle.read(min(_COPY_CHUNK, length))):
                    sink.write(chunk)
                    length -= len(chunk)
        except FileNotFoundError:
            raise ObjectNotFound(f"{self.url}/{key}") from None

    def read_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise ObjectNotFound(f"{self.url}/{key}") from None

    def stat(self, key: str) -> ObjectInfo | None:
        """Size, time and CRC32C: a directory keeps no checksum beside the bytes, so it is computed
        (one read; what it saves is a whole copy of a file already there)."""
        path = self._path(key)
        try:
            return replace(_info(key, path.stat()), crc32c=crc32c_of_file(path))
        except FileNotFoundError:
            return None

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return (info for info, _ in self._walk(prefix, temporaries=False))

    def temporaries(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """The temporary files of copies in progress, and of copies a kill stopped (their time is
        that of their last write)."""
        return (info for info, _ in self._walk(prefix, objects=False))

    def listing(self, prefix: str = "") -> Listing:
        """Both in one walk of the directory (retention wants both: a walk of a large tree on a
        network filesystem is its cost)."""
        objects: list[ObjectInfo] = []
        temporaries: list[ObjectInfo] = []
        for info, temporary in self._walk(prefix):
            (temporaries if temporary else objects).append(info)
        return objects, temporaries

    def _walk(
        self, prefix: str, *, objects: bool = True, temporaries: bool = True
    ) -> Iterator[tuple[ObjectInfo, bool]]:
        """The files under ``prefix`` of the kinds asked for, each with whether it is a copy's
        temporary file (only those are looked at: a listing of one kind stats none of the other)."""
        if not self.root.is_dir():
            return
        # Keys are made from the walk's strings, not through Path objects: that was most of a
        # listing's time (bench/file_listing.py), and a bucket may hold many files.
        cut = len(str(self.root).rstrip("/")) + 1  # a directory's path from here on is its key's folder
        for dirpath, _dirs, names in os.walk(self._top(prefix)):
            folder = dirpath[cut:]
            for name in names:
                temporary = TMP_MARK in name  # a write in progress (DCP's own ".metadata" is a real file)
                if not (temporaries if temporary else objects):
                    continue
                key = f"{folder}/{name}" if folder else name
                if key.startswith(prefix):
                    try:
                        yield _info(key, os.stat(os.path.join(dirpath, name))), temporary
                    except FileNotFoundError:
                        continue

    def _top(self, prefix: str) -> Path:
        """Where a walk for ``prefix`` starts: the directory its keys are all under (a checkpoint's,
        the peer registry's), not the whole bucket, unless a link is on the way there. A walk from
        the root never follows one, and neither does this."""
        folder = prefix.rpartition("/")[0]
        if not folder:
            return self.root
        top = self.root / folder
        try:
            # Resolved, it is itself (a folder not there yet too: nothing to list) when no link is on
            # the way: a link, or a ".." in the prefix, leaves the walk at the root.
            if top.resolve() == self.root.resolve() / folder:
                return top
        except (OSError, RuntimeError):  # not readable; a loop of links
            pass
        return self.root

    def delete(self, keys: Iterable[str]) -> None:
        parents = set()
        for key in keys:
            path = self._path(key)
            path.unlink(missing_ok=True)
            parents.add(path.parent)
        # Drop directories the deletes emptied, so listings stay tidy.
        for parent in sorted(parents, key=lambda p: len(p.parts), reverse=True):
            if parent != self.root:
                with contextlib.suppress(OSError):
                    parent.rmdir()

    def is_transient(self, exc: BaseException) -> bool:
        return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS

    def close(self) -> None:
        self._stream_pool.close()


def _info(key: str, stat: os.stat_result) -> ObjectInfo:
    return ObjectInfo(key=key, size=stat.st_size, modified=datetime.fromtimestamp(stat.st_mtime, UTC))


class _FileUpload:
    """A streamed copy as the part engine drives it: parts written at their offsets into a temporary
    file beside the target, renamed into place at ``complete``."""

    def __init__(self, target: Path, source: int) -> None:
        self._target = target
        self._tmp = target.with_name(f".{target.name}{TMP_MARK}{uuid.uuid4().hex[:8]}")
        self._source = source
        target.parent.mkdir(parents=True, exist_ok=True)
        self._out: int | None = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)

    def put_part(self, number: int, offset: int, length: int) -> tuple[int, None]:
        assert self._out is not None
        data = read_exactly(self._source, offset, length, f"{self._target} (part {number})")
        os.pwrite(self._out, data, offset)
        return int(google_crc32c.value(data)), None

    def complete(self, tokens: list[None], crc: int) -> None:
        assert self._out is not None
        os.fsync(self._out)
        os.close(self._out)
        self._out = None
        self._tmp.rename(self._target)
        fsync_dir(self._target.parent)

    def abort(self) -> None:
        if self._out is not None:
            os.close(self._out)
            self._out = None
        self._tmp.unlink(missing_ok=True)
