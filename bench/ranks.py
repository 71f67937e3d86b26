"""Shared parts of the benchmarks of several ranks: the training state, the processes, the table.

Each rank is a process of its own (``torch.multiprocessing.spawn``, gloo, a file rendezvous), every
rank holding the same DDP model and AdamW after one step.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from spotguard import Guard

RESULTS = Path(__file__).parent / "results"

# rank, world size, the rendezvous file, the arguments, a scratch directory of the run
RankMain = Callable[[int, int, str, argparse.Namespace, Path], None]


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


def start_rank(
    rank: int, world: int, store: str, args: argparse.Namespace, work: Path
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Guard]:
    """Join the gloo group, make the training state, and a Guard of one checkpoint root for every
    rank (the ranks of one VM) with no daemon."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    model, optimizer = make_training(args.mib)
    guard = Guard(checkpoint_dir=work / "guard", socket=work / f"none-{rank}.sock", handle_sigterm=False, keep=1)
    return model, optimizer, guard


def finish_rank(
    guard: Guard,
    model: torch.nn.Module,
    times: dict[str, list[float]],
    reference: str,
    *,
    column: str,
    what: str,
    args: argparse.Namespace,
) -> None:
    """Close the Guard and leave the group; rank 0 reports ``times`` (:func:`report`)."""
    guard.close()
    dist.barrier()
    if dist.get_rank() == 0:
        nbytes, world = state_bytes(model), dist.get_world_size()
        print(f"{world} ranks, each {nbytes / (1 << 20):.0f} MiB (model + AdamW); {args.runs} {what} each, interleaved")
        report(times, reference, column=column, args=args, bytes_per_rank=nbytes, ranks=world)
    dist.destroy_process_group()


def state_bytes(model: torch.nn.Module) -> int:
    """The model's parameters and AdamW's two moments of each."""
    return sum(t.numel() * t.element_size() for t in model.parameters()) * 3


def arguments(name: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=float, default=256, help="parameters per rank (AdamW adds twice as much)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS / f"{name}.json")
    return parser.parse_args()


def run_ranks(rank_main: RankMain, args: argparse.Namespace, name: str) -> None:
    """``rank_main`` in ``args.ranks`` processes, with a scratch directory removed afterwards."""
    base = args.dir or RESULTS
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=base))
    try:
        mp.spawn(rank_main, args=(args.ranks, str(work / "store"), args, work), nprocs=args.ranks)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(
    times: dict[str, list[float]], reference: str, *, column: str, args: argparse.Namespace, **facts: Any
) -> None:
    """Print each method's median and minimum, and the median over ``reference``'s; write them to ``args.out``."""
    base = statistics.median(times[reference])
    print(f"ratios over: {reference}")
    print(f"{'method':<50} {column:>14} {'min s':>7} {'ratio':>7}")
    methods: dict[str, Any] = {}
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:<50} {median:14.3f} {min(samples):7.3f} {median / base:7.3f}")
        methods[name] = {"median_s": median, "samples_s": samples, "ratio": median / base}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**facts, "runs": args.runs, "reference": reference, "methods": methods}))
