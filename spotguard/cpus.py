"""How many cores this process can keep busy: its CPU affinity, capped by its cgroup's CPU quota.

A container's CPU limit is not an affinity: a pod limited to ``cpu: "2"`` on a 96-core node sees 96
cores in ``sched_getaffinity`` and gets 2 cores' worth of time in every period of the CFS scheduler
(``cpu.max`` in cgroup v2, ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` in v1). Sizing a pool of
busy processes by the 96 makes them spend the quota early in each period, and then everything in the
cgroup, the daemon's event loop included, waits out the rest of it. So the quota counts, rounded up,
as the runtimes of Go and the JVM count it; the tightest of the cgroup and its ancestors applies.

Read once per use, from ``/proc/self/cgroup`` and ``/proc/self/mountinfo`` (where each hierarchy is
mounted, and which part of it: a container sees its own cgroup as a mount's root). Anything that
cannot be read or parsed counts as no quota: the affinity alone, as before.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

PROC = Path("/proc/self")


def usable_cores(proc: Path = PROC) -> int:
    """The cores this process may run on, capped by its cgroup's CPU quota (rounded up, at least 1)."""
    cores = len(os.sched_getaffinity(0))
    quota = cpu_quota(proc)
    return cores if quota is None else max(1, min(cores, math.ceil(quota)))


def cpu_quota(proc: Path = PROC) -> float | None:
    """This process's CPU quota in cores (1.5: one and a half cores' time per period), the tightest
    of its cgroup and their ancestors' in the hierarchies that hold the ``cpu`` controller; None
    where there is none, or it cannot be read."""
    try:
        groups = (proc / "cgroup").read_text().splitlines()
        mounts = (proc / "mountinfo").read_text().splitlines()
    except OSError:
        return None
    quotas: list[float] = []
    for line in groups:
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if number == "0" and controllers == "":
            quotas += _quotas(_group_dir(mounts, "cgroup2", None, path), _v2_quota)
        elif "cpu" in controllers.split(","):
            quotas += _quotas(_group_dir(mounts, "cgroup", "cpu", path), _v1_quota)
    return min(quotas) if quotas else None


def _group_dir(mounts: list[str], fstype: str, controller: str | None, path: str) -> tuple[Path, Path] | None:
    """Where the cgroup ``path`` of a hierarchy is in this process's view (a mount of ``fstype``
    carrying ``controller``), and the mount point it may not be walked above; None if not mounted."""
    for line in mounts:
        fields, _, tail = line.partition(" - ")
        parts, super_parts = fields.split(), tail.split()
        if len(parts) < 5 or len(super_parts) < 3 or super_parts[0] != fstype:
            continue
        if controller is not None and controller not in super_parts[2].split(","):
            continue
        root, mount_point = parts[3], Path(parts[4])
        if path == root:
            return mount_point, mount_point
        if path.startswith(root.rstrip("/") + "/"):  # below the mounted part ("/": the whole hierarchy)
            return mount_point / path[len(root) :].lstrip("/"), mount_point
        # A cgroup namespace shows the process's own cgroup as "/" and mounts it as the root.
        return mount_point / path.lstrip("/"), mount_point
    return None


def _quotas(where: tuple[Path, Path] | None, read: Callable[[Path], float | None]) -> list[float]:
    """The quota of the cgroup at ``where`` and of each of its ancestors up to the mount point."""
    if where is None:
        return []
    directory, top = where
    found: list[float] = []
    while True:
        quota = read(directory)
        if quota is not None:
            found.append(quota)
        if directory == top or top not in directory.parents:
            return found
        directory = directory.parent


def _v2_quota(directory: Path) -> float | None:
    """``cpu.max``: "<quota> <period>" in microseconds, or "max <period>" for none."""
    try:
        quota, period = (directory / "cpu.max").read_text().split()
        return None if quota == "max" else _ratio(int(quota), int(period))
    except (OSError, ValueError):
        return None


def _v1_quota(directory: Path) -> float | None:
    """``cpu.cfs_quota_us`` (-1 for none) over ``cpu.cfs_period_us``."""
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota < 0 else _ratio(quota, period)


def _ratio(quota: int, period: int) -> float | None:
    return quota / period if quota > 0 and period > 0 else None


__all__ = ["cpu_quota", "usable_cores"]
