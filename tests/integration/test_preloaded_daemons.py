"""The daemons the tests fork from a preloaded server (tests/preloaded.py) behave as the ones a VM
starts with ``python -m spotguard run``: same refusals and exit codes, same answers, and no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from spotguard.harness import Vm
from tests.preloaded import PreloadedProcess, popen_daemon


def test_a_vms_daemon_is_forked_without_torch_and_stops_as_a_started_one_does(vm: Vm) -> None:
    assert isinstance(vm.process, PreloadedProcess)
    assert vm.status()["pid"] == vm.process.pid
    mapped = Path(f"/proc/{vm.process.pid}/maps").read_text()
    assert "libtorch" not in mapped and "spotguard" in vm.log.read_text()
    assert vm.stop_daemon() == 0


def test_a_daemon_that_refuses_its_settings_says_the_same_forked_or_started(tmp_path: Path) -> None:
    """A config error ends the process with the CLI's code and message, both ways."""
    config = tmp_path / "spotguard.toml"
    config.write_text("peer_max_replicas = 'eight'\n")
    command = [sys.executable, "-m", "spotguard", "run", "--config", str(config), "--bucket", tmp_path.as_uri()]
    results = []
    for start in (popen_daemon, subprocess.Popen):
        log = tmp_path / f"{start.__name__}.log"
        with log.open("wb") as out:
            process = start(command, stdout=out, stderr=out, cwd=tmp_path)
        code = process.wait(timeout=60)
        results.append((code, log.read_text().strip().splitlines()[-1]))
    assert results[0] == results[1]
    code, message = results[0]
    assert code != 0 and "peer_max_replicas" in message
