from __future__ import annotations

from pathlib import Path

import pytest

from spotguard import Guard
from spotguard.trainer.threads import ENV, default_threads, write_threads


def test_the_default_is_at_least_four_threads_and_one_per_core_up_to_sixteen() -> None:
    assert [default_threads(cpus) for cpus in (1, 2, 4, 8, 12, 64)] == [4, 4, 4, 8, 12, 16]
    assert write_threads(None, env={}) == default_threads()


def test_the_argument_wins_over_the_environment() -> None:
    assert write_threads(None, env={ENV: " 3 "}) == 3
    assert write_threads(6, env={ENV: "3"}) == 6


@pytest.mark.parametrize("raw", ["many", "0", "-2", "65", "2.5"])
def test_a_bad_environment_value_names_the_variable(raw: str) -> None:
    with pytest.raises(ValueError, match=f"{ENV}: .*{raw!r}"):
        write_threads(None, env={ENV: raw})


def test_a_bad_argument_names_the_argument() -> None:
    with pytest.raises(ValueError, match="write_threads: must be from 1 to 64, got 0"):
        write_threads(0)


def test_guard_refuses_a_bad_environment_value_before_it_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, "lots")
    with pytest.raises(ValueError, match=ENV):
        Guard(checkpoint_dir=tmp_path / "ckpt", socket=tmp_path / "none.sock", handle_sigterm=False)
