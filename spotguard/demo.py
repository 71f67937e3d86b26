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
use it too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import IO, Any

SAMPLES = 96
BATCH = 8  # 12 steps per epoch


# --- the example training loop (trainer side: imports torch) ----------------------------------


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "t": time.time(), **fields}), flush=True)


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
                _wait_for_notice(guard, step)
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


def _wait_for_notice(guard: Any, step: int, timeout: float = 60.0) -> None:
    """Test harness knob: hold at ``step`` until the daemon's notice arrives, so that the checkpoint
    lands at exactly this step. The notice still travels the real path (daemon -> socket -> hook)."""
    emit("waiting", step=step)
    deadline = time.monotonic() + timeout
    while not guard._local_flags()[0]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no notice arrived within {timeout} s at step {step}")
        time.sleep(0.005)


def compare_final(first: Path, second: Path) -> list[str]:
    """Differences between two final states (empty: bitwise identical)."""
    import torch

    a = torch.load(first, weights_only=True)
    b = torch.load(second, weights_only=True)
    problems: list[str] = []

    def walk(x: Any, y: Any, where: str) -> None:
        if isinstance(x, torch.Tensor):
            same = isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
            if not same:
                problems.append(f"{where}: tensors differ")
        elif isinstance(x, dict):
            if not isinstance(y, dict) or set(x) != set(y):
                problems.append(f"{where}: keys differ")
                return
            for key in x:
                walk(x[key], y[key], f"{where}.{key}")
        elif isinstance(x, list | tuple):
            if not isinstance(y, list | tuple) or len(x) != len(y):
                problems.append(f"{where}: lengths differ")
                return
            for i, (p, q) in enumerate(zip(x, y, strict=True)):
                walk(p, q, f"{where}[{i}]")
        elif x != y:
            problems.append(f"{where}: {x!r} != {y!r}")

    walk(a, b, "final")
    return problems


# --- the orchestrator ---------------------------------------------------------------------


class Vm:
    """One simulated VM: a daemon subprocess with its own socket and local checkpoint root."""

    def __init__(self, base: Path, name: str, bucket: str, extra_args: list[str] | None = None) -> None:
        self.dir = base / name
        self.root = self.dir / "nvme"
        self.socket = self.dir / "spotguard.sock"
        self.bucket = bucket
        self.log = self.dir / "daemon.log"
        self.extra_args = extra_args or ["--provider", "none"]
        self.process: subprocess.Popen[bytes] | None = None

    def start_daemon(self, env: dict[str, str] | None = None) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable, "-m", "spotguard", "run",
            "--socket", str(self.socket),
            "--checkpoint-dir", str(self.root),
            "--state-dir", str(self.dir / "state"),
            "--bucket", self.bucket,
            *self.extra_args,
        ]  # fmt: skip
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=log, env={**os.environ, "SPOTGUARD_SCAN_INTERVAL": "0.5", **(env or {})}
            )
        wait_for(self._answers, 20, f"the daemon of {self.dir.name} to listen (log: {self.log})")

    def _answers(self) -> bool:
        from spotguard.control import CommandError, request

        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(f"the daemon exited with {self.process.returncode}; see {self.log}")
        try:
            request(self.socket, "status", timeout=1)
        except CommandError as exc:
            return str(exc).startswith("daemon:")  # it answered, if only to refuse us
        return True

    def status(self) -> dict[str, Any]:
        from spotguard.control import request

        return request(self.socket, "status")

    def kill_daemon(self) -> None:
        """SIGKILL: the daemon gets no chance to clean up (a crash, the OOM killer)."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def stop_daemon(self) -> int:
        if self.process is None:
            return 0
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=60)
        self.process = None
        return code


def wait_for(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def trainer_command(
    root: Path, bucket: str | None, socket: Path, steps: int, out: Path | None, **extra: Any
) -> list[str]:
    command = [sys.executable, "-m", "spotguard.demo", "train", "--checkpoint-dir", str(root), "--socket", str(socket)]
    command += ["--steps", str(steps)]
    if bucket:
        command += ["--bucket", bucket]
    if out:
        command += ["--out", str(out)]
    for key, value in extra.items():
        if value is True:
            command.append(f"--{key.replace('_', '-')}")
        elif value is not None and value is not False:
            command += [f"--{key.replace('_', '-')}", str(value)]
    return command


def events(stream: IO[str]) -> Iterator[dict[str, Any]]:
    for line in stream:
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue


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

        from spotguard.emulate.registry import start_emulator

        imds = start_emulator("aws")
        aws_args = ["--provider", "aws", "--metadata-url", imds.url, "--poll-interval", "1"]
        vm_a = Vm(base, "vm-a", bucket, extra_args=aws_args)
        vm_a.start_daemon()
        say(f"[vm-a] daemon up, polling the AWS metadata emulator at {imds.url} every 1 s; trainer starts")
        trainer = subprocess.Popen(
            trainer_command(vm_a.root, bucket, vm_a.socket, steps, None, pace=0.02),
            stdout=subprocess.PIPE,
            text=True,
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
            vm_a.stop_daemon()
            imds.stop()
            return 1

        status = wait_for(
            lambda: (s := vm_a.status())["last_notice"] and s["last_notice"].get("committed_at") and s,
            60,
            "the urgent checkpoint to be committed in the bucket",
        )
        notice = status["last_notice"]
        vm_a.stop_daemon()
        imds.stop()
        say(f"[vm-a] urgent checkpoint {notice['checkpoint']} committed in the bucket; VM A goes away")
        shutil.rmtree(vm_a.root)  # local NVMe dies with the VM

        vm_b = Vm(base, "vm-b", bucket)
        vm_b.start_daemon()
        resumed = subprocess.run(
            trainer_command(vm_b.root, bucket, vm_b.socket, steps, base / "resumed.pt"),
            stdout=subprocess.PIPE,
            text=True,
            check=False,
        )
        vm_b.stop_daemon()
        resume_events = [json.loads(line) for line in resumed.stdout.splitlines() if line.startswith("{")]
        resumed_at = next((e for e in resume_events if e["event"] == "resumed"), None)
        if resumed.returncode != 0 or resumed_at is None:
            say("[vm-b] the resumed trainer failed")
            return 1
        say(f"[vm-b] fresh process resumed from the bucket at step {resumed_at['step']} and finished {steps} steps")
        if reference.wait() != 0:
            say("the uninterrupted reference run failed")
            return 1

        differences = compare_final(reference_out, base / "resumed.pt")
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
        identical = not differences
        verdict = "yes" if identical else "NO"
        say(f"final parameters and optimizer state bitwise identical to the uninterrupted run: {verdict}")
        for problem in differences[:10]:
            say(f"  {problem}")
        say(f"demo took {time.monotonic() - t_start:.1f} s")
        return 0 if identical else 1


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
    args = parser.parse_args(argv)
    train(
        checkpoint_dir=args.checkpoint_dir,
        bucket=args.bucket,
        socket=args.socket,
        steps=args.steps,
        out=args.out,
        pace=args.pace,
        wait_notice_at=args.wait_notice_at,
        every_steps=args.every_steps,
        plain_loader=args.plain_loader,
    )
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "train":
        sys.exit(_train_main(sys.argv[2:]))
    sys.exit(run_demo())
