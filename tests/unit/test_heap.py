"""What the daemon's idle trim gives back (spotguard/daemon/heap.py): big buffers freed in the
middle of the heap (glibc raised its mmap threshold when the first one was freed) stay resident
until a trim."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

# In a fresh interpreter: eight 8 MiB buffers from the heap, each followed by a 200 KiB one that
# lives on (so that none of them is at the heap's top, which free() gives back by itself); the
# eight are freed; then, with "trim", the daemon's trim.
FREE_THEN_TRIM = """
import sys
from spotguard.daemon.heap import release_free_memory

def resident_mib():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024

first = bytearray(8 << 20)  # a mapping of its own; its free raises the threshold past 8 MiB
del first
buffers, kept = [], []
for _ in range(8):
    buffers.append(bytearray(8 << 20))
    kept.append(bytearray(200_000))
before = resident_mib()
del buffers
freed = resident_mib()
gave = release_free_memory() if sys.argv[1] == "trim" else None
print(gave, before - freed, freed - resident_mib())
"""


def given_back_mib(mode: str) -> tuple[str, int, int]:
    """Whether the trim gave any back; MiB given back by the frees, then by the trim."""
    command = [sys.executable, "-c", FREE_THEN_TRIM, mode]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    gave, by_free, by_trim = result.stdout.split()
    return gave, int(by_free), int(by_trim)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_buffers_freed_in_the_heap_stay_resident_until_a_trim_gives_them_back() -> None:
    _, by_free, by_trim = given_back_mib("keep")
    assert by_free < 8 and by_trim == 0  # what the daemon held for months before
    gave, by_free, by_trim = given_back_mib("trim")
    assert gave == "True"
    assert by_free < 8 and by_trim >= 56, f"the trim gave back {by_trim} MiB of 64"
