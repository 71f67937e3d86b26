"""FSDP2 (``fully_shard``, DTensor parameters) through Guard, on CPU with gloo.

    save:  RANK=r WORLD_SIZE=2 ... python -m tests.e2e.fsdp_check save ROOT FULL.pt [urgent|periodic]
    load:  python -m tests.e2e.fsdp_check load ROOT FULL.pt       (one plain process: resharding)

``save`` trains a step, saves (urgently by default), writes the full (unsharded) parameters and
optimizer moments to FULL.pt from rank 0, then resumes into a fresh FSDP model and checks it equals
what was saved. A periodic save is written in the background: the next step, which changes every
sharded parameter and moment in place, runs before it is waited for, so what it wrote is what was
staged when it was taken.
``load`` resumes the same checkpoint into an unsharded model and checks it against FULL.pt.
"""

from __future__ import annotations

import gc
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from spotguard import Guard


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def full(value: Any) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def unsharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"param.{n}": full(p.detach()).clone() for n, p in model.named_parameters()}
    for param, moments in optimizer.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key}.{names[id(param)]}"] = full(moments[key]).clone()
    return out


def main() -> None:
    mode, root, reference = sys.argv[1], sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    guard_kwargs = {"checkpoint_dir": root, "socket": os.path.join(root, "none.sock"), "handle_sigterm": False}
    if mode == "save":
        from torch.distributed.fsdp import fully_shard

        from tests.e2e.dist_trainer import init_process_group

        init_process_group()
        model, optimizer = build()
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        saved = unsharded(model, optimizer)
        guard = Guard(**guard_kwargs)
        reason = sys.argv[4] if len(sys.argv) > 4 else "urgent"
        guard.save({"model": model, "optimizer": optimizer}, 3, reason=reason)
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()  # the training goes on; a periodic save is being written meanwhile
        guard.wait()
        if dist.get_rank() == 0:
            torch.save(saved, reference)
        fresh, fresh_optimizer = build()
        fully_shard(fresh)
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        assert guard.resume({"model": fresh, "optimizer": fresh_optimizer}) == 3
        loaded = unsharded(fresh, fresh_optimizer)
        guard.close()
        # The sharded modules and their optimizers hold the process group (through their DTensors'
        # device mesh). Left to the interpreter's exit, it is destroyed with gloo's threads during
        # finalization, and one run in about 30 aborted there ("terminate called without an active
        # exception", after "ok"). Dropped here, it goes while the interpreter is whole.
        del model, optimizer, fresh, fresh_optimizer
        gc.collect()
        dist.destroy_process_group()
    else:
        model, optimizer = build()
        guard = Guard(**guard_kwargs)
        assert guard.resume({"model": model, "optimizer": optimizer}) == 3
        guard.close()
        saved = torch.load(reference, weights_only=True)
        loaded = unsharded(model, optimizer)
    assert set(loaded) == set(saved), (sorted(loaded), sorted(saved))
    different = [key for key in saved if not torch.equal(saved[key], loaded[key])]
    assert not different, different
    print("ok", flush=True)


if __name__ == "__main__":
    main()
