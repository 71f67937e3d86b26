"""Admission of replicas on a real directory: slots, announced bytes, files, and this node's own room."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from spotguard.peer import wire
from spotguard.peer.admission import Admission, ReplicaLimits, newest_local_bytes
from spotguard.peer.files import BLOCK, new_file_on_disk, on_disk
from tests.checkpoints import write_checkpoint


def code_of(call: object) -> str:
    with pytest.raises(wire.PeerError) as caught:
        call()  # type: ignore[operator]
    return caught.value.code


def test_slots_are_taken_and_given_back(tmp_path: Path) -> None:
    admission = Admission(tmp_path / "peer-replicas", ReplicaLimits(max_replicas=2))
    admission.reserve("a", None)
    admission.reserve("b", 10)
    assert code_of(lambda: admission.reserve("c", None)) == "full"
    admission.settled("b")  # whole on disk: keeps its slot
    assert code_of(lambda: admission.reserve("c", None)) == "full"
    admission.release("a")
    admission.reserve("c", None)
    assert sorted(admission.held) == ["b", "c"]


def test_bytes_are_weighed_against_the_free_space_and_the_node_s_own_checkpoint(tmp_path: Path) -> None:
    free = shutil.disk_usage(tmp_path).free
    admission = Admission(tmp_path / "peer-replicas", ReplicaLimits(max_replicas=4, max_replica_bytes=1 << 62))
    assert code_of(lambda: admission.reserve("big", free + (1 << 30))) == "no-space"
    admission.own_bytes = lambda: free  # the daemon knows the state fills the disk
    assert code_of(lambda: admission.reserve("small", 1 << 30)) == "no-space"
    admission.own_bytes = lambda: 0
    admission.reserve("half", free // 2)
    # Another replica's reservation counts: two halves and a bit more do not fit.
    assert code_of(lambda: admission.reserve("more", free // 2 + (1 << 30))) == "no-space"
    assert sorted(admission.held) == ["half"]


def test_files_and_their_sizes_count_against_the_reservation(tmp_path: Path) -> None:
    admission = Admission(
        tmp_path, ReplicaLimits(max_replicas=1, max_files=3, max_file_bytes=1000, max_replica_bytes=1 << 62)
    )
    admission.reserve("r", None)
    admission.grow("r", total=500, files=1, size=500)
    assert admission.held["r"] == 500
    assert code_of(lambda: admission.grow("r", total=1501, files=2, size=1001)) == "too-large"
    assert code_of(lambda: admission.grow("r", total=600, files=4, size=1)) == "too-many-files"
    free = shutil.disk_usage(tmp_path).free
    assert code_of(lambda: admission.grow("r", total=free + (1 << 30), files=2, size=1)) == "no-space"
    assert admission.held["r"] == 500


def test_what_files_and_directories_take_on_disk_is_reserved_not_only_their_bytes(tmp_path: Path) -> None:
    admission = Admission(tmp_path, ReplicaLimits(max_replicas=1, max_replica_bytes=100 * BLOCK))
    admission.reserve("r", 0)
    disk = 0
    for i in range(3):  # empty files, each in two fresh directories: three blocks each
        disk += new_file_on_disk(f"d{i}/e/f", 0, set())[0]
        admission.grow("r", total=0, files=i + 1, size=0, disk=disk)
    assert admission.held["r"] == 9 * BLOCK
    assert code_of(lambda: admission.grow("r", total=0, files=4, size=0, disk=101 * BLOCK)) == "too-large"
    assert on_disk(1) == on_disk(BLOCK) == BLOCK and on_disk(BLOCK + 1) == 2 * BLOCK
    assert new_file_on_disk("a/b/c.bin", 0, {"a"}) == (2 * BLOCK, ["a/b"])
    assert new_file_on_disk("c.bin", BLOCK + 1, set()) == (2 * BLOCK, [])


def test_the_room_kept_is_the_newest_local_checkpoint_s_size(tmp_path: Path) -> None:
    assert newest_local_bytes(tmp_path / "missing") == 0
    write_checkpoint(tmp_path, 3, {"w.bin": b"x" * 300})
    write_checkpoint(tmp_path, 7, {"w.bin": b"x" * 700})
    (tmp_path / "step-0000000009").mkdir()  # not a checkpoint name: never looked at
    assert newest_local_bytes(tmp_path) == 700
    assert Admission(tmp_path / "peer-replicas", ReplicaLimits(max_replicas=1)).own_next_bytes() == 700
