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
their clocks synchronised (NTP, the clouds' own time sources), well inside a period.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from spotguard.peer.wire import parse_address
from spotguard.storage.base import ObjectNotFound, Storage, StorageError, put_bytes

logger = logging.getLogger("spotguard.discovery")

PREFIX = ".spotguard-peers"  # never a step directory: listings, retention and resume ignore it
HEARTBEAT = 30.0  # seconds between rewrites of this daemon's entry
STALE_AFTER = 3  # heartbeat periods without a rewrite before an entry is no candidate
PRUNE_AFTER = 20  # heartbeat periods without a rewrite before a reader deletes the entry
# Where the source address is looked up for a wildcard listen address: the metadata service's
# link-local address is routed through the VM's primary interface on AWS, GCP and Azure alike.
_ROUTE_PROBE = "169.254.169.254"
_WILDCARDS = ("", "0.0.0.0", "::")


@dataclass(frozen=True)
class PeerEntry:
    key: str
    address: str
    heartbeat: float


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

    >>> registry = PeerRegistry(storage, address="10.0.1.7:7140")
    >>> await registry.run()  # registers now, then every heartbeat, until cancelled
    >>> await registry.candidates()
    [('10.0.1.8', 7140)]
    """

    def __init__(
        self,
        storage: Storage,
        *,
        address: str | None = None,
        heartbeat: float = HEARTBEAT,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.storage = storage
        self.address: str | None = None  # None: this daemon only sends, it is nobody's candidate
        self.key: str | None = None
        self.heartbeat = heartbeat
        self.clock = clock
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
        if self.key is None:
            return
        entry = {"address": self.address, "heartbeat": self.clock()}
        put_bytes(self.storage, self.key, json.dumps(entry).encode())

    def unregister(self) -> None:
        """Remove this daemon's entry (blocking): a clean shutdown is no candidate any more."""
        if self.key is not None:
            self.storage.delete([self.key])

    async def run(self) -> None:
        """Keep the entry fresh until cancelled. A failed write is logged and tried again next period:
        an entry that missed a few heartbeats only stops being a candidate for a while."""
        while True:
            try:
                await asyncio.to_thread(self.register)
            except (StorageError, OSError) as exc:
                logger.warning("peer registry: could not write %s: %s", self.key, exc)
            await asyncio.sleep(self.heartbeat)

    async def close(self) -> None:
        try:
            await asyncio.to_thread(self.unregister)
        except (StorageError, OSError) as exc:
            logger.warning("peer registry: could not remove %s: %s", self.key, exc)

    # --- the others --------------------------------------------------------------------------

    async def candidates(self) -> list[tuple[str, int]]:
        """The other daemons with a fresh heartbeat, freshest first (the likeliest to answer)."""
        try:
            entries = await asyncio.to_thread(self.read)
        except (StorageError, OSError) as exc:
            logger.warning("peer registry: could not read %s/: %s; no peer candidates", PREFIX, exc)
            return []
        now = self.clock()
        fresh = [e for e in entries if e.key != self.key and now - e.heartbeat <= STALE_AFTER * self.heartbeat]
        fresh.sort(key=lambda entry: -entry.heartbeat)
        found = []
        for entry in fresh:
            try:
                found.append(parse_address(entry.address))
            except ValueError:
                logger.warning("peer registry: %s holds %r, not HOST:PORT", entry.key, entry.address)
        self.last_seen = [entry.address for entry in fresh]
        return found

    def read(self) -> list[PeerEntry]:
        """Every readable entry (blocking); entries past :data:`PRUNE_AFTER` periods are deleted."""
        listing = [info for info in self.storage.list(f"{PREFIX}/") if info.key.endswith(".json")]
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(listing)))) as pool:
            entries = [entry for entry in pool.map(self._entry, [info.key for info in listing]) if entry is not None]
        now, limit = self.clock(), PRUNE_AFTER * self.heartbeat
        dead = [e.key for e in entries if e.key != self.key and now - e.heartbeat > limit]
        readable = {entry.key for entry in entries}
        # An entry that cannot be read goes by the store's time of its last write instead.
        dead += [
            info.key
            for info in listing
            if info.key not in readable and info.modified is not None and now - info.modified.timestamp() > limit
        ]
        if dead:
            logger.info("peer registry: removing %d entry(ies) not refreshed for long: %s", len(dead), ", ".join(dead))
            self.storage.delete(dead)
        return entries

    def _entry(self, key: str) -> PeerEntry | None:
        try:
            document = json.loads(self.storage.read_bytes(key))
            return PeerEntry(key, str(document["address"]), float(document["heartbeat"]))
        except ObjectNotFound:
            return None  # removed between the listing and the read: a clean shutdown
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("peer registry: %s cannot be read: %s", key, exc)
            return None

    def status(self) -> dict[str, object]:
        return {"advertised": self.address, "candidates": self.last_seen}


__all__ = ["HEARTBEAT", "PREFIX", "PeerEntry", "PeerRegistry", "advertised_address", "own_address"]
