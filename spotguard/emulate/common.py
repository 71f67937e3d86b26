"""What the three metadata emulators share: fault injection, request recording, the control API
plumbing, and running an emulator in a background thread (tests, the demo) or in the foreground
(``spotguard emulate``).

Each emulator is an :class:`Emulator` subclass that adds its cloud's routes to an aiohttp app.
Everything under ``/_emulator/`` is the control API (JSON in, JSON out); every other request is
"the instance talking to its metadata service", is recorded, and goes through the fault injector.

Control API, common to all providers::

    POST   /_emulator/notice    {...}          provider-specific: make a notice appear
    POST   /_emulator/clear                    back to "no notice"
    POST   /_emulator/faults    {"faults": [{"kind": "status", "status": 503, "count": 2}, ...]}
    DELETE /_emulator/faults                   remove all faults
    GET    /_emulator/requests                 what the instance side asked, oldest first
    GET    /_emulator/state                    provider-specific snapshot

Fault kinds: ``status`` (answer ``status``, default 500), ``garbage`` (200 with a junk body, or with
``body``: a hostile answer that looks almost right), ``drop`` (close the connection without an
answer), ``flood`` (200, then 16 MiB of body without a length, as a proxy gone wrong streams),
``latency`` (wait ``seconds`` first; combines with the others), ``skew`` (answer as usual, with a
``Date`` header ``seconds`` behind this host's clock; combines too), plus provider-specific ones (GCP
``no_flavor``). ``count`` limits how many requests a fault hits (``null`` = until removed); ``path``
limits it to paths containing that text.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import urllib.request
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any, ClassVar

from aiohttp import web

logger = logging.getLogger(__name__)

CONTROL_PREFIX = "/_emulator/"
GARBAGE_BODY = b"\x00\xff<html>not what you asked for{"
FLOOD_BYTES = 16 << 20  # a flood fault's body: far past what a monitor reads (spotguard.providers.base.MAX_ANSWER)
MAX_RECORDED_REQUESTS = 2000
# The control API is on loopback: an http_proxy in the environment must not take it elsewhere.
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class Fault:
    kind: str  # status | garbage | drop | flood | latency | skew | no_flavor (GCP)
    count: int | None = None  # requests left to hit; None = until cleared
    status: int = 500
    seconds: float = 0.0
    path: str | None = None
    body: str | None = None  # garbage: this instead of GARBAGE_BODY

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Fault:
        kind = str(data["kind"])
        if kind not in ("status", "garbage", "drop", "flood", "latency", "skew", "no_flavor"):
            raise ValueError(f"unknown fault kind {kind!r}")
        count = data.get("count")
        return cls(
            kind=kind,
            count=None if count is None else int(count),
            status=int(data.get("status", 500)),
            seconds=float(data.get("seconds", 0.0)),
            path=data.get("path"),
            body=None if data.get("body") is None else str(data["body"]),
        )

    def matches(self, path: str) -> bool:
        return (self.count is None or self.count > 0) and (self.path is None or self.path in path)

    def consume(self) -> None:
        if self.count is not None:
            self.count -= 1


@dataclass(eq=False)
class Emulator:
    """Base class: one metadata service, its faults and its control API.

    A provider's emulator is a dataclass subclass too: its options are its fields (after ``notice_after``
    and ``action``), its state fields with ``init=False``. ``action`` left out is ``default_action``.
    """

    provider: ClassVar[str] = "none"
    default_action: ClassVar[str | None] = None

    notice_after: float | None = None
    action: str | None = None
    faults: list[Fault] = field(default_factory=list, init=False, repr=False)
    requests: list[dict[str, Any]] = field(default_factory=list, init=False, repr=False)
    closing: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self.action = self.action or self.default_action
        self._changed = asyncio.Condition()
        self._timers: list[asyncio.TimerHandle] = []

    # --- to be extended by providers --------------------------------------------------------

    def add_routes(self, app: web.Application) -> None:
        raise NotImplementedError

    def trigger(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Make a notice appear; returns what was created (ids, times)."""
        raise NotImplementedError

    def clear(self) -> None:
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        return {}

    def answer_headers(self) -> dict[str, str]:
        """Headers every real answer carries (GCP: ``Metadata-Flavor``); faults keep them."""
        return {}

    def default_notice(self) -> dict[str, Any]:
        """The notice ``notice_after`` triggers."""
        return {"action": self.action} if self.action else {}

    # --- shared machinery --------------------------------------------------------------------

    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware])
        app.router.add_post("/_emulator/notice", self._control_notice)
        app.router.add_post("/_emulator/clear", self._control_clear)
        app.router.add_post("/_emulator/faults", self._control_add_faults)
        app.router.add_delete("/_emulator/faults", self._control_clear_faults)
        app.router.add_get("/_emulator/requests", self._control_requests)
        app.router.add_get("/_emulator/state", self._control_state)
        self.add_routes(app)
        app.on_startup.append(self._schedule_notice)
        app.on_shutdown.append(self._release_waiters)
        app.on_cleanup.append(self._cancel_timers)
        return app

    async def changed(self) -> None:
        """Wake long-polls (GCP ``wait_for_change``) after a state change."""
        async with self._changed:
            self._changed.notify_all()

    async def wait_changed(self, timeout: float) -> None:
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout)

    def later(self, delay: float, callback: Callable[[], Coroutine[Any, Any, None]]) -> None:
        loop = asyncio.get_running_loop()
        self._timers.append(loop.call_later(delay, lambda: loop.create_task(callback())))

    async def _schedule_notice(self, _app: web.Application) -> None:
        if self.notice_after is not None:

            async def fire() -> None:
                logger.info("%s emulator: notice_after elapsed, triggering a notice", self.provider)
                self.trigger(self.default_notice())
                await self.changed()

            self.later(self.notice_after, fire)

    async def _release_waiters(self, _app: web.Application) -> None:
        # Answer pending long-polls now rather than make shutdown wait for their timeout.
        self.closing = True
        await self.changed()

    async def _cancel_timers(self, _app: web.Application) -> None:
        for timer in self._timers:
            timer.cancel()

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith(CONTROL_PREFIX):
            return await handler(request)
        self._record(request)
        active = [f for f in self.faults if f.matches(request.path)]
        for fault in active:
            if fault.kind == "latency":
                fault.consume()
                await asyncio.sleep(fault.seconds)
        skews = [f for f in active if f.kind == "skew"]
        for fault in skews:
            fault.consume()
        for fault in active:
            if fault.kind in ("latency", "skew"):
                continue
            fault.consume()
            return await self.apply_fault(fault, request, handler)
        response = await handler(request)
        if skews:  # aiohttp writes a Date header of its own only where none was set
            behind = datetime.now(UTC) - timedelta(seconds=skews[0].seconds)
            response.headers["Date"] = format_datetime(behind, usegmt=True)
        return response

    async def apply_fault(self, fault: Fault, request: web.Request, handler: Handler) -> web.StreamResponse:
        if fault.kind == "status":
            return web.Response(status=fault.status, text=f"emulated error {fault.status}\n")
        if fault.kind == "garbage":
            # Answered at once (no long-poll), with the headers a real answer has: only the body is wrong.
            body = GARBAGE_BODY if fault.body is None else fault.body.encode()
            return web.Response(status=200, body=body, headers=self.answer_headers())
        if fault.kind == "flood":
            response = web.StreamResponse(status=200, headers=self.answer_headers())
            await response.prepare(request)
            chunk = b"x" * (64 * 1024)
            with contextlib.suppress(ConnectionError):  # the client stops reading, as it should
                for _ in range(FLOOD_BYTES // len(chunk)):
                    await response.write(chunk)
                await response.write_eof()
            return response
        if fault.kind == "drop":
            if request.transport is not None:
                request.transport.abort()
            # The client sees a dropped connection; aiohttp needs *some* response object.
            raise asyncio.CancelledError
        raise ValueError(f"fault {fault.kind!r} is not handled by the {self.provider} emulator")

    def _record(self, request: web.Request) -> None:
        self.requests.append(
            {
                "method": request.method,
                "path": request.path,
                "query": dict(request.query),
                "headers": {k: v for k, v in request.headers.items() if k.lower() not in ("host",)},
            }
        )
        del self.requests[:-MAX_RECORDED_REQUESTS]

    async def _control_notice(self, request: web.Request) -> web.Response:
        spec = await _json_body(request)
        try:
            created = self.trigger(spec)
        except (KeyError, ValueError, TypeError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        await self.changed()
        return web.json_response(created)

    async def _control_clear(self, _request: web.Request) -> web.Response:
        self.clear()
        await self.changed()
        return web.json_response({"cleared": True})

    async def _control_add_faults(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        try:
            faults = [Fault.from_json(item) for item in body.get("faults", [body])]
        except (KeyError, ValueError, TypeError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        self.faults.extend(faults)
        return web.json_response({"faults": len(self.faults)})

    async def _control_clear_faults(self, _request: web.Request) -> web.Response:
        self.faults.clear()
        return web.json_response({"faults": 0})

    async def _control_requests(self, _request: web.Request) -> web.Response:
        return web.json_response(self.requests)

    async def _control_state(self, _request: web.Request) -> web.Response:
        return web.json_response(self.state())


async def _json_body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        data = await request.json()
    except ValueError as exc:
        raise web.HTTPBadRequest(text=f"not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise web.HTTPBadRequest(text="expected a JSON object")
    return data


async def start_site(emulator: Emulator, host: str, port: int) -> tuple[web.AppRunner, str]:
    # No access log: tests poll the emulators hundreds of times a second. A client that hangs up
    # ends its long-poll (handler_cancellation), and stopping does not wait out long-polls.
    runner = web.AppRunner(
        emulator.build_app(),
        access_log=None,
        handle_signals=False,
        handler_cancellation=True,
        shutdown_timeout=1.0,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound_port = runner.addresses[0][1]  # the real port when 0 (random) was asked for
    return runner, f"http://{host}:{bound_port}"


class RunningEmulator:
    """An emulator serving on 127.0.0.1 from a background thread. Use :func:`start_emulator`.

    ``url`` is the base URL a monitor takes (``metadata_url``); ``control`` talks to the
    control API with blocking HTTP (fine from tests: the emulator has its own thread and loop).
    """

    def __init__(self, emulator: Emulator, host: str = "127.0.0.1", port: int = 0) -> None:
        self.emulator = emulator
        self.url = ""
        self._host = host
        self._port = port
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._run, name=f"emulator-{emulator.provider}", daemon=True)

    def start(self) -> RunningEmulator:
        self._thread.start()
        if not self._ready.wait(timeout=10):
            raise RuntimeError(f"{self.emulator.provider} emulator did not start within 10 s")
        if self._error is not None:
            raise RuntimeError(f"{self.emulator.provider} emulator failed to start") from self._error
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._runner, self.url = self._loop.run_until_complete(start_site(self.emulator, self._host, self._port))
        except BaseException as exc:  # reported to start() in the caller's thread
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def control(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        """Call ``/_emulator/<path>``; returns the decoded JSON answer."""
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(
            f"{self.url}{CONTROL_PREFIX}{path.lstrip('/')}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        with _NO_PROXY.open(request, timeout=10) as response:
            return json.loads(response.read() or b"null")

    def trigger(self, **spec: Any) -> dict[str, Any]:
        result: dict[str, Any] = self.control("POST", "notice", spec)
        return result

    def clear(self) -> None:
        self.control("POST", "clear", {})

    def inject(self, *faults: dict[str, Any]) -> None:
        self.control("POST", "faults", {"faults": list(faults)})

    def clear_faults(self) -> None:
        self.control("DELETE", "faults")

    def requests(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.control("GET", "requests")
        return result

    def state(self) -> dict[str, Any]:
        result: dict[str, Any] = self.control("GET", "state")
        return result

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> RunningEmulator:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()
