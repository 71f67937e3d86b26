"""Training-loop stall per periodic checkpoint with several ranks (DDP over gloo, one process each).

Compared in one run, interleaved, the same state on every rank (a DDP model and AdamW with its
moments), each save's stall being the longest any rank blocked:
  - one in-memory copy of every tensor of the state into preallocated buffers (the floor);
  - spotguard Guard.save, periodic: staged, then written in the background on a gloo group of its own;
  - spotguard Guard.save, urgent: written in the foreground, as periodic saves of several ranks were;
  - torch.distributed.checkpoint.save (synchronous);
  - torch.distributed.checkpoint.async_save on a gloo group (DCP's own asynchronous checkpointing).
Background work is waited for (and the page cache written back) outside the timing.

    python bench/periodic_stall_ranks.py --mib 256 --ranks 2 --runs 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ranks import arguments, finish_rank, run_ranks, start_rank
from torch.distributed.checkpoint.state_dict import get_state_dict

warnings.filterwarnings("ignore", message=".*async_save.*")
METHODS = [
    "one in-memory copy (copy_ into buffers): the floor",
    "spotguard Guard.save (periodic, background)",
    "spotguard Guard.save (urgent, foreground)",
    "DCP save (synchronous)",
    "DCP async_save (gloo group)",
]


def rank_main(rank: int, world: int, store: str, args: argparse.Namespace, work: Path) -> None:
    model, optimizer, guard = start_rank(rank, world, store, args, work)
    state = {"model": model, "optimizer": optimizer}
    group = dist.new_group(backend="gloo")
    pending: list[Any] = []
    steps = iter(range(1, 10**6))

    def dcp_tree() -> dict[str, Any]:
        model_state, optim_state = get_state_dict(model, [optimizer])
        return {"model": model_state, "optimizer": optim_state}

    def dcp_target() -> dcp.FileSystemWriter:
        target = work / f"dcp-{next(steps)}"
        pending.append(target)
        return dcp.FileSystemWriter(target, sync_files=True)

    tensors = [*model.parameters(), *(t for moments in optimizer.state.values() for t in moments.values())]
    buffers = [torch.empty_like(tensor) for tensor in tensors]

    def copy_into_buffers() -> None:
        for buffer, tensor in zip(buffers, tensors, strict=True):
            buffer.copy_(tensor)

    def periodic() -> None:
        guard.save(state, next(steps), reason="periodic")

    def urgent() -> None:
        guard.save(state, next(steps), reason="urgent")

    def dcp_sync() -> None:
        dcp.save(dcp_tree(), storage_writer=dcp_target())

    def dcp_async() -> None:
        pending.append(dcp.async_save(dcp_tree(), storage_writer=dcp_target(), process_group=group))

    methods: dict[str, Callable[[], None]] = dict(
        zip(METHODS, [copy_into_buffers, periodic, urgent, dcp_sync, dcp_async], strict=True)
    )

    def settle() -> None:
        guard.wait()
        for item in pending:
            if isinstance(item, Path):
                continue
            item.result()
        dist.barrier()
        if rank == 0:
            for item in pending:
                if isinstance(item, Path):
                    shutil.rmtree(item, ignore_errors=True)
        pending.clear()
        os.sync()
        dist.barrier()

    times: dict[str, list[float]] = {name: [] for name in METHODS}
    for name in METHODS:  # one untimed round: first allocations, the group, imports
        methods[name]()
        settle()
    for run in range(args.runs):
        for name in METHODS[run % len(METHODS) :] + METHODS[: run % len(METHODS)]:
            dist.barrier()
            started = time.perf_counter()
            methods[name]()
            stall = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
            dist.all_reduce(stall, op=dist.ReduceOp.MAX)  # the loop waits for its slowest rank
            times[name].append(float(stall))
            settle()
    finish_rank(guard, model, times, METHODS[2], column="median stall s", what="saves", args=args)


def main() -> None:
    run_ranks(rank_main, arguments("periodic_stall_ranks"), "periodic-stall-ranks")


if __name__ == "__main__":
    main()
