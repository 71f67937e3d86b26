"""Acceptance, at the daemon level, for S3 (moto) and GCS (gcp-storage-emulator): a real daemon
subprocess uploads what a ``Guard`` in this process commits; the CLI lists, verifies and restores
it byte for byte; a fresh "VM" resumes identical tensors from the bucket; uploads survive a proxy
that fails 10% of the requests; bucket retention keeps the newest ``keep_remote`` complete ones.

The servers run in this process; the daemon, the CLI commands and nothing else reach them over
real HTTP. Checks read the bucket through the servers directly, never through the fault proxy.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from spotguard import Guard
from spotguard.harness import Vm, thread_heaps, wait_for
from spotguard.manifest import load_manifest
from spotguard.storage import open_storage
from spotguard.storage.checkpoints import list_remote
from spotguard.storage.gcs import PARTS_DIR
from tests.faultproxy import FAULTS, FaultProxy
from tests.servers import FAKE_AWS_ENV, gcs_emulator, moto_s3

MiB = 1 << 20


@dataclass(frozen=True)
class Store:
    """One object store under test: where it is, and a few raw looks into it (not through spotguard)."""

    scheme: str  # "s3" | "gs"
    endpoint: str  # http://127.0.0.1:PORT
    bucket: str

    @property
    def proxy_flavor(self) -> str:
        return "s3" if self.scheme == "s3" else "gcs"

    def client_env(self, endpoint: str | None = None) -> dict[str, str]:
        """What a process needs to reach the store at ``endpoint`` (default: directly)."""
        if self.scheme == "s3":
            return {**FAKE_AWS_ENV, "AWS_ENDPOINT_URL_S3": endpoint or self.endpoint}
        return {"STORAGE_EMULATOR_HOST": endpoint or self.endpoint}

    def keys(self, prefix: str) -> list[str]:
        if self.scheme == "s3":
            import boto3

            client = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")
            try:
                pages = client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
                return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))
            finally:
                client.close()
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage as gcs

        client = gcs.Client(project="test", credentials=AnonymousCredentials())
        return sorted(blob.name for blob in client.list_blobs(self.bucket, prefix=prefix))

    def unfinished_uploads(self, prefix: str) -> list[str]:
        """S3: open multipart uploads; GCS: the composite upload's temporary part objects."""
        if self.scheme == "s3":
            import boto3

            client = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")
            try:
                resp = client.list_multipart_uploads(Bucket=self.bucket, Prefix=prefix)
                return [upload["Key"] for upload in resp.get("Uploads", [])]
            finally:
                client.close()
        return [key for key in self.keys(prefix) if f"/{PARTS_DIR}/" in f"/{key}"]


@pytest.fixture(scope="module", params=["s3", "gs"])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto logs every request otherwise
    if request.param == "s3":
        with moto_s3() as s3:
            yield Store("s3", s3.endpoint_url, s3.bucket)
    else:
        with gcs_emulator() as gcs:
            yield Store("gs", gcs.endpoint_url, gcs.bucket)


@pytest.fixture
def prefix() -> str:
    return f"run-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def bucket(store: Store, prefix: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Overrides conftest's file:// bucket: ``vm_factory`` daemons get ``--bucket s3://…`` / ``gs://…``.

    This process (and the CLI subprocesses, which inherit its environment) reach the store directly.
    """
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    for key, value in store.client_env().items():
        monkeypatch.setenv(key, value)
    return f"{store.scheme}://{store.bucket}/{prefix}"


def make_state(tensors: int, tensor_bytes: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(tensor_bytes // 4, generator=generator) for i in range(tensors)}


def zeros_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: torch.zeros_like(value) for key, value in state.items()}


def remote(url: str) -> dict[int, str]:
    """step -> status, read through spotguard's own listing."""
    storage = open_storage(url)
    try:
        return {info.step: info.status for info in list_remote(storage)}
    finally:
        storage.close()


def complete_steps(url: str) -> list[int]:
    return sorted(step for step, status in remote(url).items() if status == "complete")


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spotguard", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def connected_guard(vm: Vm) -> Guard:
    guard = Guard(checkpoint_dir=vm.root, socket=vm.socket, handle_sigterm=False, keep=10)
    wait_for(guard.client.connected.is_set, 10, "the hook to connect to the daemon")
    return guard


def same_files(a: Path, b: Path) -> list[str]:
    """Relative paths that differ in content (or exist on one side only) between two directories."""
    files_a = {p.relative_to(a).as_posix(): p for p in a.rglob("*") if p.is_file()}
    files_b = {p.relative_to(b).as_posix(): p for p in b.rglob("*") if p.is_file()}
    differ = sorted(set(files_a) ^ set(files_b))
    for rel in sorted(set(files_a) & set(files_b)):
        if files_a[rel].read_bytes() != files_b[rel].read_bytes():
            differ.append(rel)
    return differ


@pytest.mark.parametrize(
    "tensor_bytes",
    [pytest.param(5 * MiB, id="20MiB"), pytest.param(64 * MiB, id="256MiB", marks=pytest.mark.slow)],
)
def test_urgent_checkpoint_reaches_bucket_lists_restores_and_resumes_bit_identical(
    vm_factory: Callable[..., Vm], bucket: str, store: Store, prefix: str, tmp_path: Path, tensor_bytes: int
) -> None:
    vm = vm_factory("vm-a")
    state = make_state(4, tensor_bytes, seed=11)
    guard = connected_guard(vm)
    try:
        step_dir = guard.save(state, 42, reason="urgent")
    finally:
        guard.close()
    manifest = load_manifest(step_dir)
    assert manifest.total_bytes >= 4 * tensor_bytes
    assert len(manifest.files) >= 4  # one file per tensor (+ RNG states): several objects, manifest last

    timeout = 180 if tensor_bytes > 8 * MiB else 60
    wait_for(lambda: remote(bucket).get(42) == "complete", timeout, "step 42 complete in the bucket")
    assert store.unfinished_uploads(prefix) == []
    # The upload's threads took no heaps of their own, whose free tops no trim gives back (daemon/heap.py).
    assert vm.process is not None and thread_heaps(vm.process.pid) == 0

    listing = cli("list", bucket, "--json")
    assert listing.returncode == 0, listing.stderr
    rows = json.loads(listing.stdout)
    assert [(r["name"], r["step"], r["status"], r["bytes"]) for r in rows] == [
        (step_dir.name, 42, "complete", manifest.total_bytes)
    ]

    dest = tmp_path / "restored"
    restored = cli("restore", bucket, str(dest))
    assert restored.returncode == 0, restored.stderr
    assert Path(restored.stdout.strip().splitlines()[-1]) == dest / step_dir.name
    assert same_files(step_dir, dest / step_dir.name) == []

    # A fresh VM: empty local disk, no daemon; the hook itself fetches from the bucket.
    vm.kill_daemon()
    fresh = tmp_path / "vm-b-nvme"
    loaded = zeros_like(state)
    guard_b = Guard(checkpoint_dir=fresh, bucket=bucket, socket=tmp_path / "none.sock", handle_sigterm=False)
    try:
        assert guard_b.resume(loaded) == 42
    finally:
        guard_b.close()
    for key, tensor in state.items():
        assert torch.equal(loaded[key], tensor), key
    assert same_files(step_dir, fresh / step_dir.name) == []


def test_uploads_through_a_proxy_failing_10_percent_of_requests_complete_and_verify(
    vm_factory: Callable[..., Vm], bucket: str, store: Store, prefix: str
) -> None:
    with FaultProxy(store.endpoint, fault_rate=0.1, seed=20261122, flavor=store.proxy_flavor) as proxy:
        # Only the daemon goes through the proxy; this process checks the store directly.
        vm = vm_factory("faulty", env={**store.client_env(proxy.url), "SPOTGUARD_KEEP_REMOTE": "100"})
        guard = connected_guard(vm)
        steps: list[int] = []
        try:
            # Checkpoints until every kind of fault has hit at least twice (10 at most): 28 MiB each,
            # multipart (S3, 8 MiB parts) or resumable chunks (GCS, 8 MiB) plus small objects.
            while len(steps) < 10 and (len(steps) < 3 or min(proxy.injected[f] for f in FAULTS) < 2):
                step = len(steps) + 1
                state = {"big": torch.full((6 * MiB,), float(step)), "mid": torch.full((MiB,), float(step))}
                guard.save(state, step, reason="urgent")
                steps.append(step)
                wait_for(lambda s=step: s in complete_steps(bucket), 120, f"step {step} despite the faults")  # type: ignore[misc]
        finally:
            guard.close()
        injected = dict(proxy.injected)
        requests = proxy.requests
        # The faults really happened, every kind of them.
        assert set(injected) == set(FAULTS) and sum(injected.values()) >= 4, (injected, requests)
        assert complete_steps(bucket) == steps
        assert store.unfinished_uploads(prefix) == []

        # Verified with this process's direct endpoint. The proxy stays up, fault-free: the GCS
        # emulator records each object's mediaLink with the Host of the upload (the proxy), and
        # google-cloud-storage downloads from the mediaLink. Real GCS has one fixed media host.
        proxy.set_fault_rate(0.0)
        verified = cli("verify", bucket)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert verified.stdout.count(": ok") == len(steps), verified.stdout


def test_bucket_retention_keeps_newest_keep_remote_and_never_the_newest_complete(
    vm_factory: Callable[..., Vm], bucket: str, store: Store, prefix: str
) -> None:
    vm = vm_factory("retention", env={"SPOTGUARD_KEEP_REMOTE": "2"})
    observations: list[list[int]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def watch() -> None:
        # The newest complete checkpoint, once there, must be visible at every moment after.
        while not stop.is_set():
            try:
                observations.append(complete_steps(bucket))
            except Exception as exc:  # reported below; a crashed watcher must fail the test
                errors.append(exc)
                return

    watcher = threading.Thread(target=watch, name="retention-watcher", daemon=True)
    watcher.start()
    guard = connected_guard(vm)
    try:
        for step in range(1, 6):
            guard.save({"w": torch.full((MiB,), float(step))}, step, reason="urgent")
            wait_for(lambda s=step: s in complete_steps(bucket), 60, f"step {step} in the bucket")  # type: ignore[misc]
        wait_for(lambda: complete_steps(bucket) == [4, 5], 30, "retention to leave steps 4 and 5")
        # Two more observations: at least one of them began after the end state was there.
        observed = len(observations)
        wait_for(lambda: len(observations) >= observed + 2 or bool(errors), 60, "the watcher to see the end")
    finally:
        guard.close()
        stop.set()
        watcher.join(timeout=30)
    assert not errors, errors

    # Nothing of the pruned checkpoints is left, not even data objects without a manifest. Those go
    # after their manifest (which ended the checkpoint's count above), so some may still be going.
    def names() -> set[str]:
        return {key[len(prefix) + 1 :].split("/")[0] for key in store.keys(prefix + "/")}

    left = {"step-000000004", "step-000000005"}
    wait_for(lambda: names() == left, 30, "the pruned checkpoints' data objects to go")
    assert remote(bucket) == {4: "complete", 5: "complete"}

    newest_seen = 0
    gaps = []
    for seen in observations:
        if newest_seen and (not seen or max(seen) < newest_seen):
            gaps.append((newest_seen, seen))
        newest_seen = max([newest_seen, *seen])
    assert len(observations) >= 5 and newest_seen == 5
    assert gaps == [], f"the newest complete checkpoint vanished from the bucket: {gaps[:5]}"
    # Retention ran while the bucket held more than keep_remote complete ones, never fewer than 1.
    assert all(len(seen) <= 3 for seen in observations), max(observations, key=len)


def test_a_store_refusing_the_start_up_sweep_of_unfinished_uploads_leaves_the_daemon_running(
    vm_factory: Callable[..., Vm], bucket: str, store: Store
) -> None:
    """A role without the listing of multipart uploads (S3's s3:ListBucketMultipartUploads), or a store
    failing at that moment, made the start-up sweep raise out of the daemon's start: it exited, and
    under systemd started again to exit again, watching for no notice."""

    def sweep_listing(method: str, target: str) -> bool:
        query = target.partition("?")[2]
        return method == "GET" and ("uploads" in query.split("&") or "spotguard-parts" in query)

    with FaultProxy(store.endpoint, fault_rate=0.0, flavor=store.proxy_flavor) as proxy:
        proxy.fail(sweep_listing, status=403)
        vm = vm_factory("no-sweep", env=store.client_env(proxy.url))
        wait_for(lambda: "could not sweep unfinished multipart uploads" in vm.log.read_text(), 30, "the sweep refused")
        assert proxy.injected["403"] >= 1
        guard = connected_guard(vm)
        try:
            guard.save({"w": torch.full((MiB,), 3.0)}, 3, reason="urgent")
        finally:
            guard.close()
        wait_for(lambda: 3 in complete_steps(bucket), 60, "the checkpoint in the bucket")
        assert vm.process is not None and vm.process.poll() is None
