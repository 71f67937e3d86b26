"""The peer tier: notice -> safe on a peer against notice -> safe in the bucket, and the peer
transfer against the floor, a plain loopback TCP copy of the same bytes.

Notice -> safe (one run each; moto behind a relay pacing every connection, 1 MB/s by default): a
trainer (``Guard``, a ``--gib`` state) on daemon A saves its urgent checkpoint at a drill;

- peer: A has a peer, daemon B; A's plan routes to B, A streams the ranges as the trainer writes
  them; "safe on a peer" is A's handoff ``handed`` (B verified every file), A is then killed (the VM
  is gone), and B commits the checkpoint in the bucket ("safe in the bucket, through the peer");
- bucket: A alone; "safe in the bucket" is A's own commit there.

Throughput, in one run, interleaved, several runs each, medians:

- floor: the checkpoint's files sent over one loopback TCP connection (``socket.sendfile``) to a
  receiver process that writes them to its disk: what the link and the disk can do at most;
- peer: the same checkpoint handed to a real daemon's peer receiver (``spotguard run --peer-listen``,
  its own process) with ``PeerClient``: authenticated, framed, written, every file's CRC32C checked;
  the time runs to the receiver's ``verified`` answer ("safe on a peer").

The acceptance target is peer throughput >= 0.8 of the floor.

    python bench/peer_rescue.py --gib 1 --files 8 --runs 3 [--no-rescue] [--per-connection-mb-s 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from common import Moto, capped_link, machine, median, moto_process, process_cpu, write_results
from upload_deadline import TRAINER

from spotguard.control import request
from spotguard.harness import Vm, wait_for
from spotguard.localstore import CheckpointWriter
from spotguard.manifest import load_manifest
from spotguard.peer import workers
from spotguard.peer.client import PeerClient
from spotguard.peer.flows import send_committed
from spotguard.peer.wire import SEND_CHUNK, parse_address

MiB = 1 << 20
TOKEN = "bench-peer-token-0123456789abcdef"


def make_checkpoint(root: Path, gib: float, files: int) -> Path:
    writer = CheckpointWriter(root, 1, reason="urgent")
    writer.prepare()
    each = int(gib * 1024 * MiB) // files
    block = os.urandom(16 * MiB)
    for index in range(files):
        with writer.create(f"shard-{index}.bin") as out:
            left = each
            while left:
                out.write(block[: min(left, len(block))])
                left -= min(left, len(block))
    writer.commit()
    return writer.dir


def sink_main(out_dir: str, connections: int) -> None:
    """The plain copy's receiver: ``connections`` connections, each a stream of (name length, name,
    size, bytes) written to disk; a byte back once a connection's stream ends."""
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)

    def serve(conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as stream:
            while header := stream.read(4):
                name = stream.read(int.from_bytes(header, "big")).decode()
                left = int.from_bytes(stream.read(8), "big")
                with open(Path(out_dir) / name, "wb") as out:
                    while left:
                        chunk = stream.read(min(left, 8 * MiB))
                        out.write(chunk)
                        left -= len(chunk)
            conn.sendall(b"k")

    threads = []
    for _ in range(connections):
        conn, _ = listener.accept()
        threads.append(threading.Thread(target=serve, args=(conn,)))
        threads[-1].start()
    for thread in threads:
        thread.join()


def plain_copy(step_dir: Path, scratch: Path, connections: int, cpu: dict[str, float] | None = None) -> float:
    """Seconds to copy the checkpoint's files over ``connections`` loopback TCP connections at once
    (files dealt out to them, ``socket.sendfile``) to a receiver process writing them to disk. With
    ``cpu``: the CPU seconds each side spent on it go there (``sender``, ``receiver``)."""
    out = scratch / "plain"
    out.mkdir()
    command = [sys.executable, __file__, "sink", str(out), str(connections)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        files = sorted(load_manifest(step_dir).files)
        shares = [files[i::connections] for i in range(connections)]

        def send(share: list[str]) -> None:
            with socket.create_connection(("127.0.0.1", port)) as sock:
                for rel in share:
                    path = step_dir / rel
                    sock.sendall(len(rel).to_bytes(4, "big") + rel.encode() + path.stat().st_size.to_bytes(8, "big"))
                    with path.open("rb") as handle:
                        sock.sendfile(handle)
                sock.shutdown(socket.SHUT_WR)
                assert sock.recv(1) == b"k"

        sender, receiver = process_cpu(), process_cpu(proc.pid)
        started = time.perf_counter()
        threads = [threading.Thread(target=send, args=(share,)) for share in shares]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - started
        if cpu is not None:
            cpu.update(sender=process_cpu() - sender, receiver=process_cpu(proc.pid) - receiver)
        return seconds
    finally:
        proc.wait(timeout=60)
        shutil.rmtree(out, ignore_errors=True)


def floor_copy(step_dir: Path, scratch: Path) -> float:
    """The floor: the plain copy on one connection."""
    return plain_copy(step_dir, scratch, 1)


def peer_copy(step_dir: Path, where: tuple[str, int], bucket: str, flows: int = 1) -> float:
    async def hand_over() -> float:
        started = time.perf_counter()
        client = await PeerClient.connect(*where, TOKEN.encode())
        try:
            reply = await send_committed(client, step_dir, bucket, TOKEN.encode(), flows=flows)
        finally:
            await client.close()
        assert reply["state"] == "verified", reply
        return time.perf_counter() - started

    return asyncio.run(hand_over())


@contextlib.contextmanager
def peer_receiver(scratch: Path) -> Iterator[tuple[Vm, str]]:
    """A real daemon taking replicas on 127.0.0.1 (``spotguard run --peer-listen``, its own process),
    committing them to a ``file://`` bucket under ``scratch``; yields it and the bucket's URL."""
    (scratch / "bucket").mkdir()
    bucket = (scratch / "bucket").as_uri()
    receiver = Vm(scratch, "peer", bucket, extra_args=["--provider", "none", "--peer-listen", "127.0.0.1:0"])
    receiver.start_daemon(env={"SPOTGUARD_PEER_TOKEN": TOKEN})
    try:
        yield receiver, bucket
    finally:
        receiver.kill_daemon()


def worker_frames(step_dir: Path) -> int:
    """The data frames of a handoff of ``step_dir`` big enough to go to a worker process (files
    are sent in frames of at most SEND_CHUNK bytes)."""
    frames = 0
    for path in step_dir.rglob("*"):
        size = path.stat().st_size if path.is_file() else 0
        whole, rest = divmod(size, SEND_CHUNK)
        frames += whole + (rest >= workers.WORKER_PAYLOAD)
    return frames


def timed_handoff(
    step_dir: Path,
    receiver: Vm,
    where: tuple[str, int],
    bucket: str,
    flows: int = 1,
    cpu: dict[str, float] | None = None,
) -> float:
    """:func:`peer_copy` to ``where`` (``receiver``, or a relay to it); then, off the clock, the
    replica goes on to the bucket and is removed there, so that the next run starts alike. With
    ``cpu``: the CPU seconds each side spent until the receiver's ``verified`` go there."""
    assert receiver.process is not None
    sender, receiving = process_cpu(), process_cpu(receiver.process.pid)
    sent_by, received_by = workers.pool().frames, receiver.status()["peers"]["workers"]["frames"]
    seconds = peer_copy(step_dir, where, bucket, flows)
    if cpu is not None:
        cpu.update(sender=process_cpu() - sender, receiver=process_cpu(receiver.process.pid) - receiving)
        # The share of the big data frames worker processes carried (the rest went the in-process
        # way: no worker was free), on each side.
        frames = worker_frames(step_dir)
        cpu.update(
            sent_by_workers=(workers.pool().frames - sent_by) / frames,
            received_by_workers=(receiver.status()["peers"]["workers"]["frames"] - received_by) / frames,
        )
    wait_for(lambda: receiver.status()["peers"]["replicas"] == [], 120, "the replica to be committed")
    shutil.rmtree(Path(bucket.removeprefix("file://")) / step_dir.name, ignore_errors=True)
    return seconds


def notice_to_safe(
    moto: Moto,
    work: Path,
    gib: float,
    deadline: float,
    *,
    peer: bool,
    flow_cap: float | None = None,
    max_flows: int | None = None,
) -> dict[str, Any]:
    """One drill on daemon A (with peer B or alone) and its trainer; seconds from the notice.
    ``flow_cap``: A reaches B's peer port through a relay pacing each connection to that many bytes/s."""
    prefix = f"rescue-{'peer' if peer else 'bucket'}"
    env = {"SPOTGUARD_PEER_TOKEN": TOKEN}
    vm_b = Vm(work, f"{prefix}-b", moto.url(prefix), extra_args=["--provider", "none", "--peer-listen", "127.0.0.1:0"])
    peers = []
    link = contextlib.ExitStack()
    if peer:
        vm_b.start_daemon(env=env)
        address = vm_b.status()["peers"]["listen"]
        if flow_cap is not None:  # B's link: every flow capped, as a cloud caps them
            address = link.enter_context(capped_link(address, flow_cap, buffer_bytes=256 * 1024))
        peers = ["--peers", address.removeprefix("http://")]
    vm_a = Vm(work, f"{prefix}-a", moto.url(prefix), extra_args=["--provider", "none", *peers])
    vm_a.start_daemon(env={**env, **({"SPOTGUARD_PEER_MAX_FLOWS": str(max_flows)} if max_flows else {})})
    bench_dir = str(Path(__file__).parent)
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, bench_dir, str(vm_a.root), str(vm_a.socket), str(gib), "8"],
        stdout=subprocess.PIPE,
        text=True,
    )
    times: dict[str, Any] = {}
    try:
        wait_for(lambda: vm_a.status()["upload_rate_bytes_s"], 60, "A's upload-rate probe")
        assert trainer.stdout is not None
        assert trainer.stdout.readline().strip() == '{"ready": true}'
        t_notice = time.time()
        request(vm_a.socket, "drill", deadline_s=deadline)
        saved = json.loads(trainer.stdout.readline())  # the trainer's urgent save, committed locally
        times["committed_locally"] = saved["timeline"]["committed_local"] - t_notice
        if peer:
            handed = wait_for(
                lambda: (h := vm_a.status()["peers"]["handoff"])["state"] in ("handed", "failed") and h,
                600,
                "A's handoff",
                interval=0.01,
            )
            assert handed["state"] == "handed", handed
            times["safe_on_peer"] = time.time() - t_notice
            times["route"] = vm_a.status()["plan"]["route"]
            times["flows"] = vm_a.status()["peers"]["handoff"]["flows"]
            times["in_time"] = times["safe_on_peer"] <= deadline
            vm_a.kill_daemon()  # the VM is gone: B alone commits it
            wait_for(lambda: vm_b.status()["peers"]["replicas"] == [], 1800, "B's commit", interval=0.05)
            times["safe_in_bucket"] = time.time() - t_notice
        else:
            status = wait_for(
                lambda: (s := vm_a.status())["last_notice"] and s["last_notice"].get("committed_at") and s,
                1800,
                "A's commit in the bucket",
                interval=0.05,
            )
            times["safe_in_bucket"] = time.time() - t_notice
            times["route"] = status["plan"]["route"] if status.get("plan") else None
    finally:
        link.close()
        trainer.kill()
        trainer.wait()
        vm_a.kill_daemon()
        if peer:
            vm_b.kill_daemon()
        moto.empty(prefix)
        shutil.rmtree(vm_a.dir, ignore_errors=True)
        shutil.rmtree(vm_b.dir, ignore_errors=True)
    return times


def rescue(
    gib: float,
    mb_s: float,
    deadline: float,
    flow_mb_s: float | None,
    *,
    bucket_drill: bool = True,
    max_flows: int | None = None,
) -> dict[str, dict[str, Any]]:
    with (
        tempfile.TemporaryDirectory(prefix="spotguard-peer-rescue-") as tmp,
        moto_process() as direct,
        capped_link(direct.endpoint_url, mb_s * 1e6) as relay,
    ):
        os.environ["AWS_ENDPOINT_URL_S3"] = relay  # both daemons reach the bucket through it
        moto = Moto(relay, direct.bucket)
        results = {
            "peer": notice_to_safe(
                moto,
                Path(tmp),
                gib,
                deadline,
                peer=True,
                flow_cap=None if flow_mb_s is None else flow_mb_s * 1e6,
                max_flows=max_flows,
            ),
        }
        if bucket_drill:
            results["bucket"] = notice_to_safe(moto, Path(tmp), gib, deadline, peer=False)
    for route, times in results.items():
        said = ", ".join(
            f"{key} {value:.1f} s" if isinstance(value, float) else f"{key} {value}" for key, value in times.items()
        )
        print(f"notice -> safe, {route} route: {said}")
    return results


def main() -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--gib", type=float, default=1.0)
    cli.add_argument("--files", type=int, default=8)
    cli.add_argument("--runs", type=int, default=3)
    cli.add_argument("--no-rescue", action="store_true", help="only the throughput against the TCP copy")
    cli.add_argument("--per-connection-mb-s", type=float, default=1.0, help="the relay's cap on each connection")
    cli.add_argument("--deadline", type=float, default=30.0, help="the drill's seconds of notice")
    cli.add_argument("--peer-flow-mb-s", type=float, help="cap each connection to the peer (default: none)")
    cli.add_argument("--no-bucket-drill", action="store_true", help="the drill with a peer only")
    cli.add_argument("--peer-max-flows", type=int, help="A's peer_max_flows (default: the daemon's, 8)")
    args = cli.parse_args()
    rescued = None
    if not args.no_rescue:
        drill = (args.gib, args.per_connection_mb_s, args.deadline, args.peer_flow_mb_s)
        rescued = rescue(*drill, bucket_drill=not args.no_bucket_drill, max_flows=args.peer_max_flows)
    with tempfile.TemporaryDirectory(prefix="spotguard-peer-bench-") as tmp:
        scratch = Path(tmp)
        step_dir = make_checkpoint(scratch / "sender", args.gib, args.files)
        nbytes = load_manifest(step_dir).total_bytes
        times: dict[str, list[float]] = {"floor": [], "peer": []}
        with peer_receiver(scratch) as (receiver, bucket):
            where = parse_address(receiver.status()["peers"]["listen"])
            for _ in range(args.runs):
                times["floor"].append(floor_copy(step_dir, scratch))
                times["peer"].append(timed_handoff(step_dir, receiver, where, bucket))
    rates = {name: nbytes / median(samples) / 1e6 for name, samples in times.items()}
    ratio = rates["peer"] / rates["floor"]
    for name, samples in times.items():
        print(
            f"{name:6s} median {median(samples):6.2f} s  {rates[name]:7.0f} MB/s  runs {[round(s, 2) for s in samples]}"
        )
    print(f"peer / floor throughput: {ratio:.2f} (target >= 0.80)")
    report: dict[str, Any] = {"machine": machine(), "bytes": nbytes, "files": args.files, "seconds": times}
    report.update(rates_mb_s=rates, ratio=ratio, notice_to_safe=rescued)
    print(f"results: {write_results('peer_rescue', report)}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "sink":
        sink_main(sys.argv[2], int(sys.argv[3]))
        sys.exit(0)
    sys.exit(main())
