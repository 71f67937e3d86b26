"""Acceptance: a daemon's notices are its own (scoped to its checkpoint root), and every notice ends.

Real daemons in subprocesses, real sockets, a real ``Guard`` in this process.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from spotguard import Guard
from spotguard.cli import request
from spotguard.daemon.app import EventLog
from spotguard.demo import Vm, wait_for


def test_a_drill_is_replayed_only_to_a_restarted_daemon_of_the_same_root(
    vm_factory: Callable[..., Vm], tmp_path: Path
) -> None:
    # Two jobs on one host: one state directory (as /var/lib/spotguard/state is), two roots, two sockets.
    shared = ["--provider", "none", "--state-dir", str(tmp_path / "shared-state")]
    first = vm_factory("job-a", extra_args=shared)
    second = vm_factory("job-b", extra_args=shared)
    drill = request(first.socket, "drill", deadline_s=120)
    assert first.status()["pending"]["event_id"] == drill["event_id"]

    second.stop_daemon()
    second.start_daemon()
    assert second.status()["pending"] is None
    assert "still pending from before a restart" not in second.log.read_text()
    # A trainer of the other job that connects now is not told anything either: it saves periodically,
    # and its save is answered without a notice in between.
    guard = Guard(checkpoint_dir=second.root, socket=second.socket, handle_sigterm=False)
    try:
        wait_for(guard.client.welcomed.is_set, 10, "the other job's trainer to be welcomed")
        assert not guard.should_checkpoint(1) and not guard.stop_requested
    finally:
        guard.close()

    first.stop_daemon()
    first.start_daemon()
    pending = first.status()["pending"]
    assert pending is not None and pending["event_id"] == drill["event_id"]
    assert "still pending from before a restart" in first.log.read_text()
    # One event log per root in the shared directory; the drill is in the first job's only.
    logs = {vm.dir.name: EventLog.path_for(tmp_path / "shared-state", vm.root) for vm in (first, second)}
    assert logs["job-a"] != logs["job-b"]
    assert drill["event_id"] in json.loads(logs["job-a"].read_text())["events"]
    assert not logs["job-b"].exists() or drill["event_id"] not in logs["job-b"].read_text()
