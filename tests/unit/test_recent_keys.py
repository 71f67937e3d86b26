"""What a store checks once per key is remembered for its newest keys only: a daemon writes a
checkpoint's files a few times an hour for months, and every key it ever wrote must not stay in memory."""

from __future__ import annotations

from spotguard.storage.base import RecentKeys


def test_the_newest_keys_are_kept_and_the_oldest_fall_out() -> None:
    keys = RecentKeys(size=3)
    for step in range(1, 101):
        keys.add(f"step-{step:09d}/weights.bin")
    assert len(keys) == 3
    assert "step-000000100/weights.bin" in keys and "step-000000098/weights.bin" in keys
    assert "step-000000097/weights.bin" not in keys  # fell out: checked again if it ever comes back


def test_a_key_noted_again_counts_as_new() -> None:
    keys = RecentKeys(size=2)
    keys.add("a")
    keys.add("b")
    keys.add("a")  # "a" is now the newest
    keys.add("c")
    assert "a" in keys and "c" in keys and "b" not in keys
