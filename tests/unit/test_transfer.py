"""The ranged download engine on a file:// store, with faults injected by subclassing the real backend."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from spotguard.crc32c import crc32c_of_bytes
from spotguard.storage.base import Sink, StorageError, TransientStorageError
from spotguard.storage.file import FileStorage
from spotguard.storage.transfer import Download, MiB, download_files, range_size
from tests.checkpoints import write_checkpoint


def put(root: Path, key: str, data: bytes) -> Download:
    (root / key).parent.mkdir(parents=True, exist_ok=True)
    (root / key).write_bytes(data)
    return Download(key, len(data), crc32c_of_bytes(data))


class RecordingStorage(FileStorage):
    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.ranges: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()

    def read_range(self, key: str, offset: int, length: int, sink: Sink) -> None:
        with self._lock:
            self.ranges.append((key, offset, length))
        super().read_range(key, offset, length, sink)


class FlakyStorage(RecordingStorage):
    """The first read of every range sends half its bytes, then the connection 'resets'."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.failed: set[tuple[str, int]] = set()

    def read_range(self, key: str, offset: int, length: int, sink: Sink) -> None:
        with self._lock:
            first = (key, offset) not in self.failed
            self.failed.add((key, offset))
        if first and length > 1:
            half = self._path(key).read_bytes()[offset : offset + length // 2]
            sink.write(half)
            raise TransientStorageError("connection reset by peer (injected)")
        super().read_range(key, offset, length, sink)


class CorruptingStorage(RecordingStorage):
    """Flips one bit in the bytes of one key, as a bad link or disk would."""

    def __init__(self, url: str, bad_key: str) -> None:
        super().__init__(url)
        self.bad_key = bad_key

    def read_range(self, key: str, offset: int, length: int, sink: Sink) -> None:
        if key != self.bad_key or offset != 0:
            return super().read_range(key, offset, length, sink)
        data = bytearray(self._path(key).read_bytes()[offset : offset + length])
        data[len(data) // 2] ^= 0x01
        sink.write(bytes(data))
        return None


class ForbiddenStorage(RecordingStorage):
    def read_range(self, key: str, offset: int, length: int, sink: Sink) -> None:
        raise StorageError("403 AccessDenied (injected)")


@pytest.fixture
def bucket(tmp_path: Path) -> Path:
    (tmp_path / "bucket").mkdir()
    return tmp_path / "bucket"


def sample(bucket: Path) -> dict[str, bytes]:
    rng = random.Random(5)
    files = {"step/a": rng.randbytes(5 * MiB + 17), "step/b": rng.randbytes(3 * MiB), "step/empty": b""}
    files["step/sub/c"] = rng.randbytes(1234)
    for key, data in files.items():
        put(bucket, key, data)
    return files


def items_to(files: dict[str, bytes], dest: Path) -> list[Download]:
    return [Download(key, len(data), crc32c_of_bytes(data), dest / key) for key, data in files.items()]


def leftovers(dest: Path) -> list[str]:
    return [p.name for p in dest.rglob("*") if p.name.endswith(".part")]


def test_range_size_aims_at_one_range_per_stream_within_bounds() -> None:
    assert range_size(8 * 128 * MiB, 16) == 64 * MiB  # eight 128 MiB files: two ranges each
    assert range_size(1024 * MiB, 16) == 64 * MiB
    assert range_size(10 * MiB, 16) == 16 * MiB  # never smaller than min_range
    assert range_size(160 * 1024 * MiB, 16) == 256 * MiB  # never larger than max_range
    assert range_size(100 * MiB + 1, 4, min_range=MiB) == 26 * MiB  # rounded up to whole MiB


def test_download_files_writes_identical_bytes_through_shared_ranges(bucket: Path, tmp_path: Path) -> None:
    files = sample(bucket)
    storage = RecordingStorage(bucket.as_uri())
    seen: list[int] = []
    problems = download_files(
        storage, items_to(files, tmp_path / "out"), streams=4, min_range=MiB, max_range=2 * MiB, progress=seen.append
    )
    assert problems == []
    for key, data in files.items():
        assert (tmp_path / "out" / key).read_bytes() == data
    assert sum(seen) == sum(map(len, files.values()))
    assert max(length for _, _, length in storage.ranges) == 2 * MiB
    assert len([r for r in storage.ranges if r[0] == "step/a"]) == 3  # 5 MiB + 17 bytes in 2 MiB ranges
    assert leftovers(tmp_path / "out") == []


def test_a_range_that_fails_half_way_is_restarted_and_the_bytes_are_still_exact(bucket: Path, tmp_path: Path) -> None:
    files = sample(bucket)
    storage = FlakyStorage(bucket.as_uri())
    problems = download_files(storage, items_to(files, tmp_path / "out"), streams=3, min_range=MiB, max_range=MiB)
    assert problems == []
    assert len(storage.failed) >= 9  # every range of every non-empty file failed once
    for key, data in files.items():
        assert (tmp_path / "out" / key).read_bytes() == data


def test_corrupted_bytes_are_a_problem_and_leave_no_file(bucket: Path, tmp_path: Path) -> None:
    files = sample(bucket)
    storage = CorruptingStorage(bucket.as_uri(), bad_key="step/b")
    problems = download_files(storage, items_to(files, tmp_path / "out"), streams=2, min_range=MiB)
    assert len(problems) == 1 and problems[0].startswith("step/b: crc32c ")
    assert not (tmp_path / "out" / "step" / "b").exists()
    assert (tmp_path / "out" / "step" / "a").read_bytes() == files["step/a"]
    assert leftovers(tmp_path / "out") == []


def test_a_missing_object_is_reported_and_the_others_still_arrive(bucket: Path, tmp_path: Path) -> None:
    files = sample(bucket)
    (bucket / "step" / "b").unlink()
    problems = download_files(FileStorage(bucket.as_uri()), items_to(files, tmp_path / "out"), streams=2)
    assert problems == ["step/b: missing"]
    assert (tmp_path / "out" / "step" / "a").read_bytes() == files["step/a"]
    assert leftovers(tmp_path / "out") == []


def test_a_fatal_error_raises_and_leaves_no_partial_files(bucket: Path, tmp_path: Path) -> None:
    files = sample(bucket)
    with pytest.raises(StorageError, match="AccessDenied"):
        download_files(ForbiddenStorage(bucket.as_uri()), items_to(files, tmp_path / "out"), streams=2)
    assert not any(p.is_file() for p in (tmp_path / "out").rglob("*"))


def test_check_only_downloads_write_nothing(bucket: Path, tmp_path: Path) -> None:
    files = sample(bucket)
    storage = CorruptingStorage(bucket.as_uri(), bad_key="step/a")
    items = [Download(key, len(data), crc32c_of_bytes(data)) for key, data in files.items()]
    problems = download_files(storage, items, streams=2, min_range=MiB)
    assert [p.split(":")[0] for p in problems] == ["step/a"]
    assert list(tmp_path.glob("**/*.part")) == []


def test_a_store_sending_more_than_asked_is_refused(bucket: Path, tmp_path: Path) -> None:
    class Chatty(FileStorage):
        def read_range(self, key: str, offset: int, length: int, sink: Sink) -> None:
            sink.write(b"x" * (length + 1))

    data = b"abc" * 1000
    item = put(bucket, "k", data)
    with pytest.raises(StorageError, match="more than"):
        download_files(Chatty(bucket.as_uri()), [item], attempts=2)


class FdCountingStorage(FileStorage):
    """Counts, while each range is read, the downloads' temporary files held open by this process."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.most_open = 0
        self._lock = threading.Lock()

    def read_range(self, key: str, offset: int, length: int, sink: Sink) -> None:
        # The listing is not atomic: a number listed as another thread's source file may be closed and
        # reused for a new .part file before its readlink, and count once too often. Of two looks in a
        # row, the smaller cannot be inflated that way unless the same race hits both.
        held = min(self._parts_open(), self._parts_open())
        with self._lock:
            self.most_open = max(self.most_open, held)
        super().read_range(key, offset, length, sink)

    @staticmethod
    def _parts_open() -> int:
        held = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # a descriptor closed since the listing
                held += os.readlink(f"/proc/self/fd/{fd}").endswith(".part")
        return held


def test_a_300_file_download_keeps_at_most_one_open_file_per_stream(bucket: Path, tmp_path: Path) -> None:
    rng = random.Random(8)
    files = {f"step/shard-{i:03d}": rng.randbytes(rng.randrange(1, 5000)) for i in range(300)}
    files["step/big"] = rng.randbytes(3 * MiB + 5)  # several ranges of one file in flight at once
    for key, data in files.items():
        put(bucket, key, data)
    storage = FdCountingStorage(bucket.as_uri())
    problems = download_files(storage, items_to(files, tmp_path / "out"), streams=8, min_range=MiB, max_range=MiB)
    assert problems == []
    assert all((tmp_path / "out" / key).read_bytes() == data for key, data in files.items())
    assert 1 <= storage.most_open <= 8 + 1
    assert leftovers(tmp_path / "out") == []


_RESTORE_UNDER_A_LOW_FD_LIMIT = """
import resource, sys
from pathlib import Path
from spotguard.storage.checkpoints import restore
from spotguard.storage.file import FileStorage
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
print(restore(FileStorage(sys.argv[1]), Path(sys.argv[2]), streams=16))
"""


def test_a_300_file_restore_succeeds_with_64_file_descriptors(tmp_path: Path) -> None:
    rng = random.Random(9)
    files = {f"shard-{i:03d}.distcp": rng.randbytes(rng.randrange(1, 3000)) for i in range(300)}
    step_dir = write_checkpoint(tmp_path / "bucket", 7, files)
    result = subprocess.run(
        [sys.executable, "-c", _RESTORE_UNDER_A_LOW_FD_LIMIT, (tmp_path / "bucket").as_uri(), str(tmp_path / "out")],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == str(tmp_path / "out" / step_dir.name)
    assert all((tmp_path / "out" / step_dir.name / name).read_bytes() == data for name, data in files.items())
