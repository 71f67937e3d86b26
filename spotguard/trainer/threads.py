"""How many threads write (and read) one rank's checkpoint files.

One rule for every path that moves checkpoint bytes on the trainer's side: ``Guard(write_threads=N)``,
else ``SPOTGUARD_WRITE_THREADS``, else a default from the CPU count. A local disk answers a deeper
queue with more bandwidth (the bytes wait on the device, not on a core), so the default is at least
4 even on a small machine, and one per core on larger ones, up to 16.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from spotguard.errors import ConfigError

ENV = "SPOTGUARD_WRITE_THREADS"
MAX_THREADS = 64


def default_threads(cpus: int | None = None) -> int:
    cpus = cpus if cpus is not None else (os.cpu_count() or 1)
    return max(4, min(16, cpus))


def write_threads(value: int | None = None, env: Mapping[str, str] | None = None) -> int:
    """``value`` if given, else ``$SPOTGUARD_WRITE_THREADS``, else :func:`default_threads`.

    A value that is not a whole number from 1 to 64 raises :class:`spotguard.errors.ConfigError` (a
    ``ValueError``) naming the argument or the variable it came from.
    """
    env = os.environ if env is None else env
    key, raw = ("write_threads", value) if value is not None else (ENV, env.get(ENV))
    if raw is None or raw == "":
        return default_threads()
    try:
        threads = raw if isinstance(raw, int) and not isinstance(raw, bool) else int(str(raw).strip())
    except ValueError:
        raise ConfigError(key, f"must be a whole number of threads, got {raw!r}") from None
    if not 1 <= threads <= MAX_THREADS:
        raise ConfigError(key, f"must be from 1 to {MAX_THREADS}, got {raw!r}")
    return threads
