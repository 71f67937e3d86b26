"""Urgent-save throughput of a ~1 GiB state: Guard.save vs torch.save+fsync vs raw write+fsync.

All three write the same tensors to the same disk in the same run, interleaved, several times;
the report gives medians and ratios. Guard.save does more than the baselines: a CRC32C of every
byte, an RNG file, the manifest, and fsyncs of the files and directories (the commit protocol).

    python bench/urgent_save.py --gib 1 --runs 5 --dir /path/on/the/nvme
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

import torch

from spotguard import Guard


def make_state(gib: float, tensors: int = 8) -> dict[str, torch.Tensor]:
    per = int(gib * (1 << 30) / tensors / 4)
    generator = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per, generator=generator) for i in range(tensors)}


def raw_write(state: dict[str, torch.Tensor], target: Path) -> None:
    target.mkdir()
    with (target / "raw.bin").open("wb") as out:
        for tensor in state.values():
            out.write(memoryview(tensor.numpy()).cast("B"))
        out.flush()
        os.fsync(out.fileno())


def torch_save(state: dict[str, torch.Tensor], target: Path) -> None:
    target.mkdir()
    with (target / "model.pt").open("wb") as out:
        torch.save(state, out)
        out.flush()
        os.fsync(out.fileno())


def guard_save(state: dict[str, torch.Tensor], target: Path) -> None:
    guard = Guard(checkpoint_dir=target, socket=target / "none.sock", handle_sigterm=False)
    try:
        guard.save({"model": state}, 1, reason="urgent")
    finally:
        guard.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to write (default: a temp dir under bench/results)"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "urgent_save.json")
    args = parser.parse_args()

    torch.set_num_threads(1)
    state = make_state(args.gib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    base = args.dir or Path(__file__).parent / "results"
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="urgent-save-", dir=base))
    methods: dict[str, Callable[[dict[str, torch.Tensor], Path], None]] = {
        "raw write+fsync": raw_write,
        "torch.save+fsync": torch_save,
        "spotguard Guard.save (urgent)": guard_save,
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    try:
        names = list(methods)
        for run in range(args.runs):
            # Interleaved and rotated, so drift and the previous method's writeback hit all alike.
            for name in names[run % len(names) :] + names[: run % len(names)]:
                method = methods[name]
                target = work / f"{run}-{len(times[name])}-{name.split()[0]}"
                os.sync()
                started = time.perf_counter()
                method(state, target)
                times[name].append(time.perf_counter() - started)
                shutil.rmtree(target)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    raw = statistics.median(times["raw write+fsync"])
    print(
        f"state: {nbytes / (1 << 30):.2f} GiB in {len(state)} tensors; {args.runs} runs each, interleaved and rotated"
    )
    print(f"{'method':<32} {'median s':>9} {'min s':>7} {'max s':>7} {'GB/s':>6} {'vs raw':>7}")
    report = {"bytes": nbytes, "runs": args.runs, "methods": {}}
    for name, samples in times.items():
        median = statistics.median(samples)
        spread = f"{min(samples):7.3f} {max(samples):7.3f}"
        print(f"{name:<32} {median:9.3f} {spread} {nbytes / median / 1e9:6.2f} {median / raw:7.2f}")
        report["methods"][name] = {"median_s": median, "samples_s": samples, "gb_s": nbytes / median / 1e9}
    guard_vs_torch = statistics.median(times["spotguard Guard.save (urgent)"]) / statistics.median(
        times["torch.save+fsync"]
    )
    print(f"Guard.save / torch.save+fsync: {guard_vs_torch:.2f}x the time")
    report["guard_over_torch_save"] = guard_vs_torch
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
