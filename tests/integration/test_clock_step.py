"""A step of the wall clock during a race (NTP stepping a clock it found off, a VM thawed after a
pause) moves no deadline: the daemon counts a notice's time on a steady clock from when the notice
came (spotguard.notice.Notice.steady_deadline).

The daemon runs in this process (tests/daemonthread.py) so that ``time_machine`` can step the wall
clock it reads, ``time.time()`` and ``datetime.now()``, while the steady clocks run on; its
socket, trainer hook and file:// bucket are real. Before, a step forward past the deadline and the
grace ended the race at once ("the VM outlived its deadline", training went back to normal on a VM
going away), and a step back gave the race hours it did not have."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import time_machine
import torch

from spotguard import Guard
from spotguard.config import DaemonConfig
from spotguard.control import request
from spotguard.daemon.app import Daemon
from spotguard.harness import wait_for
from spotguard.notice import utcnow
from spotguard.storage.file import FileStorage
from tests.daemonthread import DaemonThread

DEADLINE_S = 60.0
STEP = timedelta(hours=2)  # far past the deadline and the notice grace either way


class FileBucketDaemon(DaemonThread):
    @asynccontextmanager
    async def running(self) -> AsyncIterator[Daemon]:
        yield Daemon(self.config, provider="none", storage=FileStorage(str(self.config.bucket)))


@contextmanager
def wall_clock_stepped(by: timedelta) -> Iterator[None]:
    """The wall clock, for everything in this process, ``by`` off the real one (and running on)."""
    with time_machine.travel(utcnow() + by, tick=True):
        yield


def pending(config: DaemonConfig) -> dict[str, Any]:
    reply = request(config.socket, "status")
    assert reply["pending"] is not None, f"the drill is no longer pending: {reply['last_notice']}"
    return dict(reply["pending"])


def test_a_wall_clock_step_either_way_moves_no_deadline_of_a_race(tmp_path: Path) -> None:
    config = DaemonConfig(
        provider="none",
        socket=tmp_path / "daemon.sock",
        checkpoint_dir=tmp_path / "nvme",
        state_dir=tmp_path / "state",
        bucket=(tmp_path / "bucket").as_uri(),
    )
    with FileBucketDaemon(config, wait=15):
        guard = Guard(checkpoint_dir=config.checkpoint_dir, socket=config.socket, handle_sigterm=False)
        try:
            request(config.socket, "drill", deadline_s=DEADLINE_S)
            wait_for(lambda: guard.should_checkpoint(1, periodic=False), 10, "the trainer to be told")
            before = pending(config)
            assert 0 < before["seconds_left"] <= DEADLINE_S

            with wall_clock_stepped(STEP):
                ahead = pending(config)  # before the change: over, "the VM outlived its deadline by 7140 s"
            assert ahead["state"] == "pending"
            assert 0 < ahead["seconds_left"] <= before["seconds_left"]

            with wall_clock_stepped(-STEP):
                behind = pending(config)  # before the change: 7,260 s left
                assert 0 < behind["seconds_left"] <= ahead["seconds_left"]
                assert behind["over_in_s"] <= before["over_in_s"]
                # The urgent checkpoint, saved and uploaded with the clock still stepped back.
                guard.save({"w": torch.arange(1024.0)}, 1)
                wait_for(lambda: request(config.socket, "status")["uploads"]["last_committed"], 20, "the urgent commit")
            committed = request(config.socket, "status")["uploads"]["last_committed"]
            # Its margin to the deadline as the race counted it: before, 7,200 s more.
            assert 0 < committed["deadline_margin_s"] <= behind["seconds_left"]
            assert request(config.socket, "status")["pending"]["state"] == "held"
        finally:
            guard.close()
