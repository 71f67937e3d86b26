"""Idle cost of the daemon: memory and CPU while it watches the metadata service and nothing happens.

One real daemon subprocess per provider polls its emulator every ``--poll-interval`` s (AWS: four
IMDS paths per poll; Azure: Scheduled Events; GCP: one long-poll held open), plus one with
provider ``none`` as the baseline (socket server and uploader only). All run side by side for
``--seconds``; each is sampled once its monitor has read the service, and again at the end:
RSS from ``/proc/PID/status`` (VmRSS), CPU time from ``/proc/PID/stat`` (utime + stime). Every
daemon has the default 2 s rescan of the local root and a ``file://`` bucket, or with ``--bucket s3``
a prefix of its own in an S3 bucket on a local moto server (its client, credentials and connection
set up at start, as on a VM; boto3 loaded). The emulators run in this process and moto in its own,
so their CPU is not counted against the daemons.

    python bench/idle_cost.py --seconds 60 [--bucket s3]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import subprocess
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from common import moto_process

from spotguard.emulate.common import RunningEmulator
from spotguard.emulate.registry import start_emulator
from spotguard.harness import Vm, wait_for

PROVIDERS = ("none", "aws", "gcp", "azure")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
SCAN_INTERVAL = "2"


@dataclass(frozen=True)
class Sample:
    at: float  # time.monotonic()
    rss_kib: int
    cpu_s: float  # user + system


def sample(pid: int) -> Sample:
    rss_kib = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
    stat = Path(f"/proc/{pid}/stat").read_text()
    # Fields after the command name (which may hold spaces) in parentheses; utime, stime are 14, 15.
    fields = stat[stat.rindex(")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])
    return Sample(time.monotonic(), rss_kib, (utime + stime) / CLOCK_TICKS)


def metadata_requests(emu: RunningEmulator | None) -> int:
    return 0 if emu is None else len(emu.requests())


def has_read(provider: str, emu: RunningEmulator | None) -> bool:
    if emu is None:
        return True
    if provider == "gcp":
        return bool(emu.state()["waiting"] == 1)  # first plain read done, long-poll held
    return metadata_requests(emu) > 0


def git_head() -> str | None:
    """The commit the tree was at (the tree may also hold uncommitted work)."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="measurement window (default 60)")
    parser.add_argument("--poll-interval", type=float, default=1.0, help="daemon poll interval, s (default 1)")
    parser.add_argument("--bucket", choices=("file", "s3"), default="file", help="the daemons' bucket (default file)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "idle_cost.json")
    args = parser.parse_args()
    if args.seconds <= 0:
        parser.error("--seconds must be > 0")

    emulators: dict[str, RunningEmulator] = {}
    vms: dict[str, Vm] = {}
    results: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        base = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="spotguard-idle-")))
        moto = stack.enter_context(moto_process()) if args.bucket == "s3" else None
        (base / "bucket").mkdir()
        try:
            for provider in PROVIDERS:
                extra = ["--provider", "none"]
                if provider != "none":
                    emulators[provider] = emu = start_emulator(provider)
                    extra = ["--provider", provider, "--metadata-url", emu.url]
                url = moto.url(provider) if moto is not None else (base / "bucket").as_uri()
                vms[provider] = vm = Vm(base, provider, url, extra_args=extra)
                # The documented default rescan of local root and bucket (Vm's own default is the tests' 0.5 s).
                vm.start_daemon(
                    env={"SPOTGUARD_POLL_INTERVAL": str(args.poll_interval), "SPOTGUARD_SCAN_INTERVAL": SCAN_INTERVAL}
                )
            for provider in PROVIDERS:
                first_read = functools.partial(has_read, provider, emulators.get(provider))
                wait_for(first_read, 20, f"the {provider} daemon's first read of its metadata service")
            start = {p: (sample(_pid(vm)), metadata_requests(emulators.get(p))) for p, vm in vms.items()}
            print(f"{len(vms)} daemons up; measuring for {args.seconds:g} s", flush=True)
            time.sleep(args.seconds)  # the measurement window itself
            end = {p: (sample(_pid(vm)), metadata_requests(emulators.get(p))) for p, vm in vms.items()}
            for provider, vm in vms.items():
                assert vm.process is not None and vm.process.poll() is None, f"the {provider} daemon died"
        finally:
            for vm in vms.values():
                vm.stop_daemon()
            for emu in emulators.values():
                emu.stop()

    for provider in PROVIDERS:
        (first, requests_first), (last, requests_last) = start[provider], end[provider]
        window = last.at - first.at
        cpu = last.cpu_s - first.cpu_s
        results[provider] = {
            "window_s": round(window, 2),
            "rss_mb_start": round(first.rss_kib / 1024, 1),
            "rss_mb_end": round(last.rss_kib / 1024, 1),
            "cpu_s": round(cpu, 3),
            "cpu_s_per_min": round(cpu / window * 60, 3),
            "core_percent": round(cpu / window * 100, 3),
            "metadata_requests_per_min": round((requests_last - requests_first) / window * 60, 1),
        }

    print()
    print(
        f"daemon idle cost over {args.seconds:g} s, polling every {args.poll_interval:g} s (GCP: long-poll), "
        f"{args.bucket} bucket"
    )
    print(f"{'provider':<9} {'RSS MB start':>12} {'RSS MB end':>10} {'CPU s/min':>10} {'% 1 core':>9} {'req/min':>8}")
    for provider, r in results.items():
        print(
            f"{provider:<9} {r['rss_mb_start']:>12.1f} {r['rss_mb_end']:>10.1f} {r['cpu_s_per_min']:>10.3f} "
            f"{r['core_percent']:>9.2f} {r['metadata_requests_per_min']:>8.1f}"
        )
    report = {
        "benchmark": "idle_cost",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": {"cpus": os.cpu_count(), "loadavg": os.getloadavg(), "python": platform.python_version()},
        "git_head": git_head(),
        "seconds": args.seconds,
        "poll_interval_s": args.poll_interval,
        "bucket": args.bucket,
        "clock_ticks_per_s": CLOCK_TICKS,
        "daemons": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {args.out}")


def _pid(vm: Vm) -> int:
    assert vm.process is not None
    return vm.process.pid


if __name__ == "__main__":
    main()
