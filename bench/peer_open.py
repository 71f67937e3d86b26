"""One protected flow's receiving side alone: how much CPU a peer worker's steps take to open 8 MiB
data frames and land them in a file, in two orders, the sealed frames coming from another process.

- whole: the frame's records opened into an 8 MiB payload buffer, then the buffer written with one
  ``pwrite`` and its CRC32C taken (a receiving worker's ``receive`` job, then its ``write`` job);
- batches: each batch of records written and its CRC32C taken as soon as it is opened, while its
  bytes are still in the cache (a variant, not what the daemon does; BENCHMARKS.md says why).

Both use the daemon's own ``open_payload`` and ``write_at``, in turn in one thread (a worker's way on
8 cores or fewer). The sender seals its frames once and sends them again and again, so that its
own CPU leaves the receiver's cores alone as far as it can. Reported: MB/s and the receiving
process's CPU seconds per GiB; medians of interleaved, rotated runs. ``--dir`` names the disk the
file lands on (``/dev/shm`` for the CPU-side ceiling).

    python bench/peer_open.py --gib 1 --runs 7 [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from common import machine, median, process_cpu, write_results

from spotguard.crc32c import crc32c_combine, crc32c_hex_to_int, crc32c_of_bytes
from spotguard.peer import noise
from spotguard.peer.files import write_at
from spotguard.peer.records import (
    BATCH_RECORDS,
    MAX_PLAINTEXT,
    batch_buffers,
    open_payload,
    records_of,
    seal_frame,
    sealed_size,
)
from spotguard.peer.sockio import HandedSocket
from spotguard.peer.wire import SEND_CHUNK

KEY = bytes(range(32))
BATCH = BATCH_RECORDS * MAX_PLAINTEXT  # a batch's plaintext bytes: a sub-payload of whole records
Receive = Callable[[memoryview], None]
Land = Callable[[noise.CipherState, tuple[bytearray, bytearray], Receive, memoryview, Path, int], int]


def send_frames(connection: socket.socket, theirs: socket.socket, frames: int) -> None:
    """Seal one 8 MiB frame of random bytes (nonces from 0) and send its plaintext's CRC32C (4 bytes),
    then send the frame ``frames`` times at each byte that comes in, until the connection ends."""
    theirs.close()  # or the receiver's end stays open here too, and no end of file ever comes
    plaintext = os.urandom(SEND_CHUNK)
    connection.sendall(crc32c_hex_to_int(crc32c_of_bytes(plaintext)).to_bytes(4, "big"))
    with tempfile.TemporaryFile() as source:
        source.write(plaintext)
        source.flush()
        out = bytearray(sealed_size(0, SEND_CHUNK))
        sealed = seal_frame(noise.CipherState(KEY), b"", source.fileno(), 0, SEND_CHUNK, out=out)
    while connection.recv(1):
        for _ in range(frames):
            connection.sendall(sealed)


def landing_by(piece: int) -> Land:
    """Open a frame ``piece`` bytes at a time, writing each piece (and taking its CRC32C) as soon as
    it is opened. A payload's first k full records are laid out on the wire as a payload of k full
    records, so the frame is opened as one payload after another, with the nonces running on."""

    def land(
        cipher: noise.CipherState,
        batches: tuple[bytearray, bytearray],
        receive: Receive,
        payload: memoryview,
        path: Path,
        offset: int,
    ) -> int:
        crc = 0
        for start in range(0, len(payload), piece):
            part = payload[start : start + piece]
            open_payload(cipher, batches, receive, b"", part)
            crc = crc32c_combine(crc, write_at(path, offset + start, part), len(part))
        return crc

    return land


def one_run(connection: socket.socket, land: Land, frames: int, target: Path, crc: int) -> tuple[float, float]:
    """Seconds and this process's CPU seconds to receive and land ``frames`` frames in ``target``
    (each one's CRC32C checked against the sender's ``crc``)."""
    batches = batch_buffers()
    payload = memoryview(bytearray(SEND_CHUNK))
    handed = HandedSocket(connection.fileno())  # a worker's receive loop, on a duplicate of the socket

    def receive(chunk: memoryview) -> None:
        handed.recv_exactly(chunk, 60.0)

    target.unlink(missing_ok=True)
    connection.sendall(b"g")
    cpu, started = process_cpu(), time.perf_counter()
    try:
        for frame in range(frames):
            cipher = noise.CipherState(KEY)  # the sender's frame is sealed with nonces from 0 each time
            landed = land(cipher, batches, receive, payload, target, frame * SEND_CHUNK)
            if landed != crc or cipher.n != records_of(SEND_CHUNK):
                raise RuntimeError(
                    f"frame {frame}: CRC32C {landed:08x} after {cipher.n} records, the sender's {crc:08x}"
                )
    finally:
        handed.close()
    seconds, cpu = time.perf_counter() - started, process_cpu() - cpu
    target.unlink()
    return seconds, cpu


def main() -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--gib", type=float, default=1.0)
    cli.add_argument("--runs", type=int, default=7)
    cli.add_argument("--dir", type=Path, default=None, help="where the frames land (default: a temp dir)")
    args = cli.parse_args()
    frames = max(1, int(args.gib * 2**30) // SEND_CHUNK)
    methods = {"whole": landing_by(SEND_CHUNK), "batches": landing_by(BATCH)}
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in methods}
    ours, theirs = socket.socketpair()
    sender = multiprocessing.get_context("fork").Process(target=send_frames, args=(theirs, ours, frames))
    sender.start()
    theirs.close()
    try:
        crc = int.from_bytes(ours.recv(4, socket.MSG_WAITALL), "big")
        with tempfile.TemporaryDirectory(prefix="spotguard-peer-open-", dir=args.dir) as tmp:
            target = Path(tmp) / "model.pt"
            for land in methods.values():
                one_run(ours, land, frames, target, crc)  # warm: code paths taken, page cache in use
            names = list(methods)
            for run in range(args.runs):
                for name in names[run % len(names) :] + names[: run % len(names)]:
                    samples[name].append(one_run(ours, methods[name], frames, target, crc))
    finally:
        ours.close()
        sender.join()
    gib = frames * SEND_CHUNK / 2**30
    where = args.dir or Path(tempfile.gettempdir())
    print(f"{gib:.2f} GiB in 8 MiB frames landing in {where}; {args.runs} runs, medians")
    print("| method | MB/s | CPU-s/GiB (receiver) | range of CPU-s/GiB |")
    print("|---|---:|---:|---|")
    report: dict[str, object] = {"machine": machine(), "gib": gib, "dir": str(where), "samples": samples}
    for name, runs in samples.items():
        rate = frames * SEND_CHUNK / median([s for s, _ in runs]) / 1e6
        cpus = sorted(c / gib for _, c in runs)
        print(f"| {name} | {rate:,.0f} | {median(cpus):.3f} | {cpus[0]:.2f}-{cpus[-1]:.2f} |")
    print(f"results: {write_results('peer_open', report)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
