"""Fixtures shared by the whole suite: real daemons in subprocesses on private sockets."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from spotguard import cloudclock
from spotguard.config import DEFAULT_CHECKPOINT_DIR, DEFAULT_STATE_DIR
from spotguard.harness import Vm
from tests.diskspace import mount_tmpfs
from tests.preloaded import popen_daemon

# Tests spawn trainer subprocesses; one thread each keeps 2 cores from thrashing and reductions repeatable.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every simulated VM's daemon is forked from a server that has imported the daemon's modules.
Vm.spawn = staticmethod(popen_daemon)


@pytest.fixture(autouse=True)
def _no_clock_measurement_carried_over() -> Iterator[None]:
    """A metadata emulator's skewed Date header, read by a monitor in this process, sets how far this
    VM's clock runs ahead of the cloud's (spotguard/cloudclock.py): it must not age the next test's objects."""
    yield
    cloudclock.forget()


@pytest.fixture
def bucket(tmp_path: Path) -> str:
    path = tmp_path / "bucket"
    path.mkdir()
    return path.as_uri()


@pytest.fixture
def vm_factory(tmp_path: Path, bucket: str) -> Iterator[Callable[..., Vm]]:
    """Make simulated VMs (a daemon subprocess each, provider none); all are stopped at teardown."""
    vms: list[Vm] = []

    def make(
        name: str = "vm", *, start: bool = True, env: dict[str, str] | None = None, extra_args: list[str] | None = None
    ) -> Vm:
        vm = Vm(tmp_path, name, bucket, extra_args=extra_args)
        vms.append(vm)
        if start:
            vm.start_daemon(env=env)
        return vm

    yield make
    for vm in vms:
        vm.kill_daemon()


@pytest.fixture
def vm(vm_factory: Callable[..., Vm]) -> Vm:
    return vm_factory("vm-a")


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """``tmpfs(size_bytes)`` mounts a small tmpfs for the test and returns where; unmounted at teardown."""
    yield from mount_tmpfs(tmp_path / "mnt")


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: three workers for every two cores (``--maxprocesses`` still caps it).

    A third of a worker's time here is spent waiting, not computing: on links paced to a
    bucket's or a peer's rate, on deadlines, on daemons and trainers starting in subprocesses.
    On the 2-core box one worker per core left the cores idle for 29 % of the suite (587 s);
    three workers kept them busy (496 s, the same tests passing)."""
    return max(2, len(os.sched_getaffinity(0)) * 3 // 2)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order the tests so that every xdist worker starts with its share of the slow ones.

    ``--dist worksteal`` hands each worker an equal contiguous slice of this list, and idle workers
    later steal the ends of the others' queues. Left in file order, the minute-long end-to-end tests
    sit together in one slice and some run last, alone, while the other cores idle. Here the slow
    tests' files are dealt out (whole: their module-scoped fixtures are built once) to the slices,
    each slice's slow tests first, the quick tests filling the rest in their usual order."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2:
        return
    slow_files: dict[object, list[pytest.Item]] = {}
    quick = []
    for item in items:
        if item.get_closest_marker("slow") is None:
            quick.append(item)
        else:
            slow_files.setdefault(item.path, []).append(item)
    lanes: list[list[pytest.Item]] = [[] for _ in range(workers)]
    for group in sorted(slow_files.values(), key=len, reverse=True):
        min(lanes, key=len).extend(group)
    ordered, left = [], len(items)
    for index, lane in enumerate(lanes):
        size = left // (workers - index)  # the slice worksteal sends this worker
        left -= size
        take = max(0, size - len(lane))
        ordered += lane + quick[:take]
        del quick[:take]
    items[:] = ordered + quick


# The daemon's default paths on a real VM: a test that forgets to point its daemon elsewhere writes
# there, and a rerun at the same tmp path then found that run's notices restored (a drill left
# pending by the first run ended the second's wait for an idle daemon).
_SYSTEM_PATHS = (DEFAULT_STATE_DIR.parent, DEFAULT_CHECKPOINT_DIR, Path("/run/spotguard"))
_ABSENT_AT_START = [path for path in _SYSTEM_PATHS if not path.exists()]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if the tests created any of the daemon's system paths (checked where none existed)."""
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: the controller checks once, after every worker is done
    created = [str(path) for path in _ABSENT_AT_START if path.exists()]
    if created:
        writer = session.config.get_terminal_writer()
        writer.line()
        writer.line(
            f"the tests wrote to the daemon's system paths {created}: give every daemon a state_dir, "
            "checkpoint_dir and socket under tmp_path",
            red=True,
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
