"""The peer handoff sends a file's ranges while the trainer is still writing it (``file-range``).

Two real daemons; the bucket (moto) behind a relay pacing each connection to 1 MB/s, so that A's
deadline plan routes its urgent checkpoint to B. The trainer side (``tests.streaming.ProgressiveWriter``)
writes one file in chunks through A's socket: B holds bytes of it before the ``file`` message, the
``file`` message sends nothing again, and B verifies the whole against the manifest. A file given
up half sent (its temporary file removed) and written again is sent again, and only the new one counts.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from spotguard.control import request
from spotguard.harness import Vm, wait_for
from tests.checkpoints import write_checkpoint
from tests.peers import handoff_ended, peer_behind_a_slow_bucket
from tests.streaming import MiB, ProgressiveWriter

SIZE = 6 * MiB + 5
DEADLINE = 8.0


@pytest.fixture
def vms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Vm, Vm]]:
    with peer_behind_a_slow_bucket(tmp_path, monkeypatch) as (url, vm_b):
        peers = ["--peers", vm_b.status()["peers"]["listen"]]
        vm_a = Vm(tmp_path, "vm-a", url, extra_args=["--provider", "none", *peers])
        # A's last checkpoint says how big the next one is: 16 s at 1 MB/s, more than the deadline.
        write_checkpoint(vm_a.root, 1, {"state.bin": bytes(16 * MiB)})
        vm_a.start_daemon()
        try:
            yield vm_a, vm_b
        finally:
            vm_a.kill_daemon()


@pytest.mark.parametrize("rewritten", [False, True])
def test_ranges_reach_the_peer_before_the_file_is_finished(vms: tuple[Vm, Vm], rewritten: bool) -> None:
    vm_a, vm_b = vms
    wait_for(lambda: vm_a.status()["upload_rate_bytes_s"], 30, "A's upload-rate probe")
    writer = ProgressiveWriter(vm_a.root, 5, vm_a.socket, size=SIZE, chunk=2 * MiB)
    given_up = 0
    try:
        request(vm_a.socket, "drill", deadline_s=DEADLINE)
        wait_for(lambda: vm_a.status()["plan"]["route"] == "peer", 10, "A's plan to route to the peer")
        writer.begin()
        writer.write_until(4 * MiB)
        # The proof that it streams: the peer holds ranges of a file whose `file` message has not come.
        sent = wait_for(
            lambda: (h := vm_a.status()["peers"]["handoff"])["bytes_sent"] >= 4 * MiB and h, 10, "ranges sent to B"
        )
        assert sent["name"] == writer.step_dir.name and sent["state"] == "sending", sent
        [replica] = vm_b.status()["peers"]["replicas"]
        assert replica["name"] == writer.step_dir.name and replica["state"] == "receiving"
        assert writer.written < writer.size
        if rewritten:  # the save starts over: its directory, with the temporary file, is removed
            given_up = sent["bytes_sent"]
            writer.close()
            writer = ProgressiveWriter(vm_a.root, 5, vm_a.socket, size=SIZE, chunk=2 * MiB)
            writer.begin()
        writer.write_until(writer.size)
        writer.finish_file()
        writer.commit()
        handed = handoff_ended(vm_a, DEADLINE)
    finally:
        writer.close()
    assert handed["state"] == "handed", handed  # B checked the file against the manifest
    # Every byte of the finished file once: its file message only confirmed it.
    assert handed["bytes_sent"] - given_up == SIZE
