"""Files written durably and read safely: temporary name, fsync, rename; no symlink followed.

Every file of a checkpoint is written under a temporary name (``.<name>.tmp-<pid>``, see
:data:`TMP_MARK`), fsynced and renamed, so a finished file can be uploaded while the rest are still being
written. Readers open with ``O_NOFOLLOW``: the daemon reads directories a trainer writes and must not be led
by a link to read a file the trainer could not.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import google_crc32c

from spotguard.errors import SpotguardError

_CHUNK = 8 * 1024 * 1024

TMP_MARK = ".tmp-"  # in the names of files being written (atomic_file)


class SaveCancelled(SpotguardError):
    """A save was abandoned half-way (an urgent save pre-empts a periodic one); nothing was committed."""


class SymlinkRefused(SpotguardError, OSError):
    """A file in a checkpoint is a symbolic link: the daemon reads step directories that a trainer
    writes, and must not be led by one to read (and upload) a file the trainer could not."""


def is_unlinked(fd: int) -> bool:
    """Whether the file open at ``fd`` has no name left on disk (its writer removed it)."""
    try:
        return os.fstat(fd).st_nlink == 0
    except OSError:
        return True


class NotARegularFile(SpotguardError, OSError):
    """A name in a checkpoint directory that is not a regular file (a FIFO, a device, a socket): the
    open of a FIFO would wait for a writer for ever, on the daemon's event loop or in its rescan."""


def open_nofollow(path: Path) -> int:
    """A read-only descriptor for ``path``, a regular file, refusing a symlink as its last component
    (race-free: ``O_NOFOLLOW`` is checked by the same call that opens) and anything that is not a
    regular file (:class:`NotARegularFile`): ``O_NONBLOCK`` makes the open of a FIFO return at once,
    and the descriptor's own type is checked, not the name's."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SymlinkRefused(
                errno.ELOOP, "a symlink in a checkpoint directory; refusing to read it", str(path)
            ) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotARegularFile(
                errno.EINVAL,
                "not a regular file in a checkpoint directory (a FIFO or a device?); refusing to read it",
                str(path),
            )
        os.set_blocking(fd, True)  # a regular file's reads never block; mapped and sent as before
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_nofollow(path: Path) -> bytes:
    with open(open_nofollow(path), "rb") as handle:
        return handle.read()


_RENAME_NOREPLACE = 1  # linux/fs.h


@functools.cache
def _renameat2() -> Callable[..., int] | None:
    libc = ctypes.CDLL(None, use_errno=True)
    return getattr(libc, "renameat2", None)


def rename_new(source: Path, target: Path) -> None:
    """Rename ``source`` to ``target`` only if nothing is there: ``FileExistsError`` otherwise, even
    for an empty directory, which a plain rename would replace. Where the kernel or the filesystem
    cannot refuse in the same call, a look just before the rename does."""
    renameat2 = _renameat2()
    if renameat2 is not None:
        at = -100  # AT_FDCWD
        if renameat2(at, os.fsencode(source), at, os.fsencode(target), _RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.ENOSYS, errno.EINVAL):
            raise OSError(code, os.strerror(code), str(target))
    if os.path.lexists(target):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target))
    os.rename(source, target)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ChecksummingWriter:
    """A write-only file wrapper that computes size and CRC32C as bytes go by (no second read)."""

    def __init__(self, raw: IO[bytes], cancel: threading.Event | None = None) -> None:
        self._raw = raw
        self._cancel = cancel
        self._crc = google_crc32c.Checksum()
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        if self._cancel is not None and self._cancel.is_set():
            raise SaveCancelled("save cancelled")
        view = memoryview(data).cast("B")
        written = self._raw.write(view)
        # google-crc32c's C extension accepts only bytes, so feed it bounded copies (memcpy speed).
        for start in range(0, len(view), _CHUNK):
            self._crc.update(bytes(view[start : start + _CHUNK]))
        self.size += len(view)
        return written if written is not None else len(view)

    def flush(self) -> None:
        self._raw.flush()

    def writable(self) -> bool:
        return True

    @property
    def crc32c(self) -> str:
        return self._crc.digest().hex()


def tmp_path_for(path: Path) -> Path:
    """Where ``path`` is written before its rename: beside it, hidden, with the temporary mark."""
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")


@contextlib.contextmanager
def atomic_file(path: Path, cancel: threading.Event | None = None) -> Iterator[ChecksummingWriter]:
    """Write ``path`` durably: temp name, fsync, rename. On error (or ``cancel``) the temp file is removed."""
    tmp = tmp_path_for(path)
    try:
        with tmp.open("wb", buffering=_CHUNK) as raw:
            writer = ChecksummingWriter(raw, cancel)
            yield writer
            raw.flush()
            os.fsync(raw.fileno())
        tmp.rename(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def is_temporary(name: str) -> bool:
    """Whether a file name is one :func:`atomic_file` writes before its rename."""
    return TMP_MARK in name


def replace_file(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` durably (:func:`atomic_file`, then its directory's entry), its directory
    made if need be."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as out:
        out.write(data)
    fsync_dir(path.parent)


class SpareFile:
    """A file of the daemon's state directory that goes to ``spare`` while that directory refuses writes.

    The state directory is on the root disk, the one a VM running for months fills, or the kernel
    remounts read-only after an I/O error. The spare is in the daemon's runtime directory (in memory: it
    outlives a restart of the daemon, not a reboot). ``what`` names the file in the one warning logged
    per outage and the one line logged when the state directory takes writes again.
    """

    def __init__(self, path: Path, spare: Path | None, what: str, log: logging.Logger) -> None:
        self.path = path
        self.spare = spare if spare is not None and spare.absolute() != path.absolute() else None
        self.what = what
        self._log = log
        self.in_spare = False  # the state directory refused the last write

    def places(self) -> list[Path]:
        """Where the file may be: the state directory's, then the spare."""
        return [self.path] if self.spare is None else [self.path, self.spare]

    def current(self) -> Path:
        """Where the last write went."""
        return self.spare if self.in_spare and self.spare is not None else self.path

    def write(self, write: Callable[[Path, bytes], None], data: bytes, *, whole: bool) -> None:
        """``write(place, data)`` in the state directory, else in the spare; raises if neither takes it.
        ``whole``: ``data`` is all of the file, so once it is in the state directory the spare goes."""
        try:
            write(self.path, data)
        except OSError as exc:
            if self.spare is None:
                raise
            write(self.spare, data)
            if not self.in_spare:
                self.in_spare = True
                what, spare = self.what, self.spare
                self._log.warning("cannot write %s (%s): %s is kept in %s until it can", self.path, exc, what, spare)
            return
        if self.in_spare:
            self.in_spare = False
            self._log.info("%s is written to %s again", self.what, self.path)
        if whole and self.spare is not None:
            with contextlib.suppress(OSError):
                self.spare.unlink(missing_ok=True)
