"""A periodic save that an urgent one cancels: the files it had already finished went up ahead of its
commit, and they must not stay in the bucket (nor keep uploading beside the urgent save's).

A real daemon in a subprocess with a directory bucket, a real ``Guard`` in this process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from spotguard import Guard
from spotguard.harness import Vm, wait_for
from spotguard.localstore import CheckpointWriter, scan_local
from spotguard.storage.checkpoints import list_remote
from spotguard.storage.file import FileStorage
from spotguard.trainer.saving import Saver

CANCELLED = "step-000000001"


class AnnouncesThenHolds(Saver):
    """A periodic save that has finished (and announced) one file and is still writing when the
    urgent save comes, like a big state on a slow disk: it goes on only once cancelled."""

    announced = threading.Event()

    def open_step_dir(self, writer: CheckpointWriter, needed: int = 0) -> None:
        super().open_step_dir(writer, needed)
        if writer.reason == "periodic":
            entry = writer.write_bytes("early.bin", b"e" * 65536)
            self.client.send("file", path=str(writer.dir), name="early.bin", size=entry.size, crc32c=entry.crc32c)
            self.announced.set()
            assert writer.cancel is not None and writer.cancel.wait(30), "no urgent save cancelled it"


class HeldGuard(Guard):
    saver_type = AnnouncesThenHolds


def keys(bucket: str) -> list[str]:
    return sorted(obj.key for obj in FileStorage(bucket).list())


def test_a_periodic_save_cancelled_by_an_urgent_one_leaves_nothing_in_the_bucket(
    vm_factory: Callable[..., Vm], bucket: str
) -> None:
    vm = vm_factory("cancelled", env={"SPOTGUARD_KEEP_REMOTE": "5"})
    guard = HeldGuard(checkpoint_dir=vm.root, socket=vm.socket, handle_sigterm=False)
    try:
        wait_for(guard.client.connected.is_set, 10, "the hook to connect")
        state: dict[str, Any] = {"w": torch.zeros(4096)}
        guard.save(state, 1)  # periodic: in the background, held after its first file
        assert AnnouncesThenHolds.announced.wait(30)
        wait_for(lambda: f"{CANCELLED}/early.bin" in keys(bucket), 30, "the finished file to go up ahead")

        state["w"] = torch.ones(4096)
        guard.save(state, 2, reason="urgent")
        assert [(i.step, i.status) for i in scan_local(vm.root)] == [(2, "complete")]
        wait_for(
            lambda: [i.step for i in list_remote(FileStorage(bucket)) if i.status == "complete"] == [2],
            30,
            "the urgent checkpoint in the bucket",
        )
        wait_for(lambda: not [k for k in keys(bucket) if k.startswith(CANCELLED)], 30, "the cancelled save's file gone")
        log = vm.log.read_text()
        assert "periodic checkpoint at step 1 cancelled" in log
        assert "checkpoint at step 1 failed" not in log  # a cancellation is no failure: no alarm for it
    finally:
        guard.close()
    resumed: dict[str, Any] = {"w": torch.empty(4096)}
    with Guard(checkpoint_dir=Path(vm.root), socket=vm.socket, handle_sigterm=False) as again:
        assert again.resume(resumed) == 2
    assert torch.equal(resumed["w"], torch.ones(4096))
