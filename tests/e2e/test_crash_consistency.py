"""Acceptance: a trainer SIGKILLed at random moments inside save never leaves a checkpoint that
resume loads partially; leftovers list as incomplete; verify catches a single flipped byte."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from spotguard import Guard
from spotguard.localstore import scan_local
from spotguard.manifest import verify_dir

# Saves back to back, so a kill at a random time lands inside a save; each entry holds the step
# number everywhere, so a checkpoint mixing two saves cannot pass the check below. Importing torch
# takes seconds: the parent imports it once and forks one writer per line on stdin; the writer
# prints "ready PID" once it has resumed, and is the process that gets SIGKILLed.
WRITER = """
import os, sys, torch
from spotguard import Guard
torch.set_num_threads(1)  # no OpenMP pool in the parent for the forks to break
torch.full((1,), 0.0)
for _ in sys.stdin:
    pid = os.fork()
    if pid == 0:
        guard = Guard(checkpoint_dir=sys.argv[1], socket=sys.argv[1] + "/none.sock", keep=3, handle_sigterm=False)
        start = guard.resume({"a": torch.zeros(1 << 20), "b": torch.zeros(1 << 19), "meta": {}}) + 1
        print("ready", os.getpid(), flush=True)
        for step in range(start, start + 10**6):
            a, b = torch.full((1 << 20,), float(step)), torch.full((1 << 19,), float(step))
            guard.save({"a": a, "b": b, "meta": {"step": step}}, step)
    os.waitpid(pid, 0)
    print("reaped", pid, flush=True)
"""
KILLS = 20


def check_loadable(root: Path) -> int:
    """Resume in this process: the state must be one whole save, never a mix."""
    state = {"a": torch.zeros(1 << 20), "b": torch.zeros(1 << 19), "meta": {}}
    guard = Guard(checkpoint_dir=root, socket=root / "none.sock", handle_sigterm=False)
    try:
        step = guard.resume(state)
    finally:
        guard.close()
    if step:
        assert state["meta"] == {"step": step}
        assert torch.equal(state["a"], torch.full((1 << 20,), float(step)))
        assert torch.equal(state["b"], torch.full((1 << 19,), float(step)))
    return step


@pytest.mark.slow
def test_sigkill_during_save_never_leaves_a_partial_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    rng = random.Random(1234)
    steps_seen = []
    incomplete_seen = 0
    writers = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(root)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert writers.stdin is not None and writers.stdout is not None
    for _ in range(KILLS):
        writers.stdin.write("go\n")
        writers.stdin.flush()
        ready, pid = writers.stdout.readline().split()
        assert ready == "ready", ready
        time.sleep(rng.uniform(0.0, 0.4))  # the kill point: random, not a synchronisation
        os.kill(int(pid), signal.SIGKILL)
        assert writers.stdout.readline().split() == ["reaped", pid]
        for info in scan_local(root):
            if info.status == "complete":
                assert verify_dir(root / info.name) == [], info.name
            else:
                incomplete_seen += 1
        steps_seen.append(check_loadable(root))
    writers.stdin.close()
    assert writers.wait(timeout=30) == 0
    assert steps_seen == sorted(steps_seen) and steps_seen[-1] > 0  # progress survives every kill
    assert incomplete_seen > 0  # the kills did land inside saves

    listing = subprocess.run(
        [sys.executable, "-m", "spotguard", "list", str(root), "--json"], capture_output=True, text=True, check=True
    )
    rows = json.loads(listing.stdout)
    assert {row["status"] for row in rows} <= {"complete", "incomplete"}
    assert [r["name"] for r in rows if r["status"] == "incomplete"] == [
        i.name for i in scan_local(root) if i.status == "incomplete"
    ]


def test_verify_exits_nonzero_on_one_flipped_byte(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    guard = Guard(checkpoint_dir=root, socket=tmp_path / "none.sock", handle_sigterm=False)
    try:
        step_dir = guard.save({"w": torch.arange(10000.0)}, 3)
    finally:
        guard.close()
    ok = subprocess.run(
        [sys.executable, "-m", "spotguard", "verify", str(root)], capture_output=True, text=True, check=False
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    payload = step_dir / "w.pt"
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0x01
    payload.write_bytes(bytes(data))
    for location in (str(root), str(step_dir)):
        bad = subprocess.run(
            [sys.executable, "-m", "spotguard", "verify", location], capture_output=True, text=True, check=False
        )
        assert bad.returncode == 1
        assert "step-000000003: FAILED" in bad.stdout and "crc32c" in bad.stdout
