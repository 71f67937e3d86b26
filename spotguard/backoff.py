"""How long to wait before trying again after failures in a row: one rule for the daemon's retries."""

from __future__ import annotations

import math
import random

# Our own generator: the module's global one belongs to the trainer, whose checkpoints hold its state
# (spotguard/trainer/state.py). A draw from it here, in a retry of the hook's bucket listing, moved the
# sequence of a job that then started fresh off the one the same seeded job drew without the retry.
_jitter = random.Random()

# Past this many doublings every wait is at its cap; the exponent is bounded so that a daemon failing
# for days (a revoked credential over a long weekend: thousands of failures) never overflows a float.
_MOST_DOUBLINGS = 64


def backoff_delay(failures: int, first: float, most: float = math.inf) -> float:
    """Seconds to wait after ``failures`` (from 1) failures in a row: ``first`` doubled per failure up
    to ``most``, jittered over its upper half, so that the VMs of a fleet whose bucket (or peer, or
    webhook) failed at once do not all come back in step."""
    delay = min(most, first * 2.0 ** min(max(failures, 1) - 1, _MOST_DOUBLINGS))
    return jitter(delay / 2, delay)


def jitter(low: float, high: float) -> float:
    """A random wait in [``low``, ``high``], drawn without touching :mod:`random`'s global state."""
    return _jitter.uniform(low, high)


__all__ = ["backoff_delay", "jitter"]
