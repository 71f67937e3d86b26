"""Trainer and daemon processes forked from servers that have imported their modules already.

Each rank of a distributed test is a real process of its own (gloo between them, signals, exit codes),
but importing torch and DCP takes every one of them 3-4 s of CPU, most of the suite's on 2 cores; each
daemon a test starts (about 270 in the suite) pays 0.5-0.7 s for its own imports (aiohttp, boto3, the
peer tier). ``multiprocessing``'s fork server imports them once per test worker; each process is
forked from it and runs its module as ``python -m`` would (``__main__``, ``sys.argv``, the environment
given, its stdout and stderr where asked), and ends as the interpreter would: non-daemon threads
joined, threading's exit hooks and then ``atexit``'s run.

Daemons come from a server of their own that never imports torch: the daemon must not, and the tests
of its memory read its resident pages.
"""

from __future__ import annotations

import atexit
import io
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import threading
import types
import weakref
from collections.abc import Mapping
from multiprocessing import forkserver, popen_forkserver
from multiprocessing.context import ForkServerProcess
from multiprocessing.reduction import DupFd
from typing import IO, Any

# What the trainers of the e2e tests import; lightning and transformers take 5-6 s more each.
PRELOAD = [
    "torch",
    "torch.distributed.checkpoint.state_dict",
    "spotguard.trainer.sharded",
    "spotguard.demo",
    "lightning.pytorch",
    "transformers.trainer",
    "transformers.models.bert.modeling_bert",
]

# What a daemon imports, for each kind of bucket and cloud the tests give it.
DAEMON_PRELOAD = [
    "spotguard.cli",
    "spotguard.daemon.app",
    "spotguard.providers.aws",
    "spotguard.providers.gcp",
    "spotguard.providers.azure",
    "spotguard.storage.file",
    "spotguard.storage.s3",
    "spotguard.storage.gcs",
    "boto3",
    "s3transfer.manager",
    "google.cloud.storage",
]

_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(PRELOAD)


# ``multiprocessing`` keeps one fork server per process; the daemons' is a second one. Its launcher is
# the stdlib's own, run with its module's ``forkserver`` pointed at that server (the forked child's side
# of a launch reads no state of the module's server).
_daemon_server = forkserver.ForkServer()
_daemon_server.set_forkserver_preload(DAEMON_PRELOAD)
_launcher_globals = dict(vars(popen_forkserver))
_launcher_globals["forkserver"] = types.SimpleNamespace(
    connect_to_new_process=_daemon_server.connect_to_new_process, read_signed=forkserver.read_signed
)


class _DaemonPopen(popen_forkserver.Popen):
    _launch = types.FunctionType(popen_forkserver.Popen._launch.__code__, _launcher_globals)


class _DaemonProcess(ForkServerProcess):
    """A process forked from the daemons' server (pickled to it: a class of this module)."""

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _DaemonPopen(process_obj)


_started: weakref.WeakSet[PreloadedProcess] = weakref.WeakSet()


@atexit.register  # registered after multiprocessing's hook, so run before it: that one joins every child left
def _kill_leftovers() -> None:
    for process in list(_started):
        process.kill()


def _run_module(argv: list[str], env: dict[str, str], cwd: str, stdout: Any, stderr: Any) -> None:
    """In the forked process: ``python -m argv[0] argv[1:]``, writing to ``stdout`` and ``stderr`` (DupFd)."""
    for fd, dup in ((1, stdout), (2, stderr)):
        os.dup2(dup.detach(), fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.argv = list(argv)
    try:
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    finally:  # as the interpreter ends: threads joined (and threading's hooks), then atexit's
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()


class PreloadedProcess:
    """What the tests use of :class:`subprocess.Popen` (text mode), for a process forked from a
    preloaded server (the trainers', or with ``daemon`` the daemons'): ``stdout``/``stderr`` may each
    be PIPE, DEVNULL, a file or None (inherited)."""

    def __init__(
        self,
        module_argv: list[str],
        *,
        daemon: bool = False,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        stdout: int | IO[Any] | None = None,
        stderr: int | IO[Any] | None = None,
    ) -> None:
        ends: list[int] = []  # this side's copies of what the child writes to: closed once it has them
        child_out, self.stdout = _child_end(stdout, 1, ends)
        child_err, self.stderr = _child_end(stderr, 2, ends)
        process_class = _DaemonProcess if daemon else _context.Process
        self._process = process_class(
            target=_run_module,
            args=(
                module_argv,
                dict(os.environ if env is None else env),
                os.fspath(cwd or os.getcwd()),
                child_out,
                child_err,
            ),
            daemon=False,
        )
        try:
            self._process.start()
        finally:
            for fd in ends:
                os.close(fd)
        assert self._process.pid is not None
        self.pid: int = self._process.pid
        _started.add(self)

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self._process.name or "", timeout or 0)
        return code

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        """Both pipes read to their end (each in a thread: neither may fill while the other is read)."""
        results: dict[str, str] = {}
        readers = [
            threading.Thread(target=lambda n=name, s=stream: results.__setitem__(n, s.read()), daemon=True)
            for name, stream in (("out", self.stdout), ("err", self.stderr))
            if stream is not None
        ]
        for reader in readers:
            reader.start()
        self.wait(timeout)
        for reader in readers:
            reader.join(timeout)
        self._close_pipes()
        return results.get("out"), results.get("err")

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def __enter__(self) -> PreloadedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self._close_pipes()
        self.wait()

    def _close_pipes(self) -> None:
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()


def _child_end(target: int | IO[Any] | None, inherited: int, ends: list[int]) -> tuple[_Fd, IO[str] | None]:
    """What the child writes to for ``target`` (None: this process's fd ``inherited``, as Popen would
    leave it), and the text stream this side reads (PIPE only)."""
    if target is None:
        return _Fd(inherited), None
    if target == subprocess.PIPE:
        read_end, write_end = os.pipe()
        ends.append(write_end)
        return _Fd(write_end), io.TextIOWrapper(io.FileIO(read_end, "r"), encoding="utf-8")
    if target == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_WRONLY)
        ends.append(fd)
        return _Fd(fd), None
    assert not isinstance(target, int), f"unsupported: {target}"
    return _Fd(target.fileno()), None


class _Fd:
    """A file descriptor that travels to the forked process (``multiprocessing`` passes it over its
    socket to the fork server) and arrives there as its ``DupFd``."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        return (_identity, (DupFd(self.fd),))


def _identity(value: Any) -> Any:
    return value


def popen(command: list[str], *, text: bool = True, **kwargs: Any) -> Any:
    """``subprocess.Popen(command, text=True, **kwargs)``, forked preloaded where it is ``python -m
    module`` and asks nothing more than env, cwd, stdout and stderr."""
    if text and _preloadable(command, kwargs):
        return PreloadedProcess(command[2:], **kwargs)
    return subprocess.Popen(command, text=text, **kwargs)


def popen_daemon(command: list[str], **kwargs: Any) -> Any:
    """``subprocess.Popen(command, **kwargs)`` for a daemon (``spotguard.harness.Vm.spawn``), forked
    from the daemons' server where :func:`popen` would fork it (its output goes to a file: no text
    mode to honour). A daemon run under a prefix (``ip netns exec``) is started as it asks."""
    if _preloadable(command, kwargs) and subprocess.PIPE not in (kwargs.get("stdout"), kwargs.get("stderr")):
        return PreloadedProcess(command[2:], daemon=True, **kwargs)
    return subprocess.Popen(command, **kwargs)


def _preloadable(command: list[str], kwargs: Mapping[str, Any]) -> bool:
    """``python -m module ...`` asking nothing more than env, cwd, stdout and stderr."""
    is_module = command[:2] == [sys.executable, "-m"] and len(command) > 2
    return is_module and set(kwargs) <= {"env", "cwd", "stdout", "stderr"}
