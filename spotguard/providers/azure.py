"""Azure notices from Scheduled Events (Instance Metadata Service).

``GET /metadata/scheduledevents?api-version=2020-07-01`` with ``Metadata: true`` lists the events of
every VM in the availability set / scale-set placement group; only those whose ``Resources`` name
this VM count. The VM's name is ``vm_name`` or, when not given, read once from IMDS
(``/metadata/instance/compute/name``).

=========================  =====================  ==========================================
``EventType``              kind                   deadline
=========================  =====================  ==========================================
``Preempt``, ``Terminate``  terminate (hard)       ``NotBefore``; once ``Started`` (blank),
                                                   30 s from when it was first seen blank
``Reboot``, ``Redeploy``,   maintenance (soft)     ``NotBefore``; once ``Started``, the moment
``Freeze`` (and unknown)                           it was first seen blank
=========================  =====================  ==========================================

The event id comes from ``EventId``. A notice of an event that names this VM alone carries its
acknowledgement: approving the event (``StartRequests``) so Azure may go ahead before ``NotBefore``;
the daemon sends it only once the checkpoint is committed remotely. Azure starts an approved event for
every VM it names, so one naming others too is never approved here. ``check_all`` returns every event
for this VM, most urgent first.

Detection (DMI): ``sys_vendor`` ``Microsoft Corporation`` *and* the Azure chassis asset tag
``7783-7084-3265-9085-8269-3286-77`` (Hyper-V on a desk has the first, not the second). The doctor's
probe is one read of Scheduled Events, as the monitor makes it.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timedelta
from typing import Any, Unpack

import aiohttp

from spotguard.cloudclock import on_this_clock
from spotguard.notice import UNTIMED_NOTICE_WINDOW, Acknowledgement, Kind, Notice, event_id_for
from spotguard.providers import base
from spotguard.providers.base import Monitor, MonitorError, MonitorSettings, PolledMonitor, Polling
from spotguard.repeats import Latest

logger = logging.getLogger(__name__)

DEFAULT_BASE_URL = "http://169.254.169.254"
EVENTS_PATH = "/metadata/scheduledevents"
EVENTS_API_VERSION = "2020-07-01"
NAME_PATH = "/metadata/instance/compute/name"
NAME_API_VERSION = "2021-02-01"
HARD_TYPES = ("Preempt", "Terminate")
FINISHED_STATUSES = ("Completed", "Canceled")
MAX_SHARED_SAID = 64  # shared events remembered as already logged
AZURE_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"
# Spot eviction (Preempt) gives at least 30 s; the notice window doctor's estimate plans for.
NOTICE_WINDOW = timedelta(seconds=30)
#: The longest notice Azure documents for each event type (Terminate: a scale set's notBeforeTimeout,
#: 5-15 min); what a correction for this VM's clock may not carry a NotBefore past (an unknown type: 15 min).
LONGEST_NOTICE = {
    "Preempt": NOTICE_WINDOW,
    "Terminate": timedelta(minutes=15),
    "Reboot": timedelta(minutes=15),
    "Redeploy": timedelta(minutes=10),
    "Freeze": timedelta(minutes=15),
}


def parse_not_before(text: str) -> datetime:
    """``Mon, 19 Sep 2016 18:29:47 GMT`` -> UTC datetime."""
    return base.parse_http_date(text, "NotBefore time")


def kind_for(event_type: str) -> Kind:
    return Kind.TERMINATE if event_type in HARD_TYPES else Kind.MAINTENANCE


def events_for_vm(text: str, vm_name: str) -> tuple[int | None, list[dict[str, Any]]]:
    """The Scheduled Events document -> (DocumentIncarnation, None if unreadable; this VM's pending
    events). The document lists the events of every VM in an availability set or scale set: an event
    that names no list of resources with this VM in it is not read further, so that a malformed one
    of another VM's never hides this VM's eviction."""
    doc = base.load_json(text)
    if not isinstance(doc, dict) or not isinstance(doc.get("Events"), list):
        raise ValueError(f"not a Scheduled Events document: {text[:80]!r}")
    mine = []
    for event in doc["Events"]:
        resources = (event.get("Resources") or []) if isinstance(event, dict) else []
        # Azure VM names are case-insensitive.
        if not isinstance(resources, list) or not any(str(r).casefold() == vm_name.casefold() for r in resources):
            continue
        if not isinstance(event.get("EventId"), str):
            raise ValueError(f"unexpected event: {event!r}")
        if event.get("EventStatus") in FINISHED_STATUSES:
            continue
        mine.append(event)
    incarnation = doc.get("DocumentIncarnation")  # only logged: a bad one must not cost the events
    return (incarnation if isinstance(incarnation, int) and not isinstance(incarnation, bool) else None), mine


class AzureMonitor(PolledMonitor):
    """Watches Azure Scheduled Events for this VM.

    >>> monitor = AzureMonitor(session, base_url="http://127.0.0.1:8082", vm_name="train-0")
    >>> notice = await monitor.check()
    >>> await notice.acknowledgement.send()    # after the checkpoint is committed in the bucket
    """

    name = "azure"

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str = DEFAULT_BASE_URL,
        *,
        vm_name: str | None = None,
        **polling: Unpack[Polling],
    ) -> None:
        super().__init__(session, base_url, **polling)
        self._vm_name = vm_name
        self._incarnation: int | None = None
        self._shared_said: Latest[str, None] = Latest(MAX_SHARED_SAID)  # events said to be shared

    async def check_all(self) -> list[Notice]:
        vm_name = await self.vm_name()
        status, body = await self._request("GET", EVENTS_PATH, EVENTS_API_VERSION, what="scheduledevents")
        if status != 200:
            raise MonitorError(f"azure: reading scheduledevents: HTTP {status}")
        try:
            incarnation, events = events_for_vm(body, vm_name)
            notices = [self._notice(event) for event in events]
        except (ValueError, TypeError) as exc:
            raise MonitorError(f"azure: reading scheduledevents: {exc}") from exc
        if incarnation != self._incarnation:
            logger.info("azure: DocumentIncarnation %s, %d event(s) for %s", incarnation, len(events), vm_name)
            self._incarnation = incarnation
        return base.most_urgent_first(notices)

    async def start_requests(self, event_id: str) -> None:
        """Approve the event (``StartRequests``) so Azure may proceed now. Raises MonitorError on failure."""
        payload = json.dumps({"StartRequests": [{"EventId": event_id}]})
        status, _ = await self._request("POST", EVENTS_PATH, EVENTS_API_VERSION, what="StartRequests", data=payload)
        if not 200 <= status < 300:
            raise MonitorError(f"azure: posting StartRequests for {event_id}: HTTP {status}")
        logger.info("azure: acknowledged event %s", event_id)

    async def vm_name(self) -> str:
        """This VM's name, from ``vm_name`` or IMDS (asked once, then remembered)."""
        if self._vm_name is None:
            status, body = await self._request(
                "GET", NAME_PATH, NAME_API_VERSION, what="compute/name", params={"format": "text"}
            )
            name = body.strip()
            if status != 200 or not name or len(name) > 128 or any(c.isspace() for c in name):
                raise MonitorError(f"azure: reading compute/name: HTTP {status}, {body[:40]!r}")
            self._vm_name = name
        return self._vm_name

    async def close(self) -> None:
        self._incarnation = None

    def _notice(self, event: dict[str, Any]) -> Notice:
        event_type = str(event.get("EventType"))
        kind = kind_for(event_type)
        event_id = event_id_for("azure", kind, event["EventId"])
        not_before = str(event.get("NotBefore") or "").strip()
        if not_before:
            # Its own key: the started event's "now" below is when it was first seen started.
            latest = self.first_seen(f"scheduled:{event_id}") + LONGEST_NOTICE.get(event_type, timedelta(minutes=15))
            deadline = on_this_clock(parse_not_before(not_before), no_later_than=latest)
        elif event_type in HARD_TYPES:
            # Started before this VM saw it (a host failure, a daemon restarted or IMDS down for the
            # Preempt's 30 s): the VM goes any moment, and a deadline of "now" would stop the upload's
            # retries at once. Planned as AWS plans a notice without a time.
            deadline = self.first_seen(event_id) + UNTIMED_NOTICE_WINDOW
        else:  # the event has started, and "now" must not move between polls
            deadline = self.first_seen(event_id)
        azure_id = str(event["EventId"])
        shared = self._shared_with(event)
        acknowledgement = (
            None
            if shared
            else Acknowledgement(f"azure: StartRequests for {azure_id}", lambda: self.start_requests(azure_id))
        )
        return Notice(
            provider="azure",
            kind=kind,
            deadline=deadline,
            event_id=event_id,
            raw=dict(event),
            acknowledgement=acknowledgement,
        )

    def _shared_with(self, event: dict[str, Any]) -> list[str]:
        """The other VMs ``event`` names (an availability set's Freeze or Reboot names several): Azure
        starts an approved event for every VM it names, so this VM's committed checkpoint may not
        approve theirs, whose uploads may still run (and a Redeploy wipes their local disks). Such an
        event is not acknowledged and goes ahead at its ``NotBefore``; said once per event."""
        name = (self._vm_name or "").casefold()
        others = sorted({str(r) for r in event.get("Resources") or [] if str(r).casefold() != name})
        event_id = str(event["EventId"])
        if others and event_id not in self._shared_said:
            self._shared_said.put(event_id, None)
            logger.info(
                "azure: event %s also names %s: not approved early (Azure would start it for every VM it "
                "names); it goes ahead at its NotBefore",
                event_id,
                ", ".join(others[:8]) + (f" and {len(others) - 8} more" if len(others) > 8 else ""),
            )
        return others

    async def _request(
        self,
        method: str,
        path: str,
        api_version: str,
        *,
        what: str,
        params: dict[str, str] | None = None,
        data: str | None = None,
    ) -> tuple[int, str]:
        headers = {"Metadata": "true"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        doing = f"azure: {'posting' if method == 'POST' else 'reading'} {what}"
        try:
            async with self._session.request(
                method,
                self._base + path,
                params={"api-version": api_version, **(params or {})},
                headers=headers,
                data=data,
                timeout=self._timeout,
                allow_redirects=False,
            ) as response:
                status = response.status
                body = await base.read_answer(response, doing)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise base.unanswered(doing, exc, self._timeout_s) from exc
        try:
            return status, body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise MonitorError(f"azure: reading {what}: body is not UTF-8") from exc


# --- the doctor's probe and the provider ----------------------------------------------------------


async def probe(session: aiohttp.ClientSession, settings: MonitorSettings) -> base.ProbeResult:
    """One read of Scheduled Events, with the monitor's request."""
    url = settings.base_url(DEFAULT_BASE_URL)
    monitor = AzureMonitor(session, url, timeout=settings.http_timeout)
    try:
        status, _body = await monitor._request("GET", EVENTS_PATH, EVENTS_API_VERSION, what="scheduledevents")
    except MonitorError as exc:
        found = f"Azure IMDS at {url} does not answer: {base.failure_reason(exc)}"
        return base.ProbeResult(base.ProbeStatus.FAIL, found, base.unreachable_fix(url))
    if status != 200:
        return base.ProbeResult(
            base.ProbeStatus.FAIL, f"Scheduled Events answered HTTP {status}", "check --metadata-url"
        )
    return base.ProbeResult(base.ProbeStatus.OK, f"Azure Scheduled Events answer at {url}")


def detect(read: base.DmiReader) -> bool:
    microsoft = "microsoft corporation" in (read("sys_vendor").lower(), read("board_vendor").lower())
    return microsoft and read("chassis_asset_tag") == AZURE_ASSET_TAG


def monitors(session: aiohttp.ClientSession, settings: MonitorSettings) -> list[Monitor]:
    url = settings.base_url(DEFAULT_BASE_URL)
    return [
        AzureMonitor(
            session, url, interval=settings.poll_interval, timeout=settings.http_timeout, vm_name=settings.vm_name
        )
    ]


PROVIDER = base.Provider(
    name="azure",
    default_metadata_url=DEFAULT_BASE_URL,
    notice_window=NOTICE_WINDOW.total_seconds(),
    detect=detect,
    monitors=monitors,
    probe=probe,
    emulator=base.lazy_emulator("spotguard.emulate.azure", "AzureEmulator"),
)
