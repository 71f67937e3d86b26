"""GCE notices from the metadata server, by long-poll.

One request watches both values: ``GET /computeMetadata/v1/instance/?recursive=true`` answers the
instance directory as JSON (``preempted``, ``maintenanceEvent``, ...) and, with
``wait_for_change=true&last_etag=E&timeout_sec=T``, blocks until anything in it differs from ETag
``E``. GCP documents wait-for-change on directories with ``recursive=true``; one long-poll instead
of one per value means one connection, one ETag and no race between two watchers. Because
``last_etag`` is sent, a change that happens between two long-polls is answered at once.

* ``preempted`` ``TRUE`` -> kind ``terminate`` (hard), deadline 30 s after it was first seen
  (GCP's Spot/preemptible notice).
* ``maintenanceEvent`` other than ``NONE`` -> kind ``maintenance`` (soft), deadline 60 s after it
  was first seen (GCP's host-maintenance notice). ``TERMINATE_ON_HOST_MAINTENANCE`` stays soft here
  on purpose: every kind maps to an action in one place, the daemon's policy (``on_maintenance``);
  the notice's ``raw["terminates"]`` is True for it so a policy can treat it as hard (GPU VMs
  cannot live-migrate, so for them it means the VM stops).

``check`` answers immediately the first time (a restarted daemon learns about a pending notice at
once) and long-polls afterwards, so it may block up to ``long_poll_timeout`` seconds; ``interval``
is therefore 0 (call again right away). After an error, the next ``check`` first waits
``poll_interval`` so a dead server is not hammered. 503 (the server during its own maintenance) is
retried after ``retry_delay`` seconds, ``max_retries`` times.

GCE gives its 60 s maintenance warning only to a VM that read the ``maintenance-event`` key itself
(directly: the recursive read is not documented to count) since the last maintenance event; without
one the event starts at once. So the key is also read on its own after the first check, after each
event ends, and every :data:`MAINTENANCE_KEY_EVERY` seconds, never in a check that found a notice; its
answer is not used (the long-poll's is), and a failed read is tried again a minute later without
failing the check.

Every answer must carry ``Metadata-Flavor: Google``; one without it did not come from the metadata
server (a proxy, a captive portal) and is a :class:`MonitorError`.

Event ids: the preemption is keyed by instance id + boot id (a VM is preempted at most once per
boot); a maintenance event by instance id + boot id + value + its count in this monitor's life.

Detection (DMI): ``Google`` in ``sys_vendor``/``board_vendor``/``bios_vendor``/``product_name``
(``Google Compute Engine``). The doctor's probe is one plain read of the instance document, as the
monitor's first ``check``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Unpack

import aiohttp

from spotguard.notice import Kind, Notice, event_id_for
from spotguard.providers import base
from spotguard.providers.base import Monitor, MonitorError, MonitorSettings, PolledMonitor, Polling

logger = logging.getLogger(__name__)

DEFAULT_BASE_URL = "http://metadata.google.internal"
INSTANCE_PATH = "/computeMetadata/v1/instance/"
MAINTENANCE_KEY_PATH = INSTANCE_PATH + "maintenance-event"
MAINTENANCE_KEY_EVERY = 600.0  # seconds between direct reads of the key (and after every event)
MAINTENANCE_KEY_RETRY = 60.0  # seconds before a failed direct read is tried again
MAINTENANCE_KEY_TIMEOUT = 1.0  # seconds a direct read may take (the long-poll just answered)
FLAVOR = "Metadata-Flavor"
PREEMPT_NOTICE = timedelta(seconds=30)
MAINTENANCE_NOTICE = timedelta(seconds=60)
BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")
# A short long-poll: a metadata server that accepts and then hangs must show up well within
# GCP's 30 s notice, not after a 60 s wait; six requests a minute cost nothing.
DAEMON_LONG_POLL_S = 10.0


def read_boot_id(path: Path = BOOT_ID_FILE) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return "unknown-boot"


def parse_instance(text: str) -> tuple[str, bool, str]:
    """The recursive instance document -> (instance id, preempted, maintenance event)."""
    doc = base.load_json(text)
    if not isinstance(doc, dict):
        raise ValueError(f"not an instance document: {text[:80]!r}")
    preempted = doc.get("preempted")
    # GCE documents the key as filled only on VMs that migrate or have a GPU: a document without it
    # has no maintenance event, and an unreadable one must not hide a preemption.
    maintenance = doc.get("maintenanceEvent", "NONE")
    if preempted not in ("TRUE", "FALSE") or (
        preempted == "FALSE" and (not isinstance(maintenance, str) or not maintenance)
    ):
        raise ValueError(f"unexpected preempted={preempted!r} maintenanceEvent={maintenance!r}")
    if not isinstance(maintenance, str) or not maintenance:
        maintenance = "NONE"
    return str(doc.get("id", "unknown-instance")), preempted == "TRUE", maintenance


class GcpMonitor(PolledMonitor):
    """Watches the GCE metadata server for preemption and host maintenance.

    >>> monitor = GcpMonitor(session, base_url="http://127.0.0.1:8081", long_poll_timeout=30)
    >>> notice = await monitor.check()    # may block up to long_poll_timeout after the first call

    ``check_all`` returns both notices when both are current (preemption first).
    """

    name = "gcp"

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str = DEFAULT_BASE_URL,
        *,
        long_poll: bool = True,
        long_poll_timeout: float = 60.0,
        retry_delay: float = 1.0,
        max_retries: int = 3,
        boot_id: str | None = None,
        **polling: Unpack[Polling],
    ) -> None:
        # Long polls wait in the request: no pause between them (``interval`` paces retries only).
        interval = polling.get("interval", 1.0)
        paced: Polling = {**polling, "interval": 0.0 if long_poll else interval}
        super().__init__(session, base_url, **paced)
        self.poll_interval = interval
        self._url = self._base + INSTANCE_PATH
        self._long_poll = long_poll
        self._long_poll_timeout = max(1, round(long_poll_timeout))
        self._retry_delay = retry_delay
        self._max_retries = max_retries
        self._boot_id = boot_id if boot_id is not None else read_boot_id()
        self._etag: str | None = None
        self._pause = 0.0
        self._maintenance_value = "NONE"
        self._maintenance_count = 0
        self._key_read_due = 0.0  # time.monotonic() when the maintenance key is read on its own next

    async def check_all(self) -> list[Notice]:
        if self._pause:
            pause, self._pause = self._pause, 0.0
            await asyncio.sleep(pause)
        try:
            text = await self._fetch()
            instance_id, preempted, maintenance = parse_instance(text)
        except ValueError as exc:
            self._pause = self.poll_interval
            raise MonitorError(f"gcp: reading instance/: {exc}") from exc
        except MonitorError:
            self._pause = self.poll_interval
            raise
        if self._long_poll and not self._etag:
            # No ETag, no long-poll: the next check is a plain read, so pace it here (interval is 0).
            self._pause = self.poll_interval
        notices = self._notices(instance_id, preempted, maintenance)
        if self._long_poll and not notices and time.monotonic() >= self._key_read_due:
            await self._read_maintenance_key()  # after the answer, and never while a notice waits on it
        return notices

    async def close(self) -> None:
        self._etag = None

    def _notices(self, instance_id: str, preempted: bool, maintenance: str) -> list[Notice]:
        notices = []
        identity = f"{instance_id}/{self._boot_id}"
        if preempted:
            notices.append(self._notice(Kind.TERMINATE, identity, PREEMPT_NOTICE, {"preempted": "TRUE"}))
        if maintenance != self._maintenance_value:
            self._maintenance_value = maintenance
            if maintenance != "NONE":
                self._maintenance_count += 1
            else:
                self._key_read_due = 0.0  # an event ended: read the key before the next one
        if maintenance != "NONE":
            raw_fields = {
                "maintenance_event": maintenance,
                "terminates": maintenance.startswith("TERMINATE"),
            }
            notices.append(
                self._notice(
                    Kind.MAINTENANCE,
                    f"{identity}/{maintenance}/{self._maintenance_count}",
                    MAINTENANCE_NOTICE,
                    raw_fields,
                )
            )
        return notices

    def _notice(self, kind: Kind, identity: str, notice: timedelta, raw: dict[str, Any]) -> Notice:
        event_id = event_id_for("gcp", kind, identity)
        # GCP gives no deadline, only "N seconds from now": fix it when first seen so every poll agrees.
        first_seen = self.first_seen(event_id)
        return Notice(provider="gcp", kind=kind, deadline=first_seen + notice, event_id=event_id, raw=raw)

    async def _read_maintenance_key(self) -> None:
        """Read ``maintenance-event`` on its own, so that GCE gives the next event its 60 s warning."""
        try:
            async with self._session.get(
                self._base + MAINTENANCE_KEY_PATH,
                headers={FLAVOR: "Google"},
                timeout=aiohttp.ClientTimeout(total=min(self._timeout_s, MAINTENANCE_KEY_TIMEOUT)),
                allow_redirects=False,
            ) as response:
                await base.read_answer(response, "gcp: reading instance/maintenance-event")
                if response.status != 200:
                    raise MonitorError(f"HTTP {response.status}")
        except (aiohttp.ClientError, TimeoutError, MonitorError) as exc:
            logger.debug("gcp: reading instance/maintenance-event on its own: %s; again in a minute", exc)
            self._key_read_due = time.monotonic() + MAINTENANCE_KEY_RETRY
            return
        self._key_read_due = time.monotonic() + MAINTENANCE_KEY_EVERY

    async def _fetch(self) -> str:
        for attempt in range(self._max_retries + 1):
            status, body, etag = await self._request()
            if status == 503 and attempt < self._max_retries:
                logger.info("gcp: metadata server answered 503; retrying in %.1f s", self._retry_delay)
                await asyncio.sleep(self._retry_delay)
                continue
            if status != 200:
                raise MonitorError(f"gcp: reading instance/: HTTP {status}")
            try:
                text = body.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise MonitorError("gcp: reading instance/: body is not UTF-8") from exc
            self._etag = etag
            return text
        raise AssertionError("unreachable")

    async def _request(self) -> tuple[int, bytes, str | None]:
        params = {"recursive": "true"}
        timeout = self._timeout_s
        if self._long_poll and self._etag:
            params.update(wait_for_change="true", last_etag=self._etag, timeout_sec=str(self._long_poll_timeout))
            timeout += self._long_poll_timeout
        try:
            async with self._session.get(
                self._url,
                params=params,
                headers={FLAVOR: "Google"},
                timeout=aiohttp.ClientTimeout(total=timeout),
                allow_redirects=False,
            ) as response:
                if response.status == 200 and response.headers.get(FLAVOR) != "Google":
                    raise MonitorError(
                        f"gcp: reading instance/: answer without {FLAVOR}: Google (not the metadata server)"
                    )
                return (
                    response.status,
                    await base.read_answer(response, "gcp: reading instance/"),
                    response.headers.get("ETag"),
                )
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise base.unanswered("gcp: reading instance/", exc, timeout) from exc


# --- the doctor's probe and the provider ----------------------------------------------------------


async def probe(session: aiohttp.ClientSession, settings: MonitorSettings) -> base.ProbeResult:
    """One plain read of the instance document, by the monitor (``Metadata-Flavor`` checked)."""
    url = settings.base_url(DEFAULT_BASE_URL)
    monitor = GcpMonitor(session, url, timeout=settings.http_timeout, long_poll=False, max_retries=0, boot_id="")
    try:
        _instance, preempted, _maintenance = parse_instance(await monitor._fetch())
    except MonitorError as exc:
        if exc.__cause__ is not None:
            found = f"GCE metadata at {url} does not answer: {base.failure_reason(exc)}"
            return base.ProbeResult(base.ProbeStatus.FAIL, found, base.unreachable_fix(url))
        fix = "check --metadata-url; a proxy may be answering instead of the metadata server"
        return base.ProbeResult(base.ProbeStatus.FAIL, f"{exc}: not the GCE metadata server", fix)
    except ValueError as exc:
        return base.ProbeResult(base.ProbeStatus.FAIL, f"GCE metadata at {url} answered: {exc}", "check --metadata-url")
    status = base.ProbeStatus.WARN if preempted else base.ProbeStatus.OK
    return base.ProbeResult(status, f"GCE metadata answers at {url}; preempted={'TRUE' if preempted else 'FALSE'}")


def detect(read: base.DmiReader) -> bool:
    return any("google" in read(name).lower() for name in ("sys_vendor", "board_vendor", "bios_vendor", "product_name"))


def monitors(session: aiohttp.ClientSession, settings: MonitorSettings) -> list[Monitor]:
    url = settings.base_url(DEFAULT_BASE_URL)
    interval, timeout = settings.poll_interval, settings.http_timeout
    return [GcpMonitor(session, url, interval=interval, timeout=timeout, long_poll_timeout=DAEMON_LONG_POLL_S)]


PROVIDER = base.Provider(
    name="gcp",
    default_metadata_url=DEFAULT_BASE_URL,
    notice_window=PREEMPT_NOTICE.total_seconds(),
    detect=detect,
    monitors=monitors,
    probe=probe,
    emulator=base.lazy_emulator("spotguard.emulate.gcp", "GcpEmulator"),
)
