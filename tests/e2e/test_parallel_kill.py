"""SIGKILL of a trainer in the middle of a parallel urgent save never leaves a loadable partial checkpoint.

The trainers report to a socket the test listens on, as they would to the daemon: ``hello``, then a
``file-range`` per piece written, ``file`` per file renamed, ``saved`` after the commit. Each round
kills one at a different point of that stream (after the k-th range, after a file, after the commit),
with a random delay on top, then checks what a new VM would see.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from spotguard import Guard
from spotguard.localstore import prune_local, scan_local
from spotguard.manifest import step_dir_name, verify_dir
from tests.e2e.parallel_kill_child import make_state

REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def listener(path: Path) -> Iterator[queue.Queue[dict[str, Any]]]:
    """A Unix socket that takes trainer connections and queues every message they send."""
    messages: queue.Queue[dict[str, Any]] = queue.Queue()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(16)

    def read(conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as lines:
            for line in lines:
                messages.put(json.loads(line))

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=read, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield messages
    finally:
        server.shutdown(socket.SHUT_RDWR)
        server.close()


class Trainers:
    """The forking parent in tests/e2e/parallel_kill_child.py."""

    def __init__(self, root: Path, sock: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.e2e.parallel_kill_child", str(root), str(sock)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.strip())

    def start(self, step: int) -> int:
        assert self.process.stdin is not None
        self.process.stdin.write(f"save {step}\n")
        self.process.stdin.flush()
        return int(self.expect("pid ").split()[1])

    def wait_exit(self, pid: int) -> int:
        return int(self.expect(f"exit {pid} ").split()[2])

    def expect(self, prefix: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            if line.startswith("error "):
                raise AssertionError(f"a trainer failed: {line}")
            if line.startswith(prefix):
                return line

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=30)


def wait_for(messages: queue.Queue[dict[str, Any]], step: int, pid: int, point: tuple[str, int]) -> bool:
    """Read messages until the ``point`` of this trainer's save is reached (kind, count); False if the
    save ended (``saved``) before it."""
    kind, count = point
    seen = 0
    deadline = time.monotonic() + 30
    while True:
        message = messages.get(timeout=max(0.0, deadline - time.monotonic()))
        mine = message.get("pid") == pid or step_dir_name(step) in str(message.get("path", ""))
        if not mine:
            continue
        if message["type"] == kind:
            seen += 1
            if seen == count:
                return True
        if message["type"] == "saved":
            return False


def assert_same(left: Any, right: Any) -> None:
    if isinstance(left, torch.Tensor):
        assert left.dtype == right.dtype and torch.equal(left, right)
    elif isinstance(left, dict):
        assert list(left) == list(right)
        for key in left:
            assert_same(left[key], right[key])
    elif isinstance(left, list | tuple):
        assert len(left) == len(right)
        for a, b in zip(left, right, strict=True):
            assert_same(a, b)
    else:
        assert left == right


def comparable(state: dict[str, Any]) -> dict[str, Any]:
    return {key: value.state_dict() if hasattr(value, "state_dict") else value for key, value in state.items()}


def check_resume(root: Path, tmp_path: Path, expected_step: int) -> None:
    """A new trainer resumes from ``expected_step``, bit for bit."""
    guard = Guard(checkpoint_dir=root, socket=tmp_path / "no-daemon.sock", handle_sigterm=False)
    try:
        state = make_state(10_000)  # other values everywhere
        assert guard.resume(state) == expected_step
        assert_same(comparable(state), comparable(make_state(expected_step)))
    finally:
        guard.close()


# Where each round's trainer is killed: after its hello (still preparing), after the k-th range, after
# the k-th renamed file, after the commit. A save here is about 25 ranges and 6 files.
POINTS = [("hello", 1), *[("file-range", k) for k in (1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24)]]
POINTS += [("file", 1), ("file", 3), ("file", 5), ("file", 6), ("saved", 1), ("file-range", 7), ("file-range", 13)]


@pytest.mark.slow
def test_sigkill_at_any_point_of_a_parallel_urgent_save_leaves_only_complete_checkpoints_loadable(
    tmp_path: Path,
) -> None:
    assert len(POINTS) >= 20
    root, sock = tmp_path / "ckpt", tmp_path / "daemon.sock"
    rng = random.Random(20)
    with listener(sock) as messages:
        trainers = Trainers(root, sock)
        try:
            pid = trainers.start(1)
            assert trainers.wait_exit(pid) == 0
            last_complete = 1
            killed_incomplete: list[str] = []
            for round_, point in enumerate(POINTS):
                step = round_ + 2
                pid = trainers.start(step)
                reached = wait_for(messages, step, pid, point)
                if reached:
                    time.sleep(rng.uniform(0, 0.004))  # lands anywhere up to the next few pieces
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                trainers.wait_exit(pid)

                name = step_dir_name(step)
                infos = {info.name: info for info in scan_local(root)}
                if name in infos and infos[name].status == "complete":
                    assert not verify_dir(root / name), "reported complete, but the files do not match"
                    last_complete = step
                else:
                    killed_incomplete.append(name)
                check_resume(root, tmp_path, last_complete)
                if point[0] != "hello":
                    # This save started by removing what earlier killed saves had left.
                    assert not (set(killed_incomplete[:-1]) & set(infos)), (point, killed_incomplete, list(infos))
                    stray = [p for p in root.rglob("*.tmp-*") if name not in p.parts]
                    assert not stray
                prune_local(root, keep=2)
            assert len(killed_incomplete) >= 15  # most kills did land mid-save

            pid = trainers.start(1000)  # an uninterrupted save cleans up what the last kill left
            assert trainers.wait_exit(pid) == 0
            assert [info.status for info in scan_local(root)] == ["complete"] * len(scan_local(root))
            assert not list(root.rglob("*.tmp-*"))
            check_resume(root, tmp_path, 1000)
        finally:
            trainers.close()
