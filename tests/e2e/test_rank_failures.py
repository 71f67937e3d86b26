"""A failure on one rank reaches every rank within seconds, with the same message, instead of a hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on a read-only tmpfs: even root cannot write there."""
    path = tmp_path / "readonly-nvme"
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], check=False)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (tests need root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.mark.slow
def test_a_rank_whose_write_fails_takes_every_rank_down_with_the_same_error(
    tmp_path: Path, read_only_dir: Path
) -> None:
    good = tmp_path / "nvme0"
    env = {**os.environ, "WORLD_SIZE": "2", "RENDEZVOUS_FILE": str(tmp_path / "rendezvous")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.e2e.dist_failure", f"{good},{read_only_dir}"],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outcomes = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=60)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            assert lines, f"rank printed nothing; stderr:\n{err}"
            outcomes.append(json.loads(lines[-1]))
    finally:
        for proc in procs:
            proc.kill()
    assert [o["raised"] for o in outcomes] == ["RankFailed", "RankFailed"], outcomes
    assert outcomes[0]["message"] == outcomes[1]["message"]
    message = outcomes[0]["message"]
    assert "rank 1" in message and "rank 0:" not in message
    assert "Read-only file system" in message
    assert all(o["seconds"] < 10 for o in outcomes), outcomes
    assert not (good / "step-000000005" / "manifest.json").exists()  # nothing half-written counts
