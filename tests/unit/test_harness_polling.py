"""The harness's polling: a condition is called every interval, and a bucket's client is kept."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest

from spotguard.harness import bucket_storage, wait_for


def test_a_quick_condition_is_called_every_interval_and_a_timeout_names_what_was_awaited() -> None:
    calls: list[float] = []
    with pytest.raises(TimeoutError, match="the impossible"):
        wait_for(lambda: calls.append(time.monotonic()), 0.3, "the impossible", interval=0.05)
    assert all(later - earlier >= 0.05 for earlier, later in itertools.pairwise(calls)), calls
    assert 1 <= len(calls) <= 8, calls  # 0.3 s at one call per 0.05 s at most


def test_the_client_of_the_last_bucket_is_kept_and_another_bucket_or_endpoint_gets_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    first, second = (tmp_path / "a").as_uri(), (tmp_path / "b").as_uri()
    kept = bucket_storage(first)
    assert bucket_storage(first) is kept
    other = bucket_storage(second)
    assert other is not kept
    assert bucket_storage(second) is other
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")  # another endpoint: another client
    assert bucket_storage(second) is not other
