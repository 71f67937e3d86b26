"""Retry waits are jittered without drawing from :mod:`random`'s global generator, which is the
trainer's: its state is saved in every checkpoint and restored on resume (spotguard/trainer/state.py)."""

from __future__ import annotations

import random

from spotguard.backoff import backoff_delay
from spotguard.storage.base import retry


def test_retry_waits_leave_the_trainers_random_sequence_where_it_was() -> None:
    random.seed(7)
    uninterrupted = [random.random() for _ in range(3)]
    random.seed(7)
    failures = iter([ConnectionError("503"), ConnectionError("503")])

    def read_from_bucket() -> str:
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return "read"

    waits: list[float] = []
    assert retry(read_from_bucket, is_transient=lambda exc: True, sleep=waits.append) == "read"
    delays = [backoff_delay(failures, first=1.0, most=8.0) for failures in range(1, 6)]
    assert [random.random() for _ in range(3)] == uninterrupted
    assert len(waits) == 2 and all(0.0 <= wait <= 0.4 for wait in waits)  # full jitter under 0.2, 0.4
    assert all(cap / 2 <= delay <= cap for delay, cap in zip(delays, [1.0, 2.0, 4.0, 8.0, 8.0], strict=True))
