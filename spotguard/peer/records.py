"""Records, the unit of spotguard-peer/2 after the handshake (docs/peer-protocol.md, section 4).

Every byte a side sends once the handshake is done goes in records: a 2-byte length and one Noise
transport message (at most 65535 bytes, tag included) under that direction's key and counter. A
payload of ``n`` bytes is laid out as full records of :data:`MAX_PLAINTEXT` bytes and one shorter
last record, each part of a frame in records of its own, so that both sides know where every record
starts without reading it. This module lays them out, seals a data frame from a file (read a
batch at a time, or straight from the file's mapped pages) and opens a payload batch by batch; the stream
around them is :class:`spotguard.peer.channel.Channel`, and worker processes call these functions
directly (spotguard/peer/workers.py).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import mmap
import os
import struct
import threading
from collections.abc import Callable, Iterator

from spotguard.peer import noise, wire

MAX_PLAINTEXT = noise.MAX_MESSAGE - noise.TAGLEN  # one record's bytes
# A payload's full records are read this many at once (a reused buffer of ~1 MiB per connection).
BATCH_RECORDS = 16
LENGTH = struct.Struct(">H")  # a record's length before it (and a handshake message's)
FULL_RECORD = LENGTH.size + noise.MAX_MESSAGE  # a record of a payload's but the last
BATCH_BYTES = BATCH_RECORDS * FULL_RECORD  # a batch buffer: what one batch of records takes at most
_IOV_MAX = 1024  # buffers one preadv takes (POSIX's minimum for IOV_MAX is 16; Linux has 1024)


def seal_record(cipher: noise.CipherState, out: memoryview, at: int, plaintext: memoryview) -> None:
    """One record at ``at`` of ``out``: its length, then ``plaintext`` (elsewhere: never overlapping
    ``out``) sealed after it. Takes the next nonce."""
    size = len(plaintext) + noise.TAGLEN
    LENGTH.pack_into(out, at, size)
    cipher.encrypt_into(plaintext, out[at + LENGTH.size : at + LENGTH.size + size])


def seal_frame(
    cipher: noise.CipherState,
    header: bytes,
    fd: int,
    offset: int,
    length: int,
    *,
    out: bytearray,
    mapped: bool = False,
) -> memoryview:
    """A data frame: ``header`` and ``length`` bytes of the file ``fd`` from ``offset``, as records
    laid out in ``out`` (at least :func:`sealed_size` bytes). The file's bytes are read a batch at a
    time into a buffer of this thread's and sealed from there into their records' places: one read
    and the sealing per byte, no allocation. ``mapped``: sealed straight from the file's pages
    instead (see :func:`seal_batches`). Raises :class:`EOFError` if the file ends first."""
    records = list(layout([len(header), length]))
    end = records_end(records)
    if len(out) < end:
        raise ValueError(f"a frame of {end} bytes in a buffer of {len(out)}: see sealed_size()")
    frame = memoryview(out)

    def place(_: int, at: int, size: int) -> memoryview:
        return frame[at : at + size]  # every batch at its place in the frame

    for _ in _sealed_groups(cipher, header, fd, offset, records, place=place, mapped=mapped):
        pass
    return frame[:end]


def batch_buffers() -> tuple[bytearray, bytearray]:
    """Two buffers of :data:`BATCH_BYTES`, for :func:`seal_batches` and :func:`open_payload` (reused
    from frame to frame: ~1 MiB each, they stay in the CPU's cache while a file streams through)."""
    return bytearray(BATCH_BYTES), bytearray(BATCH_BYTES)


def seal_batches(
    cipher: noise.CipherState,
    header: bytes,
    fd: int,
    offset: int,
    length: int,
    *,
    batches: tuple[bytearray, bytearray],
    mapped: bool = False,
) -> Iterator[memoryview]:
    """:func:`seal_frame` :data:`BATCH_RECORDS` records at a time, each batch sealed into the next of
    ``batches`` in turn (:func:`batch_buffers`) and yielded, so that it
    may go out while the next is sealed. A yielded batch must be sent before the one after next is
    sealed: that one takes its buffer. Two batch buffers stay in the CPU's cache where a whole
    frame's buffer (8 MiB) would not.

    ``mapped``: AES-GCM reads the file's pages through a read-only mapping and writes the records
    into the batch's buffer, which saves the read's copy into user space (about a fifth of a sending
    worker's CPU). Only for a worker process: a file cut short while mapped raises SIGBUS, which ends
    the process that touches the missing page, and a worker's end is one the daemon survives."""
    if min(len(batch) for batch in batches) < BATCH_BYTES:
        raise ValueError(f"batch buffers of {BATCH_BYTES} bytes at least")

    def place(number: int, _: int, size: int) -> memoryview:
        return memoryview(batches[number % 2])[:size]

    yield from _sealed_groups(
        cipher, header, fd, offset, list(layout([len(header), length])), place=place, mapped=mapped
    )


def _sealed_groups(
    cipher: noise.CipherState,
    header: bytes,
    fd: int,
    offset: int,
    records: list[tuple[int, int, range]],
    *,
    place: Callable[[int, int, int], memoryview],
    mapped: bool,
) -> Iterator[memoryview]:
    """``records`` of a data frame (:func:`layout` of its header and payload), :data:`BATCH_RECORDS`
    at a time, each batch sealed into ``place(number, at, size)`` (the batch's number, where it
    starts in the frame, its bytes) and yielded once sealed."""
    length = sum(len(piece) for _, index, piece in records if index == 1)
    with _mapped_range(fd, offset, length) if mapped else contextlib.nullcontext() as source:
        for first in range(0, len(records), BATCH_RECORDS):
            group = records[first : first + BATCH_RECORDS]
            base = group[0][0]
            view = place(first // BATCH_RECORDS, base, records_end(group) - base)
            # Each record's place in the batch's view.
            places = [(at - base, index, piece) for at, index, piece in group]
            data = [piece for _, index, piece in places if index == 1]
            # The payload's bytes, and the payload position its first byte holds: the whole mapped
            # range, or the batch's bytes (consecutive in the file) read in one call.
            plaintext, start = source, 0
            if source is None and data:
                start = data[0].start
                plaintext = _batch_plaintext()[: data[-1].stop - start]
                _preadv_full(fd, [plaintext], offset + start)
            for at, index, piece in places:
                if index == 0:
                    seal_record(cipher, view, at, memoryview(header)[piece.start : piece.stop])
                else:
                    assert plaintext is not None
                    # A slice of the mapping that outlived the call would keep it from being closed.
                    seal_record(cipher, view, at, plaintext[piece.start - start : piece.stop - start])
            yield view


_this_thread = threading.local()


def _batch_plaintext() -> memoryview:
    """This thread's buffer for a batch's plaintext, read from the file and sealed from there into the
    records' places (~1 MiB, reused: it stays in the CPU's cache). Not sealed in place: AEAD
    implementations may refuse input and output that overlap (cryptography 51 does)."""
    buffer: memoryview | None = getattr(_this_thread, "plaintext", None)
    if buffer is None:
        buffer = _this_thread.plaintext = memoryview(bytearray(BATCH_RECORDS * MAX_PLAINTEXT))
    return buffer


@contextlib.contextmanager
def _mapped_range(fd: int, offset: int, length: int) -> Iterator[memoryview | None]:
    """``length`` bytes of the file ``fd`` from ``offset``, mapped read-only; ``None`` for none, or
    where the file's filesystem maps no files (some FUSE and network ones): it is read instead.
    Raises :class:`EOFError` if the file is shorter, as a read would: a page past its end would
    raise SIGBUS when touched."""
    if length == 0:
        yield None
        return
    size = os.fstat(fd).st_size
    if offset + length > size:
        raise EOFError(f"the file ended at {size} bytes")
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    try:
        # MAP_POPULATE maps every page in one call, not one fault per few pages as they are read.
        mapping = mmap.mmap(
            fd, offset + length - start, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ, offset=start
        )
    except OSError:
        yield None
        return
    with mapping:
        whole = memoryview(mapping)
        source = whole[offset - start :]
        try:
            yield source
        finally:
            source.release()  # the caller's name for it holds the mapping no more
            whole.release()


def open_payload(
    cipher: noise.CipherState,
    batches: tuple[bytearray, bytearray],
    receive: Callable[[memoryview], None],
    read_ahead: bytes,
    view: memoryview,
    *,
    beside: concurrent.futures.Executor | None = None,
    stop: Callable[[], None] = lambda: None,
) -> None:
    """A payload of ``len(view)`` bytes, laid out as the protocol says (full records, the last one
    shorter): ``read_ahead`` the first of its bytes, the rest filled by ``receive``,
    :data:`BATCH_RECORDS` records at a time into one of ``batches``, each record opened into its place
    in ``view``. With ``beside`` (a thread), the next batch is received there while this one is
    opened (both steps leave the GIL). Raises :class:`~spotguard.peer.wire.PeerError`
    (``bad-record``), or what ``receive`` raised; on an error ``stop()`` ends a batch still being
    received beside (the connection cannot go on) and its thread is waited for, so that ``batches``
    are the caller's again."""
    records = list(layout([len(view)]))
    groups = [records[first : first + BATCH_RECORDS] for first in range(0, len(records), BATCH_RECORDS)]
    ahead = memoryview(read_ahead)

    def fill(number: int) -> memoryview:
        nonlocal ahead
        group = groups[number]
        chunk = memoryview(batches[number % 2])[: records_end(group) - group[0][0]]
        taken = min(len(ahead), len(chunk))
        chunk[:taken] = ahead[:taken]
        ahead = ahead[taken:]
        receive(chunk[taken:])
        return chunk

    if beside is None:
        for number, group in enumerate(groups):
            _open_batch(cipher, group, fill(number), view)
        return
    coming = beside.submit(fill, 0) if groups else None
    try:
        for number, group in enumerate(groups):
            assert coming is not None
            chunk, coming = coming.result(), None
            if number + 1 < len(groups):
                coming = beside.submit(fill, number + 1)
            _open_batch(cipher, group, chunk, view)
    except BaseException:
        if coming is not None and not coming.done():
            stop()
            concurrent.futures.wait([coming])
        raise


def _open_batch(
    cipher: noise.CipherState, group: list[tuple[int, int, range]], chunk: memoryview, view: memoryview
) -> None:
    """Open the records of ``group``, received in ``chunk``, into their places in ``view``."""
    base = group[0][0]
    for at, _, piece in group:
        record = chunk[at - base :]
        if LENGTH.unpack_from(record)[0] != len(piece) + noise.TAGLEN:
            raise wire.PeerError("bad-record", "a payload's records not laid out as the protocol says")
        try:
            cipher.decrypt_into(
                record[LENGTH.size : LENGTH.size + len(piece) + noise.TAGLEN], view[piece.start : piece.stop]
            )
        except noise.NoiseError as exc:
            raise wire.PeerError("bad-record", str(exc)) from None


def records_of(length: int) -> int:
    """How many records a payload of ``length`` bytes takes (the nonces it uses)."""
    return -(-length // MAX_PLAINTEXT)


def layout(sizes: list[int]) -> Iterator[tuple[int, int, range]]:
    """The records of parts of ``sizes`` bytes (each part in records of its own): where each record
    starts, the index of its part and the bytes of that part it holds."""
    at = 0
    for index, size in enumerate(sizes):
        for start in range(0, size, MAX_PLAINTEXT):
            piece = range(start, min(size, start + MAX_PLAINTEXT))
            yield at, index, piece
            at += LENGTH.size + len(piece) + noise.TAGLEN


def sealed_size(*sizes: int) -> int:
    """Bytes of parts of ``sizes`` bytes once sealed as records (what
    :meth:`spotguard.peer.channel.Channel.seal` returns)."""
    return records_end(list(layout(list(sizes))))


def records_end(records: list[tuple[int, int, range]]) -> int:
    if not records:
        return 0
    at, _, piece = records[-1]
    return at + LENGTH.size + len(piece) + noise.TAGLEN


def _preadv_full(fd: int, views: list[memoryview], offset: int) -> None:
    """Fill every one of ``views`` from ``fd`` at ``offset`` on (a read may stop short: go on)."""
    while views:
        got = os.preadv(fd, views[:_IOV_MAX], offset)
        if got == 0:
            raise EOFError(f"the file ended at {offset} bytes")
        offset += got
        while views and got >= len(views[0]):
            got -= len(views.pop(0))
        if got:
            views[0] = views[0][got:]


__all__ = [
    "BATCH_BYTES",
    "BATCH_RECORDS",
    "FULL_RECORD",
    "LENGTH",
    "MAX_PLAINTEXT",
    "batch_buffers",
    "layout",
    "open_payload",
    "records_end",
    "records_of",
    "seal_batches",
    "seal_frame",
    "seal_record",
    "sealed_size",
]
