"""The job's peer token: making one, telling a weak one, and the keys derived from it. Stdlib only.

The token is the job's one shared secret (``SPOTGUARD_PEER_TOKEN`` or ``peer_token_file``). Everything
derived from it goes through its psk, a memory-hard scrypt of it (:func:`derive_psk`, computed once
per token and process): the channel's handshake mixes the psk in, each other use gets its own key,
HKDF-SHA256 (RFC 5869) of the psk under a fixed label, and the fingerprint that status and metrics
show is a hash of the psk. So whatever of them someone sees (a recorded handshake, a registry entry
read from the bucket, a fingerprint on a metrics page) costs a scrypt per guess at the token, ~30-100 ms
and 16 MiB, and a key learnt from one use says nothing about another's.

``spotguard peer-token`` prints a fresh token: 32 random bytes from :mod:`secrets`, hex (64 characters).
A configured token that is weaker is still used (a fleet must not stop on a warning), but the daemon
logs a warning at start and ``spotguard doctor`` warns; :func:`token_weakness` says why. Its
heuristic is deliberately simple:

* shorter than :data:`STRONG_TOKEN_BYTES` (32) bytes;
* fewer than :data:`MIN_DISTINCT` (10) distinct characters (``aaaa…``, ``abab…``, a long run of one digit);
* all of one class: only digits, only lower-case letters, or only upper-case letters (a word, a number);
* a short unit repeated (``changeme-changeme-…``, ``0123456789`` twice and more).

It cannot tell a guessable phrase of many characters from a random one: a token from
``spotguard peer-token`` (or ``openssl rand -hex 32``) is the advice either way.

**Rotation.** While a fleet moves to a new token, a daemon may also hold the one it replaces
(``SPOTGUARD_PEER_TOKEN_PREVIOUS`` or ``peer_token_previous_file``): a :class:`JobToken`. It opens
connections with the new token, and where a peer refuses it connects again with the previous one;
it accepts connections and registry entries made with either, and signs its own entry under both.
So a rolling restart keeps every pair of VMs peers, old and new alike (docs/security.md). Peers known
to hold the previous token alone (a registry entry signed under it only, or a refusal of the new
one) are asked with it first: :data:`PREVIOUS_ONLY`.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets
import threading
from dataclasses import dataclass
from typing import TypeAlias

STRONG_TOKEN_BYTES = 32
MIN_DISTINCT = 10
# The psk's scrypt: salt and cost (16 MiB of memory a guess).
PSK_LABEL = b"spotguard-peer/2 psk"
_SCRYPT = {"n": 1 << 14, "r": 8, "p": 1}
# HKDF's info for the key that signs the peer registry's entries (spotguard/peer/discovery.py), and
# the one entries were signed under before it was derived from the psk (read, never written: a fleet
# upgraded VM by VM still believes the entries of VMs not upgraded yet). Never used for anything else.
REGISTRY_KEY_LABEL = b"spotguard peer registry entry signing v2"
LEGACY_REGISTRY_KEY_LABEL = b"spotguard peer registry entry signing v1"
_SALT = b"spotguard-peer-token-kdf"
_FINGERPRINT_LABEL = b"spotguard-peer-token|"


@dataclass(frozen=True, repr=False)
class JobToken:
    """The job's token (``current``) and, while the fleet is rotated to it, the one it replaces
    (``previous``: None when there is no rotation, the same token given twice included)."""

    current: bytes
    previous: bytes | None = None

    def __post_init__(self) -> None:
        if self.previous == self.current:
            object.__setattr__(self, "previous", None)

    @classmethod
    def of(cls, token: PeerToken) -> JobToken:
        return token if isinstance(token, JobToken) else cls(token)

    @property
    def accepted(self) -> tuple[bytes, ...]:
        """Every token a peer may prove, the current one first."""
        return (self.current,) if self.previous is None else (self.current, self.previous)

    def __repr__(self) -> str:
        return f"JobToken(<{len(self.accepted)} hidden>)"  # never the secret, not even in a traceback


#: What the peer tier's functions take: the job's token, or a :class:`JobToken` during a rotation.
PeerToken: TypeAlias = "bytes | JobToken"


class PreviousOnlyPeers:
    """The receivers known, during a rotation, to take only the previous token (by host and port), so
    that a connection to them offers it first instead of being refused with the new one: a daemon
    not yet restarted would log each such refusal, and a handoff's flows would each pay a round trip.

    Learnt where it shows: a registry entry signed under the previous token alone
    (spotguard/peer/discovery.py), or a receiver that refused the new token and took the previous one
    (spotguard/peer/handshake.py). Unlearnt as simply: an entry signed under the new token, or a
    receiver that took it. Kept per current token, so a later rotation starts afresh; bounded."""

    def __init__(self, bound: int = 256) -> None:
        self.bound = bound
        self._current_at: dict[tuple[str, int], bytes] = {}  # (host, port) -> the current token then
        self._lock = threading.Lock()  # learnt on the event loop (handshakes) and in a thread (the registry)

    def first(self, host: str, port: int, token: JobToken) -> bool:
        """Whether ``host:port`` is to be asked with ``token.previous`` first."""
        with self._lock:
            return token.previous is not None and self._current_at.get((host, port)) == token.current

    def learn(self, host: str, port: int, token: JobToken, *, previous_only: bool) -> None:
        if token.previous is None:
            return
        where = (host, port)
        with self._lock:
            self._current_at.pop(where, None)
            if previous_only:
                self._current_at[where] = token.current
                while len(self._current_at) > self.bound:
                    del self._current_at[next(iter(self._current_at))]

    def clear(self) -> None:
        with self._lock:
            self._current_at.clear()


#: This process's :class:`PreviousOnlyPeers`: discovery learns what the handshake then uses.
PREVIOUS_ONLY = PreviousOnlyPeers()


def new_token() -> str:
    """A fresh job token: 32 random bytes, hex."""
    return secrets.token_hex(STRONG_TOKEN_BYTES)


@functools.lru_cache(maxsize=8)
def derive_psk(token: bytes) -> bytes:
    """The channel's 32-byte psk: ``scrypt(token, salt="spotguard-peer/2 psk", n=2^14, r=8, p=1)``."""
    return hashlib.scrypt(token, salt=PSK_LABEL, dklen=32, **_SCRYPT)


def derive_key(token: bytes, label: bytes, length: int = 32) -> bytes:
    """HKDF-SHA256 (RFC 5869) of ``token``'s psk: extract with a fixed salt, expand under ``label``."""
    return hkdf(derive_psk(token), label, length)


def hkdf(secret: bytes, label: bytes, length: int = 32) -> bytes:
    """HKDF-SHA256 of ``secret`` itself: extract with a fixed salt, expand under ``label``. Only
    :func:`derive_key`, and the legacy registry key (derived from the token without its psk)."""
    prk = hmac.new(_SALT, secret, hashlib.sha256).digest()
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + label + bytes([counter]), hashlib.sha256).digest()
        out += block
        counter += 1
    return out[:length]


def token_fingerprint(token: bytes) -> str:
    """What logs, status and metrics may say about a token: 8 hex digits of a hash of its psk, enough
    to tell two apart, and each guess at the token checked against it costs a scrypt."""
    return hashlib.sha256(_FINGERPRINT_LABEL + derive_psk(token)).hexdigest()[:8]


def token_weakness(token: bytes) -> str | None:
    """Why ``token`` is weak (see the module's heuristic), or None."""
    text = token.decode("utf-8", "replace")
    if len(token) < STRONG_TOKEN_BYTES:
        return f"it is {len(token)} bytes, shorter than {STRONG_TOKEN_BYTES}"
    if len(set(text)) < MIN_DISTINCT:
        return f"it has only {len(set(text))} distinct characters"
    if text.isdigit() or (text.isalpha() and (text.islower() or text.isupper())):
        return "it is all of one class of characters"
    for unit in range(1, len(text) // 2 + 1):
        if (text[:unit] * (len(text) // unit + 1))[: len(text)] == text:
            return f"it repeats {unit} character(s) over and over"
    return None


__all__ = [
    "LEGACY_REGISTRY_KEY_LABEL",
    "MIN_DISTINCT",
    "PSK_LABEL",
    "REGISTRY_KEY_LABEL",
    "STRONG_TOKEN_BYTES",
    "PREVIOUS_ONLY",
    "JobToken",
    "PeerToken",
    "PreviousOnlyPeers",
    "derive_key",
    "derive_psk",
    "hkdf",
    "new_token",
    "token_fingerprint",
    "token_weakness",
]
