"""The job's peer token from the cloud's secret store, for a VM's bootstrap (``spotguard peer-token
--from-secret``): AWS Secrets Manager by ARN, GCP Secret Manager by ``projects/P/secrets/N``.

With ``previous`` the version the current one replaced is read as well, for a rotation
(docs/security.md): AWS's ``AWSPREVIOUS`` stage (moved there by ``put-secret-value``); on GCP the
version numbered one below the latest, while it is enabled. None where there is no such version, so a
secret never rotated (or one whose old version was retired) gives the current token alone.

The SDKs are imported here only, when a bootstrap asks: the daemon and the trainer hook never do.
"""

from __future__ import annotations

import base64
import re
from typing import Any

from spotguard.errors import FatalError

_AWS_ARN = re.compile(r"^arn:[a-z-]+:secretsmanager:([a-z0-9-]+):[0-9]{12}:secret:.+$")
_GCP_NAME = re.compile(r"^projects/[^/]+/secrets/[A-Za-z0-9_-]+$")
GCP_API = "https://secretmanager.googleapis.com/v1/"


class SecretStoreError(FatalError):
    """A secret that cannot be named or read; the message says which and why, never its value."""


def read_secret(name: str, *, previous: bool = False) -> tuple[str, str | None]:
    """(current, previous or None) of the secret ``name``, surrounding whitespace removed;
    :class:`SecretStoreError` if it cannot be read, or if a value spans lines (a bootstrap reads one
    token per line: ``openssl rand -base64 64`` wraps its output, ``-hex 32`` does not)."""
    if match := _AWS_ARN.match(name):
        values = _read_aws(name, match.group(1), previous=previous)
    elif _GCP_NAME.match(name):
        values = read_gcp(name, previous=previous)
    else:
        raise SecretStoreError(
            f"{name!r} is neither a Secrets Manager ARN (arn:aws:secretsmanager:REGION:ACCOUNT:secret:NAME) "
            "nor a Secret Manager name (projects/PROJECT/secrets/NAME)"
        )
    current, before = values[0].strip(), None if values[1] is None else values[1].strip()
    for which, value in (("current", current), ("previous", before)):
        if value is not None and "\n" in value:
            raise SecretStoreError(
                f"the {which} value of {name} spans several lines: store the token on one line "
                "(`spotguard peer-token` or `openssl rand -hex 32`)"
            )
    return current, before


def _read_aws(arn: str, region: str, *, previous: bool) -> tuple[str, str | None]:
    import boto3  # spotguard[aws]
    from botocore.exceptions import BotoCoreError, ClientError

    client = boto3.client("secretsmanager", region_name=region)
    try:
        current = str(client.get_secret_value(SecretId=arn)["SecretString"])
        if not previous:
            return current, None
        try:
            return current, str(client.get_secret_value(SecretId=arn, VersionStage="AWSPREVIOUS")["SecretString"])
        except client.exceptions.ResourceNotFoundException:
            return current, None  # never rotated
    except (BotoCoreError, ClientError) as exc:
        raise SecretStoreError(f"cannot read {arn}: {exc}") from None


def read_gcp(name: str, *, previous: bool, session: Any = None, api: str = GCP_API) -> tuple[str, str | None]:
    """The GCP half of :func:`read_secret`; ``session`` is a ``requests`` session that authenticates
    (the VM's service account by default), ``api`` the Secret Manager endpoint."""
    import requests

    if session is None:
        import google.auth  # spotguard[gcp]
        from google.auth.transport.requests import AuthorizedSession

        credentials, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-platform"])
        session = AuthorizedSession(credentials)
    versions = f"{api}{name}/versions/"
    try:
        answer = session.get(versions + "latest:access", timeout=30)
        if not answer.ok:
            raise SecretStoreError(f"cannot read {name}: HTTP {answer.status_code} {answer.text[:200]}")
        latest = answer.json()
        current = base64.b64decode(latest["payload"]["data"]).decode()
        number = int(str(latest["name"]).rsplit("/", 1)[1])
        if not previous or number <= 1:
            return current, None
        # Disabled or destroyed (the rotation's end): refused, and no previous token.
        older = session.get(f"{versions}{number - 1}:access", timeout=30)
        return current, base64.b64decode(older.json()["payload"]["data"]).decode() if older.ok else None
    except requests.RequestException as exc:
        raise SecretStoreError(f"cannot read {name}: {exc}") from None
    except (KeyError, ValueError, TypeError) as exc:
        raise SecretStoreError(f"cannot read {name}: an answer without its payload ({exc!r})") from None


__all__ = ["GCP_API", "SecretStoreError", "read_gcp", "read_secret"]
