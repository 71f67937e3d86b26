"""Build, start or serve a provider's emulator by the provider's name (the provider registry knows it)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from typing import Any

from spotguard.emulate.common import Emulator, RunningEmulator, start_site
from spotguard.providers import registry


def make_emulator(
    provider: str, notice_after: float | None = None, action: str | None = None, **options: Any
) -> Emulator:
    """The emulator of ``provider`` (any registered provider: "aws", "gcp", "azure", ...)."""
    try:
        factory = registry.get(provider).emulator
    except LookupError:
        raise ValueError(f"no emulator for provider {provider!r} ({', '.join(registry.names())})") from None
    return factory(notice_after=notice_after, action=action, **options)


def start_emulator(
    provider: str, notice_after: float | None = None, action: str | None = None, **options: Any
) -> RunningEmulator:
    """Start an emulator on 127.0.0.1 with a random port, in a background thread.

    >>> emu = start_emulator("aws", notice_after=5, action="stop")
    >>> emu.url                                   # e.g. http://127.0.0.1:41235
    >>> emu.inject({"kind": "status", "status": 500, "count": 2})
    >>> emu.stop()
    """
    return RunningEmulator(make_emulator(provider, notice_after, action, **options)).start()


async def serve(
    provider: str, host: str, port: int, notice_after: float | None = None, action: str | None = None
) -> None:
    """Serve an emulator until cancelled."""
    emulator = make_emulator(provider, notice_after, action)
    runner, url = await start_site(emulator, host, port)
    print(f"spotguard {provider} metadata emulator on {url}", flush=True)
    print(f"  e.g. spotguard run --provider {provider} --metadata-url {url}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def run_emulator_forever(provider: str, host: str, port: int, notice_after: float | None, action: str | None) -> None:
    """``spotguard emulate``: serve until SIGINT/SIGTERM, printing the URL on stdout."""

    async def main() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await serve(provider, host, port, notice_after, action)
        print("emulator stopped", file=sys.stderr, flush=True)

    asyncio.run(main())
