"""A Guard built under torchrun before ``init_process_group`` refuses to act as rank 0 of 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# A worker that fails makes torchrun stop the others: each waits (bounded) until both have answered,
# so that both answers are seen however the two are scheduled.
SCRIPT = """
import os, sys, time
from pathlib import Path
from spotguard import Guard
def answered():
    Path(sys.argv[1] + ".answered-" + os.environ["LOCAL_RANK"]).touch()
    deadline = time.monotonic() + 30
    while len(list(Path(sys.argv[1]).parent.glob("*.answered-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
try:
    Guard(checkpoint_dir=sys.argv[1], socket=sys.argv[2], daemon_wait=0.1)
except RuntimeError as exc:
    print("REFUSED:", exc, flush=True)
    answered()
    sys.exit(3)
print("BUILT", flush=True)
answered()
"""


@pytest.mark.slow
def test_guard_before_init_process_group_raises_under_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"),
        *(str(script), str(tmp_path / "ckpt"), str(tmp_path / "no.sock")),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert output.count("REFUSED:") == 2, output  # both workers, each with the reason
    assert "BUILT" not in output
    assert "WORLD_SIZE=2" in output and "init_process_group" in output
    assert not any((tmp_path / "ckpt").glob("step-*"))


def test_guard_in_a_single_process_is_unaffected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from spotguard import Guard

    monkeypatch.setenv("WORLD_SIZE", "1")
    guard = Guard(checkpoint_dir=tmp_path, socket=tmp_path / "no.sock", daemon_wait=0.1)
    guard.close()
    assert guard.world_size == 1
