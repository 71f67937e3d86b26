"""One rank of a 2-rank gloo job whose saves fail on some rank; prints one JSON line per save.

RANK=r WORLD_SIZE=2 RENDEZVOUS_FILE=f [FILLER=path] [SOCKETS=S0,S1]
python -m tests.e2e.dist_failure ROOT0,ROOT1 KIND PLAN

KIND: ``dcp`` (a module, which DCP writes on rank 0), ``files`` (a tensor per rank, each its own file),
``external`` (as ``files``, but each rank's ``torch.save`` to a path inside ``Guard.external_save``,
as a framework's callback saves: a full disk raises there with no errno; an urgent save is one after
a SIGTERM notice), ``external0`` (the same, rank 0 alone writing, as Lightning's DDP saves) or
``external-same`` (each rank its own bytes under one name).
PLAN: saves as ``step:reason``, comma-separated. Before a step whose reason ends in ``+room``, the rank
whose disk holds ``FILLER`` deletes it (all ranks wait for that). ``SOCKETS``: each rank's daemon.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from spotguard import Guard, SpotguardDiskFull


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{os.environ['RENDEZVOUS_FILE']}", world_size=world, rank=rank)
    root = Path(sys.argv[1].split(",")[rank])
    torch.manual_seed(0)
    state: dict[str, Any]
    if sys.argv[2] == "dcp":
        state = {"model": torch.nn.Linear(1024, 1024)}  # 4 MiB, the same on both ranks: DCP writes it on rank 0
    else:
        state = {"weights": torch.full((1 << 20,), float(rank + 1))}  # 4 MiB each, a file per rank
    # SOCKETS: each rank's daemon (a node of its own each), else none.
    sockets = os.environ.get("SOCKETS")
    socket = Path(sockets.split(",")[rank]) if sockets else root.parent / f"none-{rank}.sock"
    guard = Guard(checkpoint_dir=root, socket=socket, daemon_wait=10 if sockets else 0.1, handle_sigterm=False)
    for planned in sys.argv[3].split(","):
        step, reason = planned.split(":")
        if reason.endswith("+room"):
            reason = reason.removesuffix("+room")
            filler = Path(os.environ["FILLER"])
            if filler.parent == root.parent:
                filler.unlink(missing_ok=True)  # this rank's disk had the room taken (another rank's too)
            dist.barrier()
        outcome: dict[str, Any] = {"step": int(step), "rank": rank, "raised": None}
        started = time.monotonic()
        try:
            if not sys.argv[2].startswith("external"):
                guard.save(state, int(step), reason=reason)
                guard.wait()  # a periodic save is written in the background: its outcome, as an urgent one's
            else:
                if reason == "urgent":
                    guard.notify_sigterm()
                with guard.external_save(int(step), {"framework": "test", "resume": "rank0.pt"}) as step_dir:
                    if sys.argv[2] == "external-same":  # one name, each rank's own bytes
                        torch.save(state, str(step_dir / "rank0.pt"))
                    elif sys.argv[2] == "external" or rank == 0:
                        torch.save(state, str(step_dir / f"rank{rank}.pt"))
        except Exception as exc:
            outcome.update(raised=type(exc).__name__, disk_full=isinstance(exc, SpotguardDiskFull), message=str(exc))
        outcome["seconds"] = time.monotonic() - started
        outcome["last_checkpoint"] = str(guard.last_checkpoint)
        outcome["on_disk"] = sorted(path.name for path in root.iterdir()) if root.is_dir() else []
        print(json.dumps(outcome), flush=True)
    guard.close()
    dist.destroy_process_group()
    os._exit(0)  # see dist_trainer: freeing the process group's workers can deadlock at exit


if __name__ == "__main__":
    main()
