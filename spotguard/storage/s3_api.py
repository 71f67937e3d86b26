"""The S3 client spotguard's S3 store talks through: one boto3 client (and a short-budget twin used while
a notice's deadline runs), our retry on top of botocore's, and which errors are worth retrying.

Kept apart from :mod:`spotguard.storage.s3` (the store's contract) and
:mod:`spotguard.storage.s3_multipart` (multipart uploads), which both call through it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import boto3
import boto3.exceptions
import botocore.exceptions
import botocore.session
from botocore.config import Config

from spotguard.storage.base import (
    ObjectExists,
    ObjectNotFound,
    StorageError,
    TransientStorageError,
    connections_needed,
    retry,
)

# The SDK's service models, read once per process (see new_session).
_models_lock = threading.Lock()
_models: Any = None

# While racing a notice: one request may not take longer than this (the read timeout is per socket read).
_RACING_CONNECT_TIMEOUT = 2.0
_RACING_READ_TIMEOUT = 15.0

TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "PriorRequestNotComplete",
        "EC2ThrottledException",
        "IDPCommunicationError",
        # Two conditional writes of one key at once: S3 asks the loser to retry, which then
        # finds the key written (PreconditionFailed).
        "ConditionalRequestConflict",
    }
)
_FATAL_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "NoSuchBucket",
        "NoSuchKey",
        "NoSuchUpload",
        "InvalidBucketName",
        "BadDigest",
        "InvalidDigest",
        "InvalidRequest",
        "InvalidArgument",
        "EntityTooSmall",
        "EntityTooLarge",
        "InvalidPart",
        "InvalidPartOrder",
        "PermanentRedirect",
        "AuthorizationHeaderMalformed",
    }
)
_TRANSIENT_SDK = (
    botocore.exceptions.ConnectionError,  # EndpointConnectionError, ConnectionClosedError, timeouts
    botocore.exceptions.HTTPClientError,
    botocore.exceptions.ResponseStreamingError,
    botocore.exceptions.IncompleteReadError,
    botocore.exceptions.ReadTimeoutError,
    botocore.exceptions.ConnectTimeoutError,
    boto3.exceptions.RetriesExceededError,  # download_file gave up re-reading a stream
)


def error_code(exc: BaseException) -> str:
    if isinstance(exc, botocore.exceptions.ClientError):
        return str(exc.response.get("Error", {}).get("Code", ""))
    return ""


def _http_status(exc: BaseException) -> int:
    if isinstance(exc, botocore.exceptions.ClientError):
        return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return 0


def is_not_found(exc: BaseException) -> bool:
    # By code, not status: NoSuchBucket is a 404 too, and a fatal configuration error.
    return error_code(exc) in ("404", "NoSuchKey", "NotFound")


def client_config(
    max_concurrency: int, retry_mode: str, max_attempts: int, connect_timeout: float, read_timeout: float
) -> Config:
    return Config(
        # botocore's pool defaults to 10 connections; a connection over the pool's size is made for one
        # request and dropped after it (a new handshake and slow start for the next): size it to our load.
        max_pool_connections=connections_needed(max_concurrency),
        retries={"mode": retry_mode, "total_max_attempts": max_attempts},
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        # We send CRC32C ourselves; don't let botocore add a CRC32 to every PUT (and
        # never ask it to validate algorithms it can only do with awscrt).
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        # Every body we send carries its CRC32C in a signed header, which S3 checks: a SHA-256
        # of the payload for the signature (botocore's default on plain-HTTP endpoints) would
        # only cost a core-second per GB (HTTPS with a checksum header skips it already).
        s3={"payload_signing_enabled": False},
    )


def new_session() -> boto3.session.Session:
    """A boto3 session of its own (credentials, settings, clients), which reads the SDK's service models
    through the one loader of this process.

    A fresh session parses the S3 model and the endpoint rules again, about 0.15 CPU-s per client:
    every store opened to list a bucket, resume or check one paid it. The models are files shipped with
    botocore, read only; the clients of one session share them already. The loader is swapped in after
    boto3 set the session up, because boto3 adds its own data folder to the loader it finds there: with
    the shared loader in place already, that folder would be added once more per session."""
    global _models
    core = botocore.session.get_session()
    session = boto3.session.Session(botocore_session=core)
    with _models_lock:
        if _models is None:
            _models = core.get_component("data_loader")
        else:
            core.register_component("data_loader", _models)
    return session


@dataclass
class S3Api:
    """One bucket's client: made at first use (or given), calls retried, errors made StorageErrors.

    ``set_deadline`` switches every call to the racing client (2 attempts, short timeouts) and
    bounds our retries by the deadline; ``key`` turns a store key into the bucket's full key."""

    bucket: str
    prefix: str
    config: Config
    attempts: int  # our retry's, on top of botocore's
    given_client: Any = None  # a ready client (tests, custom sessions): used as is, never closed here
    endpoint_url: str | None = None
    region: str | None = None
    deadline: float | None = None  # time.monotonic() of a notice's deadline, while one runs

    def __post_init__(self) -> None:
        self._owns_client = self.given_client is None
        self._client = self.given_client
        self._client_lock = threading.Lock()
        self._session: Any = None
        self._racing_client: Any = None  # the client used while a notice's deadline runs (set_deadline)

    @property
    def client(self) -> Any:
        if self._client is None:
            with self._client_lock:
                if self._client is None:
                    self._session = new_session()
                    self._client = self._session.client(
                        "s3", endpoint_url=self.endpoint_url, region_name=self.region, config=self.config
                    )
        if self.deadline is not None and self._owns_client:
            return self._racing()
        return self._client

    def _racing(self) -> Any:
        """The same client with a short SDK budget (2 attempts, short timeouts): racing a deadline,
        botocore must not spend minutes on one request (5 attempts of a 60 s read timeout); our own
        retry, bounded by the deadline, tries again instead."""
        if self._racing_client is None:
            with self._client_lock:
                if self._racing_client is None:
                    config = self.config.merge(
                        Config(
                            retries={"mode": self.config.retries["mode"], "total_max_attempts": 2},
                            connect_timeout=min(self.config.connect_timeout, _RACING_CONNECT_TIMEOUT),
                            read_timeout=min(self.config.read_timeout, _RACING_READ_TIMEOUT),
                        )
                    )
                    self._racing_client = self._session.client(
                        "s3", endpoint_url=self.endpoint_url, region_name=self.region, config=config
                    )
        return self._racing_client

    def resolve_credentials(self) -> None:
        """Make both clients and run the credential provider chain (IMDS, SSO, …) now."""
        if not self._owns_client:
            return
        _ = self.client
        self._racing()  # made now, not when a notice comes
        creds = self._session.get_credentials()
        if creds is None:
            raise StorageError("s3: no AWS credentials found")
        creds.get_frozen_credentials()

    def key(self, key: str) -> str:
        if not key or key.startswith("/"):
            raise ValueError(f"key must be relative and non-empty: {key!r}")
        return self.prefix + key

    def call(self, what: str, fn: Any, /, **kwargs: Any) -> Any:
        """One API call with our retry on top of botocore's; errors become StorageErrors."""
        try:
            return retry(
                lambda: fn(**kwargs),
                is_transient=self.is_transient,
                attempts=self.attempts,
                deadline=self.deadline,
                what=what,
            )
        except StorageError:
            raise
        except Exception as exc:
            raise self.wrap(what, exc) from exc

    def on_key(self, operation: str, full: str, /, what: str = "", **kwargs: Any) -> Any:
        """``call`` of the client's ``operation`` on the object ``full`` of this bucket (``what``: more
        words for messages, after the operation and the key)."""
        return self.call(
            f"{operation} {full}{what}", getattr(self.client, operation), Bucket=self.bucket, Key=full, **kwargs
        )

    def wrap(self, what: str, exc: BaseException) -> StorageError:
        if is_not_found(exc):
            return ObjectNotFound(f"s3: {what}: not found")
        if error_code(exc) == "PreconditionFailed":
            return ObjectExists(f"s3: {what}: already exists")
        cls = TransientStorageError if self.is_transient(exc) else StorageError
        return cls(f"s3: {what}: {exc}")

    def is_transient(self, exc: BaseException) -> bool:
        """503 SlowDown, 500, throttling, resets and timeouts: yes. 403/404, bad keys, bad digests: no."""
        if isinstance(exc, TransientStorageError):
            return True
        if isinstance(exc, StorageError):
            return False
        if isinstance(exc, botocore.exceptions.ClientError):
            code = error_code(exc)
            if code in _FATAL_CODES:
                return False
            if code in TRANSIENT_CODES:
                return True
            status = _http_status(exc)
            return status == 429 or status >= 500
        if isinstance(exc, _TRANSIENT_SDK):
            return True
        if isinstance(exc, botocore.exceptions.BotoCoreError):
            return False  # NoCredentialsError, ParamValidationError, …: retrying changes nothing
        return isinstance(exc, ConnectionError | TimeoutError)

    def close(self) -> None:
        if self._owns_client:
            for client in (self._client, self._racing_client):
                if client is not None:
                    client.close()
            self._client = self._racing_client = None
