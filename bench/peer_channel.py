"""The protected peer channel (spotguard-peer/2): a handoff's throughput against a plain TCP copy of
the same bytes, and the cipher's single-core rate.

- plain: the checkpoint's files over ``--connections`` loopback TCP connections at once (files dealt
  out to them, ``socket.sendfile``) to a receiver process that writes them to its disk: no
  handshake, no encryption, no checks;
- protected: the same checkpoint handed to a real daemon's peer receiver (``spotguard run
  --peer-listen``, its own process) over as many flows (``send_committed``; and over one flow, for
  reference): each connection's Noise handshake, every byte sealed in
  AES-GCM records, decrypted into the receiver's buffers, written, every file's CRC32C checked; the
  time runs to the receiver's ``verified`` answer;
- cipher: one core sealing (and opening) 64 KiB records, AES-GCM and ChaCha20-Poly1305.

Beside each time, the CPU seconds per GiB each side spent (this process sending; the sink or the
daemon receiving, until its ``verified``): where both sides share a few cores, their sum sets the pace.

Runs are interleaved (plain, protected, plain, ...); medians. Target: protected >= 0.8 of plain.

    python bench/peer_channel.py --gib 1 --files 8 --runs 5 [--connections 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import capped_link, machine, median, write_results
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
from peer_rescue import make_checkpoint, peer_receiver, plain_copy, timed_handoff

from spotguard.harness import Vm
from spotguard.manifest import load_manifest
from spotguard.peer import workers
from spotguard.peer.records import MAX_PLAINTEXT
from spotguard.peer.wire import parse_address


def capped_flows(step_dir: Path, receiver: Vm, bucket: str, cap_mb_s: float, flows: int, runs: int) -> list[float]:
    """Seconds of each handoff over ``flows`` connections, each capped to ``cap_mb_s`` by a relay
    (a small receive buffer each, so that it paces from the first bytes, as a link does)."""
    address = receiver.status()["peers"]["listen"]
    with capped_link(address, cap_mb_s * 1e6, buffer_bytes=256 * 1024) as relay:
        where = parse_address(relay.removeprefix("http://"))
        return [round(timed_handoff(step_dir, receiver, where, bucket, flows), 3) for _ in range(runs)]


def cipher_rates(runs: int) -> dict[str, float]:
    """MB/s of one core sealing / opening 64 KiB records (the channel's largest), medians of ``runs``."""
    record = os.urandom(MAX_PLAINTEXT)
    count = 2000
    rates: dict[str, float] = {}
    for name, aead in (("aesgcm", AESGCM(os.urandom(32))), ("chachapoly", ChaCha20Poly1305(os.urandom(32)))):
        sealed = aead.encrypt(b"\0" * 12, record, None)
        out = bytearray(len(record))
        for what in ("seal", "open"):
            samples = []
            for _ in range(runs):
                started = time.perf_counter()
                for n in range(count):
                    nonce = n.to_bytes(12, "big") if what == "seal" else b"\0" * 12
                    if what == "seal":
                        aead.encrypt(nonce, record, None)
                    else:
                        aead.decrypt_into(nonce, sealed, None, out)
                samples.append(count * len(record) / (time.perf_counter() - started) / 1e6)
            rates[f"{name}_{what}"] = median(samples)
    return rates


def main() -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--gib", type=float, default=1.0)
    cli.add_argument("--files", type=int, default=8)
    cli.add_argument("--runs", type=int, default=5)
    cli.add_argument("--connections", type=int, default=4, help="connections of the plain copy and of the handoff")
    cli.add_argument(
        "--flow-cap-mb-s", type=float, help="also hand over through a relay capping each connection (MB/s)"
    )
    args = cli.parse_args()
    ciphers = cipher_rates(args.runs)
    for name, rate in ciphers.items():
        print(f"cipher {name:16s} {rate:8.0f} MB/s (one core, 64 KiB records)")
    with tempfile.TemporaryDirectory(prefix="spotguard-peer-channel-") as tmp:
        scratch = Path(tmp)
        step_dir = make_checkpoint(scratch / "sender", args.gib, args.files)
        nbytes = load_manifest(step_dir).total_bytes
        times: dict[str, list[float]] = {"plain": [], "protected": [], "protected-1-flow": []}
        cpu: dict[str, list[dict[str, float]]] = {name: [] for name in times}
        with peer_receiver(scratch) as (receiver, bucket):
            where = parse_address(receiver.status()["peers"]["listen"])
            if args.flow_cap_mb_s:
                capped = capped_flows(step_dir, receiver, bucket, args.flow_cap_mb_s, args.connections, args.runs)
            for _ in range(args.runs):
                cpu["plain"].append({})
                times["plain"].append(plain_copy(step_dir, scratch, args.connections, cpu["plain"][-1]))
                for name, flows in (("protected", args.connections), ("protected-1-flow", 1)):
                    cpu[name].append({})
                    times[name].append(timed_handoff(step_dir, receiver, where, bucket, flows, cpu[name][-1]))
    rates = {name: nbytes / median(samples) / 1e6 for name, samples in times.items() if samples}
    ratio = rates["protected"] / rates["plain"]
    gib = nbytes / 2**30
    cpu_per_gib = {
        name: {side: median([run[side] for run in runs]) / gib for side in ("sender", "receiver")}
        for name, runs in cpu.items()
    }
    by_workers = {
        name: {side: median([run[side] for run in runs]) for side in ("sent_by_workers", "received_by_workers")}
        for name, runs in cpu.items()
        if name != "plain"
    }
    for name, samples in times.items():
        runs = [round(s, 2) for s in samples]
        per_gib = cpu_per_gib[name]
        shares = by_workers.get(name)
        carried = (
            f"  frames by workers: sent {shares['sent_by_workers']:.0%} received {shares['received_by_workers']:.0%}"
            if shares
            else ""
        )
        print(
            f"{name:16s} median {median(samples):6.2f} s  {rates[name]:7.0f} MB/s  "
            f"CPU-s/GiB sender {per_gib['sender']:.2f} receiver {per_gib['receiver']:.2f}  runs {runs}{carried}"
        )
    print(f"protected ({args.connections} flows) / plain throughput: {ratio:.2f} (target >= 0.80)")
    pool = workers.pool()  # the receiving daemon's follows the same rule on this machine
    print(f"workers: up to {pool.size} per process, each with a second thread: {'yes' if pool.beside else 'no'}")
    print(f"protected (1 flow) / plain throughput: {rates['protected-1-flow'] / rates['plain']:.2f}")
    report: dict[str, Any] = {"machine": machine(), "bytes": nbytes, "files": args.files, "seconds": times}
    report.update(connections=args.connections, rates_mb_s=rates, ratio=ratio, cipher_mb_s=ciphers)
    report.update(cpu_s_per_gib=cpu_per_gib, frames_by_workers=by_workers)
    if args.flow_cap_mb_s:
        link = args.connections * args.flow_cap_mb_s
        capped_rate = nbytes / median(capped) / 1e6
        print(
            f"capped link, {args.connections} flows x {args.flow_cap_mb_s:g} MB/s: median {median(capped):.2f} s "
            f"{capped_rate:.1f} MB/s = {capped_rate / link:.2f} of the link (target >= 0.80), runs {capped}"
        )
        report.update(capped_seconds=capped, capped_mb_s=capped_rate, capped_share=capped_rate / link)
    print(f"results: {write_results('peer_channel', report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
