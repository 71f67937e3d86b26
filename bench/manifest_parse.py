"""Reading a large manifest: ``Manifest.from_json`` against ``json.loads`` of the same bytes, in the
same run.

A sharded state of many files (DCP writes one or more per rank and per bucket of tensors) makes a
manifest of as many entries, and the daemon reads it at each commit (its upload, the peer handoff,
retention's look at the bucket); a receiver reads the sender's. Each entry's name is checked to
be one canonical relative path and its size and CRC32C to be well formed; ``json.loads`` alone is
the floor.

    python bench/manifest_parse.py --files 100000 --runs 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from spotguard.manifest import FileEntry, Manifest


def main() -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--files", type=int, default=100_000)
    cli.add_argument("--runs", type=int, default=7)
    args = cli.parse_args()
    files = {
        f"model/rank-{i // 1000:03d}/__{i}_0.distcp": FileEntry(
            size=(i + 1) * 4096, crc32c=f"{i * 2654435761 % 2**32:08x}"
        )
        for i in range(args.files)
    }
    data = Manifest(step=1000, reason="urgent", world_size=1, files=files).to_json()
    methods = {"json.loads": json.loads, "Manifest.from_json": Manifest.from_json}
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    for run in range(args.runs):
        for name in list(methods)[:: 1 if run % 2 else -1]:  # alternated: neither always first
            started = time.perf_counter()
            methods[name](data)
            seconds[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    print(f"a manifest of {args.files} files, {len(data) / 2**20:.1f} MiB, {args.runs} runs, medians:")
    for name, value in medians.items():
        print(f"  {name:20s} {value:.3f} s  (runs {min(seconds[name]):.3f}-{max(seconds[name]):.3f})")
    per_file = (medians["Manifest.from_json"] - medians["json.loads"]) / args.files * 1e6
    ratio = medians["Manifest.from_json"] / medians["json.loads"]
    print(f"from_json: {ratio:.1f} x json.loads; checks {per_file:.2f} us per file")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
