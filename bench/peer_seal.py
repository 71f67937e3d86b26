"""One protected flow's sending side alone: how fast a peer worker seals and sends 8 MiB data frames
of a checkpoint file, against ``sendfile`` of the same bytes, each to a process that discards them.

- plain: ``socket.sendfile`` of the file (the plain copy's sender in bench/peer_channel.py);
- read: each frame read a batch at a time into a buffer (``preadv``) and sealed from there into its
  records' places, sent (the daemon's in-process way);
- mapped: each frame sealed from the file's pages through a read-only mapping, each batch of records
  sealed into one of two batch buffers in turn and sent as soon as it is sealed (a worker's way);
- mapped-frame: the same, but each batch sealed at its place in one frame-sized buffer (a worker's
  way before the two batch buffers: 8 MiB that does not stay in the CPU's cache);
- whole: the whole frame sealed before any of it is sent (``--beside`` has no such row).

``--beside`` sends a frame's sealed batches from a second thread while the next is sealed, as
workers do on more than 8 cores. The file is in the page cache (written just before, as an urgent
checkpoint is). Reported: MB/s and the sending process's CPU seconds per GiB (the sink's CPU is its
own process's); medians of interleaved, rotated runs.

    python bench/peer_seal.py --gib 1 --runs 7 [--beside]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import multiprocessing
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from common import machine, median, process_cpu, write_results

from spotguard.peer import noise
from spotguard.peer.records import (
    _sealed_groups,
    batch_buffers,
    layout,
    seal_batches,
    seal_frame,
    sealed_size,
)
from spotguard.peer.wire import SEND_CHUNK

HEADER = b'{"t":"data","path":"model.pt","offset":0}'


def discard(connection: socket.socket, theirs: socket.socket) -> None:
    theirs.close()  # or the sender's end stays open here, and no end of file ever comes
    buffer = bytearray(1 << 20)
    while connection.recv_into(buffer):
        pass


def send_sealed(
    mapped: bool, beside: concurrent.futures.Executor | None, *, whole: bool = False, in_frame: bool = False
) -> Callable[[socket.socket, int, int], None]:
    def send(connection: socket.socket, fd: int, size: int) -> None:
        cipher = noise.CipherState(os.urandom(32))
        out = bytearray(sealed_size(len(HEADER), SEND_CHUNK))
        frame = memoryview(out)
        buffers = batch_buffers()

        def at_its_place(_: int, at: int, size: int) -> memoryview:
            return frame[at : at + size]

        for offset in range(0, size, SEND_CHUNK):
            length = min(SEND_CHUNK, size - offset)
            if whole:
                connection.sendall(seal_frame(cipher, HEADER, fd, offset, length, out=out, mapped=mapped))
                continue
            if in_frame:
                records = list(layout([len(HEADER), length]))
                batches = _sealed_groups(cipher, HEADER, fd, offset, records, place=at_its_place, mapped=mapped)
            else:
                batches = seal_batches(cipher, HEADER, fd, offset, length, batches=buffers, mapped=mapped)
            going: concurrent.futures.Future[None] | None = None
            for sealed in batches:
                if beside is None:
                    connection.sendall(sealed)
                else:
                    if going is not None:
                        going.result()
                    going = beside.submit(connection.sendall, sealed)
            if going is not None:
                going.result()

    return send


def send_plain(connection: socket.socket, fd: int, size: int) -> None:
    connection.sendfile(os.fdopen(os.dup(fd), "rb"), 0, size)


def one_run(send: Callable[[socket.socket, int, int], None], fd: int, size: int) -> tuple[float, float]:
    """Seconds and this process's CPU seconds to send ``size`` bytes of ``fd`` to a fresh sink."""
    ours, theirs = socket.socketpair()
    sink = multiprocessing.get_context("fork").Process(target=discard, args=(theirs, ours))
    sink.start()
    theirs.close()
    try:
        cpu, started = process_cpu(), time.perf_counter()
        send(ours, fd, size)
        ours.shutdown(socket.SHUT_WR)
        seconds, cpu = time.perf_counter() - started, process_cpu() - cpu
    finally:
        ours.close()
        sink.join()
    return seconds, cpu


def main() -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--gib", type=float, default=1.0)
    cli.add_argument("--runs", type=int, default=7)
    cli.add_argument("--beside", action="store_true", help="send each batch from a second thread")
    cli.add_argument("--dir", type=Path, default=None, help="where the file is written (default: a temp dir)")
    args = cli.parse_args()
    size = int(args.gib * 2**30) // SEND_CHUNK * SEND_CHUNK
    with (
        tempfile.TemporaryDirectory(prefix="spotguard-peer-seal-", dir=args.dir) as tmp,
        concurrent.futures.ThreadPoolExecutor(1) if args.beside else contextlib.nullcontext() as beside,
    ):
        path = Path(tmp) / "model.pt"
        with open(path, "wb") as file:
            for _ in range(size // SEND_CHUNK):
                file.write(os.urandom(SEND_CHUNK))
        fd = os.open(path, os.O_RDONLY)
        methods = {
            "plain": send_plain,
            "read": send_sealed(False, beside),
            "mapped": send_sealed(True, beside),
            "mapped-frame": send_sealed(True, beside, in_frame=True),
        }
        if beside is None:
            methods["whole"] = send_sealed(True, None, whole=True)
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in methods}
        try:
            for send in methods.values():
                one_run(send, fd, min(size, 64 * SEND_CHUNK))  # warm: pages cached, code paths taken
            names = list(methods)
            for run in range(args.runs):
                for name in names[run % len(names) :] + names[: run % len(names)]:
                    samples[name].append(one_run(methods[name], fd, size))
        finally:
            os.close(fd)
    gib = size / 2**30
    print(f"{gib:.2f} GiB, 8 MiB frames, {'beside' if args.beside else 'in turn'}; {args.runs} runs, medians")
    print("| method | MB/s | CPU-s/GiB (sender) | of plain's MB/s |")
    print("|---|---:|---:|---:|")
    plain_rate = size / median([s for s, _ in samples["plain"]]) / 1e6
    report: dict[str, object] = {"machine": machine(), "gib": gib, "beside": args.beside, "samples": samples}
    for name, runs in samples.items():
        rate = size / median([s for s, _ in runs]) / 1e6
        cpu = median([c for _, c in runs]) / gib
        print(f"| {name} | {rate:,.0f} | {cpu:.3f} | {rate / plain_rate:.2f} |")
    print(f"results: {write_results('peer_seal', report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
