"""The frames the daemons of one job exchange (the peer tier), and the receiving end of a connection.

The whole protocol, spotguard-peer/2, is written down in docs/peer-protocol.md. In short: a
connection is a Noise NNpsk0 channel on a psk derived from the job's token
(spotguard/peer/channel.py, spotguard/peer/noise.py); inside it, every frame is a 4-byte big-endian
length, then that many bytes of a UTF-8 JSON object whose ``t`` names the frame; a ``data`` frame is
followed by exactly ``len`` raw bytes. Limits: a frame's JSON is at most :data:`MAX_HEADER` bytes
(:data:`MAX_HEADER_BEFORE_AUTH` for the clear-text greeting and refusals), but for the one frame a
reader expects to carry a manifest (a ``commit`` on the connection that opened the replica, a fetch's
``checkpoint`` answer), which may take :data:`MAX_BIG_HEADER` and must then be flat (its values
strings, numbers, booleans or nulls); a ``data`` frame carries at most :data:`MAX_DATA` bytes.

The requests (``ping``, ``query``, ``replica``, ``data``, ``commit``; ``list`` and ``fetch`` for a
fresh VM resuming from a peer) and their answers are listed in docs/peer-protocol.md; an ``error``
frame (``code``, ``message``) answers any request it refuses and ends the connection.
"""

from __future__ import annotations

import asyncio
import gc
import json
import re
import struct
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ParamSpec, Protocol, TypeVar

from spotguard.errors import SpotguardError
from spotguard.jsontext import parse_json
from spotguard.peer.tokens import JobToken, token_fingerprint

VERSION = 2
MAX_HEADER_BEFORE_AUTH = 1024
# Any frame: its JSON. The biggest a sender makes besides the manifest's are a data frame's (a file
# name: at most PATH_MAX bytes, escaped to six characters each at worst) and a list of a few replicas.
MAX_HEADER = 64 * 1024
# The frame that carries a manifest, which lists every file (100,000 of them take about 12 MiB).
MAX_BIG_HEADER = 16 * 1024 * 1024
MAX_DATA = 8 * 1024 * 1024
# What a sender puts in one data frame: the most a receiver takes. Each frame costs both event loops
# a hand-over to a worker process and back, so bigger frames carry more per hand-over: on loopback
# 4 MiB frames cost the receiver about half the CPU of 1 MiB ones, and on 16 cores four flows of
# 8 MiB frames carried 5.0-6.1 GB/s against 4.9 with 4 MiB (BENCHMARKS.md). The receiver keeps a
# few frames in flight per replica (memory: that many of these, files.WRITES_IN_FLIGHT).
SEND_CHUNK = MAX_DATA
# Received bytes not yet read by the connection's handler: frame headers, the start of a payload.
# Small, because the start of a payload that lands here is copied once more (a bigger header is
# received straight into its own buffer).
_SCRATCH = 4096
MIN_TOKEN_BYTES = 16
TOKEN_ENV = "SPOTGUARD_PEER_TOKEN"
PREVIOUS_TOKEN_ENV = "SPOTGUARD_PEER_TOKEN_PREVIOUS"  # during a rotation: docs/security.md
_LENGTH = struct.Struct(">I")
# Big frames' JSON, and the manifests they carry, are parsed here, one at a time: off the event loop,
# and one parse's objects (up to thirty times the text) in memory at once, however many connections
# send one.
_BIG_PARSER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spotguard-peer-json")
# A JSON string, escapes and all; or one cut short, to the end (each scan of it then goes forward only:
# a scan that could fail would start again at each quote it had passed, in quadratic time).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
P = ParamSpec("P")
T = TypeVar("T")


class PeerError(SpotguardError):
    """A peer broke the protocol or refused a request; ``code`` is machine-readable."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def encode(header: Mapping[str, Any]) -> bytes:
    body = json.dumps(header, separators=(",", ":")).encode()
    return _LENGTH.pack(len(body)) + body


class Reads(Protocol):
    async def readexactly(self, n: int, /) -> bytes: ...


class ReadsInto(Reads, Protocol):
    async def readinto(self, view: memoryview, /) -> None: ...


async def read_frame(reader: Reads, max_header: int = MAX_HEADER, *, big: str | None = None) -> dict[str, Any]:
    """One frame's JSON object (a ``data`` frame's payload is left to read). Only when ``big`` names a
    frame type may the frame exceed ``max_header``, up to :data:`MAX_BIG_HEADER`, and it must then be
    of that type; its JSON is parsed in a thread of its own."""
    limit = max(max_header, MAX_BIG_HEADER) if big is not None else max_header
    try:
        (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
        if length > limit:
            raise PeerError("too-large", f"a frame of {length} bytes (the limit is {limit})")
        body = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise PeerError("closed", "the connection closed mid-frame") from None
    try:
        header = await parse_off_loop(_parse_flat, body) if length > max_header else parse_json(body)
    except ValueError:
        raise PeerError("bad-frame", "a frame that is not JSON") from None
    if not isinstance(header, dict) or not isinstance(header.get("t"), str):
        raise PeerError("bad-frame", "a frame that is not a JSON object with a type")
    if header["t"] == "error":
        raise PeerError(str(header.get("code", "error")), str(header.get("message", "")))
    if length > max_header and header["t"] != big:
        raise PeerError("too-large", f"a {header['t']!r} frame of {length} bytes (the limit is {max_header})")
    return header


def _parse_flat(body: bytes) -> Any:
    """A big frame's JSON, which must be one object of strings, numbers, booleans and nulls (what
    carries a manifest does: as a string): a nested one is refused before it is parsed, since MiBs of
    tiny arrays or objects cost seconds of the interpreter's lock and GiBs of memory."""
    outside_strings = _STRING.sub(b"", body)  # a scan in C: 0.3 s for 16 MiB of manifest at worst
    if b"[" in outside_strings or b"{" in outside_strings[1:]:
        raise PeerError("too-large", "a big frame may hold only strings and numbers")
    return parse_json(body)


async def parse_off_loop(parse: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``parse(*args)`` (a parse of MiBs of JSON: a big frame, a manifest) in the one thread that
    parses them, one at a time, the cyclic garbage collector paused meanwhile: the millions of objects
    a big text may hold would start it again and again (16 MiB of tiny arrays: 5 s, 0.7 s without)."""

    def paused() -> T:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return parse(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()

    return await asyncio.get_running_loop().run_in_executor(_BIG_PARSER, paused)


def expect(header: Mapping[str, Any], kind: str) -> None:
    if header["t"] != kind:
        raise PeerError("bad-frame", f"expected a {kind!r} frame, got {header['t']!r}")


def field(header: Mapping[str, Any], name: str, kind: type) -> Any:
    value = header.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise PeerError("bad-field", f"{header['t']}: {name} must be a {kind.__name__}")
    return value


def error_frame(code: str, message: str) -> bytes:
    return encode({"t": "error", "code": code, "message": message})


# --- receiving straight into the caller's buffers ---------------------------------------------


class FrameStream(asyncio.streams.FlowControlMixin, asyncio.BufferedProtocol):
    """The receiving end of a connection: small reads come through a small scratch buffer, big ones
    (a record, a batch of a payload's records: spotguard/peer/channel.py) are received
    (``recv_into``) straight into the buffer its reader passes to :meth:`readinto`. asyncio's
    ``StreamReader`` instead copies every byte three or four times (received ``bytes``, appended to
    its buffer, sliced out, the buffer shifted). Memory per connection: the scratch buffer, plus the
    reader's buffers.
    Writing goes through an ordinary ``asyncio.StreamWriter`` (this class does its flow control)."""

    def __init__(
        self, handler: Callable[[FrameStream, asyncio.StreamWriter], Coroutine[Any, Any, None]] | None
    ) -> None:
        self._event_loop = asyncio.get_running_loop()
        super().__init__(self._event_loop)
        self._handler = handler
        self.received = 0  # bytes, counted as they come
        self._scratch = bytearray(_SCRATCH)
        self._view = memoryview(self._scratch)
        self._start = self._end = 0  # unread bytes: scratch[start:end]
        self._target: memoryview | None = None  # a handler's buffer being filled by the socket
        self._filled = 0
        self._direct = False  # the last get_buffer gave the handler's buffer
        # Reads of at least this many bytes go straight into the handler's buffer. Until a connection is
        # authenticated, small ones go through the scratch (a stranger's next bytes are then not left in
        # the kernel, where they would turn our refusal into a reset); after, the channel's 2-byte record
        # lengths go straight too, so that a record's start is not copied and reading never pauses.
        self.direct_min = _SCRATCH
        self._waiter: asyncio.Future[None] | None = None
        self._eof = False
        self._error: BaseException | None = None
        self._reading_paused = False
        self._transport: asyncio.Transport | None = None
        self._closed: asyncio.Future[None] = self._event_loop.create_future()
        self._task: asyncio.Task[None] | None = None
        # Called when the connection is lost while another process reads or writes its socket
        # (spotguard/peer/workers.py): it shuts the socket, so that the other's wait ends at once.
        self.on_lost: Callable[[], None] | None = None

    # -- the transport's side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        if self._handler is not None:  # a server's connection; a client drives its own
            writer = asyncio.StreamWriter(transport, self, None, self._event_loop)
            self._task = self._event_loop.create_task(self._handler(self, writer))
            self._task.add_done_callback(self._handler_done)

    def _handler_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (exc := task.exception()) is not None:
            self._event_loop.call_exception_handler({"message": "a peer connection's handler failed", "exception": exc})
            if self._transport is not None:
                self._transport.close()

    def get_buffer(self, sizehint: int) -> memoryview:
        # Straight into the handler's buffer when it wants more than the scratch holds; small reads (a
        # length, a header) go through the scratch, so that what follows them is not left in the kernel.
        self._direct = self._target is not None and self._start == self._end and len(self._target) >= self.direct_min
        if self._direct:
            assert self._target is not None
            return self._target[self._filled :]
        if self._start == self._end:
            self._start = self._end = 0
        elif self._start and self._end == len(self._scratch):  # room at the front only: move the rest there
            self._scratch[: self._end - self._start] = self._view[self._start : self._end]
            self._start, self._end = 0, self._end - self._start
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        self.received += nbytes
        if self._direct and self._target is not None:
            self._filled += nbytes
            if self._filled < len(self._target):
                return
            self._target = None  # full: what comes next is the next frame's
        else:
            self._end += nbytes
            if self._end == len(self._scratch) and self._start == 0 and self._transport is not None:
                self._transport.pause_reading()  # full: the handler reads on first
                self._reading_paused = True
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return True  # keep the transport open: a last error frame may still go out

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        self._error = exc
        self._wake()
        if self.on_lost is not None:
            self.on_lost()
        if not self._closed.done():
            self._closed.set_result(None)
        super().connection_lost(exc)

    def _get_close_waiter(self, stream: asyncio.StreamWriter) -> asyncio.Future[None]:
        return self._closed  # StreamWriter.wait_closed

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # -- the handler's side

    async def readinto(self, view: memoryview) -> None:
        """Fill ``view`` (a writable byte buffer); ``IncompleteReadError`` if the connection ends first."""
        done = 0
        while True:
            take = min(len(view) - done, self._end - self._start)
            if take:
                view[done : done + take] = self._view[self._start : self._start + take]
                self._start += take
                done += take
            if done == len(view):
                return
            if self._error is not None:
                raise self._error
            if self._eof:
                raise asyncio.IncompleteReadError(bytes(view[:done]), len(view))
            self._target, self._filled = view[done:], 0  # the rest comes straight from the socket
            if self._reading_paused and self._transport is not None:
                self._reading_paused = False
                self._transport.resume_reading()
            self._waiter = self._event_loop.create_future()
            try:
                await self._waiter
            finally:
                # Cancelled (a timeout): no later byte may land in a buffer its owner gave up.
                done += self._filled
                self._target, self._filled, self._waiter = None, 0, None

    async def readexactly(self, n: int, /) -> bytes:
        if self._end - self._start >= n:
            data = bytes(self._view[self._start : self._start + n])
            self._start += n
            return data
        out = bytearray(n)
        await self.readinto(memoryview(out))
        return bytes(out)

    def hand_over(self, limit: int) -> bytes:
        """Stop reading the socket, and give up to ``limit`` of the bytes read ahead: another process
        goes on reading the socket (spotguard/peer/workers.py). The next :meth:`readinto` takes it back."""
        assert self._target is None, "a read is going on"
        if not self._reading_paused and self._transport is not None:
            self._transport.pause_reading()
            self._reading_paused = True  # readinto resumes it
        take = min(limit, self._end - self._start)
        data = bytes(self._view[self._start : self._start + take])
        self._start += take
        return data


async def start_server(
    handler: Callable[[FrameStream, asyncio.StreamWriter], Coroutine[Any, Any, None]], host: str, port: int
) -> asyncio.Server:
    """``asyncio.start_server`` with :class:`FrameStream` as each connection's reading end."""
    return await asyncio.get_running_loop().create_server(lambda: FrameStream(handler), host, port)


# --- the job's token ------------------------------------------------------------------------


def load_token(env: Mapping[str, str], token_file: Path | None) -> bytes:
    """The job's shared peer token: ``SPOTGUARD_PEER_TOKEN``, else the contents of ``token_file``
    (surrounding whitespace removed). Raises ``ValueError`` naming the source, never the value."""
    token = _read_token(env, TOKEN_ENV, token_file, "peer token")
    if token is None:
        raise ValueError(f"peers need the job's shared token: set {TOKEN_ENV} or peer_token_file")
    return token


def load_job_token(env: Mapping[str, str], token_file: Path | None, previous_file: Path | None) -> JobToken:
    """The job's token (:func:`load_token`) and, during a rotation, the one it replaces:
    ``SPOTGUARD_PEER_TOKEN_PREVIOUS``, else the contents of ``previous_file``; none if both are
    unset or empty (the usual case). Raises ``ValueError`` naming the source, never the value."""
    return JobToken(load_token(env, token_file), load_previous_token(env, previous_file))


def load_previous_token(env: Mapping[str, str], previous_file: Path | None) -> bytes | None:
    """The token a rotation replaces: ``SPOTGUARD_PEER_TOKEN_PREVIOUS``, else the contents of
    ``previous_file``; None if both are unset or empty. ``ValueError`` as :func:`load_token`."""
    return _read_token(env, PREVIOUS_TOKEN_ENV, previous_file, "previous peer token")


def _read_token(env: Mapping[str, str], variable: str, token_file: Path | None, what: str) -> bytes | None:
    source = variable
    text = env.get(variable, "")
    if not text and token_file is not None:
        source = str(token_file)
        try:
            text = token_file.read_text()
        except OSError as exc:
            raise ValueError(f"cannot read the {what} file {token_file}: {exc.strerror}") from None
    token = text.strip().encode()
    if not token:
        return None
    if len(token) < MIN_TOKEN_BYTES:
        raise ValueError(f"the {what} from {source} is shorter than {MIN_TOKEN_BYTES} bytes")
    return token


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as a (host, port) pair; ``ValueError`` if it is not one."""
    host, sep, port = text.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{text!r} is not HOST:PORT")
    return host, int(port)


__all__ = [
    "MAX_BIG_HEADER",
    "MAX_DATA",
    "MAX_HEADER",
    "MAX_HEADER_BEFORE_AUTH",
    "PREVIOUS_TOKEN_ENV",
    "SEND_CHUNK",
    "TOKEN_ENV",
    "VERSION",
    "FrameStream",
    "PeerError",
    "Reads",
    "ReadsInto",
    "encode",
    "error_frame",
    "expect",
    "field",
    "load_job_token",
    "load_previous_token",
    "load_token",
    "parse_address",
    "parse_off_loop",
    "read_frame",
    "start_server",
    "token_fingerprint",
]
