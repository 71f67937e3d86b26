"""Writing state files with several threads: a standard ``torch.save`` file, its bytes written in parallel.

Each ``<key>.pt`` stays exactly what ``torch.save`` writes (a zip archive that ``torch.load`` reads,
``mmap=True`` and ``weights_only=True`` included); only the order in which its bytes reach the disk
changes. One file is written in three steps:

1. **The skeleton.** The preparing thread pickles the payload and writes, under the file's temporary
   name (``.<name>.tmp-<pid>``), every zip record ``torch.save`` writes (``data.pkl``,
   ``.format_version``, ``.storage_alignment``, ``byteorder``, each storage's local header and data
   descriptor, ``version``, the serialization id and the central directory) with a *hole* where each
   storage's bytes go (``PyTorchFileWriter.write_record_metadata``; the hole is sparse). The holes'
   offsets are checked against torch's own reader (``PyTorchFileReader.get_record_offset``) before a
   data byte is written; a file that does not match is written with ``torch.save`` instead.
2. **The data.** The file is cut into pieces of about ``chunk_bytes`` (a large storage into several; the
   small skeleton segments go with their neighbours), and a pool of threads ``pwrite``\\ s each piece into
   its place (``pwrite`` releases the GIL), computing the piece's CRC32C as the bytes pass. Pieces of one
   file, and of the next files, are written concurrently; while the pool writes, the next entry's
   ``state_dict()`` and skeleton are prepared (at most ``max_open`` files are open at once). After each
   piece, ``on_range`` announces ``[offset, offset + length)`` as written.
3. **The commit of the file.** When its last piece is written, the file is fsynced once and renamed to
   its final name; its CRC32C is combined from the pieces' (``crc32c_combine``, no second read). The
   directory is fsynced by :meth:`CheckpointWriter.commit`, before the manifest, which stays last.

The zip records carry no CRC32 of their own (``compute_crc32=False``, as
``torch.serialization.set_crc32_options(False)`` writes them); ``torch.load`` does not need it, and the
manifest's CRC32C covers every byte of the file.

CUDA tensors are copied piece by piece into a few pinned host buffers that are reused from one save to
the next (``non_blocking`` copies on a side stream, an event per piece), so the copy of one piece
overlaps the ``pwrite`` of another and no tensor is ever copied whole to pageable memory. The pieces of
CPU tensors take the same path without the copy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import queue
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

import google_crc32c
import torch

from spotguard.crc32c import crc32c_combine, crc32c_hex
from spotguard.localstore import CheckpointWriter
from spotguard.manifest import FileEntry
from spotguard.safefile import SaveCancelled, tmp_path_for

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger("spotguard.trainer")

DEFAULT_CHUNK_BYTES = 32 << 20
STAGING_BUFFERS = 4  # pinned host buffers of chunk_bytes each, for CUDA tensors

OnRange = Callable[[str, str, int, int, int], None]  # name, tmp relpath, size, offset, length
OnFile = Callable[[str], None]


class _Unsupported(Exception):
    """This torch cannot build the skeleton (an API is missing or changed): use ``torch.save``."""


# --- the skeleton ---------------------------------------------------------------------------


class _SkeletonFile:
    """The file object ``PyTorchFileWriter`` writes through: small writes go to the file at once (and
    are kept for the checksum); a relative seek is a hole that a storage's bytes fill later.

    It never raises into the C++ writer (an exception thrown there again from its destructor would
    abort the process): the first error is kept for :func:`_write_skeleton` to raise, and once
    ``closed``, writes go nowhere (a zip writer collected unfinished writes its end again)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pos = 0
        self.segments: list[tuple[int, bytes]] = []
        self.holes: list[tuple[int, int]] = []
        self.error: BaseException | None = None
        self.closed = False

    def write(self, data: bytes) -> int:
        if self.closed or self.error is not None:
            return len(data)
        data = bytes(data)
        try:
            _pwrite_all(self.fd, memoryview(data), self.pos)
        except OSError as exc:  # ENOSPC must reach the caller as it is
            self.error = exc
        self.segments.append((self.pos, data))
        self.pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_CUR:
            if offset:
                self.holes.append((self.pos, offset))
            self.pos += offset
        elif whence == os.SEEK_SET:
            self.pos = offset
        elif self.error is None:
            self.error = _Unsupported(f"the zip writer seeks from {whence}")
        return self.pos

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass


def _pickle_payload(payload: Any) -> tuple[bytes, dict[str, torch.UntypedStorage]]:
    """``data.pkl`` and the storages it refers to, as ``torch.serialization._save`` pickles them.

    ``_save`` itself cannot be used: it copies each CUDA storage whole to host memory before writing
    it. Its ``persistent_id`` is mirrored here line for line (a test compares ``data.pkl`` with
    ``torch.save``'s byte for byte)."""
    from torch.serialization import location_tag, normalize_storage_type

    storages: dict[str, torch.UntypedStorage] = {}
    keys: dict[int, str] = {}
    dtypes: dict[int, torch.dtype] = {}

    def persistent_id(obj: Any) -> tuple[Any, ...] | None:
        if not (isinstance(obj, torch.storage.TypedStorage) or torch.is_storage(obj)):
            return None
        if isinstance(obj, torch.storage.TypedStorage):
            storage = obj._untyped_storage
            dtype = obj.dtype
            storage_type = getattr(torch, obj._pickle_storage_type())
            numel = obj._size()
        else:
            storage = obj
            dtype = torch.uint8
            storage_type = normalize_storage_type(type(obj))
            numel = storage.nbytes()
        allocated = str(storage.device) != "meta" and storage.data_ptr() != 0
        if allocated and dtypes.setdefault(storage.data_ptr(), dtype) != dtype:
            raise RuntimeError("Cannot save multiple tensors or storages that view the same data as different types")
        key = keys.setdefault(storage._cdata, str(len(keys)))
        fake = getattr(obj, "_fake_device", None)
        location = str(fake) if fake is not None else location_tag(storage)
        storages[key] = storage
        return ("storage", storage_type, key, location, numel)

    buffer = _BytesSink()
    _StoragePickler(buffer, persistent_id).dump(payload)
    return buffer.value(), storages


class _StoragePickler(pickle.Pickler):
    """A pickler whose ``persistent_id`` is the given function. One class for every save: a class made
    per call lives in a reference cycle, and kept the storages its ``persistent_id`` saw (the state's
    and the RNG's) until the cycle collector ran, never when a training loop turns it off."""

    def __init__(self, sink: _BytesSink, persistent: Callable[[Any], tuple[Any, ...] | None]) -> None:
        super().__init__(sink, protocol=torch.serialization.DEFAULT_PROTOCOL)
        self._persistent = persistent

    def persistent_id(self, obj: Any) -> tuple[Any, ...] | None:
        return self._persistent(obj)


class _BytesSink:
    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def value(self) -> bytes:
        return b"".join(self._parts)


@dataclass
class _Storage:
    storage: torch.UntypedStorage
    offset: int  # where its bytes go in the file
    nbytes: int


def _write_skeleton(payload: Any, fd: int, path: Path) -> tuple[_SkeletonFile, list[_Storage], int]:
    """Write the skeleton of ``payload``'s file to ``fd``; the storages, where they go, and the file size."""
    skeleton = _SkeletonFile(fd)
    try:
        # An AttributeError or TypeError here means torch's internals moved (or the payload cannot be
        # pickled at all, which torch.save will then say in its own words).
        import numpy  # noqa: F401  # the threads hand numpy views of the tensors to pwrite and crc32c

        data_pkl, storages = _pickle_payload(payload)
        placed = _write_records(skeleton, data_pkl, storages)
        # torch's reader must find every storage where its bytes will be written.
        reader = torch._C.PyTorchFileReader(str(path))
        offsets = {key: reader.get_record_offset(f"data/{key}") for key in storages}  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ImportError) as exc:
        raise _Unsupported(f"{type(exc).__name__}: {exc}") from exc
    finally:
        skeleton.closed = True
    if any(offsets[key] != item.offset for key, item in placed.items()):
        raise _Unsupported(f"storages are not where the zip writer left holes for them ({offsets})")
    _check_tiling(skeleton, list(placed.values()), skeleton.pos)
    return skeleton, list(placed.values()), skeleton.pos


def _write_records(
    skeleton: _SkeletonFile, data_pkl: bytes, storages: Mapping[str, torch.UntypedStorage]
) -> dict[str, _Storage]:
    """The records of ``torch.serialization._save``, in its order, storages' bytes left out."""
    alignment = torch.serialization._get_storage_alignment()
    zip_writer = torch._C.PyTorchFileWriter(cast(IO[bytes], skeleton), False, alignment)
    zip_writer.write_record("data.pkl", data_pkl, len(data_pkl))
    zip_writer.write_record(".format_version", b"1", 1)
    align = str(alignment).encode()
    zip_writer.write_record(".storage_alignment", align, len(align))
    zip_writer.write_record("byteorder", sys.byteorder.encode(), len(sys.byteorder))
    placed: dict[str, _Storage] = {}
    for key, storage in storages.items():
        nbytes = storage.nbytes()
        holes = len(skeleton.holes)
        zip_writer.write_record_metadata(f"data/{key}", nbytes)  # type: ignore[attr-defined]
        if nbytes:
            if len(skeleton.holes) != holes + 1 or skeleton.holes[-1][1] != nbytes:
                skeleton.error = skeleton.error or _Unsupported(f"data/{key}: no hole of {nbytes} bytes left for it")
            else:
                placed[key] = _Storage(storage, skeleton.holes[-1][0], nbytes)
    zip_writer.write_end_of_file()
    if skeleton.error is not None:
        raise skeleton.error
    return placed


def _check_tiling(skeleton: _SkeletonFile, placed: list[_Storage], size: int) -> None:
    """The skeleton's writes and the storages' holes cover ``[0, size)`` exactly once."""
    spans = sorted([(o, len(d)) for o, d in skeleton.segments] + [(s.offset, s.nbytes) for s in placed])
    position = 0
    for offset, length in spans:
        if offset != position:
            raise _Unsupported(f"the file has a gap or an overlap at {position}")
        position += length
    if position != size:
        raise _Unsupported(f"the file's pieces end at {position}, not {size}")


# --- pieces ---------------------------------------------------------------------------------


@dataclass
class _Part:
    offset: int
    data: bytes | None = None  # a skeleton segment, already on disk
    storage: _Storage | None = None  # or a slice of a storage, to write
    start: int = 0  # slice of the storage's bytes
    length: int = 0


@dataclass
class _Piece:
    file: _OpenFile
    offset: int
    length: int
    parts: list[_Part]
    crc: int = 0


@dataclass
class _OpenFile:
    name: str
    path: Path
    tmp: Path
    fd: int
    size: int
    pieces: list[_Piece] = field(default_factory=list)
    left: int = 0  # pieces not yet written


def _pieces(file: _OpenFile, skeleton: _SkeletonFile, placed: list[_Storage], chunk: int) -> list[_Piece]:
    """Cut the file into pieces of about ``chunk`` bytes, in file order, each one contiguous."""
    parts = [_Part(offset, data=data, length=len(data)) for offset, data in skeleton.segments]
    for item in placed:
        for start in range(0, item.nbytes, chunk):
            length = min(chunk, item.nbytes - start)
            parts.append(_Part(item.offset + start, storage=item, start=start, length=length))
    parts.sort(key=lambda part: part.offset)
    pieces: list[_Piece] = []
    current: list[_Part] = []
    length = 0
    for part in parts:
        # A storage's slice may start a piece; a small skeleton segment always joins the current one.
        if current and part.storage is not None and length + part.length > chunk:
            pieces.append(_Piece(file, current[0].offset, length, current))
            current, length = [], 0
        current.append(part)
        length += part.length
    pieces.append(_Piece(file, current[0].offset, length, current))
    return pieces


# --- host bytes of a storage ----------------------------------------------------------------


def _host_bytes(storage: torch.UntypedStorage) -> np.ndarray:
    """A read-only uint8 view of a CPU storage's bytes (no copy): google-crc32c takes it as it is."""
    view = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
    view.flags.writeable = False
    return view


class StagingBuffers:
    """A few host buffers, reused across saves, that pieces of device tensors are copied through.

    For CUDA they are pinned and the copies run on a side stream (``non_blocking``), one event per
    piece: a writer thread waits only for its own piece, while the other threads write theirs.
    ``device_copies`` makes CPU tensors take the same path (tests exercise the pipeline with it).
    """

    def __init__(
        self, count: int = STAGING_BUFFERS, buffer_bytes: int = DEFAULT_CHUNK_BYTES, *, device_copies: bool = False
    ) -> None:
        if count < 1 or buffer_bytes < 1:
            raise ValueError(f"need at least one buffer of at least one byte, got {count} x {buffer_bytes}")
        self.count = count
        self.buffer_bytes = buffer_bytes
        self.device_copies = device_copies
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        self._lock = threading.Lock()
        self._streams: dict[torch.device, Any] = {}  # a side stream per CUDA device
        self.copies = 0  # pieces copied through the buffers (for tests and reports)
        self.allocations = 0  # buffers allocated: ``count`` at the first save that needs them, then none

    def wants(self, storage: torch.UntypedStorage) -> bool:
        return storage.device.type != "cpu" or self.device_copies

    def _allocate_once(self) -> None:
        with self._lock:
            if self.allocations:
                return
            pin = torch.cuda.is_available()
            for _ in range(self.count):
                self._free.put(torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=pin))
                self.allocations += 1

    @contextlib.contextmanager
    def staged(
        self, storage: torch.UntypedStorage, start: int, length: int, cancel: threading.Event
    ) -> Iterator[np.ndarray]:
        """The bytes ``[start, start + length)`` of ``storage`` in host memory, for as long as the block runs."""
        self._allocate_once()
        buffer = self._take(cancel)
        try:
            source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            target = buffer[:length]
            if storage.device.type == "cuda":
                stream = self._stream(storage.device)
                # Whatever the training queued on its stream before the save must land first.
                stream.wait_stream(torch.cuda.current_stream(storage.device))
                with torch.cuda.stream(stream):
                    target.copy_(source[start : start + length], non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(stream)
                done.synchronize()  # this piece only: the other threads' copies and writes go on
            else:
                target.copy_(source[start : start + length])  # CPU (tests) or a device without streams
            self.copies += 1
            view = target.numpy()
            view.flags.writeable = False
            yield view
        finally:
            self._free.put(buffer)

    def _stream(self, device: torch.device) -> Any:
        with self._lock:
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device=device)
            return self._streams[device]

    def _take(self, cancel: threading.Event) -> torch.Tensor:
        while True:
            try:
                return self._free.get(timeout=0.1)
            except queue.Empty:
                if cancel.is_set():
                    raise SaveCancelled("save cancelled") from None


# --- writing --------------------------------------------------------------------------------


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    """Write all of ``data`` (any contiguous buffer) at ``offset``; a short write is continued."""
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        if written == 0:
            raise OSError(f"pwrite wrote nothing at offset {offset}")
        view = view[written:]
        offset += written


class ParallelWriter:
    """Writes payloads into a :class:`CheckpointWriter`'s directory, one ``torch.save`` file per entry,
    with ``threads`` threads.

    >>> ParallelWriter(threads=4).write(writer, {"model": model.state_dict()})
    ['model.pt']
    """

    def __init__(
        self,
        threads: int,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        staging: StagingBuffers | None = None,
        max_open: int = 64,
    ) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.threads = threads
        self.chunk_bytes = chunk_bytes
        self.staging = staging or StagingBuffers(buffer_bytes=chunk_bytes)
        if self.staging.buffer_bytes < chunk_bytes:
            raise ValueError(
                f"staging buffers of {self.staging.buffer_bytes} bytes cannot hold pieces of {chunk_bytes}"
            )
        # The next entry is prepared (its state_dict(), its skeleton) while fewer than two pieces per
        # thread wait: the pool never idles, and preparing stays a step ahead, not the whole state.
        self.max_queued = 2 * threads
        self.max_open = max_open  # file descriptors
        self._warned = False

    def write(
        self,
        writer: CheckpointWriter,
        payloads: Mapping[str, Any],
        names: Mapping[str, str] | None = None,
        *,
        on_file: OnFile | None = None,
        on_range: OnRange | None = None,
    ) -> list[str]:
        """Write every payload as ``names[key]`` (default ``<key>.pt``); returns the names, in order.

        Each file is recorded in ``writer.files`` and ``on_file(name)`` is called once it is fsynced and
        renamed (from a writer thread). The first error stops the rest and is raised as it was
        (``ENOSPC`` included); ``writer.cancel`` stops the writing within a piece."""
        run = _Run(self, writer, on_file, on_range)
        written: list[str] = []
        try:
            for key in payloads:
                name = names[key] if names is not None else f"{key}.pt"
                run.wait_for_room()
                run.start_file(name, payloads[key])
                written.append(name)
            run.finish()
        except BaseException:
            run.abort()
            raise
        return written

    def warn_unsupported(self, exc: Exception) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("spotguard: writing state files with torch.save, one thread (%s)", exc)


class _Run:
    """One call of :meth:`ParallelWriter.write`: the pool, the open files, the first error."""

    def __init__(
        self, owner: ParallelWriter, writer: CheckpointWriter, on_file: OnFile | None, on_range: OnRange | None
    ) -> None:
        self.owner = owner
        self.writer = writer
        self.on_file = on_file
        self.on_range = on_range
        self.cancel = writer.cancel or threading.Event()
        self.failed = threading.Event()  # set on the first error: the other threads stop
        self.error: BaseException | None = None
        self.lock = threading.Condition()
        self.open: dict[str, _OpenFile] = {}
        self.queued = 0  # pieces submitted and not yet written
        self.pool = ThreadPoolExecutor(owner.threads, thread_name_prefix="spotguard-write")

    def check(self) -> None:
        if self.cancel.is_set():
            raise SaveCancelled(f"{self.writer.dir.name}: save cancelled")
        if self.failed.is_set():
            raise _Stopped

    def wait_for_room(self) -> None:
        with self.lock:
            while (
                (self.queued >= self.owner.max_queued or len(self.open) >= self.owner.max_open)
                and not self.failed.is_set()
                and not self.cancel.is_set()
            ):
                self.lock.wait(0.1)
        self.raise_first()
        self.check()

    def start_file(self, name: str, payload: Any) -> None:
        path = self.writer.target(name)
        tmp = tmp_path_for(path)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        file = _OpenFile(name, path, tmp, fd, 0)
        with self.lock:
            self.open[name] = file
        try:
            skeleton, placed, file.size = _write_skeleton(payload, fd, tmp)
        except _Unsupported as exc:
            self.owner.warn_unsupported(exc)
            with self.lock:
                del self.open[name]
            os.close(fd)
            tmp.unlink(missing_ok=True)
            self._torch_save(name, payload)
            return
        file.pieces = _pieces(file, skeleton, placed, self.owner.chunk_bytes)
        file.left = len(file.pieces)
        with self.lock:
            self.queued += len(file.pieces)
        for piece in file.pieces:
            self.pool.submit(self._guarded, self._write_piece, piece)

    def _torch_save(self, name: str, payload: Any) -> None:
        with self.writer.create(name) as out:
            torch.save(payload, out)  # type: ignore[arg-type]  # a write-only file object is enough
        if self.on_file:
            self.on_file(name)

    def _guarded(self, work: Callable[[_Piece], None], piece: _Piece) -> None:
        try:
            work(piece)
        except _Stopped:
            pass
        except BaseException as exc:
            with self.lock:
                if self.error is None:
                    self.error = exc
                self.failed.set()
                self.lock.notify_all()

    def _write_piece(self, piece: _Piece) -> None:
        crc = 0
        for part in piece.parts:
            self.check()
            if part.data is not None:
                crc = google_crc32c.extend(crc, part.data)
                continue
            assert part.storage is not None
            storage = part.storage.storage
            if self.owner.staging.wants(storage):
                with self.owner.staging.staged(storage, part.start, part.length, self.cancel) as data:
                    _pwrite_all(piece.file.fd, data, part.offset)
                    crc = google_crc32c.extend(crc, data)
            else:
                data = _host_bytes(storage)[part.start : part.start + part.length]
                _pwrite_all(piece.file.fd, data, part.offset)
                crc = google_crc32c.extend(crc, data)
        piece.crc = crc
        file = piece.file
        if self.on_range:
            self.on_range(
                file.name, file.tmp.relative_to(self.writer.dir).as_posix(), file.size, piece.offset, piece.length
            )
        with self.lock:
            file.left -= 1
            self.queued -= 1
            last = file.left == 0
            self.lock.notify_all()
        if last:
            self._finish_file(file)

    def _finish_file(self, file: _OpenFile) -> None:
        self.check()
        os.fsync(file.fd)
        os.close(file.fd)
        file.fd = -1
        file.tmp.rename(file.path)
        crc = 0
        for piece in file.pieces:
            crc = crc32c_combine(crc, piece.crc, piece.length)
        file.pieces = []  # each piece points back at its file: freed now, not by the cycle collector
        with self.lock:
            self.writer.files[file.name] = FileEntry(size=file.size, crc32c=crc32c_hex(crc))
            del self.open[file.name]
            self.lock.notify_all()
        if self.on_file:
            self.on_file(file.name)

    def raise_first(self) -> None:
        if self.error is not None:
            raise self.error

    def finish(self) -> None:
        self.pool.shutdown(wait=True)
        self.raise_first()
        self.check()

    def abort(self) -> None:
        """Stop the threads and remove every temporary file this run left (renamed files stay: the
        step directory is incomplete without its manifest, and the next writer removes it)."""
        self.failed.set()
        self.pool.shutdown(wait=True, cancel_futures=True)
        for file in list(self.open.values()):
            if file.fd >= 0:
                os.close(file.fd)
            file.tmp.unlink(missing_ok=True)
            file.pieces = []  # (see _finish_file)
        self.open.clear()


class _Stopped(Exception):
    """Another thread failed first: this one stops quietly."""
