"""Acceptance: a drill at step k, an urgent save, a fresh process resuming from the bucket on a new
"VM" ends bit for bit where the uninterrupted run ends (parameters and optimizer state)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from spotguard.control import request
from spotguard.demo import BATCH, SAMPLES
from spotguard.harness import Vm, collect_events, compare_final, trainer_command, wait_for
from tests.preloaded import popen

STEPS = 30  # 12 steps per epoch: the run crosses two epoch boundaries
STEPS_PER_EPOCH = SAMPLES // BATCH


def run_events(command: list[str], on_event: Callable[[dict], None] | None = None) -> list[dict]:
    return collect_events(popen(command, stdout=subprocess.PIPE), on_event)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    """Uninterrupted runs, with the recommended loader and with a plain shuffle=True loader."""
    base = tmp_path_factory.mktemp("reference")
    outs = {}
    for plain in (False, True):
        out = base / f"reference-{plain}.pt"
        run_events(trainer_command(base / f"nvme-{plain}", None, base / "none.sock", STEPS, out, plain_loader=plain))
        outs[plain] = out
    return outs


def interrupted_run(vm_factory: Callable[..., Vm], bucket: str, tmp_path: Path, k: int, plain: bool = False) -> Path:
    vm_a = vm_factory("vm-a")

    def fire_at_k(event: dict) -> None:
        if event["event"] == "waiting":
            request(vm_a.socket, "drill", deadline_s=120)

    events = run_events(
        trainer_command(vm_a.root, bucket, vm_a.socket, STEPS, None, wait_notice_at=k, plain_loader=plain), fire_at_k
    )
    saved = [e for e in events if e["event"] == "saved"]
    assert [e["step"] for e in saved] == [k] and saved[0]["stop"] is True
    assert events[-1] == {**events[-1], "event": "stopped", "step": k}
    wait_for(lambda: (s := vm_a.status()["last_notice"]) and s.get("committed_at"), 30, "the bucket commit")
    vm_a.stop_daemon()

    vm_b = vm_factory("vm-b")  # the replacement VM: empty local disk, same bucket
    out = tmp_path / "resumed.pt"
    events = run_events(trainer_command(vm_b.root, bucket, vm_b.socket, STEPS, out, plain_loader=plain))
    assert events[0]["event"] == "resumed" and events[0]["step"] == k
    assert events[-1]["event"] == "finished" and events[-1]["step"] == STEPS
    return out


@pytest.mark.slow
@pytest.mark.parametrize("k", [5, STEPS_PER_EPOCH, 17], ids=["mid-epoch-0", "epoch-boundary", "mid-epoch-1"])
def test_resume_is_bitwise_identical(
    k: int, reference: dict[bool, Path], vm_factory: Callable[..., Vm], bucket: str, tmp_path: Path
) -> None:
    resumed = interrupted_run(vm_factory, bucket, tmp_path, k)
    assert compare_final(reference[False], resumed) == []


@pytest.mark.slow
def test_plain_shuffle_loader_diverges_which_is_why_we_warn(
    reference: dict[bool, Path], vm_factory: Callable[..., Vm], bucket: str, tmp_path: Path
) -> None:
    """The control experiment for the README's warning: same loop, loader without its own
    generators, resumed mid-epoch: iter(loader) draws from the restored global RNG and the run drifts."""
    resumed = interrupted_run(vm_factory, bucket, tmp_path, 17, plain=True)
    assert compare_final(reference[True], resumed) != []
