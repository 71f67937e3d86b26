"""Acceptance: the local disk is full when a notice comes (issue 10, point 1).

A real daemon subprocess with its checkpoint root (and state directory) on a small tmpfs this test
mounts, uploading to moto over real HTTP. Step 5 is committed in the bucket, then the disk is filled
to 4 MiB free and a drill arrives: the urgent save drops the local copy of step 5 (the daemon says it
is safe in the bucket) and commits step 6. A state too big for any room raises ``SpotguardDiskFull``
with the numbers; the daemon stays up and reports it (status, metric, webhook); step 5 in the bucket
still resumes on a fresh VM.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from spotguard import Guard, SpotguardDiskFull
from spotguard.control import request
from spotguard.harness import Vm, wait_for
from spotguard.manifest import step_dir_name
from spotguard.storage import open_storage
from tests.diskspace import fill, make_read_only
from tests.integration.test_daemon_buckets import complete_steps, connected_guard
from tests.integration.test_metrics_webhook import Receiver, scrape, value
from tests.servers import S3Server, moto_s3, point_at

MiB = 1 << 20


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    with moto_s3() as server:
        yield server


@pytest.fixture
def bucket(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """The daemon (a subprocess inheriting this environment) and this process reach moto directly."""
    return point_at(s3, monkeypatch)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    yield server
    server.close()


@pytest.fixture
def vm(tmpfs: Callable[[int], Path], tmp_path: Path, bucket: str, receiver: Receiver) -> Iterator[Vm]:
    """A daemon whose checkpoint root, state directory and socket are on a 48 MiB tmpfs (its log is not:
    it must stay readable when the disk is full)."""
    vm = Vm(tmpfs(48 * MiB), "vm", bucket)
    vm.log = tmp_path / "daemon.log"
    vm.start_daemon(env={"SPOTGUARD_METRICS_PORT": "0", "SPOTGUARD_WEBHOOK_URL": receiver.url})
    try:
        yield vm
    finally:
        vm.kill_daemon()  # before the tmpfs is unmounted


def tensors(mib: int, seed: int) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(mib * MiB // 4, generator=torch.Generator().manual_seed(seed))}


def step_5_in_the_bucket_then_a_full_disk(vm: Vm, guard: Guard, bucket: str) -> dict[str, torch.Tensor]:
    state = tensors(6, seed=5)
    guard.save(state, 5, reason="urgent")
    wait_for(lambda: 5 in complete_steps(bucket), 60, "step 5 complete in the bucket")
    fill(vm.dir.parent, leave=4 * MiB)
    request(vm.socket, "drill", deadline_s=120)
    wait_for(lambda: guard.should_checkpoint(6), 10, "the drill to reach the hook")
    return state


def step_objects(bucket: str, step: int) -> list[str]:
    storage = open_storage(bucket)
    try:
        return [info.key for info in storage.list(f"{step_dir_name(step)}/")]
    finally:
        storage.close()


def test_urgent_save_on_a_full_disk_drops_the_local_copy_already_in_the_bucket_and_commits(vm: Vm, bucket: str) -> None:
    guard = connected_guard(vm)
    try:
        step_5_in_the_bucket_then_a_full_disk(vm, guard, bucket)
        step_dir = guard.save(tensors(6, seed=6), 6)
        assert guard.stop_requested
    finally:
        guard.close()
    assert step_dir == vm.root / step_dir_name(6)
    # Step 5 was the newest local checkpoint: only the daemon's word that it is complete in the
    # bucket lets the hook drop it (without a daemon the newest is never dropped).
    assert not (vm.root / step_dir_name(5)).exists(), "step 5 was safe in the bucket: dropped to make room"
    wait_for(lambda: complete_steps(bucket) == [5, 6], 60, "step 6 committed in the bucket beside step 5")
    assert vm.status()["save_failures"] == []


def test_a_state_too_big_for_any_room_raises_disk_full_and_the_daemon_reports_it(
    vm: Vm, bucket: str, receiver: Receiver, tmp_path: Path
) -> None:
    guard = connected_guard(vm)
    try:
        state5 = step_5_in_the_bucket_then_a_full_disk(vm, guard, bucket)
        with pytest.raises(SpotguardDiskFull) as info:
            guard.save(tensors(64, seed=7), 6)  # more than the whole tmpfs
        assert guard.stop_requested, "the loop still ends cleanly after the failure"
    finally:
        guard.close()
    error = info.value
    assert error.bytes_needed >= 64 * MiB and error.bytes_free <= 4 * MiB and error.path == vm.root
    assert not (vm.root / step_dir_name(6)).exists(), "no partial step directory is left"
    assert (vm.root / step_dir_name(5)).exists(), "nothing is dropped when dropping cannot make enough room"

    # The daemon heard of it: status (and the CLI's), metric, webhook.
    failure = wait_for(lambda: vm.status()["save_failures"], 10, "the daemon to record the failed save")[-1]
    assert (failure["step"], failure["reason"], failure["error"]) == (6, "urgent", "disk-full")
    assert (failure["bytes_needed"], failure["bytes_free"], failure["path"]) == (
        error.bytes_needed,
        error.bytes_free,
        str(vm.root),
    )
    shown = subprocess.run(
        [sys.executable, "-m", "spotguard", "status", "--socket", str(vm.socket)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "save failed: step 6 (urgent, disk-full)" in shown.stdout, shown.stdout
    metrics_url = vm.status()["metrics_url"]
    assert value(scrape(metrics_url), "spotguard_save_failures_total", reason="urgent", error="disk-full") == 1.0
    hook = wait_for(
        lambda: [m for m in receiver.messages() if m["type"] == "save-failed"], 10, "the save-failed webhook"
    )[0]
    assert (hook["step"], hook["error"], hook["bytes_needed"]) == (6, "disk-full", error.bytes_needed)
    assert hook["event_id"] == failure["event_id"] and hook["kind"] == "drill"

    # What the failed save had already sent ahead of its commit (small files go first) is removed from
    # the bucket: no object of step 6 stays, and verify of the bucket passes.
    wait_for(lambda: not step_objects(bucket, 6), 30, "the failed save's files to leave the bucket")
    verified = subprocess.run(
        [sys.executable, "-m", "spotguard", "verify", bucket], capture_output=True, text=True, timeout=60, check=False
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr

    # Not a byte left: the daemon's own state write (the event log) fails, is logged, the daemon runs on.
    fill(vm.dir.parent, leave=0, name="filler-2")
    request(vm.socket, "drill", deadline_s=120)
    assert vm.status()["pending"] is not None
    wait_for(  # the event log (events-<root>.json) is written off the daemon's loop
        lambda: any(
            "cannot write" in line and "/events-" in line and "No space left" in line
            for line in vm.log.read_text().splitlines()
        ),
        10,
        "the daemon to log the failed event-log write",
    )
    assert vm.status()["pending"] is not None  # and it still answers

    # Step 5 in the bucket is intact: a fresh VM (empty local disk, no daemon) resumes it.
    assert complete_steps(bucket) == [5]
    loaded = {"w": torch.zeros(6 * MiB // 4)}
    fresh = Guard(checkpoint_dir=tmp_path / "fresh", bucket=bucket, socket=tmp_path / "none.sock", handle_sigterm=False)
    try:
        assert fresh.resume(loaded) == 5
    finally:
        fresh.close()
    assert torch.equal(loaded["w"], state5["w"])


def test_a_failing_bucket_never_fills_the_disk_the_next_checkpoint_needs(
    tmpfs: Callable[[int], Path], tmp_path: Path
) -> None:
    """Uploads fail for good (the bucket's directory cannot be made): the daemon keeps room for one more
    checkpoint by dropping older ones that never reached the bucket, never the newest."""
    blocker = tmp_path / "blocked"
    blocker.write_text("a file where the bucket's directory should be")
    vm = Vm(tmpfs(40 * MiB), "vm", (blocker / "bucket").as_uri())
    vm.log = tmp_path / "daemon.log"
    vm.start_daemon()
    try:
        guard = connected_guard(vm)
        try:
            for step in range(1, 8):  # 7 checkpoints of 8 MiB on 40 MiB: the disk would be full by the 5th
                guard.save(tensors(8, seed=step), step, reason="urgent")
                # The daemon makes the room once it has handled the trainer's "saved" message.
                wait_for(lambda: shutil.disk_usage(vm.root).free >= 8 * MiB, 10, f"room for step {step + 1}")
                assert (vm.root / step_dir_name(step) / "manifest.json").exists()  # never the newest
        finally:
            guard.close()
        assert vm.status()["uploads"]["failures"], "the bucket really failed"
        assert "NOT in the bucket" in vm.log.read_text()
    finally:
        vm.kill_daemon()


def test_a_save_that_runs_out_of_room_mid_write_leaves_nothing_of_its_step_in_the_bucket(
    vm: Vm, bucket: str, tmp_path: Path
) -> None:
    guard = connected_guard(vm)
    try:
        step_5_in_the_bucket_then_a_full_disk(vm, guard, bucket)
        # The room check counts tensors: a large entry of plain bytes passes it and runs out of room
        # mid-write, after the small files (the RNG states, the note) were written and sent ahead.
        state = {"note": {"step": 7, "what": "small, written first"}, "blob": os.urandom(24 * MiB)}
        with pytest.raises(OSError):
            guard.save(state, 7)
    finally:
        guard.close()
    failure = wait_for(lambda: vm.status()["save_failures"], 10, "the daemon to record the failed save")[-1]
    assert failure["step"] == 7
    wait_for(lambda: not step_objects(bucket, 7), 30, "the failed save's files to leave the bucket")
    assert complete_steps(bucket) == [5]
    verified = subprocess.run(
        [sys.executable, "-m", "spotguard", "verify", bucket], capture_output=True, text=True, timeout=60, check=False
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "step-000000005: ok" in verified.stdout


def test_a_full_state_directory_stops_no_upload(tmpfs: Callable[[int], Path], tmp_path: Path, bucket: str) -> None:
    """The state directory lives on the root disk, which a VM running for months fills (logs, images,
    caches), not on the checkpoint disk. The upload journal there could not take a line, and every
    multipart upload was aborted for it: the urgent checkpoint never reached the bucket."""
    state = tmpfs(1 * MiB)
    # The socket (whose directory holds the journal's spare) on the same full disk: no line is written.
    vm = Vm(tmp_path, "vm", bucket, extra_args=["--provider", "none", "--state-dir", str(state)])
    vm.socket = state / "spotguard.sock"
    vm.extra_args += ["--socket", str(vm.socket)]
    vm.start_daemon()
    try:
        fill(state, leave=0)  # after the start, whose rewrite of the journal went in
        guard = connected_guard(vm)
        try:
            guard.save(tensors(40, seed=7), 7, reason="urgent")  # its file streamed as a multipart upload
            guard.save(tensors(20, seed=8), 8)
        finally:
            guard.close()
        wait_for(lambda: complete_steps(bucket) == [7, 8], 60, "steps 7 and 8 committed in the bucket")
        assert vm.status()["uploads"]["failures"] == []
    finally:
        vm.kill_daemon()
    log = vm.log.read_text()
    assert log.count("cannot record upload") == 1, log  # once, not once per file
    assert "Free space there" in log


def test_a_read_only_state_directory_stops_neither_the_daemon_nor_the_memory_of_a_handled_notice(
    tmpfs: Callable[[int], Path], tmp_path: Path, bucket: str
) -> None:
    """The kernel remounts a root filesystem read-only after an I/O error. The daemon then exited at every
    start (the upload journal's rewrite raised): no notice was watched for. And the event log of handled
    notices, in the state directory too, was lost: a daemon restarted for the same VM took a drill it had
    already checkpointed for as never seen. Both now go to the runtime directory meanwhile."""
    state = tmpfs(1 * MiB)
    make_read_only(state)
    vm = Vm(tmp_path, "vm", bucket, extra_args=["--provider", "none", "--state-dir", str(state)])
    vm.start_daemon()
    try:
        guard = connected_guard(vm)
        try:
            drill = request(vm.socket, "drill", deadline_s=120)
            wait_for(lambda: guard.should_checkpoint(3), 10, "the drill to reach the hook")
            guard.save(tensors(40, seed=3), 3, reason="urgent")  # its file streamed as a multipart upload
        finally:
            guard.close()
        wait_for(lambda: complete_steps(bucket) == [3], 60, "step 3 committed in the bucket")
        wait_for(lambda: (vm.status()["pending"] or {}).get("state") == "held", 10, "the drill held")
        vm.stop_daemon()
        vm.start_daemon()
        pending = vm.status()["pending"]
        assert pending is not None and pending["event_id"] == drill["event_id"] and pending["state"] == "held"
    finally:
        vm.kill_daemon()
    log = vm.log.read_text()
    assert log.count("the event log is kept in") == 1, log  # once, not once per write
    assert log.count("the upload journal is kept in") == 2, log  # once per daemon: each starts by rewriting it
    assert "cannot record upload" not in log and "may act on its notices again" not in log
