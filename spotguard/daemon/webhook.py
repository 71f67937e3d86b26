"""Webhook notifications: one message when a notice arrives, one with its outcome.

Off unless ``webhook_url`` is set. Each event (a notice the daemon acts on, once per event id)
gets exactly two POSTs:

* ``"type": "notice"`` as soon as the trainers have been told;
* ``"type": "outcome"`` at the first commit in the bucket of a checkpoint whose manifest
  ``meta.event_id`` is the event's (``"outcome": "committed"``, or ``"missed"`` when it landed
  after the deadline), or when the deadline passes without one (``"missed"``, or
  ``"upload-failed"`` when an upload of the event's checkpoint failed, or ``"save-failed"`` when
  the trainer could not write it). Without a bucket the outcome is ``"local-only"`` once a
  trainer has committed the checkpoint locally.

Besides, every checkpoint a trainer fails to write (a full disk, any write error; for a notice or
a periodic save) gets one ``"type": "save-failed"`` POST at once, with ``error`` (``disk-full``,
``write-failed``), ``step``, ``reason``, ``bytes_needed``, ``bytes_free`` and ``path``.

The notice message carries the deadline plan (``route``: bucket, peer or local; ``plan_bytes``,
``rate_bytes_s``, ``seconds_needed``, ``plan_size_from``: where its size came from, ``unknown`` when it
is a guess; see spotguard/daemon/plan.py); a revision that starts the peer
route while the race runs gets a ``"type": "plan"`` message of its own.

And, between the two, ``"type": "stalled"`` for each trainer (``pid``) that has not reached a
checkpoint point within the daemon's bound (``seconds`` waited, ``seconds_left`` to the deadline).

Never on the urgent path: its handlers of the daemon's events only put a message on a queue; one worker task
on the daemon's loop POSTs them in order (an outcome never overtakes its notice), each with a
5 s timeout and a few jittered retries on connection errors, timeouts, 429 and 5xx. Failures are
logged and dropped.

The body is, by default, every field (see ``spotguard.config.WEBHOOK_FIELDS``) as a JSON
object, with ``text`` repeating ``message`` so that Slack-style webhooks show it. With
``webhook_template``, it is that JSON document with ``${field}`` placeholders filled in inside
its strings (``string.Template`` syntax, ``$$`` for a literal ``$``); a string that is only a
placeholder takes the field's JSON value. E.g. ``{"text": "spotguard on ${host}: ${message}"}``
or ``{"content": "${message}", "margin": "${margin_s}"}`` (margin stays a number).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from spotguard.backoff import backoff_delay
from spotguard.config import WEBHOOK_FIELDS
from spotguard.daemon.events import (
    CheckpointSaved,
    DaemonEvents,
    NoticeSeen,
    PlanChanged,
    SaveFailed,
    TrainerStalled,
    UploadCommitted,
    UploadFailed,
)
from spotguard.daemon.route import Route
from spotguard.manifest import Manifest
from spotguard.notice import Action, Notice

if TYPE_CHECKING:
    import aiohttp


logger = logging.getLogger("spotguard.webhook")

_WHOLE_PLACEHOLDER = re.compile(r"\$(?:\{(\w+)\}|(\w+))")
_MAX_QUEUED = 256  # a dead endpoint must not make the daemon hoard messages
_REMEMBERED = 1024  # resolved event ids kept to ignore late commits


def render(template: Any, fields: dict[str, Any]) -> Any:
    """Fill ``${field}`` placeholders in the strings of a parsed JSON template."""
    if isinstance(template, str):
        whole = _WHOLE_PLACEHOLDER.fullmatch(template)
        if whole:
            return fields.get(whole.group(1) or whole.group(2))
        as_text = {k: "" if v is None else str(v) for k, v in fields.items()}
        return string.Template(template).safe_substitute(as_text)
    if isinstance(template, dict):
        return {str(render(k, fields) if isinstance(k, str) else k): render(v, fields) for k, v in template.items()}
    if isinstance(template, list):
        return [render(item, fields) for item in template]
    return template


@dataclass(frozen=True)
class RetryPolicy:
    """How one message is sent: each POST waits at most ``timeout`` seconds; up to ``attempts`` POSTs,
    the n-th retry after a random 50-100 % of ``backoff * 2**(n-1)`` seconds."""

    timeout: float = 5.0
    attempts: int = 3
    backoff: float = 0.5

    def delay(self, attempt: int) -> float:
        """Seconds to wait after the failed POST number ``attempt`` (from 1)."""
        return backoff_delay(attempt, self.backoff)


@dataclass
class _Event:
    notice: Notice
    action: Action
    checkpoint: str | None = None
    step: int | None = None
    bytes: int | None = None
    failure: str | None = None
    save_failure: str | None = None
    timer: asyncio.TimerHandle | None = None


def _seconds(value: float) -> str:
    return f"{value:.1f}"


def _plan_fields(plan: dict[str, Any] | None) -> dict[str, Any]:
    if plan is None:
        return {}
    return {
        "route": plan["route"],
        "plan_bytes": plan["bytes"],
        "plan_size_from": plan["size_from"],
        "rate_bytes_s": plan["rate_bytes_s"],
        "seconds_needed": plan["seconds_needed"],
    }


def _plan_words(plan: dict[str, Any]) -> str:
    needed = "unknown" if plan["seconds_needed"] is None else f"{plan['seconds_needed']:.1f} s"
    size = "size unknown" if plan["size_from"] == "unknown" else f"{plan['bytes']} bytes ({plan['size_from']})"
    return f"{plan['route']} ({size}, {needed} needed, {plan['seconds_left']:.1f} s left)"


class WebhookNotifier:
    """POSTs notice and outcome messages to ``url``; :meth:`attach` hooks it into a daemon.

    >>> async with aiohttp.ClientSession() as session:
    ...     webhook = WebhookNotifier("https://hooks.example.com/x", session=session, host="vm-1")
    ...     webhook.attach(daemon)
    ...     ...
    ...     await webhook.close()

    ``session`` is the caller's (not closed here); ``template`` is a parsed template
    (``spotguard.config.parse_webhook_template``) or None for the full event object; ``retry`` says how
    hard each message is tried (:class:`RetryPolicy`).
    """

    def __init__(
        self,
        url: str,
        *,
        session: aiohttp.ClientSession,
        host: str,
        template: Any = None,
        bucket: str | None = None,
        retry: RetryPolicy = RetryPolicy(),
    ) -> None:
        self.url = url
        self.host = host
        self.template = template
        self.bucket = bucket
        self.retry = retry
        self.sent = 0
        self.dropped = 0
        self._session = session
        self._events: dict[str, _Event] = {}
        self._resolved: dict[str, None] = {}  # insertion-ordered set
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(_MAX_QUEUED)
        self._worker: asyncio.Task[None] | None = None
        self._plan_of: Callable[[], dict[str, Any] | None] = lambda: None

    def attach(self, daemon: DaemonEvents) -> None:
        self.bucket = daemon.bucket_url
        bus = daemon.bus
        bus.subscribe(NoticeSeen, self.on_notice)
        bus.subscribe(CheckpointSaved, self.on_saved)
        bus.subscribe(TrainerStalled, self.on_stall)
        bus.subscribe(SaveFailed, self.on_save_failed)
        bus.subscribe(UploadCommitted, self.on_committed)
        bus.subscribe(UploadFailed, self.on_upload_failure)
        bus.subscribe(PlanChanged, self.on_plan)
        self._plan_of = daemon.plan_status

    # --- the event's story --------------------------------------------------------------

    def on_notice(self, seen: NoticeSeen) -> None:
        notice, action = seen.notice, seen.action
        if action is Action.IGNORE or notice.event_id in self._events or notice.event_id in self._resolved:
            return
        event = _Event(notice, action)
        self._events[notice.event_id] = event
        left = notice.seconds_left()
        what = "checkpoint and stop" if action is Action.STOP else "checkpoint, training goes on"
        plan = self._plan_of()
        self._enqueue(
            event,
            "notice",
            f"{notice.provider} {notice.kind} notice on {self.host}: {what}; "
            f"deadline {notice.deadline.strftime('%H:%M:%S')} UTC ({_seconds(left)} s left)"
            + ("" if plan is None else f"; plan: {_plan_words(plan)}"),
            **_plan_fields(plan),
        )
        loop = asyncio.get_running_loop()
        event.timer = loop.call_later(max(0.0, left), self._deadline_passed, notice.event_id)

    def on_saved(self, saved: CheckpointSaved) -> None:
        name, manifest = saved.name, saved.manifest
        event = self._event_of(manifest)
        if event is None:
            return
        if event.checkpoint is None or manifest.step >= (event.step or 0):
            event.checkpoint, event.step, event.bytes = name, manifest.step, manifest.total_bytes
        if self.bucket is None:
            self._resolve(
                event,
                "local-only",
                f"{name} committed locally on {self.host}; no bucket is configured, so it dies with the VM",
            )

    def on_plan(self, changed: PlanChanged) -> None:
        """A revision that starts the peer route is worth a message of its own (the first plan rides
        on the notice's)."""
        notice, plan = changed.notice, changed.plan
        event = self._events.get(notice.event_id)
        if event is None or plan.revision == 0 or plan.route is not Route.PEER:
            return
        values = plan.to_dict()
        self._enqueue(
            event,
            "plan",
            f"{notice.event_id} on {self.host}: plan revised: {_plan_words(values)}",
            **_plan_fields(values),
        )

    def on_stall(self, stalled: TrainerStalled) -> None:
        notice, action, report = stalled.notice, stalled.action, stalled.report
        event = self._events.get(notice.event_id) or _Event(notice, action)
        message = f"{report['message']} (on {self.host})"
        self._enqueue(event, "stalled", message, pid=report["pid"], seconds=report["seconds"])

    def on_save_failed(self, failed: SaveFailed) -> None:
        failure = failed.failure
        event_id = failure.get("event_id")
        event = self._events.get(event_id) if isinstance(event_id, str) else None
        message = (
            f"{failure['reason']} checkpoint at step {failure['step']} failed on {self.host} "
            f"({failure['error']}): {failure['message']}"
        )
        details = {k: failure.get(k) for k in ("step", "reason", "bytes_needed", "bytes_free", "path")}
        values: dict[str, Any]
        if event is not None:
            event.save_failure = str(failure["message"])
            values = self.fields(event, "save-failed", message, error=failure["error"], **details)
        else:
            values = {**dict.fromkeys(WEBHOOK_FIELDS), "type": "save-failed", "host": self.host, "message": message}
            values.update(error=failure["error"], **details)
        self._put(values, logger.error)

    def on_upload_failure(self, failed: UploadFailed) -> None:
        for event in self._events.values():
            if event.checkpoint == failed.name:
                event.failure = str(failed.error)

    def on_committed(self, committed: UploadCommitted) -> None:
        name, manifest, upload_seconds = committed.name, committed.manifest, committed.seconds
        event = self._event_of(manifest)
        if event is None:
            return
        event.checkpoint, event.step, event.bytes = name, manifest.step, manifest.total_bytes
        margin = event.notice.seconds_left()
        took = event.notice.seconds_since_received()
        extra = {"seconds": round(took, 3), "upload_seconds": round(upload_seconds, 3), "margin_s": round(margin, 3)}
        where = f"{name} committed in {self.bucket}"
        if margin >= 0:
            message = f"{where} in {_seconds(took)} s with {_seconds(margin)} s to spare"
            self._resolve(event, "committed", message, **extra)
        else:
            message = f"missed the deadline by {_seconds(-margin)} s: {where} {_seconds(took)} s after the notice"
            self._resolve(event, "missed", message, **extra)

    def _deadline_passed(self, event_id: str) -> None:
        event = self._events.get(event_id)
        if event is None:
            return
        event.timer = None
        if event.failure is not None:
            message = f"upload failed, the deadline passed: {event.checkpoint}: {event.failure}"
            self._resolve(event, "upload-failed", message, error=event.failure)
        elif event.checkpoint is None and event.save_failure is not None:
            message = f"missed the deadline: the trainer could not write its checkpoint: {event.save_failure}"
            self._resolve(event, "save-failed", message, error=event.save_failure)
        elif event.checkpoint is None:
            self._resolve(event, "missed", "missed the deadline: no trainer committed a checkpoint for this notice")
        else:
            self._resolve(event, "missed", f"missed the deadline: {event.checkpoint} was still uploading")

    def _event_of(self, manifest: Manifest) -> _Event | None:
        event_id = manifest.meta.get("event_id")
        if not isinstance(event_id, str):
            return None
        if event_id in self._resolved:
            logger.debug("webhook: %s already has its outcome", event_id)
        return self._events.get(event_id)

    def _resolve(self, event: _Event, outcome: str, message: str, **extra: Any) -> None:
        event_id = event.notice.event_id
        self._events.pop(event_id, None)
        if event.timer is not None:
            event.timer.cancel()
        self._resolved[event_id] = None
        while len(self._resolved) > _REMEMBERED:
            del self._resolved[next(iter(self._resolved))]
        self._enqueue(event, "outcome", message, outcome=outcome, **extra)

    # --- sending --------------------------------------------------------------------------

    def fields(self, event: _Event, kind: str, message: str, **extra: Any) -> dict[str, Any]:
        notice = event.notice
        values: dict[str, Any] = dict.fromkeys(WEBHOOK_FIELDS)
        values.update(
            type=kind,
            event_id=notice.event_id,
            provider=notice.provider,
            kind=str(notice.kind),
            action=str(event.action),
            deadline=notice.deadline.isoformat(),
            seconds_left=round(notice.seconds_left(), 3),
            host=self.host,
            message=message,
            checkpoint=event.checkpoint,
            step=event.step,
            bytes=event.bytes,
        )
        values.update(extra)
        return values

    def _enqueue(self, event: _Event, kind: str, message: str, **extra: Any) -> None:
        values = self.fields(event, kind, message, **extra)
        self._put(values, logger.info if kind == "notice" or extra.get("outcome") == "committed" else logger.warning)

    def _put(self, values: dict[str, Any], log: Callable[..., None]) -> None:
        message = values["message"]
        body = {**values, "text": message} if self.template is None else render(self.template, values)
        log("webhook %s: %s", values["type"], message)
        try:
            self._queue.put_nowait(body)
        except asyncio.QueueFull:
            self.dropped += 1
            logger.error("webhook: %d messages waiting for %s; dropping this one", self._queue.qsize(), self.url)
            return
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._work(), name="webhook")

    async def _work(self) -> None:
        while True:
            body = await self._queue.get()
            try:
                await self._post(body)
            finally:
                self._queue.task_done()

    async def _post(self, body: Any) -> None:
        import aiohttp

        for attempt in range(1, self.retry.attempts + 1):
            problem: str
            try:
                async with self._session.post(
                    self.url, json=body, timeout=aiohttp.ClientTimeout(total=self.retry.timeout), allow_redirects=False
                ) as response:
                    if 200 <= response.status < 300:
                        self.sent += 1
                        return
                    problem = f"HTTP {response.status}"
                    if response.status != 429 and response.status < 500:
                        logger.error("webhook: %s refused the message: %s", self.url, problem)
                        return
            except (aiohttp.ClientError, TimeoutError) as exc:
                problem = repr(exc)
            if attempt < self.retry.attempts:
                delay = self.retry.delay(attempt)
                logger.warning("webhook: POST to %s failed (%s); retrying in %.1f s", self.url, problem, delay)
                await asyncio.sleep(delay)
            else:
                logger.error("webhook: POST to %s failed %d times (%s); message dropped", self.url, attempt, problem)

    async def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (for at most ``timeout``), then stop. Pending deadlines are dropped."""
        for event in self._events.values():
            if event.timer is not None:
                event.timer.cancel()
        if self._worker is None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._queue.join(), timeout)
        self._worker.cancel("webhook closing")
        with contextlib.suppress(asyncio.CancelledError):
            await self._worker


__all__ = ["WebhookNotifier", "render"]
