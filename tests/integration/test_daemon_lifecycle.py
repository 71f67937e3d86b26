"""Acceptance: daemon restarts are invisible to the training loop; uploads catch up; SIGTERM drains."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from spotguard import Guard
from spotguard.control import request
from spotguard.daemon.plan import PROBE_PREFIX
from spotguard.harness import Vm, wait_for
from spotguard.safefile import TMP_MARK
from spotguard.storage.base import put_bytes
from spotguard.storage.checkpoints import list_remote
from spotguard.storage.file import FileStorage
from tests.checkpoints import write_checkpoint


def committed(bucket: str) -> list[int]:
    return [i.step for i in list_remote(FileStorage(bucket)) if i.status == "complete"]


def test_hook_reconnects_and_checkpoint_saved_while_daemon_down_is_uploaded(vm: Vm, bucket: str) -> None:
    guard = Guard(checkpoint_dir=vm.root, socket=vm.socket, handle_sigterm=False)
    try:
        wait_for(guard.client.connected.is_set, 10, "the hook to connect")
        state = {"w": torch.arange(10.0)}
        guard.save(state, 1)
        wait_for(lambda: committed(bucket) == [1], 20, "step 1 in the bucket")

        vm.kill_daemon()
        wait_for(lambda: not guard.client.connected.is_set(), 10, "the hook to notice")
        # The loop goes on as if nothing happened: questions answer, saves commit locally.
        assert guard.should_checkpoint(2) is False
        guard.save(state, 2)
        assert committed(bucket) == [1]

        vm.start_daemon()
        wait_for(lambda: committed(bucket) == [1, 2], 20, "step 2 uploaded after the restart")
        wait_for(lambda: guard.client.connections >= 2 and guard.client.connected.is_set(), 10, "the reconnect")
        request(vm.socket, "drill", deadline_s=60)
        wait_for(lambda: guard.should_checkpoint(3), 10, "the drill to reach the hook")
        assert guard.stop_requested
    finally:
        guard.close()


def test_trainer_connecting_while_a_notice_is_pending_is_told_at_once(vm: Vm) -> None:
    request(vm.socket, "drill", deadline_s=60)
    guard = Guard(checkpoint_dir=vm.root, socket=vm.socket, handle_sigterm=False)
    try:
        wait_for(lambda: guard.should_checkpoint(1), 10, "the pending notice")
        assert guard.stop_requested
        assert guard.deadline is not None
    finally:
        guard.close()


def test_pending_notice_survives_daemon_restart_without_double_action(vm: Vm) -> None:
    reply = request(vm.socket, "drill", deadline_s=120)
    vm.stop_daemon()
    vm.start_daemon()
    status = request(vm.socket, "status")
    assert status["pending"]["event_id"] == reply["event_id"]
    guard = Guard(checkpoint_dir=vm.root, socket=vm.socket, handle_sigterm=False)
    try:
        wait_for(lambda: guard.should_checkpoint(1), 10, "the pending notice after restart")
        guard.save({"x": torch.ones(1)}, 1)
        assert not guard.should_checkpoint(2)  # acted on once
    finally:
        guard.close()


def test_sigterm_drains_uploads_and_exits_zero(vm_factory: Callable[..., Vm], bucket: str) -> None:
    vm = vm_factory("drain", start=False)
    # Several checkpoints already committed locally, none uploaded: the daemon must push them before exiting.
    guard = Guard(checkpoint_dir=vm.root, socket=vm.socket, handle_sigterm=False, keep=10)
    try:
        for step in (1, 2, 3):
            guard.save({"w": torch.full((1 << 16,), float(step))}, step)
    finally:
        guard.close()
    vm.start_daemon(env={"SPOTGUARD_SCAN_INTERVAL": "3600"})
    assert vm.process is not None
    vm.process.send_signal(signal.SIGTERM)
    assert vm.process.wait(timeout=60) == 0
    vm.process = None
    assert committed(bucket) == [1, 2, 3]


def test_sighup_is_logged_and_the_daemon_keeps_serving(vm: Vm) -> None:
    """SIGHUP's default action ended the daemon at once (exit 129), uploads unfinished and the socket
    left behind; tools and admins send it to mean "reload"."""
    assert vm.process is not None
    vm.process.send_signal(signal.SIGHUP)
    wait_for(lambda: "SIGHUP: the configuration is read at start only" in vm.log.read_text(), 10, "the SIGHUP line")
    assert vm.process.poll() is None
    reply = request(vm.socket, "drill", deadline_s=30)
    assert reply["type"] == "ok" and vm.status()["pending"]["kind"] == "drill"


def test_trainer_without_daemon_saves_on_sigterm_and_resumes(tmp_path: Path) -> None:
    script = """
import sys, torch, json
from spotguard import Guard
guard = Guard(checkpoint_dir=sys.argv[1], socket=sys.argv[1] + "/none.sock")
state = {"w": torch.zeros(3)}
step = guard.resume(state)
print(json.dumps({"resumed": step}), flush=True)
while step < 10**9:
    state["w"] += 1
    step += 1
    if step == 5:
        print(json.dumps({"ready": step}), flush=True)
    if guard.should_checkpoint(step):
        guard.save(state, step)
        print(json.dumps({"saved": step, "w": state["w"].tolist()}), flush=True)
    if guard.stop_requested:
        break
"""
    root = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-c", script, str(root)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    lines = iter(proc.stdout)
    assert json.loads(next(lines)) == {"resumed": 0}
    assert "ready" in json.loads(next(lines))
    proc.send_signal(signal.SIGTERM)
    saved = json.loads(next(lines))
    assert proc.wait(timeout=30) == 0
    assert saved["w"] == [float(saved["saved"])] * 3

    again = subprocess.Popen([sys.executable, "-c", script, str(root)], stdout=subprocess.PIPE, text=True)
    assert again.stdout is not None
    try:
        assert json.loads(again.stdout.readline()) == {"resumed": saved["saved"]}
    finally:
        again.kill()
        again.wait()


def test_daemon_speaks_sd_notify_ready_watchdog_stopping(vm_factory: Callable[..., Vm], tmp_path: Path) -> None:
    import socket as sockets

    notify = sockets.socket(sockets.AF_UNIX, sockets.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    notify.settimeout(20)
    vm = vm_factory("sd", start=False)
    try:
        # WATCHDOG_USEC without WATCHDOG_PID: pings every half period, i.e. every 0.1 s.
        vm.start_daemon(env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "200000"})
        messages: list[str] = []
        while not any(m.startswith("WATCHDOG=1") for m in messages):
            messages.append(notify.recv(4096).decode())
        assert messages[0].startswith("READY=1") and "STATUS=watching none" in messages[0]
        assert vm.process is not None
        vm.process.send_signal(signal.SIGTERM)
        while not any("STOPPING=1" in m for m in messages):
            messages.append(notify.recv(4096).decode())
        assert vm.process.wait(timeout=30) == 0
        vm.process = None
    finally:
        notify.close()


class Gate:
    """A state entry whose state_dict() waits until the test opens it: holds a save mid-way."""

    def __init__(self) -> None:
        import threading

        self.open = threading.Event()

    def state_dict(self) -> dict[str, int]:
        assert self.open.wait(30)
        return {"x": 1}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


def test_finished_files_upload_while_the_rest_is_still_being_written(vm: Vm, bucket: str) -> None:
    import threading

    storage = FileStorage(bucket)
    guard = Guard(checkpoint_dir=vm.root, socket=vm.socket, handle_sigterm=False)
    gate = Gate()
    try:
        wait_for(guard.client.connected.is_set, 10, "the hook to connect")
        state = {"weights": torch.arange(1e5), "gate": gate}
        saver = threading.Thread(target=guard.save, args=(state, 7), kwargs={"reason": "urgent"})
        saver.start()
        # weights.pt is finished, gate.pt is not: the first must reach the bucket before any commit.
        wait_for(lambda: storage.stat("step-000000007/weights.pt") is not None, 20, "weights.pt uploaded early")
        assert not (vm.root / "step-000000007" / "manifest.json").exists()
        assert storage.stat("step-000000007/manifest.json") is None
        assert [i.status for i in list_remote(storage)] == ["incomplete"]
        gate.open.set()
        saver.join(30)
        wait_for(lambda: committed(bucket) == [7], 20, "the commit in the bucket")
    finally:
        gate.open.set()
        guard.close()


def run_second_daemon(vm: Vm, socket: Path, state_dir: Path) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable, "-m", "spotguard", "run", "--provider", "none", "--socket", str(socket),
        "--checkpoint-dir", str(vm.root), "--state-dir", str(state_dir), "--bucket", vm.bucket,
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def test_a_second_daemon_on_the_same_root_and_state_exits_naming_the_holder(
    vm_factory: Callable[..., Vm], tmp_path: Path
) -> None:
    """Two daemons on one root and state directory uploaded what the other had pruned and pruned what
    the other was uploading; with S3 the second's start would abort the first's live multipart
    uploads. (Daemons of several VMs sharing one root on a shared disk, each with its own state
    directory, are a setup of their own: tests/e2e/test_distributed.py.)"""
    first = vm_factory("vm-a")
    assert first.process is not None
    same_state = run_second_daemon(first, tmp_path / "second.sock", first.dir / "state")
    assert same_state.returncode == 1, same_state.stderr
    assert same_state.stderr.startswith(
        f"spotguard: another spotguard daemon (pid {first.process.pid}) holds the state directory {first.dir / 'state'}"
    ), same_state.stderr
    assert not (tmp_path / "second.sock").exists()  # refused before it listened
    # Another root beside it may share the state directory: each root's state is its own.
    beside = vm_factory("vm-b", extra_args=["--provider", "none", "--state-dir", str(first.dir / "state")])
    assert beside.process is not None and beside.status()["pid"] == beside.process.pid
    # A daemon killed outright holds nothing: the kernel drops its locks with the process.
    first.kill_daemon()
    first.start_daemon()
    assert first.process is not None and first.status()["pid"] == first.process.pid


def test_what_a_killed_daemon_left_in_a_file_bucket_is_removed_after_its_restart(
    vm_factory: Callable[..., Vm], bucket: str
) -> None:
    """Killed mid-copy, and between a rate probe's upload and its delete, a daemon left a temporary
    file and a 1 MiB probe object in the bucket for good: listings skip the one, nothing swept the other."""
    vm = vm_factory("leftovers", start=False)
    storage = FileStorage(bucket)
    put_bytes(storage, f"{PROBE_PREFIX}/left.bin", b"p" * 1024)
    put_bytes(storage, f"{PROBE_PREFIX}/fresh.bin", b"p" * 1024)  # another daemon's, probing now
    two_hours_ago = time.time() - 2 * 3600
    os.utime(storage.root / PROBE_PREFIX / "left.bin", (two_hours_ago, two_hours_ago))
    write_checkpoint(vm.root, 1, {"model.pt": b"m" * 4096})
    cut_copy = storage.root / "step-000000001" / f".model.pt{TMP_MARK}19545"  # killed a moment ago
    cut_copy.parent.mkdir()
    cut_copy.write_bytes(b"m" * 1024)

    vm.start_daemon(env={"SPOTGUARD_KEEP_REMOTE": "1", "SPOTGUARD_KEEP_LOCAL": "1"})
    # Swept at start, after the first metadata check (ages are the cloud's time), so maybe after it
    # answers; both probes are judged in one sweep, and the young one may be in use.
    wait_for(lambda: not (storage.root / PROBE_PREFIX / "left.bin").exists(), 30, "the old probe swept")
    assert (storage.root / PROBE_PREFIX / "fresh.bin").exists()
    wait_for(lambda: committed(bucket) == [1], 30, "step 1 in the bucket")
    assert cut_copy.exists()  # young, in a checkpoint still kept: it may be another node's copy
    write_checkpoint(vm.root, 2, {"model.pt": b"n" * 4096})
    wait_for(lambda: committed(bucket) == [2], 30, "step 2 in the bucket, step 1 pruned")
    wait_for(lambda: not cut_copy.parent.exists(), 30, "step 1's directory to go, its temporary file with it")
