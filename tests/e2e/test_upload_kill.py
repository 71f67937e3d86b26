"""Acceptance: the daemon SIGKILLed at random moments while it uploads a ~128 MiB checkpoint to S3
(moto) never lets the bucket show a manifest whose files are not all there, intact; after the last
restart the checkpoint completes, and no multipart upload is left open.

The daemon reaches moto through ``Uplink``, a relay capping the upload direction at 40 MiB/s in
total (an instance's uplink, instead of loopback speed on a shared 2-core box), so that the upload
takes a steady ~3.5 s. Kill points are random: a seeded RNG over the first half of what is left to
send, in the bytes the relay carried up for this daemon's connections. Progress is per file:
aborted multipart parts are not resumed, and with every file advancing together over the shared
link, nothing completes before the end, so every kill lands inside the upload. Not later: what the
killed daemon had already handed to its sockets still crosses the link after it died, as on a real
one. Kill points were once a share of an upload time measured beforehand; on a loaded box that
measurement ran long once, and the first kill came after every file was in. Everything is
synchronised by polling with deadlines.
"""

from __future__ import annotations

import base64
import json
import logging
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch

from spotguard import Guard
from spotguard.harness import Vm, bucket_status, wait_for
from spotguard.manifest import MANIFEST, load_manifest
from spotguard.storage import open_storage
from spotguard.storage.checkpoints import verify_remote
from tests.servers import FAKE_AWS_ENV, S3Server, moto_s3

MiB = 1 << 20
KILLS = 10
FILES = 4
FILE_BYTES = 32 * MiB
UPLINK_BYTES_S = 40 * MiB
PREFIX = "run1"


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto logs every request otherwise
    with moto_s3() as server:
        monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
        for key, value in {**FAKE_AWS_ENV, "AWS_ENDPOINT_URL_S3": server.endpoint_url}.items():
            monkeypatch.setenv(key, value)
        yield server


@pytest.fixture
def bucket(s3: S3Server) -> str:
    """Overrides conftest's file:// bucket, so that ``vm_factory`` daemons upload to moto."""
    return f"s3://{s3.bucket}/{PREFIX}"


class Uplink:
    """A TCP relay on 127.0.0.1: client-to-server bytes of all connections together are capped at
    ``rate`` bytes/s; answers come back at loopback speed. A client killed mid-request just goes
    away, as it would from a real link. It counts what it carried up per connection, by when the
    connection came (:meth:`sent_since`)."""

    def __init__(self, upstream: str, rate: float) -> None:
        host, _, port = upstream.removeprefix("http://").partition(":")
        self.upstream = (host, int(port))
        self.rate = rate
        self._next = time.monotonic()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = []
        self._carried: list[list[float]] = []  # per connection: [monotonic time accepted, bytes carried up]
        threading.Thread(target=self._accept, name="uplink", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            carried = [time.monotonic(), 0.0]
            server = socket.create_connection(self.upstream)
            self._sockets += [client, server]
            with self._lock:
                self._carried.append(carried)
            threading.Thread(target=self._pump, args=(client, server, carried), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, None), daemon=True).start()

    def sent_since(self, moment: float) -> float:
        """Bytes carried up on the connections accepted since ``moment`` (monotonic): one daemon's,
        not what its killed predecessor's connections still drain."""
        with self._lock:
            return sum(sent for accepted, sent in self._carried if accepted >= moment)

    def _pump(self, source: socket.socket, sink: socket.socket, carried: list[float] | None) -> None:
        """``carried``: the connection's count, for the capped direction (client to server)."""
        try:
            while data := source.recv(256 * 1024):
                if carried is not None:
                    self._take(len(data))
                sink.sendall(data)
                if carried is not None:
                    with self._lock:
                        carried[1] += len(data)
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                sock.close()

    def _take(self, count: int) -> None:
        # A shared schedule: each chunk may leave only once the link has carried the ones before it.
        with self._lock:
            now = time.monotonic()
            self._next = max(self._next, now) + count / self.rate
            wait = self._next - now - count / self.rate
        if wait > 0:
            time.sleep(wait)  # pacing the link, not synchronising the test

    def close(self) -> None:
        self._listener.close()
        for sock in self._sockets:
            sock.close()


class ManifestWatcher(threading.Thread):
    """Polls the bucket until stopped; records every moment a manifest is visible while one of the
    files it lists is missing, has another size, or (HeadObject with ChecksumMode) another CRC32C."""

    def __init__(self, server: S3Server) -> None:
        super().__init__(name="manifest-watcher", daemon=True)
        self.server = server
        self.client = boto3.client("s3", endpoint_url=server.endpoint_url, region_name="us-east-1")
        self.stop = threading.Event()
        self.polls = 0
        self.manifests_seen = 0
        self.crc_checked = 0
        self.violations: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self._poll()
                self.polls += 1
                self.stop.wait(0.05)
        except BaseException as exc:  # reported by the test: a dead watcher proves nothing
            self.error = exc
        finally:
            self.client.close()

    def _poll(self) -> None:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.server.bucket, Prefix=f"{PREFIX}/")
        keys = [obj["Key"] for page in pages for obj in page.get("Contents", [])]
        for key in keys:
            if not key.endswith(f"/{MANIFEST}"):
                continue
            body = self.client.get_object(Bucket=self.server.bucket, Key=key)["Body"]
            manifest = json.loads(body.read())
            body.close()
            self.manifests_seen += 1
            base = key[: -len(MANIFEST)]
            for rel, entry in manifest["files"].items():
                self._check(base + rel, entry)

    def _check(self, key: str, entry: dict[str, Any]) -> None:
        try:
            head = self.client.head_object(Bucket=self.server.bucket, Key=key, ChecksumMode="ENABLED")
        except self.client.exceptions.ClientError as exc:
            if exc.response["Error"]["Code"] in ("404", "NoSuchKey", "NotFound"):
                self.violations.append(f"{key}: listed in a visible manifest but missing")
                return
            raise
        if head["ContentLength"] != entry["size"]:
            self.violations.append(f"{key}: size {head['ContentLength']}, manifest says {entry['size']}")
        if "ChecksumCRC32C" in head and head.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT":
            crc = base64.b64decode(head["ChecksumCRC32C"]).hex()
            self.crc_checked += 1
            if crc != entry["crc32c"]:
                self.violations.append(f"{key}: crc32c {crc}, manifest says {entry['crc32c']}")


def open_uploads(server: S3Server) -> list[str]:
    client = boto3.client("s3", endpoint_url=server.endpoint_url, region_name="us-east-1")
    try:
        resp = client.list_multipart_uploads(Bucket=server.bucket, Prefix=f"{PREFIX}/")
        return [upload["Key"] for upload in resp.get("Uploads", [])]
    finally:
        client.close()


def data_bytes_in_bucket(s3: S3Server, name: str) -> int:
    """Bytes of the checkpoint's data objects already in the bucket (what a restart need not send)."""
    client = boto3.client("s3", endpoint_url=s3.endpoint_url, region_name="us-east-1")
    try:
        resp = client.list_objects_v2(Bucket=s3.bucket, Prefix=f"{PREFIX}/{name}/")
        return sum(obj["Size"] for obj in resp.get("Contents", []) if not obj["Key"].endswith(MANIFEST))
    finally:
        client.close()


def upload_started(vm: Vm, bucket: str, name: str) -> bool:
    return vm.status()["uploads"]["current"] is not None or bucket_status(bucket, name) == "complete"


@pytest.mark.slow
def test_daemon_sigkilled_mid_upload_never_exposes_a_partial_checkpoint_and_finishes_after_restart(
    s3: S3Server, bucket: str, vm_factory: Callable[..., Vm], tmp_path: Path
) -> None:
    vm = vm_factory("vm", start=False)
    generator = torch.Generator().manual_seed(5)
    state = {f"shard{i}": torch.randn(FILE_BYTES // 4, generator=generator) for i in range(FILES)}
    guard = Guard(checkpoint_dir=vm.root, socket=tmp_path / "none.sock", handle_sigterm=False)
    try:
        step_dir = guard.save(state, 7, reason="urgent")  # committed locally; no daemon yet
    finally:
        guard.close()
    del state
    manifest = load_manifest(step_dir)
    assert manifest.total_bytes >= FILES * FILE_BYTES and len(manifest.files) > FILES
    uplink = Uplink(s3.endpoint_url, UPLINK_BYTES_S)
    env = {"AWS_ENDPOINT_URL_S3": uplink.url}  # the daemon only; checks here go to moto directly
    watcher = ManifestWatcher(s3)
    try:
        watcher.start()
        rng = random.Random(20261122)
        kills: list[tuple[float, float, int, bool]] = []  # (fraction left, share sent, open uploads, committed)
        for kill in range(KILLS):
            # Files already in the bucket are not sent again: aim inside what is left to send.
            left = 1 - data_bytes_in_bucket(s3, step_dir.name) / manifest.total_bytes
            started = time.monotonic()
            vm.start_daemon(env=env)  # returns once it answers: warmed, its predecessor's uploads aborted
            wait_for(lambda: upload_started(vm, bucket, step_dir.name), 30, f"restart {kill}: the upload to start")
            share = rng.uniform(0.0, 0.5)  # the kill point: random, in bytes this daemon got through the link
            # Reached before any commit: the commit needs all of what was left carried on these connections.
            target = share * left * manifest.total_bytes
            wait_for(
                lambda t=target, s=started: uplink.sent_since(s) >= t, 60, f"restart {kill}: {share:.0%} of the rest"
            )
            vm.kill_daemon()
            kills.append(
                (
                    round(left, 3),
                    round(share, 3),
                    len(open_uploads(s3)),
                    bucket_status(bucket, step_dir.name) == "complete",
                )
            )

        vm.start_daemon(env=env)
        wait_for(lambda: bucket_status(bucket, step_dir.name) == "complete", 120, "the checkpoint to complete at last")
        wait_for(lambda: watcher.manifests_seen > 0, 10, "the watcher to see the committed manifest")
    finally:
        watcher.stop.set()
        if watcher.is_alive():
            watcher.join(timeout=30)
        vm.kill_daemon()
        uplink.close()

    assert watcher.error is None, repr(watcher.error)
    assert watcher.violations == [], watcher.violations[:10]
    assert watcher.polls > KILLS and watcher.crc_checked >= len(manifest.files)
    # Every kill landed inside the upload (most with multipart uploads open); all were cleaned up.
    assert not any(committed for *_, committed in kills), kills
    assert sum(1 for _, _, opened, _ in kills if opened) >= KILLS // 2, kills
    assert open_uploads(s3) == []
    storage = open_storage(bucket)
    try:
        assert verify_remote(storage, step_dir.name) == []
    finally:
        storage.close()
