"""The one seam every object store implements, and the retry helper they share.

A store is a class with the methods of :class:`Storage`: the required ones (put, get, list, …) and
the optional ones, whose defaults :class:`StoreDefaults` gives (a store inherits it). What a store
can do beyond the required set it declares in ``capabilities``; callers call the optional methods
without probing (the defaults are harmless no-ops) and read ``capabilities`` where what they do or
report depends on it (``doctor`` says a store has no checksum probe).

Backends are synchronous: boto3 and google-cloud-storage block, so the daemon
calls them through ``asyncio.to_thread`` (or a bounded executor) and the
trainer hook calls them directly. Keys are relative to the URL's prefix and
always use ``/``.
"""

from __future__ import annotations

import datetime as dt
import enum
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeVar, runtime_checkable
from urllib.parse import urlsplit

from spotguard.backoff import jitter
from spotguard.crc32c import crc32c_of_bytes
from spotguard.repeats import Latest
from spotguard.storage.errors import (  # re-exported: the contract's errors
    ChecksumMismatch,
    ObjectExists,
    ObjectNotFound,
    StorageError,
    TransientStorageError,
)

if TYPE_CHECKING:
    from spotguard.storage.journal import UploadJournal

T = TypeVar("T")

__all__ = [
    "CHECKSUM_MODES",
    "Capability",
    "ChecksumMismatch",
    "ChecksumProbe",
    "connections_needed",
    "Listing",
    "ObjectExists",
    "ObjectInfo",
    "ObjectNotFound",
    "Progress",
    "RecentKeys",
    "Sink",
    "Storage",
    "StorageError",
    "StoreDefaults",
    "TransientStorageError",
    "UploadStream",
    "put_bytes",
    "scratch_dir",
    "read_exactly",
    "retry",
]


Progress = Callable[[int], None]  # called with a number of bytes just transferred


class Sink(Protocol):
    def write(self, data: bytes, /) -> int: ...


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    crc32c: str | None = None  # hex, as in manifest.json; None when the store does not say
    modified: datetime | None = None  # when the object was last written (UTC), where the store says


# What a store's ``listing`` gives: its objects, then its temporaries (a name of its own: inside a
# store class, ``list`` is the method).
Listing = tuple[list[ObjectInfo], list[ObjectInfo]]


class UploadStream(Protocol):
    def add(self, offset: int, length: int) -> None:
        """Bytes ``[offset, offset + length)`` are written; never blocks (parts go up in threads)."""
        ...

    def finish(self, crc32c: str) -> None:
        """The whole file is written and its CRC32C is ``crc32c``: send the rest, check, complete.
        Blocking. On failure the upload is aborted before this raises."""
        ...

    def abort(self) -> None:
        """Drop the upload: nothing completed, nothing left open. Blocking; idempotent."""
        ...


class Capability(enum.Enum):
    """What a store does beyond the required methods (the optional ones are no-ops otherwise)."""

    #: ``begin_stream``: parts go up while the file is still being written.
    STREAMING = "streaming"
    #: ``set_deadline``: while a notice runs, requests get short timeouts and retries stop at it.
    DEADLINE = "deadline"
    #: ``warm``: credentials, DNS and a connection made at start, not at notice time.
    WARM_UP = "warm-up"
    #: ``abort_stale_multipart_uploads`` and ``keep_journal``: unfinished uploads found and removed.
    STALE_SWEEP = "stale-sweep"
    #: ``probe_checksum``: whether the store's answered CRC32Cs can be trusted.
    CHECKSUM_PROBE = "checksum-probe"


@runtime_checkable
class ChecksumProbe(Protocol):
    """What ``probe_checksum`` found: the store's name, the CRC32C sent and the one it answered."""

    @property
    def store(self) -> str: ...

    @property
    def sent(self) -> str: ...

    @property
    def answered(self) -> str | None: ...

    @property
    def agrees(self) -> bool: ...


@runtime_checkable
class Storage(Protocol):
    url: str
    capabilities: ClassVar[frozenset[Capability]]

    def put_file(self, local: Path, key: str, *, crc32c: str, progress: Progress | None = None) -> None:
        """Upload ``local`` to ``key``; visible only once complete; ``crc32c`` is verified by the store.

        ``progress`` is called with byte counts as parts of the file reach the store (a retried
        part may count twice); it must be cheap and must not raise."""
        ...

    def get_file(self, key: str, local: Path) -> None:
        """Download ``key`` to ``local`` (written under a temporary name, then renamed)."""
        ...

    def read_range(self, key: str, offset: int, length: int, sink: Sink) -> None:
        """Write bytes ``[offset, offset + length)`` of ``key`` to ``sink`` as they arrive.

        No retries of its own once bytes were written (the caller restarts the range with a fresh
        sink); raises :class:`ObjectNotFound` for a missing key."""
        ...

    def put_bytes_if_absent(self, key: str, data: bytes, *, crc32c: str) -> None:
        """Create ``key`` holding ``data`` only if nothing is there yet; raise :class:`ObjectExists`
        otherwise. Two writers racing on one key: exactly one succeeds (the commit of a manifest)."""
        ...

    def read_bytes(self, key: str) -> bytes: ...

    def stat(self, key: str) -> ObjectInfo | None: ...

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``."""
        ...

    def delete(self, keys: Iterable[str]) -> None: ...

    def is_transient(self, exc: BaseException) -> bool:
        """Whether ``exc`` raised by this backend is worth retrying."""
        ...

    def close(self) -> None: ...

    # --- optional: see Capability; StoreDefaults has harmless defaults -------------------------

    def warm(self) -> None:
        """Make the client, resolve credentials and open a connection now (at daemon start)."""
        ...

    def set_deadline(self, deadline: float | None) -> None:
        """A notice's deadline (``time.monotonic()``), or None once it is over."""
        ...

    def begin_stream(self, key: str, size: int, fd: int, *, progress: Progress | None = None) -> UploadStream | None:
        """A stream for ``key`` of ``size`` bytes read from ``fd`` (the caller closes it after
        ``finish``/``abort``), or None: the file goes whole once it is finished."""
        ...

    def keep_journal(self, journal: UploadJournal) -> int:
        """At start: abort what ``journal`` says an earlier run left open, then record every upload
        opened from now on in it; how many were aborted."""
        ...

    def abort_stale_multipart_uploads(self, older_than: dt.timedelta | None = None) -> int:
        """Remove unfinished uploads under the prefix (older than ``older_than``); how many."""
        ...

    def retry_aborts(self) -> int:
        """Try again to abort the uploads this instance gave up and could not abort (the store was
        failing then); how many are gone now. At most every so often: cheap to call on every rescan."""
        ...

    def probe_checksum(self, key: str, *, adopt: bool = False) -> ChecksumProbe | None:
        """Upload a tiny object under ``key`` as large files go and compare the CRC32C the store
        answers; None where there is nothing to probe."""
        ...

    def temporaries(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Writes in progress, or left behind by a writer killed mid-write, whose key starts with
        ``prefix``: what ``list`` leaves out, and ``delete`` removes. None in a store whose unfinished
        writes are no objects (S3's multipart uploads are aborted instead)."""
        ...

    def listing(self, prefix: str = "") -> Listing:
        """``list`` and ``temporaries`` of ``prefix`` together, in one pass where the store can."""
        ...


class StoreDefaults:
    """The optional methods of :class:`Storage` for a store that lacks their capability: a store
    class inherits this and overrides what it declares in ``capabilities``."""

    capabilities: ClassVar[frozenset[Capability]] = frozenset()

    def warm(self) -> None:
        """Nothing to make ahead of time."""

    def set_deadline(self, deadline: float | None) -> None:
        """Requests are quick anyway."""

    def begin_stream(self, key: str, size: int, fd: int, *, progress: Progress | None = None) -> UploadStream | None:
        return None

    def keep_journal(self, journal: UploadJournal) -> int:
        return 0

    def abort_stale_multipart_uploads(self, older_than: dt.timedelta | None = None) -> int:
        return 0

    def retry_aborts(self) -> int:
        return 0

    def probe_checksum(self, key: str, *, adopt: bool = False) -> ChecksumProbe | None:
        return None

    def temporaries(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return iter(())

    def listing(self: Storage, prefix: str = "") -> Listing:
        return list(self.list(prefix)), list(self.temporaries(prefix))


def split_bucket_url(url: str, scheme: str) -> tuple[str, str]:
    """``<scheme>://bucket/some/prefix`` → ``("bucket", "some/prefix/")``; the prefix is "" or ends in "/"."""
    parts = urlsplit(url)
    if parts.scheme != scheme or not parts.netloc:
        raise ValueError(f"not a URL of the form {scheme}://bucket/prefix: {url!r}")
    prefix = parts.path.strip("/")
    return parts.netloc, f"{prefix}/" if prefix else ""


# Where small objects wait for their upload: memory (/dev/shm), not the root disk's /tmp, which a VM
# running for months fills; a full one stopped the peer registry's heartbeat.
_MEMORY_SCRATCH = Path("/dev/shm")


def connections_needed(max_concurrency: int) -> int:
    """The HTTP connections a store instance keeps for a budget of ``max_concurrency`` streams: one per
    stream, one for the file-level request (create, complete, compose, verify) of each file in flight
    (the uploader sends at most as many files at once), and a few for listings, the peer registry and
    the rate probe."""
    return max(10, 2 * max_concurrency + 4)


def scratch_dir() -> str | None:
    """A directory for a small object's bytes on their way to a store: ``/dev/shm`` where it can be
    written, else the system's temporary directory (``None``, as ``tempfile`` takes it)."""
    if _MEMORY_SCRATCH.is_dir() and os.access(_MEMORY_SCRATCH, os.W_OK | os.X_OK):
        return str(_MEMORY_SCRATCH)
    return None


def put_bytes(storage: Storage, key: str, data: bytes) -> None:
    """Write a small object holding ``data`` (replacing any at ``key``) through ``put_file``, the one
    write every backend has: the bytes go through a scratch file (blocking), in memory where it can be."""
    with tempfile.TemporaryDirectory(prefix="spotguard-put-", dir=scratch_dir()) as scratch:
        local = Path(scratch) / "object"
        local.write_bytes(data)
        storage.put_file(local, key, crc32c=crc32c_of_bytes(data))


_MAX_PREAD = 1 << 30  # Linux returns at most 0x7ffff000 bytes from one read


def read_exactly(fd: int, offset: int, length: int, what: str) -> bytes:
    """``length`` bytes of ``fd`` at ``offset``, in reads the kernel will serve whole; a file that
    shrank under us is an error, not a short part."""
    chunks = []
    done = 0
    while done < length:
        chunk = os.pread(fd, min(length - done, _MAX_PREAD), offset + done)
        if not chunk:
            raise StorageError(f"{what}: the file shrank while uploading ({done} of {length} bytes at {offset})")
        chunks.append(chunk)
        done += len(chunk)
    return b"".join(chunks)


def retry(
    operation: Callable[[], T],
    *,
    is_transient: Callable[[BaseException], bool],
    deadline: float | None = None,
    attempts: int = 8,
    base_delay: float = 0.2,
    max_delay: float = 5.0,
    what: str = "storage operation",
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Run ``operation``, retrying transient failures with full-jitter backoff.

    Stops at ``attempts`` or when the next wait would pass ``deadline`` (a
    ``clock()`` value, usually the notice's deadline): past it, retrying only
    burns time the VM no longer has. Catches ``Exception`` only, so
    cancellation and KeyboardInterrupt pass through.
    """
    for attempt in range(1, attempts + 1):
        try:
            return operation()
        except Exception as exc:
            if not is_transient(exc) or attempt == attempts:
                raise
            delay = jitter(0, min(max_delay, base_delay * 2 ** (attempt - 1)))
            if deadline is not None and clock() + delay >= deadline:
                raise StorageError(f"{what}: gave up at the deadline after {attempt} attempts: {exc}") from exc
            sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover


class RecentKeys(Latest[str, None]):
    """The ``size`` keys (or folders) a store noted last: what it checks once per key, such as the
    leftovers of an earlier run, without keeping every key a daemon wrote in the months it runs (a
    checkpoint's files a few times an hour). A key that fell out and comes back is checked again:
    that costs a listing, never a wrong answer (only what predates the store's instance is removed)."""

    def __init__(self, size: int = 4096) -> None:
        super().__init__(size)

    def add(self, key: str) -> None:
        self.put(key, None)


#: How uploads to s3:// are verified: see README, "Buckets" (``checksum``).
CHECKSUM_MODES = ("auto", "crc32c", "md5")
