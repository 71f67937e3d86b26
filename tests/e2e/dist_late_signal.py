"""One rank of a 2-rank gloo job (DDP, SGD with momentum) in which a SIGTERM reaches rank 1 alone just
after the ranks agreed on a periodic save, before that save; prints each save's step and reason, and
the step the loop left at, as one JSON line.

RANK=r WORLD_SIZE=2 RENDEZVOUS_FILE=f python -m tests.e2e.dist_late_signal ROOT
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
import torch.distributed as dist

from spotguard import Guard


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{os.environ['RENDEZVOUS_FILE']}", world_size=world, rank=rank)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    guard = Guard(checkpoint_dir=sys.argv[1], socket=f"{sys.argv[1]}/none.sock", every_steps=2, daemon_wait=0.1)
    saves: list[tuple[int, str]] = []
    left_at = None
    for step in range(1, 6):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        if guard.should_checkpoint(step):
            if step == 2 and rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # Guard's handler notes it; the agreement is taken
            saves.append((step, guard.save_reason()))
            guard.save({"model": model, "optimizer": optimizer}, step)
        if guard.stop_requested:
            left_at = step
            break
    guard.close()
    print(json.dumps({"rank": rank, "saves": saves, "left_at": left_at}), flush=True)
    dist.destroy_process_group()
    os._exit(0)  # torch 2.13's exit may deadlock freeing DDP's reducer (tests/e2e/dist_trainer.py)


if __name__ == "__main__":
    main()
