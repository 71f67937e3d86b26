"""How long an urgent save takes when a notice lands while a periodic save of several ranks is being
written (DDP over gloo, one process per rank, one checkpoint root: the ranks of one VM).

Compared in one run, interleaved, the same state on every rank (a DDP model and AdamW with its
moments), each time being the longest any rank took, from the urgent save's call to its local commit:
  - the urgent save alone, nothing in flight (the floor);
  - the urgent save called right after a periodic save was staged: it cancels the periodic one, as
    spotguard does now;
  - the same, but waiting for the periodic save to be written and committed first, as spotguard did
    before with several ranks (``guard.wait()`` and then the urgent save).
The notice comes at the periodic save's start: the worst case for waiting, the whole write.

    python bench/notice_during_periodic.py --mib 256 --ranks 2 --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from spotguard import Guard

RESULTS = Path(__file__).parent / "results"
METHODS = [
    "urgent save, nothing in flight (the floor)",
    "urgent save cancelling the periodic one (now)",
    "urgent save after the periodic one (before)",
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
    guard = Guard(checkpoint_dir=work / "guard", socket=work / f"none-{rank}.sock", handle_sigterm=False, keep=1)
    steps = iter(range(1, 10**6))

    def urgent() -> None:
        guard.save(state, next(steps), reason="urgent")

    def periodic() -> None:
        guard.save(state, next(steps), reason="periodic")

    def waiting() -> None:
        guard.wait()
        urgent()

    # What runs before the clock starts, and what is timed.
    plans: dict[str, tuple[Callable[[], None], Callable[[], None]]] = dict(
        zip(METHODS, [(lambda: None, urgent), (periodic, urgent), (periodic, waiting)], strict=True)
    )
    times: dict[str, list[float]] = {name: [] for name in METHODS}
    for run in range(-1, args.runs):  # run -1: untimed (the checkpoint group, first allocations)
        for name in METHODS[run % len(METHODS) :] + METHODS[: run % len(METHODS)]:
            before, timed = plans[name]
            dist.barrier()
            before()
            started = time.perf_counter()
            timed()
            took = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the notice is handled once every rank committed
            if run >= 0:
                times[name].append(float(took))
            guard.wait(raise_error=False)
            dist.barrier()
            os.sync()  # each save starts with the page cache written back
            dist.barrier()
    guard.close()
    dist.barrier()
    if rank == 0:
        nbytes = sum(t.numel() * t.element_size() for t in model.parameters()) * 3
        report(times, nbytes, world, args)
    dist.destroy_process_group()


def report(times: dict[str, list[float]], nbytes: int, world: int, args: argparse.Namespace) -> None:
    floor = statistics.median(times[METHODS[0]])
    print(f"{world} ranks, each {nbytes / (1 << 20):.0f} MiB (model + AdamW); {args.runs} notices each, interleaved")
    print(f"{'method':<48} {'median s':>9} {'min s':>7} {'/ floor':>8}")
    methods: dict[str, Any] = {}
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:<48} {median:9.3f} {min(samples):7.3f} {median / floor:8.3f}")
        methods[name] = {"median_s": median, "samples_s": samples, "x_floor": median / floor}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"bytes_per_rank": nbytes, "ranks": world, "runs": args.runs, "methods": methods}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=float, default=256, help="parameters per rank (AdamW adds twice as much)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS / "notice_during_periodic.json")
    args = parser.parse_args()
    base = args.dir or RESULTS
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="notice-during-periodic-", dir=base))
    try:
        mp.spawn(rank_main, args=(args.ranks, str(work / "store"), args, work), nprocs=args.ranks)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
