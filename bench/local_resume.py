"""Resume of a ~1 GiB checkpoint from the local root, with a cold page cache: spotguard vs the naive way.

The same state (float32 tensors of random data) is on disk twice: as a spotguard checkpoint (one file
per tensor + RNG states + manifest, written by an urgent ``Guard.save``) and as one ``torch.save``
file. Each run, interleaved and rotated, every method starting from a cold page cache
(``echo 3 > /proc/sys/vm/drop_caches``, as root; otherwise the cache stays warm and the report says so):

- ``Guard.resume(state)`` with N threads (``SPOTGUARD_WRITE_THREADS``; default from the CPU count):
  CRC32C of every file checked against the manifest (N threads reading ranges), then the tensors
  loaded into ``state`` (N entries at once);
- the same with 1 thread: what every resume did before reads went parallel;
- naive: ``torch.load(weights_only=True)`` of the one file (no check at all);
- the floor: the same bytes read raw with ``pread`` into one buffer, best of 1/2/4/8 threads.

    python bench/local_resume.py --gib 1 --tensors 8 --runs 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from common import machine, make_state, median, state_bytes, table, write_results

from spotguard import Guard
from spotguard.trainer.threads import ENV, write_threads

NAIVE = "naive: torch.load(weights_only=True) of one file"
FLOOR = "floor: raw pread of the same bytes, best of 1/2/4/8 threads"
CHUNK = 8 << 20


def drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def raw_read(paths: list[Path], threads: int) -> None:
    """Every byte of ``paths`` into reused buffers: what the disk gives, with no checksum and no copy."""
    jobs = [(path, start) for path in paths for start in range(0, path.stat().st_size, CHUNK)]
    mine = threading.local()  # one buffer per thread, reused

    def read(job: tuple[Path, int]) -> None:
        path, start = job
        if not hasattr(mine, "buffer"):
            mine.buffer = bytearray(CHUNK)
        with path.open("rb", buffering=0) as handle:
            os.preadv(handle.fileno(), [mine.buffer], start)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(read, jobs))


def resume_once(root: Path, state: dict[str, torch.Tensor], threads: int) -> float:
    template = {key: torch.zeros_like(value) for key, value in state.items()}  # a live model is allocated
    os.environ[ENV] = str(threads)
    started = time.perf_counter()
    guard = Guard(checkpoint_dir=root, socket=root / "none.sock", handle_sigterm=False)
    try:
        step = guard.resume(template)
    finally:
        guard.close()
    seconds = time.perf_counter() - started
    assert step == 100, step
    assert all(torch.equal(template[k], state[k]) for k in state), "resumed tensors differ"
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="Guard's threads (default: its own rule)")
    parser.add_argument("--dir", type=Path, default=None, help="local disk to use (default: a temp dir)")
    args = parser.parse_args()

    threads = write_threads(args.threads)
    many = f"Guard.resume, local root ({threads} threads)"
    one = "Guard.resume, local root (1 thread: as before)"
    state = make_state(args.gib, args.tensors)
    nbytes = state_bytes(state)
    work = Path(tempfile.mkdtemp(prefix="local-resume-bench-", dir=args.dir))
    times: dict[str, list[float]] = {many: [], one: [], NAIVE: [], FLOOR: []}
    cold = drop_caches()
    if not cold:
        print("cannot drop the page cache (not root?): every method reads from a warm cache")
    try:
        root = work / "root"
        guard = Guard(checkpoint_dir=root, socket=work / "none.sock", handle_sigterm=False)
        try:
            step_dir = guard.save(state, 100, reason="urgent")
        finally:
            guard.close()
        single = work / "model.pt"
        torch.save(state, single)
        files = [path for path in sorted(step_dir.iterdir()) if path.is_file()]
        methods = list(times)
        for run in range(args.runs):
            for name in methods[run % len(methods) :] + methods[: run % len(methods)]:
                if name == FLOOR:
                    best = []
                    for count in (1, 2, 4, 8):
                        drop_caches()
                        started = time.perf_counter()
                        raw_read(files, count)
                        best.append(time.perf_counter() - started)
                    seconds = min(best)
                elif name == NAIVE:
                    drop_caches()
                    started = time.perf_counter()
                    loaded = torch.load(single, weights_only=True)
                    seconds = time.perf_counter() - started
                    assert all(torch.equal(loaded[k], state[k]) for k in state), "loaded tensors differ"
                    del loaded
                else:
                    drop_caches()
                    seconds = resume_once(root, state, threads if name == many else 1)
                times[name].append(seconds)
                print(f"  run {run}: {name}: {seconds:.2f} s")
    finally:
        os.environ.pop(ENV, None)
        shutil.rmtree(work, ignore_errors=True)

    lines = table(list(times.items()), nbytes, reference=NAIVE)
    summary = {
        "cold_page_cache": cold,
        "threads": threads,
        "naive_over_guard_resume": median(times[NAIVE]) / median(times[many]),
        "one_thread_over_threads": median(times[one]) / median(times[many]),
        "floor_over_guard_resume": median(times[FLOOR]) / median(times[many]),
    }
    print()
    print(
        f"state {nbytes / 1e9:.2f} GB ({len(state)} tensors), {args.runs} runs each, interleaved and rotated, "
        f"{'cold' if cold else 'WARM'} page cache"
    )
    print("\n".join(lines))
    print()
    print(f"naive / Guard.resume: {summary['naive_over_guard_resume']:.2f}x the time")
    print(f"1 thread / {threads} threads: {summary['one_thread_over_threads']:.2f}x the time")
    print(f"Guard.resume reaches {summary['floor_over_guard_resume']:.2f} of the raw read")
    report = {
        "bytes": nbytes,
        "tensors": len(state),
        "runs": args.runs,
        "machine": machine(),
        "samples_s": times,
        "summary": summary,
        "table": lines,
    }
    print(f"results: {write_results('local_resume', report)}")


if __name__ == "__main__":
    main()
