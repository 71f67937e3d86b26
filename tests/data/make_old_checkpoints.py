"""Checkpoints exactly as spotguard 0.1 writes them, kept so that later versions prove they still load them.

    python tests/data/make_old_checkpoints.py        # (re)writes tests/data/checkpoints-0.1/

Two roots, each with one committed checkpoint at step 3 and what it must load back to:

- ``single/``: one process, an urgent ``Guard.save`` of a small model, its AdamW optimizer, a
  StepLR scheduler, a plain tensor and a dict of primitives (one ``<key>.pt`` file per entry, RNG
  states in ``_rng.pt``). ``single/expected.pt`` holds the saved values and the draws each RNG
  (torch, python, numpy) gave right after the save: a resumed run must draw the same.
- ``dcp/``: two gloo ranks, the same state with the model in DDP: the model and optimizer through
  torch.distributed.checkpoint (``__<rank>_0.distcp`` + ``.metadata``), the rest per rank
  (``<key>.rank<R>.pt``). ``dcp/expected-rank<R>.pt`` as above, per rank, the model and optimizer
  keyed by parameter name (``get_state_dict``), so that they compare across world sizes.

Made once, with the version named in ``made-with.json``: running it again with newer code
replaces the old checkpoints with new ones and proves nothing. The test is
tests/integration/test_old_checkpoints.py.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
OUT = HERE / "checkpoints-0.1"
STEP = 3


def build_state(seed: int, model: torch.nn.Module | None = None) -> dict[str, Any]:
    """The state every fixture saves; ``seed`` sets its values (a resume must overwrite all of them)."""
    torch.manual_seed(seed)
    net = model or torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return {
        "model": net,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "counts": torch.arange(6, dtype=torch.float64) * seed,
        "extra": {"epoch": seed, "name": f"run-{seed}", "losses": [0.5 * seed, 0.25]},
    }


def train(state: dict[str, Any], steps: int, rank: int = 0) -> None:
    """A few real steps, so that the optimizer and scheduler have state worth saving."""
    for step in range(steps):
        inputs = torch.randn(5, 4) + rank
        loss = state["model"](inputs).square().mean()
        state["optimizer"].zero_grad()
        loss.backward()
        state["optimizer"].step()
        state["scheduler"].step()
        state["counts"] += step


def draws() -> dict[str, Any]:
    """What each global RNG gives next: equal after a resume only if all three were restored."""
    return {"torch": torch.rand(4), "python": random.random(), "numpy": torch.from_numpy(np.random.rand(3))}


def seed_rngs(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def make_single(root: Path) -> None:
    from spotguard import Guard

    state = build_state(7)
    train(state, 3)
    seed_rngs(11)
    guard = Guard(checkpoint_dir=root, socket=root / "none.sock", handle_sigterm=False)
    try:
        guard.save(state, STEP, reason="urgent")
    finally:
        guard.close()
    expected = {
        "model": state["model"].state_dict(),
        "optimizer": state["optimizer"].state_dict(),
        "scheduler": state["scheduler"].state_dict(),
        "counts": state["counts"].clone(),
        "extra": state["extra"],
        "draws": draws(),
    }
    torch.save(expected, root / "expected.pt")


def dcp_rank(root: Path, rendezvous: Path, rank: int, world: int) -> None:
    """One rank of the two-rank save."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from spotguard import Guard

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", world_size=world, rank=rank)
    torch.set_num_threads(1)
    torch.manual_seed(7)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    state = build_state(7 + rank, torch.nn.parallel.DistributedDataParallel(net))
    train(state, 3, rank)
    seed_rngs(11 + rank)
    guard = Guard(checkpoint_dir=root, socket=root / "none.sock", handle_sigterm=False)
    try:
        guard.save(state, STEP, reason="urgent")
    finally:
        guard.close()
    model_state, optim_state = get_state_dict(state["model"], state["optimizer"])
    expected = {
        "model": model_state,
        "optimizer": optim_state,
        "scheduler": state["scheduler"].state_dict(),
        "counts": state["counts"].clone(),
        "extra": state["extra"],
        "draws": draws(),
    }
    torch.save(expected, root / f"expected-rank{rank}.pt")
    dist.destroy_process_group()


def make_dcp(root: Path, world: int = 2) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        rendezvous = Path(scratch) / "store"
        command = [sys.executable, __file__, "rank", str(root), str(rendezvous), str(world)]
        procs = [subprocess.Popen([*command, str(rank)]) for rank in range(world)]
        codes = [proc.wait(timeout=300) for proc in procs]
    if codes != [0] * world:
        raise SystemExit(f"a rank failed: exit codes {codes}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    rank = sub.add_parser("rank", help="one rank of the distributed save (started by this script)")
    rank.add_argument("root", type=Path)
    rank.add_argument("rendezvous", type=Path)
    rank.add_argument("world", type=int)
    rank.add_argument("rank", type=int)
    args = parser.parse_args()
    if args.command == "rank":
        dcp_rank(args.root, args.rendezvous, args.rank, args.world)
        return

    import spotguard

    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    make_single(OUT / "single")
    make_dcp(OUT / "dcp")
    made_with = {"spotguard": spotguard.__version__, "torch": torch.__version__, "numpy": np.__version__}
    (OUT / "made-with.json").write_text(json.dumps(made_with, indent=1) + "\n")
    for path in sorted(OUT.rglob("*")):
        if path.is_file():
            print(f"{path.stat().st_size:8d}  {path.relative_to(OUT)}")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent.parent))  # the spotguard of this checkout, run as a script
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
