"""One daemon per checkpoint root: an exclusive ``flock`` held for the daemon's life.

Two daemons on one root fight: each uploads what the other's retention has just removed, each
removes what the other is uploading, and a start's journal sweep aborts the other's live multipart
uploads. The first daemon takes two locks before it reads or writes anything else; a second finds
them held and stops, naming the directory and the pid that holds it.

- ``state_dir/daemon-<digest>.lock``: the state (event log, upload journal) of this root. Every
  daemon on a host may share ``state_dir`` (each root's files are named by a hash of the root), so
  the lock is per root as well, not one for the whole directory.
- the checkpoint root's directory itself, against a daemon given another ``state_dir``: no file is
  added to the root (users and tools list it), and the trainer hook locks another inode (its
  ``.spotguard-restore.lock``). A directory holds no pid: the holder's is looked up in ``/proc/locks``.

The kernel drops a ``flock`` with the last descriptor of its open file: a daemon killed by SIGKILL
or the OOM killer never blocks the one started after it. The descriptors are close-on-exec, and the
daemon's worker processes are started with no descriptors but the ones passed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from spotguard.errors import FatalError

logger = logging.getLogger("spotguard.daemon")


class DaemonRunning(FatalError, RuntimeError):
    """Another daemon holds this checkpoint root or its state."""


def state_lock_path(state_dir: Path, root: Path) -> Path:
    """The lock of ``root``'s state in ``state_dir`` (named by the same hash as its event log)."""
    digest = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]
    return state_dir / f"daemon-{digest}.lock"


@contextlib.contextmanager
def hold_daemon_locks(state_dir: Path, root: Path, spare_dir: Path | None = None) -> Iterator[None]:
    """Hold the state's and the root's locks until the block ends; :class:`DaemonRunning` if
    another process holds either. ``spare_dir`` takes the state's lock while ``state_dir`` cannot
    be written (a full root disk: the event log goes there too)."""
    root = root.absolute()
    with contextlib.ExitStack() as held:
        held.callback(os.close, _take_state_lock(state_dir, root, spare_dir))
        root.mkdir(parents=True, exist_ok=True)
        held.callback(os.close, _take_directory(root, f"the checkpoint root {root}"))
        yield  # closing a descriptor drops its lock


def _take_state_lock(state_dir: Path, root: Path, spare_dir: Path | None) -> int:
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        return _take(state_lock_path(state_dir, root), f"the state directory {state_dir} (for checkpoint root {root})")
    except OSError as exc:
        if spare_dir is None:
            raise
        logger.warning("%s: cannot take the daemon's lock there (%s); taking it in %s", state_dir, exc, spare_dir)
        spare_dir.mkdir(parents=True, exist_ok=True)
        return _take(state_lock_path(spare_dir, root), f"the state of checkpoint root {root} in {spare_dir}")


def _take(path: Path, what: str) -> int:
    """A descriptor of ``path`` holding its exclusive lock, the holder's pid written in it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise DaemonRunning(
            f"another spotguard daemon ({holder}) holds {what}; stop it first, or give this daemon a "
            f"checkpoint_dir and state_dir of its own (lock: {path})"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    # The pid is for the message of a daemon started beside this one; the lock itself is the flock.
    with contextlib.suppress(OSError):  # a full disk: the lock holds without the pid
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _take_directory(path: Path, what: str) -> int:
    """A descriptor of the directory ``path`` holding its exclusive lock."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder_in_proc_locks(os.fstat(fd))
        os.close(fd)
        raise DaemonRunning(
            f"another spotguard daemon ({holder}) holds {what}; stop it first, or give this daemon a "
            "checkpoint_dir of its own"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _holder(fd: int) -> str:
    with contextlib.suppress(OSError):
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        if text.isdigit():
            return f"pid {text}"
    return "pid unknown"


def _holder_in_proc_locks(held: os.stat_result) -> str:
    """The pid ``/proc/locks`` names for a flock on the inode ``held``: lines such as
    ``1: FLOCK  ADVISORY  WRITE 4242 08:01:1234567 0 EOF`` (device as hex major:minor)."""
    inode = f"{os.major(held.st_dev):02x}:{os.minor(held.st_dev):02x}:{held.st_ino}"
    with contextlib.suppress(OSError):
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == inode and fields[4].isdigit():
                return f"pid {fields[4]}"
    return "pid unknown"


__all__ = ["DaemonRunning", "hold_daemon_locks", "state_lock_path"]
