"""``gs://bucket/prefix`` on google-cloud-storage.

Integrity: the manifest's CRC32C is set on the object's metadata before the
upload, so GCS itself rejects an upload whose bytes do not match (400); the
client also checks the CRC32C of the bytes it sent (``checksum="crc32c"``);
and after the upload the CRC32C GCS reports must equal ours, or the object is
deleted and the upload fails.

Parallelism for one large file: GCS's XML multipart API (what
``transfer_manager.upload_chunks_concurrently`` uses) is not implemented by
gcp-storage-emulator, so files of at least ``parallel_threshold`` bytes are
uploaded as up to 32 parts in parallel, each a temporary object under
``<prefix>.spotguard-parts/<upload id>/`` with its own CRC32C, then joined by
one ``compose`` call (which GCS and the emulator both implement; GCS computes
the composite's CRC32C, so it is still checked against the manifest), and the
parts deleted. Parts are at most ``max_part_size``; a file that needs more than
32 is composed in rounds (as is a file streamed while it is written, whose parts
shrink toward its end: ``spotguard.storage.stream.streamed_plan``). A part is
streamed from the file once a stream of the budget is free (its CRC32C in one pass, the upload in a second), so memory
stays at a few chunks per stream whatever the file's size. Parts left by a killed process are removed by
``abort_stale_multipart_uploads()`` and are never listed by ``list()``.
Smaller files go up in one resumable (or, up to 8 MiB, multipart) upload;
across files, callers parallelise.

Emulator: when ``STORAGE_EMULATOR_HOST`` is set the client talks to it with
anonymous credentials and a placeholder project.

Retries: google-cloud-storage retries each request with a
``google.api_core.retry.Retry`` whose predicate is our ``is_transient``
(429, 5xx, resets, timeouts); uploads are retried too, since our objects are
written once under fresh names.
"""

from __future__ import annotations

import builtins
import concurrent.futures as cf
import contextlib
import datetime as dt
import io
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import google.api_core.exceptions as gexc
import google.auth.exceptions
import google_crc32c
import requests
import requests.adapters
from google.api_core.retry import Retry
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage as gcs

from spotguard.cloudclock import cloud_now
from spotguard.crc32c import base64_to_hex
from spotguard.crc32c import crc32c_hex_to_int as _hex_to_int
from spotguard.crc32c import crc32c_int_to_base64 as _int_to_b64
from spotguard.safefile import open_nofollow
from spotguard.storage.base import (
    Capability,
    ObjectInfo,
    Progress,
    RecentKeys,
    Sink,
    StoreDefaults,
    connections_needed,
    read_exactly,
    split_bucket_url,
)
from spotguard.storage.cleanups import FailedCleanups
from spotguard.storage.errors import ChecksumMismatch, ObjectExists, ObjectNotFound, StorageError, TransientStorageError
from spotguard.storage.stream import PartStream, StreamPool, send_file, streamed_plan
from spotguard.storage.transfer import fetch_object

try:  # the class moved between google-cloud-storage 2.x (resumable_media) and 3.x
    from google.cloud.storage.exceptions import DataCorruption, InvalidResponse
except ImportError:  # pragma: no cover - depends on the installed version
    from google.resumable_media import DataCorruption, InvalidResponse  # type: ignore[no-redef,unused-ignore]

log = logging.getLogger(__name__)
# New sessions for one object after its session refused a chunk (see GcsStorage._upload); an object
# exists only once a session completes, so an abandoned one leaves nothing behind.
_SESSION_RESTARTS = 2

MiB = 1024 * 1024
_CHUNK_QUANTUM = 256 * 1024  # resumable chunk sizes must be multiples of 256 KiB
_MAX_COMPOSE = 32  # sources per compose call
_MIN_STREAMED_PART = 5 * MiB  # the last part of a streamed file (``streamed_plan``)
PARTS_DIR = ".spotguard-parts"
DELETE_RETRY_INTERVAL = 60.0  # seconds between tries to delete upload parts whose delete failed
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})


def gcs_crc_to_hex(value: str | None) -> str | None:
    """GCS's ``crc32c`` (base64 of the big-endian value) → our 8 hex chars."""
    if not value:
        return None
    try:
        return base64_to_hex(value)
    except ValueError:
        return None


def parse_gs_url(url: str) -> tuple[str, str]:
    """``gs://bucket/some/prefix`` → ``("bucket", "some/prefix/")``; the prefix is "" or ends in "/"."""
    return split_bucket_url(url, "gs")


def _round_up(n: int, quantum: int) -> int:
    return -(-n // quantum) * quantum


def _part_length(size: int, part_size: int, max_part_size: int) -> int:
    """The parts' length for a file of ``size`` bytes: ``part_size``, more when the file would need more
    than one compose call's sources, at most ``max_part_size``."""
    part = max(part_size, _round_up(-(-size // _MAX_COMPOSE), _CHUNK_QUANTUM))
    return min(part, max(part_size, max_part_size))


def part_plan(size: int, part_size: int, max_part_size: int) -> list[tuple[int, int, int]]:
    """The parts of a finished file of ``size`` bytes: (number from 0, offset, length), equal but the last."""
    part = _part_length(size, part_size, max_part_size)
    return [(i, off, min(part, size - off)) for i, off in enumerate(range(0, size, part))]


class _FileRange(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file as a seekable stream of their own, for an
    SDK that reads an upload body in chunks (and rewinds it to resend one): ``pread``, so parts
    of one file share its descriptor without sharing a position."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__()
        self._fd = fd
        self._offset = offset
        self._length = length
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = min(max(base + pos, 0), self._length)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        want = min(len(buffer), self._length - self._pos)
        if want <= 0:
            return 0
        got = os.preadv(self._fd, [memoryview(buffer)[:want]], self._offset + self._pos)
        if got == 0:
            raise StorageError(f"gcs: the file shrank while uploading (at {self._offset + self._pos})")
        self._pos += got
        return got


def _refused_by_session(exc: BaseException) -> bool:
    """A 400 answered to a chunk of a resumable upload session (its URL names the session)."""
    request = getattr(getattr(exc, "response", None), "request", None)
    return "upload_id=" in str(getattr(request, "url", ""))


def is_transient_error(exc: BaseException) -> bool:
    """429, 5xx, resets, timeouts, corruption in transit: yes. 400/401/403/404/409/412: no."""
    if isinstance(exc, TransientStorageError):
        return True
    if isinstance(exc, StorageError):
        return False
    if isinstance(exc, gexc.RetryError):
        return exc.cause is not None and is_transient_error(exc.cause)
    if isinstance(exc, gexc.GoogleAPICallError):
        return exc.code in _TRANSIENT_STATUS or isinstance(exc, gexc.TooManyRequests | gexc.ServerError)
    if isinstance(exc, InvalidResponse):
        status = getattr(exc.response, "status_code", None)
        return status in _TRANSIENT_STATUS
    if isinstance(exc, DataCorruption):
        # The client and the server disagree about bytes that crossed the wire:
        # the library has deleted the object; sending it again may well work.
        return True
    if isinstance(
        exc,
        requests.exceptions.ConnectionError | requests.exceptions.Timeout | requests.exceptions.ChunkedEncodingError,
    ):
        return True
    if isinstance(exc, google.auth.exceptions.TransportError):
        return True
    return isinstance(exc, ConnectionError | TimeoutError)


def compose_parts(
    bucket: Any, sources: list[Any], dest: Any, *, parts_prefix: str, made: list[Any], **call: Any
) -> Any:
    """Join ``sources`` into the blob ``dest`` (``call``: the retry and timeout of each request); every
    intermediate object made is added to ``made``. Over 32 parts (capped part sizes on a very large
    file): composed in rounds of 32."""
    level = 0
    while len(sources) > _MAX_COMPOSE:
        level += 1
        groups = [sources[i : i + _MAX_COMPOSE] for i in range(0, len(sources), _MAX_COMPOSE)]
        sources = []
        for n, group in enumerate(groups):
            joined = bucket.blob(f"{parts_prefix}join-{level}-{n:05d}")
            joined.content_type = "application/octet-stream"
            joined.compose(group, **call)
            made.append(joined)
            sources.append(joined)
    dest.content_type = "application/octet-stream"
    dest.compose(sources, **call)
    return dest


def make_client(project: str | None, max_concurrency: int) -> Any:
    """A client for the emulator (``STORAGE_EMULATOR_HOST``) or for GCS, its connection pool sized to
    ``max_concurrency`` requests in flight."""
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        # The emulator checks no credentials; without these the client would
        # search for real ones (and a project) and fail or hang on a metadata server.
        client = gcs.Client(project=project or "spotguard-emulator", credentials=AnonymousCredentials())
    else:
        client = gcs.Client(project=project)
    # requests' pool keeps 10 connections per host; a connection over the pool's size is made for one
    # request and dropped after it (a new handshake and slow start for the next): size it to our load.
    adapter = requests.adapters.HTTPAdapter(
        pool_connections=4, pool_maxsize=connections_needed(max_concurrency), max_retries=0
    )
    session = client._http
    session.mount("https://", adapter)
    session.mount("http://", adapter)
    return client


class GcsStorage(StoreDefaults):
    capabilities: ClassVar[frozenset[Capability]] = frozenset(
        {Capability.STREAMING, Capability.DEADLINE, Capability.WARM_UP, Capability.STALE_SWEEP}
    )

    """The ``Storage`` backend for ``gs://bucket/prefix``.

    Example::

        storage = GcsStorage("gs://my-bucket/run1", max_concurrency=8)
        storage.warm()
        storage.abort_stale_multipart_uploads(older_than=dt.timedelta(hours=1))
        storage.put_file(Path("/nvme/ckpt/step-1/model.pt"), "step-1/model.pt", crc32c="1a2b3c4d")

    Options (all have defaults):
        chunk_size: resumable upload chunk (a multiple of 256 KiB); a lost chunk is all a retry resends.
        max_concurrency: upload requests in flight at once, across every file this instance uploads
            (the uploader sends several files in parallel; per-file pools would multiply), and
            ranged reads in flight for one large file downloaded with ``get_file``.
        parallel_threshold: files at least this big are uploaded as parallel parts + compose,
            and downloaded with parallel ranged reads.
        part_size: size of those parts (raised so that one file needs at most 32, up to
            ``max_part_size``: a larger file takes more parts, composed in rounds of 32). A part is
            streamed from the file, never held in memory whole.
        client: a ready ``google.cloud.storage.Client`` (not closed by ``close()``).
        project: the client's project (default: from the environment; a placeholder for the emulator).
        timeout: seconds for each HTTP request (connect and read).
        retry_deadline: seconds one operation keeps retrying transient errors.
    """

    def __init__(
        self,
        url: str,
        *,
        chunk_size: int = 8 * MiB,
        max_concurrency: int = 8,
        parallel_threshold: int = 64 * MiB,
        part_size: int = 32 * MiB,
        max_part_size: int = 1024 * MiB,
        client: Any = None,
        project: str | None = None,
        timeout: float = 60.0,
        retry_deadline: float = 120.0,
    ) -> None:
        if chunk_size <= 0 or chunk_size % _CHUNK_QUANTUM:
            raise ValueError(f"chunk_size must be a positive multiple of {_CHUNK_QUANTUM}")
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        if part_size <= 0:
            raise ValueError("part_size must be positive")
        self.url = url
        self.bucket_name, self.prefix = parse_gs_url(url)
        self.chunk_size = chunk_size
        self.max_concurrency = max_concurrency
        self.parallel_threshold = parallel_threshold
        self.part_size = part_size
        self.max_part_size = max_part_size
        self.timeout = timeout
        self._project = project
        self._owns_client = client is None
        self._client = client
        self._client_lock = threading.Lock()
        # One budget of requests for the whole instance, parts and their deletes, shared by every file in flight.
        self._streams = threading.BoundedSemaphore(max_concurrency)
        self._deadline: float | None = None
        self.parts = _PartObjects(self)
        self._stream_pool = StreamPool(max_concurrency, "gcs-stream")
        self.retry = Retry(
            predicate=self.is_transient, initial=0.2, maximum=5.0, multiplier=2.0, timeout=retry_deadline
        )

    # -- plumbing -------------------------------------------------------------------

    @property
    def client(self) -> Any:
        if self._client is None:
            with self._client_lock:
                if self._client is None:
                    self._client = make_client(self._project, self.max_concurrency)
        return self._client

    @property
    def bucket(self) -> Any:
        return self.client.bucket(self.bucket_name)

    def _key(self, key: str) -> str:
        if not key or key.startswith("/"):
            raise ValueError(f"key must be relative and non-empty: {key!r}")
        return self.prefix + key

    def _wrap(self, what: str, exc: BaseException, *, reading: bool = False) -> StorageError:
        if isinstance(exc, StorageError):
            return exc
        # A 404 while reading means the object; while writing, the bucket (fatal config error).
        if reading and isinstance(exc, gexc.NotFound):
            return ObjectNotFound(f"gcs: {what}: not found")
        cls = TransientStorageError if self.is_transient(exc) else StorageError
        return cls(f"gcs: {what}: {exc}")

    def set_deadline(self, deadline: float | None) -> None:
        """A notice's deadline (``time.monotonic()``), or None: while set, the library's retries of each
        request stop at the deadline instead of after ``retry_deadline``."""
        self._deadline = deadline

    def _retry_now(self) -> Retry:
        if self._deadline is None:
            return self.retry
        return self.retry.with_timeout(max(1.0, self._deadline - time.monotonic()))

    def is_transient(self, exc: BaseException) -> bool:
        """429, 5xx, resets, timeouts, corruption in transit: yes. 400/401/403/404/409/412: no."""
        return is_transient_error(exc)

    def warm(self) -> None:
        """Create the client, resolve credentials and reach the bucket now, not at notice time."""
        try:
            # Listing one object needs storage.objects.list, which the uploader needs anyway;
            # get_bucket would need storage.buckets.get, which objectAdmin roles lack.
            for _ in self.client.list_blobs(
                self.bucket_name, prefix=self.prefix, max_results=1, retry=self._retry_now(), timeout=self.timeout
            ):
                pass
        except Exception as exc:
            raise self._wrap(f"list gs://{self.bucket_name}/{self.prefix}", exc) from exc

    def close(self) -> None:
        self._stream_pool.close()
        if self._owns_client and self._client is not None:
            self._client.close()
            self._client = None

    # -- uploads --------------------------------------------------------------------

    def put_file(self, local: Path, key: str, *, crc32c: str, progress: Progress | None = None) -> None:
        expected = _hex_to_int(crc32c)
        full = self._key(key)
        size = os.path.getsize(local)
        if size >= self.parallel_threshold and self.max_concurrency > 1 and size > self.part_size:
            self._put_composed(Path(local), full, size, expected, progress)  # verified as it completes
            return
        with self._streams:
            blob = self._put_one(Path(local), full, expected)
        if progress:
            progress(size)
        self._verify(blob, full, size, expected)

    def _new_blob(self, name: str, crc: int) -> Any:
        blob = self.bucket.blob(name, chunk_size=self.chunk_size)
        # Declaring the CRC32C up front makes GCS refuse bytes that do not match it.
        blob.crc32c = _int_to_b64(crc)
        return blob

    def _put_one(self, local: Path, full: str, expected: int) -> Any:
        fd = open_nofollow(local)
        try:
            return self._upload(full, expected, fd, 0, os.fstat(fd).st_size)
        except Exception as exc:
            raise self._wrap(f"upload {full}", exc) from exc
        finally:
            os.close(fd)

    def _upload(self, name: str, crc: int, fd: int, offset: int, length: int) -> Any:
        """Bytes ``[offset, offset + length)`` of ``fd`` as the object ``name``, its CRC32C declared. A
        chunk whose answer was lost is sent again at the offset the library knows, which a session that
        took it refuses (400): the object starts again in a new session (:data:`_SESSION_RESTARTS`)."""
        for restart in range(_SESSION_RESTARTS + 1):
            blob = self._new_blob(name, crc)
            try:
                blob.upload_from_file(
                    _FileRange(fd, offset, length),
                    size=length,
                    content_type="application/octet-stream",
                    checksum="crc32c",
                    retry=self._retry_now(),
                    timeout=self.timeout,
                )
            except gexc.BadRequest as exc:
                if restart == _SESSION_RESTARTS or not _refused_by_session(exc):
                    raise
                log.warning("gcs: upload of %s: its resumable session refused a chunk (%s); starting again", name, exc)
                continue
            return blob
        raise AssertionError("unreachable: the last attempt returns or raises")

    def put_bytes_if_absent(self, key: str, data: bytes, *, crc32c: str) -> None:
        """One upload with ``ifGenerationMatch=0``: GCS writes it only if no live object has the name.
        (gcp-storage-emulator ignores the precondition; GCS itself answers 412.)"""
        full = self._key(key)
        expected = _hex_to_int(crc32c)
        blob = self._new_blob(full, expected)
        try:
            with self._streams:
                blob.upload_from_string(
                    data,
                    content_type="application/json",
                    checksum="crc32c",
                    if_generation_match=0,
                    retry=self._retry_now(),
                    timeout=self.timeout,
                )
        except gexc.PreconditionFailed:
            raise ObjectExists(f"gcs: {self.url}/{key}: already exists") from None
        except Exception as exc:
            raise self._wrap(f"upload {full} (if absent)", exc) from exc
        self._verify(blob, full, len(data), expected)

    def _put_part(self, fd: int, name: str, offset: int, length: int) -> Any:
        """One part, streamed from the file: its CRC32C is computed in a first pass and declared, so GCS
        refuses the part if the bytes sent in the second differ; neither pass holds more than a chunk."""
        crc = 0
        for done in range(0, length, self.chunk_size):
            chunk = read_exactly(fd, offset + done, min(self.chunk_size, length - done), f"gcs: {name}")
            crc = int(google_crc32c.extend(crc, chunk))
        return self._upload(name, crc, fd, offset, length)

    def _put_composed(self, local: Path, full: str, size: int, expected: int, progress: Progress | None) -> None:
        """Through the part engine: parts as temporary objects, composed and verified at the end."""
        send_file(
            local,
            size,
            f"{expected:08x}",
            what=f"gcs: {full}",
            plan=part_plan(size, self.part_size, self.max_part_size),
            pool=self._stream_pool.get(),
            initiate=lambda fd: _GcsUpload(self, full, size, fd),
            progress=progress,
        )

    def begin_stream(self, key: str, size: int, fd: int, *, progress: Progress | None = None) -> PartStream | None:
        """Parts uploaded as the file is written, composed at the finish; None for a file that
        ``put_file`` would send in one upload."""
        if size < self.parallel_threshold or self.max_concurrency == 1 or size <= self.part_size:
            return None
        full = self._key(key)
        # Smaller parts toward the end (more than 32 are composed in rounds): little is left to send
        # once the last byte is written.
        part = _part_length(size, self.part_size, self.max_part_size)
        plan = streamed_plan(size, part, min_part=min(_MIN_STREAMED_PART, part), streams=self.max_concurrency, first=0)
        initiate = lambda: _GcsUpload(self, full, size, fd)  # noqa: E731
        return PartStream(f"gcs: {full}", size, plan, self._stream_pool.get(), initiate, progress=progress)

    def _verify(self, blob: Any, full: str, size: int, expected: int) -> None:
        stored = gcs_crc_to_hex(blob.crc32c)
        problem = None
        disagrees = False
        if blob.size is not None and int(blob.size) != size:
            problem = f"size {blob.size} != {size}"
        elif stored is None:
            problem = "the store reported no CRC32C"
        elif stored != f"{expected:08x}":
            problem = f"stored CRC32C {stored} != expected {expected:08x}"
            disagrees = True
        if problem:
            self.parts.delete({full})
            message = f"gcs: {full}: {problem}; object deleted"
            if disagrees and stored is not None:
                # GCS was told the CRC32C up front and refuses other bytes; a store that accepts
                # them and answers another CRC32C answers it again: the uploader does not retry.
                raise ChecksumMismatch(message, sent=f"{expected:08x}", answered=stored)
            raise StorageError(message)

    def abort_stale_multipart_uploads(self, older_than: dt.timedelta | None = None) -> int:
        """Delete parts left under ``<prefix>.spotguard-parts/`` by an interrupted upload;
        returns how many. Same name as the S3 backend's so the daemon calls either at start;
        ``older_than`` spares younger parts, which may be another writer's upload in flight."""
        return self.parts.sweep(older_than)

    def retry_aborts(self) -> int:
        return self.parts.retry_deletes()

    # -- downloads and metadata -------------------------------------------------------

    def _get_blob(self, full: str) -> Any:
        try:
            blob = self.bucket.get_blob(full, retry=self._retry_now(), timeout=self.timeout)
        except Exception as exc:
            raise self._wrap(f"get {full}", exc, reading=True) from exc
        if blob is None:
            raise ObjectNotFound(f"gcs: {self.url}/{full[len(self.prefix) :]}: not found")
        return blob

    def get_file(self, key: str, local: Path) -> None:
        """Parallel ranged reads for objects of ``parallel_threshold`` bytes or more, CRC32C
        checked against the object's as the bytes arrive."""
        info = self.stat(key)
        if info is None:
            raise ObjectNotFound(f"gcs: {self.url}/{key}: not found")
        streams = self.max_concurrency if info.size >= self.parallel_threshold else 1
        fetch_object(self, info, Path(local), streams=streams, min_range=self.part_size)

    def read_range(self, key: str, offset: int, length: int, sink: Sink) -> None:
        full = self._key(key)
        try:
            # No library retry: a retried ranged read would write into the sink twice; the caller
            # restarts the whole range instead. No library checksum: it covers whole objects only.
            self.bucket.blob(full).download_to_file(
                sink,
                start=offset,
                end=offset + length - 1,
                raw_download=True,
                checksum=None,
                retry=None,
                timeout=self.timeout,
            )
        except Exception as exc:
            raise self._wrap(f"read {full} bytes={offset}-{offset + length - 1}", exc, reading=True) from exc

    def read_bytes(self, key: str) -> bytes:
        full = self._key(key)
        try:
            return bytes(
                self.bucket.blob(full).download_as_bytes(
                    checksum="crc32c", retry=self._retry_now(), timeout=self.timeout
                )
            )
        except Exception as exc:
            raise self._wrap(f"read {full}", exc, reading=True) from exc

    def stat(self, key: str) -> ObjectInfo | None:
        try:
            blob = self._get_blob(self._key(key))
        except ObjectNotFound:
            return None
        return ObjectInfo(key, int(blob.size or 0), gcs_crc_to_hex(blob.crc32c), blob.updated)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object under ``prefix`` (paginated), with its CRC32C; upload parts are hidden."""
        try:
            for blob in self.client.list_blobs(
                self.bucket_name, prefix=self.prefix + prefix, retry=self._retry_now(), timeout=self.timeout
            ):
                key = blob.name[len(self.prefix) :]
                if key.startswith(PARTS_DIR + "/"):
                    continue
                yield ObjectInfo(key, int(blob.size or 0), gcs_crc_to_hex(blob.crc32c), blob.updated)
        except StorageError:
            raise
        except Exception as exc:
            raise self._wrap(f"list {self.prefix + prefix}", exc) from exc

    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys``; missing keys are not an error."""
        self.parts.delete({self._key(k) for k in keys}, strict=True)


class _PartObjects:
    """The temporary objects of one store's composed uploads (and any object it must delete): where an
    upload's parts go, what a killed run left of a key's, what a sweep finds, and the deletes that
    failed while the store did (tried again at the uploader's rescans: parts are hidden from
    listings, so no retention would ever see them)."""

    def __init__(self, storage: GcsStorage) -> None:
        self._storage = storage
        self._created = dt.datetime.now(dt.UTC)
        self._leftovers_lock = threading.Lock()
        self._leftovers_checked = RecentKeys()  # keys whose parts left by an earlier run are deleted
        self.failed_deletes: FailedCleanups[None] = FailedCleanups(DELETE_RETRY_INTERVAL)

    def prefix_for(self, full: str) -> str:
        """Where the parts of one upload of ``full`` go: under the key, so that a later upload of
        the same key finds what a killed one left (:meth:`drop_leftovers`)."""
        storage = self._storage
        return f"{storage.prefix}{PARTS_DIR}/{full[len(storage.prefix) :]}/{uuid.uuid4().hex}/"

    def drop_leftovers(self, full: str) -> None:
        """Delete the parts of ``full`` written before this store was made (a killed daemon's).
        Once per key; a failure only leaves them to :meth:`sweep`."""
        with self._leftovers_lock:
            if full in self._leftovers_checked:
                return
            self._leftovers_checked.add(full)
        storage = self._storage
        where = f"{storage.prefix}{PARTS_DIR}/{full[len(storage.prefix) :]}/"
        try:
            stale = {
                b.name
                for b in storage.client.list_blobs(storage.bucket_name, prefix=where, timeout=storage.timeout)
                if b.time_created is None or b.time_created < self._created
            }
        except Exception as exc:
            log.warning("gcs: cannot list the leftover parts of %s: %s", full, exc)
            return
        if stale:
            log.info("gcs: deleting %d parts of %s left by an earlier run", len(stale), full)
            self.delete(stale)

    def sweep(self, older_than: dt.timedelta | None) -> int:
        """Delete every part under the prefix (older than ``older_than``); how many."""
        storage = self._storage
        cutoff = cloud_now() - older_than if older_than is not None else None  # GCS stamps the cloud's time
        try:
            stale = [
                b.name
                for b in storage.client.list_blobs(
                    storage.bucket_name,
                    prefix=f"{storage.prefix}{PARTS_DIR}/",
                    retry=storage._retry_now(),
                    timeout=storage.timeout,
                )
                if cutoff is None or b.time_created is None or b.time_created <= cutoff
            ]
        except Exception as exc:
            raise storage._wrap("list stale parts", exc) from exc
        self.delete(set(stale))
        if stale:
            log.info("gcs: deleted %d stale upload parts under %s", len(stale), storage.url)
        return len(stale)

    def delete(self, names: builtins.set[str], *, strict: bool = False) -> None:
        """Delete ``names`` (missing ones are no error); ``strict``: raise on a failure, else note it
        for :meth:`retry_deletes`."""
        if not names:
            return
        storage = self._storage

        def one(name: str) -> None:
            with storage._streams, contextlib.suppress(gexc.NotFound):  # also when a retried delete already won
                storage.bucket.delete_blob(name, retry=storage._retry_now(), timeout=storage.timeout)
            self.failed_deletes.cleaned(name)

        with cf.ThreadPoolExecutor(max_workers=min(storage.max_concurrency, len(names))) as pool:
            futures = {pool.submit(one, n): n for n in sorted(names)}
            errors = [(futures[f], f.exception()) for f in futures if f.exception() is not None]
        if errors:
            name, exc = errors[0]
            if strict:
                assert exc is not None
                raise storage._wrap(f"delete {len(errors)} objects, first {name}", exc) from exc
            for failed, _ in errors:
                self.failed_deletes.failed(failed, None)
            log.warning("gcs: could not delete %d objects, first %s: %s; tried again later", len(errors), name, exc)

    def retry_deletes(self) -> int:
        """Delete again what could not be deleted, once ``failed_deletes.interval`` has passed since the
        last try; how many are gone now."""
        names = {name for name, _ in self.failed_deletes.due()}
        self.delete(names)
        gone = sum(1 for name in names if name not in self.failed_deletes)
        if gone:
            log.info("gcs: deleted %d upload parts whose delete had failed", gone)
        return gone


class _GcsUpload:
    """One composite upload as the part engine drives it (:class:`~spotguard.storage.stream.PartUpload`):
    parts as temporary objects, each with its declared CRC32C, composed and verified at ``complete``;
    every temporary object made is deleted either way."""

    def __init__(self, storage: GcsStorage, full: str, size: int, fd: int) -> None:
        self._storage = storage
        self._full = full
        self._size = size
        self._fd = fd
        self._parts_prefix = storage.parts.prefix_for(full)
        self._made: list[Any] = []
        self._made_lock = threading.Lock()
        storage.parts.drop_leftovers(full)

    def put_part(self, number: int, offset: int, length: int) -> tuple[int, Any]:
        storage = self._storage
        name = f"{self._parts_prefix}{number:05d}"
        try:
            # The budget before the first byte is read: a part waiting for a stream costs nothing.
            with storage._streams:
                blob = storage._put_part(self._fd, name, offset, length)
        except Exception as exc:
            raise storage._wrap(f"upload {name}", exc) from exc
        with self._made_lock:
            self._made.append(blob)
        crc = gcs_crc_to_hex(blob.crc32c)
        if crc is None:
            raise StorageError(f"gcs: {name}: the store reported no CRC32C for the part")
        return int(crc, 16), blob

    def complete(self, tokens: list[Any], crc: int) -> None:
        storage = self._storage
        try:
            dest = compose_parts(
                storage.bucket,
                tokens,
                storage._new_blob(self._full, crc),
                parts_prefix=self._parts_prefix,
                made=self._made,
                retry=storage._retry_now(),
                timeout=storage.timeout,
            )
        except Exception as exc:
            raise storage._wrap(f"compose {self._full} of {len(tokens)} parts", exc) from exc
        finally:
            self.abort()
        storage._verify(dest, self._full, self._size, crc)

    def abort(self) -> None:
        with self._made_lock:
            made, self._made = self._made, []
        self._storage.parts.delete({blob.name for blob in made})
