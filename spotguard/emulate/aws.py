"""An EC2 instance metadata service (IMDS) emulator: IMDSv2 tokens and the four notice paths.

Behaviour copied from the real service:

* ``PUT /latest/api/token`` needs ``X-aws-ec2-metadata-token-ttl-seconds`` between 1 and 21600
  (400 otherwise) and answers the token as text.
* Every ``GET`` needs a valid, unexpired ``X-aws-ec2-metadata-token`` (401 otherwise) unless the
  emulator runs in IMDSv1 mode (``imds_v1=True``), where a missing token is allowed (a *wrong*
  token is still 401, as on EC2).
* ``spot/instance-action`` and ``events/recommendations/rebalance`` are 404 until a notice;
  ``events/maintenance/scheduled`` is a JSON array (``[]`` when none);
  ``autoscaling/target-lifecycle-state`` is plain text (``InService``; 404 with ``in_asg=False``).

Control API (see :mod:`spotguard.emulate.common`) extras:

* ``POST /_emulator/notice`` ``{"kind": "spot", "action": "terminate|stop|hibernate", "in": 120}``
  (``time`` may be given instead of ``in``; hibernate defaults to now), ``{"kind": "rebalance"}``,
  ``{"kind": "maintenance", "event_id": "...", "code": "system-reboot", "in": 3600, "state": "active"}``,
  ``{"kind": "lifecycle", "state": "Terminated"}``.
* ``POST /_emulator/expire-tokens``: every token handed out so far becomes invalid (401).

It also answers ``instance-id`` and ``placement/region`` and, at ``POST /``, the two Auto Scaling API calls
spotguard makes (Query protocol): ``DescribeAutoScalingInstances`` (this instance is in ``ASG_NAME`` unless
``in_asg=False``) and ``CompleteLifecycleAction``; ``GET /_emulator/lifecycle-actions`` lists the latter.
"""

from __future__ import annotations

import secrets
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from aiohttp import web

from spotguard.emulate.common import Emulator

TOKEN_PATH = "/latest/api/token"
META = "/latest/meta-data/"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
MAX_TTL = 21600
INSTANCE_ID = "i-0123456789abcdef0"
REGION = "us-east-1"
ASG_NAME = "spotguard-trainers"
AUTOSCALING_XMLNS = "http://autoscaling.amazonaws.com/doc/2011-01-01/"
SPOT_ACTIONS = ("terminate", "stop", "hibernate")


def iso_z(moment: datetime) -> str:
    """IMDS's time format: ``2017-09-18T08:22:00Z``."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def maintenance_time(moment: datetime) -> str:
    """The maintenance events' time format: ``21 Jan 2019 09:00:43 GMT``."""
    return moment.astimezone(UTC).strftime("%d %b %Y %H:%M:%S GMT")


@dataclass(eq=False)
class AwsEmulator(Emulator):
    provider = "aws"
    default_action = "terminate"

    imds_v1: bool = False
    in_asg: bool = True
    tokens: dict[str, float] = field(default_factory=dict, init=False, repr=False)  # token -> monotonic expiry
    # CompleteLifecycleAction calls, as received
    lifecycle_actions: list[dict[str, str]] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.clear()

    def clear(self) -> None:
        self.instance_action: dict[str, str] | None = None
        self.rebalance: dict[str, str] | None = None
        self.maintenance: list[dict[str, str]] = []
        self.lifecycle_state = "InService"

    def default_notice(self) -> dict[str, Any]:
        return {"kind": "spot", "action": self.action}

    def state(self) -> dict[str, Any]:
        return {
            "instance_action": self.instance_action,
            "rebalance": self.rebalance,
            "maintenance": self.maintenance,
            "lifecycle_state": self.lifecycle_state,
            "tokens": len(self.tokens),
            "imds_v1": self.imds_v1,
        }

    def trigger(self, spec: dict[str, Any]) -> dict[str, Any]:
        kind = spec.get("kind", "spot")
        now = datetime.now(UTC)
        if kind == "spot":
            action = spec.get("action") or "terminate"
            if action not in SPOT_ACTIONS:
                raise ValueError(f"action must be one of {SPOT_ACTIONS}")
            # Hibernation starts right away: EC2 gives no two-minute warning for it.
            default_in = 0.0 if action == "hibernate" else 120.0
            when = spec.get("time") or iso_z(now + timedelta(seconds=float(spec.get("in", default_in))))
            self.instance_action = {"action": action, "time": when}
            return dict(self.instance_action)
        if kind == "rebalance":
            self.rebalance = {"noticeTime": spec.get("time") or iso_z(now)}
            return dict(self.rebalance)
        if kind == "maintenance":
            start = now + timedelta(seconds=float(spec.get("in", 3600)))
            event = {
                "NotBefore": spec.get("not_before") or maintenance_time(start),
                "Code": spec.get("code", "system-reboot"),
                "Description": spec.get("description", "scheduled reboot"),
                "EventId": spec.get("event_id") or f"instance-event-{uuid.uuid4().hex[:17]}",
                "NotAfter": maintenance_time(start + timedelta(hours=2)),
                "State": spec.get("state", "active"),
            }
            self.maintenance = [e for e in self.maintenance if e["EventId"] != event["EventId"]] + [event]
            return dict(event)
        if kind == "lifecycle":
            self.lifecycle_state = str(spec.get("state", "Terminated"))
            return {"state": self.lifecycle_state}
        raise ValueError(f"unknown kind {kind!r} (spot, rebalance, maintenance, lifecycle)")

    def add_routes(self, app: web.Application) -> None:
        app.router.add_put(TOKEN_PATH, self._put_token)
        app.router.add_get(META + "spot/instance-action", self._instance_action)
        app.router.add_get(META + "events/recommendations/rebalance", self._rebalance)
        app.router.add_get(META + "events/maintenance/scheduled", self._maintenance)
        app.router.add_get(META + "autoscaling/target-lifecycle-state", self._lifecycle)
        app.router.add_get(META + "instance-id", self._instance_id)
        app.router.add_get(META + "placement/region", self._region)
        app.router.add_post("/", self._autoscaling_api)
        app.router.add_post("/_emulator/expire-tokens", self._expire_tokens)
        app.router.add_get("/_emulator/lifecycle-actions", self._control_lifecycle_actions)

    async def _put_token(self, request: web.Request) -> web.Response:
        raw = request.headers.get(TTL_HEADER)
        try:
            ttl = int(raw) if raw is not None else 0
        except ValueError:
            ttl = 0
        if not 1 <= ttl <= MAX_TTL:
            return web.Response(status=400, text="Bad Request: invalid TTL\n")
        token = secrets.token_urlsafe(42)
        self.tokens[token] = time.monotonic() + ttl
        return web.Response(text=token, headers={TTL_HEADER: str(ttl)})

    async def _expire_tokens(self, _request: web.Request) -> web.Response:
        expired = len(self.tokens)
        self.tokens.clear()
        return web.json_response({"expired": expired})

    def _authorised(self, request: web.Request) -> bool:
        token = request.headers.get(TOKEN_HEADER)
        if token is None:
            return self.imds_v1
        expiry = self.tokens.get(token)
        return expiry is not None and expiry > time.monotonic()

    def _answer(self, request: web.Request, body: str | dict[str, str] | list[dict[str, str]] | None) -> web.Response:
        """IMDS's answer for one path: 401 without a valid token, 404 when there is nothing, text or JSON."""
        if not self._authorised(request):
            return web.Response(status=401, text="Unauthorized\n")
        if body is None:
            return web.Response(status=404, text="Not Found\n")
        if isinstance(body, str):
            return web.Response(text=body)
        return web.json_response(body, content_type="text/plain")

    async def _instance_action(self, request: web.Request) -> web.Response:
        return self._answer(request, self.instance_action)

    async def _rebalance(self, request: web.Request) -> web.Response:
        return self._answer(request, self.rebalance)

    async def _maintenance(self, request: web.Request) -> web.Response:
        return self._answer(request, self.maintenance)

    async def _lifecycle(self, request: web.Request) -> web.Response:
        # Not in an Auto Scaling group: the path does not exist.
        return self._answer(request, self.lifecycle_state if self.in_asg else None)

    async def _instance_id(self, request: web.Request) -> web.Response:
        return self._answer(request, INSTANCE_ID)

    async def _region(self, request: web.Request) -> web.Response:
        return self._answer(request, REGION)

    async def _autoscaling_api(self, request: web.Request) -> web.Response:
        form = {key: str(value) for key, value in (await request.post()).items()}
        action = form.pop("Action", None)
        form.pop("Version", None)
        if action == "DescribeAutoScalingInstances":
            member = (
                f"<member><InstanceId>{INSTANCE_ID}</InstanceId><AutoScalingGroupName>{ASG_NAME}"
                "</AutoScalingGroupName><LifecycleState>Terminating:Wait</LifecycleState></member>"
            )
            listed = form.get("InstanceIds.member.1") == INSTANCE_ID and self.in_asg
            return _autoscaling_reply(
                action, f"<AutoScalingInstances>{member if listed else ''}</AutoScalingInstances>"
            )
        if action != "CompleteLifecycleAction":
            return _autoscaling_error("InvalidAction", f"not emulated: {action!r}")
        missing = [k for k in ("LifecycleHookName", "AutoScalingGroupName", "LifecycleActionResult") if k not in form]
        if missing or not ("InstanceId" in form or "LifecycleActionToken" in form):
            return _autoscaling_error("ValidationError", f"missing {', '.join(missing) or 'InstanceId'}")
        self.lifecycle_actions.append(form)
        return _autoscaling_reply(action, "")

    async def _control_lifecycle_actions(self, _request: web.Request) -> web.Response:
        return web.json_response(self.lifecycle_actions)


def _autoscaling_reply(action: str, result: str) -> web.Response:
    body = (
        f'<{action}Response xmlns="{AUTOSCALING_XMLNS}"><{action}Result>{result}</{action}Result>'
        f"<ResponseMetadata><RequestId>{uuid.uuid4()}</RequestId></ResponseMetadata></{action}Response>"
    )
    return web.Response(text=body, content_type="text/xml")


def _autoscaling_error(code: str, message: str) -> web.Response:
    body = (
        f'<ErrorResponse xmlns="{AUTOSCALING_XMLNS}"><Error><Type>Sender</Type><Code>{code}</Code>'
        f"<Message>{message}</Message></Error><RequestId>{uuid.uuid4()}</RequestId></ErrorResponse>"
    )
    return web.Response(status=400, text=body, content_type="text/xml")
