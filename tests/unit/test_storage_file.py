from __future__ import annotations

import os
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from spotguard.crc32c import crc32c_of_bytes
from spotguard.manifest import MANIFEST, load_manifest
from spotguard.safefile import TMP_MARK
from spotguard.storage.base import Progress, StorageError, TransientStorageError, retry
from spotguard.storage.checkpoints import (
    CheckpointUnreadable,
    UploadCancelled,
    list_remote,
    prune_remote,
    restore,
    upload_checkpoint,
    upload_files,
    verify_remote,
)
from spotguard.storage.file import FileStorage
from tests.checkpoints import write_checkpoint


@pytest.fixture
def storage(tmp_path: Path) -> FileStorage:
    (tmp_path / "bucket").mkdir()
    return FileStorage((tmp_path / "bucket").as_uri())


class FailingStorage(FileStorage):
    """Fails the upload of one named file, like a bucket that keeps answering 403."""

    def __init__(self, url: str, fail_on: str) -> None:
        super().__init__(url)
        self.fail_on = fail_on
        self.puts: list[str] = []

    def put_file(self, local: Path, key: str, *, crc32c: str, progress: Progress | None = None) -> None:
        self.puts.append(key)
        if key.endswith(self.fail_on):
            raise StorageError(f"injected failure for {key}")
        super().put_file(local, key, crc32c=crc32c, progress=progress)

    def put_bytes_if_absent(self, key: str, data: bytes, *, crc32c: str) -> None:
        self.puts.append(key)
        if key.endswith(self.fail_on):
            raise StorageError(f"injected failure for {key}")
        super().put_bytes_if_absent(key, data, crc32c=crc32c)


def test_upload_then_list_shows_complete_and_restore_is_identical(tmp_path: Path, storage: FileStorage) -> None:
    files = {"a.pt": b"a" * 1000, "b.pt": bytes(range(256)) * 64}
    write_checkpoint(tmp_path / "local", 7, files)
    upload_checkpoint(storage, tmp_path / "local" / "step-000000007")
    [info] = list_remote(storage)
    assert (info.name, info.status, info.bytes) == ("step-000000007", "complete", sum(map(len, files.values())))
    assert verify_remote(storage, info.name) == []
    target = restore(storage, tmp_path / "restored")
    assert target is not None
    assert {p.name: p.read_bytes() for p in target.iterdir() if p.name != MANIFEST} == files


def test_manifest_is_uploaded_last_and_not_at_all_on_failure(tmp_path: Path) -> None:
    (tmp_path / "bucket").mkdir()
    failing = FailingStorage((tmp_path / "bucket").as_uri(), fail_on="b.pt")
    write_checkpoint(tmp_path / "local", 1, {"a.pt": b"1", "b.pt": b"2", "c.pt": b"3"})
    with pytest.raises(StorageError):
        upload_checkpoint(failing, tmp_path / "local" / "step-000000001", concurrency=1)
    assert not (tmp_path / "bucket" / "step-000000001" / MANIFEST).exists()
    assert [i.status for i in list_remote(failing)] == ["incomplete"]
    failing.fail_on = "nothing"
    upload_checkpoint(failing, tmp_path / "local" / "step-000000001")
    assert failing.puts[-1].endswith(MANIFEST)
    assert [i.status for i in list_remote(failing)] == ["complete"]


def test_upload_resumes_without_resending_finished_files(tmp_path: Path) -> None:
    (tmp_path / "bucket").mkdir()
    failing = FailingStorage((tmp_path / "bucket").as_uri(), fail_on="c.pt")
    write_checkpoint(tmp_path / "local", 1, {"a.pt": b"1" * 100, "b.pt": b"2" * 50, "c.pt": b"3"})
    with pytest.raises(StorageError):
        upload_checkpoint(failing, tmp_path / "local" / "step-000000001", concurrency=1)
    failing.fail_on = "nothing"
    failing.puts.clear()
    upload_checkpoint(failing, tmp_path / "local" / "step-000000001")
    assert sorted(failing.puts) == ["step-000000001/c.pt", f"step-000000001/{MANIFEST}"]


def test_cancelled_upload_does_not_commit(tmp_path: Path, storage: FileStorage) -> None:
    write_checkpoint(tmp_path / "local", 1, {"a.pt": b"1"})
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(UploadCancelled):
        upload_checkpoint(storage, tmp_path / "local" / "step-000000001", cancel=cancel)
    assert not any(i.status == "complete" for i in list_remote(storage))


def test_restore_falls_back_when_newest_fails_verification(tmp_path: Path, storage: FileStorage) -> None:
    for step in (1, 2):
        write_checkpoint(tmp_path / "local", step, {"w.pt": bytes([step]) * 4096})
        upload_checkpoint(storage, tmp_path / "local" / f"step-00000000{step}")
    remote = storage.root / "step-000000002" / "w.pt"
    data = bytearray(remote.read_bytes())
    data[10] ^= 0x40  # same size, different bytes: only the checksum notices
    remote.write_bytes(bytes(data))
    assert verify_remote(storage, "step-000000002") != []
    messages: list[str] = []
    target = restore(storage, tmp_path / "restored", log=messages.append)
    assert target is not None and target.name == "step-000000001"
    assert (target / "w.pt").read_bytes() == bytes([1]) * 4096
    assert not (tmp_path / "restored" / "step-000000002").exists()
    assert "step-000000002" in messages[0]


def test_restore_onto_a_full_disk_raises_what_to_fix_and_tries_no_older_checkpoint(
    tmp_path: Path, storage: FileStorage, tmpfs: Callable[[int], Path]
) -> None:
    """Step 2 does not fit where it is restored; step 1 would. A full disk says nothing bad of step 2:
    going back to step 1 would give up a step without a word, so the restore raises instead, saying
    where to make room, and leaves nothing half-written."""
    write_checkpoint(tmp_path / "local", 1, {"w.pt": b"1" * 4096})
    write_checkpoint(tmp_path / "local", 2, {"w.pt": b"2" * (1 << 20)})
    for step in (1, 2):
        upload_checkpoint(storage, tmp_path / "local" / f"step-00000000{step}")
    dest = tmpfs(256 * 1024)
    messages: list[str] = []
    with pytest.raises(CheckpointUnreadable, match="step-000000002 could not be restored") as caught:
        restore(storage, dest, log=messages.append)
    assert f"make room on {dest}" in str(caught.value) and "No space left" in str(caught.value)
    assert messages == []  # no "trying the previous checkpoint"
    assert list(dest.iterdir()) == []


def test_restore_of_empty_bucket_is_none(tmp_path: Path, storage: FileStorage) -> None:
    assert restore(storage, tmp_path / "restored") is None


def test_prune_remote_keeps_newest_and_drops_leftovers_past_the_grace(tmp_path: Path, storage: FileStorage) -> None:
    for step in (1, 2, 3, 4):
        write_checkpoint(tmp_path / "local", step, {"w.pt": bytes([step])})
        upload_checkpoint(storage, tmp_path / "local" / f"step-00000000{step}")
    (storage.root / "step-000000002" / MANIFEST).unlink()  # an upload that never committed
    newer = write_checkpoint(tmp_path / "local", 5, {"w.pt": b"5", "v.pt": b"55"})
    upload_files(storage, newer, load_manifest(newer).files)  # a VM that died before the manifest went up
    assert prune_remote(storage, keep=2) == ["step-000000001"]  # the leftovers are too young to tell
    assert [i.status for i in list_remote(storage)] == ["incomplete", "complete", "complete", "incomplete"]

    later = datetime.now(UTC) + timedelta(hours=1, seconds=1)
    removed = prune_remote(storage, keep=2, now=later)
    assert sorted(removed) == ["step-000000002", "step-000000005"]
    assert [(i.step, i.status) for i in list_remote(storage)] == [(3, "complete"), (4, "complete")]
    assert not (storage.root / "step-000000005").exists()
    assert prune_remote(storage, keep=1, protected=frozenset({"step-000000003"}), now=later) == []
    assert prune_remote(storage, keep=1, grace=timedelta(0)) == ["step-000000003"]
    assert [i.step for i in list_remote(storage)] == [4]  # the newest complete stays, whatever keep says


def killed_copy(storage: FileStorage, key: str, *, age: timedelta = timedelta(0)) -> Path:
    """The temporary file a copy into ``key`` leaves when its daemon is killed mid-copy, last
    written ``age`` ago."""
    target = storage.root / key
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}{TMP_MARK}19545")
    tmp.write_bytes(b"x" * 4096)
    when = (datetime.now(UTC) - age).timestamp()
    os.utime(tmp, (when, when))
    return tmp


def test_prune_removes_a_killed_copys_temporary_file_with_its_checkpoint_or_once_it_is_stale(
    tmp_path: Path, storage: FileStorage
) -> None:
    """A daemon killed mid-copy left step-000000001/.model.pt.tmp-19545 in the bucket for good:
    listings skip temporary files, so neither retention nor ``spotguard prune`` ever saw it."""
    for step in (1, 2, 3):
        write_checkpoint(tmp_path / "local", step, {"model.pt": bytes([step])})
        upload_checkpoint(storage, tmp_path / "local" / f"step-00000000{step}")
    in_pruned = killed_copy(storage, "step-000000001/model.pt")  # young: it goes with its checkpoint
    stale_in_kept = killed_copy(storage, "step-000000003/optim.pt", age=timedelta(hours=2))
    fresh_in_kept = killed_copy(storage, "step-000000003/extra.pt")  # another node's copy, under way
    stale_alone = killed_copy(storage, "step-000000009/model.pt", age=timedelta(hours=2))
    fresh_alone = killed_copy(storage, "step-000000010/model.pt")
    # An incomplete checkpoint whose listed file is old, with a copy into it still being written: not stale.
    (storage.root / "step-000000008").mkdir()
    (storage.root / "step-000000008" / "w.pt").write_bytes(b"8")
    old = (datetime.now(UTC) - timedelta(hours=2)).timestamp()
    os.utime(storage.root / "step-000000008" / "w.pt", (old, old))
    copying = killed_copy(storage, "step-000000008/big.pt")

    assert prune_remote(storage, keep=2) == ["step-000000001"]
    assert not in_pruned.exists() and not (storage.root / "step-000000001").exists()
    assert not stale_in_kept.exists() and fresh_in_kept.exists()
    assert not stale_alone.exists() and not (storage.root / "step-000000009").exists()
    assert fresh_alone.exists() and copying.exists()
    assert [(i.step, i.status) for i in list_remote(storage)] == [(2, "complete"), (3, "complete"), (8, "incomplete")]
    assert sorted(t.key for t in storage.temporaries()) == [
        "step-000000003/.extra.pt.tmp-19545", "step-000000008/.big.pt.tmp-19545", "step-000000010/.model.pt.tmp-19545"
    ]  # fmt: skip


def test_retention_walks_a_file_bucket_once(
    tmp_path: Path, storage: FileStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention reads a file:// bucket's objects and its copies' temporary files in one walk of the
    tree (two before: each a walk of every directory, on what may be a network filesystem)."""
    for step in (1, 2):
        write_checkpoint(tmp_path / "local", step, {"model.pt": bytes([step]), "sub/optim.pt": b"o"})
        upload_checkpoint(storage, tmp_path / "local" / f"step-00000000{step}")
    copy = killed_copy(storage, "step-000000002/extra.pt")
    objects, temporaries = storage.listing()
    assert sorted(o.key for o in objects) == sorted(o.key for o in storage.list())
    assert (
        [t.key for t in temporaries]
        == [t.key for t in storage.temporaries()]
        == [copy.relative_to(storage.root).as_posix()]
    )
    walks = []
    walk = os.walk
    monkeypatch.setattr(os, "walk", lambda top, *a, **k: walks.append(top) or walk(top, *a, **k))
    assert prune_remote(storage, keep=1) == ["step-000000001"]
    assert walks == [storage.root]


def test_put_file_rejects_wrong_checksum(tmp_path: Path, storage: FileStorage) -> None:
    local = tmp_path / "f"
    local.write_bytes(b"payload")
    with pytest.raises(StorageError, match="crc32c"):
        storage.put_file(local, "x/f", crc32c=crc32c_of_bytes(b"other"))
    assert storage.stat("x/f") is None


def test_keys_cannot_escape_the_bucket(storage: FileStorage) -> None:
    with pytest.raises(StorageError, match="escapes"):
        storage.read_bytes("../../etc/passwd")


def test_retry_retries_transient_and_stops_at_fatal() -> None:
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise TransientStorageError("503")
        return "done"

    transient = lambda exc: isinstance(exc, TransientStorageError)  # noqa: E731
    assert retry(flaky, is_transient=transient, base_delay=0.001, sleep=lambda s: None) == "done"
    assert len(calls) == 3

    def fatal() -> None:
        calls.append(1)
        raise StorageError("403")

    calls.clear()
    with pytest.raises(StorageError, match="403"):
        retry(fatal, is_transient=transient, sleep=lambda s: None)
    assert len(calls) == 1


def test_retry_gives_up_at_the_deadline() -> None:
    now = [100.0]

    def always_503() -> None:
        raise TransientStorageError("503")

    def fake_sleep(seconds: float) -> None:
        now[0] += seconds

    with pytest.raises(StorageError, match="deadline"):
        retry(
            always_503,
            is_transient=lambda e: True,
            deadline=100.5,
            attempts=1000,
            base_delay=0.2,
            clock=lambda: now[0],
            sleep=fake_sleep,
        )
    assert now[0] <= 100.5


def test_retry_lets_cancellation_through() -> None:
    def cancelled() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        retry(cancelled, is_transient=lambda e: True, sleep=lambda s: None)


def test_a_listing_walks_from_its_prefix_s_folder_and_never_through_a_link(
    tmp_path: Path, storage: FileStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The peer registry's and a checkpoint's listings walk their own folder, not the whole bucket;
    a link on the way (to a folder outside the bucket) is not followed, as a walk from the root never
    followed one."""
    for key in ("step-000000001/model.pt", "step-000000001/sub/optim.pt", ".spotguard-peers/a-1.json"):
        (storage.root / key).parent.mkdir(parents=True, exist_ok=True)
        (storage.root / key).write_bytes(b"x")
    outside = tmp_path / "outside"
    (outside / "deep").mkdir(parents=True)
    (outside / "deep" / "secret").write_bytes(b"s")
    (storage.root / "linked").symlink_to(outside, target_is_directory=True)
    walks: list[str] = []
    walk = os.walk
    monkeypatch.setattr(os, "walk", lambda top, *a, **k: walks.append(str(top)) or walk(top, *a, **k))

    def keys(prefix: str) -> list[str]:
        return sorted(info.key for info in storage.list(prefix))

    assert keys(".spotguard-peers/") == [".spotguard-peers/a-1.json"]
    assert keys("step-000000001/sub/") == ["step-000000001/sub/optim.pt"]
    assert keys("step-000000002/") == []  # not there: nothing, without a walk of the bucket
    assert walks == [str(storage.root / p) for p in (".spotguard-peers", "step-000000001/sub", "step-000000002")]
    walks.clear()
    assert keys("linked/deep/") == [] and keys("step-000000001/../linked/") == []
    assert walks == [str(storage.root)] * 2
    assert keys("step-") == ["step-000000001/model.pt", "step-000000001/sub/optim.pt"]
