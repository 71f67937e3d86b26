"""Fixtures shared by the whole suite: real daemons in subprocesses on private sockets."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from spotguard.demo import Vm
from tests.diskspace import mount_tmpfs

# Tests spawn trainer subprocesses; one thread each keeps 2 cores from thrashing and reductions repeatable.
os.environ.setdefault("OMP_NUM_THREADS", "1")


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
