"""Notice -> "committed in the bucket" for a ~1 GiB state, against moto (S3) on 127.0.0.1.

Several ways, in one run, interleaved and rotated, several runs each, medians:

- naive: ``torch.save`` of the state to one file, then boto3 ``upload_file`` with its defaults;
- local write alone: the urgent ``Guard.save`` with no daemon (what the disk and the writer take);
- link limit: a pure parallel upload of the same bytes straight from memory (one object per
  tensor, all parts of all objects in one thread pool, no checksums, no disk), with the best
  part size and concurrency found by a sweep at the start of the run (``max_pool_connections``
  sized to the concurrency): what the loopback link and moto can take at most;
- spotguard: a daemon (``--provider none``) and a trainer subprocess with ``Guard``; the bench
  sends the drill over the daemon's socket (what ``spotguard drill`` sends) at t0; the trainer
  sees the notice at its next step, ``guard.save`` writes the urgent checkpoint (one file per
  tensor, announced to the daemon file by file, uploaded while the next is written), the daemon
  uploads the rest and the manifest; the end is the daemon's ``last_notice.committed_at``.

- spotguard, ranges announced: the same daemon, and a trainer side that writes each tensor's file
  in 8 MiB ``pwrite`` chunks and sends a ``file-range`` message per chunk (what the parallel writer
  sends), so that the daemon uploads each part as soon as it is written; its floor is that writer
  alone, with no daemon.

The floor is max(local write alone, link limit): a notice -> committed near it means the upload ran
while the state was being written (files stream while the trainer writes them, announced in
``file-range`` messages, where the writer sends them). ``--per-connection-mb-s`` runs the same over a
relay capping each connection (a real link); choose it so that the write and the upload take about
as long to see the overlap at its largest.

Overlap saving: for each spotguard run, the same committed checkpoint is uploaded again with
``upload_checkpoint`` alone (what the daemon would do without the early per-file uploads); "serial"
= (notice -> committed locally) + that upload time, compared with the measured notice -> committed.

    python bench/upload_deadline.py --gib 1 --tensors 8 --runs 3
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import google_crc32c
import torch
from boto3.s3.transfer import TransferConfig
from common import (
    MiB,
    Moto,
    capped_link,
    machine,
    make_state,
    median,
    moto_process,
    state_bytes,
    table,
    write_results,
)

from spotguard.control import request
from spotguard.harness import Vm, wait_for
from spotguard.storage import open_storage
from spotguard.storage.checkpoints import upload_checkpoint

TRAINER = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from common import make_state
from spotguard import Guard
from spotguard.harness import wait_for
torch.set_num_threads(1)
state = make_state(float(sys.argv[4]), int(sys.argv[5]))
guard = Guard(checkpoint_dir=sys.argv[2], socket=sys.argv[3], handle_sigterm=False)
wait_for(guard.client.connected.is_set, 30, "the daemon")
print(json.dumps({"ready": True}), flush=True)
step = 0
while True:
    step += 1
    if guard.should_checkpoint(step):
        path = guard.save(state, step)
        print(json.dumps({"saved": str(path), "timeline": guard.timeline}), flush=True)
        break
    time.sleep(0.001)  # one training step
guard.close()
"""

WRITER = """
import sys, time
sys.path.insert(0, sys.argv[1])
import torch
from common import make_state
from spotguard import Guard
torch.set_num_threads(1)
state = make_state(float(sys.argv[3]), int(sys.argv[4]))
guard = Guard(checkpoint_dir=sys.argv[2], socket=sys.argv[2] + "/no-daemon.sock", handle_sigterm=False)
print("ready", flush=True)
sys.stdin.readline()
started = time.perf_counter()
guard.save(state, 1, reason="urgent")
print(time.perf_counter() - started, flush=True)
guard.close()
"""

RANGE_WRITER = """
import json, os, sys, threading, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import google_crc32c, torch
from common import make_state
from spotguard.crc32c import crc32c_hex
from spotguard.localstore import CheckpointWriter
from spotguard.manifest import FileEntry
from spotguard.safefile import TMP_MARK
from spotguard.trainer.client import DaemonClient
torch.set_num_threads(1)
root, sock, alone = Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[6] == "alone"
pace = float(sys.argv[7])  # bytes/s the writer may not exceed (a slower disk); 0: as fast as it goes
ranges = sys.argv[8] == "ranges"  # else only a file message per finished file (the A/B of streaming)
state = make_state(float(sys.argv[4]), int(sys.argv[5]))
told, ok, notice = threading.Event(), threading.Event(), {}
def on_message(message):
    if message["type"] == "checkpoint-now":
        notice.update(message["notice"])
        told.set()
    elif message["type"] == "ok":
        ok.set()
client = DaemonClient(sock, {"rank": 0, "world_size": 1, "pid": os.getpid(), "checkpoint_dir": str(root)}, on_message)
if not alone:
    client.start()
    client.welcomed.wait(30)
print(json.dumps({"ready": True}), flush=True)
if alone:
    sys.stdin.readline()
else:
    told.wait(300)
t_told = time.time()
start, written = time.perf_counter(), 0
writer = CheckpointWriter(root, 1, reason="urgent")
writer.prepare()
for name, tensor in state.items():
    view = tensor.numpy().data.cast("B")
    rel = name + ".bin"
    target = writer.dir / rel
    tmp = target.with_name("." + rel + TMP_MARK + str(os.getpid()))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    crc = 0
    for offset in range(0, len(view), 8 << 20):
        chunk = bytes(view[offset : offset + (8 << 20)])  # google-crc32c takes bytes only
        os.pwrite(fd, chunk, offset)
        written += len(chunk)
        if pace and (ahead := written / pace - (time.perf_counter() - start)) > 0:
            time.sleep(ahead)  # pacing the simulated disk
        crc = google_crc32c.extend(crc, chunk)
        if ranges:
            client.send("file-range", path=str(writer.dir), name=rel, tmp=tmp.name, size=len(view), offset=offset,
                        length=len(chunk))
    os.fsync(fd)
    os.close(fd)
    tmp.rename(target)
    writer.files[rel] = FileEntry(len(view), crc32c_hex(crc))
    client.send("file", path=str(writer.dir), name=rel, size=len(view), crc32c=crc32c_hex(crc))
writer.commit()
t_local = time.time()
if not alone:
    client.send("saved", path=str(writer.dir), step=1, reason="urgent", event_id=notice["event_id"])
    ok.wait(30)
print(json.dumps({"saved": str(writer.dir), "seconds": t_local - t_told,
                  "timeline": {"told": t_told, "committed_local": t_local}}), flush=True)
client.close()
"""

NAIVE = "naive: torch.save + upload_file (defaults)"
WRITE = "local write alone: urgent Guard.save, no daemon"
LINK = "link limit: parallel multipart from memory"
LINK_CRC = "  same, with per-part + full-object CRC32C"
LINK_WRITING = "  same, while the state is also written to local disk"
SPOTGUARD = "spotguard: drill -> urgent save -> daemon upload"
SERIAL = "  spotguard without overlap (local commit + upload)"
RANGES = "spotguard, ranges announced: drill -> range writer -> daemon upload"
RANGE_WRITE = "  range writer alone (no daemon)"


def views(state: dict[str, torch.Tensor]) -> dict[str, memoryview]:
    return {name: t.numpy().data.cast("B") for name, t in state.items()}


def parallel_upload(
    moto: Moto,
    data: dict[str, memoryview],
    prefix: str,
    part: int,
    concurrency: int,
    whole_crc32c: dict[str, str] | None = None,
) -> float:
    """Every part of every object in one pool; returns seconds from the first request to the last completion.

    ``whole_crc32c`` (base64, per object, computed beforehand): send each part's CRC32C and the
    full-object one, as spotguard does; moto then checks and combines them, server CPU that real
    S3 spends on its side but that here comes out of the same two cores."""
    crc32c = whole_crc32c is not None
    client = moto.client(
        max_pool_connections=concurrency + 4,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3={"payload_signing_enabled": False},  # no SHA-256 of every part (as over HTTPS with a checksum)
    )
    try:
        started = time.perf_counter()
        checksum: dict[str, str] = {"ChecksumAlgorithm": "CRC32C", "ChecksumType": "FULL_OBJECT"} if crc32c else {}
        uploads = {
            name: client.create_multipart_upload(Bucket=moto.bucket, Key=f"{prefix}/{name}", **checksum)["UploadId"]
            for name in data
        }

        def send(name: str, number: int, offset: int) -> tuple[str, int, str]:
            body = bytes(data[name][offset : offset + part])
            extra = {}
            if crc32c:
                crc = int(google_crc32c.value(body)).to_bytes(4, "big")
                extra = {"ChecksumAlgorithm": "CRC32C", "ChecksumCRC32C": base64.b64encode(crc).decode()}
            resp = client.upload_part(
                Bucket=moto.bucket,
                Key=f"{prefix}/{name}",
                UploadId=uploads[name],
                PartNumber=number,
                Body=body,
                **extra,
            )
            return name, number, resp["ETag"] + "|" + resp.get("ChecksumCRC32C", "")

        jobs = [(name, i + 1, off) for name, mv in data.items() for i, off in enumerate(range(0, len(mv), part))]
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            done = list(pool.map(lambda job: send(*job), jobs))
        for name, upload_id in uploads.items():
            parts = []
            for _, number, tag in sorted(job for job in done if job[0] == name):
                etag, _, crc = tag.partition("|")
                parts.append({"PartNumber": number, "ETag": etag, **({"ChecksumCRC32C": crc} if crc32c else {})})
            whole = {"ChecksumCRC32C": whole_crc32c[name], "ChecksumType": "FULL_OBJECT"} if whole_crc32c else {}
            client.complete_multipart_upload(
                Bucket=moto.bucket,
                Key=f"{prefix}/{name}",
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
                **whole,
            )
        return time.perf_counter() - started
    finally:
        client.close()


def whole_crcs(data: dict[str, memoryview]) -> dict[str, str]:
    return {
        name: base64.b64encode(int(google_crc32c.value(bytes(mv))).to_bytes(4, "big")).decode()
        for name, mv in data.items()
    }


def sweep(
    moto: Moto, state: dict[str, torch.Tensor], sweep_mib: int, points: list[tuple[int, int]]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Best (part size, concurrency) for the link-limit upload, on the first ``sweep_mib`` MiB of the state."""
    budget = sweep_mib * MiB
    data: dict[str, memoryview] = {}
    for name, mv in views(state).items():
        if budget <= 0:
            break
        data[name] = mv[: min(len(mv), budget)]
        budget -= len(data[name])
    nbytes = sum(len(mv) for mv in data.values())
    results = []
    for part_mib, concurrency in points:
        seconds = parallel_upload(moto, data, "sweep", part_mib * MiB, concurrency)
        moto.empty("sweep/")
        results.append({"part_mib": part_mib, "concurrency": concurrency, "mb_s": nbytes / seconds / 1e6})
        print(f"  sweep: part {part_mib:>2} MiB, {concurrency:>2} in flight: {results[-1]['mb_s']:6.0f} MB/s")
    best = max(results, key=lambda r: r["mb_s"])
    return best, results


@contextlib.contextmanager
def started_writer(
    work: Path, prefix: str, script: str, args_for: Callable[[Path], list[str]], is_ready: Callable[[str], bool]
) -> Iterator[subprocess.Popen[str]]:
    """A writer process on a fresh local directory, told to go once it says it is ready; it must
    exit cleanly after the block; the directory is removed either way."""
    local = work / f"{prefix}-local"
    local.mkdir()
    writer = subprocess.Popen(
        [sys.executable, "-c", script, str(Path(__file__).parent), str(local), *args_for(local)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdin is not None and writer.stdout is not None
        assert is_ready(writer.stdout.readline())
        writer.stdin.write("go\n")
        writer.stdin.flush()
        yield writer
        assert writer.wait(timeout=120) == 0
    finally:
        if writer.poll() is None:
            writer.kill()
        shutil.rmtree(local, ignore_errors=True)


def guard_writer(args: argparse.Namespace, work: Path, prefix: str) -> contextlib.AbstractContextManager[Any]:
    """The urgent ``Guard.save`` of the state, in its own process (prints ``ready``, then its seconds)."""
    return started_writer(
        work, prefix, WRITER, lambda _: [str(args.gib), str(args.tensors)], lambda line: line.strip() == "ready"
    )


def write_alone(args: argparse.Namespace, work: Path, prefix: str) -> float:
    """The urgent save to local disk with nothing uploading: seconds of ``Guard.save`` in its process."""
    with guard_writer(args, work, prefix) as writer:
        return float(writer.stdout.readline())


def range_write_alone(args: argparse.Namespace, work: Path, prefix: str) -> float:
    """The writer that announces ranges, with no daemon: what its local write takes alone."""
    extra = [str(args.gib), str(args.tensors), "alone", str(args.write_mb_s * 1e6), "ranges"]
    with started_writer(
        work, prefix, RANGE_WRITER, lambda local: [str(local / "none.sock"), *extra],
        lambda line: json.loads(line) == {"ready": True},
    ) as writer:  # fmt: skip
        return float(json.loads(writer.stdout.readline())["seconds"])


def link_while_writing(
    moto: Moto, state: dict[str, torch.Tensor], args: argparse.Namespace, work: Path, prefix: str, best: dict[str, Any]
) -> float:
    """The link limit while another process writes the same state to local disk (``Guard.save``,
    urgent): what the design's local staging alone costs the upload on this machine."""
    with guard_writer(args, work, prefix):
        return parallel_upload(moto, views(state), prefix, best["part_mib"] * MiB, best["concurrency"])


def naive(moto: Moto, state: dict[str, torch.Tensor], work: Path, prefix: str) -> float:
    path = work / "model.pt"
    client = moto.client()
    try:
        started = time.perf_counter()
        torch.save(state, path)
        client.upload_file(str(path), moto.bucket, f"{prefix}/model.pt", Config=TransferConfig())
        return time.perf_counter() - started
    finally:
        client.close()
        path.unlink(missing_ok=True)


def spotguard_run(
    moto: Moto,
    args: argparse.Namespace,
    work: Path,
    prefix: str,
    streams: int,
    *,
    ranges: bool = False,
    announce: str = "ranges",
) -> dict[str, float]:
    """One notice, end to end; plus the same checkpoint uploaded again without overlap.

    ``streams``: the daemon's ``upload_concurrency``, set to the link limit's best concurrency (the
    knob a user tunes to the link; the default, 16, is for S3, where each connection is capped)."""
    vm = Vm(work, prefix, moto.url(prefix), extra_args=["--provider", "none"])
    # scan_interval 2 s: the default (Vm's is 0.5 for tests).
    vm.start_daemon(env={"SPOTGUARD_SCAN_INTERVAL": "2", "SPOTGUARD_UPLOAD_CONCURRENCY": str(streams)})
    bench_dir, size = str(Path(__file__).parent), [str(args.gib), str(args.tensors)]
    script, mode = (RANGE_WRITER, ["daemon", str(args.write_mb_s * 1e6), announce]) if ranges else (TRAINER, [])
    trainer = subprocess.Popen(
        [sys.executable, "-c", script, bench_dir, str(vm.root), str(vm.socket), *size, *mode],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert trainer.stdout is not None
        assert json.loads(trainer.stdout.readline()) == {"ready": True}
        t_notice = time.time()
        request(vm.socket, "drill", deadline_s=120)
        status = wait_for(
            lambda: (s := vm.status())["last_notice"] and s["last_notice"].get("committed_at") and s,
            300,
            "the urgent checkpoint in the bucket",
            interval=0.01,
        )
        t_committed = datetime.fromisoformat(status["last_notice"]["committed_at"]).timestamp()
        saved = json.loads(trainer.stdout.readline())
        assert trainer.wait(timeout=60) == 0
    finally:
        if trainer.poll() is None:
            trainer.kill()
        vm.stop_daemon()
    step_dir = Path(saved["saved"])
    timeline = saved["timeline"]
    # The same checkpoint, uploaded by upload_checkpoint alone with the daemon's settings.
    storage = open_storage(moto.url(f"{prefix}-serial"), max_concurrency=streams)
    try:
        storage.warm()  # type: ignore[attr-defined]
        started = time.perf_counter()
        upload_checkpoint(storage, step_dir, concurrency=streams)
        upload_alone = time.perf_counter() - started
    finally:
        storage.close()
    shutil.rmtree(vm.dir, ignore_errors=True)
    return {
        "notice_to_committed": t_committed - t_notice,
        "notice_to_told": timeline["told"] - t_notice,
        "notice_to_local_commit": timeline["committed_local"] - t_notice,
        "upload_alone": upload_alone,
        "serial": timeline["committed_local"] - t_notice + upload_alone,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--sweep-mib", type=int, default=256, help="bytes per sweep point of the link limit")
    parser.add_argument(
        "--sweep", default="8x1,8x8,8x16,16x1,16x8,16x16,16x32,32x8,32x32", help="PART_MIBxCONCURRENCY,..."
    )
    parser.add_argument("--dir", type=Path, default=None, help="local disk for checkpoints (default: a temp dir)")
    parser.add_argument(
        "--pin-server", action="store_true", help="moto on CPU 0 alone, everything else on the others (a remote store)"
    )
    parser.add_argument(
        "--per-connection-mb-s",
        type=float,
        default=None,
        help="route every upload through a relay capping each connection at this many MB/s (a real link)",
    )
    parser.add_argument(
        "--write-mb-s",
        type=float,
        default=0.0,
        help="pace the range writer (alone and with the daemon) to this many MB/s: a disk as slow as the link",
    )
    args = parser.parse_args()
    points = [(int(p), int(c)) for p, c in (item.split("x") for item in args.sweep.split(","))]

    torch.set_num_threads(1)
    state = make_state(args.gib, args.tensors)
    nbytes = state_bytes(state)
    work = Path(tempfile.mkdtemp(prefix="upload-deadline-", dir=args.dir))
    times: dict[str, list[float]] = {NAIVE: [], WRITE: [], LINK: [], LINK_CRC: [], LINK_WRITING: [], SPOTGUARD: []}
    times.update({RANGE_WRITE: [], RANGES: []})
    range_details: list[dict[str, float]] = []
    crcs = whole_crcs(views(state))
    details: list[dict[str, float]] = []
    try:
        with moto_process(pin=args.pin_server) as direct, contextlib.ExitStack() as stack:
            moto = direct
            if args.per_connection_mb_s:
                relay = stack.enter_context(capped_link(direct.endpoint_url, args.per_connection_mb_s * 1e6))
                moto = Moto(relay, direct.bucket)
                os.environ["AWS_ENDPOINT_URL_S3"] = relay  # the daemon and open_storage() here
            print(f"state: {nbytes / (1 << 30):.2f} GiB in {len(state)} tensors; uploads to {moto.endpoint_url}")
            best, sweep_results = sweep(moto, state, args.sweep_mib, points)
            print(f"link limit settings: part {best['part_mib']} MiB, {best['concurrency']} in flight")
            methods = list(times)
            for run in range(args.runs):
                for name in methods[run % len(methods) :] + methods[: run % len(methods)]:
                    prefix = f"r{run}-m{methods.index(name)}"
                    if name == NAIVE:
                        seconds = naive(moto, state, work, prefix)
                    elif name == WRITE:
                        seconds = write_alone(args, work, prefix)
                    elif name == RANGE_WRITE:
                        seconds = range_write_alone(args, work, prefix)
                    elif name == RANGES:
                        detail = spotguard_run(moto, args, work, prefix, best["concurrency"], ranges=True)
                        range_details.append(detail)
                        seconds = detail["notice_to_committed"]
                    elif name == LINK_WRITING:
                        seconds = link_while_writing(moto, state, args, work, prefix, best)
                    elif name in (LINK, LINK_CRC):
                        seconds = parallel_upload(
                            moto,
                            views(state),
                            prefix,
                            best["part_mib"] * MiB,
                            best["concurrency"],
                            crcs if name == LINK_CRC else None,
                        )
                    else:
                        detail = spotguard_run(moto, args, work, prefix, best["concurrency"])
                        details.append(detail)
                        seconds = detail["notice_to_committed"]
                    times[name].append(seconds)
                    direct.empty(prefix)
                    print(f"  run {run}: {name}: {seconds:.2f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    serial = [d["serial"] for d in details]
    rows = [*times.items(), (SERIAL, serial)]
    lines = table(rows, nbytes, reference=LINK)
    sg, link, nv, ser = (median(times[SPOTGUARD]), median(times[LINK]), median(times[NAIVE]), median(serial))
    parts = {k: median([d[k] for d in details]) for k in details[0]}
    # The floor of notice -> committed: neither the disk nor the link can go faster alone.
    write, floor = median(times[WRITE]), max(median(times[WRITE]), link)
    summary = {
        "moto_loopback_ceiling_mb_s": best["mb_s"],
        "single_connection_mb_s": max((r["mb_s"] for r in sweep_results if r["concurrency"] == 1), default=None),
        "per_connection_cap_mb_s": args.per_connection_mb_s,
        "server_pinned": args.pin_server,
        "spotguard_throughput_over_link_limit": link / sg,
        "spotguard_throughput_over_link_limit_with_crc32c": median(times[LINK_CRC]) / sg,
        "spotguard_throughput_over_link_limit_while_writing": median(times[LINK_WRITING]) / sg,
        "write_alone_s": write,
        "link_limit_s": link,
        "write_over_upload": write / link,
        "spotguard_time_over_max_write_upload": sg / floor,
        "spotguard_time_over_naive": sg / nv,
        "ranges_time_over_max_write_upload": median(times[RANGES]) / max(median(times[RANGE_WRITE]), link),
        "ranges_time_over_naive": median(times[RANGES]) / nv,
        "ranges_throughput_over_link_limit": link / median(times[RANGES]),
        "range_writer_alone_s": median(times[RANGE_WRITE]),
        "ranges_phases_median_s": {k: median([d[k] for d in range_details]) for k in range_details[0]},
        "naive_time_over_spotguard": nv / sg,
        "overlap_saving_s": ser - sg,
        "overlap_saving_fraction": (ser - sg) / ser,
        "spotguard_phases_median_s": parts,
    }
    print()
    print(f"state {nbytes / 1e9:.2f} GB ({len(state)} tensors), {args.runs} runs each, interleaved and rotated")
    print("\n".join(lines))
    print()
    cap = f"each connection capped at {args.per_connection_mb_s} MB/s" if args.per_connection_mb_s else "loopback"
    print(f"link limit ({cap}, best sweep point): {best['mb_s']:.0f} MB/s; one connection: "
          f"{summary['single_connection_mb_s'] or float('nan'):.0f} MB/s")  # fmt: skip
    print(
        f"spotguard throughput / link limit: {summary['spotguard_throughput_over_link_limit']:.2f} (target >= 0.9); "
        f"/ link limit with CRC32C: {summary['spotguard_throughput_over_link_limit_with_crc32c']:.2f}; "
        f"/ link limit while writing locally: {summary['spotguard_throughput_over_link_limit_while_writing']:.2f}"
    )
    print(
        f"spotguard time / max(write alone {write:.2f} s, link-limit upload {link:.2f} s): "
        f"{summary['spotguard_time_over_max_write_upload']:.2f} (target <= 1.15 on a capped link); "
        f"write / upload: {summary['write_over_upload']:.2f}"
    )
    print(f"spotguard time / naive time: {summary['spotguard_time_over_naive']:.2f}")
    print(
        f"with ranges announced: time / max(range writer alone {summary['range_writer_alone_s']:.2f} s, link "
        f"{link:.2f} s): {summary['ranges_time_over_max_write_upload']:.2f} (target <= 1.15 capped); "
        f"throughput / link limit {summary['ranges_throughput_over_link_limit']:.2f} (target >= 0.9 loopback); "
        f"time / naive {summary['ranges_time_over_naive']:.2f} (target <= 1)"
    )
    print(
        f"overlap saving: {summary['overlap_saving_s']:.2f} s ({summary['overlap_saving_fraction']:.0%}) "
        f"of {ser:.2f} s serial; phases (median s): " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items())
    )
    report = {
        "bytes": nbytes,
        "tensors": len(state),
        "runs": args.runs,
        "machine": machine(),
        "link_limit_settings": best,
        "sweep": sweep_results,
        "samples_s": {name: samples for name, samples in rows},
        "spotguard_runs": details,
        "summary": summary,
        "table": lines,
    }
    name = "upload_deadline" + (f"_capped{args.per_connection_mb_s:g}" if args.per_connection_mb_s else "")
    print(f"results: {write_results(name, report)}")
    os.environ.pop("AWS_ENDPOINT_URL_S3", None)


if __name__ == "__main__":
    main()
