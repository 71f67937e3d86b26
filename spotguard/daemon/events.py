"""What the daemon tells its observers (metrics, webhook): listener types and the narrow view they attach to.

Observers depend on this Protocol, not on :class:`spotguard.daemon.app.Daemon`, so the daemon can import
them and they never import it back.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from spotguard.daemon.plan import PlanListener
from spotguard.manifest import Manifest
from spotguard.notice import Action, Notice

NoticeListener = Callable[[Notice, Action], Awaitable[None]]
SavedListener = Callable[[str, Manifest], None]  # a trainer committed this checkpoint locally
MonitorErrorListener = Callable[[str, BaseException], None]  # monitor name, what failed
CommittedListener = Callable[[str, Manifest, float], Awaitable[None]]  # name, manifest, upload seconds
UploadFailureListener = Callable[[str, BaseException], None]  # checkpoint name, what went wrong; must not block
# A trainer told of this notice has not reached a checkpoint point within the bound; the dict is its
# entry in status()["stalled"] (pid, rank, event_id, seconds, bound_s, deadline_s, message).
StallListener = Callable[[Notice, Action, dict[str, Any]], None]
SaveFailedListener = Callable[[dict[str, Any]], None]  # a trainer's save failed; the failure as in status


class UploaderEvents(Protocol):
    on_committed: list[CommittedListener]
    on_failure: list[UploadFailureListener]
    last_committed: dict[str, Any] | None

    def failing_streak(self) -> int: ...


class DaemonEvents(Protocol):
    """The part of the daemon an observer sees: listener lists and a few live values."""

    notice_listeners: list[NoticeListener]
    saved_listeners: list[SavedListener]
    monitor_error_listeners: list[MonitorErrorListener]
    stall_listeners: list[StallListener]
    save_failed_listeners: list[SaveFailedListener]
    plan_listeners: list[PlanListener]

    @property
    def uploader(self) -> UploaderEvents: ...

    @property
    def pending(self) -> tuple[Notice, Action] | None: ...

    @property
    def bucket_url(self) -> str | None: ...

    @property
    def stalled(self) -> dict[int, dict[str, Any]]: ...  # peer id -> its report, while it stays stalled

    def trainer_count(self) -> int: ...

    def plan_status(self) -> dict[str, Any] | None: ...  # the pending notice's deadline plan (Plan.to_dict())

    def measured_rate(self) -> float | None: ...  # bytes/s of recent uploads and the start-up probe


__all__ = [
    "CommittedListener",
    "DaemonEvents",
    "MonitorErrorListener",
    "NoticeListener",
    "PlanListener",
    "SaveFailedListener",
    "SavedListener",
    "StallListener",
    "UploadFailureListener",
    "UploaderEvents",
]
