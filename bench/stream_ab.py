"""The streaming gain alone: one writer, the same bytes and pace, announcing ``file-range`` chunks or
only a ``file`` message per finished file; notice -> committed in the bucket for each, against that
writer alone and the daemon's upload alone (``upload_checkpoint`` of the same checkpoint afterwards).

    python bench/stream_ab.py --gib 0.5 --tensors 8 --runs 3 --per-connection-mb-s 5 --write-mb-s 70
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from common import MiB, Moto, capped_link, machine, median, moto_process, write_results
from upload_deadline import range_write_alone, spotguard_run

WRITE = "range writer alone (no daemon)"
RANGES = "drill -> writer announcing file-range chunks -> committed in the bucket"
FILES = "drill -> same writer, a file message per finished file only -> committed"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=0.5)
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--streams", type=int, default=16, help="the daemon's upload_concurrency")
    parser.add_argument("--per-connection-mb-s", type=float, default=None)
    parser.add_argument("--write-mb-s", type=float, default=0.0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stream-ab-"))
    times: dict[str, list[float]] = {WRITE: [], RANGES: [], FILES: []}
    uploads: list[float] = []
    try:
        with moto_process() as direct, contextlib.ExitStack() as stack:
            moto = direct
            if args.per_connection_mb_s:
                relay = stack.enter_context(capped_link(direct.endpoint_url, args.per_connection_mb_s * 1e6))
                moto = Moto(relay, direct.bucket)
                os.environ["AWS_ENDPOINT_URL_S3"] = relay
            methods = list(times)
            for run in range(args.runs):
                for name in methods[run % 3 :] + methods[: run % 3]:
                    prefix = f"r{run}-m{methods.index(name)}"
                    if name == WRITE:
                        seconds = range_write_alone(args, work, prefix)
                    else:
                        announce = "ranges" if name == RANGES else "files"
                        detail = spotguard_run(moto, args, work, prefix, args.streams, ranges=True, announce=announce)
                        seconds = detail["notice_to_committed"]
                        uploads.append(detail["upload_alone"])
                    times[name].append(seconds)
                    direct.empty(prefix)
                    print(f"  run {run}: {name}: {seconds:.2f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        os.environ.pop("AWS_ENDPOINT_URL_S3", None)
    write, upload = median(times[WRITE]), median(uploads)
    floor = max(write, upload)
    summary = {
        "write_alone_s": write,
        "upload_alone_s": upload,
        "ranges_s": median(times[RANGES]),
        "files_only_s": median(times[FILES]),
        "ranges_over_max_write_upload": median(times[RANGES]) / floor,
        "files_only_over_max_write_upload": median(times[FILES]) / floor,
        "sum_over_max": (write + upload) / floor,
    }
    bytes_ = int(args.gib * 1024 * MiB)
    print(f"\n{bytes_ / 1e9:.2f} GB, {args.runs} runs, medians; link cap {args.per_connection_mb_s} MB/s/connection")
    for key, value in summary.items():
        print(f"  {key}: {value:.2f}")
    report = {"machine": machine(), "args": vars(args), "samples_s": times, "uploads_s": uploads, "summary": summary}
    print(f"results: {write_results('stream_ab', report)}")


if __name__ == "__main__":
    main()
