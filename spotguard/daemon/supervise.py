"""The daemon's background services (the uploader, the notice lifecycle, the monitors' loops) run
for months: one that ends on an unexpected error must not stay ended, silently, behind a process
that still answers its status (no more uploads, or no more notices). :func:`keep_running` logs the
error with its traceback and starts the service again after a growing wait."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from spotguard.backoff import backoff_delay

logger = logging.getLogger("spotguard.daemon")

FIRST_WAIT = 1.0  # seconds before a service that failed starts again, doubled per failure in a row
MOST_WAIT = 60.0  # ... up to this; a run that lasted longer than this starts the count afresh


async def keep_running(
    name: str, service: Callable[[], Awaitable[None]], *, first_wait: float = FIRST_WAIT, most_wait: float = MOST_WAIT
) -> None:
    """Await ``service()`` until it returns (or is cancelled); after each error, log it and await a
    new ``service()`` once a wait (``first_wait`` doubled per failure in a row, up to ``most_wait``)
    has passed."""
    failures = 0
    while True:
        started = time.monotonic()
        try:
            await service()
            return
        except Exception:  # a bug: CancelledError (shutdown) is not an Exception and passes through
            failures = 1 if time.monotonic() - started > most_wait else failures + 1
            wait = backoff_delay(failures, first_wait, most_wait)
            logger.exception(
                "the daemon's %s ended with an error (%d in a row); it starts again in %.1f s", name, failures, wait
            )
            await asyncio.sleep(wait)


__all__ = ["keep_running"]
