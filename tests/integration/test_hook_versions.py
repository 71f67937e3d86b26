"""A fleet upgraded in turn: each trainer's hello says its hook's spotguard version, the status shows
it, and a daemon whose trainer runs another version (or an older hook that does not say) says so."""

from __future__ import annotations

import io
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from spotguard import Guard, protocol
from spotguard.config import DaemonConfig
from spotguard.doctor import run_doctor
from spotguard.harness import Vm, wait_for
from spotguard.trainer.client import DaemonClient
from spotguard.version import __version__
from tests.integration.test_daemon_notices import status_text
from tests.integration.test_metrics_webhook import metrics_url
from tests.scrape import scrape, value

MiB = 1 << 20


def doctor_says(vm: Vm) -> str:
    """``spotguard doctor``'s line on the daemon (no provider: no metadata address is asked; no bucket)."""
    out = io.StringIO()
    config = DaemonConfig(provider="none", socket=vm.socket, checkpoint_dir=vm.root, state_dir=vm.dir / "state")
    run_doctor(config, out=out, checkpoint_gb=0.01, write_probe_bytes=MiB)
    [line] = [text for text in out.getvalue().splitlines() if text[6:].startswith("daemon:")]
    return line


def test_the_status_and_log_name_each_trainers_version_and_a_mismatch_is_warned_of(
    vm_factory: Callable[..., Vm],
) -> None:
    vm = vm_factory("vm-v", env={"SPOTGUARD_METRICS_PORT": "0"})
    url = metrics_url(vm)
    guard = Guard(socket=vm.socket, checkpoint_dir=vm.root)
    try:
        [trainer] = wait_for(lambda: vm.status()["trainers"], 10, "the trainer's hello")
        assert trainer["version"] == __version__
        assert value(scrape(url), "spotguard_trainers_on_another_version") == 0
        assert doctor_says(vm).startswith("ok    daemon: ")
        log = vm.log.read_text()
        assert f"rank 0/1 (spotguard {__version__})" in log and "upgrade the older" not in log
        # An older hook: its hello has no version field. It is served as before, and named.
        hello = {"rank": 0, "world_size": 1, "pid": 4242, "checkpoint_dir": str(vm.root)}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as older_hook:
            older_hook.settimeout(10)
            older_hook.connect(os.fspath(vm.socket))
            older_hook.sendall(protocol.encode("hello", **hello))
            assert protocol.decode(older_hook.makefile("rb").readline())["type"] == "welcome"
            trainers = wait_for(lambda: len(t := vm.status()["trainers"]) == 2 and t, 10, "both trainers")
            assert sorted(str(trainer["version"]) for trainer in trainers) == sorted([__version__, "None"])
            expected = f"trainers connected: 2 (1 on spotguard (older, unnamed), this daemon {__version__}: upgrade"
            assert expected in status_text(vm)
            assert value(scrape(url), "spotguard_trainers_on_another_version") == 1
            said = doctor_says(vm)
            assert said.startswith("warn  daemon: ")
            assert f"(1 on spotguard (older, unnamed), this daemon {__version__})" in said
        log = vm.log.read_text()
        assert f"runs spotguard (older, unnamed) and this daemon {__version__}: upgrade the older" in log
    finally:
        guard.close()


def test_the_hook_warns_once_of_a_daemon_of_another_version_and_not_of_its_own(
    vm: Vm, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="spotguard")
    hello = {"rank": 0, "world_size": 1, "pid": os.getpid(), "checkpoint_dir": str(vm.root), "version": __version__}
    same = DaemonClient(vm.socket, hello, lambda message: None).start()
    try:
        assert same.welcomed.wait(10) and same.welcome is not None and same.welcome["version"] == __version__
    finally:
        same.close()
    assert "upgrade the older" not in caplog.text
    # An older daemon: its welcome has no version. Two connections to it (a reconnect): one warning.
    path = tmp_path / "older.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(os.fspath(path))
        listener.listen(2)
        listener.settimeout(15)
        client = DaemonClient(path, hello, lambda message: None).start()
        try:
            for _ in range(2):
                conn, _ = listener.accept()
                with conn:
                    assert protocol.decode(conn.makefile("rb").readline())["type"] == "hello"
                    client.welcomed.clear()
                    conn.sendall(protocol.encode("welcome", checkpoint_dir=str(vm.root)))
                    assert client.welcomed.wait(10)
        finally:
            client.close()
    warned = [r.getMessage() for r in caplog.records if "upgrade the older" in r.getMessage()]
    assert warned == [
        f"spotguard: the daemon runs spotguard (older, unnamed) and this hook {__version__}: "
        "upgrade the older of the two so that both sides know the same messages"
    ]
