"""A DDP training loop for the distributed tests: one process per rank, gloo on 127.0.0.1.

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python -m tests.e2e.dist_trainer ...

Rank r talks to the daemon at ``--sockets[r % len]`` (one daemon per simulated VM). Prints JSON
lines (rank 0 only). ``--notice-at k`` holds every rank at step k, asking ``should_checkpoint`` each
time round, until some rank's daemon delivers a notice: the ranks that got none learn it through the
all-reduce, which is the behaviour under test. ``--ballast-mib M`` adds a per-rank tensor of M MiB to
the state (a per-rank file in the checkpoint) that every step changes; a run that finishes checks it
against an uninterrupted run's. ``--hold-periodic`` holds each rank's periodic saves in the background,
before DCP writes, until that rank's urgent save (for the notice of ``--notice-at``) has cancelled it:
the cancellation then certainly comes while every rank is still writing the periodic one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torchdata.stateful_dataloader import StatefulDataLoader

from spotguard import Guard, SpotguardMismatch
from spotguard.localstore import CheckpointWriter
from spotguard.manifest import FileEntry
from spotguard.trainer import sharded
from spotguard.trainer.samplers import ResumableDistributedSampler

warnings.filterwarnings("ignore", message="'set_vital' is deprecated")


def emit(event: str, **fields: object) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"event": event, **fields}), flush=True)


def init_process_group() -> None:
    """gloo; rendezvous through a file when the launcher names one (no TCP port to race for)."""
    rendezvous = os.environ.get("RENDEZVOUS_FILE")
    if rendezvous:
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", world_size=world, rank=rank)
    else:
        dist.init_process_group("gloo")


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, object]:
    """Model and optimizer state keyed by parameter name: comparable across world sizes."""
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state}


BALLAST_STRIDE = 64  # each step marks every 64th element of the ballast, from its own offset


def ballast(rank: int, mib: float, steps: int = 0) -> torch.Tensor:
    """This rank's ballast as it is after ``steps`` steps: the bulk of a node's state, its own per rank
    (a per-rank file in the checkpoint) and changed by every step, so a resume must load it."""
    tensor = torch.rand(int(mib * (1 << 18)), generator=torch.Generator().manual_seed(1000 + rank))
    for step in range(1, steps + 1):
        mark(tensor, step)
    return tensor


def mark(tensor: torch.Tensor, step: int) -> None:
    tensor[step % BALLAST_STRIDE :: BALLAST_STRIDE] += 1.0


def hold_periodic_saves() -> None:
    """Periodic saves' writes (in their background thread, after the ranks opened the step directory)
    wait until an urgent save cancels them."""
    write = sharded._write_dcp

    def held(
        writer: CheckpointWriter, tree: dict[str, Any], announce: Callable[[str, FileEntry], None], threads: int
    ) -> dict[str, FileEntry]:
        if writer.reason == "periodic":
            assert writer.cancel is not None and writer.cancel.wait(60), "no urgent save cancelled it"
        return write(writer, tree, announce, threads)

    sharded._write_dcp = held


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, help="the checkpoint root of every rank")
    parser.add_argument("--roots", default="", help="rank r uses roots[r %% len]: one local disk per VM")
    parser.add_argument("--bucket")
    parser.add_argument("--sockets", default="")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--notice-at", type=int)
    parser.add_argument("--every-steps", type=int)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--dump-loaded", type=Path, help="after resume, write the loaded state here (rank 0)")
    parser.add_argument("--dump-saved", type=Path, help="at the urgent save, write the saved state here (rank 0)")
    parser.add_argument("--sgd-on-rank", type=int, help="this rank resumes with SGD instead of AdamW")
    parser.add_argument("--mismatch-out", type=Path, help="each rank writes the resume mismatch it got here")
    parser.add_argument("--ballast-mib", type=float, default=0, help="a per-rank tensor of this size in the state")
    parser.add_argument("--hold-periodic", action="store_true", help="periodic saves wait to be cancelled")
    args = parser.parse_args()

    torch.set_num_threads(1)
    if args.hold_periodic:
        hold_periodic_saves()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        init_process_group()
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
    model = torch.nn.parallel.DistributedDataParallel(net) if world > 1 else net
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if args.sgd_on_rank == rank:
        optimizer = torch.optim.SGD(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)
    sampler = ResumableDistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=7)
    loader = StatefulDataLoader(data, batch_size=4, sampler=sampler, generator=torch.Generator().manual_seed(3))
    torch.manual_seed(100 + rank)  # each rank its own dropout stream, as in real jobs
    roots = [Path(r) for r in args.roots.split(",") if r] or [args.root]
    root = roots[rank % len(roots)]
    sockets = [s for s in args.sockets.split(",") if s] or [str(root / "none.sock")]
    guard = Guard(
        checkpoint_dir=root,
        bucket=args.bucket,
        socket=sockets[rank % len(sockets)],
        every_steps=args.every_steps,
        handle_sigterm=False,
    )
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader}
    if args.ballast_mib:
        state["ballast"] = ballast(rank, args.ballast_mib)
    try:
        step = guard.resume(state)
    except SpotguardMismatch as error:
        if args.mismatch_out is None:
            raise
        (args.mismatch_out / f"rank{rank}.txt").write_text(str(error))
        emit("mismatch", differences=len(error.differences))
        step = args.steps  # nothing to train into a state that does not fit
    emit("resumed", step=step)
    if args.dump_loaded and rank == 0:
        torch.save(snapshot(model, optimizer), args.dump_loaded)
    epoch = step // len(loader)
    while step < args.steps:
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            if args.ballast_mib:
                mark(state["ballast"], step)
            emit("step", step=step)
            if step == args.notice_at:
                deadline = time.monotonic() + 60
                while not guard.should_checkpoint(step):  # collective: every rank goes round together
                    assert time.monotonic() < deadline, "no notice arrived"
                    time.sleep(0.01)
                checkpoint = True
            else:
                checkpoint = guard.should_checkpoint(step)
            if checkpoint:
                path = guard.save(state, step)
                if args.dump_saved and rank == 0:
                    torch.save(snapshot(model, optimizer), args.dump_saved)
                committed = guard.last_checkpoint == path  # False: it returned before its commit (a periodic one)
                emit("saved", step=step, path=str(path), stop=guard.stop_requested, committed=committed)
            if guard.stop_requested or step >= args.steps:
                break
        else:
            epoch += 1
            continue
        break
    guard.close()
    code = 0
    if guard.stop_requested:
        emit("stopped", step=step)
    else:
        if args.out and rank == 0:
            torch.save(snapshot(model, optimizer), args.out)
        if args.ballast_mib and not torch.equal(state["ballast"], ballast(rank, args.ballast_mib, step)):
            print(f"rank {rank}: the ballast differs from an uninterrupted run's", file=sys.stderr)
            code = 1
        emit("finished", step=step)
    if world > 1:
        dist.destroy_process_group()
        # Leave without tearing down DDP: freeing its reducer drops the last reference to the gloo
        # process group, whose destructor joins a gloo worker thread under the GIL while that thread
        # waits for the GIL to free a finished all-reduce's tensors (torch 2.13; seen as a rank hung
        # after rank 0 had finished). Every result is written and flushed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    main()
