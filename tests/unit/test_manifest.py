from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from spotguard.crc32c import base64_to_hex, crc32c_int_to_base64, crc32c_of_bytes, crc32c_of_file, crc32c_of_files
from spotguard.localstore import CheckpointExists, CheckpointWriter, prune_local, remove_incomplete, scan_local
from spotguard.manifest import (
    MANIFEST,
    Manifest,
    ManifestError,
    ManifestFormatError,
    load_manifest,
    load_manifest_or_none,
    load_part,
    verify_dir,
    write_part,
)
from spotguard.safefile import NotARegularFile, SymlinkRefused, atomic_file
from spotguard.storage.base import put_bytes
from spotguard.storage.checkpoints import list_remote, restore, upload_checkpoint
from spotguard.storage.file import FileStorage
from tests.checkpoints import write_checkpoint


def test_commit_writes_manifest_with_sizes_and_crc32c(tmp_path: Path) -> None:
    step_dir = write_checkpoint(tmp_path, 12, {"a.bin": b"hello", "sub/b.bin": b"x" * 10_000})
    manifest = load_manifest(step_dir)
    assert step_dir.name == "step-000000012"
    assert manifest.step == 12 and manifest.reason == "periodic" and manifest.world_size == 1
    assert manifest.files["a.bin"].size == 5
    assert manifest.files["a.bin"].crc32c == crc32c_of_bytes(b"hello")
    assert manifest.files["sub/b.bin"].crc32c == crc32c_of_file(step_dir / "sub" / "b.bin")
    document = json.loads((step_dir / MANIFEST).read_text())
    assert document["format"] == "spotguard/1"
    assert set(document) == {"format", "step", "created", "reason", "world_size", "files", "meta"}
    assert verify_dir(step_dir) == []


def test_crc32c_matches_known_vector_and_cloud_encoding() -> None:
    # RFC 3720 test vector: 32 bytes of zeros -> 0x8a9136aa.
    assert crc32c_of_bytes(bytes(32)) == "8a9136aa"
    assert crc32c_int_to_base64(0x8A9136AA) == "ipE2qg=="
    assert base64_to_hex("ipE2qg==") == "8a9136aa"
    with pytest.raises(ValueError, match="not 4 bytes"):
        base64_to_hex("ipE2")
    with pytest.raises(ValueError, match="not base64"):
        base64_to_hex("!!!!")


def test_verify_detects_a_single_flipped_byte(tmp_path: Path) -> None:
    step_dir = write_checkpoint(tmp_path, 1, {"w.bin": bytes(range(256)) * 100})
    data = bytearray((step_dir / "w.bin").read_bytes())
    data[1234] ^= 0x01
    (step_dir / "w.bin").write_bytes(bytes(data))
    problems = verify_dir(step_dir)
    assert len(problems) == 1 and "crc32c" in problems[0]
    assert verify_dir(step_dir, checksums=False) == []  # same size: only the checksum catches it


def test_crc32c_of_files_read_in_ranges_by_threads_matches_one_pass(tmp_path: Path) -> None:
    paths = []
    for size in (0, 1, 4095, 4096, 4097, 3 * 4096 + 5, 100):
        path = tmp_path / f"f{size}"
        path.write_bytes(bytes((i * 7 + size) % 251 for i in range(size)))
        paths.append(path)
    one_pass = [crc32c_of_file(path) for path in paths]
    assert crc32c_of_files(paths, 1) == one_pass
    assert crc32c_of_files(paths, 3, range_bytes=4096) == one_pass  # ranges combined per file
    assert crc32c_of_files(paths, 8, range_bytes=1000) == one_pass


def test_verify_with_threads_names_the_one_file_with_a_flipped_byte(tmp_path: Path) -> None:
    files = {f"w{i}.bin": bytes([i]) * 50_000 for i in range(6)}
    step_dir = write_checkpoint(tmp_path, 1, files)
    assert verify_dir(step_dir, threads=4) == []
    data = bytearray((step_dir / "w4.bin").read_bytes())
    data[-1] ^= 0x80
    (step_dir / "w4.bin").write_bytes(bytes(data))
    problems = verify_dir(step_dir, threads=4)
    assert len(problems) == 1 and problems[0].startswith("step-000000001/w4.bin: crc32c")


def test_verify_reports_missing_and_truncated_files(tmp_path: Path) -> None:
    step_dir = write_checkpoint(tmp_path, 1, {"a": b"aaaa", "b": b"bbbb"})
    (step_dir / "a").unlink()
    (step_dir / "b").write_bytes(b"bb")
    problems = verify_dir(step_dir)
    assert any("a: missing" in p for p in problems)
    assert any("b: size 2" in p for p in problems)


def test_directory_without_manifest_is_incomplete_and_listed_so(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 1, {"a": b"1"})
    writer = CheckpointWriter(tmp_path, 2, reason="urgent")
    writer.prepare()
    writer.write_bytes("a", b"2")  # killed before commit
    infos = scan_local(tmp_path)
    assert [(i.name, i.status) for i in infos] == [("step-000000001", "complete"), ("step-000000002", "incomplete")]
    assert infos[1].created is None
    assert remove_incomplete(tmp_path) == ["step-000000002"]
    assert not (tmp_path / "step-000000002").exists()


def test_a_share_whose_directory_or_file_went_is_no_share(tmp_path: Path) -> None:
    assert load_part(tmp_path / "step-000000007") is None  # removed before the scan reached it
    writer = CheckpointWriter(tmp_path, 8, reason="periodic")
    writer.prepare()
    entry = writer.write_bytes("shard-1.bin", b"x" * 10)
    write_part(writer.dir, 1, 2, {"shard-1.bin": entry})
    assert load_part(writer.dir) == {"shard-1.bin": entry}
    (writer.dir / "shard-1.bin").unlink()
    (writer.dir / "shard-1.bin").mkdir()  # the name is there, but not as the file the share names
    assert load_part(writer.dir) is None


_SAVE_AND_PRUNE = """
import shutil, sys
from pathlib import Path
from spotguard.localstore import CheckpointWriter
from spotguard.manifest import write_part
root = Path(sys.argv[1])
step = 0
while not (root.parent / "stop").exists():
    step += 1
    writer = CheckpointWriter(root, step, reason="periodic")
    writer.prepare()
    files = {f"shard-{n}.bin": writer.write_bytes(f"shard-{n}.bin", b"x" * 4096) for n in range(4)}
    write_part(writer.dir, 1, 2, files)
    shutil.rmtree(writer.dir)
"""


def test_scanning_while_a_trainer_prunes_never_raises(tmp_path: Path) -> None:
    """A trainer's retention (or the daemon's) removes step directories while the daemon scans the
    root: once in ~1,000 periodic saves a directory went between the scan's look at its files and at
    its share marker, and the daemon answered the trainer's "saved" with an internal error. The
    trainer here is another process, so that its removals land anywhere in a scan."""
    root = tmp_path / "nvme"
    root.mkdir()
    trainer = subprocess.Popen([sys.executable, "-c", _SAVE_AND_PRUNE, str(root)])
    try:
        deadline = time.monotonic() + 30
        while not any(root.iterdir()):  # the trainer's interpreter starting
            assert trainer.poll() is None and time.monotonic() < deadline, "the trainer wrote nothing"
        seen = 0
        for _ in range(3000):
            for info in scan_local(root):
                assert info.status == "incomplete"
                assert info.node_files is None or sorted(info.node_files) == [f"shard-{n}.bin" for n in range(4)]
                seen += 1
        assert seen > 0, "the scans never met a step directory: the race was not exercised"
    finally:
        (tmp_path / "stop").touch()
        assert trainer.wait(timeout=30) == 0


def test_checkpoints_are_never_overwritten(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 5, {"a": b"first"})
    with pytest.raises(CheckpointExists):
        CheckpointWriter(tmp_path, 5, reason="urgent").prepare()
    assert (tmp_path / "step-000000005" / "a").read_bytes() == b"first"


def test_prepare_clears_a_leftover_at_the_same_step(tmp_path: Path) -> None:
    leftover = tmp_path / "step-000000005"
    leftover.mkdir()
    (leftover / "junk").write_bytes(b"half written")
    writer = CheckpointWriter(tmp_path, 5, reason="urgent")
    writer.prepare()
    assert list(leftover.iterdir()) == []


def test_atomic_file_leaves_nothing_behind_on_error(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    with pytest.raises(RuntimeError), atomic_file(target) as out:
        out.write(b"partial")
        raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(format="other/9"),
        lambda d: d.update(step=-1),
        lambda d: d.update(step=True),
        lambda d: d["files"].update({"../escape": {"size": 1, "crc32c": "00000000"}}),
        lambda d: d["files"].update({"/abs": {"size": 1, "crc32c": "00000000"}}),
        lambda d: d["files"].update({"x": {"size": 1, "crc32c": "XYZ"}}),
        lambda d: d.pop("files"),
    ],
)
def test_malformed_manifests_are_rejected(tmp_path: Path, mutate) -> None:  # type: ignore[no-untyped-def]
    step_dir = write_checkpoint(tmp_path, 3, {"a": b"1"})
    document = json.loads((step_dir / MANIFEST).read_text())
    mutate(document)
    with pytest.raises(ManifestError):
        Manifest.from_json(json.dumps(document).encode())


@pytest.mark.parametrize(
    "manifest",
    [
        b'{"format": "spotguard/1", "step": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",
        b'{"format": "spotguard/1", "step": 2' + b"0" * 5000 + b"}",
        b'{"format": "spotguard/' + b"9" * 5000 + b'"}',
    ],
    ids=["nested", "digits", "format-digits"],
)
def test_a_hostile_manifest_in_the_bucket_is_skipped_and_the_older_checkpoint_restored(
    tmp_path: Path, manifest: bytes
) -> None:
    """Each of these used to raise out of the bucket's listing (RecursionError, or the ValueError of
    Python's digit limit): one object ended every listing, restore and resume of the job."""
    storage = FileStorage(f"file://{tmp_path}/bucket/run1")
    upload_checkpoint(storage, write_checkpoint(tmp_path / "local", 1, {"w.bin": b"one"}))
    upload_checkpoint(storage, write_checkpoint(tmp_path / "local", 2, {"w.bin": b"two"}))
    put_bytes(storage, f"step-000000002/{MANIFEST}", manifest)
    with pytest.raises(ManifestError):
        Manifest.from_json(manifest)
    assert [(info.step, info.status) for info in list_remote(storage)] == [(1, "complete"), (2, "incomplete")]
    restored = restore(storage, tmp_path / "fresh")
    assert restored is not None and (restored / "w.bin").read_bytes() == b"one"


def test_manifest_for_another_step_is_rejected(tmp_path: Path) -> None:
    step_dir = write_checkpoint(tmp_path, 3, {"a": b"1"})
    other = tmp_path / "step-000000004"
    step_dir.rename(other)
    with pytest.raises(ManifestError, match="manifest says step 3"):
        load_manifest(other)


def test_prune_local_keeps_newest_and_protected(tmp_path: Path) -> None:
    for step in range(1, 6):
        write_checkpoint(tmp_path, step, {"a": bytes([step])})
    removed = prune_local(tmp_path, 2, protected=frozenset({"step-000000001"}))
    assert removed == ["step-000000002", "step-000000003"]
    assert [i.step for i in scan_local(tmp_path)] == [1, 4, 5]


def test_contents_round_trip_one_line_per_tensor_key_and_old_manifests_still_read(tmp_path: Path) -> None:
    contents = {"world_size": 1, "entries": {"model": {"kind": "module", "keys": {"w": "float32[2,3]"}}}}
    writer = CheckpointWriter(tmp_path, 3, reason="urgent", contents=contents)
    writer.prepare()
    writer.write_bytes("model.pt", b"x")
    writer.commit()
    text = (writer.dir / MANIFEST).read_text()
    assert any(line.strip() == '"w": "float32[2,3]"' for line in text.splitlines())  # one line per key
    assert load_manifest(writer.dir).contents == contents
    document = json.loads(text)
    del document["contents"]  # as written before contents were recorded
    (writer.dir / MANIFEST).write_text(json.dumps(document))
    assert load_manifest(writer.dir).contents is None


def test_a_newer_format_names_itself_and_the_format_this_reader_reads(tmp_path: Path) -> None:
    step_dir = write_checkpoint(tmp_path, 1, {"a.bin": b"a"})
    document = json.loads((step_dir / MANIFEST).read_text())
    document["format"] = "spotguard/2"
    (step_dir / MANIFEST).write_text(json.dumps(document))
    with pytest.raises(ManifestFormatError, match=r"'spotguard/2' is newer .* reads \('spotguard/1'\)") as caught:
        load_manifest(step_dir)
    assert caught.value.found == "spotguard/2"
    document["format"] = "something/else"
    (step_dir / MANIFEST).write_text(json.dumps(document))
    with pytest.raises(ManifestError) as other:
        load_manifest(step_dir)
    assert not isinstance(other.value, ManifestFormatError)


def test_a_symlinked_file_or_manifest_makes_a_checkpoint_incomplete(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes(b"same bytes")
    step_dir = write_checkpoint(tmp_path / "root", 1, {"a.bin": b"same bytes"})
    (step_dir / "a.bin").unlink()
    (step_dir / "a.bin").symlink_to(outside)
    assert verify_dir(step_dir) == [f"{step_dir.name}/a.bin: not a regular file inside the checkpoint (a symlink?)"]
    with pytest.raises(SymlinkRefused):
        crc32c_of_file(step_dir / "a.bin")
    real_manifest = step_dir / MANIFEST
    (tmp_path / "m.json").write_bytes(real_manifest.read_bytes())
    real_manifest.unlink()
    real_manifest.symlink_to(tmp_path / "m.json")
    assert load_manifest_or_none(step_dir) is None


def test_a_fifo_in_place_of_a_file_or_the_manifest_is_refused_at_once_not_waited_on(tmp_path: Path) -> None:
    """Opening a FIFO for reading waits for a writer: on the daemon's event loop (a socket message
    naming one) or in its rescan (one named manifest.json), that wait froze the daemon for good; the
    step directory is incomplete, as with a symlink."""
    step_dir = write_checkpoint(tmp_path / "root", 1, {"a.bin": b"same bytes"})
    (step_dir / "a.bin").unlink()
    os.mkfifo(step_dir / "a.bin")
    (step_dir / MANIFEST).rename(tmp_path / "m.json")
    os.mkfifo(step_dir / MANIFEST)
    outcomes: dict[str, object] = {}

    def read_both() -> None:
        with pytest.raises(NotARegularFile, match="not a regular file") as refused:
            crc32c_of_file(step_dir / "a.bin")
        outcomes["file"] = refused.value.filename
        outcomes["manifest"] = load_manifest_or_none(step_dir)
        outcomes["scanned"] = [(info.name, info.status) for info in scan_local(step_dir.parent)]

    reader = threading.Thread(target=read_both, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # stuck in an open: give it a writer, so that the thread ends
        for fifo in (step_dir / "a.bin", step_dir / MANIFEST):
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert not reader.is_alive(), "reading a checkpoint waited on a FIFO"
    assert outcomes == {"file": str(step_dir / "a.bin"), "manifest": None, "scanned": [(step_dir.name, "incomplete")]}
