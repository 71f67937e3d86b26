"""CPU-seconds per GiB uploaded, and throughput, for each S3 upload engine against moto.

The bytes are a checkpoint's: ``--files`` files of random data, ``--gib`` GiB together, in RAM
(``/dev/shm``, as a just-written checkpoint sits in the page cache). Each engine uploads all of
them in a subprocess of its own, so that the CPU counted (``getrusage(RUSAGE_SELF)``, user +
system, from the first request to the last answer) is the uploading process's alone: not moto's,
not the relay's, not this parent's. Engines:

- ``spotguard``: ``S3Storage`` with the daemon's defaults (16 MiB parts, 16 streams), called the
  way the uploader calls it (``upload_files``: files in parallel, one budget of streams, per-part
  CRC32C combined and checked against the manifest's, HeadObject after each file), in a process
  that allocates from one heap, as the daemon's does (``spotguard.daemon.heap.use_one_heap``);
- ``spotguard-heaps`` (only when named): the same with glibc's default, a heap per thread;
- ``boto3``: ``upload_file`` with its defaults, file after file (what a user would write);
- ``crt`` (when ``awscrt`` is installed): the AWS CRT S3 client (``awscrt.s3.S3Client``) with TLS
  off, files in parallel, 16 MiB parts, at most as many connections as spotguard's streams, the
  CRC32C computed by the CRT per part (trailing checksums) and the file's full-object CRC32C sent
  at completion; boto3's own CRT transfer manager cannot reach an ``http://`` endpoint (it
  hard-codes TLS; see BENCHMARKS.md).

Runs are interleaved and rotated; medians. ``--per-connection-mb-s`` puts every connection
through a relay that paces client-to-server bytes per connection (``common.capped_link``).

    python bench/s3_cpu.py --gib 1 --files 8 --runs 5
    python bench/s3_cpu.py --gib 1 --files 8 --runs 3 --per-connection-mb-s 5
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import google_crc32c

ENGINES = ("spotguard", "boto3", "crt")
MiB = 1 << 20
GiB = 1 << 30


def _measure(upload: Callable[[], None]) -> dict[str, float]:
    before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    upload()
    wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    # The process's own peak (``ru_maxrss`` would count the parent's, from before the exec).
    peak_mib = int(Path("/proc/self/status").read_text().split("VmHWM:")[1].split()[0]) / 1024
    return {"wall": wall, "cpu": user + system, "user": user, "system": system, "peak_mib": peak_mib}


# -- the engines, each run in a subprocess of its own (``worker``) ------------------------------


def _spotguard(endpoint: str, bucket: str, prefix: str, folder: Path, files: dict[str, Any]) -> dict[str, float]:
    from spotguard.manifest import FileEntry
    from spotguard.storage.checkpoints import upload_files
    from spotguard.storage.s3 import S3Storage

    storage = S3Storage(f"s3://{bucket}/{prefix}", endpoint_url=endpoint)
    storage.warm()  # as the daemon does at start
    entries = {name: FileEntry(**entry) for name, entry in files.items()}
    return _measure(lambda: upload_files(storage, folder, entries))


def _boto3(endpoint: str, bucket: str, prefix: str, folder: Path, files: dict[str, Any]) -> dict[str, float]:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    client.head_bucket(Bucket=bucket)

    def upload() -> None:
        for name in files:
            client.upload_file(str(folder / name), bucket, f"{prefix}{folder.name}/{name}")

    return _measure(upload)


def _crt(endpoint: str, bucket: str, prefix: str, folder: Path, files: dict[str, Any]) -> dict[str, float]:
    from awscrt.auth import AwsCredentialsProvider
    from awscrt.http import HttpHeaders, HttpRequest
    from awscrt.io import ClientBootstrap, DefaultHostResolver, EventLoopGroup
    from awscrt.s3 import (
        S3ChecksumAlgorithm,
        S3ChecksumConfig,
        S3ChecksumLocation,
        S3Client,
        S3RequestTlsMode,
        S3RequestType,
    )

    host = endpoint.removeprefix("http://")
    loops = EventLoopGroup()
    client = S3Client(
        bootstrap=ClientBootstrap(loops, DefaultHostResolver(loops)),
        region=os.environ["AWS_DEFAULT_REGION"],
        tls_mode=S3RequestTlsMode.DISABLED,
        credential_provider=AwsCredentialsProvider.new_environment(),
        part_size=16 * MiB,
        max_active_connections_override=16,
    )
    checksums = S3ChecksumConfig(algorithm=S3ChecksumAlgorithm.CRC32C, location=S3ChecksumLocation.TRAILER)

    def upload() -> None:
        requests = []
        for name, entry in files.items():
            full = base64.b64encode(bytes.fromhex(entry["crc32c"])).decode()
            headers = HttpHeaders(
                [("host", host), ("content-length", str(entry["size"])), ("x-amz-checksum-crc32c", full)]
            )
            request = HttpRequest("PUT", f"/{bucket}/{prefix}{folder.name}/{name}", headers)
            requests.append(
                client.make_request(
                    type=S3RequestType.PUT_OBJECT,
                    request=request,
                    send_filepath=str(folder / name),
                    checksum_config=checksums,
                )
            )
        for made in requests:
            made.finished_future.result()

    measured = _measure(upload)
    import boto3

    checker = boto3.client("s3", endpoint_url=endpoint)
    for name, entry in files.items():  # outside the measurement: what the CRT committed is the manifest's
        head = checker.head_object(Bucket=bucket, Key=f"{prefix}{folder.name}/{name}", ChecksumMode="ENABLED")
        answered = base64.b64decode(head.get("ChecksumCRC32C", "")).hex()
        if head["ContentLength"] != entry["size"] or answered != entry["crc32c"]:
            raise SystemExit(f"crt: {name}: stored {head['ContentLength']} bytes, CRC32C {answered!r}, not {entry}")
    return measured


def worker(engine: str, endpoint: str, bucket: str, prefix: str, folder: str, files_json: str) -> None:
    if engine != "crt":
        # What the default install has: with awscrt importable, botocore signs with it instead.
        sys.modules["awscrt"] = None  # type: ignore[assignment]
    if engine == "spotguard":
        from spotguard.daemon import heap

        heap.use_one_heap()
    files = json.loads(Path(files_json).read_text())
    run = {"spotguard": _spotguard, "spotguard-heaps": _spotguard, "boto3": _boto3, "crt": _crt}[engine]
    print(json.dumps(run(endpoint, bucket, prefix, Path(folder), files)), flush=True)


# -- the parent ------------------------------------------------------------------------------------


def _has_crt() -> bool:
    try:
        import awscrt.s3  # noqa: F401
    except ImportError:
        return False
    return True


def _write_files(folder: Path, gib: float, count: int) -> dict[str, Any]:
    per = int(gib * GiB) // count
    files = {}
    for i in range(count):
        data = os.urandom(per)
        (folder / f"shard{i}.bin").write_bytes(data)
        files[f"shard{i}.bin"] = {"size": per, "crc32c": f"{google_crc32c.value(data):08x}"}
    return files


def main() -> None:
    # Not at the top: the workers must not import torch (``common`` does) into the process measured.
    from common import capped_link, machine, median, moto_process, write_results

    cli = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("--gib", type=float, default=1.0)
    cli.add_argument("--files", type=int, default=8)
    cli.add_argument("--runs", type=int, default=5)
    cli.add_argument("--engines", default=",".join(ENGINES))
    cli.add_argument("--per-connection-mb-s", type=float, default=0.0, help="cap each connection (0: loopback)")
    cli.add_argument("--name", default=None, help="results file name (default from the link)")
    args = cli.parse_args()
    engines = [e for e in args.engines.split(",") if e != "crt" or _has_crt()]
    skipped = sorted(set(args.engines.split(",")) - set(engines))

    with tempfile.TemporaryDirectory(dir="/dev/shm") as scratch, moto_process() as moto:
        folder = Path(scratch) / "step-1"
        folder.mkdir()
        files = _write_files(folder, args.gib, args.files)
        files_json = Path(scratch) / "files.json"
        files_json.write_text(json.dumps(files))
        nbytes = sum(f["size"] for f in files.values())
        link = (
            capped_link(moto.endpoint_url, args.per_connection_mb_s * 1e6)
            if args.per_connection_mb_s
            else contextlib.nullcontext(moto.endpoint_url)
        )
        samples: dict[str, list[dict[str, float]]] = {e: [] for e in engines}
        with link as endpoint:
            for run in range(args.runs):
                for engine in engines[run % len(engines) :] + engines[: run % len(engines)]:
                    prefix = f"{engine}-{uuid.uuid4().hex[:8]}/"
                    command = [sys.executable, __file__, "worker", engine, endpoint, moto.bucket, prefix]
                    out = subprocess.run(
                        [*command, str(folder), str(files_json)],
                        check=True,
                        capture_output=True,
                        text=True,
                    )
                    sample = json.loads(out.stdout.strip().splitlines()[-1])
                    samples[engine].append(sample)
                    moto.empty(prefix)
                    print(
                        f"run {run} {engine:<15} {sample['wall']:6.2f} s  {nbytes / sample['wall'] / 1e6:6.0f} MB/s"
                        f"  {sample['cpu'] / (nbytes / GiB):5.2f} CPU-s/GiB  peak {sample['peak_mib']:4.0f} MiB",
                        flush=True,
                    )

    gib = nbytes / GiB
    link_name = "loopback"
    if args.per_connection_mb_s:
        link_name = f"relay capped at {args.per_connection_mb_s:g} MB/s per connection"
    print(f"\n{args.files} files, {gib:.2f} GiB, moto on 127.0.0.1, {link_name}, medians of {args.runs} runs")
    print("| engine | median s | MB/s | CPU-s per GiB (min-max) | peak resident MiB |")
    print("|---|---:|---:|---:|---:|")
    for engine, runs in samples.items():
        wall = median([r["wall"] for r in runs])
        cpu = [r["cpu"] / gib for r in runs]
        spread = f"{min(cpu):.2f}-{max(cpu):.2f}"
        peak = median([r["peak_mib"] for r in runs])
        print(f"| {engine} | {wall:.2f} | {nbytes / wall / 1e6:.0f} | {median(cpu):.2f} ({spread}) | {peak:.0f} |")
    if skipped:
        print(f"not run: {', '.join(skipped)} (awscrt is not installed)")
    name = args.name or ("s3_cpu_capped" if args.per_connection_mb_s else "s3_cpu_loopback")
    report = {
        "when": datetime.now().isoformat(),
        "machine": machine(),
        "args": vars(args),
        "bytes": nbytes,
        "samples": samples,
    }
    print(f"results: {write_results(name, report)}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(*sys.argv[2:8])
    else:
        main()
