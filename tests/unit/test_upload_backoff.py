"""Failed uploads back off exponentially (capped, jittered) and raise an alert after N in a row."""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import time
from pathlib import Path

import pytest

from spotguard.daemon.events import UploadCommitted
from spotguard.daemon.uploader import Uploader
from spotguard.storage.base import Progress, StorageError
from spotguard.storage.file import FileStorage
from tests.checkpoints import write_checkpoint


class BrokenStorage(FileStorage):
    """A real file:// bucket that refuses every upload (a revoked credential, say) until mended."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.broken = threading.Event()
        self.broken.set()

    def put_file(self, local: Path, key: str, *, crc32c: str, progress: Progress | None = None) -> None:
        if self.broken.is_set():
            raise StorageError(f"access denied (injected): {key}")
        super().put_file(local, key, crc32c=crc32c, progress=progress)


def uploader_for(tmp_path: Path) -> tuple[Uploader, BrokenStorage]:
    (tmp_path / "bucket").mkdir()
    storage = BrokenStorage((tmp_path / "bucket").as_uri())
    uploader = Uploader(storage, tmp_path / "local", scan_interval=60, retry_after=0.05, retry_max=0.2, alert_after=3)
    return uploader, storage


def test_the_wait_doubles_per_failure_up_to_the_cap_and_urgent_uploads_keep_the_short_one(tmp_path: Path) -> None:
    uploader, _ = uploader_for(tmp_path)
    # A bucket down for days: thousands of failures in a row still wait the cap (no float overflow).
    for failed, ceiling in [(1, 0.05), (2, 0.1), (3, 0.2), (4, 0.2), (30, 0.2), (5000, 0.2)]:
        uploader._failures.in_a_row["step-000000001"] = failed
        waits = [uploader.retry_delay("step-000000001") for _ in range(50)]
        assert all(ceiling / 2 <= w <= ceiling for w in waits), (failed, waits)
        assert len(set(waits)) > 1  # jittered
    uploader._queue.urgent.add("step-000000001")
    uploader.set_deadline(time.monotonic() + 30)
    assert uploader.retry_delay("step-000000001") == 0.05


def test_a_checkpoint_failing_n_times_in_a_row_raises_one_alert_and_the_streak_ends_at_its_commit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="spotguard.uploader")
    uploader, storage = uploader_for(tmp_path)
    step_dir = write_checkpoint(tmp_path / "local", 1, {"w.bin": b"w" * 1024})
    committed = asyncio.Event()

    async def on_committed(*_: object) -> None:
        committed.set()

    async def scenario() -> list[int]:
        uploader.bus.subscribe(UploadCommitted, on_committed)
        task = asyncio.create_task(uploader.run())
        streaks = []
        try:
            uploader.submit(step_dir, urgent=False)
            deadline = time.monotonic() + 30
            while len(uploader.failures) < 5 and time.monotonic() < deadline:
                streaks.append(uploader.failing_streak())
                await asyncio.sleep(0.01)
            streaks.append(uploader.failing_streak())
            storage.broken.clear()
            await asyncio.wait_for(committed.wait(), 30)
            streaks.append(uploader.failing_streak())
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return streaks

    streaks = asyncio.run(scenario())
    assert streaks[-2] >= 5 and streaks[-1] == 0 and streaks[:-1] == sorted(streaks[:-1])
    assert [f["in_a_row"] for f in uploader.failures[:5]] == [1, 2, 3, 4, 5]
    alerts = [r.getMessage() for r in caplog.records if "ALERT" in r.getMessage()]
    assert len(alerts) == 1 and "step-000000001 has failed 3 times in a row" in alerts[0]
    assert uploader.status()["failing_streak"] == 0


def test_the_failing_streak_is_a_metric(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry

    from spotguard.config import DaemonConfig
    from spotguard.daemon.app import Daemon
    from spotguard.daemon.metrics import DaemonMetrics

    config = DaemonConfig(
        provider="none", socket=tmp_path / "s.sock", checkpoint_dir=tmp_path / "nvme", state_dir=tmp_path / "state"
    )
    daemon = Daemon(config, provider="none")
    registry = CollectorRegistry()
    DaemonMetrics(registry).attach(daemon)
    assert registry.get_sample_value("spotguard_upload_failing_streak") == 0
    daemon.uploader._failures.in_a_row.update({"step-000000001": 2, "step-000000002": 6})
    assert registry.get_sample_value("spotguard_upload_failing_streak") == 6


def test_a_failing_checkpoint_removed_before_its_retry_is_forgotten_and_the_uploader_idles(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Local retention (or a disk-full save) may delete a checkpoint whose upload is waiting out its
    backoff: its retry finds nothing to send. Its backoff must go with it (one left behind kept the
    uploader's wait at zero: a busy loop for the daemon's life) and so must its failing streak (an
    alert that never ends)."""
    caplog.set_level(logging.INFO, logger="spotguard.uploader")
    uploader, _ = uploader_for(tmp_path)
    step_dir = write_checkpoint(tmp_path / "local", 1, {"w.bin": b"w" * 1024})

    async def scenario() -> tuple[int, float]:
        task = asyncio.create_task(uploader.run())
        try:
            uploader.submit(step_dir, urgent=False)
            deadline = time.monotonic() + 30
            while len(uploader.failures) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            streak = uploader.failing_streak()
            shutil.rmtree(step_dir)  # the retry that follows finds the directory gone
            while "neither a complete checkpoint" not in caplog.text and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            cpu_before = time.thread_time()  # the event loop's thread: the uploader's loop runs here
            await asyncio.sleep(1.0)  # the window the busy loop is measured over, not a synchronisation
            return streak, time.thread_time() - cpu_before
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    streak, loop_cpu = asyncio.run(scenario())
    assert streak >= 2 and "neither a complete checkpoint" in caplog.text
    assert loop_cpu < 0.3, f"the uploader's loop spent {loop_cpu:.2f} s of CPU in 1 s with nothing to do"
    assert uploader.failing_streak() == 0 and uploader.status()["failing_streak"] == 0


def test_what_an_upload_held_for_checkpoints_that_failed_until_retention_removed_them_is_forgotten(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A bucket down for hours while the trainer keeps saving under a pending notice: each save's
    upload fails until local retention removes it. What the uploader held for each (its progress, its
    urgency) must go with it, or the months a daemon runs add one per save."""
    caplog.set_level(logging.INFO, logger="spotguard.uploader")
    uploader, _ = uploader_for(tmp_path)
    uploader.set_deadline(time.monotonic() + 600)
    steps = [write_checkpoint(tmp_path / "local", step, {"w.bin": b"w" * 1024}) for step in (1, 2, 3)]

    async def scenario() -> tuple[set[str], set[str]]:
        task = asyncio.create_task(uploader.run())
        try:
            for step_dir in steps:
                uploader.submit(step_dir, urgent=True)
            deadline = time.monotonic() + 30
            while len({f["name"] for f in uploader.failures}) < 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            held = (set(uploader._progress), set(uploader._queue.urgent))
            for step_dir in steps:
                shutil.rmtree(step_dir)  # the trainer's retention, while the uploads wait out their backoff
            while caplog.text.count("neither a complete checkpoint") < 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)  # each retry finds its checkpoint gone
            await uploader.rescan(bucket=False)  # the next look at the disk
            return held
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    progress, urgent = asyncio.run(scenario())
    names = {step_dir.name for step_dir in steps}
    assert progress == names and urgent == names  # what the test is about was held while they failed
    assert uploader._progress == {} and uploader._queue.urgent == set()


def test_save_metric_labels_stay_within_the_known_values(tmp_path: Path) -> None:
    """A socket client's save-failed message names its reason and error; other strings than the known
    ones would each make a metric series of their own, for the daemon's life."""
    from prometheus_client import CollectorRegistry

    from spotguard.config import DaemonConfig
    from spotguard.daemon.app import Daemon
    from spotguard.daemon.events import CheckpointSaved, SaveFailed
    from spotguard.daemon.metrics import DaemonMetrics
    from spotguard.manifest import Manifest

    config = DaemonConfig(
        provider="none", socket=tmp_path / "s.sock", checkpoint_dir=tmp_path / "nvme", state_dir=tmp_path / "state"
    )
    daemon = Daemon(config, provider="none")
    registry = CollectorRegistry()
    DaemonMetrics(registry).attach(daemon)
    daemon.bus.emit(SaveFailed({"reason": "urgent", "error": "disk-full"}))
    for n in range(50):
        daemon.bus.emit(SaveFailed({"reason": f"made-up-{n}", "error": f"OSError {n}"}))
    series = {
        (s.labels["reason"], s.labels["error"]): s.value
        for metric in registry.collect()
        if metric.name == "spotguard_save_failures"
        for s in metric.samples
        if s.name.endswith("_total")
    }
    assert series == {("urgent", "disk-full"): 1.0, ("other", "other"): 50.0}
    # A manifest's reason is whatever its writer put on disk (a writer of its own, an older version).
    for reason in ["periodic", *(f"step-{n}" for n in range(50))]:
        daemon.bus.emit(CheckpointSaved("step-1", Manifest(step=1, reason=reason, world_size=1, files={})))
    saved = {
        s.labels["reason"]: s.value
        for metric in registry.collect()
        if metric.name == "spotguard_checkpoints_saved"
        for s in metric.samples
        if s.name.endswith("_total")
    }
    assert saved == {"periodic": 1.0, "other": 50.0}
