"""An S3-compatible store whose CRC32C disagrees with the bytes: moto without its ``crc32c`` extra,
in a process of its own (it answers a plain CRC32 as the CRC32C of every multipart upload).

A notice's checkpoint still commits, in Content-MD5 mode after a bounded number of CRC32C attempts
and one warning; ``spotguard verify`` recomputes CRC32C from the bytes and passes; ``checksum =
crc32c`` fails clearly and is not retried forever; ``checksum = md5`` sends a Content-MD5 per request.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from spotguard import Guard
from spotguard.crc32c import crc32c_of_file
from spotguard.daemon.uploader import Uploader
from spotguard.harness import Vm, wait_for
from spotguard.manifest import load_manifest
from spotguard.storage import ChecksumMismatch
from spotguard.storage.s3 import S3Storage
from tests.checkpoints import write_checkpoint
from tests.servers import FAKE_AWS_ENV, S3Server, moto_s3, moto_s3_wrong_crc32c

MiB = 1 << 20
FALLBACK_WARNING = "verifying uploads to it with Content-MD5 from now on"
RETRY_LINE = "checksum disagreement"


@pytest.fixture(scope="module")
def wrong_store() -> Iterator[S3Server]:
    with moto_s3_wrong_crc32c() as server:
        yield server


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> Callable[[S3Server], None]:
    """Point this process (and the daemons and CLI commands it starts) at one store."""

    def point(server: S3Server) -> None:
        monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
        for key, value in FAKE_AWS_ENV.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", server.endpoint_url)

    return point


@pytest.fixture
def bucket(wrong_store: S3Server, aws_env: Callable[[S3Server], None]) -> str:
    """Overrides conftest's file:// bucket: ``vm_factory`` daemons upload to the wrong-CRC32C store."""
    aws_env(wrong_store)
    return f"s3://{wrong_store.bucket}/run-{uuid.uuid4().hex[:8]}"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spotguard", *args], capture_output=True, text=True, timeout=300, check=False
    )


def test_the_store_really_answers_a_wrong_crc32c_for_a_multipart_upload(
    wrong_store: S3Server, aws_env: Callable[[S3Server], None]
) -> None:
    aws_env(wrong_store)
    storage = S3Storage(f"s3://{wrong_store.bucket}/probe")
    try:
        probe = storage.probe_checksum(f"p-{uuid.uuid4().hex[:8]}")
    finally:
        storage.close()
    assert probe.answered is not None and probe.answered != probe.sent and not probe.agrees


def test_a_notices_checkpoint_commits_in_md5_fallback_and_verifies_end_to_end(
    vm_factory: Callable[..., Vm], bucket: str, tmp_path: Path
) -> None:
    vm = vm_factory("vm-crc")
    # 20 MiB: a multipart upload (16 MiB parts), the kind this store answers wrongly; plus small files.
    state = {"big": torch.randn(5 * MiB, generator=torch.Generator().manual_seed(5)), "small": torch.arange(1000)}
    guard = Guard(checkpoint_dir=vm.root, socket=vm.socket, handle_sigterm=False)
    try:
        wait_for(guard.client.connected.is_set, 10, "the hook to connect to the daemon")
        drill = cli("drill", "--socket", str(vm.socket), "--deadline", "60")
        assert drill.returncode == 0, drill.stderr
        wait_for(lambda: guard.should_checkpoint(7), 10, "the drill to reach the hook")
        step_dir = guard.save(state, 7)
        assert guard.stop_requested
    finally:
        guard.close()

    def committed() -> dict[str, Any] | None:
        uploads = vm.status()["uploads"]
        last = uploads["last_committed"]
        return uploads if last is not None and last["name"] == step_dir.name else None

    uploads = wait_for(committed, 60, f"{step_dir.name} committed in the bucket")
    assert uploads["last_committed"]["deadline_margin_s"] > 0, uploads
    assert uploads["failures"] == [], uploads
    log = vm.log.read_text()
    assert log.count(RETRY_LINE) <= 1, log  # checksum_attempts = 2: one upload again at most, then the fallback
    assert "upload of" not in log, log  # no failed job, no retry loop
    # The manifest records the CRC32C of every file, computed from the local bytes.
    manifest = load_manifest(step_dir)
    assert all(entry.crc32c == crc32c_of_file(step_dir / rel) for rel, entry in manifest.files.items())
    # One warning, naming the store and what it got wrong: the CRC32C sent (the manifest's) and its answer.
    warnings = [text for text in log.splitlines() if FALLBACK_WARNING in text]
    assert len(warnings) == 1, log
    store = f"{os.environ['AWS_ENDPOINT_URL_S3']} bucket {bucket.removeprefix('s3://').split('/')[0]}"
    sent = manifest.files["big.pt"].crc32c
    answered = re.search(rf"sent CRC32C {sent} for \S+/big\.pt, it answered ([0-9a-f]{{8}})", warnings[0])
    assert store in warnings[0] and answered is not None and answered.group(1) != sent, warnings[0]

    verified = cli("verify", bucket)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert f"{step_dir.name}: ok" in verified.stdout
    dest = tmp_path / "restored"
    restored = cli("restore", bucket, str(dest))
    assert restored.returncode == 0, restored.stderr
    for rel in [*manifest.files, "manifest.json"]:
        assert (dest / step_dir.name / rel).read_bytes() == (step_dir / rel).read_bytes(), rel


def test_pinned_crc32c_fails_clearly_after_the_bounded_attempts_and_is_not_retried(
    wrong_store: S3Server, aws_env: Callable[[S3Server], None], tmp_path: Path
) -> None:
    aws_env(wrong_store)
    storage = S3Storage(f"s3://{wrong_store.bucket}/pinned-{uuid.uuid4().hex[:8]}", checksum="crc32c")
    multipart_uploads: list[str] = []
    storage.client.meta.events.register(
        "provide-client-params.s3.CreateMultipartUpload", lambda params, **_: multipart_uploads.append(params["Key"])
    )
    root = tmp_path / "nvme"
    step_dir = write_checkpoint(root, 3, {"big.bin": bytes(range(256)) * (80 * 1024), "small.bin": b"x" * 100})

    async def scenario() -> Uploader:
        uploader = Uploader(storage, root, scan_interval=60, retry_after=0.05)
        task = asyncio.create_task(uploader.run())
        try:
            uploader.submit(step_dir, urgent=True)
            deadline = time.monotonic() + 60
            while not uploader.failures and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            # Rescans find the checkpoint still not in the bucket, and leave it alone.
            await uploader.rescan()
            await uploader.rescan()
            assert uploader.status()["queued"] == []
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return uploader

    try:
        uploader = asyncio.run(scenario())
        assert len(uploader.failures) == 1, uploader.failures
        error = uploader.failures[0]["error"]
        assert "checksum = crc32c is set" in error and "answers CRC32Cs that do not match the bytes" in error, error
        assert step_dir.name in uploader.refused
        assert len(multipart_uploads) == 2, multipart_uploads  # checksum_attempts, not one per retry forever
        # Later uploads fail at once, sending nothing.
        big = step_dir / "big.bin"
        with pytest.raises(ChecksumMismatch, match="no fallback"):
            storage.put_file(big, "other/big.bin", crc32c=crc32c_of_file(big))
        assert len(multipart_uploads) == 2
        # Once local retention removed it, the name is not remembered for the months the daemon runs.
        shutil.rmtree(step_dir)
        asyncio.run(uploader.rescan())
        assert step_dir.name not in uploader.refused
    finally:
        storage.close()


def test_md5_mode_sends_a_content_md5_per_request_and_no_crc32c(
    aws_env: Callable[[S3Server], None], tmp_path: Path
) -> None:
    sent: list[tuple[str, str | None, str | None, bytes]] = []

    def record(request: Any, **_: Any) -> None:
        body = request.body if isinstance(request.body, bytes | None) else request.body.getvalue()
        headers = {k.lower(): v for k, v in request.headers.items()}
        value = headers.get("content-md5")
        md5 = value.decode() if isinstance(value, bytes) else value
        crc = headers.get("x-amz-checksum-crc32c")
        sent.append((request.method, md5, crc.decode() if isinstance(crc, bytes) else crc, body))

    with moto_s3() as good:
        aws_env(good)
        storage = S3Storage(f"s3://{good.bucket}/md5", checksum="md5", part_size=5 * MiB)
        storage.client.meta.events.register("before-send.s3", record)
        try:
            local = tmp_path / "f.bin"
            local.write_bytes(bytes(range(256)) * (48 * 1024))  # 12 MiB: three parts
            storage.put_file(local, "f.bin", crc32c=crc32c_of_file(local))
            small = tmp_path / "s.bin"
            small.write_bytes(b"spotguard" * 100)
            storage.put_file(small, "s.bin", crc32c=crc32c_of_file(small))
            info = storage.stat("f.bin")
            assert info is not None and info.crc32c is None  # md5 mode: the store's CRC32C is not trusted
        finally:
            storage.close()
    puts = [(md5, crc, body) for method, md5, crc, body in sent if method == "PUT" and body]
    assert len(puts) == 4  # three parts and one object
    for md5, crc, body in puts:
        assert md5 == base64.b64encode(hashlib.md5(body).digest()).decode()
        assert crc is None
