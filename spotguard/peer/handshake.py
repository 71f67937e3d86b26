"""The start of a spotguard-peer/2 connection (docs/peer-protocol.md, sections 2 and 3).

The receiver greets first, in clear (a frame a spotguard-peer/1 daemon reads as a version error);
then the Noise NNpsk0 handshake on a psk derived from the job's token (spotguard/peer/noise.py),
each message as a 2-byte length and the message; then the initiator's first record, which proves to
the receiver that it holds the key. What comes after is a :class:`~spotguard.peer.channel.Channel`.

:func:`accept` is the receiver's side, :func:`open_channel` the initiator's (connect, handshake, and
during a token rotation the previous token where a receiver refuses the current one).
"""

from __future__ import annotations

import asyncio
import struct

from spotguard.jsontext import parse_json
from spotguard.peer import noise, wire
from spotguard.peer.channel import IO_TIMEOUT, Channel, tune_socket
from spotguard.peer.records import LENGTH
from spotguard.peer.tokens import PREVIOUS_ONLY, JobToken, PeerToken

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
MAX_HANDSHAKE_MESSAGE = 1024
# Pauses before a handshake is tried again where the receiver's pool of unauthenticated connections
# turned it away (busy) or dropped it unfinished (closed): strangers crowding that pool are dropped
# once they stall (1 s, spotguard/peer/receiver.py), so the last try comes after that.
HANDSHAKE_RETRY_PAUSES = (0.2, 0.4, 0.8)
_REFUSAL = LENGTH.pack(0)  # a handshake "message" of length 0: a clear-text error frame follows


async def _read_message(stream: wire.Reads, *, initiator: bool) -> bytes:
    """A handshake message. The initiator takes a refusal (length 0) and raises the error frame that
    follows it; to the receiver, a message too short for ``e`` and a tag fails authentication."""
    try:
        (length,) = LENGTH.unpack(await stream.readexactly(LENGTH.size))
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
    handshake, with_previous = _responder_for(first, psk, previous_psk)
    message = handshake.write_message()
    writer.write(LENGTH.pack(len(message)) + message)
    sending, receiving = handshake.split()
    channel = Channel(stream, writer, sending, receiving, io_timeout=io_timeout)
    channel.with_previous_token = with_previous
    try:
        await channel.fill()
        if isinstance(stream, wire.FrameStream):
            stream.direct_min = 1
    except wire.PeerError as exc:
        if exc.code == "bad-record":
            raise wire.PeerError("auth", "authentication failed (its first record does not decrypt)") from None
        raise
    return channel


def _responder_for(first: bytes, psk: bytes, previous_psk: bytes | None) -> tuple[noise.HandshakeState, bool]:
    """The responder's handshake whose psk authenticates the initiator's first message, and whether
    that psk is the previous token's. During a rotation both psks are tried, whichever succeeds (one
    tag check passes, one fails, in either order), so the time the check takes does not tell an
    observer which token the initiator used."""
    found: tuple[noise.HandshakeState, bool] | None = None
    for candidate, previous in ((psk, False), (previous_psk, True)):
        if candidate is None:
            continue
        handshake = noise.HandshakeState(initiator=False, psk=candidate, prologue=PROLOGUE)
        try:
            handshake.read_message(first)
        except noise.NoiseError:
            continue
        found = found or (handshake, previous)
    if found is None:
        raise wire.PeerError("auth", "authentication failed")
    return found


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
    writer.write(LENGTH.pack(len(message)) + message)
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
    token rotation a receiver that refuses the current token is asked again with the previous one;
    a receiver known to hold only the previous one is asked with it first (:data:`PREVIOUS_ONLY`)."""
    job_token = JobToken.of(token)
    tokens = job_token.accepted
    if PREVIOUS_ONLY.first(host, port, job_token):
        tokens = tokens[::-1]
    for attempt, secret in enumerate(tokens):
        try:
            channel = await _handshake_retried(host, port, secret, timeout=timeout, io_timeout=io_timeout)
        except wire.PeerError as exc:
            if exc.code != "auth" or attempt == len(tokens) - 1:
                raise
            continue
        channel.with_previous_token = secret != job_token.current
        PREVIOUS_ONLY.learn(host, port, job_token, previous_only=channel.with_previous_token)
        return channel
    raise AssertionError("unreachable: the last attempt returns or raises")


async def _handshake_retried(host: str, port: int, token: bytes, *, timeout: float, io_timeout: float) -> Channel:
    """:func:`_handshake_with`, tried again after each of :data:`HANDSHAKE_RETRY_PAUSES` where the
    receiver turned it away (``busy``) or closed it before it finished (``closed``): a flood of
    strangers at its port, not a refusal of this daemon. Within ``timeout`` seconds in all."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    for pause in (*HANDSHAKE_RETRY_PAUSES, None):
        try:
            return await _handshake_with(host, port, token, timeout=deadline - loop.time(), io_timeout=io_timeout)
        except wire.PeerError as exc:
            if exc.code not in ("busy", "closed") or pause is None or deadline - loop.time() <= pause:
                raise
        await asyncio.sleep(pause)
    raise AssertionError("unreachable: the last try returns or raises")


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
    "GREETING",
    "HANDSHAKE_RETRY_PAUSES",
    "HANDSHAKE_TIMEOUT",
    "PROLOGUE",
    "PROTOCOL",
    "V1_REFUSAL",
    "V2_NOTICE",
    "accept",
    "initiate",
    "open_channel",
    "refusal",
]
