"""An Azure Instance Metadata Service emulator: Scheduled Events and the VM's name.

Behaviour copied from the real service:

* Requests without ``Metadata: true`` get 400, so do requests without ``api-version``.
* ``GET /metadata/scheduledevents`` answers ``{"DocumentIncarnation": n, "Events": [...]}``;
  ``DocumentIncarnation`` goes up by one on every change to the events.
* ``POST /metadata/scheduledevents`` ``{"StartRequests": [{"EventId": ...}]}`` approves events:
  they move to ``EventStatus: Started`` with a blank ``NotBefore`` and, after
  ``remove_started_after`` seconds (default: never), disappear as the real ones do once done.
* ``GET /metadata/instance/compute/name?format=text`` answers the VM's name.

Control API extras: ``POST /_emulator/notice`` ``{"type": "Preempt", "in": 30, "resources": ["vm"],
"event_id": "...", "status": "Scheduled"}`` (defaults: Preempt, 30 s, this VM, a new GUID);
``GET /_emulator/acks`` lists every ``StartRequests`` body received.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

from aiohttp import web

from spotguard.emulate.common import Emulator

EVENTS_PATH = "/metadata/scheduledevents"
NAME_PATH = "/metadata/instance/compute/name"
EVENT_TYPES = ("Preempt", "Terminate", "Reboot", "Redeploy", "Freeze")
DEFAULT_DURATION = {"Preempt": -1, "Terminate": -1, "Reboot": -1, "Redeploy": -1, "Freeze": 9}


def not_before(moment: datetime) -> str:
    """Scheduled Events' time format: ``Mon, 19 Sep 2016 18:29:47 GMT``."""
    return format_datetime(moment.astimezone(UTC), usegmt=True)


@dataclass(eq=False)
class AzureEmulator(Emulator):
    provider = "azure"
    default_action = "Preempt"

    vm_name: str = "spotguard-vm"
    remove_started_after: float | None = None
    incarnation: int = field(default=1, init=False)
    events: list[dict[str, Any]] = field(default_factory=list, init=False, repr=False)
    acks: list[dict[str, Any]] = field(default_factory=list, init=False, repr=False)

    def clear(self) -> None:
        if self.events:
            self.events = []
            self.incarnation += 1

    def default_notice(self) -> dict[str, Any]:
        return {"type": self.action}

    def state(self) -> dict[str, Any]:
        return {"DocumentIncarnation": self.incarnation, "Events": self.events, "acks": self.acks}

    def trigger(self, spec: dict[str, Any]) -> dict[str, Any]:
        event_type = str(spec.get("type") or "Preempt")
        if event_type not in EVENT_TYPES:
            raise ValueError(f"type must be one of {EVENT_TYPES}")
        status = str(spec.get("status", "Scheduled"))
        start = datetime.now(UTC) + timedelta(seconds=float(spec.get("in", 30)))
        event = {
            "EventId": str(spec.get("event_id") or uuid.uuid4()).upper(),
            "EventStatus": status,
            "EventType": event_type,
            "ResourceType": "VirtualMachine",
            "Resources": list(spec.get("resources") or [self.vm_name]),
            "NotBefore": "" if status == "Started" else not_before(start),
            "Description": spec.get("description", f"emulated {event_type}"),
            "EventSource": spec.get("source", "Platform"),
            "DurationInSeconds": int(spec.get("duration", DEFAULT_DURATION[event_type])),
        }
        self.events = [e for e in self.events if e["EventId"] != event["EventId"]] + [event]
        self.incarnation += 1
        return dict(event)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(EVENTS_PATH, self._get_events)
        app.router.add_post(EVENTS_PATH, self._post_start_requests)
        app.router.add_get(NAME_PATH, self._get_name)
        app.router.add_get("/_emulator/acks", self._control_acks)

    def _refuse(self, request: web.Request) -> web.Response | None:
        if request.headers.get("Metadata", "").lower() != "true":
            return web.json_response({"error": "Bad request. Required metadata header not specified"}, status=400)
        if "api-version" not in request.query:
            return web.json_response({"error": "Bad request. api-version was not specified"}, status=400)
        return None

    async def _get_events(self, request: web.Request) -> web.Response:
        if refused := self._refuse(request):
            return refused
        return web.json_response({"DocumentIncarnation": self.incarnation, "Events": self.events})

    async def _post_start_requests(self, request: web.Request) -> web.Response:
        if refused := self._refuse(request):
            return refused
        try:
            body = await request.json()
            ids = [str(item["EventId"]) for item in body["StartRequests"]]
        except (ValueError, KeyError, TypeError):
            return web.json_response({"error": "Bad request. Invalid StartRequests"}, status=400)
        self.acks.append(body)
        self._start(ids)
        await self.changed()
        return web.Response(status=200)

    def _start(self, ids: list[str]) -> None:
        wanted = {event_id.upper() for event_id in ids}
        started = False
        for event in self.events:
            if event["EventId"].upper() in wanted and event["EventStatus"] != "Started":
                event["EventStatus"] = "Started"
                event["NotBefore"] = ""
                started = True
        if started:
            self.incarnation += 1
            if self.remove_started_after is not None:
                self.later(self.remove_started_after, self._remove_started)

    async def _remove_started(self) -> None:
        self.events = [e for e in self.events if e["EventStatus"] != "Started"]
        self.incarnation += 1
        await self.changed()

    async def _get_name(self, request: web.Request) -> web.Response:
        if refused := self._refuse(request):
            return refused
        if request.query.get("format") == "text":
            return web.Response(text=self.vm_name)
        return web.json_response(self.vm_name)

    async def _control_acks(self, _request: web.Request) -> web.Response:
        return web.json_response(self.acks)
