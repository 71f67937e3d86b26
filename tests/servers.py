"""Real local object stores for tests: moto (S3) and gcp-storage-emulator (GCS).

Each context manager starts a server on 127.0.0.1 with a random port, creates
a uniquely named bucket and yields where to reach it. Nothing global is set:
tests point clients at the server themselves, e.g. with pytest's monkeypatch::

    with moto_s3() as s3:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.endpoint_url)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")  # see FAKE_AWS_ENV
        storage = S3Storage(f"s3://{s3.bucket}/run1")

Two exceptions, both making moto answer as S3 does: ``_make_moto_crc32c_faithful``
(moto needs a CRC32C implementation to compute CRC32C checksums correctly) and
``_make_moto_initiated_faithful`` (the time a multipart upload was initiated).
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import socket
import subprocess
import sys
import threading
import types
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pytest

FAKE_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass(frozen=True)
class S3Server:
    endpoint_url: str  # http://127.0.0.1:PORT
    bucket: str


@dataclass(frozen=True)
class GcsServer:
    endpoint_url: str  # http://127.0.0.1:PORT, the value for STORAGE_EMULATOR_HOST
    bucket: str
    project: str = "test-project"


def point_at(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """Point this process (and the daemons it starts) at ``server`` with fake credentials; returns a
    fresh prefix of its bucket (moto's state is per server, one prefix per test)."""
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    for key, value in {**FAKE_AWS_ENV, "AWS_ENDPOINT_URL_S3": server.endpoint_url}.items():
        monkeypatch.setenv(key, value)
    return f"s3://{server.bucket}/run-{uuid.uuid4().hex[:8]}"


def unique_bucket(prefix: str = "sg-test") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def _make_moto_crc32c_faithful() -> None:
    """moto computes CRC32C with the optional ``crc32c`` package and silently falls
    back to plain CRC32 without it (``moto[s3crc32c]``), which makes every full-object
    CRC32C of a multipart upload wrong. If that package is missing, give moto the
    same function backed by google-crc32c (a spotguard dependency). Installing
    ``crc32c`` makes this a no-op."""
    if "crc32c" in sys.modules or importlib.util.find_spec("crc32c") is not None:
        return
    import google_crc32c

    shim = types.ModuleType("crc32c")
    # moto probes with importlib.util.find_spec, which insists on a spec.
    shim.__spec__ = importlib.machinery.ModuleSpec("crc32c", None)

    def crc32c(data: bytes, value: int = 0) -> int:
        return int(google_crc32c.extend(value, bytes(data)))

    shim.crc32c = crc32c  # type: ignore[attr-defined]
    sys.modules["crc32c"] = shim


def _make_moto_initiated_faithful() -> None:
    """moto lists every open multipart upload as initiated on 2010-11-10; S3 gives the time it was
    created. A restarted daemon aborts only uploads of a key initiated before it started (the others
    are a live writer's, another node's or a peer's): with moto's fixed date it would abort a peer's
    upload in flight. Note each upload's creation time and list that instead."""
    from datetime import UTC, datetime

    from moto.s3 import models, responses

    if getattr(responses.S3Response, "spotguard_initiated", False):
        return
    create, list_uploads = models.FakeMultipart.__init__, responses.S3Response.list_multipart_uploads

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        create(self, *args, **kwargs)
        self.spotguard_initiated = datetime.now(UTC)

    def listing(self: Any) -> Any:
        serialized = self.serialized

        def faithful(result: Any) -> Any:
            created = {u.id: u for u in self.backend.list_multipart_uploads(self.bucket_name).values()}
            for upload in result.result["Uploads"]:
                when = getattr(created.get(upload["UploadId"]), "spotguard_initiated", None)
                if when is not None:
                    upload["Initiated"] = when.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
            return serialized(result)

        self.serialized = faithful
        try:
            return list_uploads(self)
        finally:
            del self.serialized

    models.FakeMultipart.__init__ = init  # type: ignore[method-assign]
    responses.S3Response.list_multipart_uploads = listing  # type: ignore[method-assign]
    responses.S3Response.spotguard_initiated = True  # type: ignore[attr-defined]


def _stop_promptly(stop: Any, host: str, port: int) -> None:
    """Call ``stop`` of a server that serves with ``socketserver``'s ``serve_forever``, waking it.

    Its loop sees a shutdown request only between two polls of its socket, 0.5 s each when nothing
    arrives: every test with a server of its own waited that long at its end. A connection (closed at
    once, served as an empty request) wakes the poll; it is repeated while ``stop`` runs, since one
    made just before the request only starts another poll."""
    stopper = threading.Thread(target=stop, name="server-stop")
    stopper.start()
    while stopper.is_alive():
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            pass
        stopper.join(0.01)


def _create_bucket(endpoint: str, name: str, region: str) -> S3Server:
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=region,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    client.create_bucket(Bucket=name)
    client.close()
    return S3Server(endpoint_url=endpoint, bucket=name)


@contextmanager
def moto_s3(bucket: str | None = None, region: str = "us-east-1") -> Iterator[S3Server]:
    """moto in server mode, reached over real HTTP by real boto3.

    moto keeps its state in process-wide backends, so servers started in one
    process share buckets; the unique bucket name keeps tests apart.
    """
    from moto.server import ThreadedMotoServer

    _make_moto_crc32c_faithful()
    _make_moto_initiated_faithful()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield _create_bucket(f"http://{host}:{port}", bucket or unique_bucket(), region)
    finally:
        _stop_promptly(server.stop, *server.get_host_and_port())


# moto in a process of its own where ``import crc32c`` fails: moto then computes a plain CRC32 and
# answers it as the CRC32C of every multipart upload (a PUT's CRC32C it only echoes back).
_CRC32C_HIDDEN_MOTO = """
import logging
import sys
sys.modules["crc32c"] = None  # what an interpreter without the package sees: ImportError
logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per request
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()  # until the test closes our stdin; the server's thread ends with the process
"""


@contextmanager
def moto_s3_wrong_crc32c(bucket: str | None = None, region: str = "us-east-1") -> Iterator[S3Server]:
    """An S3-compatible store whose CRC32C disagrees with the bytes: moto without ``crc32c``.

    It runs in a subprocess, since hiding the package in this process would reach every moto here."""
    process = subprocess.Popen(
        [sys.executable, "-c", _CRC32C_HIDDEN_MOTO], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert process.stdin is not None and process.stdout is not None
    try:
        port = process.stdout.readline().strip()  # blocks until the server listens (or the process dies)
        if not port.isdigit():
            raise RuntimeError(f"moto without crc32c did not start (exit {process.poll()})")
        yield _create_bucket(f"http://127.0.0.1:{port}", bucket or unique_bucket(), region)
    finally:
        process.stdin.close()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def gcs_emulator(bucket: str | None = None) -> Iterator[GcsServer]:
    """gcp-storage-emulator, in memory, reached by google-cloud-storage over HTTP.

    Its API server is a single-threaded ``http.server.HTTPServer``: requests are
    served one at a time, so it checks behaviour, not parallel throughput.
    """
    from gcp_storage_emulator.server import create_server

    name = bucket or unique_bucket()
    server = create_server("127.0.0.1", 0, in_memory=True, default_bucket=name)
    server.start()
    # port 0 lets the OS pick; the emulator has no public accessor for the bound port.
    port = server._api._httpd.server_address[1]
    try:
        yield GcsServer(endpoint_url=f"http://127.0.0.1:{port}", bucket=name)
    finally:
        _stop_promptly(server.stop, "127.0.0.1", port)
