"""Property tests of the peer protocol's parsers: whatever bytes arrive, as frames, as records or as
a handshake, nothing but the protocol's own error (:class:`~spotguard.peer.wire.PeerError`) comes
out of them."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from typing import Any, cast

from hypothesis import example, given, settings
from hypothesis import strategies as st

from spotguard.peer import noise, wire
from spotguard.peer.channel import Channel
from spotguard.peer.files import check_range, data_header
from spotguard.peer.handshake import PROLOGUE, accept, initiate

PSK = bytes(range(32))


class Bytes:
    """A connection's received bytes, read the way the receiver reads its socket."""

    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    async def readexactly(self, n: int, /) -> bytes:
        if self.at + n > len(self.data):
            self.at = len(self.data)
            raise asyncio.IncompleteReadError(b"", n)
        self.at += n
        return self.data[self.at - n : self.at]

    async def readinto(self, view: memoryview, /) -> None:
        view[:] = await self.readexactly(len(view))


class Sink:
    """Where a side writes (the parsers under test only read)."""

    def __init__(self) -> None:
        self.written = bytearray()
        self.transport = None

    def write(self, data: bytes) -> None:
        self.written += data

    async def drain(self) -> None:
        return None


def channels() -> tuple[Channel, Channel]:
    """Two ends of a finished handshake, each over no connection (records are carried by hand)."""
    initiator = noise.HandshakeState(initiator=True, psk=PSK, prologue=PROLOGUE)
    responder = noise.HandshakeState(initiator=False, psk=PSK, prologue=PROLOGUE)
    responder.read_message(initiator.write_message())
    initiator.read_message(responder.write_message())
    sink = cast(asyncio.StreamWriter, Sink())
    return Channel(Bytes(b""), sink, *initiator.split()), Channel(Bytes(b""), sink, *responder.split())


async def every_frame(reader: wire.Reads) -> list[dict[str, Any]]:
    """Frames until the bytes run out (as a receiver would, data frames' payloads checked and read)."""
    frames = []
    while True:
        frame = await wire.read_frame(reader)
        if frame["t"] == "data":
            rel, size, offset, length = data_header(frame)
            check_range(rel, size, offset, length)
            await reader.readexactly(length)
        frames.append(frame)


def through_a_channel(plaintext: bytes) -> Channel:
    """The receiving end of a channel whose peer sent ``plaintext`` (sealed as the sender does) and stopped."""
    sending, receiving = channels()
    receiving.stream = Bytes(bytes(sending.seal(plaintext)))
    return receiving


def only_peer_errors(coroutine: Any) -> None:
    with contextlib.suppress(wire.PeerError):  # anything else fails the test
        asyncio.run(coroutine)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048))
@example(struct.pack(">I", 100_000) + b"[" * 100_000)  # nested deeper than the JSON parser recurses
@example(wire.encode({"t": "error", "code": 5}))
def test_any_bytes_as_frames(data: bytes) -> None:
    only_peer_errors(every_frame(through_a_channel(data)))


frame_like = st.one_of(
    st.binary(max_size=512),
    st.dictionaries(st.sampled_from(["t", "name", "size", "offset", "len", "code"]), st.integers() | st.text()).map(
        wire.encode
    ),
    st.builds(
        lambda name, size, offset, length, tail: (
            wire.encode({"t": "data", "name": name, "size": size, "offset": offset, "len": length}) + tail
        ),
        st.text(max_size=20),
        st.integers(-5, 1 << 20),
        st.integers(-5, 1 << 20),
        st.integers(-5, 4096),
        st.binary(max_size=64),
    ),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(frame_like, max_size=6))
def test_frame_like_bytes_as_frames(pieces: list[bytes]) -> None:
    only_peer_errors(every_frame(through_a_channel(b"".join(pieces))))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=4096))
def test_any_bytes_as_records(data: bytes) -> None:
    _, receiving = channels()
    receiving.stream = Bytes(data)
    only_peer_errors(every_frame(receiving))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=5), st.integers(0, 4), st.integers(0, 7))
def test_sealed_records_changed_anywhere(plaintexts: list[bytes], which: int, bit: int) -> None:
    """Records the sender sealed (of any plaintext, even one that is no frame), one bit of one flipped."""
    sending, receiving = channels()
    sealed = bytearray(b"".join(sending.seal(p) for p in plaintexts if p))
    if sealed:
        sealed[which * 37 % len(sealed)] ^= 1 << bit
    receiving.stream = Bytes(bytes(sealed))
    only_peer_errors(every_frame(receiving))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=600))
def test_any_bytes_as_a_handshake(data: bytes) -> None:
    sink = cast(asyncio.StreamWriter, Sink())
    only_peer_errors(accept(Bytes(data), sink, PSK))  # the receiver's side
    only_peer_errors(initiate(Bytes(data), sink, PSK, "127.0.0.1:1"))  # the connecting side
