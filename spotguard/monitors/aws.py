"""EC2 notices from the instance metadata service (IMDSv2).

Four paths are read on every poll, concurrently:

===========================================  ======================  ==========================
path (under ``/latest/meta-data/``)           kind                    deadline
===========================================  ======================  ==========================
``spot/instance-action``                     terminate/stop (hard)   the announced ``time``
                                             hibernate (hard)        first seen + 30 s (see below)
``autoscaling/target-lifecycle-state``       terminate (hard)        first seen + 30 s (see below)
``events/maintenance/scheduled``             maintenance (soft)      the event's ``NotBefore``
``events/recommendations/rebalance``         rebalance (soft)        ``noticeTime`` + 120 s
===========================================  ======================  ==========================

Several can be current at once (a rebalance recommendation usually precedes the interruption).
:meth:`AwsMonitor.check_all` returns all of them, most urgent first (hard before soft, then the
earliest deadline); :meth:`AwsMonitor.check` returns the first of those, which is what the
:class:`~spotguard.monitors.base.Monitor` Protocol asks for. Event ids come from what EC2 announces
(action + time, ``noticeTime``, ``EventId``, the lifecycle state), never from the poll time.

Auto Scaling: with a termination lifecycle hook named in ``asg_lifecycle_hook``, the group waits (up to
the hook's heartbeat timeout) for ``CompleteLifecycleAction``. :meth:`AwsMonitor.acknowledge` sends it
(``CONTINUE``) once the lifecycle notice's checkpoint is committed in the bucket, as
aws-node-termination-handler does once a node is drained. The group's name comes from ``asg_name`` or,
unset, from ``DescribeAutoScalingInstances`` for this instance.

Errors: if any path yields a notice, the notices are returned and failures on the other paths are
only logged (a broken rebalance path must not hide an interruption). If none does and any path
failed, :class:`MonitorError` is raised.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from typing import Any

import aiohttp

from spotguard.monitors.base import MonitorError
from spotguard.notice import Kind, Notice, event_id_for, parse_iso, utcnow

logger = logging.getLogger(__name__)

DEFAULT_BASE_URL = "http://169.254.169.254"
TOKEN_PATH = "/latest/api/token"
META = "/latest/meta-data/"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
DEFAULT_TOKEN_TTL = 21600
# A rebalance recommendation has no deadline of its own; the interruption that may follow it still
# comes with a two-minute notice, so two minutes from the recommendation is the earliest it can bite.
REBALANCE_HORIZON = timedelta(seconds=120)
# Hibernation and an Auto Scaling `Terminated` target state promise no warning time (EC2 may start
# hibernating at once; without a lifecycle hook Auto Scaling goes straight to shutdown). A deadline
# of "now" would leave the urgent upload no retry budget at all, yet the VM still runs its shutdown
# for a while; this window (GCP's preemption notice) is the budget they get.
UNTIMED_NOTICE_WINDOW = timedelta(seconds=30)
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
    try:
        value = parsedate_to_datetime(text)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"not a maintenance time: {text!r}") from exc
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON: {text[:80]!r}") from exc


def parse_instance_action(text: str, first_seen: datetime) -> Notice:
    """``{"action": "terminate", "time": "2017-09-18T08:22:00Z"}`` -> a hard notice."""
    data = _json(text)
    if not isinstance(data, dict) or data.get("action") not in SPOT_KINDS or not isinstance(data.get("time"), str):
        raise ValueError(f"unexpected instance-action: {text[:120]!r}")
    kind = SPOT_KINDS[data["action"]]
    announced = parse_iso(data["time"])
    # EC2 fills "time" in for hibernation too, but promises no two-minute warning for it.
    deadline = min(announced, first_seen + UNTIMED_NOTICE_WINDOW) if kind is Kind.HIBERNATE else announced
    event_id = event_id_for("aws", kind, f"{data['action']}@{data['time']}")
    return Notice(provider="aws", kind=kind, deadline=deadline, event_id=event_id, raw={"instance-action": data})


def parse_rebalance(text: str) -> Notice:
    """``{"noticeTime": "2020-10-27T08:22:00Z"}`` -> a soft rebalance notice."""
    data = _json(text)
    if not isinstance(data, dict) or not isinstance(data.get("noticeTime"), str):
        raise ValueError(f"unexpected rebalance recommendation: {text[:120]!r}")
    notice_time = parse_iso(data["noticeTime"])
    return Notice(
        provider="aws",
        kind=Kind.REBALANCE,
        deadline=notice_time + REBALANCE_HORIZON,
        event_id=event_id_for("aws", Kind.REBALANCE, data["noticeTime"]),
        raw={"rebalance": data},
    )


def parse_maintenance(text: str) -> list[Notice]:
    """The ``events/maintenance/scheduled`` array -> one soft notice per event still to come."""
    data = _json(text)
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
                deadline=parse_maintenance_time(str(event.get("NotBefore", ""))),
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


def most_urgent_first(notices: list[Notice]) -> list[Notice]:
    return sorted(notices, key=lambda n: (not n.is_hard, n.deadline))


# --- the monitor --------------------------------------------------------------------------------


class AwsMonitor:
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
        interval: float = 1.0,
        timeout: float = 2.0,
        *,
        token_ttl: int = DEFAULT_TOKEN_TTL,
        imds_v1_fallback: bool = False,
        lifecycle_hook: str | None = None,
        asg_name: str | None = None,
        clock: Callable[[], datetime] = utcnow,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 1 <= token_ttl <= DEFAULT_TOKEN_TTL:
            raise ValueError(f"token_ttl must be 1..{DEFAULT_TOKEN_TTL}, got {token_ttl}")
        self.interval = interval
        self._session = session
        self._base = base_url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._token_ttl = token_ttl
        self._refresh_margin = min(60.0, token_ttl / 4)
        self._v1_fallback = imds_v1_fallback
        self._clock = clock
        self._monotonic = monotonic
        self._token: str | None = None
        self._token_expires = 0.0
        self._token_lock = asyncio.Lock()
        self._using_v1 = False
        self._first_seen: dict[str, datetime] = {}
        self._lifecycle_hook = lifecycle_hook
        self._asg_name = asg_name

    async def check(self) -> Notice | None:
        notices = await self.check_all()
        return notices[0] if notices else None

    async def check_all(self) -> list[Notice]:
        """Every current notice, most urgent first (hard before soft, then earliest deadline)."""
        results = await asyncio.gather(
            self._spot(), self._lifecycle(), self._maintenance(), self._rebalance(), return_exceptions=True
        )
        notices: list[Notice] = []
        errors: list[MonitorError] = []
        for result in results:
            if isinstance(result, MonitorError):
                errors.append(result)
            elif isinstance(result, BaseException):
                raise result
            else:
                notices.extend(result)
        if errors and not notices:
            raise errors[0]
        for error in errors:
            logger.warning("%s: %r (other paths have a notice)", error, error.__cause__)
        return most_urgent_first(notices)

    async def close(self) -> None:
        self._token = None

    async def acknowledge(self, notice: Notice) -> None:
        """Tell Auto Scaling to go on terminating (``CompleteLifecycleAction``, ``CONTINUE``): the checkpoint
        for this lifecycle notice is safe. Nothing for other notices, or without a lifecycle hook."""
        if self._lifecycle_hook is None or "target-lifecycle-state" not in notice.raw:
            return
        instance_id = await self._get(INSTANCE_ID_PATH)
        region = await self._get(REGION_PATH)
        if not (instance_id and region):
            raise MonitorError("aws: completing the lifecycle action needs the instance id and region from IMDS")
        hook, instance_id = self._lifecycle_hook, instance_id.strip()
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
        first_seen = self._seen(f"spot:{text.strip()}")
        return [self._parse(SPOT_PATH, lambda: parse_instance_action(text, first_seen))]

    async def _rebalance(self) -> list[Notice]:
        text = await self._get(REBALANCE_PATH)
        return [] if text is None else [self._parse(REBALANCE_PATH, lambda: parse_rebalance(text))]

    async def _maintenance(self) -> list[Notice]:
        text = await self._get(MAINTENANCE_PATH)
        return [] if text is None else self._parse(MAINTENANCE_PATH, lambda: parse_maintenance(text))

    async def _lifecycle(self) -> list[Notice]:
        text = await self._get(LIFECYCLE_PATH)
        if text is None:
            return []
        notice = self._parse(LIFECYCLE_PATH, lambda: parse_lifecycle(text, self._seen(f"lifecycle:{text.strip()}")))
        return [] if notice is None else [notice]

    def _seen(self, key: str) -> datetime:
        # A deadline of "now" must stay the same on every poll of the same event.
        return self._first_seen.setdefault(key, self._clock())

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
            try:
                async with self._session.get(
                    self._base + META + path, headers=headers, timeout=self._timeout, allow_redirects=False
                ) as response:
                    status = response.status
                    body = await response.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise MonitorError(f"aws: reading {path}") from exc
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
            if self._using_v1:
                return None
            try:
                self._token = await self._fetch_token()
            except MonitorError:
                if not self._v1_fallback:
                    raise
                logger.warning("aws: no IMDSv2 token could be had; falling back to IMDSv1 as configured")
                self._using_v1 = True
                return None
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
        try:
            async with self._session.put(
                self._base + TOKEN_PATH,
                headers={TTL_HEADER: str(self._token_ttl)},
                timeout=self._timeout,
                allow_redirects=False,
            ) as response:
                status = response.status
                body = await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise MonitorError("aws: getting an IMDSv2 token") from exc
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
