"""Urgent-save throughput of ~1 GiB, held in one entry and in 16: Guard.save against the disk's floor.

The floor is the best of 1/2/4/8 raw writers: N threads each ``pwrite`` their contiguous share of
one file (32 MiB writes), then one fsync; the same bytes, no serialisation. The naive path is
``torch.save`` + fsync (one file per entry, one after another). Guard.save does more than both: the
zip records, a CRC32C of every byte, an RNG file, the manifest and the directory fsyncs (the commit
protocol). Every method writes the same tensors to the same disk in the same run, interleaved and
rotated; the report gives medians and each method's throughput as a fraction of the floor.

    python bench/urgent_save.py --gib 1 --runs 5 --dir /path/on/the/nvme [--threads 1,2,4,8]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import machine, make_state, median, table, write_results

from spotguard import Guard
from spotguard.trainer.threads import default_threads

RAW_WRITERS = (1, 2, 4, 8)
WRITE = 32 << 20

Method = Callable[[dict[str, Any], Path], None]


def raw_parallel(writers: int) -> Method:
    def run(state: dict[str, Any], target: Path) -> None:
        views = [memoryview(t.numpy()).cast("B") for entry in state.values() for t in entry.values()]
        total = sum(len(v) for v in views)
        # Each writer's share: a contiguous byte range of the one file.
        spans: list[tuple[memoryview, int]] = []
        offset = 0
        for view in views:
            for start in range(0, len(view), WRITE):
                spans.append((view[start : start + WRITE], offset + start))
            offset += len(view)
        target.mkdir()
        fd = os.open(target / "raw.bin", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            share = -(-len(spans) // writers)

            def write(part: list[tuple[memoryview, int]]) -> None:
                for data, at in part:
                    os.pwrite(fd, data, at)

            threads = [
                threading.Thread(target=write, args=(spans[i * share : (i + 1) * share],)) for i in range(writers)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            os.fsync(fd)
            assert os.fstat(fd).st_size == total
        finally:
            os.close(fd)

    return run


def torch_save(state: dict[str, Any], target: Path) -> None:
    target.mkdir()
    for key, entry in state.items():
        with (target / f"{key}.pt").open("wb") as out:
            torch.save(entry, out)
            out.flush()
            os.fsync(out.fileno())


def guard_save(threads: int | None) -> Method:
    def run(state: dict[str, Any], target: Path) -> None:
        guard = Guard(checkpoint_dir=target, socket=target / "none.sock", handle_sigterm=False, write_threads=threads)
        try:
            guard.save(state, 1, reason="urgent")
        finally:
            guard.close()

    return run


def shapes(gib: float) -> dict[str, dict[str, Any]]:
    one = make_state(gib, tensors=8)
    return {
        "1 entry": {"model": one},
        "16 entries": {f"shard{i}": {"weight": tensor} for i, tensor in enumerate(make_state(gib, 16, 1).values())},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: under bench/results)")
    parser.add_argument("--threads", default="", help="also Guard.save with these write_threads, e.g. 1,2,4,8")
    args = parser.parse_args()

    torch.set_num_threads(1)
    base = args.dir or Path(__file__).parent / "results"
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="urgent-save-", dir=base))
    default = default_threads()
    methods: dict[str, Method] = {f"raw x{n} + fsync": raw_parallel(n) for n in RAW_WRITERS}
    methods["torch.save + fsync"] = torch_save
    methods[f"Guard.save (default: {default} threads)"] = guard_save(None)
    for n in (int(x) for x in args.threads.split(",") if x):
        methods[f"Guard.save ({n} threads)"] = guard_save(n)

    report: dict[str, Any] = {"machine": machine(), "runs": args.runs, "shapes": {}}
    for shape, state in shapes(args.gib).items():
        nbytes = sum(t.numel() * t.element_size() for entry in state.values() for t in entry.values())
        times: dict[str, list[float]] = {name: [] for name in methods}
        names = list(methods)
        try:
            for run in range(args.runs):
                # Interleaved and rotated, so drift and the previous method's writeback hit all alike.
                for name in names[run % len(names) :] + names[: run % len(names)]:
                    target = work / f"{run}-{len(times[name])}"
                    os.sync()
                    started = time.perf_counter()
                    methods[name](state, target)
                    times[name].append(time.perf_counter() - started)
                    shutil.rmtree(target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir()
        floor_name = min((n for n in names if n.startswith("raw")), key=lambda n: median(times[n]))
        floor = median(times[floor_name])
        print(f"\n{shape}: {nbytes / (1 << 30):.2f} GiB; {args.runs} runs each, interleaved and rotated")
        print("\n".join(table([(name, times[name]) for name in names], nbytes, reference=floor_name)))
        print(f"floor: {floor_name}; throughput as a fraction of the floor:")
        for name in names:
            print(f"  {name:<36} {floor / median(times[name]):.2f}")
        report["shapes"][shape] = {
            "bytes": nbytes,
            "floor": floor_name,
            "methods": {
                name: {"median_s": median(s), "samples_s": s, "of_floor": floor / median(s)}
                for name, s in times.items()
            },
        }
    shutil.rmtree(work, ignore_errors=True)
    print(f"\nresults: {write_results('urgent_save', report)}")


if __name__ == "__main__":
    main()
