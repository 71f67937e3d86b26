"""One file:// bucket shared by several writers: exclusive manifests, files judged by their
checksum and not their size, and an uploader that backs off from another writer's commit once."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from threading import Barrier

import pytest

from spotguard.crc32c import crc32c_of_bytes
from spotguard.daemon.uploader import Uploader
from spotguard.manifest import MANIFEST, load_manifest
from spotguard.storage.base import ObjectExists, ObjectInfo
from spotguard.storage.checkpoints import list_remote, upload_checkpoint, verify_remote
from spotguard.storage.file import FileStorage
from tests.checkpoints import write_checkpoint


class CountingStorage(FileStorage):
    """A real file:// bucket that counts manifest commits and listings; ``before_commit`` runs
    just before a commit (another writer getting there first)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.commits = 0
        self.listings = 0
        self.before_commit: Callable[[str], None] | None = None

    def put_bytes_if_absent(self, key: str, data: bytes, *, crc32c: str) -> None:
        self.commits += 1
        if self.before_commit is not None:
            self.before_commit(key)
        super().put_bytes_if_absent(key, data, crc32c=crc32c)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        self.listings += 1
        return super().list(prefix)


@pytest.fixture
def storage(tmp_path: Path) -> CountingStorage:
    (tmp_path / "bucket").mkdir()
    return CountingStorage((tmp_path / "bucket").as_uri())


def test_put_bytes_if_absent_lets_exactly_one_of_racing_writers_create_the_key(storage: FileStorage) -> None:
    for round_ in range(20):
        start = Barrier(4)

        def create(writer: int, round_: int = round_, start: Barrier = start) -> bool:
            data = f"writer {writer}".encode()
            start.wait(timeout=10)
            try:
                storage.put_bytes_if_absent(f"k{round_}", data, crc32c=crc32c_of_bytes(data))
            except ObjectExists:
                return False
            return True

        with ThreadPoolExecutor(max_workers=4) as pool:
            won = list(pool.map(create, range(4)))
        assert won.count(True) == 1
        assert storage.read_bytes(f"k{round_}") == f"writer {won.index(True)}".encode()
    assert sorted(p.name for p in storage.root.iterdir()) == sorted(f"k{i}" for i in range(20))  # no temp files


def test_a_file_of_the_same_size_but_other_bytes_is_sent_again(tmp_path: Path, storage: FileStorage) -> None:
    step_dir = write_checkpoint(tmp_path / "local", 1, {"w.pt": b"ours" * 1000})
    (storage.root / "step-000000001").mkdir()
    (storage.root / "step-000000001" / "w.pt").write_bytes(b"them" * 1000)  # another writer's, same size
    upload_checkpoint(storage, step_dir)
    assert verify_remote(storage, "step-000000001") == []


def run_uploader_until(uploader: Uploader, storage: CountingStorage, done: Callable[[], bool]) -> None:
    """Run ``uploader`` until ``done()`` and at least 30 listings (rescans) more, with a deadline."""

    async def run() -> None:
        task = asyncio.create_task(uploader.run())
        try:
            deadline = time.monotonic() + 20
            while not done():
                assert time.monotonic() < deadline, f"uploader stuck: {uploader.status()}"
                await asyncio.sleep(0.02)
            settled = storage.listings + 30
            while storage.listings < settled:
                assert time.monotonic() < deadline, f"uploader stuck: {uploader.status()}"
                await asyncio.sleep(0.02)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    asyncio.run(run())


def test_uploader_leaves_another_writers_checkpoint_of_the_same_step_alone(
    tmp_path: Path, storage: CountingStorage, caplog: pytest.LogCaptureFixture
) -> None:
    theirs = write_checkpoint(tmp_path / "other", 1, {"w.pt": b"theirs" * 100})
    upload_checkpoint(storage, theirs)
    root = tmp_path / "nvme"
    write_checkpoint(root, 1, {"w.pt": b"ours!!" * 100})  # the same step, other bytes
    write_checkpoint(root, 2, {"w.pt": b"two" * 100})
    storage.commits = 0
    uploader = Uploader(storage, root, scan_interval=0.02)
    run_uploader_until(uploader, storage, lambda: "step-000000002" in uploader.committed)
    assert uploader.conflicts == {"step-000000001"}
    assert storage.commits == 1  # step 2 only
    assert (storage.root / "step-000000001" / MANIFEST).read_bytes() == (theirs / MANIFEST).read_bytes()
    assert verify_remote(storage, "step-000000001") == []
    assert caplog.text.count("not committing step-000000001") == 1


def test_uploader_that_loses_the_race_for_a_manifest_backs_off_once(
    tmp_path: Path, storage: CountingStorage, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "nvme"
    write_checkpoint(root, 1, {"w.pt": b"ours!!" * 100})
    theirs = write_checkpoint(tmp_path / "other", 1, {"w.pt": b"theirs" * 100})
    other = FileStorage(storage.url)

    def they_commit_first(key: str) -> None:
        if key.startswith("step-000000001/") and storage.before_commit is not None:
            storage.before_commit = None
            other.delete(o.key for o in other.list("step-000000001/"))  # ours go; theirs come in
            upload_checkpoint(other, theirs)

    storage.before_commit = they_commit_first
    uploader = Uploader(storage, root, scan_interval=0.02)
    run_uploader_until(uploader, storage, lambda: bool(uploader.conflicts))
    assert uploader.conflicts == {"step-000000001"}
    assert storage.commits == 1  # no retry loop
    assert uploader.failures == []
    assert (storage.root / "step-000000001" / MANIFEST).read_bytes() == (theirs / MANIFEST).read_bytes()
    assert verify_remote(storage, "step-000000001") == []
    assert [i.status for i in list_remote(storage)] == ["complete"]
    assert caplog.text.count("not committing step-000000001") == 1
    assert "already holds another writer's checkpoint" in caplog.text


def test_the_same_checkpoint_committed_elsewhere_is_completed_not_taken_on_its_manifest(
    tmp_path: Path, storage: CountingStorage
) -> None:
    files = {"a.pt": b"a" * 100, "b.pt": b"b" * 100}
    upload_checkpoint(storage, write_checkpoint(tmp_path / "first", 3, files))
    (storage.root / "step-000000003" / "b.pt").unlink()  # the other writer's upload lost a file
    again = write_checkpoint(tmp_path / "second", 3, files, reason="urgent")  # same files, another manifest
    upload_checkpoint(storage, again)
    assert verify_remote(storage, "step-000000003") == []


def test_files_ready_ahead_of_the_commit_never_overwrite_another_writers_checkpoint(
    tmp_path: Path, storage: CountingStorage
) -> None:
    theirs = write_checkpoint(tmp_path / "other", 1, {"w.pt": b"theirs" * 100})
    upload_checkpoint(storage, theirs)
    ours = write_checkpoint(tmp_path / "nvme", 1, {"w.pt": b"ours!!" * 100, "v.pt": b"v"})

    async def run() -> None:
        uploader = Uploader(storage, tmp_path / "nvme", scan_interval=60)
        for rel, entry in load_manifest(ours).files.items():
            uploader.file_ready(ours, rel, entry, urgent=True)  # as a trainer reports them while saving
        await asyncio.gather(*uploader._early[ours.name])

    asyncio.run(run())
    assert sorted(p.name for p in (storage.root / "step-000000001").iterdir()) == [MANIFEST, "w.pt"]
    assert verify_remote(storage, "step-000000001") == []
