"""Streamed uploads (``begin_stream``) on the directory backend: parts land as their bytes are
announced, in any order; only a finish whose CRC32C matches makes the object visible; an abort or a
failed finish leaves nothing behind, temporary files included."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotguard.crc32c import crc32c_of_bytes
from spotguard.storage.base import StorageError
from spotguard.storage.file import _COPY_CHUNK, FileStorage
from spotguard.storage.s3_multipart import MIN_PART, S3Multipart

SIZE = 3 * _COPY_CHUNK + 12345


@pytest.fixture
def store(tmp_path: Path) -> Iterator[FileStorage]:
    (tmp_path / "bucket").mkdir()
    storage = FileStorage((tmp_path / "bucket").as_uri())
    yield storage
    storage.close()


@pytest.fixture
def source(tmp_path: Path) -> Iterator[tuple[int, bytes]]:
    data = random.Random(3).randbytes(SIZE)
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    yield fd, data
    os.close(fd)


def leftovers(store: FileStorage) -> list[str]:
    return sorted(p.name for p in store.root.rglob("*") if p.is_file())


def test_ranges_in_any_order_make_the_file(store: FileStorage, source: tuple[int, bytes]) -> None:
    fd, data = source
    sent: list[int] = []
    stream = store.begin_stream("step-000000001/model.bin", SIZE, fd, progress=sent.append)
    chunks = [(off, min(1 << 20, SIZE - off)) for off in range(0, SIZE, 1 << 20)]
    random.Random(4).shuffle(chunks)
    for offset, length in chunks[: len(chunks) // 2]:
        stream.add(offset, length)
    stream.finish(crc32c_of_bytes(data))  # what was never announced goes at the finish
    assert (store.root / "step-000000001" / "model.bin").read_bytes() == data
    assert sum(sent) == SIZE
    assert leftovers(store) == ["model.bin"]


def test_a_wrong_crc32c_completes_nothing(store: FileStorage, source: tuple[int, bytes]) -> None:
    fd, data = source
    stream = store.begin_stream("step-000000001/model.bin", SIZE, fd)
    stream.add(0, SIZE)
    with pytest.raises(StorageError, match="CRC32C"):
        stream.finish(crc32c_of_bytes(data + b"x"))
    assert leftovers(store) == []


def test_abort_leaves_nothing(store: FileStorage, source: tuple[int, bytes]) -> None:
    fd, _ = source
    stream = store.begin_stream("step-000000001/model.bin", SIZE, fd)
    stream.add(0, 2 * _COPY_CHUNK)
    stream.abort()
    stream.abort()  # idempotent
    stream.add(2 * _COPY_CHUNK, 10)  # ignored once aborted
    assert leftovers(store) == []
    with pytest.raises(StorageError, match="aborted"):
        stream.finish("00000000")


def test_overlapping_or_outside_ranges_are_refused(store: FileStorage, source: tuple[int, bytes]) -> None:
    fd, _ = source
    stream = store.begin_stream("step-000000001/model.bin", SIZE, fd)
    stream.add(100, 50)
    for offset, length in [(120, 10), (90, 20), (140, 100), (SIZE - 5, 10), (-1, 2)]:
        with pytest.raises(ValueError):
            stream.add(offset, length)
    stream.add(150, 10)  # adjacent is fine
    stream.abort()


MiB = 1 << 20


@pytest.mark.parametrize("size", [0, 3 * MiB, 5 * MiB, 11 * MiB, 64 * MiB + 7, 200 * MiB, 10 << 30, 5 << 40])
def test_a_streamed_plan_covers_every_byte_once_and_shrinks_toward_the_end(size: int) -> None:
    plan = S3Multipart(None, 16 * MiB, None).stream_plan(size, streams=16)  # type: ignore[arg-type]
    assert [number for number, _, _ in plan] == list(range(1, len(plan) + 1))
    assert [offset for _, offset, _ in plan] == [sum(length for _, _, length in plan[:i]) for i in range(len(plan))]
    assert sum(length for _, _, length in plan) == size
    assert all(length >= MIN_PART for _, _, length in plan[:-1])  # S3's floor but for the last
    assert len(plan) <= 10_000  # S3's limit, also for a 5 TiB file
    if size > 16 * MiB:
        assert plan[-1][2] == MIN_PART  # the tail is one small part
        # Each part that ends d bytes before the end is at most the minimum + d / streams (rounded up
        # to a MiB; the first tapered part may take what is left over before it).
        for _, offset, length in plan[-8:-1]:
            after = size - offset - length
            assert length <= MIN_PART + after // 16 + MiB
