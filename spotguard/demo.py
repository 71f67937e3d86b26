"""``spotguard demo``: the whole story on one machine, with embedded defaults.

A daemon and a trainer stand for spot VM "A", the daemon polling a local AWS
metadata emulator (IMDSv2) as it would the real one; mid-run the emulator
announces a spot interruption;
the trainer writes an urgent checkpoint, the daemon uploads it to a
``file://`` bucket; a fresh daemon and trainer on "VM B" resume from the
bucket and finish; the result is compared, bit for bit, with an
uninterrupted run.

``python -m spotguard.demo train ...`` is the example training loop itself
(dropout, AdamW, an LR scheduler, a shuffling StatefulDataLoader); the tests
use it too. The daemons and trainer processes are run by :mod:`spotguard.harness`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotguard.harness import Vm, compare_final, events, trainer_command, wait_for

if TYPE_CHECKING:
    from spotguard.trainer.guard import Guard

SAMPLES = 96
BATCH = 8  # 12 steps per epoch


# --- the example training loop (trainer side: imports torch) ----------------------------------


def emit(event: str, **fields: Any) -> None:
    """One JSON line on stdout, in one write: processes sharing the pipe (ranks under torchrun, whose
    output is unbuffered) cannot split each other's lines, as ``print``'s separate newline could."""
    sys.stdout.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")
    sys.stdout.flush()


def build_training(seed: int = 0, *, plain_loader: bool = False) -> dict[str, Any]:
    """A small model whose result depends on every piece of state: dropout, AdamW moments,
    the LR schedule, the shuffling order and position in the epoch.

    ``plain_loader`` builds the loader the common way (``shuffle=True``, no generators of its
    own) to show the global-RNG trap the README describes; spotguard warns about it."""
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import RandomSampler

    torch.manual_seed(seed)
    data = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 16), torch.randn(SAMPLES, 1))
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=500)
    if plain_loader:
        loader = StatefulDataLoader(data, batch_size=BATCH, shuffle=True)
        return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader}
    # Own generators for the loader and its sampler: see README, "Exact resume and DataLoaders".
    loader = StatefulDataLoader(
        data,
        batch_size=BATCH,
        sampler=RandomSampler(data, generator=torch.Generator().manual_seed(seed + 1)),
        generator=torch.Generator().manual_seed(seed + 2),
    )
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader}


def train(
    *,
    checkpoint_dir: Path,
    bucket: str | None,
    socket: Path,
    steps: int,
    out: Path | None,
    pace: float = 0.0,
    wait_notice_at: int | None = None,
    every_steps: int | None = None,
    plain_loader: bool = False,
) -> int:
    """The loop from the README, with JSON progress lines on stdout. Returns the step reached."""
    import warnings

    import torch

    from spotguard import Guard

    # torchdata 0.11 calls a torch API that torch 2.13 deprecates; nothing for users to act on.
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
    torch.set_num_threads(1)  # same reduction order in every process
    state = build_training(plain_loader=plain_loader)
    model, optimizer, scheduler, loader = state["model"], state["optimizer"], state["scheduler"], state["loader"]
    guard = Guard(checkpoint_dir=checkpoint_dir, bucket=bucket, socket=socket, every_steps=every_steps)
    started = time.time()
    step = guard.resume(state)
    emit("resumed", step=step, seconds=round(time.time() - started, 3))
    stopped = False
    while step < steps and not stopped:
        for inputs, targets in loader:
            model.train()
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            emit("step", step=step, loss=round(loss.item(), 6))
            if wait_notice_at == step:
                wait_for_notice(guard, step)
            if pace:
                time.sleep(pace)  # stands for a real step's compute time
            if guard.should_checkpoint(step):
                path = guard.save(state, step)
                emit("saved", step=step, path=str(path), timeline=guard.timeline, stop=guard.stop_requested)
            if guard.stop_requested:
                stopped = True
                break
            if step >= steps:
                break
    guard.close()
    if out is not None and not stopped:
        torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}, out)
    emit("stopped" if stopped else "finished", step=step)
    return step


def wait_for_notice(guard: Guard, step: int, timeout: float = 60.0) -> None:
    """Test harness knob: hold at ``step`` until the daemon's notice arrives, so that the checkpoint
    lands at exactly this step. The notice still travels the real path (daemon -> socket -> hook)."""
    emit("waiting", step=step)
    deadline = time.monotonic() + timeout
    while not guard.notice_pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no notice arrived within {timeout} s at step {step}")
        time.sleep(0.005)


# --- the orchestrator ---------------------------------------------------------------------


@contextmanager
def _workspace(keep_dir: str | None) -> Iterator[Path]:
    if keep_dir:
        path = Path(keep_dir).absolute()
        path.mkdir(parents=True, exist_ok=True)
        yield path
    else:
        path = Path(tempfile.mkdtemp(prefix="spotguard-demo-"))
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)


def _ms(start: float, end: float) -> str:
    return f"{(end - start) * 1000:8.1f} ms"


def _ts(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


@dataclass
class _Interruption:
    """What VM A's part of the story left: the trainer's ``saved`` event, when the notice appeared,
    and the daemon's record of the notice (``received_at``, ``committed_at``, ``checkpoint``)."""

    saved: dict[str, Any]
    t_notice: float
    notice: dict[str, Any]


def run_demo(steps: int = 240, notice_at: int = 100, keep_dir: str | None = None) -> int:
    say = print
    t_start = time.monotonic()
    with _workspace(keep_dir) as base:
        bucket_dir = base / "bucket"
        bucket_dir.mkdir()
        bucket = bucket_dir.as_uri()
        say(f"spotguard demo: {steps} steps; a spot interruption near step {notice_at}; bucket {bucket}")
        reference_out = base / "reference.pt"
        reference = subprocess.Popen(
            trainer_command(base / "ref" / "nvme", None, base / "ref" / "none.sock", steps, reference_out),
            stdout=subprocess.DEVNULL,
        )
        interruption = _interrupt_vm_a(base, bucket, steps, notice_at, say)
        if interruption is None:
            return 1
        resumed_at = _resume_on_vm_b(base, bucket, steps, say)
        if resumed_at is None:
            return 1
        if reference.wait() != 0:
            say("the uninterrupted reference run failed")
            return 1
        differences = compare_final(reference_out, base / "resumed.pt")
        _tell_timeline(interruption, resumed_at, say)
        identical = not differences
        verdict = "yes" if identical else "NO"
        say(f"final parameters and optimizer state bitwise identical to the uninterrupted run: {verdict}")
        for problem in differences[:10]:
            say(f"  {problem}")
        say(f"demo took {time.monotonic() - t_start:.1f} s")
        return 0 if identical else 1


def _interrupt_vm_a(
    base: Path, bucket: str, steps: int, notice_at: int, say: Callable[[str], None]
) -> _Interruption | None:
    """VM A trains until EC2 (the emulator) announces a spot interruption; the urgent checkpoint is
    committed in the bucket, then the VM and its local disk go away. None if the story went wrong."""
    from spotguard.emulate.registry import start_emulator

    imds = start_emulator("aws")
    vm_a = Vm(
        base, "vm-a", bucket, extra_args=["--provider", "aws", "--metadata-url", imds.url, "--poll-interval", "1"]
    )
    try:
        vm_a.start_daemon()
        say(f"[vm-a] daemon up, polling the AWS metadata emulator at {imds.url} every 1 s; trainer starts")
        trainer = subprocess.Popen(
            trainer_command(vm_a.root, bucket, vm_a.socket, steps, None, pace=0.02), stdout=subprocess.PIPE, text=True
        )
        assert trainer.stdout is not None
        t_notice = None
        saved: dict[str, Any] = {}
        for event in events(trainer.stdout):
            if event["event"] == "step" and t_notice is None and event["step"] >= notice_at:
                t_notice = time.time()
                action = imds.trigger(kind="spot", action="terminate")
                say(f"[vm-a] step {event['step']}: EC2 announces a spot interruption {action}")
            elif event["event"] == "saved":
                saved = event
                say(f"[vm-a] trainer saved step {event['step']} and stops")
        if trainer.wait() != 0 or not saved or t_notice is None:
            say("[vm-a] the trainer did not save and stop as expected")
            return None
        status = wait_for(
            lambda: (s := vm_a.status())["last_notice"] and s["last_notice"].get("committed_at") and s,
            60,
            "the urgent checkpoint to be committed in the bucket",
        )
    finally:
        vm_a.stop_daemon()
        imds.stop()
    notice = status["last_notice"]
    say(f"[vm-a] urgent checkpoint {notice['checkpoint']} committed in the bucket; VM A goes away")
    shutil.rmtree(vm_a.root)  # local NVMe dies with the VM
    return _Interruption(saved, t_notice, notice)


def _resume_on_vm_b(base: Path, bucket: str, steps: int, say: Callable[[str], None]) -> dict[str, Any] | None:
    """A fresh VM B resumes from the bucket and finishes; its ``resumed`` event, or None if it failed."""
    vm_b = Vm(base, "vm-b", bucket)
    vm_b.start_daemon()
    try:
        resumed = subprocess.run(
            trainer_command(vm_b.root, bucket, vm_b.socket, steps, base / "resumed.pt"),
            stdout=subprocess.PIPE,
            text=True,
            check=False,
        )
    finally:
        vm_b.stop_daemon()
    resume_events = [json.loads(line) for line in resumed.stdout.splitlines() if line.startswith("{")]
    resumed_at = next((e for e in resume_events if e["event"] == "resumed"), None)
    if resumed.returncode != 0 or resumed_at is None:
        say("[vm-b] the resumed trainer failed")
        return None
    say(f"[vm-b] fresh process resumed from the bucket at step {resumed_at['step']} and finished {steps} steps")
    return resumed_at


def _tell_timeline(interruption: _Interruption, resumed_at: dict[str, Any], say: Callable[[str], None]) -> None:
    t_notice, notice, saved = interruption.t_notice, interruption.notice, interruption.saved
    timeline = saved["timeline"]
    say("")
    say("timeline of the interruption (wall clock; the daemon polls IMDS every 1 s)")
    say(f"  notice appears in IMDS        {_ms(t_notice, t_notice)}")
    say(f"  daemon saw it                 {_ms(t_notice, _ts(notice['received_at']))}")
    say(f"  trainer told                  {_ms(t_notice, timeline['told'])}")
    say(f"  committed locally (step {saved['step']}) {_ms(t_notice, timeline['committed_local'])}")
    say(f"  committed in bucket           {_ms(t_notice, _ts(notice['committed_at']))}")
    say(f"  resume on VM B (restore+load) {resumed_at['seconds'] * 1000:8.1f} ms")
    say("")


def _train_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m spotguard.demo train")
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--bucket")
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--pace", type=float, default=0.0)
    parser.add_argument("--wait-notice-at", type=int)
    parser.add_argument("--every-steps", type=int)
    parser.add_argument("--plain-loader", action="store_true")
    train(**vars(parser.parse_args(argv)))  # the flags are train()'s keyword arguments
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "train":
        sys.exit(_train_main(sys.argv[2:]))
    sys.exit(run_demo())
