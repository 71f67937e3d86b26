"""A daemon's background service that ends on an unexpected error is logged and started again (the
daemon runs for months; a dead uploader behind a live process would upload nothing, silently)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from spotguard.daemon.supervise import keep_running


def test_a_service_that_fails_is_logged_and_started_again_until_it_returns(caplog: pytest.LogCaptureFixture) -> None:
    runs: list[int] = []

    async def service() -> None:
        runs.append(len(runs) + 1)
        if len(runs) < 3:
            raise KeyError(f"a bug, run {len(runs)}")

    asyncio.run(asyncio.wait_for(keep_running("uploader", service, first_wait=0.01, most_wait=0.05), 10))
    assert runs == [1, 2, 3]
    errors = [record for record in caplog.records if record.levelno == logging.ERROR]
    assert [record.getMessage().split(";")[0] for record in errors] == [
        "the daemon's uploader ended with an error (1 in a row)",
        "the daemon's uploader ended with an error (2 in a row)",
    ]
    assert all(record.exc_info is not None for record in errors)  # with the traceback that says where


def test_a_cancelled_service_is_not_started_again() -> None:
    runs: list[int] = []

    async def scenario() -> None:
        started = asyncio.Event()

        async def service() -> None:
            runs.append(1)
            started.set()
            await asyncio.Event().wait()

        task = asyncio.create_task(keep_running("uploader", service, first_wait=0.01))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert runs == [1]
