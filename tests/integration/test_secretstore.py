"""The job's peer token from the cloud's secret store, as a VM's bootstrap reads it (`spotguard
peer-token --from-secret`): moto's Secrets Manager in server mode, and a stand-in for GCP Secret
Manager's two REST calls on 127.0.0.1."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import boto3
import pytest
import requests

from spotguard.secretstore import SecretStoreError, read_gcp
from tests.servers import FAKE_AWS_ENV, S3Server

OLD = "the-token-the-fleet-ran-with-0123456789"
NEW = "the-token-it-is-rotated-to-0123456789"


def peer_token(server: S3Server, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **FAKE_AWS_ENV, "AWS_ENDPOINT_URL": server.endpoint_url}
    command = [sys.executable, "-m", "spotguard", "peer-token", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, check=False)


def test_the_token_and_during_a_rotation_the_previous_one_come_from_secrets_manager(server: S3Server) -> None:
    client = boto3.client(
        "secretsmanager",
        region_name="us-east-1",
        endpoint_url=server.endpoint_url,
        aws_access_key_id=FAKE_AWS_ENV["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=FAKE_AWS_ENV["AWS_SECRET_ACCESS_KEY"],
    )
    arn = client.create_secret(Name=f"peer-token-{os.urandom(4).hex()}", SecretString=OLD)["ARN"]
    # Never rotated: the token, and an empty second line (nothing more to accept).
    never = peer_token(server, "--from-secret", arn, "--with-previous")
    assert never.returncode == 0 and never.stdout.split("\n") == [OLD, "", ""], never.stderr
    client.put_secret_value(SecretId=arn, SecretString=NEW)  # AWSCURRENT -> NEW, AWSPREVIOUS -> OLD
    rotating = peer_token(server, "--from-secret", arn, "--with-previous")
    assert rotating.returncode == 0 and rotating.stdout.split("\n") == [NEW, OLD, ""], rotating.stderr
    alone = peer_token(server, "--from-secret", arn)
    assert alone.returncode == 0 and alone.stdout == NEW + "\n"
    # A secret that is not there, and a name that is no secret's: exit 1, saying which, printing none.
    missing = peer_token(server, "--from-secret", arn.rsplit(":", 1)[0] + ":not-there-AbCdEf")
    assert missing.returncode == 1 and "cannot read arn:aws:secretsmanager" in missing.stderr
    assert missing.stdout == ""
    # A value over two lines would read as a token and a previous one: refused, saying how to fix it.
    client.put_secret_value(SecretId=arn, SecretString="first-half-of-a-wrapped-token\nsecond-half-0123456789\n")
    wrapped = peer_token(server, "--from-secret", arn)
    assert wrapped.returncode == 1 and "the current value of arn:" in wrapped.stderr
    assert "spans several lines" in wrapped.stderr and wrapped.stdout == "" and "half" not in wrapped.stderr
    wrong = peer_token(server, "--from-secret", "peer-token")
    assert wrong.returncode == 1 and "neither a Secrets Manager ARN" in wrong.stderr
    needs_secret = peer_token(server, "--with-previous")
    assert needs_secret.returncode == 2 and "--from-secret" in needs_secret.stderr
    assert OLD not in missing.stderr + wrong.stderr + needs_secret.stderr


class SecretVersions(BaseHTTPRequestHandler):
    """``GET /v1/projects/p/secrets/s/versions/{N|latest}:access`` as Secret Manager answers it: the
    payload of an enabled version, 400 FAILED_PRECONDITION for a disabled one, 404 for none."""

    versions: ClassVar[dict[int, str | None]] = {}  # number -> value; None: disabled (set by each test)

    def do_GET(self) -> None:
        prefix = "/v1/projects/p/secrets/s/versions/"
        wanted = self.path.removeprefix(prefix).removesuffix(":access")
        number = max(self.versions, default=0) if wanted == "latest" else int(wanted) if wanted.isdigit() else 0
        value = self.versions.get(number)
        if not self.path.startswith(prefix) or number not in self.versions:
            self._answer(404, {"error": {"code": 404, "status": "NOT_FOUND"}})
        elif value is None:
            self._answer(400, {"error": {"code": 400, "status": "FAILED_PRECONDITION"}})
        else:
            data = base64.b64encode(value.encode()).decode()
            self._answer(200, {"name": f"projects/1234/secrets/s/versions/{number}", "payload": {"data": data}})

    def _answer(self, code: int, body: dict[str, object]) -> None:
        raw = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def secret_manager() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), SecretVersions)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1/"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_the_previous_version_on_gcp_is_the_one_below_the_latest_while_enabled(secret_manager: str) -> None:
    def read(previous: bool) -> tuple[str, str | None]:
        with requests.Session() as session:
            return read_gcp("projects/p/secrets/s", previous=previous, session=session, api=secret_manager)

    SecretVersions.versions = {1: OLD}
    assert read(previous=True) == (OLD, None)  # one version: nothing to accept besides it
    SecretVersions.versions = {1: OLD, 2: NEW}
    assert read(previous=True) == (NEW, OLD)
    assert read(previous=False) == (NEW, None)
    SecretVersions.versions = {1: OLD, 2: None, 3: NEW}  # the version before the latest disabled: rotation over
    assert read(previous=True) == (NEW, None)
    SecretVersions.versions = {}
    with pytest.raises(SecretStoreError, match="cannot read projects/p/secrets/s: HTTP 404"):
        read(previous=True)
