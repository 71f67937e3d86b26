"""The Noise pieces of the peer channel (spotguard/peer/noise.py) against fixed vectors: a published
one for the symmetric state, and the NNpsk0 vector of docs/peer-protocol.md."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from spotguard.peer import noise, wire
from spotguard.peer.handshake import PROLOGUE

PSK = bytes(range(1, 33))


def key(first: int) -> X25519PrivateKey:
    return X25519PrivateKey.from_private_bytes(bytes(range(first, first + 32)))


def test_the_symmetric_state_gives_snows_published_npsk0_message() -> None:
    """snow's Noise_Npsk0_25519_AESGCM_SHA256 vector (responder static key 00..1f, ephemeral 20..3f,
    psk 01..20, empty prologue and payload): the same primitives, with an ``es`` instead of ``ee``."""
    responder_static, ephemeral = key(0), key(0x20)
    state = noise.SymmetricState(b"Noise_Npsk0_25519_AESGCM_SHA256")
    state.mix_hash(b"")
    state.mix_hash(responder_static.public_key().public_bytes_raw())
    state.mix_key_and_hash(PSK)
    public = ephemeral.public_key().public_bytes_raw()
    state.mix_hash(public)
    state.mix_key(public)
    state.mix_key(ephemeral.exchange(responder_static.public_key()))
    message = public + state.encrypt_and_hash(b"")
    assert message.hex() == (
        "358072d6365880d1aeea329adf9121383851ed21a28e3b75e965d0d2cd1662542044ae563929068930dcf04674526cb9"
    )


def handshake(psk_i: bytes = PSK, psk_r: bytes = PSK) -> tuple[noise.HandshakeState, noise.HandshakeState]:
    return (
        noise.HandshakeState(initiator=True, psk=psk_i, prologue=PROLOGUE, ephemeral=key(0x20)),
        noise.HandshakeState(initiator=False, psk=psk_r, prologue=PROLOGUE, ephemeral=key(0x40)),
    )


def test_the_nnpsk0_vector_of_the_protocol_document() -> None:
    initiator, responder = handshake()
    first = initiator.write_message()
    assert first.hex() == (
        "358072d6365880d1aeea329adf9121383851ed21a28e3b75e965d0d2cd1662541e600e9ba95f880c898a6e2c741c028c"
    )
    assert responder.read_message(first) == b""
    second = responder.write_message()
    assert second.hex() == (
        "79a631eede1bf9c98f12032cdeadd0e7a079398fc786b88cc846ec89af85a51a80e5c69542536a3559bd76cab8f7c353"
    )
    assert initiator.read_message(second) == b""
    assert initiator.handshake_hash.hex() == "0353cd34773532f0fb8b2b94b53f091a750fe65379a0c9834989a529bc910ff5"
    assert responder.handshake_hash == initiator.handshake_hash
    (i_send, i_recv), (r_send, r_recv) = initiator.split(), responder.split()
    ping = i_send.encrypt(b"", wire.encode({"t": "ping"}))
    assert ping.hex() == "b70deb6bd9f05a2ec618babe8961d95b7b1a9a28d857481fc5a55e9a43728221"
    assert r_recv.decrypt(b"", ping) == wire.encode({"t": "ping"})
    ok = r_send.encrypt(b"", wire.encode({"t": "ok"}))
    assert ok.hex() == "d3621f6e1b7c3650193e3cd12ad73be67afbd4c08e7fd8f0596457704377"
    assert i_recv.decrypt(b"", ok) == wire.encode({"t": "ok"})


def test_the_psk_is_derived_from_the_token_as_documented() -> None:
    assert noise.derive_psk(b"spotguard-test-token-0123456789").hex() == (
        "73fabeaec10b24b0158c8f0dd94a63ea516acafb68da6b70696cefefa2acad23"
    )


def test_another_psk_or_prologue_fails_the_handshake() -> None:
    initiator, responder = handshake(psk_r=bytes(32))
    with pytest.raises(noise.NoiseError):
        responder.read_message(initiator.write_message())
    other = noise.HandshakeState(initiator=True, psk=PSK, prologue=b"spotguard-peer/1")
    with pytest.raises(noise.NoiseError):
        handshake()[1].read_message(other.write_message())
    initiator, responder = handshake()
    responder.read_message(initiator.write_message())
    second = bytearray(responder.write_message())
    second[40] ^= 1
    with pytest.raises(noise.NoiseError):
        initiator.read_message(bytes(second))


def test_a_replayed_reordered_or_changed_record_fails() -> None:
    initiator, responder = handshake()
    responder.read_message(initiator.write_message())
    initiator.read_message(responder.write_message())
    (send, _), (_, receive) = initiator.split(), responder.split()
    one, two = send.encrypt(b"", b"one"), send.encrypt(b"", b"two")
    with pytest.raises(noise.NoiseError):
        receive.decrypt(b"", two)  # before one: reordered
    receive = responder.split()[1]  # the same key from counter 0 again
    assert receive.decrypt(b"", one) == b"one"
    with pytest.raises(noise.NoiseError):
        receive.decrypt(b"", one)  # replayed


def test_messages_out_of_order_are_refused() -> None:
    initiator, responder = handshake()
    with pytest.raises(noise.NoiseError):
        responder.write_message()  # before the initiator's message
    with pytest.raises(noise.NoiseError):
        initiator.split()


def test_during_a_rotation_the_receiver_checks_both_psks_whichever_the_initiator_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One tag check passes and one fails either way, so the handshake's time does not tell which
    token a sender holds. (Counted with the real checks running: a spy, not a stand-in.)"""
    import asyncio

    from spotguard.peer.handshake import accept, open_channel

    new, old = b"the-job-s-new-peer-token-0123456789", b"the-job-s-old-peer-token-0123456789"
    checks: list[bool] = []  # the responder's checks of message 1: passed or not
    real = noise.HandshakeState.read_message

    def counted(self: noise.HandshakeState, message: bytes) -> bytes:
        if self.initiator:
            return real(self, message)
        try:
            payload = real(self, message)
        except noise.NoiseError:
            checks.append(False)
            raise
        checks.append(True)
        return payload

    monkeypatch.setattr(noise.HandshakeState, "read_message", counted)

    async def handshake_with(token: bytes) -> None:
        async def receiver(stream: wire.FrameStream, writer: asyncio.StreamWriter) -> None:
            channel = await accept(stream, writer, noise.derive_psk(new), previous_psk=noise.derive_psk(old))
            assert (await wire.read_frame(channel))["t"] == "ping"
            channel.close()

        server = await wire.start_server(receiver, "127.0.0.1", 0)
        try:
            channel = await open_channel("127.0.0.1", server.sockets[0].getsockname()[1], token)
            channel.close()
        finally:
            server.close()
            await server.wait_closed()

    for token, expected in ((new, [True, False]), (old, [False, True])):
        checks.clear()
        asyncio.run(handshake_with(token))
        assert checks == expected
