"""A verified replica whose commit in the bucket fails is retried with a growing wait, for as long as
the bucket fails (a daemon runs for months; the bucket may be down for hours), and one whose files
on the peer's disk are gone is given up at once, its slot and bytes freed, instead of being retried
for good."""

from __future__ import annotations

import asyncio
import math
import os
import re
import shutil
from pathlib import Path

from spotguard.backoff import backoff_delay
from spotguard.harness import wait_for
from spotguard.peer.client import PeerClient
from spotguard.peer.flows import send_committed
from spotguard.peer.replicas import AREA
from tests.checkpoints import write_checkpoint
from tests.peers import TOKEN, address, receiving_daemon

MiB = 1 << 20


def test_the_wait_doubles_up_to_its_cap_and_never_overflows() -> None:
    for failures, ceiling in [(0, 5.0), (1, 5.0), (2, 10.0), (3, 20.0), (7, 300.0), (10_000, 300.0)]:
        waits = [backoff_delay(failures, 5.0, 300.0) for _ in range(50)]
        assert all(ceiling / 2 <= wait <= ceiling for wait in waits), (failures, waits)
    assert math.isfinite(backoff_delay(10_000, 0.5))  # uncapped: at its largest doubling, not an overflow


def test_a_replica_whose_commit_fails_waits_and_one_whose_files_are_gone_is_given_up(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    with receiving_daemon(tmp_path, bucket.as_uri()) as vm:
        # After the daemon's own upload-rate probe, which writes in the bucket (and would make it again).
        wait_for(lambda: vm.status()["upload_rate_bytes_s"], 30, "the daemon's upload-rate probe")
        shutil.rmtree(bucket)
        bucket.write_bytes(b"")  # the bucket now refuses every write: its directory is a plain file
        step_dir = write_checkpoint(tmp_path / "vm-a", 9, {"weights.bin": os.urandom(MiB)})

        async def hand_over() -> dict[str, object]:
            client = await PeerClient.connect(*address(vm), TOKEN.encode())
            try:
                return await send_committed(client, step_dir, bucket.as_uri(), TOKEN.encode(), flows=1)
            finally:
                await client.close()

        assert asyncio.run(hand_over())["state"] == "verified"
        failed = wait_for(
            lambda: re.search(
                r"committing step-000000009 failed \(1 in a row\): .*; retrying in (\d+) s", vm.log.read_text()
            ),
            30,
            "the first failed commit",
        )
        assert 2 <= int(failed[1]) <= 5  # 5 s, jittered over its upper half
        [replica] = vm.status()["peers"]["replicas"]
        assert replica["state"] == "verified"
        for held in (vm.root / AREA).glob("*/step-000000009"):
            shutil.rmtree(held)  # its files are gone from the peer's disk (an operator, a failing disk)
        wait_for(lambda: vm.status()["peers"]["replicas"] == [], 15, "the replica given up")
        log = vm.log.read_text()
        assert "(1 in a row)" in log and "(2 in a row)" not in log and "given up" in log
