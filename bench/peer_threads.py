"""Where each side of a protected peer handoff spends its CPU: the event loop's thread, the process's
other threads, and its worker processes (spotguard/peer/workers.py), in CPU seconds per GiB.

The peer channel's ratio against a plain copy (bench/peer_channel.py) depends on what all flows
share: each process's one event loop hands every data frame to a worker and waits for its answer.
Its thread's CPU per GiB, against the workers', says how many GiB/s that loop could carry at most,
and whether a change moved work between them or removed it. Handoffs as in bench/peer_channel.py (a
real daemon's receiver, its own process; this process sends), the time runs to ``verified``.

    python bench/peer_threads.py --gib 1 --flows 1 --runs 3
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

from peer_rescue import make_checkpoint, peer_copy, peer_receiver, timed_handoff

from spotguard.harness import wait_for, worker_pids
from spotguard.manifest import load_manifest
from spotguard.peer.wire import SEND_CHUNK, parse_address

TICK = os.sysconf("SC_CLK_TCK")


def task_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of ``pid``; one that ends meanwhile is left out."""
    seconds: dict[int, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            seconds[int(task.name)] = (int(fields[11]) + int(fields[12])) / TICK
    return seconds


def split_cpu(pid: int) -> dict[str, float]:
    """``pid``'s CPU seconds so far: its main (event loop) thread, its other threads, its workers."""
    threads = task_cpu(pid)
    workers = 0.0
    for child in worker_pids(pid):
        with contextlib.suppress(OSError):
            workers += sum(task_cpu(child).values())
    main = threads.pop(pid, 0.0)
    return {"loop": main, "threads": sum(threads.values()), "workers": workers}


def per_gib(before: dict[str, float], after: dict[str, float], gib: float) -> str:
    return " ".join(f"{part} {(after[part] - before[part]) / gib:.2f}" for part in before)


def main() -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--gib", type=float, default=1.0)
    cli.add_argument("--files", type=int, default=8)
    cli.add_argument("--flows", type=int, default=1)
    cli.add_argument("--runs", type=int, default=3)
    args = cli.parse_args()
    with tempfile.TemporaryDirectory(prefix="spotguard-peer-threads-") as tmp:
        scratch = Path(tmp)
        step_dir = make_checkpoint(scratch / "sender", args.gib, args.files)
        nbytes = load_manifest(step_dir).total_bytes
        gib = nbytes / 2**30
        with peer_receiver(scratch) as (receiver, bucket):
            assert receiver.process is not None
            daemon = receiver.process.pid
            where = parse_address(receiver.status()["peers"]["listen"])
            timed_handoff(step_dir, receiver, where, bucket, args.flows)  # workers started, caches warm
            print(f"{gib:.2f} GiB in {args.files} files, {args.flows} flow(s); CPU-s per GiB")
            for _ in range(args.runs):
                frames_before = receiver.status()["peers"]["workers"]["frames"]
                sending, receiving = split_cpu(os.getpid()), split_cpu(daemon)
                seconds = peer_copy(step_dir, where, bucket, args.flows)
                sent, received = split_cpu(os.getpid()), split_cpu(daemon)
                frames = receiver.status()["peers"]["workers"]["frames"] - frames_before
                print(
                    f"{seconds:5.2f} s {nbytes / seconds / 1e6:6.0f} MB/s | sender {per_gib(sending, sent, gib)}"
                    f" | receiver {per_gib(receiving, received, gib)}"
                    f" | frames received by workers {frames / max(1, nbytes // SEND_CHUNK):.0%}"
                )
                # Off the clock: the replica goes on to the bucket, then leaves it, as in peer_channel.py.
                wait_for(lambda: receiver.status()["peers"]["replicas"] == [], 120, "the replica to be committed")
                shutil.rmtree(Path(bucket.removeprefix("file://")) / step_dir.name, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
