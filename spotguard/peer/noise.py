"""Noise_NNpsk0_25519_AESGCM_SHA256, from the Noise Protocol Framework (revision 34), for the peer channel.

Only what this one pattern needs::

    NNpsk0:
      -> psk, e
      <- e, ee

The initiator (the daemon that connects) and the responder (the receiver) share a 32-byte ``psk``
derived from the job's token (:func:`derive_psk`); neither has a static key. After the two
messages :meth:`HandshakeState.split` gives one :class:`CipherState` per direction, whose
``nonce`` is a counter: a record changed, replayed, reordered, dropped or injected fails to
decrypt. AES-GCM was chosen over ChaCha20-Poly1305 by measured speed (bench/peer_channel.py).
The wire around these messages (framing, the greeting, records) is spotguard/peer/channel.py's;
docs/peer-protocol.md has the whole protocol and a test vector.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from spotguard.errors import SpotguardError
from spotguard.peer.tokens import PSK_LABEL, derive_psk

PROTOCOL_NAME = b"Noise_NNpsk0_25519_AESGCM_SHA256"
DHLEN = 32
HASHLEN = 32
TAGLEN = 16
MAX_MESSAGE = 65535  # Noise's limit on any message, tag included
_MAX_NONCE = (1 << 64) - 1  # reserved by the spec: never used
_NONCE = struct.Struct(">4xQ")  # AESGCM: 32 zero bits, then the counter big-endian


class NoiseError(SpotguardError):
    """A handshake or transport message that fails (authentication, length, order)."""


def _hkdf(chaining_key: bytes, material: bytes, outputs: int) -> list[bytes]:
    temp = hmac.digest(chaining_key, material, "sha256")
    out, previous = [], b""
    for i in range(1, outputs + 1):
        previous = hmac.digest(temp, previous + bytes([i]), "sha256")
        out.append(previous)
    return out


class CipherState:
    """A key and its counter: every message takes the next nonce."""

    def __init__(self, key: bytes | None = None, n: int = 0) -> None:
        self.key = key  # a connection's bulk bytes may be sealed in a worker process: it gets key and n
        self._aead = AESGCM(key) if key is not None else None
        self.n = n

    @property
    def has_key(self) -> bool:
        return self._aead is not None

    def _nonce(self) -> bytes:
        if self.n >= _MAX_NONCE:
            raise NoiseError("this channel's counter is exhausted")
        nonce = _NONCE.pack(self.n)
        self.n += 1
        return nonce

    def encrypt(self, ad: bytes, plaintext: bytes | memoryview) -> bytes:
        if self._aead is None:
            return bytes(plaintext)
        return self._aead.encrypt(self._nonce(), plaintext, ad or None)

    def encrypt_into(self, plaintext: bytes | memoryview, out: memoryview) -> None:
        """A transport message (no associated data) into ``out`` (``len(plaintext) + TAGLEN`` bytes)."""
        assert self._aead is not None
        self._aead.encrypt_into(self._nonce(), plaintext, None, out)

    def decrypt(self, ad: bytes, ciphertext: bytes | memoryview) -> bytes:
        if self._aead is None:
            return bytes(ciphertext)
        try:
            return self._aead.decrypt(self._nonce(), ciphertext, ad or None)
        except InvalidTag:
            raise NoiseError("a message that fails authentication") from None

    def decrypt_into(self, ciphertext: memoryview, out: memoryview) -> None:
        """A transport message's plaintext into ``out`` (``len(ciphertext) - TAGLEN`` bytes)."""
        assert self._aead is not None
        try:
            self._aead.decrypt_into(self._nonce(), ciphertext, None, out)
        except InvalidTag:
            raise NoiseError("a record that fails authentication (changed, replayed, reordered or forged)") from None


class SymmetricState:
    def __init__(self, protocol_name: bytes) -> None:
        if len(protocol_name) <= HASHLEN:
            self.h = protocol_name.ljust(HASHLEN, b"\0")
        else:
            self.h = hashlib.sha256(protocol_name).digest()
        self.ck = self.h
        self.cipher = CipherState()

    def mix_key(self, material: bytes) -> None:
        self.ck, key = _hkdf(self.ck, material, 2)
        self.cipher = CipherState(key)

    def mix_hash(self, data: bytes) -> None:
        self.h = hashlib.sha256(self.h + data).digest()

    def mix_key_and_hash(self, material: bytes) -> None:
        self.ck, temp_h, key = _hkdf(self.ck, material, 3)
        self.mix_hash(temp_h)
        self.cipher = CipherState(key)

    def encrypt_and_hash(self, plaintext: bytes) -> bytes:
        ciphertext = self.cipher.encrypt(self.h, plaintext)
        self.mix_hash(ciphertext)
        return ciphertext

    def decrypt_and_hash(self, ciphertext: bytes) -> bytes:
        plaintext = self.cipher.decrypt(self.h, ciphertext)
        self.mix_hash(ciphertext)
        return plaintext

    def split(self) -> tuple[CipherState, CipherState]:
        first, second = _hkdf(self.ck, b"", 2)
        return CipherState(first), CipherState(second)


def _public(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes_raw()


class HandshakeState:
    """One side of an NNpsk0 handshake: the initiator writes message 1 and reads message 2; the responder
    the other way round. ``ephemeral`` is for test vectors only (a fresh key otherwise)."""

    def __init__(
        self, *, initiator: bool, psk: bytes, prologue: bytes, ephemeral: X25519PrivateKey | None = None
    ) -> None:
        if len(psk) != 32:
            raise ValueError("a Noise psk is 32 bytes")
        self.initiator = initiator
        self._psk = psk
        self._e = ephemeral or X25519PrivateKey.generate()
        self._re: bytes | None = None
        self._step = 0
        self.symmetric = SymmetricState(PROTOCOL_NAME)
        self.symmetric.mix_hash(prologue)

    def _advance(self, step: int, role_ok: bool) -> None:
        if self._step != step or not role_ok:
            raise NoiseError("a handshake message out of order")
        self._step += 1

    def _mix_e(self, public: bytes) -> None:
        self.symmetric.mix_hash(public)
        self.symmetric.mix_key(public)  # psk handshakes mix e into the key as well

    def write_message(self, payload: bytes = b"") -> bytes:
        """Message 1 (``-> psk, e``) from the initiator, message 2 (``<- e, ee``) from the responder."""
        ours = _public(self._e)
        if self.initiator:
            self._advance(0, True)
            self.symmetric.mix_key_and_hash(self._psk)
            self._mix_e(ours)
        else:
            self._advance(1, self._re is not None)
            self._mix_e(ours)
            self.symmetric.mix_key(self._dh())
        return ours + self.symmetric.encrypt_and_hash(payload)

    def read_message(self, message: bytes) -> bytes:
        """The other side's message; its payload. :class:`NoiseError` if it fails."""
        if not DHLEN + TAGLEN <= len(message) <= MAX_MESSAGE:
            raise NoiseError(f"a handshake message of {len(message)} bytes")
        self._re = message[:DHLEN]
        if self.initiator:
            self._advance(1, True)
            self._mix_e(self._re)
            self.symmetric.mix_key(self._dh())
        else:
            self._advance(0, True)
            self.symmetric.mix_key_and_hash(self._psk)
            self._mix_e(self._re)
        return self.symmetric.decrypt_and_hash(message[DHLEN:])

    def _dh(self) -> bytes:
        assert self._re is not None
        try:
            return self._e.exchange(X25519PublicKey.from_public_bytes(self._re))
        except ValueError:  # a low-order point: an all-zero shared secret
            raise NoiseError("a handshake with an invalid ephemeral key") from None

    def split(self) -> tuple[CipherState, CipherState]:
        """(sending, receiving) for this side, once both messages went."""
        if self._step != 2:
            raise NoiseError("the handshake is not finished")
        first, second = self.symmetric.split()
        return (first, second) if self.initiator else (second, first)

    @property
    def handshake_hash(self) -> bytes:
        return self.symmetric.h


__all__ = [
    "DHLEN",
    "MAX_MESSAGE",
    "PROTOCOL_NAME",
    "PSK_LABEL",
    "TAGLEN",
    "CipherState",
    "HandshakeState",
    "NoiseError",
    "SymmetricState",
    "derive_psk",
]
