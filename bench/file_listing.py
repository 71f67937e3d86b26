"""Listings of a file:// bucket (a mounted network filesystem, or a local directory): what the daemon
lists often, against ``os.walk`` of the whole tree in the same run.

A daemon on a file:// store lists the peer registry's folder at each handoff and on every discovery
look, one checkpoint's folder at each verify and resume, and the whole bucket for retention (its
objects and its copies' temporary files). A bucket that keeps several checkpoints of many files
makes a walk of the whole tree the cost of each of those.

    python bench/file_listing.py --checkpoints 10 --files 2000 --runs 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from spotguard.manifest import step_dir_name
from spotguard.storage.checkpoints import prune_remote
from spotguard.storage.file import FileStorage


def make_bucket(root: Path, checkpoints: int, files: int) -> None:
    for step in range(1, checkpoints + 1):
        folder = root / step_dir_name(step) / "model"
        folder.mkdir(parents=True)
        for i in range(files):
            (folder / f"__{i}_0.distcp").write_bytes(b"")
    registry = root / ".spotguard-peers"
    registry.mkdir()
    for i in range(8):
        (registry / f"10.0.0.{i}-7140.json").write_bytes(b"{}")


def whole_walk(root: Path) -> int:
    return sum(len(names) for _, _, names in os.walk(root))


def whole_walk_and_stat(root: Path) -> int:
    """The floor of a listing that gives each object's size and time: every file's stat too."""
    return sum(os.stat(os.path.join(folder, name)).st_size for folder, _, names in os.walk(root) for name in names)


def main() -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--checkpoints", type=int, default=10)
    cli.add_argument("--files", type=int, default=2000)
    cli.add_argument("--runs", type=int, default=5)
    cli.add_argument("--dir", type=Path, default=None, help="where the bucket goes (default: a temporary directory)")
    args = cli.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp) / "bucket"
        make_bucket(root, args.checkpoints, args.files)
        storage = FileStorage(f"file://{root}")
        newest = step_dir_name(args.checkpoints)
        methods: dict[str, Callable[[], object]] = {
            "os.walk of the whole bucket": lambda: whole_walk(root),
            "os.walk + stat of every file": lambda: whole_walk_and_stat(root),
            "list the peer registry": lambda: list(storage.list(".spotguard-peers/")),
            "list one checkpoint": lambda: list(storage.list(f"{newest}/")),
            "retention's listing": storage.listing,
            "prune_remote (nothing to delete)": lambda: prune_remote(storage, keep=args.checkpoints),
        }
        seconds: dict[str, list[float]] = {name: [] for name in methods}
        for run in range(args.runs):
            order = list(methods)
            for name in order[run % len(order) :] + order[: run % len(order)]:  # rotated
                started = time.perf_counter()
                methods[name]()
                seconds[name].append(time.perf_counter() - started)
        storage.close()
    walk = statistics.median(seconds["os.walk of the whole bucket"])
    floor = statistics.median(seconds["os.walk + stat of every file"])
    total = args.checkpoints * args.files
    print(
        f"a file:// bucket of {args.checkpoints} checkpoints x {args.files} files ({total}), {args.runs} runs, medians:"
    )
    for name, values in seconds.items():
        median = statistics.median(values)
        print(f"  {name:34s} {median * 1e3:9.2f} ms  {median / walk:6.2f} x walk, {median / floor:6.2f} x walk+stat")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
