"""Acceptance: a daemon's notices are its own (scoped to its checkpoint root), and every notice ends.

Real daemons in subprocesses, real sockets, a real ``Guard`` in this process.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import subprocess
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from spotguard import Guard
from spotguard.cli import request
from spotguard.config import DaemonConfig
from spotguard.daemon.app import Daemon
from spotguard.daemon.notices import EventLog
from spotguard.harness import Vm, daemon_answers, wait_for
from spotguard.notice import parse_iso
from spotguard.storage.checkpoints import list_remote
from spotguard.storage.file import FileStorage


def test_a_drill_is_replayed_only_to_a_restarted_daemon_of_the_same_root(
    vm_factory: Callable[..., Vm], tmp_path: Path
) -> None:
    # Two jobs on one host: one state directory (as /var/lib/spotguard/state is), two roots, two sockets.
    shared = ["--provider", "none", "--state-dir", str(tmp_path / "shared-state")]
    first = vm_factory("job-a", extra_args=shared)
    second = vm_factory("job-b", extra_args=shared)
    drill = request(first.socket, "drill", deadline_s=120)
    assert first.status()["pending"]["event_id"] == drill["event_id"]

    second.stop_daemon()
    second.start_daemon()
    assert second.status()["pending"] is None
    assert "still pending from before a restart" not in second.log.read_text()
    # A trainer of the other job that connects now is not told anything either: it saves periodically,
    # and its save is answered without a notice in between.
    guard = Guard(checkpoint_dir=second.root, socket=second.socket, handle_sigterm=False)
    try:
        wait_for(guard.client.welcomed.is_set, 10, "the other job's trainer to be welcomed")
        assert not guard.should_checkpoint(1) and not guard.stop_requested
    finally:
        guard.close()

    first.stop_daemon()
    first.start_daemon()
    pending = first.status()["pending"]
    assert pending is not None and pending["event_id"] == drill["event_id"]
    assert "still pending from before a restart" in first.log.read_text()
    # One event log per root in the shared directory; the drill is in the first job's only.
    logs = {vm.dir.name: EventLog.path_for(tmp_path / "shared-state", vm.root) for vm in (first, second)}
    assert logs["job-a"] != logs["job-b"]
    assert drill["event_id"] in json.loads(logs["job-a"].read_text())["events"]
    assert not logs["job-b"].exists() or drill["event_id"] not in logs["job-b"].read_text()


def status_text(vm: Vm) -> str:
    """What ``spotguard status`` prints."""
    command = [sys.executable, "-m", "spotguard", "status", "--socket", str(vm.socket)]
    done = subprocess.run(command, check=False, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def committed_steps(bucket: str) -> list[int]:
    return [i.step for i in list_remote(FileStorage(bucket)) if i.status == "complete"]


def test_a_drill_the_vm_outlives_is_held_then_over_and_training_goes_back_to_normal(
    vm_factory: Callable[..., Vm], bucket: str
) -> None:
    vm = vm_factory("outlived", env={"SPOTGUARD_NOTICE_GRACE": "4"})
    state = {"w": torch.arange(4.0)}
    first = Guard(checkpoint_dir=vm.root, socket=vm.socket, handle_sigterm=False)
    try:
        wait_for(first.client.welcomed.is_set, 10, "the trainer to be welcomed")
        drill = request(vm.socket, "drill", deadline_s=3)
        wait_for(lambda: first.should_checkpoint(1), 10, "the drill to reach the trainer")
        assert first.stop_requested
        first.save(state, 1)
    finally:
        first.close()
    seen: list[dict[str, Any]] = []

    def notice_state() -> str | None:
        seen.append(vm.status())
        pending = seen[-1]["pending"]
        return None if pending is None else str(pending["state"])

    wait_for(lambda: notice_state() == "held", 10, "the drill to be held once its checkpoint is committed")
    assert ", held, " in status_text(vm)
    # Held: the VM is still going away, so a trainer that starts now is told to stop as well.
    second = Guard(checkpoint_dir=vm.root, socket=vm.socket, handle_sigterm=False)
    try:
        wait_for(lambda: second.should_checkpoint(1), 10, "the held drill to reach a new trainer")
        assert second.stop_requested
    finally:
        second.close()

    wait_for(lambda: notice_state() is None, 30, "the drill to be over")
    last = seen[-1]["last_notice"]
    assert last["event_id"] == drill["event_id"] and last["state"] == "over"
    assert parse_iso(last["over_at"]) >= parse_iso(last["deadline"]) + timedelta(seconds=4)
    assert all(s["pending"]["seconds_left"] >= 0 and s["pending"]["over_in_s"] >= 0 for s in seen if s["pending"])
    assert [s["pending"]["state"] for s in seen if s["pending"]][-1] == "held"
    assert vm.log.read_text().count("outlived its deadline") == 1
    assert "notice: none" in status_text(vm)

    # Past deadline + grace a trainer trains normally: periodic saves, uploaded in time, never told to stop.
    third = Guard(checkpoint_dir=vm.root, socket=vm.socket, handle_sigterm=False, every_steps=2)
    try:
        wait_for(third.client.welcomed.is_set, 10, "the trainer to be welcomed")
        for step in range(1, 5):
            if third.should_checkpoint(step):
                third.save(state, step)
            assert not third.stop_requested
        wait_for(lambda: committed_steps(bucket) == [1, 2, 4], 20, "the periodic checkpoints in the bucket")
        assert not third.should_checkpoint(5) and not third.stop_requested
    finally:
        third.close()
    log = vm.log.read_text()
    assert "AFTER the deadline" not in log and "failed" not in log, log

    # A daemon restarted after that does not replay it.
    vm.stop_daemon()
    before = len(vm.log.read_bytes())
    vm.start_daemon()
    assert vm.status()["pending"] is None
    assert "from before a restart" not in vm.log.read_bytes()[before:].decode()
    events = json.loads(EventLog.path_for(vm.dir / "state", vm.root).read_text())["events"]
    assert events[drill["event_id"]]["state"] == "over" and events[drill["event_id"]]["saved_step"] == 1


class FlakyCommitStorage(FileStorage):
    """A real file:// bucket whose next manifest upload fails once with EIO (a transient fault)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.fail_next_commit = threading.Event()
        self.failed: list[str] = []

    def put_bytes_if_absent(self, key: str, data: bytes, *, crc32c: str) -> None:
        # Manifests are created conditionally: this is the commit.
        if key.endswith("/manifest.json") and self.fail_next_commit.is_set():
            self.fail_next_commit.clear()
            self.failed.append(key)
            raise OSError(errno.EIO, "injected transient fault", key)
        super().put_bytes_if_absent(key, data, crc32c=crc32c)


def test_after_a_notice_is_over_a_periodic_upload_gets_its_retries_and_is_not_late(
    tmp_path: Path, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    config = DaemonConfig(
        provider="none",
        socket=tmp_path / "daemon.sock",
        checkpoint_dir=tmp_path / "nvme",
        state_dir=tmp_path / "state",
        bucket=bucket,
        scan_interval=0.5,
        notice_grace=0.5,
    )
    storage = FlakyCommitStorage(bucket)
    daemon = Daemon(config, provider="none", storage=storage)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(daemon.serve_until_stopped(),))
    thread.start()
    guard = None
    try:
        wait_for(lambda: daemon_answers(config.socket), 10, "the daemon to answer")
        guard = Guard(checkpoint_dir=config.checkpoint_dir, socket=config.socket, handle_sigterm=False)
        state = {"w": torch.arange(4.0)}
        wait_for(guard.client.welcomed.is_set, 10, "the trainer to be welcomed")
        request(config.socket, "drill", deadline_s=1)
        wait_for(lambda: guard is not None and guard.should_checkpoint(1), 10, "the drill")
        guard.save(state, 1)
        wait_for(lambda: committed_steps(bucket) == [1], 20, "the drill's checkpoint in the bucket")
        wait_for(lambda: request(config.socket, "status")["last_notice"]["state"] == "over", 20, "the drill to end")

        storage.fail_next_commit.set()
        guard.save(state, 2, reason="periodic")
        wait_for(lambda: committed_steps(bucket) == [1, 2], 20, "the periodic checkpoint in the bucket")
    finally:
        if guard is not None:
            guard.close()
        loop.call_soon_threadsafe(daemon.request_stop)
        thread.join(60)
        loop.close()
    assert storage.failed == ["step-000000002/manifest.json"]  # the fault happened, and was retried
    assert daemon.uploader.failures == []
    assert daemon.uploader.last_committed is not None and daemon.uploader.last_committed["deadline_margin_s"] is None
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "step-000000002" in m and ("failed" in m or "AFTER the deadline" in m)]


def test_a_drill_without_a_deadline_gives_the_configured_drill_deadline(
    vm_factory: Callable[..., Vm], tmp_path: Path
) -> None:
    config = tmp_path / "spotguard.toml"
    config.write_text("drill_deadline = 45.0\n")
    vm = vm_factory("drill-deadline", extra_args=["--config", str(config)])
    command = [sys.executable, "-m", "spotguard", "drill", "--socket", str(vm.socket)]
    done = subprocess.run(command, check=False, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "deadline in 45 s" in done.stdout
    pending = vm.status()["pending"]
    assert pending is not None
    assert 40.0 < pending["seconds_left"] <= 45.0
