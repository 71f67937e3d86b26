"""Rank agreement under ``torch.distributed``: every rank takes the same decision at the same step."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def barrier() -> None:
    if active():
        dist.barrier()


def agree_any(flags: list[bool]) -> list[bool]:
    """Element-wise OR of ``flags`` across ranks: one small all-reduce (MAX) per call.

    Called at step boundaries only, never from a signal handler: a collective there could
    deadlock against the one the training step is in.
    """
    if not active():
        return flags
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    tensor = torch.tensor([int(flag) for flag in flags], dtype=torch.int32, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [bool(value) for value in tensor.tolist()]


def broadcast_object(value: T) -> T:
    """Rank 0's ``value`` on every rank (a no-op without ``torch.distributed``)."""
    if not active():
        return value
    holder: list[Any] = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def all_gather(value: T) -> list[T]:
    """Every rank's ``value``, in rank order (``[value]`` without ``torch.distributed``)."""
    if not active():
        return [value]
    values: list[Any] = [None] * world_size()
    dist.all_gather_object(values, value)
    return values


def is_node_leader(root: Path) -> bool:
    """Whether this rank is the lowest of those writing to the same local disk (host and root)."""
    if not active():
        return True
    key = (socket.gethostname(), str(root.resolve()))
    return all_gather(key).index(key) == rank()
