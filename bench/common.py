"""Shared parts of the bucket benchmarks: a moto server in its own process, the state, the tables.

moto runs in a separate process (``python -m moto.server``, threaded werkzeug) so that no client
measured here shares a GIL with the server; every client reaches it over real HTTP on 127.0.0.1.
moto keeps objects in memory, so benchmarks delete what they uploaded after each run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import torch
from botocore.config import Config

from spotguard.harness import worker_pids

RESULTS = Path(__file__).parent / "results"
MiB = 1 << 20
FAKE_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass(frozen=True)
class Moto:
    endpoint_url: str
    bucket: str

    def client(self, **config: Any) -> Any:
        return boto3.client("s3", endpoint_url=self.endpoint_url, config=Config(**config) if config else None)

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def empty(self, prefix: str = "") -> None:
        """Delete every object (and open multipart upload) under ``prefix``: moto holds them in RAM."""
        client = self.client()
        try:
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
                if keys:
                    client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})
            uploads = client.list_multipart_uploads(Bucket=self.bucket, Prefix=prefix).get("Uploads", [])
            for upload in uploads:
                client.abort_multipart_upload(Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"])
        finally:
            client.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def moto_process(*, pin: bool = False) -> Iterator[Moto]:
    """moto in server mode in a child process, with a fresh bucket; fake credentials in os.environ.

    moto keeps objects in RAM: by default it spills every object and part over 5 MiB to a temporary
    file on this machine's disk (written again when parts are joined), disk I/O that a real store
    does not do on the VM and that would compete with the checkpoint being written locally.

    ``pin``: moto gets CPU 0 to itself and this process (with every child it starts after: trainer,
    daemon, relay) the other CPUs, as a remote store would not share the VM's CPUs."""
    os.environ.update(FAKE_AWS_ENV)
    os.environ.pop("AWS_ENDPOINT_URL", None)
    port = _free_port()
    cpus = sorted(os.sched_getaffinity(0))
    if pin and len(cpus) < 2:
        raise SystemExit("--pin-server needs at least 2 CPUs")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(1 << 40)},
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus[:1])) if pin else None,  # noqa: PLW1509
    )
    if pin:
        os.sched_setaffinity(0, cpus[1:])
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.05)
        bucket = f"bench-{uuid.uuid4().hex[:10]}"
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket=bucket)
        client.close()
        os.environ["AWS_ENDPOINT_URL_S3"] = endpoint
        yield Moto(endpoint, bucket)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if pin:
            os.sched_setaffinity(0, cpus)


def make_state(gib: float, tensors: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    """``tensors`` float32 tensors of random data, ``gib`` GiB together (random: nothing compresses)."""
    per = int(gib * (1 << 30) / tensors / 4)
    generator = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(per, generator=generator) for i in range(tensors)}


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def process_cpu(pid: int | None = None) -> float:
    """CPU seconds (user + system) used so far by the process ``pid`` (this one by default) and the
    peer tier's worker processes it runs now (spotguard/peer/workers.py); a child that has exited but
    was not yet waited for still answers."""
    pid = pid or os.getpid()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    seconds = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    for child in worker_pids(pid):
        with contextlib.suppress(OSError):
            seconds += process_cpu(child)
    return seconds


def median(samples: list[float]) -> float:
    return float(statistics.median(samples))


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "boto3": boto3.__version__,
        "load_avg_at_start": os.getloadavg(),
    }


def table(rows: list[tuple[str, list[float]]], nbytes: int, reference: str | None = None) -> list[str]:
    """Median/min/max seconds, MB/s at the median, and the time relative to ``reference``."""
    ref = next((median(s) for name, s in rows if name == reference), None)
    width = max(len(name) for name, _ in rows)
    lines = [
        f"| {'method':<{width}} | median s | min s | max s |   MB/s | vs ref |",
        f"|{'-' * (width + 2)}|---:|---:|---:|---:|---:|",
    ]
    for name, samples in rows:
        med = median(samples)
        rel = f"{med / ref:.2f}" if ref else "-"
        lines.append(
            f"| {name:<{width}} | {med:8.2f} | {min(samples):5.2f} | {max(samples):5.2f} | "
            f"{nbytes / med / 1e6:6.0f} | {rel:>6} |"
        )
    return lines


def write_results(name: str, report: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(report, indent=1))
    return path


# --- a link whose every connection is capped, as on a real network path to S3 -----------------


@contextlib.contextmanager
def capped_link(
    upstream: str, per_connection_bytes_s: float, *, downloads: bool = False, buffer_bytes: int = 0
) -> Iterator[str]:
    """A TCP relay in a child process: each connection's client-to-server bytes are paced at
    ``per_connection_bytes_s`` (uploads; ``downloads=True``: server-to-client bytes instead), the
    other direction passes at full speed. ``buffer_bytes``: each paced connection's receive buffer
    (0: the kernel's, megabytes on loopback: a burst passes before the pacing shows). Yields its
    ``http://`` URL."""
    direction = "down" if downloads else "up"
    proc = subprocess.Popen(
        [sys.executable, __file__, "relay", upstream, str(per_connection_bytes_s), direction, str(buffer_bytes)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        yield proc.stdout.readline().strip()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _relay_main(upstream: str, rate: float, direction: str, buffer_bytes: int) -> None:
    host, _, port = upstream.removeprefix("http://").partition(":")
    listener = socket.create_server(("127.0.0.1", 0))
    if buffer_bytes:  # accepted connections take it from the listener
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
    print(f"http://127.0.0.1:{listener.getsockname()[1]}", flush=True)

    def pump(source: socket.socket, sink: socket.socket, paced: bool) -> None:
        started, sent = time.monotonic(), 0
        try:
            while data := source.recv(64 * 1024):
                if paced:
                    sent += len(data)
                    ahead = started + sent / rate - time.monotonic()
                    if ahead > 0:
                        time.sleep(ahead)  # pacing this connection to its cap
                sink.sendall(data)
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            source.close()
            sink.close()

    while True:
        client, _ = listener.accept()
        server = socket.create_connection((host, int(port)))
        up = direction == "up"
        threading.Thread(target=pump, args=(client, server, up), daemon=True).start()
        threading.Thread(target=pump, args=(server, client, not up), daemon=True).start()


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description="helpers for the benchmarks")
    cli.add_argument("command", choices=["relay"])
    cli.add_argument("upstream")
    cli.add_argument("rate", type=float, help="bytes per second per connection")
    cli.add_argument("direction", choices=["up", "down"], help="up: client to server is paced; down: the answers")
    cli.add_argument("buffer", type=int, nargs="?", default=0, help="receive buffer of each connection (0: the OS's)")
    parsed = cli.parse_args()
    _relay_main(parsed.upstream, parsed.rate, parsed.direction, parsed.buffer)
