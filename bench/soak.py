"""A daemon's life in fast-forward: does anything it holds grow with the number of checkpoints?

A daemon runs for months on a training VM. One real daemon (``spotguard run``, its own process,
provider ``aws`` against the IMDS emulator, an S3 bucket in moto, its peer receiver on 127.0.0.1)
goes through ``--cycles`` cycles of what it sees in that time, sped up. Every cycle: a periodic
``Guard.save`` of a small state, waited for until it is committed in the bucket (so retention
prunes, locally and in the bucket), a status request and a Prometheus scrape. Every
``--handoff-every`` cycles: a replica handed to its peer receiver by another daemon (this
process) and committed by it. Every ``--reconnect-every`` cycles: the trainer closes its Guard
and connects again. Every ``--rebalance-every`` cycles: a new rebalance recommendation (a soft
notice). ``--fault-rate``: that share of the daemon's requests to the bucket fails (a 503, a 500,
a reset connection or a stalled answer, in turn: the tests' fault proxy in front of moto), so that
the paths of failed and retried uploads run thousands of times too.

Every ``--sample-every`` cycles the daemon's resident memory, open file descriptors, threads and
worker processes are read from ``/proc``; the report gives their first and last samples and the
growth per 1,000 cycles over the second half of the run (least squares), after the warm-up in the
first half (caches, pools, the allocator's arenas). Growth that stays above zero there is what a
fleet would pay per month.

    python bench/soak.py --cycles 2000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch
from common import _free_port, moto_process
from peer_rescue import TOKEN

from spotguard import Guard
from spotguard.emulate.common import RunningEmulator
from spotguard.emulate.registry import start_emulator
from spotguard.harness import Vm, wait_for, worker_pids
from spotguard.peer.client import PeerClient
from spotguard.peer.flows import send_committed
from spotguard.peer.wire import parse_address
from spotguard.trainer.writer import CheckpointWriter

STATE_MIB = 4
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the fault proxy of tests/


@dataclass(frozen=True)
class Sample:
    cycle: int
    rss_kib: int
    fds: int
    threads: int
    workers: int


def sample(pid: int, cycle: int) -> Sample:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in status if ":" in line)
    return Sample(
        cycle=cycle,
        rss_kib=int(fields["VmRSS"].split()[0]),
        fds=len(os.listdir(f"/proc/{pid}/fd")),
        threads=int(fields["Threads"]),
        workers=len(worker_pids(pid)),
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
    cli.add_argument("--fault-rate", type=float, default=0.0)
    args = cli.parse_args()
    torch.set_num_threads(1)
    state = {"weight": torch.randn(STATE_MIB * 2**20 // 4), "step": torch.zeros(1)}
    with contextlib.ExitStack() as stack:
        return soak(args, state, stack)


def soak(args: argparse.Namespace, state: dict[str, torch.Tensor], stack: contextlib.ExitStack) -> int:
    scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="spotguard-soak-")))
    moto = stack.enter_context(moto_process())
    if args.fault_rate:
        from tests.faultproxy import FaultProxy

        proxy = stack.enter_context(FaultProxy(moto.endpoint_url, fault_rate=args.fault_rate, stall_seconds=2.0))
        os.environ["AWS_ENDPOINT_URL_S3"] = proxy.url  # the daemon's; this process's own calls go direct
    emulator = stack.enter_context(start_emulator("aws"))
    config = scratch / "spotguard.toml"
    metrics_port = _free_port()
    config.write_text(f"metrics_port = {metrics_port}\n")
    vm = Vm(
        scratch,
        "vm",
        moto.url("ckpt"),
        extra_args=[
            "--config", str(config),
            "--provider", "aws",
            "--metadata-url", emulator.url,
            "--poll-interval", "0.2",
            "--peer-listen", "127.0.0.1:0",
        ],
    )  # fmt: skip
    vm.start_daemon(env={"SPOTGUARD_PEER_TOKEN": TOKEN})
    stack.callback(vm.stop_daemon)
    started = time.monotonic()
    samples = run_cycles(args, state, vm, emulator, metrics_port, scratch)
    vm.stop_daemon()
    first, last = samples[0], samples[-1]
    print(f"\n{args.cycles} cycles in {time.monotonic() - started:.0f} s; growth per 1,000 cycles, second half:")
    for field, unit in (("rss_kib", "KiB"), ("fds", ""), ("threads", ""), ("workers", "")):
        print(
            f"  {field:8s} {getattr(first, field):8d} -> {getattr(last, field):8d}"
            f"   {slope_per_1000(samples, field):+9.1f} {unit}"
        )
    return 1 if report_errors(vm.log) else 0


def run_cycles(
    args: argparse.Namespace,
    state: dict[str, torch.Tensor],
    vm: Vm,
    emulator: RunningEmulator,
    metrics_port: int,
    scratch: Path,
) -> list[Sample]:
    assert vm.process is not None
    pid = vm.process.pid
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
            if cycle % args.rebalance_every == 0:
                emulator.trigger(kind="rebalance")
            if cycle % args.sample_every == 0:
                samples.append(latest := sample(pid, cycle))
                print(
                    f"cycle {cycle:6d} {time.monotonic() - started:7.1f} s  rss {latest.rss_kib / 1024:7.1f} MiB"
                    f"  fds {latest.fds:4d}  threads {latest.threads:3d}  workers {latest.workers}",
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
