"""Rank agreement under ``torch.distributed``: every rank takes the same decision at the same step."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from spotguard.errors import FatalError
from spotguard.manifest import FileEntry
from spotguard.safefile import SaveCancelled
from spotguard.space import SpotguardDiskFull, as_disk_full, disk_full_behind, full_disk_of

T = TypeVar("T")

_this_thread = threading.local()  # .group: the process group of this thread's collectives (None: the default)


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def check_initialised() -> None:
    """Refuse to go on as rank 0 of 1 in a process launched as one of several (torchrun, Slurm with WORLD_SIZE).

    Every such process would write the same files and commit the same step as if alone.
    """
    declared = os.environ.get("WORLD_SIZE", "1").strip() or "1"
    if declared.isdigit() and int(declared) > 1 and not active():
        raise RuntimeError(
            f"spotguard: this process is one of WORLD_SIZE={declared}, but torch.distributed is not initialised; "
            "create the Guard after torch.distributed.init_process_group() (otherwise every process acts as "
            "rank 0 of 1 and they all write the same checkpoint)"
        )


def can_save_in_background() -> bool:
    """Whether a save may run its collectives in a background thread: one process, or gloo to make
    :func:`new_checkpoint_group` with (a torch built without it writes in the foreground)."""
    return not active() or dist.is_gloo_available()


def new_checkpoint_group() -> dist.ProcessGroup:
    """A gloo group of every rank, for the collectives of a checkpoint written in a background thread
    beside the training's own (as DCP's ``async_save`` wants one). Collective: every rank creates it,
    at the same point (the first periodic save)."""
    return dist.new_group(backend="gloo")


@contextmanager
def on_group(group: dist.ProcessGroup | None) -> Iterator[None]:
    """This module's collectives in this thread (and DCP's, given :func:`group_of_this_thread`) go to
    ``group``: a background save's run on a group of their own, never interleaved with the training's."""
    previous = group_of_this_thread()
    _this_thread.group = group
    try:
        yield
    finally:
        _this_thread.group = previous


def group_of_this_thread() -> dist.ProcessGroup | None:
    """Where this thread's collectives go (:func:`on_group`); None: the default group."""
    return getattr(_this_thread, "group", None)


def barrier() -> None:
    if active():
        dist.barrier(group=group_of_this_thread())


def agree_any(flags: list[bool]) -> list[bool]:
    """Element-wise OR of ``flags`` across ranks: one small all-reduce (MAX) per call.

    Called at step boundaries only, never from a signal handler: a collective there could
    deadlock against the one the training step is in.
    """
    if not active():
        return flags
    group = group_of_this_thread()
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    tensor = torch.tensor([int(flag) for flag in flags], dtype=torch.int32, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return [bool(value) for value in tensor.tolist()]


class RankFailed(FatalError, RuntimeError):
    """One or more ranks failed a step every rank takes part in; every rank raises this, with the same text."""


class GroupGone(FatalError, RuntimeError):
    """A save of several ranks found ``torch.distributed`` no longer initialized (the process group
    destroyed before ``guard.close()``): without its collectives each rank would write, and rank 0
    commit, as if it were alone."""


def require_group(world: int, what: str) -> None:
    """Raise :class:`GroupGone` if a job of ``world`` ranks has lost its process group."""
    if world > 1 and not active():
        raise GroupGone(
            f"spotguard: {what}: the process group was destroyed while it was being written; "
            "call guard.close() before destroy_process_group()"
        )


class FailedElsewhere(FatalError, RuntimeError):
    """This rank's part went well, but a library that agrees on failures itself (DCP) failed the step
    because of another rank: :func:`agree_ok` counts it, and names only the ranks that failed."""


class RankDiskFull(SpotguardDiskFull, RankFailed):
    """A :class:`RankFailed` where a rank's disk was full: every rank raises it, with the numbers of the
    first full rank, so that every rank treats it as a full disk (a periodic save is skipped on all of
    them, not only on the rank whose disk it was)."""

    def __init__(self, message: str, path: Path, bytes_needed: int, bytes_free: int) -> None:
        super().__init__(path, bytes_needed, bytes_free)
        self.strerror = message  # str(): the same text on every rank


def agree_ok(what: str, error: BaseException | None, disk: Path | None = None) -> None:
    """Collective: every rank reports whether its part of ``what`` succeeded, before the next collective.

    Without this, a rank that raised leaves the others waiting in that collective until the process
    group times out. If any rank failed, every rank raises the same :class:`RankFailed` naming each
    failed rank and its error (a :class:`RankDiskFull` when one of them was a full disk: an ENOSPC
    behind its error, or, where ``what`` wrote to ``disk``, that disk left nearly full, whatever the
    error said; each rank judges its own disk and all ranks decide on the same reports). Where every
    error was a :class:`SaveCancelled` (an urgent save pre-empting a periodic one), every rank raises
    that instead. Without ``torch.distributed`` the error is raised as it is.
    """
    if not active():
        if error is not None:
            raise error
        return
    if not agree_any([error is not None])[0]:
        return
    mine: tuple[str, tuple[str, int, int] | None, bool] | None = None
    if error is not None and not isinstance(error, FailedElsewhere):
        if disk is not None:
            room = full_disk_of(error, disk)
        else:
            full = disk_full_behind(error)
            room = as_disk_full(full) if full is not None else None
        mine = (
            f"{type(error).__name__}: {error}",
            None if room is None else (str(room.path), room.bytes_needed, room.bytes_free),
            isinstance(error, SaveCancelled),
        )
    reports: list[Any] = [None] * world_size()
    dist.all_gather_object(reports, mine, group=group_of_this_thread())
    failures = "; ".join(f"rank {r}: {report[0]}" for r, report in enumerate(reports) if report is not None)
    failures = failures or f"some rank ({error})"  # only FailedElsewhere, which names them
    message = f"spotguard: {what} failed on {failures}"
    rooms = [report[1] for report in reports if report is not None and report[1] is not None]
    if rooms:
        path, needed, free = rooms[0]
        raise RankDiskFull(message, Path(path), needed, free) from error
    if all(report[2] for report in reports if report is not None) and any(reports):
        # An urgent save pre-empted it (on every rank: each saves at the same step): not a failure.
        raise SaveCancelled(f"spotguard: {what} cancelled") from error
    raise RankFailed(message) from error


@contextmanager
def settled(what: str, disk: Path | None = None) -> Iterator[None]:
    """Run the block on every rank, then :func:`agree_ok` on its outcome (a barrier when all went well);
    ``disk``: where the block writes."""
    error: Exception | None = None
    try:
        yield
    except Exception as exc:
        error = exc
    agree_ok(what, error, disk)


def broadcast_object(value: T) -> T:
    """Rank 0's ``value`` on every rank (a no-op without ``torch.distributed``)."""
    if not active():
        return value
    holder: list[Any] = [value]
    dist.broadcast_object_list(holder, src=0, group=group_of_this_thread())
    return holder[0]


def all_gather(value: T) -> list[T]:
    """Every rank's ``value``, in rank order (``[value]`` without ``torch.distributed``)."""
    if not active():
        return [value]
    values: list[Any] = [None] * world_size()
    dist.all_gather_object(values, value, group=group_of_this_thread())
    return values


NodeKey = tuple[str, str]  # (host, checkpoint root): one local disk
NodeShare = tuple[NodeKey, dict[str, FileEntry]]  # a disk and the files written on it


def node_key(root: Path) -> NodeKey:
    """Which disk a rank writes to: its host and its checkpoint root. The ranks of one node share it."""
    return socket.gethostname(), str(root.resolve())


def is_node_leader(root: Path) -> bool:
    """Whether this rank is the lowest of those writing to the same local disk (host and root)."""
    if not active():
        return True
    key = node_key(root)
    return all_gather(key).index(key) == rank()
