"""A daemon's life in fast-forward: does anything it holds grow with the number of checkpoints?

A daemon runs for months on a training VM. One real daemon (``spotguard run``, its own process,
provider ``aws`` against the IMDS emulator, an S3 bucket in moto or, with ``--store gs``, a GCS
bucket in gcp-storage-emulator, its peer receiver on 127.0.0.1) goes through ``--cycles`` cycles of
what it sees in that time, sped up. Every cycle: a periodic ``Guard.save`` of a small state, waited
for until it is committed in the bucket (so retention prunes, locally and in the bucket), a status
request and a Prometheus scrape. Every ``--handoff-every`` cycles: a replica handed to its peer
receiver by another daemon (this process) and committed by it. Every ``--reconnect-every`` cycles:
the trainer closes its Guard and connects again. Every ``--rebalance-every`` cycles: a new rebalance
recommendation (a soft notice). ``--fault-rate``: that share of the daemon's requests to the bucket
fails (a 503, a 500, a reset connection or a stalled answer, in turn: the tests' fault proxy in
front of the store), so that the paths of failed and retried uploads run thousands of times too.

Every ``--sample-every`` cycles the daemon's resident memory, open file descriptors, threads, the
heaps its threads allocate from apart from the main one (spotguard/daemon/heap.py) and worker
processes are read from ``/proc``; so is what it keeps on disk (files and bytes in its state
directory and its checkpoint directory) and in the bucket (objects and bytes: checkpoints, markers,
the peer registry, whatever the daemon writes there; and multipart uploads left open). The report
gives their first and last samples and the growth per 1,000 cycles over the second half of the run
(least squares), after the warm-up in the first half (caches, pools, the allocator's arenas).
Growth that stays above zero there is what a fleet would pay per month.

    python bench/soak.py --cycles 2000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from common import _free_port, moto_process
from peer_rescue import TOKEN

from spotguard import Guard
from spotguard.daemon.heap import TRIM_INTERVAL
from spotguard.emulate.common import RunningEmulator
from spotguard.emulate.registry import start_emulator
from spotguard.harness import Vm, thread_heaps, wait_for, worker_pids
from spotguard.peer.client import PeerClient
from spotguard.peer.flows import send_committed
from spotguard.peer.wire import parse_address
from spotguard.storage.gcs import PARTS_DIR
from spotguard.trainer.writer import CheckpointWriter

STATE_MIB = 4
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the fault proxy of tests/


@dataclass(frozen=True)
class Sample:
    cycle: int
    rss_kib: int
    fds: int
    threads: int
    thread_heaps: int
    workers: int
    state_files: int
    state_kib: int
    local_files: int
    local_kib: int
    bucket_objects: int
    bucket_kib: int
    bucket_uploads: int


def footprint(root: Path) -> tuple[int, int]:
    """Files under ``root`` and their bytes in KiB (a file that goes while it is counted is skipped)."""
    files = size = 0
    for path in root.rglob("*"):
        with contextlib.suppress(FileNotFoundError):
            if path.is_file():
                files += 1
                size += path.stat().st_size
    return files, size // 1024


def s3_footprint(client: Any, bucket: str) -> tuple[int, int, int]:
    """Objects in ``bucket`` (every prefix), their bytes in KiB, and multipart uploads left open (a
    store bills their parts, and no listing of objects shows them)."""
    objects = size = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for item in page.get("Contents", []):
            objects += 1
            size += item["Size"]
    uploads = sum(
        len(page.get("Uploads", [])) for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket)
    )
    return objects, size // 1024, uploads


def gcs_footprint(client: Any, bucket: str) -> tuple[int, int, int]:
    """Objects in ``bucket``, their bytes in KiB, and the parts of composite uploads among them (a
    GCS upload's parts are objects of their own until the composed object replaces them)."""
    blobs = list(client.list_blobs(bucket))
    parts = sum(f"/{PARTS_DIR}/" in f"/{blob.name}" for blob in blobs)
    return len(blobs), sum(blob.size or 0 for blob in blobs) // 1024, parts


@dataclass(frozen=True)
class Bucket:
    """The store the daemon uploads to: its location, what the daemon needs to reach it (through the
    fault proxy, if any), and a look at everything in it (this process's own, directly)."""

    url: str
    daemon_env: dict[str, str]
    footprint: Callable[[], tuple[int, int, int]]


def open_bucket(store: str, fault_rate: float, stack: contextlib.ExitStack) -> Bucket:
    from tests.faultproxy import FaultProxy

    if store == "s3":
        moto = stack.enter_context(moto_process())
        endpoint, name = moto.endpoint_url, moto.bucket
        s3 = moto.client()
        stack.callback(s3.close)
        footprint = functools.partial(s3_footprint, s3, name)
    else:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage as gcs

        from tests.servers import gcs_emulator

        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        server = stack.enter_context(gcs_emulator())
        endpoint, name = server.endpoint_url, server.bucket
        client = gcs.Client(
            project=server.project, credentials=AnonymousCredentials(), client_options={"api_endpoint": endpoint}
        )
        footprint = functools.partial(gcs_footprint, client, name)
    if fault_rate:
        flavor = "s3" if store == "s3" else "gcs"
        proxy = FaultProxy(endpoint, fault_rate=fault_rate, stall_seconds=2.0, flavor=flavor)
        endpoint = stack.enter_context(proxy).url
    env = {"AWS_ENDPOINT_URL_S3": endpoint} if store == "s3" else {"STORAGE_EMULATOR_HOST": endpoint}
    return Bucket(f"{store}://{name}/ckpt", env, footprint)


def sample(vm: Vm, bucket: Bucket, cycle: int) -> Sample:
    assert vm.process is not None
    pid = vm.process.pid
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in status if ":" in line)
    state_files, state_kib = footprint(vm.dir / "state")
    local_files, local_kib = footprint(vm.root)
    bucket_objects, bucket_kib, bucket_uploads = bucket.footprint()
    return Sample(
        cycle=cycle,
        rss_kib=int(fields["VmRSS"].split()[0]),
        fds=len(os.listdir(f"/proc/{pid}/fd")),
        threads=int(fields["Threads"]),
        thread_heaps=thread_heaps(pid),
        workers=len(worker_pids(pid)),
        state_files=state_files,
        state_kib=state_kib,
        local_files=local_files,
        local_kib=local_kib,
        bucket_objects=bucket_objects,
        bucket_kib=bucket_kib,
        bucket_uploads=bucket_uploads,
    )


def slope_per_1000(samples: list[Sample], field: str) -> float:
    """Least-squares growth of ``field`` per 1,000 cycles over the second half of ``samples``."""
    half = samples[len(samples) // 2 :]
    if len(half) < 2:
        return 0.0
    xs = [s.cycle for s in half]
    ys = [float(getattr(s, field)) for s in half]
    return statistics.linear_regression(xs, ys).slope * 1000


def hand_over(step_dir: Path, where: tuple[str, int], bucket: str) -> None:
    async def run() -> None:
        client = await PeerClient.connect(*where, TOKEN.encode())
        try:
            reply = await send_committed(client, step_dir, bucket, TOKEN.encode(), flows=2)
        finally:
            await client.close()
        assert reply["state"] == "verified", reply

    asyncio.run(run())


def scrape(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return len(response.read())


def main() -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--cycles", type=int, default=2000)
    cli.add_argument("--sample-every", type=int, default=100)
    cli.add_argument("--handoff-every", type=int, default=10)
    cli.add_argument("--reconnect-every", type=int, default=50)
    cli.add_argument("--rebalance-every", type=int, default=100)
    cli.add_argument(
        "--idle-seconds",
        type=float,
        default=TRIM_INTERVAL + 10,
        help="the daemon's idle time (once no notice is pending) before the last sample",
    )
    cli.add_argument("--store", choices=("s3", "gs"), default="s3", help="moto, or gcp-storage-emulator")
    cli.add_argument("--fault-rate", type=float, default=0.0)
    cli.add_argument(
        "--state-mib", type=int, default=STATE_MIB, help="the periodic state's size (from 16 MiB, multipart uploads)"
    )
    cli.add_argument(
        "--urgent-mib",
        type=int,
        default=0,
        help="after the cycles, an urgent save of this many MiB (uploaded the race's way) before the idle sample",
    )
    args = cli.parse_args()
    torch.set_num_threads(1)
    state = {"weight": torch.randn(args.state_mib * 2**20 // 4), "step": torch.zeros(1)}
    with contextlib.ExitStack() as stack:
        return soak(args, state, stack)


def soak(args: argparse.Namespace, state: dict[str, torch.Tensor], stack: contextlib.ExitStack) -> int:
    scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="spotguard-soak-")))
    bucket = open_bucket(args.store, args.fault_rate, stack)
    emulator = stack.enter_context(start_emulator("aws"))
    config = scratch / "spotguard.toml"
    metrics_port = _free_port()
    config.write_text(f"metrics_port = {metrics_port}\n")
    vm = Vm(
        scratch,
        "vm",
        bucket.url,
        extra_args=[
            "--config", str(config),
            "--provider", "aws",
            "--metadata-url", emulator.url,
            "--poll-interval", "0.2",
            "--peer-listen", "127.0.0.1:0",
        ],
    )  # fmt: skip
    vm.start_daemon(env={"SPOTGUARD_PEER_TOKEN": TOKEN, **bucket.daemon_env})
    stack.callback(vm.stop_daemon)
    started = time.monotonic()
    samples = run_cycles(args, state, vm, emulator, metrics_port, scratch, bucket)
    spent = time.monotonic() - started
    if args.urgent_mib:
        urgent_save(vm, bucket, args.urgent_mib, step=2 * args.cycles + 2)
    idle = idle_sample(vm, bucket, args.cycles, args.idle_seconds)
    vm.stop_daemon()
    first, last = samples[0], samples[-1]
    print(f"\n{args.cycles} cycles in {spent:.0f} s; growth per 1,000 cycles, second half:")
    for field in [f.name for f in dataclasses.fields(Sample) if f.name != "cycle"]:
        print(
            f"  {field:14s} {getattr(first, field):8d} -> {getattr(last, field):8d}"
            f"   {slope_per_1000(samples, field):+9.1f} {'KiB' if field.endswith('_kib') else ''}"
        )
    print(
        f"after {args.idle_seconds:.0f} s idle: rss {idle.rss_kib / 1024:.1f} MiB, fds {idle.fds}, threads"
        f" {idle.threads} (heaps of their own {idle.thread_heaps}), workers {idle.workers},"
        f" bucket {idle.bucket_objects} objects, {idle.bucket_uploads} open"
    )
    return 1 if report_errors(vm.log) else 0


def urgent_save(vm: Vm, bucket: Bucket, mib: int, step: int) -> None:
    """An urgent checkpoint of ``mib`` MiB in eight tensors, waited for until it is in the bucket: the
    daemon uploads it the race's way, every stream at once, from threads it may not have used before."""
    state = {f"w{i}": torch.randn(mib * 2**20 // 32) for i in range(8)}
    guard = Guard(checkpoint_dir=vm.root, socket=vm.socket, handle_sigterm=False)
    try:
        wait_for(guard.client.connected.is_set, 10, "the hook to connect to the daemon")
        guard.save(state, step, reason="urgent")
        wait_for(lambda: committed(vm) >= step, 600, f"the urgent step {step} to be committed in the bucket")
    finally:
        guard.close()
    after = sample(vm, bucket, step)
    print(f"urgent save of {mib} MiB committed: rss {after.rss_kib / 1024:.1f} MiB, {after.thread_heaps} thread heaps")


def idle_sample(vm: Vm, bucket: Bucket, cycle: int, seconds: float) -> Sample:
    """A sample after ``seconds`` with nothing to do, once no notice is pending and nothing is being
    uploaded, as a daemon spends most of its months: the cycles come back to back, so the daemon's
    idle work (heap trims, retiring idle workers) seldom runs during them."""

    def idle() -> bool:
        status = vm.status()
        return status["pending"] is None and status["uploads"]["current"] is None and not status["uploads"]["queued"]

    wait_for(idle, 300, "the last notice to be over and the uploads to end")
    time.sleep(seconds)  # the idle time itself is what is measured
    return sample(vm, bucket, cycle)


def run_cycles(
    args: argparse.Namespace,
    state: dict[str, torch.Tensor],
    vm: Vm,
    emulator: RunningEmulator,
    metrics_port: int,
    scratch: Path,
    bucket: Bucket,
) -> list[Sample]:
    where = parse_address(vm.status()["peers"]["listen"])
    guard = Guard(checkpoint_dir=vm.root, socket=vm.socket, handle_sigterm=False)
    samples: list[Sample] = []
    started = time.monotonic()
    try:
        for cycle in range(1, args.cycles + 1):
            step = 2 * cycle  # a peer's replica of the same job takes the odd step after it
            state["step"].fill_(step)
            guard.save(state, step)
            wait_for(lambda step=step: committed(vm) >= step, 300, f"step {step} to be committed in the bucket")
            scrape(metrics_port)
            if cycle % args.handoff_every == 0:
                hand_over(peer_checkpoint(scratch / "peer", step + 1), where, vm.bucket)
                wait_for(lambda: not vm.status()["peers"]["replicas"], 300, "the replica to be committed")
            if cycle % args.reconnect_every == 0:
                guard.close()
                guard = Guard(checkpoint_dir=vm.root, socket=vm.socket, handle_sigterm=False)
            if cycle % args.rebalance_every == 0 and cycle < args.cycles:  # none unseen at the idle sample
                emulator.trigger(kind="rebalance")
            if cycle % args.sample_every == 0:
                samples.append(latest := sample(vm, bucket, cycle))
                print(
                    f"cycle {cycle:6d} {time.monotonic() - started:7.1f} s  rss {latest.rss_kib / 1024:7.1f} MiB"
                    f"  fds {latest.fds:4d}  threads {latest.threads:3d} ({latest.thread_heaps} heaps)"
                    f"  workers {latest.workers}"
                    f"  state {latest.state_files}/{latest.state_kib} KiB"
                    f"  local {latest.local_files}/{latest.local_kib} KiB"
                    f"  bucket {latest.bucket_objects}/{latest.bucket_kib} KiB, {latest.bucket_uploads} open",
                    flush=True,
                )
    finally:
        guard.close()
    return samples


def report_errors(log: Path) -> int:
    """Print how many errors the daemon logged (a failing bucket's are expected) and the first
    traceback in full; the number of tracebacks (an error the daemon did not expect)."""
    lines = log.read_text(errors="replace").splitlines()
    errors = sum(" ERROR " in line for line in lines)
    tracebacks = [index for index, line in enumerate(lines) if line.startswith("Traceback")]
    print(f"the daemon logged {errors} errors, {len(tracebacks)} with a traceback")
    if tracebacks:
        first = tracebacks[0]
        print("\n".join(lines[max(0, first - 1) : first + 40]))
    return len(tracebacks)


def peer_checkpoint(root: Path, step: int) -> Path:
    """Another node's committed urgent checkpoint of ``step``: 8 MiB in two files."""
    writer = CheckpointWriter(root, step, reason="urgent")
    writer.prepare()
    for index in range(2):
        with writer.create(f"shard-{index}.bin") as out:
            out.write(os.urandom(4 * 2**20))
    writer.commit()
    return writer.dir


def committed(vm: Vm) -> int:
    report = vm.status()["uploads"]["last_committed"] or {}
    name = str(report.get("name", "step-0"))
    return int(name.removeprefix("step-") or 0)


if __name__ == "__main__":
    sys.exit(main())
