"""What one S3 store's client costs to make: a session sharing the process's service models
(``s3_api.new_session``) against a fresh ``boto3.session.Session()`` (what every store made before),
interleaved in the same run; CPU seconds per client, medians.

Every store opened in a process (the CLI's commands, a trainer's resume that lists the bucket and then
fetches, the tests' polls of a bucket) makes one client. No request is sent: the cost is the client
alone (models, endpoint rules, the client class).

    python bench/s3_client_cost.py --clients 20 --runs 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import boto3

from spotguard.storage.s3_api import new_session

ENDPOINT = "http://127.0.0.1:9"  # never dialled: making a client sends nothing


def fresh_session() -> Any:
    return boto3.session.Session()


def cpu_per_client(make_session: Callable[[], Any], clients: int) -> float:
    """CPU seconds per client, each from a session of its own."""
    started = time.process_time()
    for _ in range(clients):
        make_session().client("s3", endpoint_url=ENDPOINT, region_name="us-east-1")
    return (time.process_time() - started) / clients


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=20, help="clients made per run and kind")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    new_session().client("s3", endpoint_url=ENDPOINT, region_name="us-east-1")  # the one read of the models
    kinds: dict[str, Callable[[], Any]] = {"fresh boto3 session": fresh_session, "new_session": new_session}
    results: dict[str, list[float]] = {name: [] for name in kinds}
    for _ in range(args.runs):
        for name, make in kinds.items():
            results[name].append(cpu_per_client(make, args.clients))
    baseline = statistics.median(results["fresh boto3 session"])
    for name, runs in results.items():
        median = statistics.median(runs)
        spread = ", ".join(f"{1000 * run:.1f}" for run in runs)
        print(f"{name:20s} {1000 * median:6.1f} ms CPU per client ({spread})  {median / baseline:.2f} of fresh")


if __name__ == "__main__":
    main()
