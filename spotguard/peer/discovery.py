"""Peer discovery through the shared bucket (``peers = "bucket"``).

Daemons of one job share one bucket URL, and on a real fleet (an Auto Scaling group, a managed
instance group) every replacement VM comes up with a new address, so a static ``peers`` list goes
stale. Instead each daemon that serves ``peer_listen`` keeps one small object in the bucket::

    <prefix>/.spotguard-peers/<host>-<port>.json   {"address": "10.0.1.7:7140", "heartbeat": 1700000000.0}

``.spotguard-peers`` is never a step directory, so listings, retention, restore and resume never
see it (as ``.spotguard-rate-probe/``). The object is rewritten every ``heartbeat`` seconds and
deleted on a clean shutdown. A sender reads the prefix when it needs a peer: its own entry is
skipped, an entry whose heartbeat is older than :data:`STALE_AFTER` periods is skipped (a VM
preempted without a clean shutdown leaves its entry behind), and one older than
:data:`PRUNE_AFTER` periods is deleted. Heartbeats are wall-clock times of the writer; VMs keep
their clocks synchronised (NTP, the clouds' own time sources), well inside a period. A VM whose clock
the metadata service's ``Date`` header finds off writes and reads them on the cloud's time instead
(spotguard/cloudclock.py): ahead, it neither deletes its live peers' entries as long dead nor writes
its own in their future; behind, it neither refuses theirs as from the future nor is passed over as
stale. Entries are deleted by a clock never later than the VM's own.

Nothing in an entry is trusted as written (docs/security.md):

* each entry is signed: ``"sig"`` is HMAC-SHA256, under a key derived from the job's token
  (spotguard/peer/tokens.py, a label of its own), of the canonical JSON (sorted keys, no spaces) of
  ``{"v": 1, "bucket": <the bucket URL with its prefix>, "key": <the entry's object key>,
  "address": ..., "heartbeat": ...}``. An entry without a valid signature (written without the token,
  or moved to another job's prefix or another key) is ignored. During a token rotation a daemon
  holding the previous token as well signs ``"sig"`` with the previous token's key and adds
  ``"sig_next"`` under the new one's, so that daemons not yet restarted (which check ``"sig"`` with
  the old token) and those already rotated (either field, either of their tokens) all believe it.
  An entry signed under the previous token alone is a daemon not yet restarted: a rotated reader
  dials it with that token first (:data:`spotguard.peer.tokens.PREVIOUS_ONLY`);
* a heartbeat more than :data:`MAX_SKEW` seconds in the future is refused (it would never go stale
  and would always sort first);
* at most :data:`MAX_CANDIDATES` entries are candidates, the freshest;
* an address is dialled only inside the allowed networks, never link-local nor a metadata service
  (spotguard/peer/networks.py); a host name is resolved once, here, and dialled by its address.

An entry refused for any of these reasons is logged once (per entry key and reason), and not dialled.
Entries refused for their signature or heartbeat are pruned by the store's time of their last write,
as unreadable ones are.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import re
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from spotguard.cloudclock import cloud_now, cloud_time
from spotguard.jsontext import parse_json
from spotguard.peer.networks import PeerNetworks
from spotguard.peer.tokens import (
    LEGACY_REGISTRY_KEY_LABEL,
    PREVIOUS_ONLY,
    REGISTRY_KEY_LABEL,
    JobToken,
    PeerToken,
    derive_key,
    hkdf,
)
from spotguard.peer.wire import parse_address
from spotguard.repeats import RepeatedErrors
from spotguard.storage.base import ObjectNotFound, Storage, StorageError, put_bytes

logger = logging.getLogger("spotguard.discovery")

PREFIX = ".spotguard-peers"  # never a step directory: listings, retention and resume ignore it
HEARTBEAT = 30.0  # seconds between rewrites of this daemon's entry
STALE_AFTER = 3  # heartbeat periods without a rewrite before an entry is no candidate
PRUNE_AFTER = 20  # heartbeat periods without a rewrite before a reader deletes the entry
MAX_SKEW = 60.0  # seconds a heartbeat may lie in the reader's future (clock skew between VMs)
WARN_EVERY = 600.0  # seconds between warnings of a write that keeps failing the same way
MAX_CANDIDATES = 16  # entries asked at most, the freshest
ENTRY_VERSION = 1
# Where the source address is looked up for a wildcard listen address: the metadata service's
# link-local address is routed through the VM's primary interface on AWS, GCP and Azure alike.
_ROUTE_PROBE = "169.254.169.254"
_WILDCARDS = ("", "0.0.0.0", "::")


@dataclass(frozen=True)
class PeerEntry:
    key: str
    address: str
    heartbeat: float
    signature: str = ""
    next_signature: str = ""  # during a rotation: under the new token's key ("sig" under the previous)


def signing_key(token: bytes) -> bytes:
    """The key entries are signed with: derived from the job's token's psk, used for nothing else."""
    return derive_key(token, REGISTRY_KEY_LABEL)


def legacy_signing_key(token: bytes) -> bytes:
    """The key entries were signed with before :func:`signing_key`: derived from the token without its
    psk, so that an entry read from the bucket let each guess at the token be checked in microseconds.
    Believed on read (daemons not upgraded yet still sign with it), never written."""
    return hkdf(token, LEGACY_REGISTRY_KEY_LABEL)


def entry_signature(key: bytes, bucket: str, entry_key: str, address: str, heartbeat: float) -> str:
    """HMAC-SHA256 of the entry's canonical JSON: its fields, the bucket (with its prefix) and its key."""
    fields = {"v": ENTRY_VERSION, "bucket": bucket, "key": entry_key, "address": address, "heartbeat": heartbeat}
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    return hmac.new(key, canonical, hashlib.sha256).hexdigest()


def own_address() -> str:
    """This host's address as the job's other VMs reach it: the source address the kernel picks for
    a route to the metadata service (connecting a UDP socket sends nothing), else what the host
    name resolves to."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((_ROUTE_PROBE, 80))
            address = str(probe.getsockname()[0])
        if address != "0.0.0.0":
            return address
    except OSError:
        pass
    return socket.gethostbyname(socket.gethostname())


def advertised_address(listen: str, advertise: str | None, *, lookup: Callable[[], str] = own_address) -> str:
    """What peers are told to connect to: ``advertise`` when set; else ``listen`` (with the port the
    receiver really got) when its host is not a wildcard; else this host's own address."""
    if advertise:
        return advertise
    host, port = parse_address(listen)
    if host not in _WILDCARDS:
        return listen if ":" not in host else f"[{host}]:{port}"
    own = lookup()
    return f"[{own}]:{port}" if ":" in own else f"{own}:{port}"


def entry_name(address: str) -> str:
    """The entry's key under the prefix: host name and port, one per daemon (a VM that replaces
    another of the same name takes over its entry)."""
    port = parse_address(address)[1]
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{socket.gethostname()}-{port}") + ".json"


class PeerRegistry:
    """This daemon's entry under ``.spotguard-peers/`` (when it listens), and the others'.

    >>> registry = PeerRegistry(storage, token=token, networks=networks, address="10.0.1.7:7140")
    >>> await registry.run()  # registers now, then every heartbeat, until cancelled
    >>> await registry.candidates()
    [('10.0.1.8', 7140)]
    """

    def __init__(
        self,
        storage: Storage,
        *,
        token: PeerToken,
        networks: PeerNetworks,
        address: str | None = None,
        heartbeat: float = HEARTBEAT,
        max_candidates: int = MAX_CANDIDATES,
        clock: Callable[[], float] = lambda: cloud_time().timestamp(),
    ) -> None:
        self.storage = storage
        self.address: str | None = None  # None: this daemon only sends, it is nobody's candidate
        self.key: str | None = None
        self.heartbeat = heartbeat
        self.networks = networks
        self.max_candidates = max_candidates
        self.clock = clock
        self._token = JobToken.of(token)
        # Never logged, never in status: the current token's key, then (a rotation) the previous one's.
        self._signing_keys = [signing_key(secret) for secret in self._token.accepted]
        self._legacy_keys = [legacy_signing_key(secret) for secret in self._token.accepted]
        self._reported: dict[str, str] = {}  # entry key -> why it was refused, as last logged
        self.last_seen: list[str] = []  # the candidates of the last look, for status
        if address is not None:
            self.advertise(address)

    def advertise(self, address: str) -> None:
        """This daemon listens, reachable at ``address``: its entry says so (from the next write)."""
        parse_address(address)
        self.address = address
        self.key = f"{PREFIX}/{entry_name(address)}"

    # --- this daemon's entry ---------------------------------------------------------------

    def register(self) -> None:
        """Write (or rewrite) this daemon's entry (blocking)."""
        if self.key is None or self.address is None:
            return
        heartbeat = self.clock()
        url, key, address = self.storage.url, self.key, self.address
        signatures = [entry_signature(signing, url, key, address, heartbeat) for signing in self._signing_keys]
        entry: dict[str, object] = {"address": self.address, "heartbeat": heartbeat, "sig": signatures[-1]}
        if len(signatures) > 1:  # a rotation: "sig" for the daemons not yet restarted, this for the others
            entry["sig_next"] = signatures[0]
        put_bytes(self.storage, self.key, json.dumps(entry).encode())

    def unregister(self) -> None:
        """Remove this daemon's entry (blocking): a clean shutdown is no candidate any more."""
        if self.key is not None:
            self.storage.delete([self.key])

    async def run(self) -> None:
        """Keep the entry fresh until cancelled. A failed write is tried again next period: an entry
        that missed a few heartbeats only stops being a candidate for a while. A write that keeps
        failing (a full disk under the scratch file, a bucket that refuses) is logged when its kind of
        error first comes or changes and every :data:`WARN_EVERY` seconds after, not at every
        heartbeat (2,880 lines a day), and once when a write succeeds again."""
        warnings = RepeatedErrors(WARN_EVERY)
        while True:
            try:
                await asyncio.to_thread(self.register)
            except (StorageError, OSError) as exc:
                # Its kind, not its text: the text names a fresh scratch file or request every time.
                if warnings.due("write", f"{type(exc).__name__} {getattr(exc, 'errno', None)}"):
                    logger.warning("peer registry: could not write %s: %s", self.key, exc)
            else:
                if warnings.clear("write"):
                    logger.info("peer registry: %s written again", self.key)
            await asyncio.sleep(self.heartbeat)

    async def close(self) -> None:
        try:
            await asyncio.to_thread(self.unregister)
        except (StorageError, OSError) as exc:
            logger.warning("peer registry: could not remove %s: %s", self.key, exc)

    # --- the others --------------------------------------------------------------------------

    async def candidates(self) -> list[tuple[str, int]]:
        """The other daemons with a fresh, signed heartbeat on an allowed network: at most
        ``max_candidates``, freshest first (the likeliest to answer), each as the address to dial."""
        try:
            entries = await asyncio.to_thread(self.read)
        except (StorageError, OSError) as exc:
            logger.warning("peer registry: could not read %s/: %s; no peer candidates", PREFIX, exc)
            return []
        now = self.clock()
        fresh: list[tuple[PeerEntry, bytes]] = []
        for entry, signer in entries:
            if entry.key == self.key:
                continue
            why = self.refusal(entry, signer, now)
            if why is None:
                assert signer is not None
                fresh.append((entry, signer))
            else:
                self._report(entry.key, why)
        fresh.sort(key=lambda signed: -signed[0].heartbeat)
        found = await asyncio.to_thread(self._dialable, fresh)
        self.last_seen = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}" for host, port in found]
        return found

    def refusal(self, entry: PeerEntry, signer: bytes | None, now: float) -> str | None:
        """Why ``entry`` (signed with ``signer``, :meth:`read`) is no candidate (its signature, its
        heartbeat), or None."""
        if signer is None:
            return "not signed with the job's token (forged, or moved from another job or key): ignored"
        if entry.heartbeat > now + MAX_SKEW:
            return f"its heartbeat is more than {MAX_SKEW:.0f} s in the future: ignored"
        if now - entry.heartbeat > STALE_AFTER * self.heartbeat:
            return f"not refreshed for {STALE_AFTER} heartbeats: stale, not asked"
        return None

    def _signer(self, entry: PeerEntry) -> bytes | None:
        """Which of this daemon's tokens signed ``entry`` (the current one if both did), or None."""
        given = [sig for sig in (entry.signature, entry.next_signature) if sig]
        for keys in (self._signing_keys, self._legacy_keys):
            for key, token in zip(keys, self._token.accepted, strict=True):
                expected = entry_signature(key, self.storage.url, entry.key, entry.address, entry.heartbeat)
                if any(hmac.compare_digest(expected, sig) for sig in given):
                    return token
        return None

    def _dialable(self, entries: list[tuple[PeerEntry, bytes]]) -> list[tuple[str, int]]:
        """The first ``max_candidates`` entries (each with the token that signed it) whose address may
        be dialled, resolved (blocking)."""
        found: list[tuple[str, int]] = []
        for entry, signer in entries:
            if len(found) >= self.max_candidates:
                break
            try:
                host, port = parse_address(entry.address)
            except ValueError:
                self._report(entry.key, f"holds {entry.address!r}, not HOST:PORT")
                continue
            dial, why = self.networks.resolve(host, port)
            if dial is None:
                self._report(entry.key, f"{entry.address}: {why}")
                continue
            self._reported.pop(entry.key, None)  # refused before, fine now: a later refusal is news
            # Signed under the previous token alone: a daemon not yet restarted, asked with that one first.
            PREVIOUS_ONLY.learn(dial, port, self._token, previous_only=signer != self._token.current)
            found.append((dial, port))
        return found

    def _report(self, key: str, why: str) -> None:
        """Log a refused entry once per key and reason (a reader looks again on every notice)."""
        if self._reported.get(key) != why:
            self._reported[key] = why
            logger.warning("peer registry: %s %s", key, why)

    def read(self) -> list[tuple[PeerEntry, bytes | None]]:
        """Every readable entry, each with the token of this daemon's that signed it (None: none did),
        checked once here (blocking); entries past :data:`PRUNE_AFTER` periods are deleted."""
        listing = [info for info in self.storage.list(f"{PREFIX}/") if info.key.endswith(".json")]
        # What was logged of an entry goes with the entry: over months of spot VMs coming and going
        # (each one leaving an entry that goes stale, then is deleted) it grew by one per VM.
        listed = {info.key for info in listing}
        self._reported = {key: why for key, why in self._reported.items() if key in listed}
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(listing)))) as pool:
            read = [entry for entry in pool.map(self._entry, [info.key for info in listing]) if entry is not None]
        entries = [(entry, self._signer(entry)) for entry in read]
        # What is deleted is aged on a clock never later than this VM's own: a metadata Date header
        # from the future must not make every live peer's entry look long dead (cloudclock).
        now, limit = min(self.clock(), cloud_now().timestamp()), PRUNE_AFTER * self.heartbeat
        # A signed entry ages by its heartbeat; any other (unreadable, unsigned, a heartbeat in the
        # future) by the store's time of its last write: a forged heartbeat must not keep it forever.
        trusted = {e.key: e for e, signer in entries if signer is not None and e.heartbeat <= now + MAX_SKEW}
        dead = [key for key, e in trusted.items() if key != self.key and now - e.heartbeat > limit]
        dead += [
            info.key
            for info in listing
            if info.key not in trusted and info.modified is not None and now - info.modified.timestamp() > limit
        ]
        if dead:
            logger.info("peer registry: removing %d entry(ies) not refreshed for long: %s", len(dead), ", ".join(dead))
            self.storage.delete(dead)
        return entries

    def _entry(self, key: str) -> PeerEntry | None:
        try:
            document = parse_json(self.storage.read_bytes(key))
            address, heartbeat = str(document["address"]), float(document["heartbeat"])
            return PeerEntry(key, address, heartbeat, str(document.get("sig", "")), str(document.get("sig_next", "")))
        except ObjectNotFound:
            return None  # removed between the listing and the read: a clean shutdown
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            self._report(key, f"cannot be read: {exc}")
            return None

    def status(self) -> dict[str, object]:
        return {"advertised": self.address, "candidates": self.last_seen}


__all__ = [
    "HEARTBEAT", "MAX_CANDIDATES", "MAX_SKEW", "PREFIX", "PeerEntry", "PeerRegistry", "advertised_address",
    "entry_signature", "legacy_signing_key", "own_address", "signing_key",
]  # fmt: skip
