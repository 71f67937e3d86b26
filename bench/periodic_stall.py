"""Training-loop stall per periodic checkpoint of a ~1 GiB state.

Compared in one run (medians over several saves, interleaved):
  - one in-memory copy of the state (the floor: copy_ into preallocated buffers, and clone);
  - spotguard Guard.save (periodic: stage into reused host buffers, write in the background);
  - synchronous torch.save + fsync;
  - torch.distributed.checkpoint.async_save (DCP's own asynchronous checkpointing).
The stall is the time the call blocks the loop; background work is waited for outside the timing.

    python bench/periodic_stall.py --gib 1 --runs 5
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

import torch
import torch.distributed.checkpoint as dcp

from spotguard import Guard

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def make_state(gib: float, tensors: int = 8) -> dict[str, torch.Tensor]:
    per = int(gib * (1 << 30) / tensors / 4)
    generator = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per, generator=generator) for i in range(tensors)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "periodic_stall.json")
    args = parser.parse_args()

    torch.set_num_threads(1)
    state = make_state(args.gib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    base = args.dir or Path(__file__).parent / "results"
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="periodic-stall-", dir=base))
    buffers = {k: torch.empty_like(v) for k, v in state.items()}
    guard = Guard(checkpoint_dir=work / "guard", socket=work / "none.sock", handle_sigterm=False, keep=1)
    pending: list[object] = []
    counter = iter(range(1, 10**6))

    def copy_into_buffers() -> None:
        for key, value in state.items():
            buffers[key].copy_(value)

    def clone() -> None:
        pending.append({k: v.clone() for k, v in state.items()})

    def guard_save() -> None:
        guard.save({"model": state}, next(counter))

    def torch_save() -> None:
        with (work / "model.pt").open("wb") as out:
            torch.save(state, out)
            out.flush()
            os.fsync(out.fileno())

    def dcp_async() -> None:
        target = work / f"dcp-{next(counter)}"
        pending.append((dcp.async_save({"model": state}, storage_writer=dcp.FileSystemWriter(target)), target))

    def settle() -> None:
        """Finish background work outside the timing, and free what it used."""
        guard.wait()
        for item in pending:
            if isinstance(item, tuple):
                item[0].result()
                shutil.rmtree(item[1], ignore_errors=True)
        pending.clear()
        os.sync()

    methods: dict[str, Callable[[], None]] = {
        "in-memory copy (copy_ into buffers)": copy_into_buffers,
        "in-memory copy (clone)": clone,
        "spotguard Guard.save (periodic)": guard_save,
        "torch.save + fsync (synchronous)": torch_save,
        "DCP async_save": dcp_async,
    }
    names = list(methods)
    times: dict[str, list[float]] = {name: [] for name in names}
    # One untimed round: page faults of first allocations are not what a running job pays.
    for name in names:
        methods[name]()
        settle()
    try:
        for run in range(args.runs):
            for name in names[run % len(names) :] + names[: run % len(names)]:
                started = time.perf_counter()
                methods[name]()
                times[name].append(time.perf_counter() - started)
                settle()
    finally:
        guard.close()
        shutil.rmtree(work, ignore_errors=True)

    floor = statistics.median(times["in-memory copy (copy_ into buffers)"])
    print(f"state: {nbytes / (1 << 30):.2f} GiB in {len(state)} tensors; {args.runs} saves each, interleaved")
    print(f"{'method':<40} {'median stall s':>14} {'min s':>7} {'x one copy':>10}")
    report: dict[str, object] = {"bytes": nbytes, "runs": args.runs, "methods": {}}
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:<40} {median:14.3f} {min(samples):7.3f} {median / floor:10.2f}")
        report["methods"][name] = {"median_s": median, "samples_s": samples, "x_copy": median / floor}  # type: ignore[index]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
