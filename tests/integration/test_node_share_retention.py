"""A multi-node job's node other than 0 holds only its shares (``part-N.json``, no manifest): local
retention and the room kept for the next save must count them, or that node's disk fills with every
share it ever wrote, while node 0's stays pruned, until every save there fails for want of room."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path

from spotguard.control import request
from spotguard.daemon.uploader import Uploader
from spotguard.harness import Vm, wait_for
from spotguard.localstore import CheckpointWriter, scan_local
from spotguard.manifest import step_dir_name, write_part
from spotguard.space import keep_room_for_one
from spotguard.storage import open_storage
from spotguard.storage.file import FileStorage
from tests.diskspace import fill

KiB, MiB = 1 << 10, 1 << 20


def write_share(root: Path, step: int, size: int) -> Path:
    """Node 1 of 2 commits its share of ``step``: its file and its part, no manifest."""
    writer = CheckpointWriter(root, step, reason="periodic")
    writer.prepare()
    writer.write_bytes("shard.rank1.pt", os.urandom(size))
    write_part(writer.dir, 1, 2, writer.files)
    return writer.dir


def local_steps(root: Path) -> list[int]:
    return [info.step for info in scan_local(root)]


def share_keys(bucket: str) -> set[str]:
    storage = open_storage(bucket)
    try:
        return {item.key for item in storage.list()}
    finally:
        storage.close()


def test_a_node_holding_only_shares_keeps_the_newest_keep_local_of_them(
    vm_factory: Callable[..., Vm], bucket: str
) -> None:
    vm = vm_factory("node-1")  # keep_local = 2, the default
    for step in range(1, 6):
        step_dir = write_share(vm.root, step, 64 * KiB)
        request(vm.socket, "saved", path=str(step_dir), step=step, reason="periodic")
        key = f"{step_dir.name}/shard.rank1.pt"
        wait_for(lambda key=key: key in share_keys(bucket), 30, f"{key} in the bucket")
    wait_for(lambda: local_steps(vm.root) == [4, 5], 30, "only the newest two shares kept on disk")
    # Nothing of the bucket was pruned by this node: node 0, which commits, prunes it.
    assert {f"{step_dir_name(step)}/shard.rank1.pt" for step in range(1, 6)} <= share_keys(bucket)


def test_the_room_for_the_next_save_is_made_from_older_shares_never_the_newest(
    tmpfs: Callable[[int], Path],
) -> None:
    root = tmpfs(8 * MiB) / "ckpt"
    for step in (1, 2, 3):
        write_share(root, step, MiB)
    fill(root.parent, leave=MiB // 2)  # less than the newest share's size is free
    dropped = keep_room_for_one(root)
    assert dropped == [step_dir_name(1)]  # the oldest went, and that made room for one more
    assert local_steps(root) == [2, 3]


def test_what_the_uploader_remembers_of_a_share_goes_with_the_share(tmp_path: Path) -> None:
    """The names of the shares sent are kept (so that a rescan does not send one again) only while
    the share is on this disk: over months of saves they would otherwise grow by one per save."""
    (tmp_path / "bucket").mkdir()
    root = tmp_path / "node1"
    uploader = Uploader(FileStorage((tmp_path / "bucket").as_uri()), root, scan_interval=3600)

    async def scenario() -> tuple[set[str], set[str]]:
        task = asyncio.create_task(uploader.run())
        try:
            for step in range(1, 6):
                uploader.submit(write_share(root, step, 4 * KiB), urgent=False)
                deadline = time.monotonic() + 30
                while step_dir_name(step) not in uploader.shares.uploaded and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
            sent = set(uploader.shares.uploaded)
            # The local retention after the last share's upload runs after it is marked sent.
            deadline = time.monotonic() + 30
            while local_steps(root) != [4, 5] and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            await uploader.rescan()
            return sent, set(uploader.shares.uploaded)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    sent, remembered = asyncio.run(scenario())
    assert sent == {step_dir_name(step) for step in range(1, 6)}  # every share sent, none forgotten yet
    assert local_steps(root) == [4, 5]  # local retention kept the newest two
    assert remembered == {step_dir_name(4), step_dir_name(5)}


def node0_checkpoint(root: Path, step: int) -> tuple[Path, bytes]:
    """Node 0's disk after a save of 2 nodes: the manifest (both nodes' files), node 0's file and its
    part; and the bytes of node 1's file, which is on node 1's disk."""
    writer = CheckpointWriter(root, step, reason="periodic", world_size=2, meta={"nodes": 2})
    writer.prepare()
    writer.write_bytes("shard.rank0.pt", os.urandom(64 * KiB))
    writer.write_bytes("shard.rank1.pt", os.urandom(64 * KiB))
    rank1 = (writer.dir / "shard.rank1.pt").read_bytes()
    writer.commit()
    (writer.dir / "shard.rank1.pt").unlink()
    write_part(writer.dir, 0, 2, {"shard.rank0.pt": writer.files["shard.rank0.pt"]})
    return writer.dir, rank1


def test_node_0_gives_up_a_checkpoint_whose_other_share_never_comes_once_a_newer_one_is_committed(
    tmp_path: Path,
) -> None:
    """Node 1 died before its share of step 1 reached the bucket. Node 0 tried step 1 again for good,
    each attempt holding the one upload slot for the whole wait for that share, while the newer
    checkpoints of the job's next run (a new node 1) queued behind it; and it kept step 1 on its disk
    past keep_local. Now a retry only looks, and step 1 is given up once step 2 is committed."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    root = tmp_path / "node-0"
    storage = FileStorage(bucket.as_uri())
    uploader = Uploader(storage, root, keep_local=2, scan_interval=3600, bucket_scan_interval=3600, retry_after=0.05)
    uploader.shares.wait = 3.0  # ten minutes in the daemon

    async def scenario() -> tuple[float, list[int]]:
        task = asyncio.create_task(uploader.run())
        try:
            hopeless, _ = node0_checkpoint(root, 1)
            uploader.submit(hopeless, urgent=False)
            await wait_async(lambda: hopeless.name in uploader.shares.missing, 30)  # its first attempt failed
            newer, rank1 = node0_checkpoint(root, 2)
            (bucket / newer.name).mkdir()
            (bucket / newer.name / "shard.rank1.pt").write_bytes(rank1)  # node 1 of the next run sent its share
            started = time.monotonic()
            uploader.submit(newer, urgent=False)
            await wait_async(lambda: newer.name in uploader.committed, 30)
            took = time.monotonic() - started
            await wait_async(lambda: hopeless.name in uploader.shares.superseded, 30)
            for step in (3, 4):  # local retention may prune step 1 now
                later, rank1 = node0_checkpoint(root, step)
                (bucket / later.name).mkdir()
                (bucket / later.name / "shard.rank1.pt").write_bytes(rank1)
                uploader.submit(later, urgent=False)
                await wait_async(lambda later=later: later.name in uploader.committed, 30)
            # Retention runs right after each commit is announced: keep_local counts step 1 no more.
            await wait_async(lambda: local_steps(root) == [3, 4], 30)
            return took, local_steps(root)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    took, kept = asyncio.run(scenario())
    assert took < uploader.shares.wait, f"step 2 waited {took:.1f} s behind step 1's hopeless attempts"
    assert kept == [3, 4]
    assert uploader.failing_streak() == 0 and uploader.status()["queued"] == []
    assert not (bucket / step_dir_name(1) / "manifest.json").exists()


async def wait_async(predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)
