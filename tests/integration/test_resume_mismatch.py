"""Resuming into a state that does not match the checkpoint, against a real moto bucket.

Every request the trainer makes goes through a recording proxy, so "nothing was fetched" is
counted, not assumed: the only objects read before the check are manifests.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from spotguard import Guard, SpotguardMismatch
from spotguard.manifest import MANIFEST, ManifestFormatError, load_manifest
from spotguard.storage import open_storage
from spotguard.storage.checkpoints import CheckpointUnreadable, commit_remote, upload_checkpoint, upload_files
from tests.faultproxy import FaultProxy
from tests.servers import FAKE_AWS_ENV, S3Server, moto_s3

STEP = 7


@pytest.fixture(scope="module")
def server() -> Iterator[S3Server]:
    with moto_s3() as srv:
        yield srv


@pytest.fixture
def proxy(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    for key, value in FAKE_AWS_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    with FaultProxy(server.endpoint_url, fault_rate=0.0) as recorder:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", recorder.url)
        yield recorder


def make_state(width: int = 16, optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))
    opt = optimizer(model.parameters(), lr=0.01)
    return {"model": model, "optimizer": opt, "epoch": 1}


def train_step(state: dict[str, Any]) -> None:
    state["model"](torch.randn(5, 8)).sum().backward()
    state["optimizer"].step()


def uploaded(server: S3Server, step_dir: Path) -> str:
    """``step_dir`` uploaded (committed) under a new prefix of the test bucket; that prefix's URL."""
    url = f"s3://{server.bucket}/run-{uuid.uuid4().hex[:8]}"
    storage = open_storage(url)
    try:
        upload_checkpoint(storage, step_dir)
    finally:
        storage.close()
    return url


@pytest.fixture
def saved(tmp_path: Path, proxy: FaultProxy, server: S3Server) -> str:
    """A checkpoint of an 8-16-4 MLP with AdamW, only in the bucket; returns the bucket URL."""
    state = make_state()
    train_step(state)
    with Guard(checkpoint_dir=tmp_path / "first-vm", socket=tmp_path / "none.sock", handle_sigterm=False) as guard:
        step_dir = guard.save(state, STEP, reason="urgent")
    return uploaded(server, step_dir)


def is_data_read(method: str, target: str) -> bool:
    """An object read other than a manifest's (a listing is a GET of the bucket with a query, no key)."""
    return method in ("GET", "HEAD") and "/step-" in target and not target.split("?", maxsplit=1)[0].endswith(MANIFEST)


def flip_a_byte(path: Path) -> None:
    """One byte of ``path`` changed, inside the last tensor's bytes: its size still matches."""
    data = bytearray(path.read_bytes())
    data[-200] ^= 0xFF
    path.write_bytes(data)


def data_reads(proxy: FaultProxy) -> list[str]:
    return [target for method, target in proxy.seen if is_data_read(method, target)]


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in state["model"].state_dict().items()},
        "optimizer": repr(state["optimizer"].state_dict()),
        "epoch": state["epoch"],
    }


def assert_unchanged(state: dict[str, Any], before: dict[str, Any]) -> None:
    after = snapshot(state)
    assert after["model"].keys() == before["model"].keys()
    for key, tensor in before["model"].items():
        assert torch.equal(after["model"][key], tensor), key
    assert after["optimizer"] == before["optimizer"]
    assert after["epoch"] == before["epoch"]


def fresh_guard(tmp_path: Path, url: str) -> Guard:
    return Guard(checkpoint_dir=tmp_path / "new-vm", bucket=url, socket=tmp_path / "none.sock", handle_sigterm=False)


def resume_mismatched(tmp_path: Path, url: str, proxy: FaultProxy, state: dict[str, Any]) -> SpotguardMismatch:
    before = snapshot(state)
    proxy.seen.clear()
    with fresh_guard(tmp_path, url) as guard, pytest.raises(SpotguardMismatch) as caught:
        guard.resume(state)
    assert data_reads(proxy) == []  # the manifest was read; not one byte of data
    assert any(target.split("?")[0].endswith(MANIFEST) for _, target in proxy.seen)
    assert not list((tmp_path / "new-vm").glob("step-*"))  # nothing downloaded either
    assert_unchanged(state, before)
    assert guard.last_resume_report is None
    return caught.value


def test_a_wider_layer_is_refused_before_any_data_is_fetched(tmp_path: Path, saved: str, proxy: FaultProxy) -> None:
    error = resume_mismatched(tmp_path, saved, proxy, make_state(width=32))
    found = {(d.entry, d.key): (d.saved, d.live) for d in error.differences}
    assert found[("model", "0.weight")] == ("float32[16,8]", "float32[32,8]")
    assert found[("model", "2.weight")] == ("float32[4,16]", "float32[4,32]")
    assert found[("optimizer", "param.0")] == ("float32[16,8]", "float32[32,8]")
    assert ("model", "2.bias") not in found  # still 4 wide
    assert "model: 0.weight: saved float32[16,8], live float32[32,8]" in str(error)
    assert "nothing was loaded" in str(error)


def test_another_optimizer_is_refused(tmp_path: Path, saved: str, proxy: FaultProxy) -> None:
    error = resume_mismatched(tmp_path, saved, proxy, make_state(optimizer=torch.optim.SGD))
    assert [(d.entry, d.key, d.saved, d.live) for d in error.differences] == [
        ("optimizer", "class", "torch.optim.adamw.AdamW", "torch.optim.sgd.SGD")
    ]


def test_a_dtype_change_is_refused_not_cast(tmp_path: Path, saved: str, proxy: FaultProxy) -> None:
    state = make_state()
    state["model"].to(torch.float64)
    error = resume_mismatched(tmp_path, saved, proxy, state)
    found = {(d.entry, d.key): (d.saved, d.live) for d in error.differences}
    assert found[("model", "0.bias")] == ("float32[16]", "float64[16]")
    assert len(error.differences) == 8  # 4 model tensors, and the 4 parameters the optimizer steps


def test_the_error_lists_ten_differences_and_counts_the_rest(tmp_path: Path, saved: str, proxy: FaultProxy) -> None:
    state = make_state()
    state["model"] = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(8)))  # 16 unknown keys
    state["optimizer"] = torch.optim.AdamW(state["model"].parameters())
    with fresh_guard(tmp_path, saved) as guard, pytest.raises(SpotguardMismatch) as caught:
        guard.resume(state)
    message = str(caught.value)
    listed = [line for line in message.splitlines() if line.startswith("  ") and "... and" not in line]
    assert len(listed) == 10
    assert f"... and {len(caught.value.differences) - 10} more" in message


def test_strict_false_loads_what_matches_and_reports_the_rest(tmp_path: Path, saved: str, proxy: FaultProxy) -> None:
    original = make_state()
    train_step(original)  # the state the checkpoint holds (same seed, same data draw)
    state = make_state(width=32, optimizer=torch.optim.SGD)
    state["epoch"] = 0
    wide_weight = state["model"][0].weight.clone()
    with fresh_guard(tmp_path, saved) as guard:
        assert guard.resume(state, strict=False) == STEP
        report = guard.last_resume_report
    assert report is not None and report.checked and not report.complete
    assert report.skipped_entries == ["optimizer"]  # another class: left as it was
    assert sorted(report.skipped_keys["model"]) == ["0.bias", "0.weight", "2.weight"]
    assert torch.equal(state["model"][2].bias, original["model"][2].bias)  # loaded: it fits
    assert torch.equal(state["model"][0].weight, wide_weight)  # not loaded: it does not
    assert state["optimizer"].state_dict()["state"] == {}
    assert state["epoch"] == 1


def test_a_matching_state_resumes_with_a_clean_report(tmp_path: Path, saved: str, proxy: FaultProxy) -> None:
    state = make_state()
    proxy.seen.clear()
    with fresh_guard(tmp_path, saved) as guard:
        assert guard.resume(state) == STEP
        report = guard.last_resume_report
    assert report is not None and report.checked and report.complete
    assert len(data_reads(proxy)) >= 4  # the counter sees data reads: model, optimizer, epoch, RNG
    assert len(state["optimizer"].state_dict()["state"]) == 4


def test_a_checkpoint_without_recorded_contents_still_loads(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    state = make_state()
    train_step(state)
    with Guard(checkpoint_dir=root, socket=tmp_path / "none.sock", handle_sigterm=False) as guard:
        step_dir = guard.save(state, STEP, reason="urgent")
    # As spotguard wrote it before contents were recorded.
    document = json.loads((step_dir / MANIFEST).read_bytes())
    assert "contents" in document
    del document["contents"]
    (step_dir / MANIFEST).write_text(json.dumps(document))
    assert load_manifest(step_dir).contents is None
    fresh = make_state()
    with Guard(checkpoint_dir=root, socket=tmp_path / "none.sock", handle_sigterm=False) as guard:
        assert guard.resume(fresh) == STEP
        report = guard.last_resume_report
    assert report is not None and not report.checked and report.complete
    assert torch.equal(fresh["model"][0].weight, state["model"][0].weight)


def rewrite_format(step_dir: Path, fmt: str) -> None:
    document = json.loads((step_dir / MANIFEST).read_bytes())
    document["format"] = fmt
    (step_dir / MANIFEST).write_text(json.dumps(document))


def test_a_newer_format_is_a_clear_error_locally_and_in_the_bucket(
    tmp_path: Path, proxy: FaultProxy, server: S3Server
) -> None:
    root = tmp_path / "ckpt"
    state = make_state()
    with Guard(checkpoint_dir=root, socket=tmp_path / "none.sock", handle_sigterm=False) as guard:
        guard.save(state, 1, reason="urgent")
        newest = guard.save(state, 2, reason="urgent")
    url = f"s3://{server.bucket}/run-{uuid.uuid4().hex[:8]}"
    storage = open_storage(url)
    try:
        upload_files(storage, newest, load_manifest(newest).files)
        rewrite_format(newest, "spotguard/2")
        commit_remote(storage, newest)  # the manifest, of the newer format (manifests are never overwritten)
    finally:
        storage.close()
    for where in (root, tmp_path / "new-vm"):
        with (
            Guard(checkpoint_dir=where, bucket=url, socket=tmp_path / "none.sock", handle_sigterm=False) as guard,
            pytest.raises(ManifestFormatError, match=r"'spotguard/2' is newer than this spotguard .*'spotguard/1'"),
        ):
            guard.resume(make_state())


def spotguard_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spotguard", *args], capture_output=True, text=True, check=False, timeout=120
    )


def test_verify_and_list_json_show_the_recorded_contents(tmp_path: Path, saved: str) -> None:
    root = tmp_path / "ckpt"
    with Guard(checkpoint_dir=root, socket=tmp_path / "none.sock", handle_sigterm=False) as guard:
        guard.save(make_state(), STEP, reason="urgent")
    listed = spotguard_cli("list", str(root), "--json")
    assert listed.returncode == 0, listed.stderr
    [entry] = json.loads(listed.stdout)
    assert {"name", "step", "bytes", "created", "status"} <= entry.keys()
    contents = entry["contents"]
    assert contents["versions"]["torch"] == torch.__version__
    assert contents["versions"]["format"] == "spotguard/1"
    assert contents["world_size"] == 1
    assert contents["entries"]["model"]["keys"]["0.weight"] == "float32[16,8]"
    assert contents["entries"]["optimizer"]["class"] == "torch.optim.adamw.AdamW"
    assert contents["entries"]["optimizer"]["groups"] == [4]
    assert contents["entries"]["epoch"] == {"kind": "value", "class": "int"}
    for location in (str(root), saved):
        verified = spotguard_cli("verify", location, "--json")
        assert verified.returncode == 0, verified.stderr
        [result] = json.loads(verified.stdout)
        assert result["status"] == "ok" and result["problems"] == []
        assert result["contents"]["entries"]["model"]["keys"]["2.bias"] == "float32[4]"


def test_integration_resume_path_checks_the_model_before_fetching(
    tmp_path: Path, proxy: FaultProxy, server: S3Server
) -> None:
    from spotguard.integrations.common import find_resumable

    root = tmp_path / "first-vm"
    model = make_state()["model"]
    with Guard(checkpoint_dir=root, socket=tmp_path / "none.sock", handle_sigterm=False) as guard:
        meta = {"framework": "lightning", "resume": "lightning.ckpt"}
        with guard.external_save(3, meta, {"model": model}) as step_dir:
            torch.save(model.state_dict(), step_dir / "lightning.ckpt")
    assert find_resumable(root, None, "lightning", live={"model": model}) == step_dir / "lightning.ckpt"
    url = uploaded(server, step_dir)
    wider = make_state(width=32)["model"]
    proxy.seen.clear()
    with pytest.raises(SpotguardMismatch, match=r"model: 0\.weight: saved float32\[16,8\], live float32\[32,8\]"):
        find_resumable(tmp_path / "new-vm", url, "lightning", live={"model": wider})
    assert data_reads(proxy) == []
    assert not (tmp_path / "new-vm").exists() or not list((tmp_path / "new-vm").glob("step-*"))
    found = find_resumable(tmp_path / "new-vm", url, "lightning", live={"model": model})
    assert found == tmp_path / "new-vm" / step_dir.name / "lightning.ckpt"


def lightning_checkpoint_in_the_bucket(tmp_path: Path, server: S3Server) -> tuple[Path, str]:
    """A Lightning-style checkpoint of two files, committed on a first VM's disk and uploaded: its step
    directory there and the bucket's URL."""
    guard = Guard(checkpoint_dir=tmp_path / "first-vm", socket=tmp_path / "none.sock", handle_sigterm=False)
    with guard, guard.external_save(3, {"framework": "lightning", "resume": "lightning.ckpt"}) as step_dir:
        torch.save(make_state()["model"].state_dict(), step_dir / "lightning.ckpt")
        torch.save({"rank": 1}, step_dir / "extra.pt")
    return step_dir, uploaded(server, step_dir)


# A rank's resume_path(), as a process of its own: where it found (or fetched) the checkpoint.
FIND_RESUMABLE = """
import sys
from pathlib import Path
from spotguard.integrations.common import find_resumable
print(find_resumable(Path(sys.argv[1]), sys.argv[2], "lightning"), flush=True)
"""


def test_ranks_sharing_a_disk_fetch_it_once_and_ranks_on_disks_of_their_own_each_fetch(
    tmp_path: Path, proxy: FaultProxy, server: S3Server
) -> None:
    """Processes racing to resume from the bucket: those sharing a root (a node's local ranks) fetch
    the checkpoint once between them, whatever LOCAL_RANK says; each root of its own (nodes with
    disks of their own, even on one host) gets its copy. Before, only LOCAL_RANK 0 fetched, and a rank
    with another number but a disk of its own waited 600 s for a copy that never came."""
    step_dir, url = lightning_checkpoint_in_the_bucket(tmp_path, server)

    def resume(roots: list[Path]) -> list[str]:
        proxy.seen.clear()
        ranks = [
            subprocess.Popen(
                [sys.executable, "-c", FIND_RESUMABLE, str(root), url],
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ, "LOCAL_RANK": str(rank)},
            )
            for rank, root in enumerate(roots)
        ]
        found = [rank.communicate(timeout=120)[0].strip() for rank in ranks]
        assert [rank.returncode for rank in ranks] == [0] * len(roots)
        assert found == [str(root / step_dir.name / "lightning.ckpt") for root in roots]
        return sorted(data_reads(proxy))

    one_fetch = resume([tmp_path / "alone"])
    assert one_fetch, "the fetch reads the checkpoint's files"
    assert resume([tmp_path / "shared"] * 3) == one_fetch
    assert resume([tmp_path / "disk-0", tmp_path / "disk-1"]) == sorted(one_fetch * 2)


# A process that holds a root's restore lock until it is killed, as a rank dying mid-fetch would.
HOLD_THE_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""


def test_a_rank_killed_mid_fetch_leaves_the_fetch_to_the_next(
    tmp_path: Path, proxy: FaultProxy, server: S3Server
) -> None:
    """While another process holds the root's restore lock, a resume waits for it (and gives up at its
    deadline); once that process is killed, the next resume fetches at once."""
    from spotguard.integrations.common import RESTORE_LOCK, find_resumable

    step_dir, url = lightning_checkpoint_in_the_bucket(tmp_path, server)
    root = tmp_path / "new-vm"
    root.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_THE_LOCK, str(root / RESTORE_LOCK)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(TimeoutError, match="restoring a checkpoint into"):
            find_resumable(root, url, "lightning", wait=1.0)
        assert not list(root.glob("step-*")), "nothing fetched past a held lock"
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert find_resumable(root, url, "lightning", wait=30.0) == root / step_dir.name / "lightning.ckpt"


def resume_past_a_flipped_byte(tmp_path: Path, root: Path, url: str, step_dir: Path, state: dict[str, Any]) -> None:
    """A byte of ``step_dir``'s model file flipped, ``state`` (saved there at STEP, intact in ``url``)
    is what a resume from ``root`` loads: the bucket's bytes, the corrupt copy replaced."""
    flip_a_byte(next(p for p in step_dir.iterdir() if p.name.startswith("model")))
    resumed = make_state()
    with Guard(checkpoint_dir=root, bucket=url, socket=tmp_path / "none.sock", handle_sigterm=False) as guard:
        assert guard.resume(resumed) == STEP
    for key, value in state["model"].state_dict().items():
        assert torch.equal(resumed["model"].state_dict()[key], value), key
    assert spotguard_cli("verify", str(root)).returncode == 0  # the corrupt copy was replaced


def test_a_corrupt_local_copy_is_fetched_again_from_the_bucket_not_loaded(
    tmp_path: Path, proxy: FaultProxy, server: S3Server
) -> None:
    """The node's only local checkpoint has a flipped byte; the bucket holds the same step intact. The
    resume loads the bucket's bytes (the local copy is replaced), never the corrupt ones."""
    root = tmp_path / "ckpt"
    state = make_state()
    train_step(state)
    with Guard(checkpoint_dir=root, socket=tmp_path / "none.sock", handle_sigterm=False) as guard:
        step_dir = guard.save(state, STEP, reason="urgent")
    resume_past_a_flipped_byte(tmp_path, root, uploaded(server, step_dir), step_dir, state)


def test_a_bucket_refusing_reads_stops_the_resume_instead_of_starting_over(
    tmp_path: Path, proxy: FaultProxy, saved: str
) -> None:
    """The bucket answers its manifests and listings, and refuses every read of a checkpoint's data
    (403; a 503 past every retry takes the same way, only slower): nothing says the checkpoint is
    bad, so the resume raises, naming the step and what to do, instead of going back to an older
    checkpoint (or to step 0: there is no older one here), which would give up every step since
    without a word. The live state is left as it was."""
    state = make_state()
    before = snapshot(state)
    proxy.fail(is_data_read, status=403)
    with fresh_guard(tmp_path, saved) as guard, pytest.raises(CheckpointUnreadable) as caught:
        guard.resume(state)
    message = str(caught.value)
    assert f"step-{STEP:09d} could not be restored" in message and "not found bad" in message, message
    assert "check the bucket" in message, message
    assert proxy.injected["403"] > 0
    assert not list((tmp_path / "new-vm").glob("step-*"))  # nothing half-downloaded left
    assert_unchanged(state, before)


def test_a_corrupt_newest_local_checkpoint_is_resumed_from_the_bucket_not_from_an_older_local_one(
    tmp_path: Path, proxy: FaultProxy, server: S3Server
) -> None:
    """The disk holds steps 6 and 7, step 7 with a flipped byte; the bucket holds step 7 intact. The
    resume loads the bucket's step 7 (the newest complete checkpoint), not the disk's step 6."""
    root = tmp_path / "ckpt"
    state = make_state()
    with Guard(checkpoint_dir=root, socket=tmp_path / "none.sock", handle_sigterm=False) as guard:
        guard.save(state, STEP - 1, reason="periodic")
        guard.wait()  # committed: an urgent save would pre-empt a periodic one still going
        train_step(state)
        newest = guard.save(state, STEP, reason="urgent")
    resume_past_a_flipped_byte(tmp_path, root, uploaded(server, newest), newest, state)
    assert sorted(p.name for p in root.glob("step-*")) == [f"step-{STEP - 1:09d}", f"step-{STEP:09d}"]


def test_a_framework_resume_path_takes_the_buckets_copy_of_a_newest_local_checkpoint_found_bad(
    tmp_path: Path, proxy: FaultProxy, server: S3Server
) -> None:
    """The Lightning/HF path alike: the disk holds steps 2 and 3, step 3 with a flipped byte; the
    bucket holds step 3 intact. The resume path is the bucket's step 3, not the disk's step 2."""
    from spotguard.integrations.common import find_resumable

    root = tmp_path / "vm"
    model = make_state()["model"]
    meta = {"framework": "lightning", "resume": "lightning.ckpt"}
    with Guard(checkpoint_dir=root, socket=tmp_path / "none.sock", handle_sigterm=False) as guard:
        for step in (2, 3):
            with guard.external_save(step, meta, {"model": model}) as step_dir:
                torch.save({"step": step, "model": model.state_dict()}, step_dir / "lightning.ckpt")
    url = uploaded(server, step_dir)
    flip_a_byte(step_dir / "lightning.ckpt")
    found = find_resumable(root, url, "lightning", live={"model": model})
    assert found == step_dir / "lightning.ckpt"
    assert torch.load(found, weights_only=True)["step"] == 3  # the bucket's bytes: the copy verifies
    assert spotguard_cli("verify", str(root)).returncode == 0


def test_a_root_the_job_left_and_came_back_to_resumes_from_the_buckets_newer_checkpoint(
    tmp_path: Path, proxy: FaultProxy, server: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    """A node's checkpoint root (a Kubernetes hostPath) holds step 6 from when the job ran there; the
    job went on elsewhere to step 7, which is in the bucket. Coming back, the resume loaded the disk's
    step 6 without looking at the bucket: progress lost, and the bucket's retention (newest steps
    kept) would then prune the new run's checkpoints in favour of the old step 7."""
    node_x, node_y = tmp_path / "node-x", tmp_path / "node-y"
    state = make_state()
    with Guard(checkpoint_dir=node_x, socket=tmp_path / "none.sock", handle_sigterm=False) as guard:
        old = guard.save(state, STEP - 1, reason="urgent")
    train_step(state)
    with Guard(checkpoint_dir=node_y, socket=tmp_path / "none.sock", handle_sigterm=False) as guard:
        newer = guard.save(state, STEP, reason="urgent")
    url = uploaded(server, newer)
    storage = open_storage(url)
    try:
        upload_checkpoint(storage, old)  # the bucket holds both
    finally:
        storage.close()

    resumed = make_state()
    caplog.set_level(logging.WARNING, logger="spotguard.trainer")
    with Guard(checkpoint_dir=node_x, bucket=url, socket=tmp_path / "none.sock", handle_sigterm=False) as guard:
        assert guard.resume(resumed) == STEP
    for key, value in state["model"].state_dict().items():
        assert torch.equal(resumed["model"].state_dict()[key], value), key
    said = f"holds step-{STEP:09d}, newer than this disk's newest step-{STEP - 1:09d}"
    assert any(said in m for m in caplog.messages), caplog.messages
    assert sorted(p.name for p in node_x.glob("step-*")) == [old.name, newer.name]

    # A bucket that refuses the listing leaves the disk's newest the choice, said so.
    node_z = tmp_path / "node-z"
    with Guard(checkpoint_dir=node_z, socket=tmp_path / "none.sock", handle_sigterm=False) as guard:
        guard.save(make_state(), STEP - 2, reason="urgent")
    proxy.fail(lambda method, target: True, status=403)
    with Guard(checkpoint_dir=node_z, bucket=url, socket=tmp_path / "none.sock", handle_sigterm=False) as guard:
        assert guard.resume(make_state()) == STEP - 2
    assert proxy.injected["403"] > 0
    assert any("could not look in" in m and "resuming from this disk's" in m for m in caplog.messages)
