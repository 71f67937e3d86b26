"""The daemon's one event stream: what happened, as typed events, and the bus observers subscribe to.

Every service tells of what happened by emitting one event (a notice seen, a notice moved, a
checkpoint saved, a plan changed, an upload committed, ...); observers (metrics, webhook, the
notice timeline, the planner's rate meter, the peer route, the acknowledgement of a notice)
subscribe to the kinds they care about. The bus is the one place a failing observer is caught and
logged: an observer's bug never reaches the service that emitted, nor the observers after it.

Observers are told in the order they subscribed. A handler may be a plain function or a coroutine
function:

* :meth:`EventBus.emit_async` (from a coroutine) awaits each handler before the next; it is used
  where order matters across an await (a notice is told to the observers only after the trainers
  were told; an upload's commit is acknowledged to the cloud before the observers hear of it);
* :meth:`EventBus.emit` (from plain code) calls each handler in turn; a coroutine handler there is
  run as a task of the running loop (its failure logged the same way).

Observers depend on this module and on :class:`DaemonEvents`, never on :mod:`spotguard.daemon.app`,
so the daemon can import them and they never import it back. This module imports neither the
planner nor the notice book: the data its events carry lives below both
(:mod:`spotguard.daemon.route`, :mod:`spotguard.daemon.lifecycle`).

>>> bus = EventBus()
>>> bus.subscribe(SaveFailed, lambda event: print(event.failure["error"]))
>>> bus.emit(SaveFailed({"error": "disk-full"}))
disk-full
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, dataclass_transform

from spotguard.daemon.lifecycle import NoticeState, TrackedNotice
from spotguard.daemon.route import Plan
from spotguard.manifest import Manifest
from spotguard.notice import Action, Notice

logger = logging.getLogger("spotguard.daemon")


@dataclass_transform(frozen_default=True)
@dataclass(frozen=True)
class Event:
    """What every event is; subscribe to it to hear them all. Each subclass is a frozen dataclass of
    its own (its annotated attributes are its fields): an event is never changed once emitted."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        dataclass(frozen=True)(cls)

    def about(self) -> str:
        """What the event concerns, for the log line of an observer that failed on it: its kind,
        and the notice or checkpoint it is about."""
        for value in vars(self).values():
            if isinstance(value, Notice | TrackedNotice):
                return f"{type(self).__name__} of {value.event_id}"
            if isinstance(value, str):
                return f"{type(self).__name__} of {value}"
        return type(self).__name__


class NoticeSeen(Event):
    """A notice with a new event id (ignored ones included), after the trainers were told."""

    notice: Notice
    action: Action


class NoticeMoved(Event):
    """A notice changed state: ``tracked`` is in its new one, ``old`` is the one it left."""

    tracked: TrackedNotice
    old: NoticeState


class CheckpointSaved(Event):
    """A trainer committed this checkpoint locally (a whole manifest, not a node's share)."""

    name: str
    manifest: Manifest


class SaveFailed(Event):
    """A trainer's save failed; ``failure`` is its entry in status()["save_failures"]."""

    failure: dict[str, Any]


class MonitorFailed(Event):
    """A check of monitor ``monitor`` failed (it is asked again at its next interval)."""

    monitor: str
    error: BaseException


class TrainerStalled(Event):
    """A trainer told of this notice has not reached a checkpoint point within the bound; ``report`` is
    its entry in status()["stalled"] (pid, rank, event_id, seconds, bound_s, deadline_s, message)."""

    notice: Notice
    action: Action
    report: dict[str, Any]


class PlanChanged(Event):
    """A notice's deadline plan, and each change of its route."""

    notice: Notice
    plan: Plan


class UploadCommitted(Event):
    """A checkpoint is committed in the bucket, ``seconds`` after its upload started."""

    name: str
    manifest: Manifest
    seconds: float


class UploadFailed(Event):
    """An upload attempt of checkpoint ``name`` failed (it is retried unless the store refuses its bytes)."""

    name: str
    error: BaseException


E = TypeVar("E", bound=Event)
Handler = Callable[[Any], Awaitable[None] | None]


class EventBus:
    """Handlers subscribed by event kind, told in subscription order; see the module docstring."""

    def __init__(self) -> None:
        self._handlers: list[tuple[type[Event], Handler]] = []
        self._running: set[asyncio.Task[None]] = set()  # coroutine handlers started by emit()

    def subscribe(self, kind: type[E], handler: Callable[[E], Awaitable[None] | None]) -> None:
        """Call ``handler`` with every event of ``kind`` (and of its subclasses: ``Event`` hears all)."""
        self._handlers.append((kind, handler))

    def emit(self, event: Event) -> None:
        """Tell every handler of ``event``'s kind, in order, from plain code."""
        for handler in self._handlers_of(event):
            result = self._call(handler, event)
            if result is not None:
                self._start(result, event)

    async def emit_async(self, event: Event) -> None:
        """Tell every handler of ``event``'s kind, in order, each one finished before the next."""
        for handler in self._handlers_of(event):
            result = self._call(handler, event)
            if result is not None:
                await self._finish(result, event)

    def _handlers_of(self, event: Event) -> list[Handler]:
        return [handler for kind, handler in self._handlers if isinstance(event, kind)]

    @staticmethod
    def _call(handler: Handler, event: Event) -> Awaitable[None] | None:
        try:
            result = handler(event)
        except Exception:
            logger.exception("an observer failed on %s", event.about())
            return None
        return result if inspect.isawaitable(result) else None

    @staticmethod
    async def _finish(result: Awaitable[None], event: Event) -> None:
        try:
            await result
        except Exception:
            logger.exception("an observer failed on %s", event.about())

    def _start(self, result: Awaitable[None], event: Event) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop to run it on: a coroutine observer of an event emitted off the loop
            if inspect.iscoroutine(result):
                result.close()
            logger.error("an observer of %s is a coroutine and no event loop runs here", event.about())
            return
        task = loop.create_task(self._finish(result, event))
        self._running.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._running.discard)


class UploaderEvents(Protocol):
    last_committed: dict[str, Any] | None

    def failing_streak(self) -> int: ...

    def newest_in_bucket(self) -> float | None: ...  # Unix time the newest complete checkpoint there was made


class DaemonEvents(Protocol):
    """The part of the daemon an observer sees: the event stream and a few live values."""

    @property
    def bus(self) -> EventBus: ...

    @property
    def uploader(self) -> UploaderEvents: ...

    @property
    def pending(self) -> tuple[Notice, Action] | None: ...

    @property
    def bucket_url(self) -> str | None: ...

    @property
    def stalled(self) -> dict[int, dict[str, Any]]: ...  # peer id -> its report, while it stays stalled

    def trainer_count(self) -> int: ...

    def trainers_on_another_version(self) -> int: ...  # hooks whose spotguard is not the daemon's, or unnamed

    def plan_status(self) -> dict[str, Any] | None: ...  # the pending notice's deadline plan (Plan.to_dict())

    def measured_rate(self) -> float | None: ...  # bytes/s of recent uploads and the start-up probe

    def peer_status(self) -> dict[str, Any] | None: ...  # the peer tier's status (None where it is off)


__all__ = [
    "CheckpointSaved",
    "DaemonEvents",
    "Event",
    "EventBus",
    "MonitorFailed",
    "NoticeMoved",
    "NoticeSeen",
    "PlanChanged",
    "SaveFailed",
    "TrainerStalled",
    "UploadCommitted",
    "UploadFailed",
    "UploaderEvents",
]
