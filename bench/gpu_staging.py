"""GPU staging: device-to-host GB/s against the pinned-copy limit, urgent-save GB/s, periodic stall.

Needs a CUDA device; without one it says so and exits 0. In one run, on the GPU it names:

- the limit: one ``copy_`` of the whole state into a pinned host buffer (``non_blocking``, then a
  synchronize); a pageable ``.cpu()`` beside it;
- the staging pipeline alone: the state copied piece by piece through the writer's reused pinned
  buffers by its threads (no disk), as a fraction of the limit;
- an urgent ``Guard.save`` of the CUDA state against the same save of a CPU copy (the disk's share),
  and against min(D2H limit, disk floor): the floor is the best of 1/4/8 raw writers + fsync of the
  same bytes to the same directory (``urgent_save.py``'s);
- the periodic stall: how long ``Guard.save`` blocks training (the copy to reused host buffers) against
  one pinned D2H copy of the same bytes.

    python bench/gpu_staging.py --gib 1 --runs 5 --dir /path/on/the/nvme
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from common import machine, median, write_results
from urgent_save import raw_parallel

from spotguard import Guard
from spotguard.trainer.threads import default_threads
from spotguard.trainer.writer import DEFAULT_CHUNK_BYTES, StagingBuffers


def timed(run: Any, runs: int) -> list[float]:
    samples = []
    for _ in range(runs):
        torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - started)
    return samples


def staged_copy(state: dict[str, torch.Tensor], staging: StagingBuffers, threads: int) -> None:
    cancel = threading.Event()

    def piece(storage: torch.UntypedStorage, start: int, length: int) -> None:
        with staging.staged(storage, start, length, cancel):
            pass

    with ThreadPoolExecutor(threads) as pool:
        for tensor in state.values():
            storage = tensor.untyped_storage()
            for start in range(0, storage.nbytes(), DEFAULT_CHUNK_BYTES):
                pool.submit(piece, storage, start, min(DEFAULT_CHUNK_BYTES, storage.nbytes() - start))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: under bench/results)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_staging: no CUDA device here (torch.cuda.is_available() is False); nothing to measure")
        return

    gpu = torch.cuda.get_device_name()
    per = int(args.gib * (1 << 30) / 8 / 4)
    state = {f"layer{i}": torch.randn(per, device="cuda") for i in range(8)}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    base = args.dir or Path(__file__).parent / "results"
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-staging-", dir=base))
    threads = default_threads()
    staging = StagingBuffers()
    results: dict[str, list[float]] = {}
    try:
        results["pinned copy_ (the limit)"] = timed(lambda: pinned.copy_(flat, non_blocking=True), args.runs)
        results["pageable .cpu()"] = timed(flat.cpu, args.runs)
        # The first run allocates (and pins) the reused buffers, as a save's first does: left out, as
        # for the periodic stall below.
        staged = timed(lambda: staged_copy(state, staging, threads), args.runs + 1)
        results["staging pipeline (no disk)"] = staged[1:]

        cpu_state = {key: tensor.cpu() for key, tensor in state.items()}
        for writers in (1, 4, 8):
            samples = []
            for run in range(args.runs):
                target = work / f"raw-{writers}-{run}"
                started = time.perf_counter()
                raw_parallel(writers)({"model": cpu_state}, target)
                samples.append(time.perf_counter() - started)
                shutil.rmtree(target)
            results[f"disk: raw x{writers} + fsync"] = samples
        for name, source in (("urgent Guard.save, CUDA state", state), ("urgent Guard.save, CPU state", cpu_state)):
            samples = []
            for run in range(args.runs):
                target = work / f"{run}"
                guard = Guard(checkpoint_dir=target, socket=target / "none.sock", handle_sigterm=False)
                started = time.perf_counter()
                guard.save({"model": source}, 1, reason="urgent")
                samples.append(time.perf_counter() - started)
                guard.close()
                shutil.rmtree(target)
            results[name] = samples

        stalls = []
        target = work / "periodic"
        guard = Guard(checkpoint_dir=target, socket=target / "none.sock", handle_sigterm=False, every_steps=1)
        for step in range(1, args.runs + 2):
            torch.cuda.synchronize()
            started = time.perf_counter()
            guard.save({"model": state}, step)  # periodic: returns once staged
            stalls.append(time.perf_counter() - started)
            guard.wait()
        guard.close()
        results["periodic Guard.save stall"] = stalls[1:]  # the first allocates its buffers
    finally:
        shutil.rmtree(work, ignore_errors=True)

    limit = median(results["pinned copy_ (the limit)"])
    disk = min(median(samples) for name, samples in results.items() if name.startswith("disk:"))
    print(f"GPU: {gpu}; {nbytes / (1 << 30):.2f} GiB in {len(state)} tensors; {args.runs} runs; {threads} threads")
    print(f"| {'method':<34} | median s |   GB/s | of the D2H limit |")
    print(f"|{'-' * 36}|---:|---:|---:|")
    for name, samples in results.items():
        med = median(samples)
        print(f"| {name:<34} | {med:8.3f} | {nbytes / med / 1e9:6.2f} | {limit / med:16.2f} |")
    staged = median(results["staging pipeline (no disk)"])
    urgent = median(results["urgent Guard.save, CUDA state"])
    print(f"D2H through the staging pipeline: {limit / staged:.2f} of the pinned limit (target >= 0.8)")
    print(
        f"urgent save of the CUDA state: {max(limit, disk) / urgent:.2f} of min(D2H, disk) "
        f"(D2H {nbytes / limit / 1e9:.1f} GB/s, disk floor {nbytes / disk / 1e9:.2f} GB/s)"
    )
    report = {"gpu": gpu, "machine": machine(), "bytes": nbytes, "threads": threads, "results": results}
    print(f"results: {write_results('gpu_staging', report)}")


if __name__ == "__main__":
    main()
