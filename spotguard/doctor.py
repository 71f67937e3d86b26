"""``spotguard doctor``: is this VM ready to survive a spot interruption?

One line per check, ``ok``, ``warn`` or ``FAIL``, each saying what was found and, when it is not
ok, what to do. The exit status is 1 when any check FAILs, else 0. Checks, in order:

* **provider**: which cloud, and how it was decided (the config, or which DMI field said so);
* **metadata**: the notice source answers (AWS: an IMDSv2 token can be had; a token PUT that
  times out while a plain GET answers is the container hop-limit trap: hop limit 2);
* **clock**: this VM's clock against the metadata service's answers' ``Date`` header: past 30 s
  apart, the cloud's deadlines and the bucket's ages are moved onto the cloud's time (and NTP wants
  a look);
* **socket directory** and **daemon**: where trainers connect, and whether a daemon answers there;
* **state directory**: the daemon's event log and upload journal can be written there (it is on
  the root disk, which a VM running for months fills), and how much room is left;
* **checkpoint root**: exists, free space for a few checkpoints, write + fsync speed;
* **bucket**: credentials, then put / stat / list / delete of a probe object
  ``<prefix>/.spotguard-doctor-<random>`` through the same storage backend the daemon uses;
* **checksum** (s3:// only): a tiny multipart upload with a full-object CRC32C, whether the store
  answers the CRC32C of the bytes, and so which verification uploads will use (``checksum``);
* **estimate**: from the probe's upload throughput and the local write speed, how long a
  checkpoint of ``--checkpoint-gb`` GB takes to reach the bucket, against this cloud's notice
  window (AWS 120 s, GCP and Azure 30 s).

The probe is one object sent in one stream; the daemon's uploads run several parts in
parallel, so the estimate errs on the slow side.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from spotguard import cloudclock
from spotguard.config import DaemonConfig
from spotguard.crc32c import crc32c_of_file
from spotguard.oneline import one_line
from spotguard.providers import registry as providers
from spotguard.providers.detect import DMI_ROOT, dmi_evidence
from spotguard.storage.base import Capability, ChecksumProbe, Storage

MiB = 1024 * 1024
GB = 1_000_000_000
#: Seconds between the notice and the VM going away.

OK, WARN, FAIL = "ok", "warn", "FAIL"


@dataclass
class Check:
    status: str  # ok | warn | FAIL
    name: str
    found: str
    fix: str = ""

    def line(self) -> str:
        # What was found may hold a metadata service's or a bucket's answer: one line each, no controls.
        text = one_line(f"{self.status:<4}  {self.name}: {self.found}")
        return f"{text}\n      -> {one_line(self.fix)}" if self.fix and self.status != OK else text


@dataclass
class Findings:
    checks: list[Check] = field(default_factory=list)
    provider: str = "none"
    write_bytes_s: float | None = None
    upload_bytes_s: float | None = None


def _secs(seconds: float) -> str:
    return f"{seconds:.1f}" if seconds < 10 else f"{seconds:.0f}"


def _human_rate(rate: float) -> str:
    return f"{rate / 1e6:.0f} MB/s" if rate >= 1e6 else f"{rate / 1e3:.0f} kB/s"


def run_doctor(
    config: DaemonConfig,
    *,
    out: TextIO | None = None,
    checkpoint_gb: float = 10.0,
    dmi_root: Path | None = None,
    write_probe_bytes: int = 64 * MiB,
    upload_probe_bytes: int = 16 * MiB,
    open_storage: Callable[[str], Any] | None = None,
) -> int:
    """Run every check, print one line each to ``out`` (default stdout); 1 if any FAILed, else 0.

    >>> run_doctor(load_config({"bucket": "s3://b/run1"}), checkpoint_gb=40)
    """
    out = sys.stdout if out is None else out  # looked up now: sys.stdout may have been replaced
    findings = Findings()

    def report(check: Check) -> None:
        findings.checks.append(check)
        print(check.line(), file=out, flush=True)

    _check_provider(config, findings, report, dmi_root)
    _check_metadata(config, findings, report)
    _check_socket(config, report)
    _check_peer_token(config, report)
    _check_state_dir(config, report)
    _check_checkpoint_root(config, findings, report, checkpoint_gb, write_probe_bytes)
    _check_bucket(config, findings, report, upload_probe_bytes, open_storage)
    _estimate(findings, report, checkpoint_gb)
    failed = sum(check.status == FAIL for check in findings.checks)
    warned = sum(check.status == WARN for check in findings.checks)
    print(
        f"{len(findings.checks)} checks: {failed} failed, {warned} warnings"
        + ("" if failed else " - ready" if not warned else " - usable, see the warnings"),
        file=out,
    )
    return 1 if failed else 0


# --- provider and metadata ----------------------------------------------------------------------


def _check_provider(
    config: DaemonConfig, findings: Findings, report: Callable[[Check], None], dmi: Path | None
) -> None:
    dmi_root = dmi or DMI_ROOT
    if config.provider != "auto":
        findings.provider = config.provider
        if config.provider == "none":
            report(
                Check(
                    WARN,
                    "provider",
                    "none (set in the config): no metadata is watched, only drills and SIGTERM",
                    f"set provider = {'|'.join(providers.names())} (or auto) on a cloud VM",
                )
            )
        else:
            report(Check(OK, "provider", f"{config.provider} (set in the config or by --provider)"))
        return
    provider = providers.detect_provider(dmi_root)
    findings.provider = provider
    evidence = ", ".join(f"{name}={value!r}" for name, value in dmi_evidence(dmi_root).items())
    if provider == "none":
        report(
            Check(
                WARN,
                "provider",
                f"auto: no cloud recognised in DMI ({evidence or f'nothing readable in {dmi_root}'})",
                f"on a cloud VM, set --provider {'|'.join(providers.names())}; "
                "elsewhere only drills and SIGTERM trigger checkpoints",
            )
        )
    else:
        report(Check(OK, "provider", f"{provider}, auto-detected from DMI ({evidence})"))


def _check_metadata(config: DaemonConfig, findings: Findings, report: Callable[[Check], None]) -> None:
    """The provider's own probe: the monitors' requests, paths and headers."""
    if findings.provider == "none":
        report(Check(OK, "metadata", "skipped (no provider)"))
        return
    cloudclock.forget()  # what this probe's answers say, nothing measured before
    result = asyncio.run(providers.run_probe(findings.provider, config.monitor_settings()))
    report(Check(str(result.status), "metadata", result.found, result.fix))
    lead = cloudclock.measured_lead()
    if lead is None:
        report(Check(OK, "clock", "not compared (no metadata answer with a Date header)"))
    elif abs(lead) <= cloudclock.CLOCK_OFF:
        report(Check(OK, "clock", f"within {abs(lead):.0f} s of the metadata service's (its Date header)"))
    else:
        report(
            Check(
                WARN,
                "clock",
                f"{cloudclock.how_far(lead)} the metadata service's (its Date header): the daemon counts the "
                "cloud's deadlines and the bucket's ages on the cloud's time",
                "check time sync (chronyc tracking, timedatectl): a trainer's manifests and logs carry this clock",
            )
        )


# --- socket and daemon ----------------------------------------------------------------------------


def _check_socket(config: DaemonConfig, report: Callable[[Check], None]) -> None:
    from spotguard.control import CommandError, request, trainers_on_another_version

    directory = config.socket.parent
    if not directory.exists():
        report(
            Check(
                WARN,
                "socket directory",
                f"{directory} does not exist (the daemon creates it; systemd's RuntimeDirectory= does too)",
                "start the daemon: systemctl start spotguard",
            )
        )
    elif not directory.is_dir():
        report(Check(FAIL, "socket directory", f"{directory} is not a directory", "point --socket elsewhere"))
    elif not os.access(directory, os.W_OK | os.X_OK):
        report(
            Check(
                FAIL,
                "socket directory",
                f"{directory} is not writable by uid {os.getuid()}",
                "run the daemon as the directory's owner, or fix its permissions",
            )
        )
    else:
        report(Check(OK, "socket directory", f"{directory} exists and is writable"))
    try:
        reply = request(config.socket, "status", timeout=2.0)
    except (CommandError, OSError, ValueError) as exc:
        report(
            Check(
                WARN,
                "daemon",
                f"no daemon answers at {config.socket} ({exc})",
                "start it (systemctl start spotguard, or spotguard run); without it no notice reaches the trainers",
            )
        )
        return
    trainers = len(reply.get("trainers", []))
    answers = (
        f"spotguard {reply.get('version')} pid {reply.get('pid')} answers at {config.socket}: "
        f"provider {reply.get('provider')}, {trainers} trainer(s) connected"
    )
    others = trainers_on_another_version(reply)
    if others:
        # Both work together, but what one side added since the other's version the other refuses or ignores.
        fix = "upgrade the older of the two (the daemon's package or image, or the trainers' spotguard)"
        report(Check(WARN, "daemon", f"{answers} ({others})", fix))
    else:
        report(Check(OK, "daemon", answers))


# --- checkpoint root ------------------------------------------------------------------------------


def _check_peer_token(config: DaemonConfig, report: Callable[[Check], None]) -> None:
    """With the peer tier on: a token can be read, and it is not weak (spotguard/peer/tokens.py)."""
    if not (config.peer_listen or config.peers):
        return
    from spotguard.peer.tokens import JobToken, token_weakness
    from spotguard.peer.wire import load_previous_token, load_token

    fix = "make one with `spotguard peer-token` and give every VM of the job the same (docs/security.md)"
    try:
        current = load_token(os.environ, config.peer_token_file)
    except ValueError as exc:
        report(Check(FAIL, "peer token", str(exc), fix))
        return
    try:
        token = JobToken(current, load_previous_token(os.environ, config.peer_token_previous_file))
    except ValueError as exc:
        unset = "set it to the token the fleet ran with before the rotation, or unset it once no VM uses that one"
        report(Check(FAIL, "peer token", str(exc), unset))
        return
    weakness = token_weakness(token.current)
    if weakness is not None:
        report(Check(WARN, "peer token", f"weak: {weakness}", fix))
    else:
        report(Check(OK, "peer token", f"{len(token.current)} bytes, no weakness found"))
    if token.previous is not None:
        found = "the previous token is accepted too (a rotation under way)"
        report(Check(WARN, "peer token", found, "remove it once every VM of the job has the new token"))


#: Below this the state directory's disk is reported as nearly full: the event log and the upload
#: journal take kilobytes, but a disk this close to full is one log rotation away from none.
STATE_DIR_LOW = 64 * MiB


def _check_state_dir(config: DaemonConfig, report: Callable[[Check], None]) -> None:
    """What the daemon keeps across restarts (handled notices, open multipart uploads) can be written.
    Without it the daemon runs on: its event log and upload journal go to the socket's directory."""
    state = config.state_dir.absolute()
    meanwhile = f"meanwhile the daemon keeps its event log and upload journal in {config.socket.parent}"
    existing = next((p for p in (state, *state.parents) if p.exists()), Path("/"))
    if existing != state:
        if os.access(existing, os.W_OK | os.X_OK):
            report(Check(OK, "state directory", f"{state} does not exist yet (the daemon creates it)"))
        else:
            found = f"{state} cannot be created: {existing} is not writable"
            report(Check(WARN, "state directory", found, f"create it, owned by the daemon's user; {meanwhile}"))
        return
    try:
        with tempfile.NamedTemporaryFile(prefix=".spotguard-doctor-", dir=state) as probe:
            probe.write(b"\0" * 4096)
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as exc:
        fix = f"free space on its disk (df {state}) or fix its owner/mode; {meanwhile}"
        report(Check(WARN, "state directory", f"cannot write in {state}: {exc}", fix))
        return
    free = shutil.disk_usage(state).free
    if free < STATE_DIR_LOW:
        found = f"{state}: writable, only {free / MiB:.0f} MiB free on its disk"
        fix = f"free space on it (df {state}): logs, images and caches fill a root disk over months"
        report(Check(WARN, "state directory", found, fix))
        return
    report(Check(OK, "state directory", f"{state}: writable, {free / GB:.1f} GB free"))


def _check_checkpoint_root(
    config: DaemonConfig, findings: Findings, report: Callable[[Check], None], checkpoint_gb: float, probe_bytes: int
) -> None:
    root = config.checkpoint_dir.absolute()
    if not root.is_dir():
        report(_missing_root(root))
        return
    if not os.access(root, os.W_OK | os.X_OK):
        report(Check(FAIL, "checkpoint root", f"{root} is not writable by uid {os.getuid()}", "fix its owner/mode"))
        return
    report(_root_space(root, checkpoint_gb, keep=config.keep_local + 1))  # the ones kept, plus the one being written
    try:
        rate = _write_speed(root, probe_bytes)
    except OSError as exc:
        report(Check(FAIL, "checkpoint write", f"writing a probe file in {root} failed: {exc}", "check the disk"))
        return
    findings.write_bytes_s = rate
    seconds = checkpoint_gb * GB / rate
    report(
        Check(
            OK,
            "checkpoint write",
            f"{probe_bytes // MiB} MiB written + fsynced at {_human_rate(rate)}: "
            f"~{_secs(seconds)} s to save {checkpoint_gb:g} GB locally",
        )
    )


def _missing_root(root: Path) -> Check:
    parent = next((p for p in root.parents if p.exists()), Path("/"))
    if os.access(parent, os.W_OK | os.X_OK):
        return Check(
            WARN,
            "checkpoint root",
            f"{root} does not exist yet (the daemon creates it under {parent})",
            "create it on local NVMe if there is one; trainers must use the same directory",
        )
    return Check(
        FAIL,
        "checkpoint root",
        f"{root} does not exist and {parent} is not writable",
        "create it, owned by the daemon's user, on local NVMe if there is one",
    )


def _root_space(root: Path, checkpoint_gb: float, *, keep: int) -> Check:
    free = shutil.disk_usage(root).free
    need = checkpoint_gb * GB
    free_text = f"{root}: {free / GB:.1f} GB free"
    if free < need:
        return Check(
            FAIL,
            "checkpoint space",
            f"{free_text}, less than one {checkpoint_gb:g} GB checkpoint",
            "free space or use a bigger disk",
        )
    if free < need * keep:
        return Check(
            WARN,
            "checkpoint space",
            f"{free_text}, room for fewer than keep_local + 1 = {keep} checkpoints of {checkpoint_gb:g} GB",
            "free space, or lower keep_local",
        )
    return Check(OK, "checkpoint space", f"{free_text}, room for {int(free // need)} checkpoints")


def _write_speed(root: Path, size: int) -> float:
    chunk = os.urandom(min(size, 4 * MiB))
    handle, name = tempfile.mkstemp(prefix=".spotguard-doctor-", dir=root)
    try:
        started = time.monotonic()
        written = 0
        while written < size:
            written += os.write(handle, chunk[: size - written])
        os.fsync(handle)
        return written / max(time.monotonic() - started, 1e-6)
    finally:
        os.close(handle)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


# --- bucket ---------------------------------------------------------------------------------------


def _check_bucket(
    config: DaemonConfig,
    findings: Findings,
    report: Callable[[Check], None],
    probe_bytes: int,
    opener: Callable[[str], Any] | None,
) -> None:
    if config.bucket is None:
        report(
            Check(
                WARN,
                "bucket",
                "none configured: checkpoints stay on local disk, which dies with a spot VM",
                "set --bucket s3://... | gs://... | file:///shared/dir",
            )
        )
        return
    from spotguard.storage import StorageError, open_storage, scheme_of

    scheme = scheme_of(config.bucket)
    hints = dict(scheme.permission_hints) if scheme is not None else {}
    try:
        storage = (opener or open_storage)(config.bucket, **config.storage_options())
    except (ImportError, ValueError, StorageError) as exc:
        extra = scheme.install_hint if isinstance(exc, ImportError) and scheme is not None else ""
        report(Check(FAIL, "bucket", f"cannot open {config.bucket}: {exc}", extra or "check the bucket URL"))
        return
    try:
        if Capability.WARM_UP in storage.capabilities:
            try:
                storage.warm()
            except Exception as exc:
                report(
                    Check(
                        FAIL,
                        "bucket credentials",
                        f"{config.bucket}: {exc}",
                        "check the credentials (instance role / service account) and that the bucket exists",
                    )
                )
                return
            report(Check(OK, "bucket credentials", f"credentials resolved and {config.bucket} reachable"))
        # Before the throughput probe, so that it measures the verification uploads will use. Its
        # verdict is reported after the permissions: a probe that fails for want of them says so there.
        checksum = _checksum_probe(storage)
        permitted = _probe(
            storage, bucket=config.bucket, findings=findings, report=report, size=probe_bytes, hints=hints
        )
        if permitted or not isinstance(checksum, Exception):
            _report_checksum(checksum, config, report)
    finally:
        with contextlib.suppress(Exception):
            storage.close()


def _probe(
    storage: Any,
    *,
    bucket: str,
    findings: Findings,
    report: Callable[[Check], None],
    size: int,
    hints: dict[str, str],
) -> bool:
    key = f".spotguard-doctor-{secrets.token_hex(8)}"
    where = f"{bucket.rstrip('/')}/{key}"
    done: list[str] = []  # the operations that worked, in order
    with tempfile.TemporaryDirectory(prefix="spotguard-doctor-") as scratch:
        local = Path(scratch) / "probe"
        local.write_bytes(os.urandom(size))
        try:
            elapsed = _probe_operations(storage, local, key, size, done)
        except Exception as exc:
            from spotguard.storage import ChecksumMismatch

            step = ("put", "stat", "list", "delete")[len(done)]
            # A store that answers wrong checksums is not a missing permission.
            fix = "see the checksum check" if isinstance(exc, ChecksumMismatch) else hints[step]
            worked = ", ".join(done) or "nothing"
            report(
                Check(FAIL, "bucket permissions", f"{step} of the probe {where} failed ({worked} worked): {exc}", fix)
            )
            if "put" in done and "delete" not in done:
                with contextlib.suppress(Exception):
                    storage.delete([key])
            return False
    rate = size / elapsed
    findings.upload_bytes_s = rate
    report(
        Check(
            OK,
            "bucket permissions",
            f"put, stat, list and delete of a {size // MiB} MiB probe under {bucket} work; "
            f"uploaded at {_human_rate(rate)}",
        )
    )
    return True


def _probe_operations(storage: Any, local: Path, key: str, size: int, done: list[str]) -> float:
    """Put, stat, list and delete the probe object, appending each that worked to ``done``; returns the
    seconds the put took."""
    started = time.monotonic()
    storage.put_file(local, key, crc32c=crc32c_of_file(local))
    elapsed = max(time.monotonic() - started, 1e-6)
    done.append("put")
    info = storage.stat(key)
    if info is None or info.size != size:
        raise RuntimeError(f"stat after put says {info!r}, expected {size} bytes")
    done.append("stat")
    # Listing must be allowed (the uploader lists the bucket); the file:// backend hides dot-files
    # (writes in progress), so the probe itself need not show up.
    for _ in storage.list(key):
        pass
    done.append("list")
    storage.delete([key])
    if storage.stat(key) is not None:
        raise RuntimeError("the probe object is still there after delete")
    done.append("delete")
    return elapsed


def _checksum_probe(storage: Storage) -> ChecksumProbe | Exception | None:
    """The store's :class:`ChecksumProbe`, the exception it raised, or None for a store without the
    capability (gs:// verifies CRC32C natively; file:// has no store to disagree)."""
    if Capability.CHECKSUM_PROBE not in storage.capabilities:
        return None
    try:
        return storage.probe_checksum(f".spotguard-doctor-{secrets.token_hex(8)}", adopt=True)
    except Exception as exc:
        return exc


def _report_checksum(probe: Any, config: DaemonConfig, report: Callable[[Check], None]) -> None:
    if probe is None:
        return
    if isinstance(probe, Exception):
        report(
            Check(
                FAIL,
                "checksum",
                f"a multipart upload with a full-object CRC32C failed: {probe}",
                "the store may not support additional checksums: set checksum = md5",
            )
        )
        return
    mode = config.checksum
    if probe.agrees:
        found = (
            f"{probe.store} answers the CRC32C of the bytes ({probe.answered})"
            if probe.answered
            else f"{probe.store} answers no CRC32C (it still checks the one each request carries)"
        )
        uses = "Content-MD5 (checksum = md5 is set)" if mode == "md5" else "CRC32C"
        report(Check(OK, "checksum", f"{found}: uploads will verify {uses}"))
        return
    wrong = f"{probe.store} answered CRC32C {probe.answered} for bytes whose CRC32C is {probe.sent}"
    if mode == "crc32c":
        report(
            Check(
                FAIL,
                "checksum",
                f"{wrong}; checksum = crc32c is set, so uploads will fail",
                "set checksum = md5 (or auto) for this store",
            )
        )
    elif mode == "md5":
        report(Check(OK, "checksum", f"{wrong}: uploads will verify Content-MD5 (checksum = md5 is set)"))
    else:
        report(
            Check(
                WARN,
                "checksum",
                f"{wrong}: uploads will verify Content-MD5 (checksum = auto falls back once uploads have "
                "disagreed, and sends them again; the probe above used it already)",
                "set checksum = md5 for this store, so no notice-time upload is spent finding out",
            )
        )


# --- the estimate ---------------------------------------------------------------------------------


def _estimate(findings: Findings, report: Callable[[Check], None], checkpoint_gb: float) -> None:
    if findings.upload_bytes_s is None:
        report(Check(WARN, "estimate", "no upload throughput measured (see the bucket checks)", "fix those first"))
        return
    known = providers.get(findings.provider).notice_window if findings.provider in providers.names() else None
    if known is None:
        window = min(providers.get(name).notice_window for name in providers.BUILTIN)
        window_text = f"the shortest notice window ({window:.0f} s, GCP/Azure; no cloud detected)"
    else:
        window = known
        window_text = f"{findings.provider.upper()}'s {window:.0f} s notice window"
    size = checkpoint_gb * GB
    upload = size / findings.upload_bytes_s
    save = size / findings.write_bytes_s if findings.write_bytes_s else 0.0
    total = upload + save
    found = (
        f"a {checkpoint_gb:g} GB checkpoint reaches the bucket in ~{_secs(total)} s "
        f"(~{_secs(save)} s to write locally + ~{_secs(upload)} s to upload): "
        f"{'inside' if total <= window else 'OUTSIDE'} {window_text}"
    )
    if total <= window * 0.8:
        report(Check(OK, "estimate", found))
    else:
        report(
            Check(
                WARN,
                "estimate",
                found,
                "shrink the urgent checkpoint (shard it, drop what can be rebuilt), use faster storage or a "
                "closer bucket, and save periodically (every_steps=) so less is lost when the notice is too short",
            )
        )


__all__ = ["Check", "run_doctor"]
