"""What refusing links and non-files costs per file opened: ``safefile.open_nofollow`` against a plain
``os.open`` of the same files, in the same run.

Every file of a checkpoint that the daemon reads (to upload it, check it, hand it to a peer) is
opened with ``O_NOFOLLOW | O_NONBLOCK``, then checked to be a regular file (``fstat``) and set back
to blocking (``fcntl`` twice): three system calls more than a plain open. The question is whether
that shows next to the least a file's reading costs: a 4 KiB file opened, read, its CRC32C taken.

    python bench/open_nofollow.py --files 20000 --runs 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from spotguard.crc32c import crc32c_of_bytes
from spotguard.safefile import open_nofollow

PLAIN_FLAGS = os.O_RDONLY | os.O_CLOEXEC


def plain_open(path: Path) -> int:
    return os.open(path, PLAIN_FLAGS)


def timed(paths: list[Path], opener: Callable[[Path], int], *, read: bool) -> float:
    """Microseconds per file: opened (and with ``read``, read whole and its CRC32C taken), closed."""
    started = time.perf_counter()
    for path in paths:
        fd = opener(path)
        try:
            if read:
                crc32c_of_bytes(os.read(fd, 1 << 16))
        finally:
            os.close(fd)
    return (time.perf_counter() - started) / len(paths) * 1e6


def main() -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--files", type=int, default=20_000)
    cli.add_argument("--runs", type=int, default=7)
    cli.add_argument("--dir", type=Path, default=None, help="where the files go (default: a temporary directory)")
    args = cli.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        paths = []
        for i in range(args.files):
            path = Path(tmp) / f"shard-{i:06d}.bin"
            path.write_bytes(os.urandom(4096))
            paths.append(path)
        methods: dict[str, tuple[Callable[[Path], int], bool]] = {
            "os.open + close": (plain_open, False),
            "open_nofollow + close": (open_nofollow, False),
            "os.open + read 4 KiB + CRC32C": (plain_open, True),
            "open_nofollow + read 4 KiB + CRC32C": (open_nofollow, True),
        }
        results: dict[str, list[float]] = {name: [] for name in methods}
        for run in range(args.runs):
            order = list(methods)
            order = order[run % len(order) :] + order[: run % len(order)]  # rotated: no method always first
            for name in order:
                opener, read = methods[name]
                results[name].append(timed(paths, opener, read=read))
    medians = {name: statistics.median(values) for name, values in results.items()}
    print(f"{args.files} files of 4 KiB, {args.runs} runs, medians (microseconds per file):")
    for name, value in medians.items():
        print(f"  {name:38s} {value:7.2f}  (runs {min(results[name]):.2f}-{max(results[name]):.2f})")
    extra = medians["open_nofollow + close"] - medians["os.open + close"]
    reading = medians["os.open + read 4 KiB + CRC32C"]
    print(f"open_nofollow's extra: {extra:.2f} us per file, {extra / reading:.2f} of a 4 KiB file's open+read+CRC32C")
    print(f"with the read: {medians['open_nofollow + read 4 KiB + CRC32C'] / reading:.2f} of the plain open's time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
