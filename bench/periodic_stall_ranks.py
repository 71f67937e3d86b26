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
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict

from spotguard import Guard

warnings.filterwarnings("ignore", message=".*async_save.*")
RESULTS = Path(__file__).parent / "results"
METHODS = [
    "one in-memory copy (copy_ into buffers): the floor",
    "spotguard Guard.save (periodic, background)",
    "spotguard Guard.save (urgent, foreground)",
    "DCP save (synchronous)",
    "DCP async_save (gloo group)",
]


def make_training(mib: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A DDP model of ``mib`` MiB of parameters and AdamW after one step (its moments: twice as much again)."""
    width = 1024
    layers = max(1, int(mib * (1 << 20) / (width * width * 4)))
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    model = torch.nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, width)).sum().backward()
    optimizer.step()
    return model, optimizer


def rank_main(rank: int, world: int, store: str, args: argparse.Namespace, work: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    model, optimizer = make_training(args.mib)
    state = {"model": model, "optimizer": optimizer}
    # One checkpoint root for every rank: the ranks of one VM.
    guard = Guard(checkpoint_dir=work / "guard", socket=work / f"none-{rank}.sock", handle_sigterm=False, keep=1)
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
    guard.close()
    dist.barrier()
    if rank == 0:
        nbytes = sum(t.numel() * t.element_size() for t in model.parameters()) * 3
        report(times, nbytes, world, args)
    dist.destroy_process_group()


def report(times: dict[str, list[float]], nbytes: int, world: int, args: argparse.Namespace) -> None:
    urgent = statistics.median(times[METHODS[2]])
    print(f"{world} ranks, each {nbytes / (1 << 20):.0f} MiB (model + AdamW); {args.runs} saves each, interleaved")
    print(f"{'method':<46} {'median stall s':>14} {'min s':>7} {'/ urgent':>9}")
    methods: dict[str, Any] = {}
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:<46} {median:14.3f} {min(samples):7.3f} {median / urgent:9.3f}")
        methods[name] = {"median_s": median, "samples_s": samples, "x_urgent": median / urgent}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"bytes_per_rank": nbytes, "ranks": world, "runs": args.runs, "methods": methods}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=float, default=256, help="parameters per rank (AdamW adds twice as much)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS / "periodic_stall_ranks.json")
    args = parser.parse_args()
    base = args.dir or RESULTS
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="periodic-stall-ranks-", dir=base))
    try:
        mp.spawn(rank_main, args=(args.ranks, str(work / "store"), args, work), nprocs=args.ranks)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
