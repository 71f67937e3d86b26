"""Checkpoints written by spotguard 0.1 (tests/data/checkpoints-0.1, made by make_old_checkpoints.py)
still load bit for bit, from the local root and from a bucket, and ``spotguard verify`` passes them.

Each resume goes into a state built from another seed, so every value compared was loaded."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from spotguard import Guard
from spotguard.cli import main as cli
from spotguard.harness import compare_final
from tests.data.make_old_checkpoints import OUT, STEP, build_state, draws
from tests.preloaded import popen

STEP_DIR = f"step-{STEP:09d}"


def copy_of(layout: str, root: Path) -> Path:
    """The fixture's checkpoint under ``root`` (a checkpoint root or a file:// bucket); never the original."""
    shutil.copytree(OUT / layout / STEP_DIR, root / STEP_DIR)
    return root


def resume(root: Path, bucket: str | None = None) -> tuple[int, dict[str, Any]]:
    state = build_state(99)
    guard = Guard(checkpoint_dir=root, bucket=bucket, socket=root / "none.sock", handle_sigterm=False)
    try:
        step = guard.resume(state)
    finally:
        guard.close()
    return step, state


def loaded(state: dict[str, Any], *, by_name: bool) -> dict[str, Any]:
    """What ``state`` holds now, in the form the fixture's expected-*.pt saved it."""
    if by_name:  # DCP fixtures: model and optimizer keyed by parameter name
        model, optimizer = get_state_dict(state["model"], state["optimizer"])
    else:
        model, optimizer = state["model"].state_dict(), state["optimizer"].state_dict()
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": state["scheduler"].state_dict(),
        "counts": state["counts"],
        "extra": state["extra"],
        "draws": draws(),  # taken right after the resume: the RNG states must be the saved ones
    }


def assert_as_saved(state: dict[str, Any], expected: Path, tmp_path: Path, *, by_name: bool = False) -> None:
    actual = tmp_path / "actual.pt"
    torch.save(loaded(state, by_name=by_name), actual)
    assert compare_final(expected, actual) == []


@pytest.mark.parametrize("source", ["local", "bucket"])
def test_a_single_process_checkpoint_of_0_1_resumes_bitwise(source: str, tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    if source == "local":
        step, state = resume(copy_of("single", nvme))
    else:
        bucket = copy_of("single", tmp_path / "bucket")
        step, state = resume(nvme, bucket=f"file://{bucket}")
    assert step == STEP
    assert_as_saved(state, OUT / "single" / "expected.pt", tmp_path)
    assert (nvme / STEP_DIR / "manifest.json").is_file()  # restored from the bucket, verified, kept


@pytest.mark.parametrize("source", ["local", "bucket"])
def test_a_two_rank_dcp_checkpoint_of_0_1_resumes_bitwise_into_one_process(source: str, tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    if source == "local":
        step, state = resume(copy_of("dcp", nvme))
    else:
        bucket = copy_of("dcp", tmp_path / "bucket")
        step, state = resume(nvme, bucket=f"file://{bucket}")
    assert step == STEP
    # One process is rank 0: the model resharded from both ranks' files, the rest from rank 0's.
    assert_as_saved(state, OUT / "dcp" / "expected-rank0.pt", tmp_path, by_name=True)


@pytest.mark.slow
def test_a_two_rank_dcp_checkpoint_of_0_1_resumes_bitwise_into_two_ranks(tmp_path: Path) -> None:
    root = copy_of("dcp", tmp_path / "nvme")
    with tempfile.TemporaryDirectory(prefix="rendezvous-") as scratch:
        command = [sys.executable, "-m", "tests.integration.test_old_checkpoints", str(root), scratch]
        procs = [popen([*command, str(rank)], stderr=subprocess.PIPE) for rank in range(2)]
        with contextlib.ExitStack() as stack:
            for proc in procs:
                stack.callback(proc.kill)
            errors = [proc.communicate(timeout=240)[1] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], "\n".join(errors)
    for rank in range(2):
        assert compare_final(OUT / "dcp" / f"expected-rank{rank}.pt", root / f"actual-rank{rank}.pt") == []


@pytest.mark.parametrize("layout", ["single", "dcp"])
def test_spotguard_verify_passes_0_1_checkpoints_locally_and_in_a_bucket(
    layout: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = copy_of(layout, tmp_path / "nvme")
    bucket = copy_of(layout, tmp_path / "bucket")
    assert cli(["verify", str(root)]) == 0
    assert cli(["verify", f"file://{bucket}"]) == 0
    assert STEP_DIR in capsys.readouterr().out


def test_verify_fails_a_0_1_checkpoint_with_a_flipped_byte(tmp_path: Path) -> None:
    """The check above can fail: the same copy with one data byte changed does not pass."""
    root = copy_of("single", tmp_path / "nvme")
    data = bytearray((root / STEP_DIR / "model.pt").read_bytes())
    data[-100] ^= 0xFF
    (root / STEP_DIR / "model.pt").write_bytes(data)
    assert cli(["verify", str(root)]) != 0


def rank_main(root: Path, rendezvous: Path, rank: int) -> None:
    """One rank of the two-rank resume: loads the old checkpoint, writes what it holds then."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{rendezvous / 'store'}", world_size=2, rank=rank)
    torch.set_num_threads(1)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    state = build_state(99 + rank, torch.nn.parallel.DistributedDataParallel(net))
    guard = Guard(checkpoint_dir=root, socket=root / "none.sock", handle_sigterm=False)
    try:
        assert guard.resume(state) == STEP
    finally:
        guard.close()
    torch.save(loaded(state, by_name=True), root / f"actual-rank{rank}.pt")
    dist.destroy_process_group()
    # Leave without tearing down DDP, as tests/e2e/dist_trainer.py does: freeing its reducer at exit
    # runs the gloo process group's destructor, which joins a gloo thread that may wait for the GIL
    # (torch 2.13): a rank hung, or aborted with "terminate called without an active exception" (once
    # in some twenty CI runs, on a loaded machine). Everything it had to write is written by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
