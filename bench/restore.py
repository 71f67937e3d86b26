"""Restore of a ~1 GiB checkpoint from moto (S3) on 127.0.0.1: spotguard vs the naive way.

The same state (float32 tensors of random data) is in the bucket twice: as a spotguard checkpoint
(one object per tensor + RNG states + manifest, uploaded by ``upload_checkpoint``) and as one
``torch.save`` file (uploaded by ``upload_file``). Each run, interleaved and rotated:

- ``spotguard restore s3://... DEST`` (a subprocess, as a user runs it: interpreter start and
  imports included): newest complete checkpoint, parallel download, CRC32C of every file;
- ``Guard.resume(state)`` on a fresh local root (in this process): the same download, then the
  tensors loaded into ``state`` (what a trainer on a fresh VM does);
- naive: boto3 ``download_file`` (defaults: 8 MiB ranged GETs, 10 threads) + ``torch.load(weights_only=True)``;
- naive, one GET: the same with ``multipart_threshold`` above the object size (a single stream);
- spotguard ``restore()`` with one GET per object (``S3Storage(multipart_threshold=...)`` above
  the object size; objects still in parallel): what ``spotguard restore`` does minus moto's
  ranged-GET penalty (see below).

On moto a ranged GET costs time proportional to the whole object (it reads the object to slice
it: 0.17 s for 8 MiB of a 256 MiB object, 0.39 s for all of it), so ranged downloads of one big
object are slow there and not on S3: the one-GET rows are the fair comparison on moto. The
default naive row (ranged GETs of one 1 GiB object: over a minute) runs in the first run only.

    python bench/restore.py --gib 1 --tensors 8 --runs 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from boto3.s3.transfer import TransferConfig
from common import Moto, machine, make_state, median, moto_process, state_bytes, table, write_results

from spotguard import Guard
from spotguard.storage import open_storage
from spotguard.storage.checkpoints import restore, upload_checkpoint
from spotguard.storage.s3 import S3Storage

CLI = "spotguard restore (CLI, verified)"
RESUME = "Guard.resume from the bucket (download, verify, load)"
NAIVE = "naive: download_file + torch.load"
NAIVE_ONE = "naive, one GET: download_file + torch.load"
RESTORE_ONE = "spotguard restore(), one GET per object"


def seed_bucket(moto: Moto, state: dict[str, torch.Tensor], work: Path) -> None:
    guard = Guard(checkpoint_dir=work / "src", socket=work / "none.sock", handle_sigterm=False)
    try:
        step_dir = guard.save(state, 100, reason="urgent")
    finally:
        guard.close()
    storage = open_storage(moto.url("sg"))
    try:
        upload_checkpoint(storage, step_dir)
    finally:
        storage.close()
    torch.save(state, work / "model.pt")
    client = moto.client()
    try:
        client.upload_file(str(work / "model.pt"), moto.bucket, "naive/model.pt")
    finally:
        client.close()
    shutil.rmtree(work / "src")
    (work / "model.pt").unlink()


def cli_restore(moto: Moto, dest: Path) -> float:
    started = time.perf_counter()
    command = [sys.executable, "-m", "spotguard", "restore", moto.url("sg"), str(dest)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def guard_resume(moto: Moto, template: dict[str, torch.Tensor], dest: Path, work: Path) -> float:
    started = time.perf_counter()
    guard = Guard(checkpoint_dir=dest, bucket=moto.url("sg"), socket=work / "none.sock", handle_sigterm=False)
    try:
        step = guard.resume(template)
    finally:
        guard.close()
    seconds = time.perf_counter() - started
    assert step == 100, step
    return seconds


def restore_one_get(moto: Moto, dest: Path) -> float:
    storage = S3Storage(moto.url("sg"), multipart_threshold=1 << 50)
    try:
        started = time.perf_counter()
        target = restore(storage, dest)
        seconds = time.perf_counter() - started
    finally:
        storage.close()
    assert target is not None and target.name == "step-000000100"
    return seconds


def naive_restore(moto: Moto, dest: Path, one_get: bool) -> tuple[float, dict[str, torch.Tensor]]:
    dest.mkdir(parents=True)
    client = moto.client()
    config = TransferConfig(multipart_threshold=1 << 50) if one_get else TransferConfig()
    try:
        started = time.perf_counter()
        client.download_file(moto.bucket, "naive/model.pt", str(dest / "model.pt"), Config=config)
        loaded = torch.load(dest / "model.pt", weights_only=True)
        return time.perf_counter() - started, loaded
    finally:
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="local disk to restore to (default: a temp dir)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    state = make_state(args.gib, args.tensors)
    nbytes = state_bytes(state)
    work = Path(tempfile.mkdtemp(prefix="restore-bench-", dir=args.dir))
    times: dict[str, list[float]] = {CLI: [], RESUME: [], RESTORE_ONE: [], NAIVE: [], NAIVE_ONE: []}
    try:
        with moto_process() as moto:
            seed_bucket(moto, state, work)
            methods = list(times)
            for run in range(args.runs):
                for name in methods[run % len(methods) :] + methods[: run % len(methods)]:
                    if name == NAIVE and run > 0:
                        continue  # over a minute a run on moto (ranged GETs), and not what S3 does
                    dest = work / f"dest-{run}-{methods.index(name)}"
                    os.sync()
                    if name == CLI:
                        seconds = cli_restore(moto, dest)
                    elif name == RESTORE_ONE:
                        seconds = restore_one_get(moto, dest)
                    elif name == RESUME:
                        template = {key: torch.zeros_like(value) for key, value in state.items()}
                        seconds = guard_resume(moto, template, dest, work)
                        assert all(torch.equal(template[k], state[k]) for k in state), "resumed tensors differ"
                        del template
                    else:
                        seconds, loaded = naive_restore(moto, dest, one_get=name == NAIVE_ONE)
                        assert all(torch.equal(loaded[k], state[k]) for k in state), "loaded tensors differ"
                        del loaded
                    times[name].append(seconds)
                    shutil.rmtree(dest, ignore_errors=True)
                    print(f"  run {run}: {name}: {seconds:.2f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    rows = list(times.items())
    lines = table(rows, nbytes, reference=NAIVE)
    summary = {
        "naive_over_guard_resume": median(times[NAIVE]) / median(times[RESUME]),
        "naive_one_get_over_guard_resume": median(times[NAIVE_ONE]) / median(times[RESUME]),
        "naive_one_get_over_restore_one_get": median(times[NAIVE_ONE]) / median(times[RESTORE_ONE]),
        "guard_resume_over_cli_restore": median(times[RESUME]) / median(times[CLI]),
    }
    print()
    print(f"state {nbytes / 1e9:.2f} GB ({len(state)} tensors), {args.runs} runs each, interleaved and rotated")
    print("\n".join(lines))
    print()
    print(f"naive (defaults) / Guard.resume: {summary['naive_over_guard_resume']:.2f}x the time")
    print(f"naive (one GET) / Guard.resume: {summary['naive_one_get_over_guard_resume']:.2f}x the time")
    print(
        "naive (one GET) / spotguard restore() with one GET per object: "
        f"{summary['naive_one_get_over_restore_one_get']:.2f}x the time"
    )
    report = {
        "bytes": nbytes,
        "tensors": len(state),
        "runs": args.runs,
        "machine": machine(),
        "samples_s": times,
        "summary": summary,
        "table": lines,
    }
    print(f"results: {write_results('restore', report)}")


if __name__ == "__main__":
    main()
