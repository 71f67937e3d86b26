"""The protected byte stream between two daemons of a job, once the handshake is done
(spotguard-peer/2, docs/peer-protocol.md; the handshake: spotguard/peer/handshake.py).

From then on every byte either side sends, frame headers and data alike, goes in records
(spotguard/peer/records.py) under that direction's key and counter. A record changed, replayed,
reordered, dropped or injected fails to decrypt and ends the connection.

:class:`Channel` is a byte stream on top of that: what :func:`spotguard.peer.wire.encode` and
:func:`~spotguard.peer.wire.read_frame` speak works on it unchanged. Every read of a record and
every drain of a write has a deadline (:data:`IO_TIMEOUT`), and both sides set TCP keepalive and
``TCP_USER_TIMEOUT``: a peer that goes silent, mid-payload or not, is dropped within that time. A peer
whose host answers nothing at all (reclaimed at once, or cut off) is told apart from one that is only
slow (:meth:`Channel.unanswered`), and a channel that leaves such a peer (the receiver's, a fetch's)
ends after :data:`GONE_AFTER` seconds of it. A data frame's payload may be handed to a worker process
(spotguard/peer/workers.py) with the nonces it uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any, Protocol

from spotguard.errors import TransientError
from spotguard.peer import noise, wire
from spotguard.peer.records import (
    BATCH_BYTES,
    BATCH_RECORDS,
    FULL_RECORD,
    LENGTH,
    MAX_PLAINTEXT,
    layout,
    records_end,
    records_of,
    seal_frame,
    seal_record,
    sealed_size,
)
from spotguard.peer.sockio import HandedSocket, run_handed


class Worker(Protocol):
    """What carries a frame's bytes in another process (spotguard/peer/workers.py)."""

    def call(self, job: dict[str, Any], fds: list[int], *, more: bool = False) -> Any: ...

    def release(self) -> None: ...


# Seconds a peer may leave a started record unfinished, or leave our writes unread, before it is
# dropped (with its replica, if it was sending one); also TCP_USER_TIMEOUT.
IO_TIMEOUT = 30.0
WATCH_INTERVAL = 1.0  # how often the record deadline is checked
# The bound on how long a silent peer holds its connection (and a replica slot on a receiver).
SILENT_PEER_RELEASE = IO_TIMEOUT + WATCH_INTERVAL
# Seconds a peer's host may answer nothing while something of ours waits for its answer (bytes in
# flight, or keepalive probes) before it is taken for gone: its kernel answers within a round trip
# unless the host is gone, and in 3 s a lost segment is sent again four times (0.2, 0.4, 0.8, 1.6 s).
GONE_AFTER = 3.0
# The bound on how long a peer whose host is gone holds a connection that leaves it (the receiver's,
# and so a replica slot; a fetch's): GONE_AFTER, then the watch's next look.
GONE_PEER_RELEASE = GONE_AFTER + WATCH_INTERVAL
# A probe once a connection is idle for a second, then one a second: something the peer's host must
# answer, so that a host that is gone is told while nothing of ours is in flight. The kernel ends the
# connection only at TCP_USER_TIMEOUT (io_timeout), which takes over from TCP_KEEPCNT where it is set.
_KEEPALIVE = {"TCP_KEEPIDLE": 1, "TCP_KEEPINTVL": 1, "TCP_KEEPCNT": 3}
_GONE_PROBES = 2  # unanswered probes in a row: one answer lost, or a zero-window probe just sent, is not it


# struct tcp_info (linux/tcp.h): 8 one-byte fields, 24 u32 (rto, ato, snd_mss, rcv_mss, unacked, ...,
# last_ack_recv, ..., total_retrans), u64 pacing_rate, u64 max_pacing_rate, then u64 tcpi_bytes_acked.
_U32 = struct.Struct("=I")
_PROBES_AT = 3  # u8 tcpi_probes: keepalive or zero-window probes sent since the last acknowledgement
_UNACKED_AT = 8 + 4 * 4  # segments sent and not acknowledged yet
_LAST_ACK_RECV_AT = 8 + 12 * 4  # milliseconds since the peer's last acknowledgement
_BYTES_ACKED_AT = 8 + 24 * 4 + 2 * 8
_BYTES_ACKED = struct.Struct("=Q")
_TCP_INFO_SIZE = 256


class PeerGone(TransientError, TimeoutError):
    """The peer's host answered nothing for :data:`GONE_AFTER` seconds: the connection was ended (a
    TimeoutError, as a deadline run into is: callers that handle one handle both)."""


def tune_socket(sock: socket.socket | None, io_timeout: float = IO_TIMEOUT) -> None:
    """Keepalive probes once idle for a second (a host that is gone leaves them unanswered:
    :meth:`Channel.unanswered`), and ``io_timeout`` seconds with nothing acknowledged ends the
    connection in the kernel (where the OS has these options)."""
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
        # End the connection once the peer's host is gone (:meth:`unanswered`). A handoff's flows
        # leave it off: they fail together (spotguard/peer/flows.py), not one connection at a time.
        self.leave_when_gone = False
        self._gone: float | None = None  # seconds it had answered nothing, once ended for it
        # Authenticated with the previous token during a rotation (set by spotguard/peer/handshake.py).
        self.with_previous_token = False

    @property
    def transport(self) -> asyncio.WriteTransport:
        return self.writer.transport

    def delivered(self) -> int | None:
        """Bytes the peer has acknowledged on this connection (Linux ``TCP_INFO``), not counting
        what waits in buffers on the way; None where the OS does not say. A flow's rate, measured."""
        info = self._tcp_info()
        if info is None or len(info) < _BYTES_ACKED.size + _BYTES_ACKED_AT:
            return None  # a kernel older than 4.1
        return int(_BYTES_ACKED.unpack_from(info, _BYTES_ACKED_AT)[0])

    def unanswered(self) -> float | None:
        """Seconds the peer's host has answered nothing while something of ours waited for its answer
        (Linux ``TCP_INFO``): bytes in flight, or :data:`_GONE_PROBES` keepalive probes in a row; 0.0
        with neither; None where the OS does not say.

        It tells a peer that is gone from one that is slow or idle. A receiver that stops reading (its
        disk stalls, its process is stopped) still has a kernel that acknowledges what arrived and
        answers the zero-window probes, and an idle peer's kernel answers the keepalive probes: nothing
        stays unanswered. A host reclaimed at once, or cut off, answers nothing: what was sent stays in
        flight and is sent again and again, and probe follows probe."""
        info = self._tcp_info()
        if info is None or len(info) < _LAST_ACK_RECV_AT + _U32.size:
            return None
        if _U32.unpack_from(info, _UNACKED_AT)[0] == 0 and info[_PROBES_AT] < _GONE_PROBES:
            return 0.0
        return float(_U32.unpack_from(info, _LAST_ACK_RECV_AT)[0]) / 1000

    def gone_for(self) -> float | None:
        """Seconds the peer's host has answered nothing (:meth:`unanswered`) once that is
        :data:`GONE_AFTER` or more, which makes it gone; None while it is not (or the OS does not say)."""
        quiet = self.unanswered()
        return quiet if quiet is not None and quiet >= GONE_AFTER else None

    def _tcp_info(self) -> bytes | None:
        sock = self.writer.get_extra_info("socket")
        if sock is None or not hasattr(socket, "TCP_INFO"):
            return None
        try:
            return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_SIZE)
        except OSError:
            return None

    # --- reading ------------------------------------------------------------------------

    async def _next_record(self) -> memoryview:
        """The next record's ciphertext (in the reused buffer), read within the deadline."""
        with self._record_deadline():
            (length,) = LENGTH.unpack(await self.stream.readexactly(LENGTH.size))
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
            with self._ended_if_gone():
                yield
        except asyncio.IncompleteReadError:
            if self._timed_out:
                raise TimeoutError(f"no whole record for {self.io_timeout:g} s") from None
            raise wire.PeerError("closed", "the connection closed mid-record") from None
        finally:
            self._reading_since = None

    @contextlib.contextmanager
    def _ended_if_gone(self) -> Iterator[None]:
        """Whatever a read, a drain or a worker's job inside raises once the watch ended the connection
        for a peer that is gone, it is told as that (:class:`PeerGone`)."""
        try:
            yield
        except Exception:
            if self._gone is None:
                raise
            raise PeerGone(f"its host answered nothing for {self._gone:.1f} s (gone, or the way to it cut)") from None

    def _watch(self) -> None:
        """The deadline on records, checked every :data:`WATCH_INTERVAL` seconds while the connection
        is open (cheaper than a timeout around each of a payload's thousands of records): a record
        begun and not finished within ``io_timeout`` ends the connection; so does a peer whose host is
        gone, where the channel leaves one (``leave_when_gone``)."""
        transport = self.writer.transport
        if self._watchdog is not None or transport is None or transport.is_closing():
            return
        since = self._reading_since
        if since is not None and time.monotonic() - since > self.io_timeout:
            self._timed_out = True
            transport.abort()  # the pending read ends; it raises TimeoutError
            return
        quiet = self.gone_for() if self.leave_when_gone else None
        if quiet is not None:
            self._gone = quiet
            self.abort()  # shut down too: a worker's job on its duplicate of the socket ends as well
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
            self._batch = bytearray(BATCH_BYTES)
        batch = memoryview(self._batch)[: count * FULL_RECORD]
        with self._record_deadline():
            await self.stream.readinto(batch)
        for index in range(count):
            record = batch[index * FULL_RECORD : (index + 1) * FULL_RECORD]
            if LENGTH.unpack_from(record)[0] != noise.MAX_MESSAGE:
                raise wire.PeerError("bad-record", "a payload's record that is not full before its last")
            self._open(record[LENGTH.size :], view[index * MAX_PLAINTEXT : (index + 1) * MAX_PLAINTEXT])
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
        with self._ended_if_gone():
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
        with self._ended_if_gone():
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

    async def read_frame(
        self, *, timeout: float | None = None, max_header: int = wire.MAX_HEADER, big: str | None = None
    ) -> dict[str, Any]:
        """The next frame (``max_header`` and ``big`` as :func:`~spotguard.peer.wire.read_frame`).
        ``timeout``, when longer than the record deadline, replaces it while this frame is awaited and
        read: a receiver waiting for a sender's next request, a sender waiting for the answer to a commit."""
        if timeout is None or timeout <= self.io_timeout:
            return await wire.read_frame(self, max_header, big=big)
        saved, self.io_timeout = self.io_timeout, timeout
        try:
            return await wire.read_frame(self, max_header, big=big)
        finally:
            self.io_timeout = saved

    # --- writing ------------------------------------------------------------------------

    def seal(self, *parts: bytes | bytearray | memoryview) -> bytearray:
        """``parts`` as records (each part in records of its own), ready for the socket. Takes the next
        nonces: calls must go out in the order they were made (one may run in a thread while the
        previous one's bytes are sent)."""
        views = [memoryview(part).cast("B") for part in parts]
        records = list(layout([len(view) for view in views]))
        out = bytearray(records_end(records))
        target = memoryview(out)
        for at, index, piece in records:
            seal_record(self._send, target, at, views[index][piece.start : piece.stop])
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
        with self._ended_if_gone():
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

    def abort(self) -> None:
        """End the connection now, what waits in its buffers dropped: a peer that acknowledges
        nothing would hold a plain close (which flushes first) for ``io_timeout``. The socket is shut
        down first, which ends a worker's send on its duplicate of it too."""
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.close()
        self.writer.transport.abort()

    async def wait_closed(self) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.io_timeout):
                await self.writer.wait_closed()


__all__ = [
    "GONE_AFTER",
    "GONE_PEER_RELEASE",
    "IO_TIMEOUT",
    "PeerGone",
    "SILENT_PEER_RELEASE",
    "WATCH_INTERVAL",
    "Channel",
    "Worker",
    "tune_socket",
]
