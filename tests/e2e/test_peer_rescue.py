"""Acceptance: a checkpoint too big for the bucket before the deadline is rescued by a peer.

Two daemons on 127.0.0.1 stand for two VMs of one job; the bucket (moto) is behind a relay pacing
each connection to 1 MB/s. A trainer on VM A holds a 400 MiB state (in 8 files, handed over each
as soon as it is written); a drill gives A 10 s. A's plan
routes the checkpoint to B, A hands it over before the deadline, and at the deadline A is SIGKILLed
and its disk deleted. B commits the checkpoint in the bucket; a fresh process resumes that urgent
step and ends bit for bit where an uninterrupted run ends.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotguard import control
from spotguard.harness import Vm, compare_final, wait_for
from spotguard.storage.checkpoints import list_remote
from spotguard.storage.s3 import S3Storage
from tests.pacedrelay import PacedRelay
from tests.preloaded import popen
from tests.servers import S3Server, moto_s3, point_at

STATE_MIB = 400
STEPS = 20
K = 7  # the urgent step
DEADLINE = 10.0
TOKEN = "the-job-s-peer-token-0123456789abcdef"


def trainer(root: Path, socket: Path, bucket: str | None, out: Path | None, **extra: object) -> list[str]:
    command = [sys.executable, "-m", "tests.e2e.peer_trainer", "--checkpoint-dir", str(root), "--socket", str(socket)]
    command += ["--steps", str(STEPS), "--ballast-mib", str(STATE_MIB)]
    command += ["--bucket", bucket] if bucket else []
    command += ["--out", str(out)] if out else []
    for key, value in extra.items():
        command += [f"--{key.replace('_', '-')}", str(value)]
    return command


def run_to_end(command: list[str], env: dict[str, str] | None = None) -> list[dict[str, object]]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.fixture
def server() -> Iterator[S3Server]:
    with moto_s3() as s3:
        yield s3


@pytest.mark.slow
def test_a_peer_rescues_an_urgent_checkpoint_the_bucket_cannot_take_in_time(
    tmp_path: Path, server: S3Server, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    url = point_at(server, monkeypatch)
    direct = {**os.environ, "AWS_ENDPOINT_URL_S3": server.endpoint_url}  # the fresh VM reads the bucket directly
    reference = tmp_path / "reference.pt"
    # The uninterrupted run goes on alongside the rest (each process uses one thread).
    uninterrupted = popen(
        trainer(tmp_path / "ref-nvme", tmp_path / "none.sock", None, reference), stdout=subprocess.DEVNULL
    )
    request.addfinalizer(uninterrupted.kill)  # a no-op once it has ended

    with PacedRelay(server.endpoint_url, 1_000_000) as relay:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", relay.url)
        monkeypatch.setenv("SPOTGUARD_PEER_TOKEN", TOKEN)
        vm_b = Vm(tmp_path, "vm-b", url, extra_args=["--provider", "none", "--peer-listen", "127.0.0.1:0"])
        vm_b.start_daemon(env={"SPOTGUARD_UPLOAD_CONCURRENCY": "48"})  # a VM with more streams to the bucket
        request.addfinalizer(vm_b.kill_daemon)  # also when the handoff's checks fail before B's own block
        vm_a = Vm(tmp_path, "vm-a", url, extra_args=["--provider", "none", "--peers", vm_b.status()["peers"]["listen"]])
        vm_a.start_daemon()
        train_a: subprocess.Popen[str] | None = None
        try:
            wait_for(lambda: vm_a.status()["upload_rate_bytes_s"], 30, "A's upload-rate probe")
            train_a = popen(trainer(vm_a.root, vm_a.socket, url, None, wait_notice_at=K), stdout=subprocess.PIPE)
            assert train_a.stdout is not None
            for line in train_a.stdout:
                if line.startswith("{") and json.loads(line)["event"] == "waiting":
                    break
            control.request(vm_a.socket, "drill", deadline_s=DEADLINE)
            deadline = time.monotonic() + DEADLINE

            handed = wait_for(
                lambda: (h := vm_a.status()["peers"]["handoff"])["state"] in ("handed", "failed") and h,
                DEADLINE,
                "A to hand its checkpoint to B",
            )
            assert handed["state"] == "handed", handed
            assert handed["name"] == f"step-{K:09d}" and handed["bytes_sent"] > STATE_MIB << 20
            plan = vm_a.status()["plan"]
            assert plan["route"] == "peer" and plan["bytes"] > STATE_MIB << 20
            assert time.monotonic() < deadline  # handed over before the deadline

            # The deadline: the VM is gone, and its disk with it.
            time.sleep(max(0.0, deadline - time.monotonic()))  # waiting for the deadline itself
            vm_a.kill_daemon()  # SIGKILL
            train_a.kill()
            shutil.copy(vm_a.log, tmp_path / "vm-a.log")  # kept for the timeline, off the deleted disk
            shutil.rmtree(vm_a.dir)
        finally:
            if train_a is not None:
                train_a.kill()
                train_a.wait()
            vm_a.kill_daemon()

        try:
            storage = S3Storage(url)
            try:
                committed = wait_for(
                    lambda: [i.name for i in list_remote(storage) if i.status == "complete"], 240, "B's commit"
                )
            finally:
                storage.close()
            assert committed == [f"step-{K:09d}"]
            wait_for(lambda: vm_b.status()["peers"]["replicas"] == [], 30, "B to drop the committed replica")
        finally:
            vm_b.kill_daemon()

    assert uninterrupted.wait(timeout=300) == 0
    resumed = tmp_path / "resumed.pt"
    events = run_to_end(trainer(tmp_path / "fresh-nvme", tmp_path / "none.sock", url, resumed), env=direct)
    assert events[0] == {**events[0], "event": "resumed", "step": K}
    assert events[-1] == {**events[-1], "event": "finished", "step": STEPS}
    assert compare_final(reference, resumed) == []
