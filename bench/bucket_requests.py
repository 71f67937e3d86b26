"""Requests an idle daemon makes to its bucket, and what they cost a day.

A real daemon (``python -m spotguard run``, provider ``none``, the default 2 s rescan of the local
root) uploads ``--checkpoints`` small checkpoints to moto in server mode, then sits idle for
``--seconds``. moto's own access log counts every request in that window, by kind (LIST, GET,
HEAD, PUT/POST, DELETE); the table extrapolates them to a day and prices them at S3 Standard's
request rates (LIST, PUT, POST: $0.005 per 1,000; GET, HEAD: $0.0004 per 1,000; GCS's class A and
B operations cost the same). Each ``--bucket-scan-interval`` value is one daemon, run one after
another against the same bucket; ``default`` leaves the setting out (so the bench also runs
against a version that does not have it).

    python bench/bucket_requests.py --seconds 120 --bucket-scan-interval default 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from common import FAKE_AWS_ENV, RESULTS, _free_port

from spotguard.harness import Vm, wait_for
from spotguard.localstore import CheckpointWriter

PRICE_PER_1000 = {"LIST": 0.005, "PUT/POST": 0.005, "GET": 0.0004, "HEAD": 0.0004, "DELETE": 0.0}
REQUEST = re.compile(r'"(GET|HEAD|PUT|POST|DELETE) (/[^ ]*) HTTP')


def kind_of(method: str, target: str, bucket: str) -> str:
    if method == "GET" and target.startswith(f"/{bucket}?") and "list-type" in target:
        return "LIST"
    if method in ("PUT", "POST"):
        return "PUT/POST"
    return method


def requests_in(log: Path, start: int, bucket: str) -> Counter[str]:
    counts: Counter[str] = Counter()
    with log.open("rb") as stream:
        stream.seek(start)
        for line in stream.read().decode(errors="replace").splitlines():
            match = REQUEST.search(line)
            if match and match.group(2).startswith(f"/{bucket}"):
                counts[kind_of(match.group(1), match.group(2), bucket)] += 1
    return counts


def commit_local(root: Path, steps: int) -> None:
    """``steps`` small complete checkpoints under ``root`` (written as the hook writes them)."""
    for step in range(1, steps + 1):
        writer = CheckpointWriter(root, step, reason="periodic", world_size=1, meta={})
        writer.prepare()
        writer.write_bytes("state.pt", os.urandom(64 * 1024))
        writer.commit()


def measure(base: Path, bucket_url: str, bucket: str, log: Path, interval: str, args: argparse.Namespace) -> dict:
    env = {"SPOTGUARD_SCAN_INTERVAL": "2"}
    if interval != "default":
        env["SPOTGUARD_BUCKET_SCAN_INTERVAL"] = interval
    vm = Vm(base, f"vm-{interval}", bucket_url)
    commit_local(vm.root, args.checkpoints)
    vm.start_daemon(env)
    try:
        wait_for(lambda: len(vm.status()["uploads"]["committed"]) >= min(args.checkpoints, 3), 60, "the uploads")
        time.sleep(args.settle)  # the retention and the first rescans after the commits
        start = log.stat().st_size
        began = time.monotonic()
        time.sleep(args.seconds)  # the idle window itself is what is measured
        counts = requests_in(log, start, bucket)
        seconds = time.monotonic() - began
    finally:
        vm.stop_daemon()
    per_day = {kind: count * 86400 / seconds for kind, count in counts.items()}
    dollars = sum(per_day[kind] * PRICE_PER_1000[kind] / 1000 for kind in per_day)
    return {"interval": interval, "seconds": seconds, "counts": dict(counts), "per_day": per_day, "usd_day": dollars}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="idle window per daemon")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds after the uploads before the window")
    parser.add_argument("--checkpoints", type=int, default=3, help="checkpoints in the bucket (keep_remote: 3)")
    parser.add_argument("--bucket-scan-interval", nargs="+", default=["default"])
    args = parser.parse_args()

    os.environ.update(FAKE_AWS_ENV)
    with tempfile.TemporaryDirectory(prefix="bucket-requests-") as tmp:
        base = Path(tmp)
        log = base / "moto.log"
        port = _free_port()
        with log.open("wb") as sink:
            moto = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=sink, stderr=sink
            )
        try:
            endpoint = f"http://127.0.0.1:{port}"
            os.environ["AWS_ENDPOINT_URL_S3"] = endpoint
            import boto3

            wait_for(lambda: b"Running on" in log.read_bytes(), 30, "moto")
            bucket = "bench-requests"
            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
            rows = [
                measure(base, f"s3://{bucket}/{interval}", bucket, log, interval, args)
                for interval in args.bucket_scan_interval
            ]
        finally:
            moto.terminate()
            moto.wait(timeout=30)

    kinds = ["LIST", "GET", "HEAD", "PUT/POST", "DELETE"]
    print(f"idle daemon, {args.checkpoints} checkpoints in the bucket, root rescanned every 2 s")
    print("| bucket_scan_interval | " + " | ".join(f"{k}/min" for k in kinds) + " | requests/day | $/day (S3) |")
    print("|---|" + "---:|" * (len(kinds) + 2))
    for row in rows:
        per_min = [row["counts"].get(k, 0) * 60 / row["seconds"] for k in kinds]
        total = sum(row["per_day"].values())
        cells = " | ".join(f"{v:.1f}" for v in per_min)
        print(f"| {row['interval']} | {cells} | {total:,.0f} | {row['usd_day']:.3f} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bucket_requests.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
