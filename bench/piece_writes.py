"""A receiver's writes of 4 MiB pieces: several writers in one file against the same writers each in
a file of its own.

A handoff over several flows writes its pieces on the receiver through ``write_at`` (a worker
process per frame: ``pwrite`` under the file's ``flock``, then the piece's CRC32C). Writes to one
file take turns there (and in the kernel, which holds the file's lock for each ``pwrite``), so
flows that send pieces of the same file share one writer's speed, where flows on different files
write in parallel. This measures both with the product's ``write_at``, in processes, interleaved:

    python bench/piece_writes.py --gib 1 --writers 4 --runs 5
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from common import machine, median, write_results

from spotguard.peer.files import write_at

PIECE = 4 << 20


def _write(paths: list[str], pieces: list[tuple[int, int]], start: multiprocessing.synchronize.Event) -> None:
    data = memoryview(bytearray(os.urandom(PIECE)))
    start.wait()
    for file, offset in pieces:
        write_at(paths[file], offset, data)


def timed(directory: Path, writers: int, total: int, *, own_files: bool) -> float:
    """Seconds for ``writers`` processes to write ``total`` bytes in pieces: piece ``i`` of one file
    goes to writer ``i % writers`` (flows taking the next piece of one file), or each writer writes
    a file of its own."""
    count = total // PIECE
    paths = [str(directory / f"f{k}.bin") for k in range(writers if own_files else 1)]
    if own_files:
        shares = [[(k, i * PIECE) for i in range(count // writers)] for k in range(writers)]
    else:
        shares = [[(0, i * PIECE) for i in range(k, count, writers)] for k in range(writers)]
    start = multiprocessing.Event()
    processes = [multiprocessing.Process(target=_write, args=(paths, share, start)) for share in shares]
    for process in processes:
        process.start()
    os.sync()  # the last run's dirty pages are not this run's to wait for
    time.sleep(0.5)  # every writer has its buffer before the clock starts (not a synchronisation: start is)
    began = time.perf_counter()
    start.set()
    for process in processes:
        process.join()
        if process.exitcode:
            raise RuntimeError(f"a writer failed ({process.exitcode})")
    seconds = time.perf_counter() - began
    for path in paths:
        os.unlink(path)
    return seconds


def main() -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--gib", type=float, default=1.0)
    cli.add_argument("--writers", type=int, default=4)
    cli.add_argument("--runs", type=int, default=5)
    args = cli.parse_args()
    total = int(args.gib * 2**30) // (PIECE * args.writers) * PIECE * args.writers
    times: dict[str, list[float]] = {"one file": [], "own files": []}
    directory = Path(tempfile.mkdtemp(prefix="spotguard-piece-writes-"))
    try:
        for _ in range(args.runs):
            times["one file"].append(timed(directory, args.writers, total, own_files=False))
            times["own files"].append(timed(directory, args.writers, total, own_files=True))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    rates = {name: total / median(samples) / 1e6 for name, samples in times.items()}
    for name, samples in times.items():
        print(f"{args.writers} writers, {name:9s} median {median(samples):.3f} s {rates[name]:7.0f} MB/s  runs "
              f"{[round(s, 3) for s in samples]}")  # fmt: skip
    print(f"one file / own files throughput: {rates['one file'] / rates['own files']:.2f}")
    report = {"machine": machine(), "bytes": total, "writers": args.writers, "seconds": times, "rates_mb_s": rates}
    print(f"results: {write_results('piece_writes', report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
