"""EC2 notices from the instance metadata service (IMDSv2).

Four paths are read on every poll, concurrently:

===========================================  ======================  ==========================
path (under ``/latest/meta-data/``)           kind                    deadline
===========================================  ======================  ==========================
``spot/instance-action``                     terminate/stop (hard)   ``time``, first seen + 120 s at most
                                             hibernate (hard)        first seen + 30 s (see below)
``autoscaling/target-lifecycle-state``       terminate (hard)        first seen + 30 s (see below)
``events/maintenance/scheduled``             maintenance (soft)      the event's ``NotBefore``
``events/recommendations/rebalance``         rebalance (soft)        ``noticeTime`` + 120 s
===========================================  ======================  ==========================

Several can be current at once (a rebalance recommendation usually precedes the interruption).
:meth:`AwsMonitor.check_all` returns all of them, most urgent first (hard before soft, then the
earliest deadline). Event ids come from what EC2 announces (action + time, ``noticeTime``, ``EventId``,
the lifecycle state), never from the poll time.

Auto Scaling: with a termination lifecycle hook named in ``asg_lifecycle_hook``, the group waits (up to
the hook's heartbeat timeout) for ``CompleteLifecycleAction``. The lifecycle notice carries it as its
acknowledgement (``CONTINUE``), which the daemon sends once the notice's checkpoint is committed in the
bucket, as aws-node-termination-handler does once a node is drained. The group's name comes from
``asg_name`` or, unset, from ``DescribeAutoScalingInstances`` for this instance.

Detection (DMI): ``sys_vendor`` ``Amazon EC2`` (Nitro), or ``amazon`` in ``bios_version``/``bios_vendor``
(older Xen instances, whose ``sys_vendor`` is ``Xen``). The doctor's probe gets an IMDSv2 token and reads
``spot/instance-action``; a token PUT that times out while a plain GET answers is the container hop-limit
trap.

Errors: if any path yields a notice, the notices are returned and failures on the other paths are
only logged (a broken rebalance path must not hide an interruption). If none does and any path
failed, :class:`MonitorError` is raised.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, Unpack

import aiohttp

from spotguard.cloudclock import on_this_clock
from spotguard.notice import UNTIMED_NOTICE_WINDOW, Acknowledgement, Kind, Notice, event_id_for, parse_iso
from spotguard.providers import base
from spotguard.providers.base import Monitor, MonitorError, MonitorSettings, PolledMonitor, Polling

logger = logging.getLogger(__name__)

DEFAULT_BASE_URL = "http://169.254.169.254"
TOKEN_PATH = "/latest/api/token"
META = "/latest/meta-data/"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
DEFAULT_TOKEN_TTL = 21600
PROBE_TOKEN_TTL = 60  # the doctor's token: it reads one path and is done
# Fallen back to IMDSv1 (``imds_v1_fallback``), a token is asked for again this often: a failure that
# passed goes back to IMDSv2, and one that lasts (a container's hop limit) costs one PUT per period.
V2_RETRY_AFTER = 300.0
NOTICE_WINDOW = 120.0  # a spot interruption's two-minute warning
# A rebalance recommendation has no deadline of its own; the interruption that may follow it still
# comes with a two-minute notice, so two minutes from the recommendation is the earliest it can bite.
REBALANCE_HORIZON = timedelta(seconds=120)
SPOT_KINDS = {"terminate": Kind.TERMINATE, "stop": Kind.STOP, "hibernate": Kind.HIBERNATE}
FINISHED_MAINTENANCE = ("completed", "canceled", "cancelled")

SPOT_PATH = "spot/instance-action"
REBALANCE_PATH = "events/recommendations/rebalance"
MAINTENANCE_PATH = "events/maintenance/scheduled"
LIFECYCLE_PATH = "autoscaling/target-lifecycle-state"
INSTANCE_ID_PATH = "instance-id"
REGION_PATH = "placement/region"


# --- parsing (pure; unit-tested on their own) ------------------------------------------------


def parse_maintenance_time(text: str) -> datetime:
    """``21 Jan 2019 09:00:43 GMT`` (the format of ``events/maintenance/scheduled``) -> UTC datetime."""
    return base.parse_http_date(text, "maintenance time")


def parse_instance_action(text: str, first_seen: datetime) -> Notice:
    """``{"action": "terminate", "time": "2017-09-18T08:22:00Z"}`` -> a hard notice."""
    data = base.load_json(text)
    action = data.get("action") if isinstance(data, dict) else None
    if not isinstance(action, str) or action not in SPOT_KINDS or not isinstance(data.get("time"), str):
        raise ValueError(f"unexpected instance-action: {text[:120]!r}")
    kind = SPOT_KINDS[action]
    announced = on_this_clock(parse_iso(data["time"]))  # EC2's time, moved onto this VM's clock
    # EC2 fills "time" in for hibernation too, but promises no two-minute warning for it. For the
    # others it is two minutes after the notice: a "time" further than that from when the notice was
    # first seen says this VM's clock is behind EC2's, and the plan must not count on the difference.
    window = UNTIMED_NOTICE_WINDOW if kind is Kind.HIBERNATE else timedelta(seconds=NOTICE_WINDOW)
    deadline = min(announced, first_seen + window)
    event_id = event_id_for("aws", kind, f"{data['action']}@{data['time']}")
    return Notice(provider="aws", kind=kind, deadline=deadline, event_id=event_id, raw={"instance-action": data})


def parse_rebalance(text: str, first_seen: datetime) -> Notice:
    """``{"noticeTime": "2020-10-27T08:22:00Z"}`` -> a soft rebalance notice."""
    data = base.load_json(text)
    if not isinstance(data, dict) or not isinstance(data.get("noticeTime"), str):
        raise ValueError(f"unexpected rebalance recommendation: {text[:120]!r}")
    # Posted before it was first seen, whatever the Date header says of this VM's clock.
    notice_time = on_this_clock(parse_iso(data["noticeTime"]), no_later_than=first_seen)
    return Notice(
        provider="aws",
        kind=Kind.REBALANCE,
        deadline=notice_time + REBALANCE_HORIZON,
        event_id=event_id_for("aws", Kind.REBALANCE, data["noticeTime"]),
        raw={"rebalance": data},
    )


def parse_maintenance(text: str) -> list[Notice]:
    """The ``events/maintenance/scheduled`` array -> one soft notice per event still to come."""
    data = base.load_json(text)
    if not isinstance(data, list):
        raise ValueError(f"unexpected scheduled events: {text[:120]!r}")
    notices = []
    for event in data:
        if not isinstance(event, dict) or not isinstance(event.get("EventId"), str):
            raise ValueError(f"unexpected scheduled event: {event!r}")
        state = str(event.get("State", "")).lower()
        description = str(event.get("Description", "")).lower()
        # Finished events stay listed for a while; EC2 marks them in State and in the description.
        if state in FINISHED_MAINTENANCE or description.startswith(("[completed]", "[canceled]")):
            continue
        notices.append(
            Notice(
                provider="aws",
                kind=Kind.MAINTENANCE,
                deadline=on_this_clock(parse_maintenance_time(str(event.get("NotBefore", "")))),
                event_id=event_id_for("aws", Kind.MAINTENANCE, event["EventId"]),
                raw={"maintenance": event},
            )
        )
    return notices


def parse_lifecycle(text: str, first_seen: datetime) -> Notice | None:
    """``autoscaling/target-lifecycle-state``: ``Terminated`` -> a hard notice, other states -> None."""
    state = text.strip()
    if not state or len(state) > 64 or not all(c.isalnum() or c in ":-_" for c in state):
        raise ValueError(f"unexpected lifecycle state: {text[:80]!r}")
    if state != "Terminated":
        return None
    return Notice(
        provider="aws",
        kind=Kind.TERMINATE,
        deadline=first_seen + UNTIMED_NOTICE_WINDOW,
        event_id=event_id_for("aws", Kind.TERMINATE, f"lifecycle:{state}"),
        raw={"target-lifecycle-state": state},
    )


# --- the monitor --------------------------------------------------------------------------------


class AwsMonitor(PolledMonitor):
    """Watches IMDSv2 for spot interruptions, rebalance recommendations, scheduled maintenance and
    Auto Scaling termination.

    >>> monitor = AwsMonitor(session, base_url="http://127.0.0.1:8080", interval=1.0, timeout=2.0)
    >>> notice = await monitor.check()        # the most urgent current notice, or None
    >>> everything = await monitor.check_all()

    The session is the caller's (it is not closed by :meth:`close`). ``clock`` gives UTC wall time
    for deadlines; ``monotonic`` times the token's lifetime. The token is renewed once less than a
    quarter of its TTL (at most 60 s) is left, and at once after a 401. Without a token nothing is
    read, unless ``imds_v1_fallback`` allows plain IMDSv1 requests.
    """

    name = "aws"

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str = DEFAULT_BASE_URL,
        *,
        token_ttl: int = DEFAULT_TOKEN_TTL,
        imds_v1_fallback: bool = False,
        lifecycle_hook: str | None = None,
        asg_name: str | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        **polling: Unpack[Polling],
    ) -> None:
        if not 1 <= token_ttl <= DEFAULT_TOKEN_TTL:
            raise ValueError(f"token_ttl must be 1..{DEFAULT_TOKEN_TTL}, got {token_ttl}")
        super().__init__(session, base_url, **polling)
        self._token_ttl = token_ttl
        self._refresh_margin = min(60.0, token_ttl / 4)
        self._v1_fallback = imds_v1_fallback
        self._monotonic = monotonic
        self._token: str | None = None
        self._token_expires = 0.0
        self._token_lock = asyncio.Lock()
        self._using_v1 = False
        self._v1_until = 0.0  # monotonic: while falling back to IMDSv1, when to try a token again
        self._lifecycle_hook = lifecycle_hook
        self._asg_name = asg_name

    async def check_all(self) -> list[Notice]:
        """Every current notice, most urgent first (hard before soft, then earliest deadline)."""
        paths = (SPOT_PATH, LIFECYCLE_PATH, MAINTENANCE_PATH, REBALANCE_PATH)
        results = await asyncio.gather(
            self._spot(), self._lifecycle(), self._maintenance(), self._rebalance(), return_exceptions=True
        )
        notices: list[Notice] = []
        errors: list[MonitorError] = []
        for path, result in zip(paths, results, strict=True):
            if isinstance(result, MonitorError):
                errors.append(result)
            elif isinstance(result, Exception):
                # Whatever one path's answer did, even to a bug of ours, the other paths' notices stand.
                error = MonitorError(f"aws: reading {path}: {result!r}")
                error.__cause__ = result
                errors.append(error)
            elif isinstance(result, BaseException):
                raise result
            else:
                notices.extend(result)
        if errors and not notices:
            raise errors[0]
        for error in errors:
            logger.warning("%s: %r (other paths have a notice)", error, error.__cause__)
        return base.most_urgent_first(notices)

    async def close(self) -> None:
        self._token = None

    async def complete_lifecycle(self, hook: str) -> None:
        """Tell Auto Scaling to go on terminating (``CompleteLifecycleAction``, ``CONTINUE``): the checkpoint
        for the lifecycle notice is safe. The acknowledgement of a lifecycle notice, with a hook set."""
        instance_id = await self._get(INSTANCE_ID_PATH)
        region = await self._get(REGION_PATH)
        if not (instance_id and region):
            raise MonitorError("aws: completing the lifecycle action needs the instance id and region from IMDS")
        instance_id = instance_id.strip()
        try:
            group = await asyncio.to_thread(
                complete_lifecycle_action, region.strip(), hook, instance_id, self._asg_name
            )
        except Exception as exc:  # botocore's errors, a missing boto3: all mean the same here
            raise MonitorError(f"aws: CompleteLifecycleAction for {instance_id}: {exc}") from exc
        logger.info("aws: completed lifecycle hook %s for %s in %s (CONTINUE)", hook, instance_id, group)

    # --- one method per path ----------------------------------------------------------------

    async def _spot(self) -> list[Notice]:
        text = await self._get(SPOT_PATH)
        if text is None:
            return []
        first_seen = self.first_seen(f"spot:{text.strip()}")
        return [self._parse(SPOT_PATH, lambda: parse_instance_action(text, first_seen))]

    async def _rebalance(self) -> list[Notice]:
        text = await self._get(REBALANCE_PATH)
        if text is None:
            return []
        first_seen = self.first_seen(f"rebalance:{text.strip()}")
        return [self._parse(REBALANCE_PATH, lambda: parse_rebalance(text, first_seen))]

    async def _maintenance(self) -> list[Notice]:
        text = await self._get(MAINTENANCE_PATH)
        return [] if text is None else self._parse(MAINTENANCE_PATH, lambda: parse_maintenance(text))

    async def _lifecycle(self) -> list[Notice]:
        text = await self._get(LIFECYCLE_PATH)
        if text is None:
            return []
        seen = self.first_seen(f"lifecycle:{text.strip()}")
        notice = self._parse(LIFECYCLE_PATH, lambda: parse_lifecycle(text, seen))
        if notice is None:
            return []
        if self._lifecycle_hook is not None:
            hook = self._lifecycle_hook
            acknowledgement = Acknowledgement(
                f"aws: CompleteLifecycleAction ({hook}, CONTINUE)", lambda: self.complete_lifecycle(hook)
            )
            notice = dataclasses.replace(notice, acknowledgement=acknowledgement)
        return [notice]

    @staticmethod
    def _parse(path: str, parse: Callable[[], Any]) -> Any:
        try:
            return parse()
        except (ValueError, TypeError, KeyError) as exc:
            raise MonitorError(f"aws: reading {path}: {exc}") from exc

    # --- HTTP -------------------------------------------------------------------------------

    async def _get(self, path: str) -> str | None:
        """The body of ``path``; None on 404. A 401 renews the token and retries once."""
        for attempt in (1, 2):
            token = await self._current_token()
            headers = {TOKEN_HEADER: token} if token else {}
            status, body = await self._send("GET", META + path, headers, f"reading {path}")
            if status == 401 and attempt == 1:
                logger.info("aws: %s answered 401; renewing the IMDSv2 token", path)
                await self._drop_token(token)
                continue
            if status == 404:
                return None
            if status != 200:
                raise MonitorError(f"aws: reading {path}: HTTP {status}")
            try:
                return body.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise MonitorError(f"aws: reading {path}: body is not UTF-8") from exc
        raise MonitorError(f"aws: reading {path}: HTTP 401 even with a fresh token")

    async def _current_token(self) -> str | None:
        async with self._token_lock:
            if self._token is not None and self._monotonic() < self._token_expires - self._refresh_margin:
                return self._token
            if self._using_v1 and self._monotonic() < self._v1_until:
                return None
            try:
                self._token = await self._fetch_token()
            except MonitorError:
                if not self._v1_fallback:
                    raise
                if not self._using_v1:
                    logger.warning("aws: no IMDSv2 token could be had; falling back to IMDSv1 as configured")
                # One failure (a slow token PUT) must not leave the daemon on IMDSv1 for months.
                self._using_v1, self._v1_until = True, self._monotonic() + V2_RETRY_AFTER
                return None
            if self._using_v1:
                logger.info("aws: IMDSv2 tokens can be had again; IMDSv1 is no longer used")
                self._using_v1 = False
            return self._token

    async def _drop_token(self, token: str | None) -> None:
        async with self._token_lock:
            # Only the token that was refused: a concurrent request may have renewed it already.
            if token is not None and token == self._token:
                self._token = None
            if token is None:
                # IMDSv1 refused: the instance now requires tokens, so try IMDSv2 again.
                self._using_v1 = False

    async def _fetch_token(self) -> str:
        started = self._monotonic()
        status, body = await self._put_token()
        if status != 200:
            raise MonitorError(f"aws: getting an IMDSv2 token: HTTP {status}")
        try:
            token = body.decode("ascii").strip()
        except UnicodeDecodeError as exc:
            raise MonitorError("aws: getting an IMDSv2 token: not a token") from exc
        if not token or len(token) > 1024 or any(c.isspace() for c in token):
            raise MonitorError("aws: getting an IMDSv2 token: not a token")
        self._token_expires = started + self._token_ttl
        return token

    async def _put_token(self) -> tuple[int, bytes]:
        return await self._send("PUT", TOKEN_PATH, {TTL_HEADER: str(self._token_ttl)}, "getting an IMDSv2 token")

    async def _send(self, method: str, path: str, headers: dict[str, str], doing: str) -> tuple[int, bytes]:
        """(status, body) of one request to IMDS; MonitorError when nothing answers."""
        try:
            async with self._session.request(
                method, self._base + path, headers=headers, timeout=self._timeout, allow_redirects=False
            ) as response:
                return response.status, await base.read_answer(response, f"aws: {doing}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            error = base.unanswered(f"aws: {doing}", exc, self._timeout_s)
            if method == "PUT" and isinstance(exc, TimeoutError):
                # The commonest cause by far, and one that lasts: the doctor tells it from a dead IMDS.
                error = MonitorError(f"{error} (if a plain GET answers, {HOP_LIMIT_FIX}; `spotguard doctor` tells)")
            raise error from exc


def complete_lifecycle_action(region: str, hook: str, instance_id: str, group: str | None) -> str:
    """``CompleteLifecycleAction`` (``CONTINUE``) for this instance; returns the group's name. Blocking; boto3
    is imported only here. ``group`` None: ask ``DescribeAutoScalingInstances``. The endpoint follows boto3's
    standard overrides (``AWS_ENDPOINT_URL_AUTO_SCALING``, ``AWS_ENDPOINT_URL``)."""
    import boto3

    client = boto3.client("autoscaling", region_name=region)
    try:
        if group is None:
            found = client.describe_auto_scaling_instances(InstanceIds=[instance_id])["AutoScalingInstances"]
            if not found:
                raise LookupError(f"{instance_id} is in no Auto Scaling group; set asg_name")
            group = str(found[0]["AutoScalingGroupName"])
        client.complete_lifecycle_action(
            LifecycleHookName=hook,
            AutoScalingGroupName=group,
            InstanceId=instance_id,
            LifecycleActionResult="CONTINUE",
        )
        return group
    finally:
        client.close()


# --- the doctor's probe -------------------------------------------------------------------------

HOP_LIMIT_FIX = (
    "the token's reply is dropped one hop short: in a container, raise the instance's metadata hop "
    "limit to 2 (aws ec2 modify-instance-metadata-options --http-put-response-hop-limit 2 "
    "--http-tokens required --instance-id ...; Terraform: metadata_options "
    "http_put_response_hop_limit = 2)"
)


async def probe(session: aiohttp.ClientSession, settings: MonitorSettings) -> base.ProbeResult:
    """Can an IMDSv2 token be had, and what does ``spot/instance-action`` say? Asked with the monitor's
    own requests. Without a token, a plain GET tells an unreachable IMDS from the hop-limit trap."""
    url = settings.base_url(DEFAULT_BASE_URL)
    monitor = AwsMonitor(session, url, timeout=settings.http_timeout, token_ttl=PROBE_TOKEN_TTL)
    started = time.monotonic()
    try:
        status, body = await monitor._put_token()
    except MonitorError as exc:
        problem, timed_out = (
            f"the IMDSv2 token PUT failed: {base.failure_reason(exc)}",
            isinstance(exc.__cause__, TimeoutError),
        )
    else:
        if status == 200 and body.strip():
            took = (time.monotonic() - started) * 1000
            state = await _spot_state(monitor)
            return base.ProbeResult(base.ProbeStatus.OK, f"IMDSv2 token obtained from {url} in {took:.0f} ms; {state}")
        problem, timed_out = f"the IMDSv2 token PUT answered HTTP {status}", False
    return await _probe_without_token(monitor, url, problem, timed_out, settings.imds_v1_fallback)


async def _spot_state(monitor: AwsMonitor) -> str:
    try:
        text = await monitor._get(SPOT_PATH)
    except MonitorError as exc:
        return str(exc) if exc.__cause__ is None else f"{exc} failed: {base.failure_reason(exc)}"
    return "no spot interruption pending" if text is None else f"a spot interruption is PENDING: {text.strip()}"


async def _probe_without_token(
    monitor: AwsMonitor, url: str, problem: str, timed_out: bool, v1_fallback: bool
) -> base.ProbeResult:
    # No token. Does a plain GET get through? (401 means "answered, wants a token".)
    try:
        get_status: int | None = (await monitor._send("GET", META + INSTANCE_ID_PATH, {}, "reading instance-id"))[0]
    except MonitorError:
        get_status = None
    if get_status is None:
        return base.ProbeResult(
            base.ProbeStatus.FAIL, f"{problem}; a plain GET gets no answer either", base.unreachable_fix(url)
        )
    if timed_out:
        return base.ProbeResult(
            base.ProbeStatus.FAIL, f"{problem} but a plain GET answers (HTTP {get_status})", HOP_LIMIT_FIX
        )
    if get_status == 200:
        if v1_fallback:
            return base.ProbeResult(base.ProbeStatus.WARN, f"{problem}; only IMDSv1 answers", "prefer IMDSv2")
        fix = "enable IMDSv2 on the instance, or set imds_v1_fallback = true (not recommended)"
        return base.ProbeResult(base.ProbeStatus.FAIL, f"{problem}; only IMDSv1 answers", fix)
    return base.ProbeResult(
        base.ProbeStatus.FAIL, f"{problem}; a plain GET answers HTTP {get_status}", "check --metadata-url"
    )


# --- the provider ---------------------------------------------------------------------------------


def detect(read: base.DmiReader) -> bool:
    """Nitro says ``Amazon EC2``; older Xen instances say ``Xen`` but carry ``amazon`` in the BIOS."""
    if "amazon ec2" in (read("sys_vendor").lower(), read("board_vendor").lower()):
        return True
    return any("amazon" in read(name).lower() for name in ("bios_version", "bios_vendor", "product_version"))


def monitors(session: aiohttp.ClientSession, settings: MonitorSettings) -> list[Monitor]:
    monitor = AwsMonitor(
        session,
        settings.base_url(DEFAULT_BASE_URL),
        interval=settings.poll_interval,
        timeout=settings.http_timeout,
        imds_v1_fallback=settings.imds_v1_fallback,
        lifecycle_hook=settings.asg_lifecycle_hook,
        asg_name=settings.asg_name,
    )
    return [monitor]


PROVIDER = base.Provider(
    name="aws",
    default_metadata_url=DEFAULT_BASE_URL,
    notice_window=NOTICE_WINDOW,
    detect=detect,
    monitors=monitors,
    probe=probe,
    emulator=base.lazy_emulator("spotguard.emulate.aws", "AwsEmulator"),
)
