"""One file:// bucket shared by several writers: exclusive manifests, files judged by their
checksum and not their size, and an uploader that backs off from another writer's commit once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from threading import Barrier

import pytest

from spotguard.crc32c import crc32c_of_bytes
from spotguard.daemon.uploader import Uploader
from spotguard.manifest import MANIFEST, load_manifest
from spotguard.storage.base import ObjectExists, ObjectInfo, StorageError
from spotguard.storage.checkpoints import KnownManifests, list_remote, upload_checkpoint, verify_remote
from spotguard.storage.file import FileStorage
from tests.checkpoints import write_checkpoint


class CountingStorage(FileStorage):
    """A real file:// bucket that counts manifest commits and listings; ``before_commit`` runs
    just before a commit (another writer getting there first)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.commits = 0
        self.listings = 0
        self.manifest_reads = 0
        self.bucket_listings = 0  # of the whole bucket (the others: one checkpoint's files)
        self.listing_fails: str | None = None  # the error every listing of the whole bucket raises
        self.before_commit: Callable[[str], None] | None = None

    def put_bytes_if_absent(self, key: str, data: bytes, *, crc32c: str) -> None:
        self.commits += 1
        if self.before_commit is not None:
            self.before_commit(key)
        super().put_bytes_if_absent(key, data, crc32c=crc32c)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        self.listings += 1
        self.bucket_listings += not prefix
        if not prefix and self.listing_fails is not None:
            raise StorageError(self.listing_fails)
        return super().list(prefix)

    def read_bytes(self, key: str) -> bytes:
        self.manifest_reads += key.endswith("/" + MANIFEST)
        return super().read_bytes(key)


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


def run_with(uploader: Uploader, steps: Callable[[], Awaitable[None]]) -> None:
    """Run ``uploader`` while ``steps()`` runs beside it on the same loop."""

    async def run() -> None:
        task = asyncio.create_task(uploader.run())
        try:
            await steps()
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    asyncio.run(run())


def run_uploader_until(uploader: Uploader, storage: CountingStorage, done: Callable[[], bool]) -> None:
    """Run ``uploader`` until ``done()`` and at least 30 listings (rescans) more, with a deadline."""

    async def steps() -> None:
        deadline = time.monotonic() + 20
        while not done():
            assert time.monotonic() < deadline, f"uploader stuck: {uploader.status()}"
            await asyncio.sleep(0.02)
        settled = storage.listings + 30
        while storage.listings < settled:
            assert time.monotonic() < deadline, f"uploader stuck: {uploader.status()}"
            await asyncio.sleep(0.02)

    run_with(uploader, steps)


def test_uploader_leaves_another_writers_checkpoint_of_the_same_step_alone(
    tmp_path: Path, storage: CountingStorage, caplog: pytest.LogCaptureFixture
) -> None:
    theirs = write_checkpoint(tmp_path / "other", 1, {"w.pt": b"theirs" * 100})
    upload_checkpoint(storage, theirs)
    root = tmp_path / "nvme"
    write_checkpoint(root, 1, {"w.pt": b"ours!!" * 100})  # the same step, other bytes
    write_checkpoint(root, 2, {"w.pt": b"two" * 100})
    storage.commits = 0
    uploader = Uploader(storage, root, scan_interval=0.02, bucket_scan_interval=0.02)  # a listing every rescan
    run_uploader_until(uploader, storage, lambda: "step-000000002" in uploader.committed)
    assert uploader.conflicts == {"step-000000001"}
    assert storage.commits == 1  # step 2 only
    assert (storage.root / "step-000000001" / MANIFEST).read_bytes() == (theirs / MANIFEST).read_bytes()
    assert verify_remote(storage, "step-000000001") == []
    assert caplog.text.count("not committing step-000000001") == 1
    shutil.rmtree(root / "step-000000001")  # local retention, in time: the name is not kept for months
    asyncio.run(uploader.rescan())
    assert uploader.conflicts == set()


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
    uploader = Uploader(storage, root, scan_interval=0.02, bucket_scan_interval=0.02)  # a listing every rescan
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
        await asyncio.gather(*uploader._ahead.tasks[ours.name])

    asyncio.run(run())
    assert sorted(p.name for p in (storage.root / "step-000000001").iterdir()) == [MANIFEST, "w.pt"]
    assert verify_remote(storage, "step-000000001") == []


async def rescans(uploader: Uploader, count: int, done: Callable[[], bool] = lambda: True) -> None:
    """Wait until the running ``uploader`` rescanned its root ``count`` times more and ``done()``."""
    deadline = time.monotonic() + 20
    target = uploader.rescans + count
    while uploader.rescans < target or not done():
        assert time.monotonic() < deadline, f"uploader stuck: {uploader.status()}"
        await asyncio.sleep(0.02)


def test_an_idle_uploader_lists_the_bucket_only_when_due_or_when_the_root_holds_something_new(
    tmp_path: Path, storage: CountingStorage
) -> None:
    """Every rescan listed the bucket and read every manifest in it: 43,200 LISTs and three times as
    many GETs a day per node, billed, with nothing to upload. A listing is needed at start, for a
    checkpoint new on disk, and now and then for other writers' changes."""
    root = tmp_path / "nvme"
    for step in (1, 2, 3):
        upload_checkpoint(storage, write_checkpoint(root, step, {"w.pt": bytes([step]) * 1000}))
    storage.bucket_listings = storage.manifest_reads = 0
    uploader = Uploader(storage, root, scan_interval=0.02, bucket_scan_interval=3600)

    async def steps() -> None:
        await rescans(uploader, 50)
        assert uploader.committed == {"step-000000001", "step-000000002", "step-000000003"}
        assert (storage.bucket_listings, storage.manifest_reads) == (1, 3), "one listing at start, each manifest once"
        # A complete checkpoint appears on disk with no word from a trainer (a hook without a daemon,
        # a restart in between): the next rescan looks it up in the bucket and uploads it.
        write_checkpoint(root, 4, {"w.pt": b"four" * 250})
        await rescans(uploader, 20, done=lambda: "step-000000004" in uploader.committed)
        listed = storage.bucket_listings
        assert listed <= 3, "the lookup of the new checkpoint, and the bucket retention after its commit"
        await rescans(uploader, 50)
        assert storage.bucket_listings == listed, "none while idle"

    run_with(uploader, steps)
    assert storage.manifest_reads == 4, "only the new checkpoint's manifest is read (by the retention)"
    assert verify_remote(storage, "step-000000004") == []


def test_a_due_listing_reads_only_the_manifests_that_changed(tmp_path: Path, storage: CountingStorage) -> None:
    root = tmp_path / "nvme"
    for step in (1, 2):
        upload_checkpoint(storage, write_checkpoint(root, step, {"w.pt": bytes([step]) * 1000}))
    storage.bucket_listings = storage.manifest_reads = 0
    uploader = Uploader(storage, root, scan_interval=0.02, bucket_scan_interval=0.02)
    run_with(uploader, lambda: rescans(uploader, 20))
    assert storage.bucket_listings >= 10 and storage.manifest_reads == 2

    # Another writer replaces step 2 (deleted, then committed anew, other bytes): its manifest lists
    # differently, so it is read again; a checkpoint gone from the bucket is no longer remembered.
    known = KnownManifests()
    assert [i.name for i in list_remote(storage, known=known)] == ["step-000000001", "step-000000002"]
    list_remote(storage, known=known)
    assert known.reads == 2
    other = FileStorage(storage.url)
    other.delete(o.key for o in other.list("step-000000002/"))
    upload_checkpoint(other, write_checkpoint(tmp_path / "other", 2, {"w.pt": b"theirs" * 100}))
    replaced = list_remote(storage, known=known)[1]
    assert known.reads == 3 and replaced.manifest is not None and replaced.manifest.files["w.pt"].size == 600
    other.delete(o.key for o in other.list("step-000000001/"))
    list_remote(storage, known=known)
    upload_checkpoint(other, write_checkpoint(tmp_path / "again", 1, {"w.pt": b"back" * 100}))
    list_remote(storage, known=known)
    assert known.reads == 4, "step 1, gone and back with another manifest, is read again"


def test_a_bucket_that_keeps_failing_its_listings_is_logged_once_then_once_when_it_answers(
    tmp_path: Path, storage: CountingStorage, caplog: pytest.LogCaptureFixture
) -> None:
    """A new checkpoint on disk makes every rescan list the bucket until the listing succeeds: with
    the bucket down for a weekend, that was one warning every 2 s."""
    root = tmp_path / "nvme"
    write_checkpoint(root, 1, {"w.pt": b"one" * 100})
    storage.listing_fails = "503 Slow Down"
    uploader = Uploader(storage, root, scan_interval=0.02, bucket_scan_interval=3600)

    async def steps() -> None:
        # A rescan is counted as it begins: once the 51st has begun, the 50th (and its listing) is done.
        await rescans(uploader, 51)
        assert storage.bucket_listings >= 50, "the new checkpoint is looked up at every rescan"
        storage.listing_fails = None
        await rescans(uploader, 5, done=lambda: "step-000000001" in uploader.committed)

    with caplog.at_level(logging.DEBUG, logger="spotguard.uploader"):
        run_with(uploader, steps)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "cannot list" in r.getMessage()]
    assert len(warnings) == 1 and "503 Slow Down" in warnings[0].getMessage()
    assert caplog.text.count("answers listings again") == 1


class HeldListingStorage(CountingStorage):
    """A listing of the whole bucket taken when ``hold`` is armed is answered only once ``release``
    is set: a listing that was slow while a commit went in."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.hold = threading.Event()
        self.held = threading.Event()
        self.release = threading.Event()

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        items = list(super().list(prefix))  # what the bucket holds now
        if not prefix and self.hold.is_set():
            self.hold.clear()
            self.held.set()
            assert self.release.wait(20), "the test never released the listing"
        return iter(items)


def test_a_listing_taken_before_a_commit_does_not_make_the_uploader_send_that_checkpoint_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The daemon's shutdown lists the bucket while the trainer's urgent checkpoint uploads. The listing,
    taken before the commit and answered after it, replaced what the uploader knew was committed: the
    checkpoint was queued and sent again (its files probed, its manifest found there) at every
    shutdown that followed a save, and at every due listing that overlapped a commit."""
    (tmp_path / "bucket").mkdir()
    storage = HeldListingStorage((tmp_path / "bucket").as_uri())
    root = tmp_path / "nvme"
    root.mkdir()
    uploader = Uploader(storage, root, scan_interval=3600, bucket_scan_interval=3600)

    async def steps() -> None:
        await rescans(uploader, 1, done=uploader.idle.is_set)
        storage.hold.set()
        step_dir = write_checkpoint(root, 1, {"w.pt": b"one" * 1000})
        drain = asyncio.create_task(uploader.drain(timeout=20))  # as the daemon's shutdown does
        assert await asyncio.to_thread(storage.held.wait, 20), "the shutdown's listing never began"
        uploader.submit(step_dir, urgent=True)  # the trainer's save, answered meanwhile
        await rescans(uploader, 0, done=lambda: "step-000000001" in uploader.committed)
        storage.release.set()
        assert await drain

    with caplog.at_level(logging.INFO, logger="spotguard.uploader"):
        run_with(uploader, steps)
    assert caplog.text.count("uploading step-000000001") == 1, caplog.text
    assert storage.commits == 1
    assert "step-000000001" in uploader.committed


def test_a_commit_while_the_bucket_is_listed_stays_the_newest_checkpoint(tmp_path: Path) -> None:
    """Each listing says what the bucket holds now; one that began before a commit may not show it,
    and must not make the newest checkpoint an older one (or none) until the next."""
    from datetime import datetime

    from spotguard.daemon.events import EventBus, UploadCommitted
    from spotguard.daemon.uploader import BucketListings
    from spotguard.manifest import Manifest

    entered, gate = threading.Event(), threading.Event()

    class SlowListing(FileStorage):
        def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
            entered.set()
            gate.wait(10)
            return super().list(prefix)

    (tmp_path / "bucket").mkdir()
    storage = SlowListing((tmp_path / "bucket").as_uri())
    manifest = Manifest(step=5, reason="periodic", world_size=1, files={})

    async def scenario() -> float | None:
        bus = EventBus()
        listings = BucketListings(60.0, bus)
        listing = asyncio.create_task(listings.complete(storage))
        await asyncio.to_thread(entered.wait, 10)
        await bus.emit_async(UploadCommitted("step-000000005", manifest, 1.0))
        gate.set()
        assert await listing == {}  # the listing began before the commit
        return listings.newest_created()

    assert asyncio.run(scenario()) == datetime.fromisoformat(manifest.created).timestamp()
