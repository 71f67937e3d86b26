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
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

# How often an idle daemon gives its heaps' free pages back: a trim of heaps with nothing to give
# costs well under a millisecond; one after an upload gives back what its parts left.
TRIM_INTERVAL = 60.0


def release_free_memory() -> bool:
    """Give the free pages of every heap of the process back to the system (glibc's
    ``malloc_trim(0)``). Whether any was given; False where the C library has no such call."""
    malloc_trim = _malloc_trim()
    return malloc_trim is not None and bool(malloc_trim(0))


@functools.cache
def _malloc_trim() -> Any:
    """The C library's ``malloc_trim``, looked up once; None where there is none (not glibc)."""
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim.restype = ctypes.c_int
    return malloc_trim


__all__ = ["TRIM_INTERVAL", "release_free_memory"]
