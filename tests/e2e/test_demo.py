"""Acceptance: `spotguard demo` tells the whole story and ends bitwise identical, in under 2 minutes."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest


@pytest.mark.slow
def test_demo_succeeds_with_timeline_and_identical_result() -> None:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "spotguard", "demo"], capture_output=True, text=True, timeout=180, check=False
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "bitwise identical to the uninterrupted run: yes" in out
    for stage in ("daemon saw it", "trainer told", "committed locally", "committed in bucket"):
        assert re.search(rf"{stage}.*\d+\.\d ms", out), stage
    assert elapsed < 120
