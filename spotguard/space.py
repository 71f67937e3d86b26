"""Room on the local disk for the next checkpoint; both sides use it.

The local root is a staging tier: a checkpoint already complete in the bucket may be dropped
to make room for a new one. Which ones are safe is the daemon's to say (it knows what it
committed remotely); without a daemon only older complete checkpoints go, never the newest.
The daemon itself keeps room for one more checkpoint when its bucket fails for long
(:func:`keep_room_for_one`). Stdlib only (and the manifest helpers): no torch, no SDKs.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Callable, Collection
from pathlib import Path

from spotguard.errors import FatalError
from spotguard.localstore import scan_local

logger = logging.getLogger("spotguard.trainer")

NEARLY_FULL = 1 << 20  # free bytes under which a failed write counts as a full disk, whatever it raised


class SpotguardDiskFull(FatalError, OSError):
    """No room on the local disk for a checkpoint, even after dropping what was safe to drop.

    ``errno`` is ``ENOSPC``; ``bytes_needed``, ``bytes_free`` and ``path`` say how far off it was.
    """

    def __init__(self, path: Path, bytes_needed: int, bytes_free: int, detail: str = "") -> None:
        message = (
            f"no room for a checkpoint on {path}: {bytes_needed} bytes needed, {bytes_free} free"
            f"{'; ' + detail if detail else ''}"
        )
        super().__init__(errno.ENOSPC, message)
        self.path = path
        self.bytes_needed = bytes_needed
        self.bytes_free = bytes_free

    def __str__(self) -> str:
        return str(self.strerror)


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def disk_full_behind(exc: BaseException) -> OSError | None:
    """The ENOSPC (or EDQUOT) error behind ``exc``: ``exc`` itself, its cause or context, or one rank's
    failure inside DCP's ``CheckpointException`` (which keeps them in ``failures`` as ``(error,
    traceback)`` pairs); None when there is none. Frameworks wrap a full disk in their own errors."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        error = todo.pop()
        if id(error) in seen:
            continue
        seen.add(id(error))
        if is_disk_full(error):
            assert isinstance(error, OSError)
            return error
        todo.extend(linked for linked in (error.__cause__, error.__context__) if linked is not None)
        failures = getattr(error, "failures", None)
        if isinstance(failures, dict):
            for failure in failures.values():
                inner = failure[0] if isinstance(failure, tuple) and failure else failure
                if isinstance(inner, BaseException):
                    todo.append(inner)
    return None


def as_disk_full(error: OSError) -> SpotguardDiskFull:
    """``error`` (a full disk) with the numbers: where, how much was free, and at least one byte more
    than that needed (how much a framework's write wanted is not known)."""
    if isinstance(error, SpotguardDiskFull):
        return error
    where = Path(os.fsdecode(error.filename)).parent if error.filename else Path.cwd()
    try:
        free = free_bytes(where)
    except OSError:
        free = 0
    return SpotguardDiskFull(where, free + 1, free, str(error))


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def full_disk_of(error: BaseException, disk: Path) -> SpotguardDiskFull | None:
    """The full disk behind a failed write to ``disk``: an ENOSPC in ``error``'s chain
    (:func:`disk_full_behind`), or, whatever it raised, ``disk`` left with under
    :data:`NEARLY_FULL` bytes free: ``torch.save`` to a path reports a full disk as 'basic_ios::clear:
    iostream error', with no errno, so a failed write that left (almost) no room is taken for what
    it most likely was. The numbers are ``disk``'s; None when neither holds."""
    behind = disk_full_behind(error) is not None
    try:
        free = free_bytes(disk)
    except OSError:  # the disk cannot even be asked: only the error's own word counts
        return SpotguardDiskFull(disk, 1, 0, str(error)) if behind else None
    if behind or free < NEARLY_FULL:
        return SpotguardDiskFull(disk, free + 1, free, str(error))
    return None


def make_room(
    root: Path,
    needed: int,
    *,
    safe: Callable[[], Collection[str] | None],
    exclude: Collection[str] = (),
    unsafe_why: str = "older local checkpoints; no daemon to ask",
) -> list[str]:
    """Delete local checkpoints, oldest first, until ``needed`` bytes are free under ``root``.

    ``safe`` is asked only when there is too little room: the names the daemon says are complete
    in the bucket (only those may go), or None without a daemon (then every complete one but the
    newest may go). Nothing is deleted
    when even dropping every candidate would not make room: a hopeless save must not cost the
    local copies too. Raises :class:`SpotguardDiskFull` then; returns the names deleted.
    """
    free = free_bytes(root)
    if free >= needed:
        return []
    safe_names = safe()
    complete = [info for info in scan_local(root) if info.held and info.name not in exclude]
    if safe_names is None:
        candidates = complete[:-1]  # never the newest: nothing says it is anywhere else
        why = "no daemon says what is safe in the bucket; the newest local checkpoint is kept"
    else:
        candidates = [info for info in complete if info.name in safe_names]
        why = f"{len(candidates)} local checkpoint(s) are complete in the bucket and may be dropped"
    if free + sum(info.bytes for info in candidates) < needed:
        raise SpotguardDiskFull(root, needed, free, why)
    removed = []
    for info in candidates:
        shutil.rmtree(root / info.name, ignore_errors=True)
        removed.append(info.name)
        free = free_bytes(root)
        if free >= needed:
            break
    logger.warning(
        "spotguard: dropped %s from %s to make room for %d bytes (%s)",
        ", ".join(removed),
        root,
        needed,
        "complete in the bucket" if safe_names is not None else unsafe_why,
    )
    if free < needed:  # another writer took the room meanwhile
        raise SpotguardDiskFull(root, needed, free, f"after dropping {', '.join(removed)}")
    return removed


def keep_room_for_one(root: Path, *, protected: Collection[str] = ()) -> list[str]:
    """Keep room under ``root`` for one more checkpoint the size of the newest complete one.

    For the daemon, after each local commit: a bucket that has failed for hours leaves every
    checkpoint unsafe, and without this the disk fills until the next urgent save finds no room.
    Older complete checkpoints go first, uploaded or not (a newer one supersedes them); never the
    newest, nor ``protected`` ones (an upload in flight). Returns the names dropped.
    """
    complete = [info for info in scan_local(root) if info.held]
    if len(complete) < 2:
        return []
    newest = complete[-1]
    try:
        return make_room(
            root,
            newest.bytes,
            safe=lambda: None,
            exclude=frozenset(protected),
            unsafe_why="older local checkpoints, NOT in the bucket: uploads keep failing and the next one needs room",
        )
    except SpotguardDiskFull as exc:
        logger.error("spotguard: cannot keep room for another checkpoint: %s", exc)
        return []


__all__ = [
    "SpotguardDiskFull",
    "as_disk_full",
    "disk_full_behind",
    "free_bytes",
    "is_disk_full",
    "keep_room_for_one",
    "make_room",
]
