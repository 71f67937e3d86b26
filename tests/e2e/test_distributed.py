"""Distributed acceptance: ranks agree on the stop step, sharded (DCP) checkpoints resume bit for bit,
and a checkpoint saved by 2 ranks loads into 1 and into 4 (resharding)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from spotguard.cli import request
from spotguard.demo import Vm, compare_final, wait_for
from spotguard.manifest import load_manifest, scan_local

STEPS = 20  # 8 steps per epoch per rank with 2 ranks


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(world: int, *args: str, on_event: Callable[[dict], None] | None = None) -> list[dict]:
    """Run the trainer with ``world`` ranks (one process each); returns rank 0's events."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world)}
    command = [sys.executable, "-m", "tests.e2e.dist_trainer", *args]
    procs = [
        subprocess.Popen(
            command, env={**env, "RANK": str(r)}, stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL, text=True
        )
        for r in range(world)
    ]
    events = []
    assert procs[0].stdout is not None
    for line in procs[0].stdout:
        event = json.loads(line)
        events.append(event)
        if on_event:
            on_event(event)
    codes = [proc.wait(timeout=120) for proc in procs]
    assert codes == [0] * world
    return events


@pytest.mark.slow
def test_ddp_notice_on_one_rank_saves_same_step_everywhere_and_resumes_bitwise(
    vm_factory: Callable[..., Vm], bucket: str, tmp_path: Path
) -> None:
    reference = tmp_path / "reference.pt"
    launch(2, "--root", str(tmp_path / "ref"), "--steps", str(STEPS), "--out", str(reference))

    # Two daemons, as on two VMs; both ranks write to one shared checkpoint root (a shared disk).
    vm_a, vm_b = vm_factory("vm-a"), vm_factory("vm-b", start=False)
    vm_b.root = vm_a.root
    vm_b.start_daemon()
    k = 6

    def drill_rank1(event: dict) -> None:
        if event["event"] == "step" and event["step"] == k:
            request(vm_b.socket, "drill", deadline_s=120)  # only rank 1's daemon hears of it

    events = launch(
        2, "--root", str(vm_a.root), "--bucket", bucket, "--sockets", f"{vm_a.socket},{vm_b.socket}",
        "--steps", str(STEPS), "--notice-at", str(k), on_event=drill_rank1,
    )  # fmt: skip
    assert [e["step"] for e in events if e["event"] == "saved"] == [k]
    assert events[-1]["event"] == "stopped"
    manifest = load_manifest(vm_a.root / f"step-{k:09d}")
    assert manifest.meta["layout"] == "dcp" and manifest.world_size == 2
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "loader.rank0.pt", "loader.rank1.pt"} <= set(manifest.files)
    wait_for(lambda: (s := vm_a.status()["uploads"]["last_committed"]) and s["step"] == k, 30, "the bucket commit")
    vm_a.stop_daemon()
    vm_b.stop_daemon()

    fresh = tmp_path / "fresh-vm"
    resumed = tmp_path / "resumed.pt"
    events = launch(2, "--root", str(fresh), "--bucket", bucket, "--steps", str(STEPS), "--out", str(resumed))
    assert events[0] == {"event": "resumed", "step": k}
    assert compare_final(reference, resumed) == []


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 4])
def test_checkpoint_saved_by_two_ranks_reshards(world: int, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    saved = tmp_path / "saved.pt"
    launch(2, "--root", str(root), "--steps", "12", "--every-steps", "12", "--dump-saved", str(saved))
    [info] = scan_local(root)
    assert (info.step, info.status) == (12, "complete")
    assert load_manifest(root / info.name).meta["world_size"] == 2

    loaded = tmp_path / "loaded.pt"
    events = launch(world, "--root", str(root), "--steps", "14", "--dump-loaded", str(loaded))
    assert events[0] == {"event": "resumed", "step": 12}
    assert events[-1] == {"event": "finished", "step": 14}  # and training goes on
    assert compare_final(saved, loaded) == []  # every parameter and optimizer tensor as saved
    assert torch.load(loaded, weights_only=True)["model"]
