"""Several writers on one bucket prefix (moto in server mode, real daemons, real boto3).

The nodes of a multi-node job, a restarted daemon and a replacement VM all write under one prefix:
a daemon start must not abort the others' uploads in flight, two writers of one step's manifest
must leave exactly one, and a checkpoint written by a newer spotguard must survive an older one's
retention and saves.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import boto3
import pytest

from spotguard.crc32c import crc32c_of_file
from spotguard.harness import Vm, wait_for
from spotguard.localstore import CheckpointExists, CheckpointWriter, prune_local, remove_incomplete, scan_local
from spotguard.manifest import MANIFEST, load_manifest
from spotguard.storage.checkpoints import (
    CommitLost,
    commit_remote,
    list_remote,
    prune_remote,
    upload_checkpoint,
    upload_files,
    verify_remote,
)
from spotguard.storage.gcs import GcsStorage
from spotguard.storage.s3 import S3Storage
from tests.checkpoints import write_checkpoint
from tests.faultproxy import FaultProxy
from tests.servers import S3Server, gcs_emulator, moto_s3, point_at

MiB = 1 << 20
# moto dates every multipart upload 2010-11-10 (ListMultipartUploads' "Initiated"), so the age
# bound is set past that: the daemon must still spare what the bound spares.
PAST_MOTOS_DATES = str(20 * 365 * 86400)


@pytest.fixture(scope="module")
def server() -> Iterator[S3Server]:
    with moto_s3() as s3:
        yield s3


@pytest.fixture
def url(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    return point_at(server, monkeypatch)


@pytest.fixture
def raw(server: S3Server) -> Iterator[object]:
    client = boto3.client("s3", endpoint_url=server.endpoint_url, region_name="us-east-1")
    yield client
    client.close()


def open_uploads(raw: object, bucket: str, prefix: str) -> list[str]:
    resp = raw.list_multipart_uploads(Bucket=bucket, Prefix=prefix)  # type: ignore[attr-defined]
    return [upload["UploadId"] for upload in resp.get("Uploads", [])]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spotguard", *args], check=False, capture_output=True, text=True, timeout=120
    )


def verify(location: str) -> subprocess.CompletedProcess[str]:
    return cli("verify", location)


def race_commits(storage: S3Storage, dirs: list[Path]) -> list[bool]:
    """Each writer commits its copy at the same moment; what each ``commit_remote`` returned."""
    start = threading.Barrier(len(dirs))

    def commit(step_dir: Path) -> bool:
        start.wait(timeout=30)
        return commit_remote(storage, step_dir)

    with ThreadPoolExecutor(max_workers=len(dirs)) as pool:
        return list(pool.map(commit, dirs))


def foreign_checkpoint(root: Path, step: int) -> Path:
    """A checkpoint as a newer spotguard might write it: complete by its own rules, format 99."""
    step_dir = write_checkpoint(root, step, {"w.pt": b"from the future" * 100})
    document = json.loads((step_dir / MANIFEST).read_bytes())
    document["format"] = 99
    (step_dir / MANIFEST).write_text(json.dumps(document))
    return step_dir


def test_daemon_restart_spares_another_nodes_multipart_upload_in_flight(
    url: str, server: S3Server, raw: object, tmp_path: Path
) -> None:
    prefix = url.removeprefix(f"s3://{server.bucket}/") + "/"
    env = {"SPOTGUARD_STALE_UPLOAD_AGE": PAST_MOTOS_DATES}
    node_a, node_b = Vm(tmp_path, "a", url), Vm(tmp_path, "b", url)
    with FaultProxy(server.endpoint_url, fault_rate=0.0) as proxy:
        # Node b's link: the CompleteMultipartUpload of its big file waits until released.
        proxy.hold(lambda method, target: method == "POST" and "uploadId=" in target)
        try:
            node_a.start_daemon(env)
            node_b.start_daemon({**env, "AWS_ENDPOINT_URL_S3": proxy.url})
            write_checkpoint(node_b.root, 7, {"big.bin": bytes(range(256)) * (40 * MiB // 256), "small.pt": b"s"})
            wait_for(proxy.held.is_set, 60, "node b's multipart upload to reach its completion")
            in_flight = open_uploads(raw, server.bucket, prefix)
            assert len(in_flight) == 1

            node_a.stop_daemon()
            node_a.start_daemon(env)  # answers on its socket only after its start-up abort pass
            assert open_uploads(raw, server.bucket, prefix) == in_flight, "node a's restart aborted node b's upload"

            proxy.release()
            storage = S3Storage(url)
            wait_for(lambda: [i.step for i in list_remote(storage) if i.status == "complete"] == [7], 60, "step 7")
            assert node_b.status()["uploads"]["failures"] == []
            creates = [t for m, t in proxy.seen if m == "POST" and t.endswith("?uploads")]
            assert len(creates) == 1, f"the upload was started again: {creates}"
            assert open_uploads(raw, server.bucket, prefix) == []
            result = verify(url)
            assert result.returncode == 0, result.stdout + result.stderr
        finally:
            proxy.release()
            node_a.stop_daemon()
            node_b.stop_daemon()


def test_two_writers_racing_on_one_manifest_exactly_one_wins_and_it_verifies(url: str, tmp_path: Path) -> None:
    storage = S3Storage(url)
    files = {"model.pt": b"m" * (3 * MiB), "optim.pt": b"o" * 1000}
    for step in range(1, 6):
        # The same checkpoint held by two writers (a restarted daemon and a replacement VM): the
        # same files, manifests written at different times.
        dirs = [
            write_checkpoint(tmp_path / name, step, files, reason=reason)
            for name, reason in (("x", "urgent"), ("y", "final"))
        ]
        upload_files(storage, dirs[0], load_manifest(dirs[0]).files)
        results = race_commits(storage, dirs)
        assert sorted(results) == [False, True], f"step {step}: {results}"
        winner = dirs[results.index(True)]
        assert storage.read_bytes(f"{winner.name}/{MANIFEST}") == (winner / MANIFEST).read_bytes()
    result = verify(url)
    assert result.returncode == 0, result.stdout + result.stderr

    # A writer of different bytes at a committed step backs off: nothing of the winner's is touched.
    other = write_checkpoint(tmp_path / "z", 3, {"model.pt": b"M" * (3 * MiB), "optim.pt": b"O" * 1000})
    before = {o.key: storage.stat(o.key) for o in storage.list("step-000000003/")}
    with pytest.raises(CommitLost, match=r"step-000000003 already holds another writer's checkpoint \(2 file"):
        upload_checkpoint(storage, other)
    assert {o.key: storage.stat(o.key) for o in storage.list("step-000000003/")} == before
    result = verify(f"{url}/step-000000003")
    assert result.returncode == 0, result.stdout + result.stderr


def test_checkpoint_of_unknown_format_survives_prune_and_new_saves(url: str, tmp_path: Path) -> None:
    storage = S3Storage(url)
    root = tmp_path / "nvme"
    for step in (1, 2, 3):
        upload_checkpoint(storage, write_checkpoint(root, step, {"w.pt": bytes([step]) * 4096}))
    old, new = foreign_checkpoint(root, 0), foreign_checkpoint(root, 5)
    for step_dir in (old, new):  # uploaded as-is: a newer spotguard's checkpoints in the bucket
        for path in sorted(step_dir.iterdir(), key=lambda p: p.name == MANIFEST):
            storage.put_file(path, f"{step_dir.name}/{path.name}", crc32c=crc32c_of_file(path))

    # Locally: rank 0's clean-up of leftovers before a save, a new save, and retention.
    assert remove_incomplete(root) == []
    with pytest.raises(CheckpointExists, match="format '99'"):
        CheckpointWriter(root, 5, reason="urgent").prepare()
    write_checkpoint(root, 6, {"w.pt": b"6" * 4096})
    prune_local(root, 1)
    assert [i.name for i in scan_local(root)] == ["step-000000000", "step-000000005", "step-000000006"]
    assert json.loads((new / MANIFEST).read_bytes())["format"] == 99

    # In the bucket: a new save and retention well past the grace for leftovers.
    upload_checkpoint(storage, root / "step-000000006")
    later = datetime.now(UTC) + timedelta(days=2)
    assert prune_remote(storage, 3, now=later) == ["step-000000001"]  # the daemon's retention
    pruned = cli("prune", url, "--keep", "1", "--grace", "0")  # by hand, no grace for leftovers
    assert pruned.returncode == 0, pruned.stdout + pruned.stderr
    assert pruned.stdout.strip() == "removed: step-000000002, step-000000003"
    assert "format '99'" in pruned.stderr
    names = {o.key for o in storage.list()}
    for step_dir in (old, new):
        assert {f"{step_dir.name}/w.pt", f"{step_dir.name}/{MANIFEST}"} <= names


def test_a_file_of_the_same_size_but_other_bytes_is_sent_again(url: str, tmp_path: Path) -> None:
    # S3 listings carry no checksum: a size match must not pass for "already uploaded".
    storage = S3Storage(url)
    step_dir = write_checkpoint(tmp_path / "nvme", 4, {"w.pt": b"ours" * 4096, "big.bin": b"b" * (17 * MiB)})
    for rel, data in (("w.pt", b"them" * 4096), ("big.bin", b"c" * (17 * MiB))):
        (tmp_path / rel).write_bytes(data)
        storage.put_file(tmp_path / rel, f"step-000000004/{rel}", crc32c=crc32c_of_file(tmp_path / rel))
    upload_checkpoint(storage, step_dir)
    result = verify(url)
    assert result.returncode == 0, result.stdout + result.stderr


def test_gcs_manifest_commit_asks_for_generation_zero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # gcp-storage-emulator ignores preconditions, so what is checked is that the request carries it.
    with gcs_emulator() as gcs, FaultProxy(gcs.endpoint_url, fault_rate=0.0, flavor="gcs") as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        storage = GcsStorage(f"gs://{gcs.bucket}/run")
        step_dir = write_checkpoint(tmp_path, 1, {"w.pt": b"w" * 1000})
        assert upload_checkpoint(storage, step_dir).step == 1
        # The object's name travels in the body; the manifest is the last of the two uploads.
        uploads = [t for m, t in proxy.seen if m == "POST" and t.startswith("/upload/")]
        assert len(uploads) == 2, proxy.seen
        assert "ifGenerationMatch=0" not in uploads[0] and "ifGenerationMatch=0" in uploads[1]
        assert verify_remote(storage, "step-000000001") == []
