"""``spotguard verify``: a step never committed (no manifest: a failed or unfinished save) is listed as
incomplete and does not fail a location's run; a committed step whose files do not match does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spotguard.cli import main
from spotguard.manifest import step_dir_name
from tests.checkpoints import write_checkpoint


@pytest.fixture
def root(tmp_path: Path) -> Path:
    write_checkpoint(tmp_path, 1, {"w.bin": b"w" * 1000})
    leftover = tmp_path / step_dir_name(2)  # a save that failed after its first file
    leftover.mkdir()
    (leftover / "_rng.pt").write_bytes(b"r" * 100)
    return tmp_path


def test_an_incomplete_step_is_listed_and_does_not_fail_the_location(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", str(root)]) == 0
    out = capsys.readouterr().out
    assert "step-000000001: ok" in out
    assert "step-000000002: incomplete (never committed: no manifest)" in out
    assert main(["verify", str(root), "--json"]) == 0
    statuses = {r["name"]: r["status"] for r in json.loads(capsys.readouterr().out)}
    assert statuses == {"step-000000001": "ok", "step-000000002": "incomplete"}


def test_an_incomplete_step_named_on_its_own_fails(root: Path) -> None:
    assert main(["verify", str(root / step_dir_name(2))]) == 1


def test_a_committed_step_whose_file_changed_fails_the_location(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (root / step_dir_name(1) / "w.bin").write_bytes(b"x" * 1000)
    assert main(["verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert "step-000000001: FAILED" in out and "crc32c" in out
