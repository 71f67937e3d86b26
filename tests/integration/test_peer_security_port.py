"""What the peer port costs the daemon, against a real receiver: a worker process started where
another local user can write."""

from __future__ import annotations

from pathlib import Path

import pytest

from spotguard.harness import wait_for
from spotguard.peer import workers

# --- a worker's import path ------------------------------------------------------------------------


def test_a_worker_never_imports_a_package_planted_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``spotguard`` package in the daemon's working directory (which another local user may be
    able to write) is not what its worker processes import: they start and serve."""
    planted = tmp_path / "cwd" / "spotguard"
    planted.mkdir(parents=True)
    ran = tmp_path / "planted-code-ran"
    (planted / "__init__.py").write_text(f"open({str(ran)!r}, 'w').close()\nraise SystemExit(0)\n")
    monkeypatch.chdir(planted.parent)
    pool = workers.WorkerPool(1)
    try:
        pool.warm(1)
        wait_for(lambda: ran.exists() or pool.status()["idle"] == 1, 30, "a worker started, or the planted code")
        assert not ran.exists()
        worker = pool.take()
        assert worker is not None and worker.process.poll() is None
        worker.release()
    finally:
        pool.close()
