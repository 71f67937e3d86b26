"""The uploader's deadline forecast: progress counted per part and per file, early uploads
included, and a log line saying whether the urgent upload will beat the deadline."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from spotguard.cli import _upload_line
from spotguard.crc32c import crc32c_of_bytes
from spotguard.daemon.events import UploadCommitted
from spotguard.daemon.uploader import Uploader
from spotguard.manifest import FileEntry
from spotguard.storage.base import Progress
from spotguard.storage.checkpoints import UploadProgress, upload_files
from spotguard.storage.file import FileStorage
from tests.checkpoints import write_checkpoint

KiB = 1024


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class PacedStorage(FileStorage):
    """A real file:// bucket behind a link of ``rate`` bytes/s, reporting progress per 64 KiB."""

    def __init__(self, url: str, rate: float) -> None:
        super().__init__(url)
        self.rate = rate

    def put_file(self, local: Path, key: str, *, crc32c: str, progress: Progress | None = None) -> None:
        size = local.stat().st_size
        started = time.monotonic()
        for sent in range(64 * KiB, size + 64 * KiB, 64 * KiB):
            time.sleep(max(0.0, started + min(sent, size) / self.rate - time.monotonic()))  # the link's pace
            if progress:
                progress(min(64 * KiB, size - (sent - 64 * KiB)))
        super().put_file(local, key, crc32c=crc32c)


def test_upload_progress_counts_each_file_once_and_rates_only_bytes_sent() -> None:
    clock = FakeClock()
    progress = UploadProgress(clock)
    progress.expect("a", 1000)
    progress.expect("b", 3000)
    assert (progress.total, progress.done, progress.rate(), progress.eta()) == (4000, 0, None, None)
    send_a = progress.sender("a")
    send_a(400)
    clock.now += 2.0
    send_a(400)
    send_a(400)  # a retried part: capped at a's size
    assert progress.done == 1000
    assert progress.rate() == pytest.approx(1000 / 2.001)
    progress.present("a")  # found in the bucket again: no double count
    progress.present("b")  # another process sent b: done, but the link is no faster
    assert progress.done == 4000 and progress.eta() == 0.0
    assert progress.rate() == pytest.approx(1000 / 2.001)


def test_upload_progress_eta_is_what_is_left_at_the_rate_so_far() -> None:
    clock = FakeClock()
    progress = UploadProgress(clock)
    progress.expect("a", 10_000)
    progress.sender("a")(2_000)
    clock.now += 1.0
    rate = progress.rate()
    assert rate is not None
    assert progress.eta() == pytest.approx(8_000 / rate)


def test_a_file_sent_here_is_skipped_only_with_the_same_bytes_and_taken_ahead_once(tmp_path: Path) -> None:
    """A save of a step begun again (after the trainer crashed) may write other bytes under a name sent
    before: the commit's upload sends them, where skipping "sent here" would leave the old object."""
    (tmp_path / "bucket").mkdir()
    storage = FileStorage((tmp_path / "bucket").as_uri())
    step_dir = write_checkpoint(tmp_path / "local", 7, {"a.bin": b"first save"})
    first = FileEntry(10, crc32c_of_bytes(b"first save"))
    progress = UploadProgress()
    assert progress.take_ahead("a.bin", first) and not progress.take_ahead("a.bin", first)  # its message repeated
    upload_files(storage, step_dir, {"a.bin": first}, progress=progress)
    assert progress.sent_here("a.bin", first)
    (step_dir / "a.bin").write_bytes(b"second save, other bytes")
    second = FileEntry(24, crc32c_of_bytes(b"second save, other bytes"))
    assert progress.take_ahead("a.bin", second)  # another file under the same name: it goes again
    upload_files(storage, step_dir, {"a.bin": second}, progress=progress)
    assert (tmp_path / "bucket" / step_dir.name / "a.bin").read_bytes() == b"second save, other bytes"
    assert progress.sent_here("a.bin", second) and not progress.sent_here("a.bin", first)


async def run_urgent_upload(
    tmp_path: Path, rate: float, deadline_s: float, caplog: pytest.LogCaptureFixture
) -> tuple[list[dict[str, object]], bool]:
    caplog.set_level(logging.INFO, logger="spotguard.uploader")
    (tmp_path / "bucket").mkdir()
    storage = PacedStorage((tmp_path / "bucket").as_uri(), rate)
    root = tmp_path / "local"
    step_dir = write_checkpoint(root, 7, {"a.bin": b"a" * (512 * KiB), "b.bin": b"b" * (512 * KiB)})
    uploader = Uploader(storage, root, scan_interval=60, forecast_interval=0.2)
    uploader.set_deadline(time.monotonic() + deadline_s)
    committed = asyncio.Event()

    async def on_committed(*_: object) -> None:
        committed.set()

    uploader.bus.subscribe(UploadCommitted, on_committed)
    task = asyncio.create_task(uploader.run())
    reports: list[dict[str, object]] = []
    try:
        uploader.submit(step_dir, urgent=True)
        deadline = time.monotonic() + 30
        while not committed.is_set() and time.monotonic() < deadline:
            if (report := uploader.status()["current"]) is not None:
                reports.append(report)
            await asyncio.sleep(0.05)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return reports, committed.is_set()


def test_an_upload_too_slow_for_the_deadline_is_reported_before_it_misses(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # 1 MiB at 400 KiB/s takes ~2.6 s; the deadline is 1 s away.
    reports, committed = asyncio.run(run_urgent_upload(tmp_path, 400 * KiB, 1.0, caplog))
    assert committed
    missing = [r for r in reports if r["will_meet_deadline"] is False]
    assert missing, reports
    line = _upload_line(missing[-1])  # what `spotguard status` prints
    assert line.startswith("uploading step-000000007 (urgent): ") and line.endswith("will MISS it")
    assert all(r["urgent"] and r["total_known"] and r["bytes_total"] == 1024 * KiB for r in reports)
    done = [r["bytes_done"] for r in reports]
    assert done == sorted(done) and max(done) > 0  # type: ignore[type-var]
    assert any("will MISS it by" in m for m in caplog.messages), caplog.messages
    assert any("deadline passed" in m and "still uploading" in m for m in caplog.messages), caplog.messages
    assert any("AFTER the deadline" in m for m in caplog.messages)


def test_an_upload_well_within_the_deadline_is_reported_on_track(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reports, committed = asyncio.run(run_urgent_upload(tmp_path, 1024 * KiB, 60.0, caplog))
    assert committed
    judged = [r for r in reports if r["will_meet_deadline"] is not None]
    assert judged and all(r["will_meet_deadline"] is True for r in judged)
    assert any(m.endswith("on track") for m in caplog.messages), caplog.messages
    assert not any("MISS" in m for m in caplog.messages)


def test_files_sent_before_the_commit_show_in_the_forecast(tmp_path: Path) -> None:
    async def scenario() -> list[dict[str, object]]:
        (tmp_path / "bucket").mkdir()
        storage = PacedStorage((tmp_path / "bucket").as_uri(), 512 * KiB)
        root = tmp_path / "local"
        step_dir = root / "step-000000009"
        step_dir.mkdir(parents=True)
        data = b"x" * (768 * KiB)
        (step_dir / "w.bin").write_bytes(data)
        uploader = Uploader(storage, root, scan_interval=60)
        uploader.set_deadline(time.monotonic() + 30)
        uploader.file_ready(step_dir, "w.bin", FileEntry(len(data), crc32c_of_bytes(data)), urgent=True)
        reports = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            report = uploader.status()["current"]
            if report is None:
                break
            reports.append(report)
            await asyncio.sleep(0.05)
        return reports

    reports = asyncio.run(scenario())
    assert reports, "the early upload never showed in status"
    assert all(r["name"] == "step-000000009" and r["total_known"] is False for r in reports)
    assert reports[-1]["bytes_total"] == 768 * KiB
    assert any(r["rate_bytes_s"] for r in reports) and any("deadline_s_left" in r for r in reports)
    assert "(still being written)" in _upload_line(reports[-1])
    assert (tmp_path / "bucket" / "step-000000009" / "w.bin").stat().st_size == 768 * KiB


class CountingStorage(PacedStorage):
    """:class:`PacedStorage` that counts each key's puts."""

    def __init__(self, url: str, rate: float) -> None:
        super().__init__(url, rate)
        self.puts: dict[str, int] = {}

    def put_file(self, local: Path, key: str, *, crc32c: str, progress: Progress | None = None) -> None:
        super().put_file(local, key, crc32c=crc32c, progress=progress)
        self.puts[key] = self.puts.get(key, 0) + 1


def test_an_urgent_save_of_the_checkpoint_uploading_now_makes_it_urgent_and_sends_nothing_twice(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A notice during evaluation, right after a periodic save of the same step: the urgent save finds
    the checkpoint on disk and reports it as urgent. The uploader cancelled that checkpoint's own
    periodic upload and sent its file in flight again, inside the notice's deadline."""
    caplog.set_level(logging.INFO, logger="spotguard.uploader")
    (tmp_path / "bucket").mkdir()
    storage = CountingStorage((tmp_path / "bucket").as_uri(), 1024 * KiB)
    root = tmp_path / "local"
    files = {f"shard{i}.bin": bytes([i]) * (384 * KiB) for i in range(4)}  # 1.5 s on the paced link
    step_dir = write_checkpoint(root, 9, files, reason="periodic")
    uploader = Uploader(storage, root, scan_interval=60)
    committed = asyncio.Event()
    uploader.bus.subscribe(UploadCommitted, lambda _event: committed.set())

    async def scenario() -> tuple[bool, bool]:
        task = asyncio.create_task(uploader.run())
        try:
            uploader.submit(step_dir, urgent=False)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # a file in flight, none finished: the worst case to cancel
                report = uploader.status()["current"]
                if report is not None and 0 < int(report["bytes_done"]) < 384 * KiB:
                    break
                await asyncio.sleep(0.005)
            before = uploader.status()["current"]
            uploader.submit(step_dir, urgent=True)
            after = uploader.status()["current"]
            await asyncio.wait_for(committed.wait(), 30)
            return bool(before and not before["urgent"]), bool(after and after["urgent"])
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    was_periodic, now_urgent = asyncio.run(scenario())
    assert was_periodic and now_urgent
    assert not any("cancelling the periodic upload" in m for m in caplog.messages), caplog.messages
    sent = {key.rsplit("/", 1)[-1]: count for key, count in storage.puts.items()}
    assert sent == dict.fromkeys(files, 1), sent
    assert step_dir.name in uploader.committed and uploader.status()["queued"] == []
