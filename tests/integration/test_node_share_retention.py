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
                while step_dir_name(step) not in uploader.shares_uploaded and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
            sent = set(uploader.shares_uploaded)
            # The local retention after the last share's upload runs after it is marked sent.
            deadline = time.monotonic() + 30
            while local_steps(root) != [4, 5] and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            await uploader.rescan()
            return sent, set(uploader.shares_uploaded)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    sent, remembered = asyncio.run(scenario())
    assert sent == {step_dir_name(step) for step in range(1, 6)}  # every share sent, none forgotten yet
    assert local_steps(root) == [4, 5]  # local retention kept the newest two
    assert remembered == {step_dir_name(4), step_dir_name(5)}
