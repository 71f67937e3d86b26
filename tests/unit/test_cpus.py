"""The cores the daemon may keep busy: affinity capped by the cgroup's CPU quota, read from files laid
out as the kernel lays them out (``/proc/self/cgroup``, ``/proc/self/mountinfo``, the cgroup files)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from spotguard.cpus import cpu_quota, usable_cores

AFFINITY = len(os.sched_getaffinity(0))


def _proc(tmp_path: Path, cgroup: str, mounts: list[str]) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text("".join(line + "\n" for line in mounts))
    return proc


def _write(directory: Path, files: dict[str, str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text + "\n")


def _v2_mount(point: Path, root: str = "/") -> str:
    return f"41 31 0:38 {root} {point} rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw,nsdelegate"


def _v1_mount(point: Path, root: str, options: str = "cpu,cpuacct") -> str:
    return f"32 31 0:29 {root} {point} rw,nosuid,nodev,noexec,relatime shared:9 - cgroup cgroup rw,{options}"


def test_v2_takes_the_tightest_quota_of_the_cgroup_and_its_ancestors(tmp_path: Path) -> None:
    mount = tmp_path / "cg"
    _write(mount / "kubepods.slice", {"cpu.max": "max 100000"})
    _write(mount / "kubepods.slice/pod1", {"cpu.max": "400000 100000"})
    _write(mount / "kubepods.slice/pod1/ctr", {"cpu.max": "150000 100000"})
    proc = _proc(tmp_path, "0::/kubepods.slice/pod1/ctr\n", [_v2_mount(mount)])
    assert cpu_quota(proc) == 1.5
    assert usable_cores(proc) == min(AFFINITY, 2)  # one and a half cores' time keeps two busy part of it


def test_v2_in_a_cgroup_namespace_reads_the_mount_root(tmp_path: Path) -> None:
    mount = tmp_path / "cg"
    _write(mount, {"cpu.max": "50000 100000"})
    _write(tmp_path, {"cpu.max": "1 100000"})  # above the mount point: not this process's view
    proc = _proc(tmp_path, "0::/\n", [_v2_mount(mount)])
    assert cpu_quota(proc) == 0.5
    assert usable_cores(proc) == 1


def test_v1_cpu_hierarchy_mounted_at_the_containers_own_cgroup(tmp_path: Path) -> None:
    mount = tmp_path / "cpu,cpuacct"
    _write(mount, {"cpu.cfs_quota_us": "300000", "cpu.cfs_period_us": "100000"})
    cgroup = "12:pids:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n0::/\n"
    mounts = [_v1_mount(tmp_path / "pids", "/docker/abc", "pids"), _v1_mount(mount, "/docker/abc")]
    proc = _proc(tmp_path, cgroup, mounts)
    assert cpu_quota(proc) == 3.0
    assert usable_cores(proc) == min(AFFINITY, 3)


def test_v1_cgroup_below_a_host_mount_walks_up_to_it(tmp_path: Path) -> None:
    mount = tmp_path / "cpu"
    _write(mount, {"cpu.cfs_quota_us": "-1", "cpu.cfs_period_us": "100000"})
    _write(mount / "system.slice", {"cpu.cfs_quota_us": "250000", "cpu.cfs_period_us": "100000"})
    _write(mount / "system.slice/spotguard.service", {"cpu.cfs_quota_us": "-1", "cpu.cfs_period_us": "100000"})
    proc = _proc(tmp_path, "3:cpu:/system.slice/spotguard.service\n", [_v1_mount(mount, "/", "cpu")])
    assert cpu_quota(proc) == 2.5


@pytest.mark.parametrize(
    ("cpu_max", "expected"),
    [("max 100000", None), ("garbage", None), ("0 100000", None), ("100000 0", None), ("200000 100000", 2.0)],
)
def test_v2_cpu_max_without_a_usable_quota_counts_as_none(tmp_path: Path, cpu_max: str, expected: float | None) -> None:
    mount = tmp_path / "cg"
    _write(mount, {"cpu.max": cpu_max})
    proc = _proc(tmp_path, "0::/\n", [_v2_mount(mount)])
    assert cpu_quota(proc) == expected
    assert usable_cores(proc) == (AFFINITY if expected is None else min(AFFINITY, math.ceil(expected)))


def test_nothing_readable_leaves_the_affinity(tmp_path: Path) -> None:
    assert cpu_quota(tmp_path / "no-proc") is None
    assert usable_cores(tmp_path / "no-proc") == AFFINITY
    # A cpu hierarchy that is not mounted, and one whose files are missing.
    mounts = [_v1_mount(tmp_path / "mem", "/", "memory"), _v2_mount(tmp_path / "v2")]
    proc = _proc(tmp_path, "4:cpu:/x\n0::/y\n", mounts)
    assert cpu_quota(proc) is None
    assert usable_cores(proc) == AFFINITY
