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
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from ranks import arguments, finish_rank, run_ranks, start_rank

METHODS = [
    "urgent save, nothing in flight (the floor)",
    "urgent save cancelling the periodic one (now)",
    "urgent save after the periodic one (before)",
]


def rank_main(rank: int, world: int, store: str, args: argparse.Namespace, work: Path) -> None:
    model, optimizer, guard = start_rank(rank, world, store, args, work)
    state = {"model": model, "optimizer": optimizer}
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
    finish_rank(guard, model, times, METHODS[0], column="median s", what="notices", args=args)


def main() -> None:
    run_ranks(rank_main, arguments("notice_during_periodic"), "notice-during-periodic")


if __name__ == "__main__":
    main()
