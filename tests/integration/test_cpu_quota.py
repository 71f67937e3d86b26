"""A daemon in a cgroup with a CPU quota (a container's CPU limit) sizes its peer workers by the
quota, not by the cores it sees: a real cgroup on this machine, made and removed by the test (root)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotguard.peer.workers import MAX_WORKERS

V1_CPU = Path("/sys/fs/cgroup/cpu")  # a cgroup v1 cpu hierarchy, where the host mounts one
V2_ROOT = Path("/sys/fs/cgroup")  # the unified hierarchy, where the host mounts it there

# The child joins the cgroup first, then makes its process's pool as the daemon would.
CHILD = """
import json, os, sys
with open(sys.argv[1], "w") as procs:
    procs.write(str(os.getpid()))
from spotguard.cpus import cpu_quota
from spotguard.peer import workers
pool = workers.pool()
print(json.dumps({"quota": cpu_quota(), "size": pool.status()["bound"], "beside": pool.beside}))
"""


def _limited_cgroup(quota_us: int, period_us: int) -> tuple[Path, Path]:
    """A new cgroup with that quota (v1 or v2, whichever cpu controller can be written here), and
    the file a process writes its pid to, to join it."""
    name = f"spotguard-test-{uuid.uuid4().hex[:8]}"
    controls = V2_ROOT / "cgroup.subtree_control"
    if (V1_CPU / "cpu.cfs_quota_us").exists():
        group, limits = V1_CPU / name, {"cpu.cfs_period_us": str(period_us), "cpu.cfs_quota_us": str(quota_us)}
    elif controls.exists() and "cpu" in controls.read_text().split():
        group, limits = V2_ROOT / name, {"cpu.max": f"{quota_us} {period_us}"}
    else:
        pytest.skip("no cgroup cpu controller here (v1 at /sys/fs/cgroup/cpu, or v2 with cpu delegated)")
    try:
        group.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a cgroup here: {exc}")
    try:
        for setting, value in limits.items():
            (group / setting).write_text(value)
    except BaseException:
        group.rmdir()
        raise
    return group, group / "cgroup.procs"


@pytest.fixture
def half_a_core() -> Iterator[Path]:
    group, procs = _limited_cgroup(50_000, 100_000)
    try:
        yield procs
    finally:
        group.rmdir()  # its one process has exited


def _pool_in(procs: Path | None) -> dict[str, object]:
    args = [sys.executable, "-c", CHILD, str(procs) if procs else os.devnull]
    result = subprocess.run(args, capture_output=True, text=True, timeout=60, check=True)
    return dict(json.loads(result.stdout))


def test_a_cpu_quota_sizes_the_peer_worker_pool(half_a_core: Path) -> None:
    cores = len(os.sched_getaffinity(0))
    outside = _pool_in(None)
    assert outside["size"] == min(MAX_WORKERS, cores)
    inside = _pool_in(half_a_core)
    assert inside["quota"] == 0.5
    assert inside["size"] == 1 and inside["beside"] is False
