"""One rank of a 2-rank gloo job whose urgent save fails on some rank; prints what this rank raised.

RANK=r WORLD_SIZE=2 RENDEZVOUS_FILE=f python -m tests.e2e.dist_failure ROOT0,ROOT1 STEP_DIR_STATE
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from spotguard import Guard


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{os.environ['RENDEZVOUS_FILE']}", world_size=world, rank=rank)
    roots = sys.argv[1].split(",")
    root = Path(roots[rank])
    guard = Guard(checkpoint_dir=root, socket=root.parent / f"none-{rank}.sock", daemon_wait=0.1)
    state = {"weights": torch.arange(1024, dtype=torch.float32) * (rank + 1), "step": 5}
    started = time.monotonic()
    try:
        guard.save(state, 5, reason="urgent")
        outcome = {"rank": rank, "raised": None}
    except Exception as exc:
        outcome = {"rank": rank, "raised": type(exc).__name__, "message": str(exc)}
    outcome["seconds"] = time.monotonic() - started
    print(json.dumps(outcome), flush=True)
    guard.close()
    dist.destroy_process_group()
    os._exit(0)  # see dist_trainer: freeing the process group's workers can deadlock at exit


if __name__ == "__main__":
    main()
