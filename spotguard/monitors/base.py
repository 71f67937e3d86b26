"""The one seam every notice source implements."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from spotguard.notice import Notice


class MonitorError(Exception):
    """A source could not be read. Logged by the daemon, never turned into a notice."""


@runtime_checkable
class Monitor(Protocol):
    """A source of termination notices.

    ``check`` returns ``None`` when there is no notice ("nothing happened" is a
    value), a :class:`Notice` when there is one (every time it is asked, while
    the event lasts: the daemon de-duplicates by ``event_id``), and raises
    :class:`MonitorError` when the source could not be read. A long-polling
    source may block inside ``check`` until something changes or its own
    timeout passes; the daemon calls ``check`` again right away after a
    long-poll and after ``interval`` seconds otherwise.
    """

    name: str
    interval: float

    async def check(self) -> Notice | None: ...

    async def close(self) -> None: ...


@runtime_checkable
class Acknowledger(Protocol):
    """A source that must be told once a notice has been handled (Azure ``StartRequests``)."""

    async def acknowledge(self, notice: Notice) -> None: ...
