"""The harness that runs spotguard as it runs on a VM: a daemon subprocess per simulated VM, the
example trainer as a subprocess, waiting on conditions, comparing final states.

``spotguard demo`` tells its story with it; the tests and the benchmarks drive real daemons with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from spotguard.storage.base import Storage


class Vm:
    """One simulated VM: a daemon subprocess with its own socket and local checkpoint root."""

    #: What starts the daemon's process, with :class:`subprocess.Popen`'s arguments and the methods of
    #: its result the harness uses (the tests fork theirs from a server that has its imports done).
    spawn: ClassVar[Callable[..., Any]] = subprocess.Popen

    def __init__(
        self, base: Path, name: str, bucket: str, extra_args: list[str] | None = None, prefix: Sequence[str] = ()
    ) -> None:
        """``prefix``: a command the daemon's is run under (``ip netns exec NAME``: a daemon in a
        network namespace of its own)."""
        self.dir = base / name
        self.prefix = list(prefix)
        self.root = self.dir / "nvme"
        self.socket = self.dir / "spotguard.sock"
        self.bucket = bucket
        self.log = self.dir / "daemon.log"
        self.extra_args = extra_args or ["--provider", "none"]
        self.process: subprocess.Popen[bytes] | None = None

    def start_daemon(self, env: dict[str, str] | None = None) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        command = [
            *self.prefix,
            sys.executable, "-m", "spotguard", "run",
            "--socket", str(self.socket),
            "--checkpoint-dir", str(self.root),
            "--state-dir", str(self.dir / "state"),
            "--bucket", self.bucket,
            *self.extra_args,
        ]  # fmt: skip
        with self.log.open("ab") as log:
            self.process = self.spawn(
                command, stdout=log, stderr=log, env={**os.environ, "SPOTGUARD_SCAN_INTERVAL": "0.5", **(env or {})}
            )
        wait_for(self._answers, 20, f"the daemon of {self.dir.name} to listen (log: {self.log})")

    def _answers(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(f"the daemon exited with {self.process.returncode}; see {self.log}")
        return daemon_answers(self.socket)

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


def worker_pids(pid: int) -> list[int]:
    """The peer tier's worker processes (spotguard/peer/workers.py) among the children of ``pid``; one
    that ends while it is looked at is left out."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                if b"spotguard.peer.workers" in Path(f"/proc/{child}/cmdline").read_bytes():
                    found.append(int(child))
    return found


# glibc reserves a thread's heap as this many bytes aligned to as many (HEAP_MAX_SIZE, 64-bit).
_THREAD_HEAP_BYTES = 64 << 20


def thread_heaps(pid: int) -> int:
    """How many heaps of their own ``pid``'s threads allocate from (glibc's arenas other than the main
    heap; spotguard/daemon/heap.py): each is an anonymous mapping at a multiple of 64 MiB, read-write
    where it is in use, the rest of its 64 MiB reserved, inaccessible."""
    anonymous: dict[int, tuple[int, str]] = {}  # start: (end, mode)
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) == 5:  # no path: anonymous
            start, end = (int(edge, 16) for edge in fields[0].split("-"))
            anonymous[start] = (end, fields[1])
    count = 0
    for start, (end, mode) in anonymous.items():
        if mode != "rw-p" or start % _THREAD_HEAP_BYTES:
            continue
        rest = anonymous.get(end)
        whole = end - start == _THREAD_HEAP_BYTES
        count += whole or (rest is not None and rest == (start + _THREAD_HEAP_BYTES, "---p"))
    return count


def daemon_answers(socket: Path) -> bool:
    """Whether a daemon answers a status request on ``socket``. Not whether the socket file is
    there: the file exists from ``bind``, a moment before the daemon listens, and a connection in
    that moment is refused."""
    from spotguard.control import CommandError, request

    try:
        request(socket, "status", timeout=1)
    except CommandError as exc:
        return str(exc).startswith("daemon:")  # it answered, if only to refuse us
    return True


def wait_for(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    """Poll ``condition`` every ``interval`` s until it returns something true (which is returned) or
    ``timeout`` s pass. A poll is a synchronisation point (a test may act at once on what it saw), so
    the wait after a slow call is not stretched: make a slow condition cheap instead (bucket_storage)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


_last_bucket: tuple[tuple[str, str], Storage] | None = None


def bucket_storage(bucket: str) -> Storage:
    """A storage client for ``bucket``, kept for the next call with the same bucket and endpoint: the
    tests poll buckets, and a new S3 client still costs about 0.02 CPU-s (0.15 before its sessions
    shared the SDK's models, ``s3_api.new_session``) and a connection of its own. For one thread: a
    call for another bucket closes the kept client."""
    from spotguard.storage import open_storage

    global _last_bucket
    endpoints = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "STORAGE_EMULATOR_HOST")
    key = (bucket, " ".join(os.environ.get(name, "") for name in endpoints))
    if _last_bucket is None or _last_bucket[0] != key:
        if _last_bucket is not None:
            _last_bucket[1].close()
        _last_bucket = (key, open_storage(bucket))
    return _last_bucket[1]


def bucket_status(bucket: str, name: str) -> str | None:
    """The status of checkpoint ``name`` in ``bucket`` as a resume sees it (``complete`` once every
    node's share and the manifest are there); None while the bucket has none of it."""
    from spotguard.storage.checkpoints import list_remote

    return next((info.status for info in list_remote(bucket_storage(bucket)) if info.name == name), None)


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


def collect_events(
    proc: subprocess.Popen[str],
    on_event: Callable[[dict[str, Any]], None] | None = None,
    *,
    marker: str = "{",
    timeout: float = 120.0,
) -> list[dict[str, Any]]:
    """The JSON events a trainer process prints on its stdout (the lines that start with ``marker``:
    libraries talk there too), each handed to ``on_event`` as it comes. The process must exit 0
    within ``timeout`` once its stdout ends; its pipe is closed either way."""
    seen = []
    with proc:
        if proc.stdout is None:
            raise ValueError("the trainer's stdout is not a pipe")
        for line in proc.stdout:
            if line.startswith(marker):
                event = json.loads(line)
                seen.append(event)
                if on_event:
                    on_event(event)
        code = proc.wait(timeout=timeout)
    if code != 0:
        raise AssertionError(f"the trainer exited with {code}")
    return seen


def events(stream: IO[str]) -> Iterator[dict[str, Any]]:
    for line in stream:
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue


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
