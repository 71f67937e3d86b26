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

import builtins
import contextlib
import datetime as dt
import logging
import os
import tempfile
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from spotguard.crc32c import base64_to_hex
from spotguard.crc32c import crc32c_hex_to_int as _hex_to_int
from spotguard.safefile import read_nofollow
from spotguard.storage.base import (
    CHECKSUM_MODES,
    Capability,
    ObjectInfo,
    Progress,
    Sink,
    StoreDefaults,
    scratch_dir,
    split_bucket_url,
)
from spotguard.storage.errors import ChecksumMismatch, ObjectNotFound, StorageError, TransientStorageError
from spotguard.storage.journal import UploadJournal
from spotguard.storage.s3_api import TRANSIENT_CODES, S3Api, client_config
from spotguard.storage.s3_multipart import MIN_PART, ChecksumVerdict, Part, S3Multipart, crc_of, integrity_args
from spotguard.storage.stream import PartStream, StreamPool, send_file
from spotguard.storage.transfer import fetch_object

log = logging.getLogger(__name__)

MiB = 1024 * 1024
_DELETE_BATCH = 1000  # DeleteObjects' limit
_READ_CHUNK = 1 * MiB  # what a download stream holds in memory at once


def _b64_to_hex(value: str) -> str | None:
    """S3's base64 big-endian checksum as our hex; None for composite (``…-N``) or junk."""
    if "-" in value:
        return None
    try:
        return base64_to_hex(value)
    except ValueError:
        return None


@dataclass(frozen=True)
class ChecksumProbe:
    """What :meth:`S3Storage.probe_checksum` found."""

    store: str  # "<endpoint> bucket <name>"
    sent: str  # the CRC32C of the probe's bytes, hex
    answered: str | None  # the full-object CRC32C the store answered; None: it answered none

    @property
    def agrees(self) -> bool:
        return self.answered in (None, self.sent)


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` → ``("bucket", "some/prefix/")``; the prefix is "" or ends in "/"."""
    return split_bucket_url(url, "s3")


def _check_options(
    checksum: str, checksum_attempts: int, part_size: int, max_concurrency: int, retry_mode: str
) -> None:
    if checksum not in CHECKSUM_MODES:
        raise ValueError(f"checksum must be one of {', '.join(CHECKSUM_MODES)}, not {checksum!r}")
    if checksum_attempts < 1:
        raise ValueError("checksum_attempts must be at least 1")
    if part_size < MIN_PART:
        raise ValueError(f"part_size must be at least {MIN_PART} bytes (S3's minimum)")
    if max_concurrency < 1:
        raise ValueError("max_concurrency must be at least 1")
    if retry_mode not in ("standard", "adaptive", "legacy"):
        raise ValueError(f"retry_mode must be standard, adaptive or legacy, not {retry_mode!r}")


class S3Storage(StoreDefaults):
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

    capabilities: ClassVar[frozenset[Capability]] = frozenset(Capability)

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
        bucket, prefix = parse_s3_url(url)
        config = client_config(max_concurrency, retry_mode, max_attempts, connect_timeout, read_timeout)
        self._api = S3Api(bucket, prefix, config, attempts, client, endpoint_url, region)
        self.part_size = part_size
        self.max_concurrency = max_concurrency
        # One budget of upload streams for the whole instance, shared by every file in flight.
        self._streams = threading.BoundedSemaphore(max_concurrency)
        self.multipart_threshold = multipart_threshold if multipart_threshold is not None else part_size
        self.verify_after_upload = verify_after_upload
        self._verdict = ChecksumVerdict(lambda: self.store_name, checksum, checksum_attempts)
        self._multipart = S3Multipart(self._api, part_size, self._streams)
        self._part_pool = StreamPool(max_concurrency, "s3-part")

    # -- plumbing -------------------------------------------------------------------

    @property
    def bucket(self) -> str:
        return self._api.bucket

    @property
    def prefix(self) -> str:
        return self._api.prefix

    @property
    def client(self) -> Any:
        return self._api.client

    @property
    def journal(self) -> UploadJournal | None:
        return self._multipart.journal

    @property
    def store_name(self) -> str:
        return f"{self.client.meta.endpoint_url} bucket {self.bucket}"

    def set_deadline(self, deadline: float | None) -> None:
        """A notice's deadline (``time.monotonic()``), or None: while set, every request gets the short
        SDK budget and our retries stop at the deadline."""
        self._api.deadline = deadline

    def is_transient(self, exc: BaseException) -> bool:
        return self._api.is_transient(exc)

    def warm(self) -> None:
        """Create the client, resolve credentials and open a connection to the bucket now,
        so that nothing slow (credential chains, DNS, TLS) happens at notice time. One listing of
        a key under the prefix, not a HeadBucket: S3 authorises HeadBucket as s3:ListBucket with no
        prefix, which a role allowed to list only its prefix (``s3:prefix`` condition, as the
        Terraform module's) is refused, and the daemon would not start."""
        self._api.resolve_credentials()
        try:
            self._api.call(
                f"list {self.bucket}/{self.prefix}",
                self.client.list_objects_v2,
                Bucket=self.bucket,
                Prefix=self.prefix,
                MaxKeys=1,
            )
        except ObjectNotFound:
            raise StorageError(f"s3: bucket {self.bucket} does not exist") from None

    def close(self) -> None:
        self._part_pool.close()
        self._api.close()

    # -- uploads --------------------------------------------------------------------

    def put_file(self, local: Path, key: str, *, crc32c: str, progress: Progress | None = None) -> None:
        expected = _hex_to_int(crc32c)
        full = self._api.key(key)
        size = os.path.getsize(local)
        while True:
            md5 = self._verdict.use_md5()
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
                self._verdict.disagreed(full, exc)  # raises when neither a retry nor a fallback is left

    def _put_single(self, local: Path, full: str, expected: int, *, md5: bool) -> None:
        # The budget first: bytes are read only once they can be sent.
        with self._streams:
            data = read_nofollow(local)
            actual = crc_of(data)
            if actual != expected:
                raise StorageError(f"s3: {local}: local CRC32C {actual:08x} != expected {expected:08x}; not uploaded")
            self._put_object(full, data, expected, md5=md5)

    def _put_object(self, full: str, data: bytes, expected: int, *, md5: bool, **conditions: str) -> None:
        self._api.on_key(
            "put_object",
            full,
            " (if absent)" if conditions else "",
            Body=data,
            **integrity_args(data, expected, md5),
            **conditions,
        )

    def put_bytes_if_absent(self, key: str, data: bytes, *, crc32c: str) -> None:
        """One PUT with ``If-None-Match: *``: S3 writes it only if the key does not exist yet."""
        full = self._api.key(key)
        expected = _hex_to_int(crc32c)
        if crc_of(data) != expected:
            raise StorageError(f"s3: {full}: CRC32C of the bytes given != expected {crc32c}; not uploaded")
        md5 = self._verdict.use_md5()
        with self._streams:
            self._put_object(full, data, expected, md5=md5, IfNoneMatch="*")

    def _put_multipart(
        self, local: Path, full: str, size: int, expected: int, progress: Progress | None, *, md5: bool
    ) -> None:
        """Through the part engine; verified by the caller (a disagreement may send it again)."""
        send_file(
            local,
            size,
            f"{expected:08x}",
            what=f"s3: {local}",
            plan=self._multipart.plan(size),
            pool=self._part_pool.get(),
            initiate=lambda fd: _S3Upload(self, full, fd, md5=md5, size=size, verify=False),
            progress=progress,
        )

    def begin_stream(self, key: str, size: int, fd: int, *, progress: Progress | None = None) -> PartStream | None:
        """Multipart parts sent as the file is written (``spotguard.storage.stream``), smaller toward
        the file's end (``streamed_plan``); None for a file below ``multipart_threshold`` (one PUT
        once it is finished)."""
        if size < self.multipart_threshold or size == 0:
            return None
        full = self._api.key(key)

        def initiate() -> _S3Upload:
            # The checksum mode is fixed when the upload opens.
            return _S3Upload(self, full, fd, md5=self._verdict.use_md5(), size=size, verify=self.verify_after_upload)

        plan = self._multipart.stream_plan(size, self.max_concurrency)
        return PartStream(f"s3: {full}", size, plan, self._part_pool.get(), initiate, progress=progress)

    def keep_journal(self, journal: UploadJournal) -> int:
        return self._multipart.keep_journal(journal)

    def retry_aborts(self) -> int:
        return self._multipart.retry_aborts()

    def abort_stale_multipart_uploads(self, older_than: dt.timedelta | None = None) -> int:
        """Abort unfinished multipart uploads under our prefix; returns how many.

        Called at daemon start. Pass ``older_than`` whenever another writer may share the prefix
        (the other nodes of a job, a replacement VM): it spares uploads initiated more recently,
        which may be in flight. ListMultipartUploads names no writer, so age is what tells.
        """
        aborted = self._multipart.abort_stale(older_than)
        if aborted:
            log.info("s3: aborted %d stale multipart uploads under %s", aborted, self.url)
        return aborted

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
                self._api.on_key("delete_object", full)
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
        crc = crc_of(data)
        full = self._api.key(key)
        with tempfile.TemporaryDirectory(prefix="spotguard-probe-", dir=scratch_dir()) as scratch:
            local = Path(scratch) / "probe"
            local.write_bytes(data)
            self._put_multipart(local, full, len(data), crc, None, md5=False)
        try:
            info = self._stat_full(full)
        finally:
            self._api.on_key("delete_object", full)
        probe = ChecksumProbe(self.store_name, f"{crc:08x}", None if info is None else info.crc32c)
        if adopt and not probe.agrees:
            self._verdict.adopt_md5()
        return probe

    # -- downloads and metadata -------------------------------------------------------

    def get_file(self, key: str, local: Path) -> None:
        """Parallel ranged GETs (``max_concurrency`` streams of ``part_size`` or more), CRC32C
        checked against what S3 stores for the object, or the size alone where it stores none."""
        info = self.stat(key)
        if info is None:
            raise ObjectNotFound(f"s3: {self.url}/{key}: not found")
        fetch_object(self, info, Path(local), streams=self.max_concurrency, min_range=self.part_size)

    def read_range(self, key: str, offset: int, length: int, sink: Sink) -> None:
        full = self._api.key(key)
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
            raise self._api.wrap(what, exc) from exc

    def read_bytes(self, key: str) -> bytes:
        full = self._api.key(key)

        def read() -> bytes:
            body = self.client.get_object(Bucket=self.bucket, Key=full)["Body"]
            try:
                return bytes(body.read())
            finally:
                body.close()

        return bytes(self._api.call(f"get_object {full}", read))

    def stat(self, key: str) -> ObjectInfo | None:
        info = self._stat_full(self._api.key(key))
        if info is None:
            return None
        # In md5 mode the store's CRC32C is not trusted: sizes are compared, and the bytes are
        # still checked against the manifest's CRC32C wherever they are read.
        return ObjectInfo(key, info.size, None if self._verdict.md5 else info.crc32c, info.modified)

    def _stat_full(self, full: str) -> ObjectInfo | None:
        try:
            head = self._api.on_key("head_object", full, ChecksumMode="ENABLED")
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
            raise self._api.wrap(f"list {self.prefix + prefix}", exc) from exc

    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` in batches of 1000 (DeleteObjects); missing keys are not an error."""
        batch: builtins.list[str] = []
        for key in keys:
            batch.append(self._api.key(key))
            if len(batch) == _DELETE_BATCH:
                self._delete_batch(batch)
                batch = []
        if batch:
            self._delete_batch(batch)

    def _delete_batch(self, fulls: builtins.list[str]) -> None:
        resp = self._api.call(
            f"delete_objects ({len(fulls)} keys)",
            self.client.delete_objects,
            Bucket=self.bucket,
            Delete={"Objects": [{"Key": k} for k in fulls], "Quiet": True},
        )
        errors = [e for e in resp.get("Errors", []) if e.get("Code") != "NoSuchKey"]
        if errors:
            first = errors[0]
            cls = TransientStorageError if first.get("Code") in TRANSIENT_CODES else StorageError
            raise cls(
                f"s3: delete_objects: {len(errors)} keys failed, first {first.get('Key')}: "
                f"{first.get('Code')} {first.get('Message')}"
            )


class _S3Upload:
    """One multipart upload as the part engine drives it (:class:`~spotguard.storage.stream.PartUpload`):
    opened at construction, parts read from ``fd``; ``verify``: check the completed object here (a
    stream; a whole file is checked by ``put_file``, which may send it again)."""

    def __init__(self, storage: S3Storage, full: str, fd: int, *, md5: bool, size: int, verify: bool) -> None:
        self._storage = storage
        self._multipart = storage._multipart
        self._full = full
        self._fd = fd
        self._md5 = md5
        self._size = size
        self._verify = verify
        self._upload_id: str | None = self._multipart.create(full, md5=md5)

    def put_part(self, number: int, offset: int, length: int) -> tuple[int, Part]:
        assert self._upload_id is not None
        etag, crc = self._multipart.send_part(
            self._fd, self._full, self._upload_id, (number, offset, length), self._md5
        )
        return crc, (number, etag, crc, length)

    def complete(self, tokens: list[Part], crc: int) -> None:
        assert self._upload_id is not None
        upload_id = self._upload_id  # kept until completed: a completion that fails leaves it to abort
        if not self._multipart.complete(self._full, upload_id, tokens, crc, md5=self._md5):
            # A completion retried after a lost response finds the upload gone: if the object is
            # there with our size, the first attempt won.
            info = self._storage._stat_full(self._full)
            if info is None or info.size != self._size:
                raise StorageError(f"s3: complete_multipart_upload {self._full}: NoSuchUpload")
            log.info("s3: %s completed by an earlier attempt", self._full)
            self._multipart.journal_done(upload_id)
        self._upload_id = None
        if self._verify:
            try:
                self._storage._verify_remote(self._full, self._size, crc, md5=self._md5)
            except ChecksumMismatch as exc:
                self._storage._verdict.disagreed(self._full, exc)  # raises when no retry or fallback is left
                raise StorageError(f"{exc}; to be sent again") from exc

    def abort(self) -> None:
        if self._upload_id is not None:
            self._multipart.abort(self._full, self._upload_id)
            self._upload_id = None
