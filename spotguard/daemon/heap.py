"""The daemon's heap over months: freed buffers go back to the system once the work that used them
is over.

glibc serves an allocation above its mmap threshold (128 KiB at first) from a mapping of its own,
unmapped when freed, but raises the threshold to the size of each such block freed, up to 32 MiB:
once the first 8 MiB frame buffer or upload part has been freed, blocks of that size come from the
heaps of the threads that use them, and stay there when freed. Measured with bench/soak.py (4,000
cycles of saves, uploads and peer handoffs), the daemon's resident size was 135-152 MiB and grew
in steps of 4-8 MiB. Holding the threshold at 1 MiB kept it at 79-81 MiB, but then every part read
for an upload is a fresh mapping, paid in page faults: 0.67-0.73 CPU-s per GiB of parts read against
0.10-0.14. So the threshold is left to glibc, which keeps the hot path's buffers in the heap for
reuse, and the daemon hands the heaps' free pages back (``malloc_trim``) when it is idle: no notice
pending, nothing uploading.

A trim reaches every heap's free blocks, but not the free top of a thread's heap: glibc gives each
new thread a heap of its own (up to eight per core) and shrinks it only when a free leaves more than
twice the mmap threshold at its top. The threads that read 16 MiB upload parts kept up to 24 MiB
each resident that way, for good: after 40 periodic checkpoints of 40 MiB to GCS an idle daemon
held 210 MiB in 12 such heaps, after one urgent checkpoint of 256 MiB to S3 137 MiB in 15. So the
daemon allocates from the main heap alone (:func:`use_one_heap`, at its start), whose free top and
free blocks a trim gives back: 65 and 64 MiB after the same work. Its threads mostly wait on
sockets and disks, with the GIL between their allocations: one heap's lock cost the uploads no CPU
that could be measured (BENCHMARKS.md).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

# How often an idle daemon gives its heaps' free pages back: a trim of heaps with nothing to give
# costs well under a millisecond; one after an upload gives back what its parts left.
TRIM_INTERVAL = 60.0
# mallopt's parameter for the most heaps the process may have (glibc's malloc.h).
_M_ARENA_MAX = -8


def use_one_heap() -> bool:
    """Serve every thread's allocations from glibc's main heap from now on. Call it before the
    process starts threads: a thread keeps the heap it first allocated from. Whether it took; False
    where the C library has no such setting (not glibc)."""
    mallopt = _libc_function("mallopt", (ctypes.c_int, ctypes.c_int))
    return mallopt is not None and bool(mallopt(_M_ARENA_MAX, 1))


def release_free_memory() -> bool:
    """Give the free pages of every heap of the process back to the system (glibc's
    ``malloc_trim(0)``). Whether any was given; False where the C library has no such call."""
    malloc_trim = _libc_function("malloc_trim", (ctypes.c_size_t,))
    return malloc_trim is not None and bool(malloc_trim(0))


@functools.cache
def _libc_function(name: str, argtypes: tuple[Any, ...]) -> Any:
    """The C library's function ``name`` returning an int, looked up once; None where there is none
    (not glibc)."""
    try:
        function = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = list(argtypes)
    function.restype = ctypes.c_int
    return function


__all__ = ["TRIM_INTERVAL", "release_free_memory", "use_one_heap"]
