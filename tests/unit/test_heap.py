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


def run_fresh(script: str, mode: str) -> tuple[str, int, int]:
    """``script`` in a fresh interpreter: the word and the two numbers it prints."""
    command = [sys.executable, "-c", script, mode]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    word, first, second = result.stdout.split()
    return word, int(first), int(second)


def given_back_mib(mode: str) -> tuple[str, int, int]:
    """Whether the trim gave any back; MiB given back by the frees, then by the trim."""
    return run_fresh(FREE_THEN_TRIM, mode)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_buffers_freed_in_the_heap_stay_resident_until_a_trim_gives_them_back() -> None:
    _, by_free, by_trim = given_back_mib("keep")
    assert by_free < 8 and by_trim == 0  # what the daemon held for months before
    gave, by_free, by_trim = given_back_mib("trim")
    assert gave == "True"
    assert by_free < 8 and by_trim >= 56, f"the trim gave back {by_trim} MiB of 64"


# In a fresh interpreter, as the daemon's upload threads use the heap: four threads at once each hold
# two 16 MiB parts, then let them go; then the daemon's trim. With "one-heap", the daemon's setting first.
THREADS_THEN_TRIM = """
import os, sys, threading
from spotguard.daemon import heap
from spotguard.harness import thread_heaps

def resident_mib():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024

took = heap.use_one_heap() if sys.argv[1] == "one-heap" else None
first = bytearray(24 << 20)  # a mapping of its own; its free raises the threshold past 16 MiB
del first
start = resident_mib()
together = threading.Barrier(4)

def upload_parts():
    together.wait()
    parts = [bytearray(16 << 20) for _ in range(2)]
    together.wait()  # all 128 MiB resident at once
    del parts

threads = [threading.Thread(target=upload_parts) for _ in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
heap.release_free_memory()
print(took, resident_mib() - start, thread_heaps(os.getpid()))
"""


def resident_after_threads_mib(mode: str) -> tuple[str, int, int]:
    """Whether the daemon's setting took; MiB still resident after the threads' parts and a trim; the
    heaps of the threads' own that the harness finds in the process's mappings."""
    return run_fresh(THREADS_THEN_TRIM, mode)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's heaps and mallopt")
def test_parts_freed_by_upload_threads_go_back_at_a_trim_only_from_one_heap() -> None:
    _, left, heaps = resident_after_threads_mib("a-heap-a-thread")
    assert left >= 64, f"{left} MiB"  # glibc's default: the free tops of the threads' heaps stay
    assert heaps >= 1
    took, left, heaps = resident_after_threads_mib("one-heap")
    assert took == "True"
    assert left <= 16, f"{left} MiB of the threads' 128 MiB still resident after the trim"
    assert heaps == 0
