"""``s3://bucket/prefix`` on boto3.

Uploads are parallel multipart with a CRC32C per part and a full-object CRC32C
(``ChecksumType="FULL_OBJECT"``) checked three times over:

1. client side, before anything is committed: the per-part CRC32Cs of the bytes
   actually sent are combined and must equal the manifest's ``crc32c`` (a file
   that changed under us, or a wrong manifest, never becomes an object);
2. server side: S3 verifies every part's ``x-amz-checksum-crc32c`` and, at
   CompleteMultipartUpload, the full-object CRC32C we send (BadDigest otherwise);
3. after completion, HeadObject with ``ChecksumMode=ENABLED``: a store that
   reports a different full-object CRC32C (or size) gets the object deleted and
   the upload fails. Stores that report no checksum pass this step.

Some S3-compatible stores accept CRC32C headers but answer a CRC32C of their own that does not
match the bytes (partial support for additional checksums; moto without its ``crc32c`` extra
computes a plain CRC32 for multipart uploads). That is not transient: the same bytes get the same
wrong answer. With ``checksum="auto"`` (the default) such a disagreement is retried
``checksum_attempts - 1`` times in all, then this instance falls back, with one warning, to what
every S3-compatible store verifies: a ``Content-MD5`` on every request (the store refuses a body
that does not match it). The client-side check (1) stays, so the manifest's CRC32C still describes
the bytes sent. ``checksum="md5"`` starts there; ``checksum="crc32c"`` never falls back and fails
with :class:`ChecksumMismatch` once the attempts are spent.

Why our own multipart loop instead of ``upload_file`` + ``TransferConfig``:
s3transfer asks botocore to *compute* CRC32C per part (``ChecksumAlgorithm``),
which needs ``awscrt`` (``botocore[crt]``; without it: MissingDependencyException),
and it gives us no hook to combine the part checksums nor to abort on our terms.
Computing the part CRC32C with google-crc32c (already a spotguard dependency)
and sending it as ``ChecksumCRC32C`` keeps botocore from computing anything.
The AWS CRT S3 client (``awscrt``) is not used: at the same number of connections it is no faster
and saves at most a quarter of a CPU-second per GiB, but it cannot upload parts of a file still being
written, shows us no part checksum to check against the manifest before it completes an upload, and
drops Content-MD5 (the fallback below); see BENCHMARKS.md.
Downloads are parallel ranged GETs through ``spotguard.storage.transfer`` (one pool of streams
shared by every file of a checkpoint, CRC32C computed as the bytes arrive and combined per file):
s3transfer's ``download_file`` runs a pool per file and leaves the checksum to a second read.

Endpoint: ``endpoint_url=`` if given, else boto3 resolves it itself from
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` (and the shared config file).
"""

from __future__ import annotations

import base64
import builtins
import concurrent.futures as cf
import contextlib
import datetime as dt
import hashlib
import logging
import os
import tempfile
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import boto3
import boto3.exceptions
import botocore.exceptions
import google_crc32c
from botocore.config import Config

from spotguard.crc32c import base64_to_hex, crc32c_combine
from spotguard.crc32c import crc32c_hex_to_int as _hex_to_int
from spotguard.crc32c import crc32c_int_to_base64 as _int_to_b64
from spotguard.safefile import open_nofollow, read_nofollow
from spotguard.storage.base import (
    CHECKSUM_MODES,
    ChecksumMismatch,
    ObjectExists,
    ObjectInfo,
    ObjectNotFound,
    Progress,
    Sink,
    StorageError,
    TransientStorageError,
    read_exactly,
    retry,
)
from spotguard.storage.journal import UploadJournal
from spotguard.storage.stream import PartStream, StreamPool
from spotguard.storage.transfer import fetch_object

log = logging.getLogger(__name__)
# ListMultipartUploads gives Initiated to the second: an upload begun in this client's first second
# may be listed as older than the client, and is not ours to abort.
_INITIATED_PRECISION = dt.timedelta(seconds=1)

MiB = 1024 * 1024
_MIN_PART = 5 * MiB  # S3's floor for every part but the last
# While racing a notice: one request may not take longer than this (the read timeout is per socket read).
_RACING_CONNECT_TIMEOUT = 2.0
_RACING_READ_TIMEOUT = 15.0
_MAX_PARTS = 10_000
_DELETE_BATCH = 1000  # DeleteObjects' limit
_READ_CHUNK = 1 * MiB  # what a download stream holds in memory at once

_TRANSIENT_CODES = frozenset(
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


# -- CRC32C helpers ---------------------------------------------------------------------


def _b64_to_hex(value: str) -> str | None:
    """S3's base64 big-endian checksum as our hex; None for composite (``…-N``) or junk."""
    if "-" in value:
        return None
    try:
        return base64_to_hex(value)
    except ValueError:
        return None


def _crc_of(data: bytes | memoryview) -> int:
    return int(google_crc32c.value(bytes(data)))


def _integrity_args(data: bytes, crc: int, md5: bool) -> dict[str, str]:
    """What a PutObject / UploadPart carries for the store to check the body against."""
    if md5:
        return {"ContentMD5": base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()}
    return {"ChecksumAlgorithm": "CRC32C", "ChecksumCRC32C": _int_to_b64(crc)}


@dataclass(frozen=True)
class ChecksumProbe:
    """What :meth:`S3Storage.probe_checksum` found."""

    store: str  # "<endpoint> bucket <name>"
    sent: str  # the CRC32C of the probe's bytes, hex
    answered: str | None  # the full-object CRC32C the store answered; None: it answered none

    @property
    def agrees(self) -> bool:
        return self.answered in (None, self.sent)


# -- helpers ------------------------------------------------------------------------------


def _error_code(exc: BaseException) -> str:
    if isinstance(exc, botocore.exceptions.ClientError):
        return str(exc.response.get("Error", {}).get("Code", ""))
    return ""


def _http_status(exc: BaseException) -> int:
    if isinstance(exc, botocore.exceptions.ClientError):
        return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return 0


def _is_not_found(exc: BaseException) -> bool:
    # By code, not status: NoSuchBucket is a 404 too, and a fatal configuration error.
    return _error_code(exc) in ("404", "NoSuchKey", "NotFound")


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` → ``("bucket", "some/prefix/")``; the prefix is "" or ends in "/"."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise ValueError(f"not an s3:// URL with a bucket: {url!r}")
    prefix = parts.path.strip("/")
    return parts.netloc, f"{prefix}/" if prefix else ""


def _check_options(
    checksum: str, checksum_attempts: int, part_size: int, max_concurrency: int, retry_mode: str
) -> None:
    if checksum not in CHECKSUM_MODES:
        raise ValueError(f"checksum must be one of {', '.join(CHECKSUM_MODES)}, not {checksum!r}")
    if checksum_attempts < 1:
        raise ValueError("checksum_attempts must be at least 1")
    if part_size < _MIN_PART:
        raise ValueError(f"part_size must be at least {_MIN_PART} bytes (S3's minimum)")
    if max_concurrency < 1:
        raise ValueError("max_concurrency must be at least 1")
    if retry_mode not in ("standard", "adaptive", "legacy"):
        raise ValueError(f"retry_mode must be standard, adaptive or legacy, not {retry_mode!r}")


def _client_config(
    max_concurrency: int, retry_mode: str, max_attempts: int, connect_timeout: float, read_timeout: float
) -> Config:
    return Config(
        # botocore's pool defaults to 10 connections: more parts in flight than that
        # silently queue for a connection, so the pool must cover our concurrency.
        max_pool_connections=max(10, max_concurrency + 4),
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


class S3Storage:
    """The ``Storage`` backend for ``s3://bucket/prefix``.

    Example::

        storage = S3Storage("s3://my-bucket/run1", part_size=16 * MiB, max_concurrency=16)
        storage.warm()                                  # at daemon start, not at notice time
        storage.abort_stale_multipart_uploads(older_than=dt.timedelta(hours=1))
        storage.put_file(Path("/nvme/ckpt/step-1/__0_0.distcp"), "step-1/__0_0.distcp", crc32c="1a2b3c4d")

    Options (all have defaults):
        part_size: multipart part size in bytes (≥ 5 MiB; raised for files over 10,000 parts).
        max_concurrency: requests in flight at once, across every file this instance uploads (the
            uploader sends several files in parallel; per-file pools would multiply), and per
            file for ranged downloads.
        multipart_threshold: files at least this big go multipart (default: ``part_size``).
        client: a ready boto3 S3 client (tests, custom sessions); not closed by ``close()``.
        endpoint_url: overrides ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``.
        region: the client's region (default: boto3's resolution).
        retry_mode / max_attempts: botocore's retry strategy (``standard`` or ``adaptive``)
            and its attempts per HTTP request, the first one included; ``attempts``
            bounds our own retry (``is_transient`` + jittered backoff) on top of that.
        connect_timeout / read_timeout: seconds; a stalled connection is a transient error.
        verify_after_upload: HeadObject after each upload and compare size and CRC32C.
        checksum: ``auto`` (CRC32C, then Content-MD5 once the store is seen to answer wrong
            CRC32Cs), ``crc32c`` (never fall back) or ``md5`` (Content-MD5 from the start; the
            store's CRC32C is then never trusted, not even by ``stat``).
        checksum_attempts: uploads a CRC32C disagreement may cost this instance, in all, before
            it falls back (``auto``) or fails (``crc32c``).
    """

    def __init__(
        self,
        url: str,
        *,
        part_size: int = 16 * MiB,
        max_concurrency: int = 16,
        multipart_threshold: int | None = None,
        client: Any = None,
        endpoint_url: str | None = None,
        region: str | None = None,
        retry_mode: str = "standard",
        max_attempts: int = 5,
        attempts: int = 4,
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
        verify_after_upload: bool = True,
        checksum: str = "auto",
        checksum_attempts: int = 2,
    ) -> None:
        _check_options(checksum, checksum_attempts, part_size, max_concurrency, retry_mode)
        self.url = url
        self.bucket, self.prefix = parse_s3_url(url)
        self.part_size = part_size
        self.max_concurrency = max_concurrency
        # One budget of upload streams for the whole instance, shared by every file in flight.
        self._streams = threading.BoundedSemaphore(max_concurrency)
        self.multipart_threshold = multipart_threshold if multipart_threshold is not None else part_size
        self.attempts = attempts
        self.verify_after_upload = verify_after_upload
        self.checksum = checksum
        self.checksum_attempts = checksum_attempts
        # Shared by every upload thread: one store, one verdict on its CRC32C.
        self._checksum_lock = threading.Lock()
        self._md5 = checksum == "md5"
        self._disagreements = 0
        self._refusal: ChecksumMismatch | None = None  # pinned crc32c, attempts spent
        self._created = dt.datetime.now(dt.UTC)
        self._leftovers_lock = threading.Lock()
        self._leftovers_checked: set[str] = set()  # keys whose leftover multipart uploads are aborted
        # The daemon's record of the uploads it opens (None: not recorded, e.g. the CLI's restore).
        self.journal: UploadJournal | None = None
        self._stream_pool = StreamPool(max_concurrency, "s3-stream")
        self._endpoint_url = endpoint_url
        self._region = region
        self._owns_client = client is None
        self._client = client
        self._client_lock = threading.Lock()
        self._session: Any = None
        self._racing_client: Any = None  # the client used while a notice's deadline runs (set_deadline)
        self._deadline: float | None = None
        self._config = _client_config(max_concurrency, retry_mode, max_attempts, connect_timeout, read_timeout)

    # -- plumbing -------------------------------------------------------------------

    @property
    def client(self) -> Any:
        if self._client is None:
            with self._client_lock:
                if self._client is None:
                    self._session = boto3.session.Session()
                    self._client = self._session.client(
                        "s3", endpoint_url=self._endpoint_url, region_name=self._region, config=self._config
                    )
        if self._deadline is not None and self._owns_client:
            return self._racing()
        return self._client

    def _racing(self) -> Any:
        """The same client with a short SDK budget (2 attempts, short timeouts): racing a deadline,
        botocore must not spend minutes on one request (5 attempts of a 60 s read timeout); our own
        retry, bounded by the deadline, tries again instead."""
        if self._racing_client is None:
            with self._client_lock:
                if self._racing_client is None:
                    config = self._config.merge(
                        Config(
                            retries={"mode": self._config.retries["mode"], "total_max_attempts": 2},
                            connect_timeout=min(self._config.connect_timeout, _RACING_CONNECT_TIMEOUT),
                            read_timeout=min(self._config.read_timeout, _RACING_READ_TIMEOUT),
                        )
                    )
                    self._racing_client = self._session.client(
                        "s3", endpoint_url=self._endpoint_url, region_name=self._region, config=config
                    )
        return self._racing_client

    def set_deadline(self, deadline: float | None) -> None:
        """A notice's deadline (``time.monotonic()``), or None: while set, every request gets the short
        SDK budget and our retries stop at the deadline."""
        self._deadline = deadline

    def _key(self, key: str) -> str:
        if not key or key.startswith("/"):
            raise ValueError(f"key must be relative and non-empty: {key!r}")
        return self.prefix + key

    def _call(self, what: str, fn: Any, /, **kwargs: Any) -> Any:
        """One API call with our retry on top of botocore's; errors become StorageErrors."""
        try:
            return retry(
                lambda: fn(**kwargs),
                is_transient=self.is_transient,
                attempts=self.attempts,
                deadline=self._deadline,
                what=what,
            )
        except StorageError:
            raise
        except Exception as exc:
            raise self._wrap(what, exc) from exc

    def _wrap(self, what: str, exc: BaseException) -> StorageError:
        if _is_not_found(exc):
            return ObjectNotFound(f"s3: {what}: not found")
        if _error_code(exc) == "PreconditionFailed":
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
            code = _error_code(exc)
            if code in _FATAL_CODES:
                return False
            if code in _TRANSIENT_CODES:
                return True
            status = _http_status(exc)
            return status == 429 or status >= 500
        if isinstance(exc, _TRANSIENT_SDK):
            return True
        if isinstance(exc, botocore.exceptions.BotoCoreError):
            return False  # NoCredentialsError, ParamValidationError, …: retrying changes nothing
        return isinstance(exc, ConnectionError | TimeoutError)

    def warm(self) -> None:
        """Create the client, resolve credentials and open a connection to the bucket now,
        so that nothing slow (credential chains, DNS, TLS) happens at notice time."""
        client = self.client
        if self._owns_client:
            self._racing()  # made now, not when a notice comes
            # Resolving the frozen credentials runs the whole provider chain (IMDS, SSO, …) now.
            creds = self._session.get_credentials()
            if creds is None:
                raise StorageError("s3: no AWS credentials found")
            creds.get_frozen_credentials()
        try:
            self._call(f"head_bucket {self.bucket}", client.head_bucket, Bucket=self.bucket)
        except ObjectNotFound:
            raise StorageError(f"s3: bucket {self.bucket} does not exist") from None

    def close(self) -> None:
        self._stream_pool.close()
        if self._owns_client:
            for client in (self._client, self._racing_client):
                if client is not None:
                    client.close()
            self._client = self._racing_client = None

    # -- uploads --------------------------------------------------------------------

    @property
    def checksum_mode(self) -> str:
        """How uploads are verified now: ``crc32c`` or ``md5`` (pinned, or ``auto`` after its fallback)."""
        return "md5" if self._md5 else "crc32c"

    @property
    def store_name(self) -> str:
        return f"{self.client.meta.endpoint_url} bucket {self.bucket}"

    def put_file(self, local: Path, key: str, *, crc32c: str, progress: Progress | None = None) -> None:
        expected = _hex_to_int(crc32c)
        full = self._key(key)
        size = os.path.getsize(local)
        while True:
            md5 = self._use_md5()
            if size >= self.multipart_threshold and size > 0:
                self._put_multipart(local, full, size, expected, progress, md5=md5)
            else:
                self._put_single(local, full, expected, md5=md5)
                if progress:
                    progress(size)
            if not self.verify_after_upload:
                return
            try:
                self._verify_remote(full, size, expected, md5=md5)
                return
            except ChecksumMismatch as exc:
                self._disagreed(full, exc)  # raises when neither a retry nor a fallback is left

    def _use_md5(self) -> bool:
        with self._checksum_lock:
            refusal = self._refusal
            md5 = self._md5
        if refusal is not None:
            # Nothing is sent: the store would only answer the same wrong CRC32C again.
            raise ChecksumMismatch(str(refusal), sent=refusal.sent, answered=refusal.answered)
        return md5

    def _disagreed(self, full: str, exc: ChecksumMismatch) -> None:
        """Count one CRC32C disagreement: return to upload ``full`` again (the same way or with
        Content-MD5), or raise once ``checksum_attempts`` are spent and ``checksum`` is pinned."""
        with self._checksum_lock:
            if self._md5:
                return  # another upload made the switch meanwhile: this one goes again with Content-MD5
            self._disagreements += 1
            count = self._disagreements
            if count < self.checksum_attempts:
                log.warning(
                    "s3: %s answered CRC32C %s for %s, sent %s: checksum disagreement %d of %d, uploading again",
                    self.store_name,
                    exc.answered,
                    full,
                    exc.sent,
                    count,
                    self.checksum_attempts,
                )
                return
            if self.checksum == "crc32c":
                self._refusal = ChecksumMismatch(
                    f"s3: {self.store_name} answers CRC32Cs that do not match the bytes (sent {exc.sent} for {full}, "
                    f"it answered {exc.answered}; {count} uploads disagreed); checksum = crc32c is set, so there is "
                    "no fallback: set checksum = auto or md5 for this store",
                    sent=exc.sent,
                    answered=exc.answered,
                )
                raise self._refusal from exc
            self._md5 = True
        log.warning(
            "s3: %s answers CRC32Cs that do not match the bytes (sent CRC32C %s for %s, it answered %s; "
            "%d uploads disagreed): verifying uploads to it with Content-MD5 from now on "
            "(checksum = md5 skips this detection)",
            self.store_name,
            exc.sent,
            full,
            exc.answered,
            count,
        )

    def _put_single(self, local: Path, full: str, expected: int, *, md5: bool) -> None:
        # The budget first: bytes are read only once they can be sent.
        with self._streams:
            data = read_nofollow(local)
            actual = _crc_of(data)
            if actual != expected:
                raise StorageError(f"s3: {local}: local CRC32C {actual:08x} != expected {expected:08x}; not uploaded")
            self._put_object(full, data, expected, md5=md5)

    def _put_object(self, full: str, data: bytes, expected: int, *, md5: bool, **conditions: str) -> None:
        self._call(
            f"put_object {full}" + (" (if absent)" if conditions else ""),
            self.client.put_object,
            Bucket=self.bucket,
            Key=full,
            Body=data,
            **_integrity_args(data, expected, md5),
            **conditions,
        )

    def put_bytes_if_absent(self, key: str, data: bytes, *, crc32c: str) -> None:
        """One PUT with ``If-None-Match: *``: S3 writes it only if the key does not exist yet."""
        full = self._key(key)
        expected = _hex_to_int(crc32c)
        if _crc_of(data) != expected:
            raise StorageError(f"s3: {full}: CRC32C of the bytes given != expected {crc32c}; not uploaded")
        md5 = self._use_md5()
        with self._streams:
            self._put_object(full, data, expected, md5=md5, IfNoneMatch="*")

    def _part_plan(self, size: int) -> list[tuple[int, int, int]]:
        part = self.part_size
        while -(-size // part) > _MAX_PARTS:
            part *= 2
        return [(i + 1, off, min(part, size - off)) for i, off in enumerate(range(0, size, part))]

    def _put_multipart(
        self, local: Path, full: str, size: int, expected: int, progress: Progress | None, *, md5: bool
    ) -> None:
        upload_id = self._create_multipart(full, md5=md5)
        try:
            # The part CRC32Cs are computed either way: combined, they must equal the manifest's.
            parts = self._upload_parts(local, full, upload_id, self._part_plan(size), progress, md5=md5)
            combined = parts[0][2]
            for _, _, crc, length in parts[1:]:
                combined = crc32c_combine(combined, crc, length)
            if combined != expected:
                raise StorageError(
                    f"s3: {local}: CRC32C of the bytes sent {combined:08x} != expected {expected:08x}; upload aborted"
                )
            self._complete(full, upload_id, parts, expected, size, md5=md5)
        except BaseException:
            # Also on KeyboardInterrupt/cancel: unfinished parts cost money and are never visible.
            self._abort(full, upload_id)
            raise

    def _create_multipart(self, full: str, *, md5: bool) -> str:
        self._abort_leftovers(full)
        created = self._call(
            f"create_multipart_upload {full}",
            self.client.create_multipart_upload,
            Bucket=self.bucket,
            Key=full,
            **({} if md5 else {"ChecksumAlgorithm": "CRC32C", "ChecksumType": "FULL_OBJECT"}),
        )
        upload_id = str(created["UploadId"])
        if self.journal is not None:
            try:
                self.journal.opened(full, upload_id)
            except OSError:
                self._abort(full, upload_id)  # an upload nobody could find again after a kill: not opened
                raise
        return upload_id

    def _abort_leftovers(self, full: str) -> None:
        """Abort the multipart uploads of exactly ``full`` opened before this instance was made: an
        earlier daemon's, killed mid-upload (at start only those older than ``stale_upload_age`` go,
        since other nodes share the prefix; this key is ours to write now). Once per key."""
        with self._leftovers_lock:
            if full in self._leftovers_checked:
                return
            self._leftovers_checked.add(full)
        try:
            uploads = self._open_uploads(full)
        except StorageError as exc:
            # Not worth failing the upload for: abort_stale_multipart_uploads() gets them later.
            log.warning("s3: cannot list the open multipart uploads of %s: %s", full, exc)
            return
        for upload in uploads:
            initiated = upload.get("Initiated")
            if upload["Key"] == full and (initiated is None or initiated < self._created - _INITIATED_PRECISION):
                log.info("s3: aborting multipart upload %s of %s left by an earlier run", upload["UploadId"], full)
                self._abort(full, upload["UploadId"])

    def _open_uploads(self, prefix: str) -> builtins.list[dict[str, Any]]:
        """The unfinished multipart uploads of every key starting with ``prefix``."""
        try:
            pages = list(
                self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=prefix)
            )
        except Exception as exc:
            raise self._wrap("list_multipart_uploads", exc) from exc
        return [upload for page in pages for upload in page.get("Uploads", [])]

    def begin_stream(self, key: str, size: int, fd: int, *, progress: Progress | None = None) -> _S3Stream | None:
        """Multipart parts sent as the file is written (``spotguard.storage.stream``); None for a
        file below ``multipart_threshold`` (one PUT once it is finished)."""
        if size < self.multipart_threshold or size == 0:
            return None
        return _S3Stream(self, self._key(key), size, fd, progress)

    def _upload_parts(
        self,
        local: Path,
        full: str,
        upload_id: str,
        plan: list[tuple[int, int, int]],
        progress: Progress | None,
        *,
        md5: bool,
    ) -> list[tuple[int, str, int, int]]:
        fd = open_nofollow(local)
        try:

            def one(number: int, offset: int, length: int) -> tuple[int, str, int, int]:
                etag, crc = self._send_part(
                    fd, full, upload_id, number=number, offset=offset, length=length, what=f"s3: {local}", md5=md5
                )
                if progress:
                    progress(length)
                return number, etag, crc, length

            workers = min(self.max_concurrency, len(plan))
            with cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="s3-part") as pool:
                futures = [pool.submit(one, *p) for p in plan]
                try:
                    for fut in cf.as_completed(futures):
                        fut.result()  # first failure stops the file
                except BaseException:
                    for f in futures:
                        f.cancel()
                    raise
                return sorted(f.result() for f in futures)
        finally:
            os.close(fd)

    def _send_part(
        self, fd: int, full: str, upload_id: str, *, number: int, offset: int, length: int, what: str, md5: bool
    ) -> tuple[str, int]:
        """One part read from ``fd`` and sent with its checksum; its ETag and CRC32C."""
        # The budget before the read: only parts about to be sent are in memory.
        with self._streams:
            data = read_exactly(fd, offset, length, f"{what} (part {number})")
            crc = _crc_of(data)
            resp = self._call(
                f"upload_part {full} #{number}",
                self.client.upload_part,
                Bucket=self.bucket,
                Key=full,
                UploadId=upload_id,
                PartNumber=number,
                Body=data,
                **_integrity_args(data, crc, md5),
            )
        return str(resp["ETag"]), crc

    def _complete(
        self, full: str, upload_id: str, parts: list[tuple[int, str, int, int]], expected: int, size: int, *, md5: bool
    ) -> None:
        checksums: dict[str, str] = {}
        if not md5:
            checksums = {"ChecksumCRC32C": _int_to_b64(expected), "ChecksumType": "FULL_OBJECT"}
        try:
            self._call(
                f"complete_multipart_upload {full}",
                self.client.complete_multipart_upload,
                Bucket=self.bucket,
                Key=full,
                UploadId=upload_id,
                MultipartUpload={
                    "Parts": [
                        {"PartNumber": n, "ETag": etag, **({} if md5 else {"ChecksumCRC32C": _int_to_b64(crc)})}
                        for n, etag, crc, _ in parts
                    ]
                },
                **checksums,
            )
        except StorageError as exc:
            # A completion retried after a lost response finds the upload gone: if the
            # object is there with our size, the first attempt won.
            if "NoSuchUpload" in str(exc):
                info = self._stat_full(full)
                if info is not None and info.size == size:
                    log.info("s3: %s completed by an earlier attempt", full)
                    self._journal_done(upload_id)
                    return
            raise
        self._journal_done(upload_id)

    def _journal_done(self, upload_id: str) -> None:
        if self.journal is None:
            return
        try:
            self.journal.done(upload_id)
        except OSError as exc:
            # Harmless: the next start aborts it again and finds it gone.
            log.warning("s3: cannot record the end of upload %s in %s: %s", upload_id, self.journal.path, exc)

    def keep_journal(self, journal: UploadJournal) -> int:
        """At start: abort every upload ``journal`` says this daemon opened and never finished (a killed
        predecessor's), however young, then record every upload opened from now on in it. Returns how many
        were aborted; those that could not be stay recorded for the next start."""
        unfinished = journal.unfinished()
        still_open = [upload for upload in unfinished if not self._abort(upload.key, upload.upload_id)]
        journal.keep_only(still_open)
        self.journal = journal
        return len(unfinished) - len(still_open)

    def _abort(self, full: str, upload_id: str) -> bool:
        """Abort one multipart upload; whether nothing of it is left open (already gone counts)."""
        try:
            self._call(
                f"abort_multipart_upload {full}",
                self.client.abort_multipart_upload,
                Bucket=self.bucket,
                Key=full,
                UploadId=upload_id,
            )
        except ObjectNotFound:
            pass
        except Exception:
            # The journal keeps it: the next start tries again (and the sweep by age as well).
            log.warning("s3: could not abort multipart upload %s of %s", upload_id, full, exc_info=True)
            return False
        self._journal_done(upload_id)
        return True

    def _verify_remote(self, full: str, size: int, expected: int, *, md5: bool = False) -> None:
        info = self._stat_full(full)
        problem = None
        answered = None  # a CRC32C the store answered that is not the bytes'
        if info is None:
            problem = "object missing after upload"
        elif info.size != size:
            problem = f"size {info.size} != {size}"
        elif not md5 and info.crc32c is not None and info.crc32c != f"{expected:08x}":
            answered = info.crc32c
            problem = f"stored CRC32C {answered} != expected {expected:08x}"
        if problem:
            with contextlib.suppress(StorageError):
                self._call(f"delete_object {full}", self.client.delete_object, Bucket=self.bucket, Key=full)
            message = f"s3: {full}: {problem}; object deleted"
            if answered is not None:
                raise ChecksumMismatch(message, sent=f"{expected:08x}", answered=answered)
            raise StorageError(message)

    def probe_checksum(self, key: str, *, adopt: bool = False) -> ChecksumProbe:
        """Upload a tiny object under ``key`` the way large files go (multipart, full-object
        CRC32C, no fallback), read back the CRC32C the store answers for it, and delete it.
        ``adopt``: with ``checksum="auto"``, a disagreement switches this instance to Content-MD5
        at once, without spending uploads to find out (the caller reports it).

        Multipart, because a single PUT proves little: some stores (moto without ``crc32c``) echo
        the CRC32C a PUT carries but compute their own, wrong one when they assemble parts."""
        data = os.urandom(4096)
        crc = _crc_of(data)
        full = self._key(key)
        with tempfile.TemporaryDirectory(prefix="spotguard-probe-") as scratch:
            local = Path(scratch) / "probe"
            local.write_bytes(data)
            self._put_multipart(local, full, len(data), crc, None, md5=False)
        try:
            info = self._stat_full(full)
        finally:
            self._call(f"delete_object {full}", self.client.delete_object, Bucket=self.bucket, Key=full)
        probe = ChecksumProbe(self.store_name, f"{crc:08x}", None if info is None else info.crc32c)
        if adopt and not probe.agrees and self.checksum == "auto":
            with self._checksum_lock:
                self._md5 = True
        return probe

    def abort_stale_multipart_uploads(self, older_than: dt.timedelta | None = None) -> int:
        """Abort unfinished multipart uploads under our prefix; returns how many.

        Called at daemon start. Pass ``older_than`` whenever another writer may share the prefix
        (the other nodes of a job, a replacement VM): it spares uploads initiated more recently,
        which may be in flight. ListMultipartUploads names no writer, so age is what tells.
        """
        cutoff = dt.datetime.now(dt.UTC) - older_than if older_than is not None else None
        aborted = 0
        for upload in self._open_uploads(self.prefix):
            initiated = upload.get("Initiated")
            if cutoff is not None and initiated is not None and initiated > cutoff:
                continue
            self._abort(upload["Key"], upload["UploadId"])
            aborted += 1
        if aborted:
            log.info("s3: aborted %d stale multipart uploads under %s", aborted, self.url)
        return aborted

    # -- downloads and metadata -------------------------------------------------------

    def get_file(self, key: str, local: Path) -> None:
        """Parallel ranged GETs (``max_concurrency`` streams of ``part_size`` or more), CRC32C
        checked against what S3 stores for the object, or the size alone where it stores none."""
        info = self.stat(key)
        if info is None:
            raise ObjectNotFound(f"s3: {self.url}/{key}: not found")
        fetch_object(self, info, Path(local), streams=self.max_concurrency, min_range=self.part_size)

    def read_range(self, key: str, offset: int, length: int, sink: Sink) -> None:
        full = self._key(key)
        what = f"get_object {full} bytes={offset}-{offset + length - 1}"
        try:
            # botocore retries the request itself; once the body streams, a failure is the caller's to retry.
            resp = self.client.get_object(Bucket=self.bucket, Key=full, Range=f"bytes={offset}-{offset + length - 1}")
            body = resp["Body"]
            try:
                for chunk in body.iter_chunks(_READ_CHUNK):
                    sink.write(chunk)
            finally:
                body.close()
        except StorageError:
            raise
        except Exception as exc:
            raise self._wrap(what, exc) from exc

    def read_bytes(self, key: str) -> bytes:
        full = self._key(key)

        def read() -> bytes:
            body = self.client.get_object(Bucket=self.bucket, Key=full)["Body"]
            try:
                return bytes(body.read())
            finally:
                body.close()

        return bytes(self._call(f"get_object {full}", read))

    def stat(self, key: str) -> ObjectInfo | None:
        info = self._stat_full(self._key(key))
        if info is None:
            return None
        # In md5 mode the store's CRC32C is not trusted: sizes are compared, and the bytes are
        # still checked against the manifest's CRC32C wherever they are read.
        return ObjectInfo(key, info.size, None if self._md5 else info.crc32c, info.modified)

    def _stat_full(self, full: str) -> ObjectInfo | None:
        try:
            head = self._call(
                f"head_object {full}",
                self.client.head_object,
                Bucket=self.bucket,
                Key=full,
                ChecksumMode="ENABLED",
            )
        except ObjectNotFound:
            return None
        crc = None
        # Only a full-object CRC32C is comparable with the manifest; a composite one
        # ("…-N", ChecksumType COMPOSITE) is a checksum of part checksums.
        if head.get("ChecksumCRC32C") and head.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT":
            crc = _b64_to_hex(head["ChecksumCRC32C"])
        return ObjectInfo(full[len(self.prefix) :], int(head["ContentLength"]), crc, head.get("LastModified"))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object under ``prefix`` (ListObjectsV2, paginated; crc32c is not listed: None)."""
        paginator = self.client.get_paginator("list_objects_v2")
        pages = paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix)
        try:
            for page in pages:
                for obj in page.get("Contents", []):
                    yield ObjectInfo(obj["Key"][len(self.prefix) :], int(obj["Size"]), None, obj.get("LastModified"))
        except Exception as exc:
            if isinstance(exc, StorageError):
                raise
            raise self._wrap(f"list {self.prefix + prefix}", exc) from exc

    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` in batches of 1000 (DeleteObjects); missing keys are not an error."""
        batch: builtins.list[str] = []
        for key in keys:
            batch.append(self._key(key))
            if len(batch) == _DELETE_BATCH:
                self._delete_batch(batch)
                batch = []
        if batch:
            self._delete_batch(batch)

    def _delete_batch(self, fulls: builtins.list[str]) -> None:
        resp = self._call(
            f"delete_objects ({len(fulls)} keys)",
            self.client.delete_objects,
            Bucket=self.bucket,
            Delete={"Objects": [{"Key": k} for k in fulls], "Quiet": True},
        )
        errors = [e for e in resp.get("Errors", []) if e.get("Code") != "NoSuchKey"]
        if errors:
            first = errors[0]
            cls = TransientStorageError if first.get("Code") in _TRANSIENT_CODES else StorageError
            raise cls(
                f"s3: delete_objects: {len(errors)} keys failed, first {first.get('Key')}: "
                f"{first.get('Code')} {first.get('Message')}"
            )


class _S3Stream(PartStream):
    """A multipart upload fed as the file is written; the checksum mode is fixed at its start."""

    def __init__(self, storage: S3Storage, full: str, size: int, fd: int, progress: Progress | None) -> None:
        super().__init__(f"s3: {full}", size, storage._part_plan(size), storage._stream_pool.get(), progress=progress)
        self._storage = storage
        self._full = full
        self._fd = fd
        self._md5 = False
        self._upload_id: str | None = None

    def _start(self) -> None:
        self._md5 = self._storage._use_md5()
        self._upload_id = self._storage._create_multipart(self._full, md5=self._md5)

    def _send_part(self, number: int, offset: int, length: int) -> tuple[int, Any]:
        assert self._upload_id is not None
        where = {"number": number, "offset": offset, "length": length}
        etag, crc = self._storage._send_part(
            self._fd, self._full, self._upload_id, **where, what=self.what, md5=self._md5
        )
        return crc, (number, etag, crc, length)

    def _complete(self, tokens: list[Any], crc: int) -> None:
        assert self._upload_id is not None
        storage = self._storage
        storage._complete(self._full, self._upload_id, tokens, crc, self.size, md5=self._md5)
        self._upload_id = None  # completed: nothing left to abort
        if not storage.verify_after_upload:
            return
        try:
            storage._verify_remote(self._full, self.size, crc, md5=self._md5)
        except ChecksumMismatch as exc:
            storage._disagreed(self._full, exc)  # raises when no retry or fallback is left
            raise StorageError(f"{exc}; to be sent again") from exc

    def _abort_upload(self) -> None:
        if self._upload_id is not None:
            self._storage._abort(self._full, self._upload_id)
            self._upload_id = None
