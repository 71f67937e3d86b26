"""One rank of a 2-rank gloo job (DDP, Adam) that trains 3 steps: ``plain`` without a checkpoint,
``save`` with an urgent save before the first step (a notice that early), ``resume`` resumed from that
checkpoint. Prints, as one JSON line, the parameters and the optimizer's step counts at the end, and
the optimizer's step counts right after the save.

RANK=r WORLD_SIZE=2 RENDEZVOUS_FILE=f python -m tests.e2e.dist_fresh_optimizer ROOT plain|save|resume
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from spotguard import Guard

STEPS = 3


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{os.environ['RENDEZVOUS_FILE']}", world_size=world, rank=rank)
    root, how = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    state = {"model": model, "optimizer": optimizer}
    first, after_save = 0, None
    if how != "plain":
        guard = Guard(checkpoint_dir=root, socket=f"{root}/none.sock", daemon_wait=0.1)
        if how == "save":
            guard.save(state, 0, reason="urgent")
            after_save = [float(v["step"]) for v in optimizer.state.values()]
        else:
            first = guard.resume(state)
        guard.close()
    for step in range(first, STEPS):
        batch = torch.randn(2, 4, generator=torch.Generator().manual_seed(1000 * rank + step))
        model(batch).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    print(
        json.dumps(
            {
                "params": [p.detach().flatten().tolist() for p in model.parameters()],
                "steps": [float(v["step"]) for v in optimizer.state.values()],
                "after_save": after_save,
            }
        ),
        flush=True,
    )
    dist.destroy_process_group()
    os._exit(0)  # torch 2.13's exit may deadlock freeing DDP's reducer (tests/e2e/dist_trainer.py)


if __name__ == "__main__":
    main()
