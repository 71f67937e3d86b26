"""One daemon per checkpoint root's state: an exclusive ``flock`` held for the daemon's life.

Two daemons of one host on one root and state directory fight: each uploads what the other's
retention has just removed, each removes what the other is uploading, and a start's journal sweep
aborts the other's live multipart uploads. The first daemon takes ``state_dir/daemon-<digest>.lock``
(the state of this root: event log, upload journal) before it reads or writes anything else; a
second finds it held and stops, naming the directory and the pid that holds it. Every daemon on a
host may share ``state_dir`` (each root's files are named by a hash of the root), so the lock is per
root, not one for the whole directory.

The root itself is not locked: daemons of several VMs may share one checkpoint root on a shared disk
(each VM's own state directory), as multi-node jobs on one filesystem do, and a lock on the root
would be taken across hosts where the filesystem has locks that span them (NFSv4).

The kernel drops a ``flock`` with the last descriptor of its open file: a daemon killed by SIGKILL
or the OOM killer never blocks the one started after it. The descriptor is close-on-exec, and the
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
    """Another daemon of this host holds this checkpoint root's state."""


def state_lock_path(state_dir: Path, root: Path) -> Path:
    """The lock of ``root``'s state in ``state_dir`` (named by the same hash as its event log)."""
    digest = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]
    return state_dir / f"daemon-{digest}.lock"


@contextlib.contextmanager
def hold_daemon_lock(state_dir: Path, root: Path, spare_dir: Path | None = None) -> Iterator[None]:
    """Hold the lock of ``root``'s state until the block ends; :class:`DaemonRunning` if another
    process holds it. ``spare_dir`` takes it while ``state_dir`` cannot be written (a full root
    disk: the event log goes there too)."""
    fd = _take_state_lock(state_dir, root.absolute(), spare_dir)
    try:
        yield
    finally:
        os.close(fd)  # and the lock with it


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


def _holder(fd: int) -> str:
    with contextlib.suppress(OSError):
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        if text.isdigit():
            return f"pid {text}"
    return "pid unknown"


__all__ = ["DaemonRunning", "hold_daemon_lock", "state_lock_path"]
