"""``spotguard doctor`` against the AWS metadata emulator, moto (S3) and a real daemon."""

from __future__ import annotations

import contextlib
import http.client
import io
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread
from urllib.parse import urlsplit

import boto3
import pytest

from spotguard.cli import main
from spotguard.config import DaemonConfig
from spotguard.doctor import run_doctor
from spotguard.emulate.common import RunningEmulator
from spotguard.emulate.registry import start_emulator
from spotguard.harness import Vm
from tests.diskspace import fill
from tests.emulators import assert_lead_of_skew
from tests.servers import FAKE_AWS_ENV, S3Server, moto_s3

MiB = 1024 * 1024
# DeleteObjects is "POST /bucket?delete"; DeleteObject is "DELETE /bucket/key".
_ACCESS_DENIED = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>'
)


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with moto_s3() as server:
        yield server


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, s3: S3Server) -> S3Server:
    for key, val in FAKE_AWS_ENV.items():
        monkeypatch.setenv(key, val)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.endpoint_url)
    return s3


@pytest.fixture
def imds() -> Iterator[RunningEmulator]:
    emulator = start_emulator("aws")
    yield emulator
    emulator.stop()


class DenyDeletes:
    """An HTTP proxy in front of moto that answers every delete with 403 AccessDenied, as S3 does
    for a role without s3:DeleteObject (moto itself does not enforce bucket policies by default)."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        self.denied = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _relay(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.command == "DELETE" or (self.command == "POST" and "delete" in urlsplit(self.path).query):
                    proxy.denied += 1
                    self.send_response(403)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(_ACCESS_DENIED)))
                    self.end_headers()
                    self.wfile.write(_ACCESS_DENIED)
                    return
                upstream_conn = http.client.HTTPConnection(host, port, timeout=30)
                try:
                    upstream_conn.request(self.command, self.path, body=body, headers=dict(self.headers))
                    response = upstream_conn.getresponse()
                    data = response.read()
                    self.send_response(response.status)
                    for name, value in response.getheaders():
                        if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                            self.send_header(name, value)
                    length = response.getheader("Content-Length") if self.command == "HEAD" else None
                    self.send_header("Content-Length", length or str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    upstream_conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

            def log_message(self, *_args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def doctor(config: DaemonConfig, **options: object) -> tuple[int, str]:
    out = io.StringIO()
    code = run_doctor(config, out=out, write_probe_bytes=8 * MiB, **options)  # type: ignore[arg-type]
    return code, out.getvalue()


def line(output: str, name: str) -> str:
    found = [text for text in output.splitlines() if text[6:].startswith(f"{name}:")]
    assert len(found) == 1, output
    return found[0]


def probe_objects(s3: S3Server) -> list[str]:
    client = boto3.client("s3", endpoint_url=s3.endpoint_url, region_name="us-east-1")
    try:
        return [o["Key"] for o in client.list_objects_v2(Bucket=s3.bucket).get("Contents", []) if "doctor" in o["Key"]]
    finally:
        client.close()


def test_doctor_passes_on_a_ready_aws_vm_and_leaves_no_probe_behind(
    vm_factory: Callable[..., Vm], imds: RunningEmulator, aws_env: S3Server
) -> None:
    vm = vm_factory("vm-doc")
    config = DaemonConfig(
        provider="aws",
        metadata_url=imds.url,
        socket=vm.socket,
        checkpoint_dir=vm.root,
        bucket=f"s3://{aws_env.bucket}/run1",
    )
    code, output = doctor(config, checkpoint_gb=0.05)
    assert code == 0, output
    assert line(output, "provider").startswith("ok    provider: aws")
    assert line(output, "clock").startswith("ok    clock: within ")
    assert "IMDSv2 token obtained" in line(output, "metadata") and "no spot interruption pending" in output
    assert line(output, "daemon").startswith("ok") and f"pid {vm.process.pid}" in output  # type: ignore[union-attr]
    assert line(output, "socket directory").startswith("ok")
    assert line(output, "checkpoint write").startswith("ok    checkpoint write: 8 MiB written + fsynced")
    assert line(output, "bucket credentials").startswith("ok")
    assert line(output, "bucket permissions").startswith("ok    bucket permissions: put, stat, list and delete")
    estimate = line(output, "estimate")
    assert estimate.startswith("ok") and "inside AWS's 120 s notice window" in estimate, estimate
    assert "FAIL" not in output
    assert probe_objects(aws_env) == []
    # A pending interruption shows up, and is not a failure of the VM's setup.
    imds.trigger(kind="spot", action="terminate")
    code, output = doctor(config, checkpoint_gb=0.05, upload_probe_bytes=1 * MiB)
    assert code == 0 and "a spot interruption is PENDING" in line(output, "metadata")


def test_doctor_warns_of_a_clock_minutes_off_the_metadata_services(imds: RunningEmulator, tmp_path: Path) -> None:
    config = DaemonConfig(
        provider="aws", metadata_url=imds.url, socket=tmp_path / "spotguard.sock", checkpoint_dir=tmp_path / "nvme"
    )
    imds.inject({"kind": "skew", "seconds": 200})  # EC2's Date header 200 s behind this VM's clock
    started = time.monotonic()
    _, output = doctor(config)
    clock = line(output, "clock")
    assert clock.startswith("warn  clock: "), clock
    assert_lead_of_skew(clock, "warn  clock: ", 200, waited=time.monotonic() - started)
    assert "chronyc tracking" in output and line(output, "metadata").startswith("ok")


def test_doctor_fails_on_a_missing_delete_permission(imds: RunningEmulator, aws_env: S3Server, tmp_path: Path) -> None:
    proxy = DenyDeletes(aws_env.endpoint_url)
    try:
        config = DaemonConfig(
            provider="aws",
            metadata_url=imds.url,
            socket=tmp_path / "run" / "spotguard.sock",
            checkpoint_dir=tmp_path / "nvme",
            bucket=f"s3://{aws_env.bucket}/denied",
        )
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
            code, output = doctor(config, upload_probe_bytes=1 * MiB)
    finally:
        proxy.close()
    assert code == 1, output
    permissions = line(output, "bucket permissions")
    assert permissions.startswith("FAIL  bucket permissions: delete of the probe")
    assert "(put, stat, list worked)" in permissions and "AccessDenied" in permissions
    assert "allow s3:DeleteObject" in output
    assert proxy.denied >= 1
    # No daemon and no checkpoint root yet: warnings that say what to do, not failures.
    assert line(output, "daemon").startswith("warn") and "spotguard run" in output
    assert line(output, "checkpoint root").startswith("warn")
    assert "1 failed" in output.splitlines()[-1]


def test_doctor_fails_on_a_bucket_that_does_not_exist(imds: RunningEmulator, aws_env: S3Server, tmp_path: Path) -> None:
    (tmp_path / "nvme").mkdir()
    config = DaemonConfig(
        provider="aws",
        metadata_url=imds.url,
        socket=tmp_path / "spotguard.sock",
        checkpoint_dir=tmp_path / "nvme",
        bucket="s3://no-such-bucket-spotguard-doctor/run1",
    )
    code, output = doctor(config)
    assert code == 1
    assert line(output, "bucket credentials").startswith("FAIL") and "does not exist" in output
    assert line(output, "estimate").startswith("warn")


def test_doctor_hints_at_the_hop_limit_when_only_the_token_put_times_out(imds: RunningEmulator, tmp_path: Path) -> None:
    imds.inject({"kind": "latency", "seconds": 1.5, "path": "/latest/api/token"})
    config = DaemonConfig(
        provider="aws",
        metadata_url=imds.url,
        http_timeout=0.3,
        socket=tmp_path / "spotguard.sock",
        checkpoint_dir=tmp_path / "nvme",
        bucket=(tmp_path / "bucket").as_uri(),
    )
    code, output = doctor(config, upload_probe_bytes=1 * MiB)
    assert code == 1
    metadata = line(output, "metadata")
    assert metadata.startswith("FAIL") and "timed out" in metadata and "plain GET answers (HTTP 401)" in metadata
    assert "hop limit to 2" in output
    assert line(output, "bucket permissions").startswith("ok")  # file:// works


def test_doctor_command_takes_the_run_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    (tmp_path / "nvme").mkdir()
    argv = ["doctor", "--provider", "none", "--socket", str(tmp_path / "s.sock")]
    argv += ["--checkpoint-dir", str(tmp_path / "nvme"), "--bucket", bucket.as_uri(), "--checkpoint-gb", "0.01"]
    assert main(argv) == 0
    output = capsys.readouterr().out
    assert line(output, "provider").startswith("warn")
    assert "the shortest notice window (30 s" in line(output, "estimate")
    assert main([*argv[:-1], "0"]) == 2  # --checkpoint-gb 0: a usage error


@pytest.mark.parametrize(
    ("provider", "expected"), [("gcp", "GCE metadata answers"), ("azure", "Azure Scheduled Events answer")]
)
def test_doctor_reads_the_gcp_and_azure_metadata_services(provider: str, expected: str, tmp_path: Path) -> None:
    emulator = start_emulator(provider)
    try:
        config = DaemonConfig(
            provider=provider, metadata_url=emulator.url, socket=tmp_path / "s.sock", checkpoint_dir=tmp_path
        )
        code, output = doctor(config)
        assert line(output, "metadata").startswith(f"ok    metadata: {expected}")
        emulator.inject({"kind": "status", "status": 500})
        code, output = doctor(config)
    finally:
        emulator.stop()
    assert code == 1 and line(output, "metadata").startswith("FAIL") and "HTTP 500" in output
    assert line(output, "bucket").startswith("warn  bucket: none configured")


@pytest.mark.parametrize(
    ("wrong", "checksum", "verdict", "says", "code"),
    [
        (False, "auto", "ok", "uploads will verify CRC32C", 0),
        (True, "auto", "warn", "uploads will verify Content-MD5 (checksum = auto falls back", 0),
        (True, "md5", "ok", "uploads will verify Content-MD5 (checksum = md5 is set)", 0),
        (True, "crc32c", "FAIL", "checksum = crc32c is set, so uploads will fail", 1),
    ],
    ids=["good-store", "wrong-crc32c-auto", "wrong-crc32c-md5", "wrong-crc32c-pinned"],
)
def test_doctor_says_which_checksum_mode_uploads_will_use(
    s3: S3Server,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    wrong: bool,
    checksum: str,
    verdict: str,
    says: str,
    code: int,
) -> None:
    from tests.servers import moto_s3_wrong_crc32c

    for key, val in FAKE_AWS_ENV.items():
        monkeypatch.setenv(key, val)
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(moto_s3_wrong_crc32c()) if wrong else s3
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", server.endpoint_url)
        config = DaemonConfig(
            provider="none",
            socket=tmp_path / "sock" / "spotguard.sock",
            checkpoint_dir=tmp_path / "nvme",
            bucket=f"s3://{server.bucket}/checksum-{checksum}",
            checksum=checksum,
        )
        # A 16 MiB probe goes multipart, the kind of upload this store answers wrongly.
        exit_code, output = doctor(config, checkpoint_gb=0.05, upload_probe_bytes=16 * MiB)
        found = line(output, "checksum")
        assert found.startswith(f"{verdict:<4}  checksum: {server.endpoint_url} bucket {server.bucket}"), output
        assert says in found, output
        if wrong:
            assert "answered CRC32C" in found and "for bytes whose CRC32C is" in found
        # Only a pinned crc32c makes the throughput probe fail (auto switched to Content-MD5 before it).
        assert line(output, "bucket permissions").startswith("FAIL" if code else "ok"), output
        assert ("-> see the checksum check" in output) == bool(code), output  # not blamed on a permission
        assert exit_code == code, output
        assert [key for key in probe_objects(server) if key.startswith(f"checksum-{checksum}/")] == []


def test_doctor_reports_a_state_directory_on_a_disk_that_is_full_or_nearly(
    tmpfs: Callable[[int], Path], tmp_path: Path
) -> None:
    """The state directory is on the root disk, the one a VM running for months fills; the daemon runs
    on when it cannot write there, but what it keeps across restarts is then in memory only."""
    (tmp_path / "nvme").mkdir()
    config = DaemonConfig(provider="none", socket=tmp_path / "run" / "s.sock", checkpoint_dir=tmp_path / "nvme")
    _, output = doctor(replace(config, state_dir=tmp_path / "state"))
    assert line(output, "state directory").startswith("ok    state directory:") and "does not exist yet" in output
    (tmp_path / "state").mkdir()
    _, output = doctor(replace(config, state_dir=tmp_path / "state"))
    assert line(output, "state directory").startswith(f"ok    state directory: {tmp_path / 'state'}: writable")

    small = tmpfs(1 * MiB)
    _, output = doctor(replace(config, state_dir=small))
    assert line(output, "state directory").startswith("warn") and "MiB free on its disk" in output
    assert list(small.iterdir()) == []  # the probe is gone
    fill(small, leave=0)
    code, output = doctor(replace(config, state_dir=small))
    found = line(output, "state directory")
    assert found.startswith("warn") and "No space left on device" in found, output
    assert f"keeps its event log and upload journal in {tmp_path / 'run'}" in output
    assert code == 0  # the daemon runs on: a warning, not a failure
