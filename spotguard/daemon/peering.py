"""The daemon's peer tier: the receiver peers hand checkpoints to, the registry in the bucket, the
handoff of the urgent checkpoint to a peer, and a resume from a peer's replica."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spotguard import protocol
from spotguard.config import DaemonConfig
from spotguard.daemon.plan import Plan, Route
from spotguard.daemon.server import Reply
from spotguard.localstore import scan_local
from spotguard.notice import Notice
from spotguard.peer.admission import ReplicaLimits
from spotguard.peer.discovery import PREFIX as DISCOVERY_PREFIX
from spotguard.peer.discovery import PeerRegistry, advertised_address
from spotguard.peer.fetch import PeerResume, resume_from_peers
from spotguard.peer.fetch import attach as attach_peer_fetch
from spotguard.peer.handoff import Handoff, HandoffState
from spotguard.peer.receiver import PeerReceiver, ReceiverLimits
from spotguard.peer.replicas import AREA as PEER_AREA
from spotguard.peer.tokens import JobToken
from spotguard.peer.wire import parse_address, token_fingerprint
from spotguard.storage.base import Storage, StorageError
from spotguard.storage.checkpoints import list_remote

logger = logging.getLogger("spotguard.daemon")


class Peering:
    """Wires the peer tier for one daemon; ``submit`` queues a fetched checkpoint for upload."""

    def __init__(
        self,
        config: DaemonConfig,
        *,
        storage: Storage | None,
        root: Path,
        token: JobToken | None,
        submit: Callable[[Path], None],
    ) -> None:
        self.config = config
        self.storage = storage
        self.root = root
        self._token = token  # the job's shared secret: never logged, never in status
        self._submit = submit
        self.receiver: PeerReceiver | None = None
        self.handoff: Handoff | None = None  # the peer route: hands the urgent checkpoint to a peer
        # peers = "bucket": the peers register under the bucket's .spotguard-peers/ (and so does this one).
        self.registry: PeerRegistry | None = None
        self._registry_task: asyncio.Task[None] | None = None
        self._resume_lock = asyncio.Lock()
        if config.peer_discovery and token is not None and storage is not None:
            self.registry = PeerRegistry(storage, token=token, networks=config.peer_network_policy())
        if config.peers and token is not None and config.bucket is not None:
            timeout, flows = config.peer_io_timeout, config.peer_max_flows
            self.handoff = Handoff(self.candidates, token, config.bucket, io_timeout=timeout, max_flows=flows)

    async def start_receiver(self, busy: Callable[[], bool]) -> None:
        """Listen for peers' checkpoints (``busy``: a hard notice is pending here), and register in the bucket."""
        if not self.config.peer_listen or self._token is None:
            return
        host, port = parse_address(self.config.peer_listen)
        receiver = PeerReceiver(
            self.root / PEER_AREA,
            self.storage,
            token=self._token,
            host=host,
            port=port,
            busy=busy,
            limits=ReceiverLimits(
                replicas=ReplicaLimits(
                    max_replicas=self.config.peer_max_replicas, max_replica_bytes=self.config.peer_max_replica_bytes
                ),
                concurrency=self.config.upload_concurrency,
                io_timeout=self.config.peer_io_timeout,
            ),
        )
        try:
            await receiver.start()
        except OSError as exc:
            logger.error(
                "peers: cannot listen on %s: %s; running without the peer receiver", self.config.peer_listen, exc
            )
            return
        attach_peer_fetch(receiver)  # a replacement VM may fetch a replica back to resume from it
        self.receiver = receiver
        if self.handoff is not None:
            self.handoff.own_instance = receiver.instance  # a peers list naming this VM: passed over
        if self.registry is not None and receiver.address is not None:
            try:
                address = await asyncio.to_thread(advertised_address, receiver.address, self.config.peer_advertise)
            except OSError as exc:  # no route and a host name that does not resolve
                logger.error("peers: cannot tell this host's address (%s); set peer_advertise. Not registering", exc)
                return
            self.registry.advertise(address)
            logger.info("peers: registering %s under %s/", address, DISCOVERY_PREFIX)
            self._registry_task = asyncio.create_task(self.registry.run(), name="peer-registry")

    async def candidates(self) -> list[tuple[str, int]]:
        if self.registry is not None:
            return await self.registry.candidates()
        return self.config.peer_addresses()

    def can_resume(self) -> bool:
        return bool(self.config.peers) and self._token is not None and self.storage is not None

    async def resume(self, message: dict[str, Any]) -> Reply:
        """Fetch the newest verified checkpoint of this bucket a peer holds, if it is newer than
        every complete one here and in the bucket (consistency rule: spotguard/daemon/peerfetch.py)."""
        after = message["after"]
        if not self.can_resume():
            return "peer-resume", {"after": after, "path": None, "not_fetched": []}
        assert self.storage is not None and self._token is not None
        storage, token = self.storage, self._token

        async def ask() -> PeerResume:
            newest = max(after, await asyncio.to_thread(self._newest_complete))
            fetch = message.get("fetch") is not False  # false: a multi-node job, only told what is newer
            peers = await self.candidates()  # the listed ones, or those found in the bucket
            return await resume_from_peers(
                peers,
                token,
                storage.url,
                self.root,
                newest,
                fetch=fetch,
                io_timeout=self.config.peer_io_timeout,
                max_flows=self.config.peer_max_flows,
            )

        async with self._resume_lock:  # two ranks' hooks asking at once fetch once
            try:
                found = await asyncio.wait_for(ask(), protocol.PEER_RESUME_TIMEOUT)
            except TimeoutError:
                logger.warning("peers: nothing fetched in %.0f s; resuming without them", protocol.PEER_RESUME_TIMEOUT)
                found = PeerResume(after=after)
        after = found.after
        for where in found.not_fetched:
            logger.warning(
                "peers: %s is newer than step %d but not fetched (a node's share, or a multi-node job)", where, after
            )
        fields: dict[str, Any] = {"after": after, "path": None, "not_fetched": found.not_fetched}
        if found.path is not None and found.offer is not None:
            self._submit(found.path)  # the same bytes as the peer's: either commit counts
            peer = found.offer.peer
            fields.update(path=str(found.path), step=found.offer.step, peer=f"{peer[0]}:{peer[1]}")
        return "peer-resume", fields

    def _newest_complete(self) -> int:
        """The newest complete checkpoint's step, here or in the bucket (-1: none anywhere)."""
        steps = [info.step for info in scan_local(self.root) if info.status == "complete"]
        if self.storage is not None:
            try:
                steps += [info.step for info in list_remote(self.storage) if info.status == "complete"]
            except (StorageError, OSError) as exc:
                logger.warning(
                    "peers: cannot list %s (%s): comparing with the local checkpoints only", self.storage.url, exc
                )
        return max(steps, default=-1)

    def available(self) -> bool:
        return self.handoff is not None and self.handoff.state is not HandoffState.FAILED

    def follow_plan(self, notice: Notice, plan: Plan) -> None:
        if plan.route is Route.PEER and self.handoff is not None:
            self.handoff.start(expected_bytes=plan.bytes, deadline=notice.monotonic_deadline)

    def status(self) -> dict[str, Any] | None:
        if not (self.config.peer_listen or self.config.peers):
            return None
        receiver = self.receiver.status() if self.receiver is not None else {"listen": None}
        listed = [f"{host}:{port}" for host, port in self.config.peer_addresses()]
        token, previous = (None, None) if self._token is None else (self._token.current, self._token.previous)
        return {
            "peers": self.registry.last_seen if self.registry is not None else listed,
            "discovery": None if self.registry is None else self.registry.status(),
            **receiver,
            "handoff": None if self.handoff is None else self.handoff.status(),
            # Which token this daemon uses, and accepts besides it during a rotation: fingerprints that
            # tell tokens apart across the fleet (every VM rotated?) and say nothing to rebuild one.
            "token": None if token is None else token_fingerprint(token),
            "previous_token": None if previous is None else token_fingerprint(previous),
        }

    async def stop_registry(self) -> None:
        """No candidate any more (the heartbeat first, or it could write the entry again)."""
        if self._registry_task is not None and self.registry is not None:
            self._registry_task.cancel("daemon shutting down")
            await asyncio.gather(self._registry_task, return_exceptions=True)
            await self.registry.close()

    async def close(self) -> None:
        if self.receiver is not None:
            await self.receiver.close()
        if self.handoff is not None:
            await self.handoff.close()
