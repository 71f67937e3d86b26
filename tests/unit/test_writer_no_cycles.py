"""A save leaves nothing for the cycle collector to free. Large training loops turn it off (Megatron's
``--manual-gc``, torchtitan's ``gc_freq``): what a save keeps in a reference cycle then stays, save
after save, for the weeks the job runs (the storages its pickler saw included)."""

from __future__ import annotations

import gc
import shutil
import threading
from pathlib import Path

import torch

from spotguard.localstore import CheckpointWriter
from spotguard.trainer.writer import ParallelWriter


def test_saves_with_the_cycle_collector_off_leave_no_objects_behind(tmp_path: Path) -> None:
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(20)])
    writer = ParallelWriter(2)

    def save(step: int) -> None:
        checkpoint = CheckpointWriter(tmp_path, step, reason="periodic", cancel=threading.Event())
        checkpoint.prepare()
        writer.write(checkpoint, {"model": model.state_dict(), "rng": torch.get_rng_state()})
        shutil.rmtree(checkpoint.dir)

    save(0)  # first-use caches (torch's, the writer's) are not what this test counts
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        storages_before = sum(type(o) is torch.UntypedStorage for o in gc.get_objects())
        for step in range(1, 21):
            save(step)
        grown = len(gc.get_objects()) - before
        storages_kept = sum(type(o) is torch.UntypedStorage for o in gc.get_objects()) - storages_before
    finally:
        gc.enable()
    assert storages_kept == 0  # a pickler class made per save kept the RNG state's storage, each save
    assert grown < 20 * 20, f"{grown} objects left by 20 saves"  # it was some 370 a save
