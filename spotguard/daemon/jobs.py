"""The uploader's queue: checkpoints waiting for the one upload job, urgent ones (a notice's) first,
then newest first; and which checkpoints are urgent, early uploads of their files included."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field


@dataclass(order=True)
class Job:
    priority: int  # 0 urgent, 1 periodic
    neg_step: int  # newest first within a priority
    name: str = field(compare=False)


class JobQueue:
    def __init__(self) -> None:
        self._queued: dict[str, Job] = {}
        self.urgent: set[str] = set()  # checkpoints a notice's save wrote (or reported)

    def add(self, name: str, step: int) -> None:
        """Queue ``name`` (urgent if it was marked so); queued already, it keeps the higher priority."""
        job = Job(0 if name in self.urgent else 1, -step, name)
        self._queued[name] = min(job, self._queued.get(name, job))

    def again(self, job: Job, *, urgent: bool) -> None:
        """Queue ``job`` once more after an attempt (unless it was queued meanwhile)."""
        self._queued.setdefault(job.name, Job(0 if urgent else 1, job.neg_step, job.name))

    def next(self, not_before: Mapping[str, float], now: float) -> Job | None:
        """The first job not waiting out a backoff (``not_before``), taken off the queue."""
        ready = [job for job in self._queued.values() if not_before.get(job.name, 0) <= now]
        if not ready:
            return None
        job = min(ready)
        del self._queued[job.name]
        return job

    def drop(self, name: str) -> None:
        """``name`` is not to be uploaded (any more): neither queued nor urgent."""
        self._queued.pop(name, None)
        self.urgent.discard(name)

    def __contains__(self, name: object) -> bool:
        return name in self._queued

    def __iter__(self) -> Iterator[str]:
        return iter(self._queued)

    def __bool__(self) -> bool:
        return bool(self._queued)


__all__ = ["Job", "JobQueue"]
