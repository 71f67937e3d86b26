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
- spotguard ``restore()`` in this process: the CLI's download without interpreter start.

spotguard fetches every file through one pool of ranged GETs, about one range per stream (16):
eight 128 MiB objects go as sixteen 64 MiB ranges. On moto a ranged GET costs time in proportion
to the whole object (it reads the object to slice it: 0.17 s for 8 MiB of a 256 MiB object, 0.39 s
for all of it), which punishes boto3's default 8 MiB ranges of one 1 GiB object most (over a
minute: that row runs in the first run only); the one-GET row is the fair baseline on moto.

``--per-connection-mb-s N`` sends every download through a relay that caps each connection's
answers at N MB/s, as a real link does (S3 gives one connection tens of MB/s): then the number
of streams decides.

    python bench/restore.py --gib 1 --tensors 8 --runs 3
    python bench/restore.py --gib 1 --tensors 8 --runs 3 --per-connection-mb-s 10
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from boto3.s3.transfer import TransferConfig
from common import Moto, capped_link, machine, make_state, median, moto_process, state_bytes, table, write_results

from spotguard import Guard
from spotguard.storage import open_storage
from spotguard.storage.checkpoints import restore, upload_checkpoint

CLI = "spotguard restore (CLI, verified)"
RESUME = "Guard.resume from the bucket (download, verify, load)"
NAIVE = "naive: download_file + torch.load"
NAIVE_ONE = "naive, one GET: download_file + torch.load"
RESTORE_API = "spotguard restore() in process"


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


def restore_in_process(moto: Moto, dest: Path) -> float:
    storage = open_storage(moto.url("sg"))
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
    parser.add_argument(
        "--per-connection-mb-s",
        type=float,
        default=None,
        help="route every download through a relay capping each connection at this many MB/s (a real link)",
    )
    args = parser.parse_args()

    torch.set_num_threads(1)
    state = make_state(args.gib, args.tensors)
    nbytes = state_bytes(state)
    work = Path(tempfile.mkdtemp(prefix="restore-bench-", dir=args.dir))
    times: dict[str, list[float]] = {CLI: [], RESUME: [], RESTORE_API: [], NAIVE: [], NAIVE_ONE: []}
    try:
        with moto_process() as direct, contextlib.ExitStack() as stack:
            seed_bucket(direct, state, work)
            moto = direct
            if args.per_connection_mb_s:
                relay = stack.enter_context(
                    capped_link(direct.endpoint_url, args.per_connection_mb_s * 1e6, downloads=True)
                )
                moto = Moto(relay, direct.bucket)
                os.environ["AWS_ENDPOINT_URL_S3"] = relay  # the CLI, Guard and open_storage() here
            methods = list(times)
            for run in range(args.runs):
                for name in methods[run % len(methods) :] + methods[: run % len(methods)]:
                    if name == NAIVE and (run > 0 or args.per_connection_mb_s):
                        continue  # over a minute a run on moto (ranged GETs), and not what S3 does
                    dest = work / f"dest-{run}-{methods.index(name)}"
                    os.sync()
                    if name == CLI:
                        seconds = cli_restore(moto, dest)
                    elif name == RESTORE_API:
                        seconds = restore_in_process(moto, dest)
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

    os.environ.pop("AWS_ENDPOINT_URL_S3", None)
    rows = [(name, samples) for name, samples in times.items() if samples]
    lines = table(rows, nbytes, reference=NAIVE_ONE)
    summary = {
        "per_connection_cap_mb_s": args.per_connection_mb_s,
        "naive_over_guard_resume": median(times[NAIVE]) / median(times[RESUME]) if times[NAIVE] else None,
        "naive_one_get_over_guard_resume": median(times[NAIVE_ONE]) / median(times[RESUME]),
        "naive_one_get_over_restore": median(times[NAIVE_ONE]) / median(times[RESTORE_API]),
        "guard_resume_over_cli_restore": median(times[RESUME]) / median(times[CLI]),
    }
    print()
    print(f"state {nbytes / 1e9:.2f} GB ({len(state)} tensors), {args.runs} runs each, interleaved and rotated")
    print("\n".join(lines))
    print()
    if summary["naive_over_guard_resume"]:
        print(f"naive (defaults) / Guard.resume: {summary['naive_over_guard_resume']:.2f}x the time")
    print(f"naive (one GET) / Guard.resume: {summary['naive_one_get_over_guard_resume']:.2f}x the time")
    print(f"naive (one GET) / spotguard restore(): {summary['naive_one_get_over_restore']:.2f}x the time")
    report = {
        "bytes": nbytes,
        "tensors": len(state),
        "runs": args.runs,
        "machine": machine(),
        "samples_s": times,
        "summary": summary,
        "table": lines,
    }
    name = "restore" + (f"_capped{args.per_connection_mb_s:g}" if args.per_connection_mb_s else "")
    print(f"results: {write_results(name, report)}")


if __name__ == "__main__":
    main()
