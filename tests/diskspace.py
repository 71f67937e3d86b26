"""A small real filesystem to fill up: a tmpfs the test mounts itself (tests run as root)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


def mount_tmpfs(base: Path) -> Iterator[Callable[[int], Path]]:
    """Yields ``mount(size_bytes) -> Path``; every tmpfs mounted through it is unmounted afterwards.
    Skips the test (saying why) where mounting is not permitted."""
    mounts: list[Path] = []

    def mount(size: int) -> Path:
        target = base / f"fs{len(mounts)}"
        target.mkdir(parents=True)
        command = ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(target)]
        try:
            result = subprocess.run(command, capture_output=True, text=True, check=False)
        except FileNotFoundError:
            pytest.skip("no mount(8) here: the disk-full tests need to mount a small tmpfs")
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {result.stderr.strip() or result.returncode}")
        mounts.append(target)
        return target

    try:
        yield mount
    finally:
        for target in reversed(mounts):
            if subprocess.run(["umount", str(target)], check=False).returncode != 0:
                subprocess.run(["umount", "--lazy", str(target)], check=False)  # a process still holds a file


def fill(path: Path, leave: int, name: str = "filler") -> Path:
    """Take all but ``leave`` free bytes of ``path``'s filesystem with one file; returns the file."""
    filler = path / name
    size = shutil.disk_usage(path).free - leave
    assert size > 0, f"{path} has less than {leave} bytes free already"
    fd = os.open(filler, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)
    assert shutil.disk_usage(path).free <= leave
    return filler


def make_read_only(path: Path) -> None:
    """Remount the tmpfs at ``path`` read-only, as the kernel does a root filesystem after an I/O error
    (ext4's ``errors=remount-ro``); it is still unmounted at teardown."""
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True, capture_output=True)
