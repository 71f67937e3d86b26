"""The daemon's upload of a checkpoint already committed on disk against boto3's transfer manager.

The same bytes, the same part size and the same number of threads, interleaved, several runs:

- spotguard: ``upload_checkpoint`` (what the daemon runs for a committed checkpoint: every file's
  parts in one budget of ``--streams`` requests, each part with its CRC32C, the parts' CRC32Cs
  checked against the manifest before completing, the object's CRC32C checked after, the manifest
  last), reading the files from disk (the page cache: they were just written);
- boto3: one ``TransferManager`` (what ``upload_fileobj`` runs) with ``multipart_chunksize`` =
  ``multipart_threshold`` = the part size and ``max_concurrency`` = ``--streams`` (and as many parts
  held in memory, so that boto3's default of 10 does not cap the parts in flight), every file
  submitted at once from memory (``BytesIO`` of the same bytes), the client's pool sized to the
  threads; boto3's own default checksums (CRC32) and, as on HTTPS, no SHA-256 of the payloads.

``--pin-server``: moto alone on one CPU, this process (and the relay) on the others, as a remote
store does not share the client's CPUs. ``--per-connection-mb-s``: every connection through a relay
capped at that rate (a real link to S3).

    python bench/upload_vs_boto3.py --gib 0.5 --tensors 8 --runs 5 --pin-server
    python bench/upload_vs_boto3.py --gib 0.5 --tensors 8 --runs 3 --pin-server --per-connection-mb-s 5
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import os
import resource
import shutil
import tempfile
import time
import zlib
from pathlib import Path

import torch
from boto3.s3.transfer import TransferConfig
from common import MiB, Moto, capped_link, machine, make_state, median, moto_process, write_results
from s3transfer.manager import TransferManager

from spotguard import Guard
from spotguard.manifest import load_manifest
from spotguard.storage.checkpoints import upload_checkpoint
from spotguard.storage.s3 import S3Storage

SPOTGUARD = "spotguard upload_checkpoint (from disk)"
BOTO3 = "boto3 TransferManager / upload_fileobj (from memory)"
BOTO3_FULL = "  same, with the object's full-object CRC32 (ExtraArgs ChecksumCRC32)"
SIDES = {SPOTGUARD: "spotguard", BOTO3: "boto3", BOTO3_FULL: "boto3-full"}


def committed_checkpoint(args: argparse.Namespace, work: Path) -> Path:
    """A checkpoint committed on local disk by the real ``Guard.save`` (no daemon)."""
    torch.set_num_threads(1)
    state = make_state(args.gib, args.tensors)
    guard = Guard(checkpoint_dir=work / "ckpt", socket=work / "no-daemon.sock", handle_sigterm=False)
    try:
        return Path(guard.save(state, 1))
    finally:
        guard.close()


def spotguard_upload(moto: Moto, step_dir: Path, prefix: str, args: argparse.Namespace) -> float:
    storage = S3Storage(moto.url(prefix), max_concurrency=args.streams, part_size=args.part_mib * MiB)
    try:
        storage.warm()
        started = time.perf_counter()
        upload_checkpoint(storage, step_dir, concurrency=args.streams)
        return time.perf_counter() - started
    finally:
        storage.close()


def boto3_upload(
    moto: Moto, files: dict[str, bytes], prefix: str, args: argparse.Namespace, *, full_object: bool = False
) -> float:
    """``full_object``: each object's CRC32 given (``ChecksumCRC32``, a FULL_OBJECT checksum the store
    checks the assembled object against), the integrity spotguard's full-object CRC32C gives."""
    part = args.part_mib * MiB
    # As boto3 runs against S3 on HTTPS, where a part with a checksum header is not SHA-256-signed
    # (on plain HTTP botocore would sign every payload: a slower floor than a real one).
    client = moto.client(max_pool_connections=args.streams, s3={"payload_signing_enabled": False})
    # max_in_memory_upload_chunks (10 by default) would cap parts in flight from memory below the threads.
    config = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=args.streams)
    config.max_in_memory_upload_chunks = max(10, args.streams)  # s3transfer's knob, not in boto3's __init__
    try:
        client.head_bucket(Bucket=moto.bucket)  # the connection and the credentials, as warm() does
        with TransferManager(client, config) as manager:
            # Known before the upload, as the manifest's CRC32Cs are for spotguard: not timed.
            extra = {rel: full_crc32(data, full_object) for rel, data in files.items()}
            started = time.perf_counter()
            futures = [
                manager.upload(io.BytesIO(data), moto.bucket, f"{prefix}/{rel}", extra[rel])
                for rel, data in files.items()
            ]
            for future in futures:
                future.result()
            return time.perf_counter() - started
    finally:
        client.close()


def full_crc32(data: bytes, full_object: bool) -> dict[str, str] | None:
    if not full_object:
        return None
    return {"ChecksumCRC32": base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()}


def moto_pid() -> int | None:
    """The moto server this process started (a child running ``moto.server``)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text()
            if (
                int(stat.rpartition(")")[2].split()[1]) == os.getpid()
                and b"moto.server" in (entry / "cmdline").read_bytes()
            ):
                return int(entry.name)
    return None


def cpu_seconds(pid: int | None) -> float:
    """CPU seconds (user + system) used so far by ``pid`` (None: this process, all its threads)."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=0.5)
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--streams", type=int, default=16, help="threads / requests in flight, both sides")
    parser.add_argument("--part-mib", type=int, default=16)
    parser.add_argument("--pin-server", action="store_true", help="moto alone on one CPU, the clients on the others")
    parser.add_argument("--per-connection-mb-s", type=float, default=None)
    parser.add_argument("--only", choices=sorted(SIDES.values()), default=None, help="one side alone (to profile it)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="upload-vs-boto3-"))
    times: dict[str, list[float]] = {name: [] for name in SIDES}
    cpu: dict[str, list[tuple[float, float]]] = {name: [] for name in SIDES}  # (client, server) CPU seconds
    try:
        step_dir = committed_checkpoint(args, work)
        files = {rel: (step_dir / rel).read_bytes() for rel in load_manifest(step_dir).files}
        nbytes = sum(len(data) for data in files.values())
        with moto_process(pin=args.pin_server) as direct, contextlib.ExitStack() as stack:
            moto = direct
            if args.per_connection_mb_s:
                relay = stack.enter_context(capped_link(direct.endpoint_url, args.per_connection_mb_s * 1e6))
                moto = Moto(relay, direct.bucket)
                os.environ["AWS_ENDPOINT_URL_S3"] = relay
            server = moto_pid()
            for run in range(args.runs):
                names = list(SIDES)
                for name in names[run % 3 :] + names[: run % 3]:
                    side = SIDES[name]
                    if args.only not in (None, side):
                        continue
                    prefix = f"r{run}-{side}"
                    before = cpu_seconds(None), cpu_seconds(server)
                    if name == SPOTGUARD:
                        seconds = spotguard_upload(moto, step_dir, prefix, args)
                    else:
                        seconds = boto3_upload(moto, files, prefix, args, full_object=name == BOTO3_FULL)
                    used = cpu_seconds(None) - before[0], cpu_seconds(server) - before[1]
                    direct.empty(prefix)
                    times[name].append(seconds)
                    cpu[name].append(used)
                    print(
                        f"  run {run}: {name}: {seconds:.2f} s ({nbytes / seconds / 1e6:.0f} MB/s), "
                        f"CPU s client {used[0]:.2f}, server {used[1]:.2f}",
                        flush=True,
                    )
    finally:
        shutil.rmtree(work, ignore_errors=True)
        os.environ.pop("AWS_ENDPOINT_URL_S3", None)
    if args.only:
        return
    summary: dict[str, float] = {}
    ratios: dict[str, list[float]] = {}
    for name, side in SIDES.items():
        summary[f"{side}_s"] = median(times[name])
        summary[f"{side}_mb_s"] = nbytes / median(times[name]) / 1e6
        summary[f"{side}_client_cpu_s"] = median([c for c, _ in cpu[name]])
        summary[f"{side}_server_cpu_s"] = median([s for _, s in cpu[name]])
        if name != SPOTGUARD:  # spotguard's speed over this one's, per run and of the medians
            ratios[side] = [b / s for s, b in zip(times[SPOTGUARD], times[name], strict=True)]
            summary[f"speed_vs_{side}_of_medians"] = median(times[name]) / median(times[SPOTGUARD])
            summary[f"speed_vs_{side}_median_per_run"] = median(ratios[side])
    print(f"\n{nbytes / 1e9:.2f} GB in {len(files)} files, {args.runs} runs; cap {args.per_connection_mb_s} MB/s/conn")
    for key, value in summary.items():
        print(f"  {key}: {value:.3f}")
    for side, values in ratios.items():
        print(f"  per-run speed ratios (spotguard / {side}): " + ", ".join(f"{r:.3f}" for r in values))
    report = {"machine": machine(), "args": vars(args), "samples_s": times, "cpu_s": cpu, "ratios": ratios}
    report["summary"] = summary
    print(f"results: {write_results('upload_vs_boto3', report)}")


if __name__ == "__main__":
    main()
