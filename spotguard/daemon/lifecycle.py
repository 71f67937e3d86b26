"""Where a notice the daemon acts on stands: pending, held, over (see spotguard/daemon/notices.py).

Below both the notice book, which moves notices, and the event stream, which tells of each move.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from spotguard.notice import Action, Notice


class NoticeState(StrEnum):
    PENDING = "pending"
    HELD = "held"
    OVER = "over"


@dataclass
class TrackedNotice:
    notice: Notice
    action: Action
    state: NoticeState
    after_deadline: float  # seconds it stays live past its deadline (a hard one's grace)

    @property
    def event_id(self) -> str:
        return self.notice.event_id

    def seconds_to_end(self, now: float) -> float:
        """Seconds from ``now`` until it is over at the latest, both on the steady clock (see
        Notice.steady_deadline)."""
        return self.notice.steady_deadline + self.after_deadline - now

    def rank(self) -> tuple[bool, bool, datetime]:
        """Lower first: a hard notice before a soft one, pending before held, then the earlier deadline."""
        return self.action is not Action.STOP, self.state is not NoticeState.PENDING, self.notice.deadline


__all__ = ["NoticeState", "TrackedNotice"]
