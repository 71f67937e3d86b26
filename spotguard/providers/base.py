"""The provider contract: what a cloud module gives the daemon, ``doctor`` and the emulators.

A cloud is one module in this package that defines a :class:`Provider` (``PROVIDER``): how to tell
from DMI that this VM runs there, how to build its monitors from plain :class:`MonitorSettings`, the
probe ``spotguard doctor`` runs against its metadata service (with the monitors' own HTTP code), and
its emulator. :mod:`spotguard.providers.registry` knows them by name.

Nothing here imports aiohttp at run time: the trainer side imports the registry (through the config)
and must not pull in an HTTP client.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, runtime_checkable

from spotguard.cloudclock import CLOCK_OFF, how_far, note_ahead
from spotguard.errors import TransientError
from spotguard.jsontext import parse_json
from spotguard.notice import Acknowledgement, Notice, plausible_time, utcnow
from spotguard.repeats import Latest, RepeatedErrors

if TYPE_CHECKING:
    import aiohttp

    from spotguard.emulate.common import Emulator

logger = logging.getLogger(__name__)


class MonitorError(TransientError):
    """A source could not be read. Logged by the daemon, never turned into a notice."""


@runtime_checkable
class Monitor(Protocol):
    """A source of termination notices.

    ``check_all`` returns every current notice, most urgent first (``[]`` when there is none: "nothing
    happened" is a value; every time it is asked, while the event lasts: the daemon de-duplicates by
    ``event_id``), and raises :class:`MonitorError` when the source could not be read. A soft event
    must not hide behind a harder one, so it is a list. A long-polling source may block inside
    ``check_all`` until something changes or its own timeout passes; the daemon calls it again right
    away after a long-poll and after ``interval`` seconds otherwise.
    """

    name: str
    interval: float

    async def check_all(self) -> list[Notice]: ...

    async def close(self) -> None: ...


class Polling(TypedDict, total=False):
    """How a polled monitor polls, as keyword arguments of every cloud's monitor: seconds between checks,
    seconds per request, and the UTC wall clock notices are dated by."""

    interval: float
    timeout: float
    clock: Callable[[], datetime]


FIRST_SEEN_KEPT = 64  # events whose first sighting a monitor remembers


class PolledMonitor:
    """What the metadata monitors share: the caller's HTTP session, base URL, poll interval and timeout.

    The session is the caller's (``close`` does not close it).
    """

    name = "none"

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        interval: float = 1.0,
        timeout: float = 2.0,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.interval = interval
        self._session = session
        self._base = base_url.rstrip("/")
        self._timeout_s = timeout
        import aiohttp  # here: importing the provider contract must not load it (the hook reads settings)

        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._clock = clock  # UTC wall time, for deadlines
        self._first_seen: Latest[str, datetime] = Latest(FIRST_SEEN_KEPT)

    async def check_all(self) -> list[Notice]:
        raise NotImplementedError

    def first_seen(self, event_id: str) -> datetime:
        """When ``event_id`` was first polled: a deadline a cloud gives only as "from now" (or "started")
        must not move between polls. Past :data:`FIRST_SEEN_KEPT`, the event polled longest ago is
        forgotten: a daemon outlives many, and each is gone from the metadata long before that."""
        return self._first_seen.setdefault(event_id, self._clock())

    async def check(self) -> Notice | None:
        """The most urgent current notice, or None (for callers that want only one)."""
        notices = await self.check_all()
        return notices[0] if notices else None

    async def close(self) -> None:
        """Nothing to release: the session is the caller's."""


def most_urgent_first(notices: list[Notice]) -> list[Notice]:
    """Hard before soft, then the earliest deadline."""
    return sorted(notices, key=lambda n: (not n.is_hard, n.deadline))


# Bytes a metadata answer may hold: the services answer in bytes to kilobytes. A proxy in the way (an
# IMDS proxy on a Kubernetes node, a broken middlebox) that streams without end could otherwise fill the
# daemon's memory within one http_timeout, and every byte would then go through the JSON parser.
MAX_ANSWER = 1 << 20


# An answer's Date header further than this from this VM's clock: the clocks disagree. The cloud's
# deadlines are moved onto this VM's clock by what was measured (spotguard/cloudclock.py; where nothing
# was, spotguard.daemon.notices.clock_checked catches the worst case at notice time), and NTP is broken:
# this says so before any notice comes. Once an hour while it lasts.
CLOCK_SKEW_WARN = CLOCK_OFF
_CLOCK_WARNINGS = RepeatedErrors(every=3600.0)


def note_clock(source: str, date_header: str | None, now: datetime | None = None) -> float | None:
    """Seconds this VM's clock is ahead of the metadata service's (negative: behind), read from an
    answer's ``Date`` header (None without one); warned about while past :data:`CLOCK_SKEW_WARN`."""
    if not date_header:
        return None
    try:
        skew = ((now or utcnow()) - parse_http_date(date_header, "Date header")).total_seconds()
    except ValueError:
        return None
    if now is None:  # a test's clock says nothing of this VM's
        note_ahead(skew)  # the cloud's deadlines, the bucket's ages and the registry's heartbeats use it
    if abs(skew) <= CLOCK_SKEW_WARN:
        _CLOCK_WARNINGS.clear(source)
    elif _CLOCK_WARNINGS.due(source, "skewed"):
        logger.warning(
            "%s: this VM's clock is %s the metadata service's (its answers' Date header); the daemon counts "
            "the cloud's deadlines and the bucket's ages on the cloud's time meanwhile: check chronyd or NTP",
            source,
            how_far(skew),
        )
    return skew


async def read_answer(response: aiohttp.ClientResponse, doing: str) -> bytes:
    """The body of a metadata answer, or :class:`MonitorError` past :data:`MAX_ANSWER` bytes. ``doing``
    starts with the provider's name (``"aws: reading ..."``): its clock is compared with the answer's."""
    note_clock(doing.partition(":")[0], response.headers.get("Date"))
    too_long = f"{doing}: an answer of more than {MAX_ANSWER} bytes, which no metadata service sends"
    if response.content_length is not None and response.content_length > MAX_ANSWER:
        raise MonitorError(too_long)
    body = bytearray()
    async for chunk in response.content.iter_chunked(64 * 1024):
        body += chunk
        if len(body) > MAX_ANSWER:
            raise MonitorError(too_long)
    return bytes(body)


def unanswered(doing: str, exc: BaseException, timeout: float) -> MonitorError:
    """A request that got no answer, saying why: "aws: reading spot/instance-action" alone did not tell
    a timeout (a route, a hop limit) from a refused or reset connection."""
    why = f"no answer within {timeout:g} s" if isinstance(exc, TimeoutError) else (str(exc) or type(exc).__name__)
    return MonitorError(f"{doing}: {why}")


def load_json(text: str) -> Any:
    """``text`` as JSON; ValueError saying what the text began with when it is not."""
    try:
        return parse_json(text)
    except ValueError as exc:
        raise ValueError(f"not JSON: {text[:80]!r}") from exc


def parse_http_date(text: str, what: str) -> datetime:
    """An RFC 2822 date (``Mon, 19 Sep 2016 18:29:47 GMT``, or without the weekday) -> UTC datetime."""
    try:
        value = parsedate_to_datetime(text)
        value = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    except (TypeError, ValueError, OverflowError) as exc:  # OverflowError: a date at the calendar's end
        raise ValueError(f"not a {what}: {text!r}") from exc
    return plausible_time(value, text)


@dataclass(frozen=True)
class MonitorSettings:
    """Plain settings for building monitors and probes; the config (the composition root) fills them in."""

    metadata_url: str | None = None  # base URL, e.g. http://127.0.0.1:8080; None = the provider's own
    poll_interval: float = 1.0
    http_timeout: float = 2.0
    imds_v1_fallback: bool = False  # AWS: fall back to IMDSv1 if no token can be had
    asg_lifecycle_hook: str | None = None  # AWS: complete this termination lifecycle hook after the commit
    asg_name: str | None = None  # AWS: the Auto Scaling group; None = ask DescribeAutoScalingInstances
    vm_name: str | None = None  # Azure: this VM's name in Scheduled Events `Resources`; None = ask IMDS

    def base_url(self, default: str) -> str:
        return (self.metadata_url or default).rstrip("/")


class ProbeStatus(StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "FAIL"


@dataclass(frozen=True)
class ProbeResult:
    """What ``spotguard doctor`` prints for the metadata check: a verdict, what was found, what to do."""

    status: ProbeStatus
    found: str
    fix: str = ""


def unreachable_fix(base: str) -> str:
    return f"is this a VM of that cloud? check --metadata-url ({base}) and that no firewall blocks it"


def failure_reason(exc: BaseException) -> str:
    """Why a request got no answer, in words (aiohttp's timeouts have no message of their own)."""
    cause = exc.__cause__ or exc
    if isinstance(cause, TimeoutError):
        return "timed out"
    return str(cause) or type(cause).__name__


#: Reads one DMI field by name (``sys_vendor``, ``chassis_asset_tag``, ...); ``""`` when it is not there.
DmiReader = Callable[[str], str]
MonitorFactory = Callable[["aiohttp.ClientSession", MonitorSettings], list[Monitor]]
Probe = Callable[["aiohttp.ClientSession", MonitorSettings], Awaitable[ProbeResult]]
EmulatorFactory = Callable[..., "Emulator"]


@dataclass(frozen=True)
class Provider:
    """One cloud: everything spotguard knows about it.

    >>> register(Provider("fake", "http://127.0.0.1:9", 30.0, detect, monitors, probe, emulator))
    """

    name: str
    default_metadata_url: str
    notice_window: float  # seconds between a hard notice and the VM going away
    detect: Callable[[DmiReader], bool]  # from DMI only: no network request
    monitors: MonitorFactory
    probe: Probe
    emulator: EmulatorFactory  # (notice_after=, action=, **options) -> an emulator of its metadata service


def lazy_emulator(module: str, name: str) -> EmulatorFactory:
    """An emulator factory that imports ``module`` when first called.

    Only rehearsals and tests serve an emulator (aiohttp's server side). The emulator restates its
    cloud's wire protocol on its own (paths, headers) instead of importing the monitor's constants, so
    a wrong constant in the monitor fails the tests instead of agreeing with itself.
    """

    def make(**options: Any) -> Emulator:
        factory: EmulatorFactory = getattr(importlib.import_module(module), name)
        return factory(**options)

    return make


class Acknowledgements:
    """The daemon's memory of each event's acknowledgement, sent once its checkpoint is in the bucket.

    The latest notice polled for an event id is remembered, not only the first: a daemon restarted
    mid-incident restores the notice from its log (no acknowledgement survives that) and learns the
    acknowledgement again from the next poll.
    """

    def __init__(self) -> None:
        self._by_event: Latest[str, Acknowledgement] = Latest(FIRST_SEEN_KEPT)  # a daemon outlives many events

    def remember(self, notice: Notice) -> None:
        if notice.acknowledgement is not None:
            self._by_event.put(notice.event_id, notice.acknowledgement)

    async def send(self, event_id: str) -> None:
        """Send the acknowledgement of ``event_id``, if its notice carried one; a failure is logged."""
        acknowledgement = self._by_event.get(event_id)
        if acknowledgement is None:
            return
        try:
            await acknowledgement.send()
        except MonitorError as exc:
            logger.warning("acknowledging %s (%s) failed: %s", event_id, acknowledgement.description, exc)
