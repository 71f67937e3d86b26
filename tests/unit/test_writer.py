"""The parallel state-file writer: standard torch.save files, the right CRC32C, ranges, cancel, staging."""

from __future__ import annotations

import io
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from spotguard import Guard
from spotguard.crc32c import crc32c_of_file
from spotguard.localstore import CheckpointWriter
from spotguard.safefile import SaveCancelled
from spotguard.trainer.writer import ParallelWriter, StagingBuffers, _pickle_payload

SMALL_CHUNK = 4096  # so that even small test tensors are split into several pieces


def optimizer_state() -> dict[str, Any]:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return opt.state_dict()


def payloads() -> dict[str, Any]:
    base = torch.randn(5000)
    grid = torch.arange(64, dtype=torch.int64).reshape(8, 8)
    return {
        "nested": {"a": {"b": [torch.ones(3), (torch.zeros(2, 2), {"c": torch.tensor(7)})]}, "n": 3, "s": "x"},
        "shared": {"whole": base, "view": base[100:300], "strided": base[::7], "again": base},
        "layout": {"transposed": grid.t(), "column": grid[:, 3], "empty": torch.empty(0), "empty2": torch.zeros(0, 5)},
        "dtypes": {
            "bf16": torch.randn(3000).to(torch.bfloat16),
            "f16": torch.randn(100).half(),
            "i8": torch.arange(-50, 50, dtype=torch.int8),
            "u8": torch.arange(200, dtype=torch.uint8),
            "i32": torch.arange(1000, dtype=torch.int32),
            "bool": torch.tensor([True, False, True]),
            "f64": torch.randn(40, dtype=torch.float64),
        },
        "optimizer": optimizer_state(),
        "plain": {"epoch": 4, "names": ["a", "b"], "pair": (1, 2.5)},
        "big": torch.randn(300_000),  # 1.2 MB: hundreds of pieces at SMALL_CHUNK
    }


def same(left: Any, right: Any) -> None:
    """Structure, types, dtypes, shapes, strides and bytes all equal."""
    assert type(left) is type(right)
    if isinstance(left, torch.Tensor):
        assert left.dtype == right.dtype and left.shape == right.shape and left.stride() == right.stride()
        assert left.storage_offset() == right.storage_offset()
        assert torch.equal(left, right)
    elif isinstance(left, dict):
        assert list(left) == list(right)
        for key in left:
            same(left[key], right[key])
    elif isinstance(left, list | tuple):
        assert len(left) == len(right)
        for a, b in zip(left, right, strict=True):
            same(a, b)
    else:
        assert left == right


def write(
    root: Path, entries: dict[str, Any], threads: int = 4, chunk: int = SMALL_CHUNK, **kwargs: Any
) -> tuple[CheckpointWriter, list[str]]:
    writer = CheckpointWriter(root, 1, reason="urgent", cancel=kwargs.pop("cancel", None))
    writer.prepare()
    names = ParallelWriter(threads, chunk_bytes=chunk, staging=kwargs.pop("staging", None)).write(
        writer, entries, **kwargs
    )
    return writer, names


@pytest.mark.parametrize("threads", [1, 4])
def test_files_load_exactly_as_torch_save_wrote_them(tmp_path: Path, threads: int) -> None:
    entries = payloads()
    writer, names = write(tmp_path, entries, threads=threads)
    assert names == [f"{key}.pt" for key in entries]
    for key, value in entries.items():
        reference = tmp_path / f"reference-{key}.pt"
        torch.save(value, reference)
        for options in ({"weights_only": True}, {"weights_only": True, "mmap": True}, {"weights_only": False}):
            same(torch.load(writer.dir / f"{key}.pt", **options), torch.load(reference, **options))
        # The pickled structure is torch.save's, byte for byte; so are the records' names.
        reader = torch._C.PyTorchFileReader(str(writer.dir / f"{key}.pt"))
        expected = torch._C.PyTorchFileReader(str(reference))
        assert reader.get_record("data.pkl") == expected.get_record("data.pkl")
        assert sorted(reader.get_all_records()) == sorted(expected.get_all_records())


def test_shared_storages_stay_shared(tmp_path: Path) -> None:
    writer, _ = write(tmp_path, {"shared": payloads()["shared"]})
    loaded = torch.load(writer.dir / "shared.pt", weights_only=True)
    pointers = {loaded[key].untyped_storage().data_ptr() for key in ("whole", "view", "strided", "again")}
    assert len(pointers) == 1
    loaded["view"][0] = 123.0
    assert loaded["whole"][100] == 123.0


def test_data_pkl_matches_torch_save_byte_for_byte() -> None:
    for value in payloads().values():
        reference = io.BytesIO()
        torch.save(value, reference)
        reference.seek(0)
        assert _pickle_payload(value)[0] == torch._C.PyTorchFileReader(reference).get_record("data.pkl")


def test_manifest_checksums_and_sizes_match_the_files(tmp_path: Path) -> None:
    writer, names = write(tmp_path, payloads())
    for name in names:
        entry = writer.files[name]
        assert entry.size == (writer.dir / name).stat().st_size
        assert entry.crc32c == crc32c_of_file(writer.dir / name)
    writer.commit()


def test_ranges_cover_each_file_once_before_its_file_is_announced(tmp_path: Path) -> None:
    events: list[tuple[Any, ...]] = []
    lock = threading.Lock()

    def on_range(name: str, tmp: str, size: int, offset: int, length: int) -> None:
        with lock:
            assert (tmp_path / "step-000000001" / tmp).is_file()  # written under the temporary name
            events.append(("range", name, tmp, size, offset, length))

    def on_file(name: str) -> None:
        with lock:
            events.append(("file", name))

    writer, names = write(tmp_path, payloads(), chunk=64 << 10, on_range=on_range, on_file=on_file)
    for name in names:
        ranges = sorted((e[4], e[5]) for e in events if e[0] == "range" and e[1] == name)
        size = writer.files[name].size
        assert {e[3] for e in events if e[0] == "range" and e[1] == name} == {size}
        position = 0
        for offset, length in ranges:
            assert offset == position and length > 0  # no gap, no overlap
            position += length
        assert position == size
        tmps = {e[2] for e in events if e[0] == "range" and e[1] == name}
        assert len(tmps) == 1 and ".tmp-" in next(iter(tmps)) and "/" not in next(iter(tmps))
        last_range = max(i for i, e in enumerate(events) if e[0] == "range" and e[1] == name)
        assert events.index(("file", name)) > last_range
    # MiB-sized announcements, not one per write: the big entry's 1.2 MB is a handful of ranges.
    assert len([e for e in events if e[0] == "range" and e[1] == "big.pt"]) <= 1_200_000 // (64 << 10) + 2


def test_cancel_stops_the_threads_and_leaves_no_temporary_files(tmp_path: Path) -> None:
    cancel = threading.Event()
    seen: list[int] = []
    lock = threading.Lock()

    def on_range(name: str, tmp: str, size: int, offset: int, length: int) -> None:
        with lock:
            seen.append(offset)
            if len(seen) == 5:
                cancel.set()

    entries = {f"part{i}": torch.randn(200_000) for i in range(4)}  # 3.2 MB, ~800 pieces
    with pytest.raises(SaveCancelled):
        write(tmp_path, entries, threads=4, cancel=cancel, on_range=on_range)
    # Each thread finishes at most the piece it had started.
    assert len(seen) <= 5 + 4
    leftovers = list((tmp_path / "step-000000001").iterdir())
    assert not [path for path in leftovers if ".tmp-" in path.name]


def test_an_error_in_a_writer_thread_surfaces_as_it_was(tmp_path: Path) -> None:
    class Boom(OSError):
        pass

    def on_range(name: str, tmp: str, size: int, offset: int, length: int) -> None:
        if name == "part2.pt":
            raise Boom(28, "No space left on device")

    entries = {f"part{i}": torch.randn(50_000) for i in range(4)}
    with pytest.raises(Boom):
        write(tmp_path, entries, on_range=on_range)
    assert not [path for path in (tmp_path / "step-000000001").iterdir() if ".tmp-" in path.name]


def test_cpu_tensors_through_the_staging_buffers_give_the_same_file(tmp_path: Path) -> None:
    """The pipeline CUDA tensors take (copy a piece into a reused buffer, then write it), run on the CPU."""
    staging = StagingBuffers(count=2, buffer_bytes=SMALL_CHUNK, device_copies=True)
    entries = payloads()
    writer, names = write(tmp_path / "a", entries, staging=staging)
    assert staging.copies > 100 and staging.allocations == 2
    writer2, _ = write(tmp_path / "b", entries, staging=staging)
    assert staging.allocations == 2  # reused across saves, never more than `count`
    for name in names:
        assert writer.files[name] == writer2.files[name]
        assert crc32c_of_file(writer.dir / name) == writer.files[name].crc32c
    same(torch.load(writer.dir / "big.pt", weights_only=True), entries["big"])


def test_falls_back_to_torch_save_when_torch_lacks_what_the_writer_needs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class ReaderWithoutOffsets:  # an older torch's reader: no get_record_offset
        def __init__(self, *args: object) -> None:
            pass

    monkeypatch.setattr(torch._C, "PyTorchFileReader", ReaderWithoutOffsets)
    entries = {"model": {"w": torch.randn(1000)}, "step": {"n": 1}}
    writer, names = write(tmp_path, entries)
    monkeypatch.undo()
    assert "torch.save, one thread" in caplog.text
    assert not [path for path in writer.dir.iterdir() if ".tmp-" in path.name]
    for key, name in zip(entries, names, strict=True):
        same(torch.load(writer.dir / name, weights_only=True), entries[key])
        assert crc32c_of_file(writer.dir / name) == writer.files[name].crc32c


def test_guard_refuses_a_bad_write_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make: Callable[..., Guard] = lambda **kw: Guard(  # noqa: E731
        checkpoint_dir=tmp_path, socket=tmp_path / "none.sock", handle_sigterm=False, **kw
    )
    with pytest.raises(ValueError, match="write_threads"):
        make(write_threads=0)
    monkeypatch.setenv("SPOTGUARD_WRITE_THREADS", "many")
    with pytest.raises(ValueError, match="SPOTGUARD_WRITE_THREADS"):
        make()
    guard = make(write_threads=2)  # the argument wins over the environment
    try:
        guard.save({"w": torch.randn(10)}, 1, reason="urgent")
        assert guard._saver.files_writer.threads == 2
    finally:
        guard.close()
