"""A GCE metadata server emulator: ``preempted``, ``maintenance-event`` and the recursive
``instance/`` directory, with ETags and real ``wait_for_change`` long-polls.

Behaviour copied from the real server:

* Requests without ``Metadata-Flavor: Google`` get 403; every answer carries ``Metadata-Flavor: Google``
  and an ``ETag`` (a hash of the body, so equal content means equal ETag).
* ``?wait_for_change=true`` blocks until the value differs from ``last_etag`` (answering at once when it
  already differs) or ``timeout_sec`` passes (then answers the current value). Without ``last_etag`` it
  waits for the next change.
* ``instance/?recursive=true`` answers JSON with camelCase keys (``preempted``, ``maintenanceEvent``, ...).

Control API extras: ``POST /_emulator/notice`` ``{"preempted": true}`` or
``{"maintenance_event": "TERMINATE_ON_HOST_MAINTENANCE"}``; fault kind ``no_flavor`` answers the real
value without the ``Metadata-Flavor`` header (as a captive proxy would); ``GET /_emulator/state``
includes ``waiting``, the number of long-polls in flight.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from spotguard.emulate.common import Emulator, Fault, Handler

BASE = "/computeMetadata/v1/instance/"
FLAVOR = "Metadata-Flavor"
MAINTENANCE_VALUES = ("NONE", "MIGRATE_ON_HOST_MAINTENANCE", "TERMINATE_ON_HOST_MAINTENANCE")
MAX_TIMEOUT_SEC = 3600


def etag_of(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest()[:16]


@dataclass(eq=False)
class GcpEmulator(Emulator):
    provider = "gcp"
    default_action = "preempted"

    instance_id: str = "4520031799277581759"
    instance_name: str = "spotguard-vm"
    waiting: int = field(default=0, init=False)  # long-polls in flight

    def __post_init__(self) -> None:
        super().__post_init__()
        self.clear()

    def clear(self) -> None:
        self.preempted = False
        self.maintenance_event = "NONE"

    def default_notice(self) -> dict[str, Any]:
        if self.action in MAINTENANCE_VALUES:
            return {"maintenance_event": self.action}
        return {"preempted": True}

    def state(self) -> dict[str, Any]:
        return {"preempted": self.preempted, "maintenance_event": self.maintenance_event, "waiting": self.waiting}

    def trigger(self, spec: dict[str, Any]) -> dict[str, Any]:
        if "maintenance_event" in spec:
            value = str(spec["maintenance_event"])
            if value not in MAINTENANCE_VALUES:
                raise ValueError(f"maintenance_event must be one of {MAINTENANCE_VALUES}")
            self.maintenance_event = value
        if "preempted" in spec or "maintenance_event" not in spec:
            self.preempted = bool(spec.get("preempted", True))
        return self.state()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(BASE + "preempted", self._value(lambda: "TRUE" if self.preempted else "FALSE"))
        app.router.add_get(BASE + "maintenance-event", self._value(lambda: self.maintenance_event))
        app.router.add_get(BASE + "id", self._value(lambda: self.instance_id))
        app.router.add_get(BASE + "name", self._value(lambda: self.instance_name))
        app.router.add_get(BASE, self._directory)

    def _document(self) -> dict[str, Any]:
        return {
            "id": int(self.instance_id),
            "name": self.instance_name,
            "maintenanceEvent": self.maintenance_event,
            "preempted": "TRUE" if self.preempted else "FALSE",
            "scheduling": {"automaticRestart": "FALSE", "onHostMaintenance": "TERMINATE", "preemptible": "TRUE"},
            "zone": "projects/123456789012/zones/europe-west4-a",
        }

    def _value(self, read: Callable[[], str]) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await self._answer(request, read, "application/text")

        return handler

    async def _directory(self, request: web.Request) -> web.StreamResponse:
        if request.query.get("recursive", "").lower() != "true":
            listing = "\n".join(sorted(["id", "name", "maintenance-event", "preempted", "scheduling/", "zone"]))
            return await self._answer(request, lambda: listing + "\n", "application/text")
        return await self._answer(request, lambda: json.dumps(self._document()), "application/json")

    async def _answer(self, request: web.Request, render: Callable[[], str], content_type: str) -> web.StreamResponse:
        if request.headers.get(FLAVOR) != "Google":
            return web.Response(status=403, text="Missing required header: Metadata-Flavor\n")
        if request.query.get("wait_for_change", "").lower() == "true":
            await self._wait_for_change(request, render)
        body: str = render()
        return web.Response(text=body, content_type=content_type, headers={FLAVOR: "Google", "ETag": etag_of(body)})

    async def _wait_for_change(self, request: web.Request, render: Callable[[], str]) -> None:
        try:
            timeout = min(float(request.query.get("timeout_sec", MAX_TIMEOUT_SEC)), MAX_TIMEOUT_SEC)
        except ValueError as exc:
            raise web.HTTPBadRequest(text="timeout_sec must be a number\n") from exc
        last = request.query.get("last_etag") or etag_of(render())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        self.waiting += 1
        try:
            while not self.closing and etag_of(render()) == last and (left := deadline - loop.time()) > 0:
                await self.wait_changed(left)
        finally:
            self.waiting -= 1

    def answer_headers(self) -> dict[str, str]:
        return {FLAVOR: "Google"}

    async def apply_fault(self, fault: Fault, request: web.Request, handler: Handler) -> web.StreamResponse:
        if fault.kind == "no_flavor":
            # What a proxy or captive portal in the way might answer: plausible content, wrong origin.
            return web.Response(text=json.dumps(self._document()), content_type="application/json")
        if fault.kind == "status":
            # The real server's own errors (503 during its maintenance) still say who they are from.
            return web.Response(
                status=fault.status, text=f"emulated error {fault.status}\n", headers=self.answer_headers()
            )
        return await super().apply_fault(fault, request, handler)
