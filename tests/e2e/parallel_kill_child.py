"""A trainer that saves on request, to be SIGKILLed mid-save (tests/e2e/test_parallel_kill.py).

Importing torch takes seconds; the kill test needs dozens of trainers. So this process imports it
once (and warms up) and forks one trainer per line on stdin (``save STEP``): the child builds the state of STEP, runs
an urgent ``Guard.save`` with four writer threads against the test's socket, and exits. For each child
this prints ``pid PID`` at once and ``exit PID STATUS`` once it is reaped. Nothing here starts a
thread before forking.

    python -m tests.e2e.parallel_kill_child ROOT SOCKET
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

CHUNK = 1 << 20  # small pieces, so that a state of a few MiB is many ranges (and kill points)


def make_state(step: int) -> dict[str, Any]:
    """The state a run has at ``step``: the same bytes in every process, different for every step."""
    generator = torch.Generator().manual_seed(1000 + step)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    opt = torch.optim.AdamW(model.parameters())
    for parameter in model.parameters():
        parameter.grad = torch.randn(parameter.shape, generator=generator)
    opt.step()
    return {
        "model": model,
        "optimizer": opt,
        "embedding": torch.randn(3 << 20, generator=generator),  # 12 MiB: twelve pieces
        "buffers": {f"b{i}": torch.randn(300_000, generator=generator) for i in range(4)},
        "progress": {"step": step, "seen": [step, step * 2]},
    }


def save(root: Path, socket: Path, step: int) -> None:
    from spotguard import Guard
    from spotguard.trainer.writer import ParallelWriter

    torch.manual_seed(step)
    guard = Guard(checkpoint_dir=root, socket=socket, handle_sigterm=False, write_threads=4)
    guard._saver.files_writer = ParallelWriter(4, chunk_bytes=CHUNK)
    guard.client.connected.wait(5)  # so that the test sees this save's messages as they happen
    guard.save(make_state(step), step, reason="urgent")
    guard.close()


def main() -> None:
    root, socket = Path(sys.argv[1]), Path(sys.argv[2])
    # One intra-op thread: no OpenMP pool exists to be broken by the forks. The first optimizer step
    # imports seconds' worth of modules: once here, not in every child.
    torch.set_num_threads(1)
    make_state(0)
    import spotguard.trainer.guard  # noqa: F401

    for line in sys.stdin:
        step = int(line.split()[1])
        pid = os.fork()
        if pid == 0:
            status = 0
            try:
                save(root, socket, step)
            except BaseException as exc:
                print(f"error {os.getpid()} {exc!r}", flush=True)
                status = 1
            finally:
                os._exit(status)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {pid} {status}", flush=True)


if __name__ == "__main__":
    main()
