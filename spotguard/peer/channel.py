"""The protected channel between two daemons of a job: spotguard-peer/2 (docs/peer-protocol.md).

A connection starts with the receiver's greeting (a clear-text frame that a spotguard-peer/1 daemon
reads as a version error), then the Noise NNpsk0 handshake on a psk derived from the job's token
(spotguard/peer/noise.py), each message as a 2-byte length and the message. From then on every byte
either side sends, frame headers and data alike, goes in records: a 2-byte length and one Noise
transport message (at most 65535 bytes, tag included) under that direction's key and counter. A
record changed, replayed, reordered, dropped or injected fails to decrypt and ends the connection.

:class:`Channel` is a byte stream on top of that: what :func:`spotguard.peer.wire.encode` and
:func:`~spotguard.peer.wire.read_frame` speak works on it unchanged. Every read of a record and
every drain of a write has a deadline (:data:`IO_TIMEOUT`), and both sides set TCP keepalive and
``TCP_USER_TIMEOUT``: a peer that goes silent, mid-payload or not, is dropped within that time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import mmap
import os
import socket
import struct
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from spotguard.jsontext import parse_json
from spotguard.peer import noise, wire
from spotguard.peer.sockio import HandedSocket, run_handed
from spotguard.peer.tokens import JobToken, PeerToken


class Worker(Protocol):
    """What carries a frame's bytes in another process (spotguard/peer/workers.py)."""

    def call(self, job: dict[str, Any], fds: list[int], *, more: bool = False) -> Any: ...

    def release(self) -> None: ...


PROTOCOL = "spotguard-peer/2"
PROLOGUE = PROTOCOL.encode()  # bound into the handshake: another version's handshake cannot succeed
V2_NOTICE = f"peer speaks {PROTOCOL}; this daemon speaks spotguard-peer/1 — upgrade it"
# The receiver's first bytes: a frame a spotguard-peer/1 daemon reads as an error, with this message.
GREETING = wire.encode(
    {
        "t": "error",
        "code": "version",
        "proto": PROTOCOL,
        "message": V2_NOTICE,
    }
)
V1_REFUSAL = f"peer speaks spotguard-peer/1; this daemon needs /2 — upgrade the peer's spotguard to {PROTOCOL}"
HANDSHAKE_TIMEOUT = 5.0  # seconds from accept to the first record of an authenticated connection
# Seconds a peer may leave a started record unfinished, or leave our writes unread, before it is
# dropped (with its replica, if it was sending one); also TCP_USER_TIMEOUT.
IO_TIMEOUT = 30.0
WATCH_INTERVAL = 1.0  # how often the record deadline is checked
# The bound on how long a silent peer holds its connection (and a replica slot on a receiver).
SILENT_PEER_RELEASE = IO_TIMEOUT + WATCH_INTERVAL
MAX_HANDSHAKE_MESSAGE = 1024
MAX_PLAINTEXT = noise.MAX_MESSAGE - noise.TAGLEN  # one record's bytes
# A payload's full records are read this many at once (a reused buffer of ~1 MiB per connection).
BATCH_RECORDS = 16
_LENGTH = struct.Struct(">H")
FULL_RECORD = _LENGTH.size + noise.MAX_MESSAGE  # a record of a payload's but the last
_REFUSAL = _LENGTH.pack(0)  # a handshake "message" of length 0: a clear-text error frame follows
_IOV_MAX = 1024  # buffers one preadv takes (POSIX's minimum for IOV_MAX is 16; Linux has 1024)
_KEEPALIVE = {"TCP_KEEPIDLE": 10, "TCP_KEEPINTVL": 5, "TCP_KEEPCNT": 3}


# struct tcp_info (linux/tcp.h): 8 one-byte fields, 24 u32 (rto ... total_retrans), u64 pacing_rate,
# u64 max_pacing_rate, then u64 tcpi_bytes_acked.
_BYTES_ACKED_AT = 8 + 24 * 4 + 2 * 8
_BYTES_ACKED = struct.Struct("=Q")
_TCP_INFO_SIZE = 256


def tune_socket(sock: socket.socket | None, io_timeout: float = IO_TIMEOUT) -> None:
    """Keepalive probes after 10 s of silence (a dead host is noticed in ~25 s), and unacknowledged
    data for ``io_timeout`` seconds ends the connection (where the OS has these options)."""
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in _KEEPALIVE.items():
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, int(io_timeout * 1000)))


class Channel:
    """An authenticated, encrypted byte stream: ``write`` + ``drain`` send, ``readexactly`` /
    ``readinto`` receive (decrypting straight into the caller's buffer when a record fits in it).
    Raises :class:`~spotguard.peer.wire.PeerError` (``closed``, ``bad-record``), ``TimeoutError``
    past the deadline, ``OSError``."""

    def __init__(
        self,
        stream: wire.ReadsInto,
        writer: asyncio.StreamWriter,
        sending: noise.CipherState,
        receiving: noise.CipherState,
        *,
        io_timeout: float = IO_TIMEOUT,
    ) -> None:
        self.stream = stream
        self.writer = writer
        self._send = sending
        self._recv = receiving
        self.io_timeout = io_timeout
        self._record = bytearray(noise.MAX_MESSAGE)  # one record's ciphertext, reused
        self._plain = bytearray(MAX_PLAINTEXT)  # a record's plaintext not read yet: plain[start:end]
        self._start = self._end = 0
        self._reading_since: float | None = None  # when the record being read was begun
        self._watchdog: asyncio.TimerHandle | None = None
        self._timed_out = False
        self._batch: bytearray | None = None  # full records of a payload, read at once

    @property
    def transport(self) -> asyncio.WriteTransport:
        return self.writer.transport

    def delivered(self) -> int | None:
        """Bytes the peer has acknowledged on this connection (Linux ``TCP_INFO``), not counting
        what waits in buffers on the way; None where the OS does not say. A flow's rate, measured."""
        sock = self.writer.get_extra_info("socket")
        if sock is None or not hasattr(socket, "TCP_INFO"):
            return None
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_SIZE)
        except OSError:
            return None
        if len(info) < _BYTES_ACKED.size + _BYTES_ACKED_AT:
            return None  # a kernel older than 4.1
        return int(_BYTES_ACKED.unpack_from(info, _BYTES_ACKED_AT)[0])

    # --- reading ------------------------------------------------------------------------

    async def _next_record(self) -> memoryview:
        """The next record's ciphertext (in the reused buffer), read within the deadline."""
        with self._record_deadline():
            (length,) = _LENGTH.unpack(await self.stream.readexactly(_LENGTH.size))
            if length < noise.TAGLEN:
                raise wire.PeerError("bad-record", f"a record of {length} bytes")
            view = memoryview(self._record)[:length]
            await self.stream.readinto(view)
        return view

    @contextlib.contextmanager
    def _record_deadline(self) -> Iterator[None]:
        """Reads of whole records inside: watched against the deadline; a connection that closes (or is
        closed by the watch) mid-record ends as ``closed`` (or a TimeoutError)."""
        self._reading_since = time.monotonic()
        self._watch()
        try:
            yield
        except asyncio.IncompleteReadError:
            if self._timed_out:
                raise TimeoutError(f"no whole record for {self.io_timeout:g} s") from None
            raise wire.PeerError("closed", "the connection closed mid-record") from None
        finally:
            self._reading_since = None

    def _watch(self) -> None:
        """The deadline on records, checked every :data:`WATCH_INTERVAL` seconds while the connection
        is open (cheaper than a timeout around each of a payload's thousands of records): a record
        begun and not finished within ``io_timeout`` ends the connection."""
        transport = self.writer.transport
        if self._watchdog is not None or transport is None or transport.is_closing():
            return
        since = self._reading_since
        if since is not None and time.monotonic() - since > self.io_timeout:
            self._timed_out = True
            transport.abort()  # the pending read ends; it raises TimeoutError
            return
        self._watchdog = asyncio.get_running_loop().call_later(WATCH_INTERVAL, self._rewatch)

    def _rewatch(self) -> None:
        self._watchdog = None
        self._watch()

    def _open(self, ciphertext: memoryview, out: memoryview) -> None:
        try:
            self._recv.decrypt_into(ciphertext, out)
        except noise.NoiseError as exc:
            raise wire.PeerError("bad-record", str(exc)) from None

    async def fill(self) -> None:
        """Read and check the next record into the channel's own buffer (the receiver does this for
        the first one: a peer is authenticated once a record of it decrypts)."""
        assert self._start == self._end
        ciphertext = await self._next_record()
        size = len(ciphertext) - noise.TAGLEN
        self._open(ciphertext, memoryview(self._plain)[:size])
        self._start, self._end = 0, size

    async def readinto(self, view: memoryview) -> None:
        """Fill ``view``: whole records are decrypted straight into it; a payload's full records
        (:data:`MAX_PLAINTEXT` bytes each, as the protocol lays them out) are read in batches."""
        done = min(len(view), self._end - self._start)
        view[:done] = self._plain[self._start : self._start + done]
        self._start += done
        while done < len(view):
            if len(view) - done >= MAX_PLAINTEXT:
                done += await self._read_full_records(view[done:])
                continue
            ciphertext = await self._next_record()
            size = len(ciphertext) - noise.TAGLEN
            if size <= len(view) - done:
                self._open(ciphertext, view[done : done + size])
                done += size
                continue
            self._open(ciphertext, memoryview(self._plain)[:size])
            take = len(view) - done
            view[done:] = self._plain[:take]
            self._start, self._end = take, size
            done += take

    async def _read_full_records(self, view: memoryview) -> int:
        """Up to :data:`BATCH_RECORDS` full records in one read, each decrypted into ``view``; the
        number of bytes filled. A record of another length there breaks the protocol's layout."""
        count = min(len(view) // MAX_PLAINTEXT, BATCH_RECORDS)
        if self._batch is None:
            self._batch = bytearray(BATCH_RECORDS * FULL_RECORD)
        batch = memoryview(self._batch)[: count * FULL_RECORD]
        with self._record_deadline():
            await self.stream.readinto(batch)
        for index in range(count):
            record = batch[index * FULL_RECORD : (index + 1) * FULL_RECORD]
            if _LENGTH.unpack_from(record)[0] != noise.MAX_MESSAGE:
                raise wire.PeerError("bad-record", "a payload's record that is not full before its last")
            self._open(record[_LENGTH.size :], view[index * MAX_PLAINTEXT : (index + 1) * MAX_PLAINTEXT])
        return count * MAX_PLAINTEXT

    # --- a worker process's frames (spotguard/peer/workers.py) ------------------------------

    def can_hand_over(self) -> bool:
        """Whether the next payload may be received by a worker process: the connection is a socket
        read through a :class:`~spotguard.peer.wire.FrameStream`, open, with no record half read."""
        return self._start == self._end and self._socket_open()

    def _socket_open(self) -> bool:
        sock = self.writer.get_extra_info("socket")
        return (
            isinstance(self.stream, wire.FrameStream)
            and sock is not None
            and sock.fileno() >= 0
            and not self.transport.is_closing()
        )

    async def receive_payload_by(self, worker: Worker, length: int) -> None:
        """A data frame's payload of ``length`` bytes, received and opened by ``worker``
        (:meth:`can_hand_over` first), which keeps it for a ``write`` or a ``drop``."""
        handed = self._handed(worker)
        assert isinstance(self.stream, wire.FrameStream)
        job = {
            "t": "receive",
            **self._job_cipher(self._recv, records_of(length)),
            "ahead": self.stream.hand_over(sealed_size(length)),
            "length": length,
        }
        await run_handed(self.stream, handed, lambda: worker.call(job, [handed.sock.fileno()], more=True))

    async def send_frame_by(self, worker: Worker, header: bytes, fd: int, offset: int, length: int) -> None:
        """A data frame, ``header`` and ``length`` bytes of the file ``fd`` from ``offset``, read, sealed
        and sent by ``worker``, once what was written before has gone out."""
        try:
            await self.flush_to(0)
        except BaseException:
            worker.release()
            raise
        handed = self._handed(worker)
        assert isinstance(self.stream, wire.FrameStream)
        records = records_of(len(header)) + records_of(length)
        job = {
            "t": "send",
            **self._job_cipher(self._send, records),
            "header": header,
            "offset": offset,
            "length": length,
        }
        await run_handed(self.stream, handed, lambda: worker.call(job, [handed.sock.fileno(), fd]))

    def _handed(self, worker: Worker) -> HandedSocket:
        """A duplicate of the connection's socket for ``worker``'s job (given back if there is none)."""
        try:
            if not self._socket_open():
                raise wire.PeerError("closed", "the connection closed")
            return HandedSocket(self.writer.get_extra_info("socket").fileno())
        except BaseException:
            worker.release()
            raise

    def _job_cipher(self, cipher: noise.CipherState, records: int) -> dict[str, Any]:
        """A job's key and first nonce; the next ``records`` nonces are the job's (a job that fails
        ends the connection: no nonce is ever used twice)."""
        first = cipher.n
        cipher.n += records
        return {"key": cipher.key, "n": first, "timeout": self.io_timeout}

    async def readexactly(self, n: int, /) -> bytes:
        if self._end - self._start >= n:
            data = bytes(self._plain[self._start : self._start + n])
            self._start += n
            return data
        out = bytearray(n)
        await self.readinto(memoryview(out))
        return bytes(out)

    async def read_frame(self, *, timeout: float | None = None, max_header: int = wire.MAX_HEADER) -> dict[str, Any]:
        """The next frame. ``timeout``, when longer than the record deadline, replaces it while this
        frame is awaited and read: a receiver waiting for a sender's next request, a sender waiting
        for the answer to a commit."""
        if timeout is None or timeout <= self.io_timeout:
            return await wire.read_frame(self, max_header)
        saved, self.io_timeout = self.io_timeout, timeout
        try:
            return await wire.read_frame(self, max_header)
        finally:
            self.io_timeout = saved

    # --- writing ------------------------------------------------------------------------

    def seal(self, *parts: bytes | bytearray | memoryview) -> bytearray:
        """``parts`` as records (each part in records of its own), ready for the socket. Takes the next
        nonces: calls must go out in the order they were made (one may run in a thread while the
        previous one's bytes are sent)."""
        views = [memoryview(part).cast("B") for part in parts]
        records = list(_layout([len(view) for view in views]))
        out = bytearray(_records_end(records))
        target = memoryview(out)
        for at, index, piece in records:
            _seal_record(self._send, target, at, views[index][piece.start : piece.stop])
        return out

    def seal_read(self, header: bytes, fd: int, offset: int, length: int, out: bytearray) -> memoryview:
        """A data frame: ``header`` and ``length`` bytes of the file ``fd`` from ``offset``, as records
        laid out in ``out`` (:func:`seal_frame`). Takes the next nonces, as :meth:`seal` does."""
        return seal_frame(self._send, header, fd, offset, length, out=out)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if data:
            self.writer.write(self.seal(data))

    def write_sealed(self, records: bytearray | memoryview) -> None:
        self.writer.write(records)

    async def drain(self) -> None:
        async with asyncio.timeout(self.io_timeout):
            await self.writer.drain()

    async def flush_to(self, pending: int) -> None:
        """Wait until at most ``pending`` bytes wait in the transport: everything written before them
        has gone to the kernel, so a buffer that held it may be written again (a transport may keep a
        view of a buffer it was given, not a copy)."""
        transport = self.transport
        if transport.get_write_buffer_size() <= pending:
            return
        low, high = transport.get_write_buffer_limits()
        transport.set_write_buffer_limits(high=pending, low=pending)
        try:
            await self.drain()
        finally:
            transport.set_write_buffer_limits(high=high, low=low)

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        self.writer.close()

    async def wait_closed(self) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.io_timeout):
                await self.writer.wait_closed()


def _seal_record(cipher: noise.CipherState, out: memoryview, at: int, plaintext: memoryview) -> None:
    """One record at ``at`` of ``out``: its length, then ``plaintext`` sealed after it (``plaintext``
    may be that very place: sealed in place). Takes the next nonce."""
    size = len(plaintext) + noise.TAGLEN
    _LENGTH.pack_into(out, at, size)
    cipher.encrypt_into(plaintext, out[at + _LENGTH.size : at + _LENGTH.size + size])


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
    laid out in ``out`` (at least :func:`sealed_size` bytes). The file's bytes are read straight into
    their records' places and sealed there, in place: a frame costs one read, no copy and no
    allocation. ``mapped``: sealed straight from the file's pages instead (see :func:`seal_batches`).
    Raises :class:`EOFError` if the file ends first."""
    ends = list(seal_batches(cipher, header, fd, offset, length, out=out, mapped=mapped))
    return memoryview(out)[: ends[-1] if ends else 0]


def seal_batches(
    cipher: noise.CipherState,
    header: bytes,
    fd: int,
    offset: int,
    length: int,
    *,
    out: bytearray,
    mapped: bool = False,
) -> Iterator[int]:
    """:func:`seal_frame` :data:`BATCH_RECORDS` records at a time: after each batch is read and sealed,
    yields where the sealed bytes of ``out`` end, so that they may go out while the next batch is
    sealed (the bytes before that point are not touched again).

    ``mapped``: AES-GCM reads the file's pages through a read-only mapping and writes the records
    into ``out``, which saves the read's copy into user space (about a fifth of a sending worker's
    CPU). Only for a worker process: a file cut short while mapped raises SIGBUS, which ends the
    process that touches the missing page, and a worker's end is one the daemon survives."""
    records = list(_layout([len(header), length]))
    end = _records_end(records)
    if len(out) < end:
        raise ValueError(f"a frame of {end} bytes in a buffer of {len(out)}: see sealed_size()")
    view = memoryview(out)

    def body(at: int, size: int) -> memoryview:
        return view[at + _LENGTH.size : at + _LENGTH.size + size]

    with _mapped_range(fd, offset, length) if mapped else contextlib.nullcontext() as source:
        for first in range(0, len(records), BATCH_RECORDS):
            group = records[first : first + BATCH_RECORDS]
            for at, index, piece in group:
                if index == 0:
                    body(at, len(piece))[:] = header[piece.start : piece.stop]
            if source is None:  # the batch's file bytes read into their records' places, in one call
                data = [(at, piece) for at, index, piece in group if index == 1]
                if data:
                    _preadv_full(fd, [body(at, len(piece)) for at, piece in data], offset + data[0][1].start)
            for at, index, piece in group:
                if index == 1 and source is not None:
                    # A view of the mapping that outlived the call would keep it from being closed.
                    _seal_record(cipher, view, at, source[piece.start : piece.stop])
                else:
                    _seal_record(cipher, view, at, body(at, len(piece)))  # in place: input and output coincide
            yield _records_end(group)


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
    records = list(_layout([len(view)]))
    groups = [records[first : first + BATCH_RECORDS] for first in range(0, len(records), BATCH_RECORDS)]
    ahead = memoryview(read_ahead)

    def fill(number: int) -> memoryview:
        nonlocal ahead
        group = groups[number]
        chunk = memoryview(batches[number % 2])[: _records_end(group) - group[0][0]]
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
        if _LENGTH.unpack_from(record)[0] != len(piece) + noise.TAGLEN:
            raise wire.PeerError("bad-record", "a payload's records not laid out as the protocol says")
        try:
            cipher.decrypt_into(
                record[_LENGTH.size : _LENGTH.size + len(piece) + noise.TAGLEN], view[piece.start : piece.stop]
            )
        except noise.NoiseError as exc:
            raise wire.PeerError("bad-record", str(exc)) from None


def records_of(length: int) -> int:
    """How many records a payload of ``length`` bytes takes (the nonces it uses)."""
    return -(-length // MAX_PLAINTEXT)


def _layout(sizes: list[int]) -> Iterator[tuple[int, int, range]]:
    """The records of parts of ``sizes`` bytes (each part in records of its own): where each record
    starts, the index of its part and the bytes of that part it holds."""
    at = 0
    for index, size in enumerate(sizes):
        for start in range(0, size, MAX_PLAINTEXT):
            piece = range(start, min(size, start + MAX_PLAINTEXT))
            yield at, index, piece
            at += _LENGTH.size + len(piece) + noise.TAGLEN


def sealed_size(*sizes: int) -> int:
    """Bytes of parts of ``sizes`` bytes once sealed as records (what :meth:`Channel.seal` returns)."""
    return _records_end(list(_layout(list(sizes))))


def _records_end(records: list[tuple[int, int, range]]) -> int:
    if not records:
        return 0
    at, _, piece = records[-1]
    return at + _LENGTH.size + len(piece) + noise.TAGLEN


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


# --- the handshake --------------------------------------------------------------------------


async def _read_message(stream: wire.Reads, *, initiator: bool) -> bytes:
    """A handshake message. The initiator takes a refusal (length 0) and raises the error frame that
    follows it; to the receiver, a message too short for ``e`` and a tag fails authentication."""
    try:
        (length,) = _LENGTH.unpack(await stream.readexactly(_LENGTH.size))
        if length == 0 and initiator:
            await wire.read_frame(stream, wire.MAX_HEADER_BEFORE_AUTH)  # raises its error
            raise wire.PeerError("bad-frame", "a refusal without an error frame")
        if length > MAX_HANDSHAKE_MESSAGE:
            raise wire.PeerError("too-large", f"a handshake message of {length} bytes")
        if length < noise.DHLEN + noise.TAGLEN:
            raise wire.PeerError("auth", f"authentication failed (a handshake message of {length} bytes)")
        return await stream.readexactly(length)
    except asyncio.IncompleteReadError:
        raise wire.PeerError("closed", "the connection closed during the handshake") from None


def refusal(code: str, message: str) -> bytes:
    """What the receiver sends, in clear, to a connection that fails its handshake."""
    return _REFUSAL + wire.error_frame(code, message)


async def accept(
    stream: wire.ReadsInto,
    writer: asyncio.StreamWriter,
    psk: bytes,
    *,
    previous_psk: bytes | None = None,
    io_timeout: float = IO_TIMEOUT,
) -> Channel:
    """The receiver's side: greeting, ``-> psk, e``, ``<- e, ee``, and the initiator's first record.
    During a token rotation ``previous_psk`` is accepted too: the first message authenticates under
    one psk only (its tag), so trying each costs a failed tag check, not a round trip. The caller
    bounds it in time (:data:`HANDSHAKE_TIMEOUT`)."""
    writer.write(GREETING)
    first = await _read_message(stream, initiator=False)
    handshake = _responder_for(first, psk, previous_psk)
    message = handshake.write_message()
    writer.write(_LENGTH.pack(len(message)) + message)
    sending, receiving = handshake.split()
    channel = Channel(stream, writer, sending, receiving, io_timeout=io_timeout)
    try:
        await channel.fill()
        if isinstance(stream, wire.FrameStream):
            stream.direct_min = 1
    except wire.PeerError as exc:
        if exc.code == "bad-record":
            raise wire.PeerError("auth", "authentication failed (its first record does not decrypt)") from None
        raise
    return channel


def _responder_for(first: bytes, psk: bytes, previous_psk: bytes | None) -> noise.HandshakeState:
    """The responder's handshake whose psk authenticates the initiator's first message."""
    for candidate in (psk, previous_psk):
        if candidate is None:
            continue
        handshake = noise.HandshakeState(initiator=False, psk=candidate, prologue=PROLOGUE)
        try:
            handshake.read_message(first)
        except noise.NoiseError:
            continue
        return handshake
    raise wire.PeerError("auth", "authentication failed")


async def _check_greeting(stream: wire.ReadsInto, writer: asyncio.StreamWriter) -> None:
    try:
        (length,) = struct.unpack(">I", await stream.readexactly(4))
        if length > wire.MAX_HEADER_BEFORE_AUTH:
            raise wire.PeerError("version", "the peer does not speak spotguard-peer (no greeting)")
        greeting = parse_json(await stream.readexactly(length))
    except asyncio.IncompleteReadError:
        raise wire.PeerError("closed", "the connection closed before the peer's greeting") from None
    except ValueError:
        raise wire.PeerError("version", "the peer does not speak spotguard-peer (no greeting)") from None
    if isinstance(greeting, dict) and greeting.get("t") == "challenge":  # a spotguard-peer/1 receiver
        writer.write(wire.error_frame("version", V2_NOTICE))
        raise wire.PeerError("version", V1_REFUSAL)
    if not isinstance(greeting, dict) or greeting.get("proto") != PROTOCOL:
        proto = greeting.get("proto") if isinstance(greeting, dict) else None
        raise wire.PeerError("version", f"peer speaks {proto or 'something else'}; this daemon needs {PROTOCOL}")


async def initiate(
    stream: wire.ReadsInto, writer: asyncio.StreamWriter, psk: bytes, address: str, *, io_timeout: float = IO_TIMEOUT
) -> Channel:
    """The connecting side: check the greeting, ``-> psk, e``, ``<- e, ee``, then a first record
    (a ping) that proves to the receiver this side holds the key."""
    await _check_greeting(stream, writer)
    handshake = noise.HandshakeState(initiator=True, psk=psk, prologue=PROLOGUE)
    message = handshake.write_message()
    writer.write(_LENGTH.pack(len(message)) + message)
    try:
        handshake.read_message(await _read_message(stream, initiator=True))
    except noise.NoiseError:
        raise wire.PeerError("auth", f"{address} does not know the job's token") from None
    sending, receiving = handshake.split()
    channel = Channel(stream, writer, sending, receiving, io_timeout=io_timeout)
    if isinstance(stream, wire.FrameStream):
        stream.direct_min = 1
    channel.write(wire.encode({"t": "ping"}))
    await channel.drain()
    return channel


async def open_channel(
    host: str, port: int, token: PeerToken, *, timeout: float = HANDSHAKE_TIMEOUT, io_timeout: float = IO_TIMEOUT
) -> Channel:
    """Connect to a receiver and run the handshake, each attempt within ``timeout`` seconds. During a
    token rotation a receiver that refuses the current token is asked again with the previous one,
    and that receiver is asked with the previous one first from then on (:data:`_PREVIOUS_AT`)."""
    job_token = JobToken.of(token)
    tokens = job_token.accepted
    where = f"{host}:{port}"
    if len(tokens) > 1 and _PREVIOUS_AT.get(where) == job_token.current:
        tokens = tokens[::-1]
    for attempt, secret in enumerate(tokens):
        try:
            channel = await _handshake_with(host, port, secret, timeout=timeout, io_timeout=io_timeout)
        except wire.PeerError as exc:
            if exc.code != "auth" or attempt == len(tokens) - 1:
                raise
            continue
        _remember(where, job_token, used_previous=secret != job_token.current)
        return channel
    raise AssertionError("unreachable: the last attempt returns or raises")


#: Receivers that took only the previous token during a rotation (``host:port`` -> the current token
#: then), so that a handoff's further flows do not each knock with the new token first. Bounded.
_PREVIOUS_AT: dict[str, bytes] = {}
_PREVIOUS_AT_MAX = 256


def _remember(where: str, token: JobToken, *, used_previous: bool) -> None:
    if token.previous is None:
        return
    _PREVIOUS_AT.pop(where, None)
    if used_previous:
        _PREVIOUS_AT[where] = token.current
        while len(_PREVIOUS_AT) > _PREVIOUS_AT_MAX:
            del _PREVIOUS_AT[next(iter(_PREVIOUS_AT))]


async def _handshake_with(host: str, port: int, token: bytes, *, timeout: float, io_timeout: float) -> Channel:
    psk = await asyncio.to_thread(noise.derive_psk, token)
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(timeout):
        transport, stream = await loop.create_connection(lambda: wire.FrameStream(None), host, port)
    writer = asyncio.StreamWriter(transport, stream, None, loop)
    tune_socket(transport.get_extra_info("socket"), io_timeout)
    try:
        async with asyncio.timeout(timeout):
            return await initiate(stream, writer, psk, f"{host}:{port}", io_timeout=io_timeout)
    except BaseException:
        writer.close()
        raise


__all__ = [
    "BATCH_RECORDS",
    "open_payload",
    "records_of",
    "seal_batches",
    "seal_frame",
    "sealed_size",
    "GREETING",
    "HANDSHAKE_TIMEOUT",
    "IO_TIMEOUT",
    "MAX_PLAINTEXT",
    "PROLOGUE",
    "PROTOCOL",
    "V1_REFUSAL",
    "SILENT_PEER_RELEASE",
    "V2_NOTICE",
    "WATCH_INTERVAL",
    "Channel",
    "accept",
    "initiate",
    "open_channel",
    "refusal",
    "tune_socket",
]
