"""Helpers shared by the monitor tests: real emulators on 127.0.0.1, a fake clock, polling with a deadline."""

from __future__ import annotations

import asyncio
import math
import re
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import aiohttp

from spotguard.emulate.common import RunningEmulator
from spotguard.emulate.registry import start_emulator
from spotguard.notice import Notice
from spotguard.providers.base import MonitorError

T = TypeVar("T")


@contextmanager
def emulator(provider: str, **options: Any) -> Iterator[RunningEmulator]:
    running = start_emulator(provider, **options)
    try:
        yield running
    finally:
        running.stop()


@asynccontextmanager
async def http_session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def run(coro: Awaitable[T], timeout: float = 20.0) -> T:
    """asyncio.run with an overall limit, so a hung long-poll fails the test instead of the suite."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


async def eventually(predicate: Callable[[], Any], timeout: float = 5.0, every: float = 0.005) -> Any:
    """Poll ``predicate`` until it is truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(every)


class FakeClock:
    """An injectable UTC clock that moves only when told to."""

    def __init__(self, start: datetime | None = None) -> None:
        self.now = start or datetime(2026, 11, 22, 4, 0, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


class FakeMonotonic:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def poll_outcomes(check: Callable[[], Awaitable[Notice | None]], polls: int) -> list[Notice | str | None]:
    """Call ``check`` ``polls`` times; each outcome is the notice, None, or "error" for a MonitorError."""
    outcomes: list[Notice | str | None] = []
    for _ in range(polls):
        try:
            outcomes.append(await check())
        except MonitorError:
            outcomes.append("error")
    return outcomes


def count_requests(running: RunningEmulator, method: str, path_part: str) -> int:
    return sum(1 for r in running.requests() if r["method"] == method and path_part in r["path"])


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def raw_http(method: str, url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
    """A plain blocking request straight to loopback (no proxy): status, headers, body."""
    request = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with _NO_PROXY.open(request, timeout=5) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def assert_lead_of_skew(text: str, before: str, skew: int, waited: float) -> None:
    """``text`` says ``<before><N> s ahead of the metadata service's`` with the lead a ``skew`` fault
    (the emulator's Date header ``skew`` s behind) can give: at least ``skew`` (the header's whole
    seconds only take from the emulator's clock), at most a second more plus ``waited``, the seconds
    between the fault and reading ``text``, the most an answer can have spent on its way to being read."""
    found = re.search(rf"{re.escape(before)}(\d+) s ahead of the metadata service's", text)
    assert found, text
    assert skew <= int(found[1]) <= skew + 1 + math.ceil(waited), (text, waited)
