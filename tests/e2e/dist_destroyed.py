"""One rank of a job that destroys its process group without ``guard.close()`` while a periodic save
is being written. ``wait``: the save goes on once the group is gone, and ``guard.wait()`` says how it
ended (a JSON line). ``exit``: the save is held until the interpreter's exit (by this script's own
exit hook, which runs before spotguard's).

    RANK=r WORLD_SIZE=2 RENDEZVOUS_FILE=f python -m tests.e2e.dist_destroyed ROOT wait|exit
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from spotguard import Guard
from spotguard.trainer.saving import Saver

release = threading.Event()


class HeldSaver(Saver):
    def write(self, writer: Any, payloads: Any, *rest: Any) -> None:
        release.wait()
        super().write(writer, payloads, *rest)


class ScriptGuard(Guard):
    saver_type = HeldSaver


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{os.environ['RENDEZVOUS_FILE']}", rank=rank, world_size=world)
    root, mode = Path(sys.argv[1]), sys.argv[2]
    guard = ScriptGuard(checkpoint_dir=root, socket=root.parent / "none.sock", daemon_wait=0.1, handle_sigterm=False)
    torch.manual_seed(0)
    guard.save({"model": torch.nn.Linear(64, 64)}, 5)  # periodic: in the background, held
    dist.destroy_process_group()  # before guard.close(): the mistake under test
    if mode == "exit":
        threading._register_atexit(release.set)  # type: ignore[attr-defined]
        return
    release.set()
    try:
        guard.wait()
    except Exception as exc:
        print(json.dumps({"raised": type(exc).__name__, "message": str(exc)}), flush=True)
    else:
        print(json.dumps({"raised": None}), flush=True)
    guard.close()


if __name__ == "__main__":
    main()
