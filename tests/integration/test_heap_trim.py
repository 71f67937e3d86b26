"""An idle daemon gives its heaps' free pages back now and then (spotguard/daemon/heap.py), and
never while a notice is pending or a checkpoint is uploading: a trim in the race would only make
the next buffers fault their pages in again."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import torch

from spotguard import Guard
from spotguard.config import DaemonConfig
from spotguard.control import request
from spotguard.daemon import heap
from spotguard.daemon.app import Daemon
from spotguard.harness import wait_for
from spotguard.storage.file import FileStorage
from tests.daemonthread import DaemonThread


class HeldCommitStorage(FileStorage):
    """A real file:// bucket whose manifest uploads wait until the test lets them go on."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.committing = threading.Event()
        self.go_on = threading.Event()

    def put_bytes_if_absent(self, key: str, data: bytes, *, crc32c: str) -> None:
        self.committing.set()
        self.go_on.wait(30)
        super().put_bytes_if_absent(key, data, crc32c=crc32c)


class TrimmingDaemon(DaemonThread):
    def __init__(self, config: DaemonConfig, storage: FileStorage) -> None:
        super().__init__(config, wait=15)
        self.storage = storage

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Daemon]:
        yield Daemon(self.config, provider="none", storage=self.storage)


def test_an_idle_daemon_trims_its_heaps_and_not_while_uploading_or_under_a_notice(
    tmp_path: Path, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(heap, "TRIM_INTERVAL", 0.05)
    config = DaemonConfig(
        provider="none",
        socket=tmp_path / "daemon.sock",
        checkpoint_dir=tmp_path / "nvme",
        state_dir=tmp_path / "state",  # not the default's: a rerun at the same path restored this run's drill
        bucket=bucket,
    )
    storage = HeldCommitStorage(bucket)
    with TrimmingDaemon(config, storage) as running:
        daemon = running.daemon
        assert daemon is not None
        wait_for(lambda: daemon.heap_trims >= 2, 10, "trims while idle")

        guard = Guard(checkpoint_dir=config.checkpoint_dir, socket=config.socket, handle_sigterm=False)
        try:
            guard.save({"w": torch.arange(1024.0)}, 1)
            wait_for(storage.committing.is_set, 20, "the upload to reach its commit")
            assert not daemon.may_trim_heap()  # uploading
            storage.go_on.set()
            wait_for(lambda: daemon.status()["uploads"]["last_committed"], 20, "the commit")
            trims = daemon.heap_trims
            wait_for(lambda: daemon.heap_trims > trims, 10, "a trim once idle again")

            request(config.socket, "drill", deadline_s=120)
            wait_for(lambda: daemon.pending is not None, 10, "the drill to be pending")
            assert not daemon.may_trim_heap()  # under a notice
        finally:
            storage.go_on.set()
            guard.close()
