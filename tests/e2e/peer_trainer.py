"""The demo's training loop with a large state: deterministic tensors (the bulk of a big model's
weights and optimizer moments, one file each, as shards are) that every step changes. JSON progress
lines on stdout, as the demo's.

    python -m tests.e2e.peer_trainer --checkpoint-dir D --socket S --steps N [--bucket URL]
        [--out F] [--wait-notice-at K] [--ballast-mib M] [--ballast-files F]
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

from spotguard import Guard
from spotguard.demo import build_training, emit, wait_for_notice


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.e2e.peer_trainer")
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--bucket")
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--wait-notice-at", type=int)
    parser.add_argument("--ballast-mib", type=int, default=400)
    parser.add_argument("--ballast-files", type=int, default=8)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
    torch.set_num_threads(1)
    state = build_training()
    generator = torch.Generator().manual_seed(11)
    shards = [f"ballast{index}" for index in range(args.ballast_files)]
    for shard in shards:
        state[shard] = torch.rand(args.ballast_mib * (1 << 18) // len(shards), generator=generator)
    guard = Guard(checkpoint_dir=args.checkpoint_dir, bucket=args.bucket, socket=args.socket, handle_sigterm=False)
    step = guard.resume(state)
    emit("resumed", step=step)
    model, optimizer, scheduler, loader = state["model"], state["optimizer"], state["scheduler"], state["loader"]
    stopped = False
    while step < args.steps and not stopped:
        for inputs, targets in loader:
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            for shard in shards:
                state[shard][step :: args.steps] += loss.detach()  # every step leaves its mark in the bulk
            step += 1
            emit("step", step=step)
            if args.wait_notice_at == step:
                wait_for_notice(guard, step)
            if guard.should_checkpoint(step):
                path = guard.save(state, step)
                emit("saved", step=step, path=str(path), stop=guard.stop_requested)
            if guard.stop_requested:
                stopped = True
                break
            if step >= args.steps:
                break
    guard.close()
    if args.out is not None and not stopped:
        final = {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
        torch.save({**final, **{shard: state[shard] for shard in shards}}, args.out)
    emit("stopped" if stopped else "finished", step=step)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
