"""The sending side of the peer tier: on a notice routed to ``peer``, hand the urgent checkpoint over.

While a notice is pending the daemon tells :class:`Handoff` of every file the trainer finishes
(``file`` messages) and of the commit (``saved``). Once the plan's route is ``peer`` a task picks
the first configured peer that answers, shares the bucket and has no hard notice of its own, opens a
replica for the newest checkpoint announced, sends each finished file as soon as it is there (the
bucket upload runs alongside), and after the trainer's commit sends whatever the manifest lists that
was not sent yet, then the manifest. The peer checks every file against it and commits the
checkpoint in the bucket; the handoff is ``handed`` once the peer answered ``verified``.

A sender that dies mid-stream leaves nothing on the peer that counts (the peer drops a replica whose
connection ends before its manifest), so there is nothing to clean up here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from enum import StrEnum
from pathlib import Path
from typing import Any

from spotguard import peerwire
from spotguard.daemon.peers import PeerClient, choose_peer
from spotguard.manifest import FileEntry, ManifestError, node_holdings, parse_step_dir

logger = logging.getLogger("spotguard.handoff")

_KEEPALIVE = 10.0  # seconds without a file to send before a ping (the receiver's idle limit is 30 s)


class HandoffState(StrEnum):
    IDLE = "idle"
    CHOOSING = "choosing"
    SENDING = "sending"
    HANDED = "handed"  # the peer holds a verified replica and commits it in the bucket
    FAILED = "failed"


Candidates = Callable[[], Awaitable[list[tuple[str, int]]]]  # the peers to ask, preferred first


class Handoff:
    def __init__(self, candidates: Candidates, token: bytes, bucket: str) -> None:
        self._candidates = candidates  # asked at each handoff: with discovery, the fleet changes
        self._token = token
        self.bucket = bucket
        self.state = HandoffState.IDLE
        self.peer: str | None = None
        self.name: str | None = None
        self.bytes_sent = 0
        self.seconds: float | None = None
        self.error: str | None = None
        self._announced: dict[str, tuple[Path, dict[str, FileEntry]]] = {}  # step name -> (dir, files)
        self._saved: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # --- what the daemon tells it -------------------------------------------------------

    def file_ready(self, step_dir: Path, rel: str, entry: FileEntry) -> None:
        self._announced.setdefault(step_dir.name, (step_dir, {}))[1][rel] = entry
        self._wake.set()

    def saved(self, step_dir: Path) -> None:
        self._announced.setdefault(step_dir.name, (step_dir, {}))
        self._saved.add(step_dir.name)
        self._wake.set()

    def start(self) -> None:
        """The route is ``peer``: start handing over (once per notice)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="peer-handoff")

    def reset(self) -> None:
        """The notice is over: forget what it announced (a handoff in flight goes on to its end)."""
        if self._task is None or self._task.done():
            self._task = None
            self._announced.clear()
            self._saved.clear()
            self.state = HandoffState.IDLE

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel("daemon shutting down")
            await asyncio.gather(self._task, return_exceptions=True)

    def _move(self, state: HandoffState, why: str) -> None:
        logger.warning(
            "peer handoff of %s to %s: %s -> %s (%s)", self.name or "-", self.peer or "-", self.state, state, why
        )
        self.state = state

    # --- the handover -----------------------------------------------------------------------

    async def _run(self) -> None:
        started = time.monotonic()
        addresses = await self._candidates()
        self._move(HandoffState.CHOOSING, f"asking {len(addresses)} peer(s)")
        client = await choose_peer(addresses, self._token, self.bucket)
        if client is None:
            self.error = "no peer answered with the same bucket and no hard notice of its own"
            self._move(HandoffState.FAILED, self.error)
            return
        self.peer = client.address
        try:
            await self._send(client)
            self.seconds = time.monotonic() - started
            self._move(HandoffState.HANDED, f"{self.bytes_sent} bytes verified by the peer in {self.seconds:.1f} s")
        except (OSError, TimeoutError, peerwire.PeerError, ManifestError) as exc:
            self.error = str(exc)
            self._move(HandoffState.FAILED, self.error)
        finally:
            await client.close()

    async def _send(self, client: PeerClient) -> None:
        sent: set[str] = set()
        while True:
            self._wake.clear()
            if self.name is None and self._announced:
                self.name = max(self._announced, key=lambda name: parse_step_dir(name) or 0)
                await client.open_replica(self.name, self.bucket)
                self._move(HandoffState.SENDING, f"replica of {self.name} opened")
            if self.name is not None:
                step_dir, files = self._announced[self.name]
                for rel in [rel for rel in files if rel not in sent]:
                    self.bytes_sent += await client.send_file(step_dir / rel, rel)
                    sent.add(rel)
                if self.name in self._saved:
                    listed = await asyncio.to_thread(_committed_files, step_dir)
                    for rel in sorted(set(listed) - sent):  # files never announced
                        self.bytes_sent += await client.send_file(step_dir / rel, rel)
                        sent.add(rel)
                    await client.commit(step_dir)
                    return
            try:
                await asyncio.wait_for(self._wake.wait(), _KEEPALIVE)
            except TimeoutError:
                await client.ping()  # a big file takes long to write; the peer drops idle connections

    def status(self) -> dict[str, Any]:
        return {
            "state": str(self.state),
            "peer": self.peer,
            "name": self.name,
            "bytes_sent": self.bytes_sent,
            "seconds": None if self.seconds is None else round(self.seconds, 3),
            "error": self.error,
        }


def _committed_files(step_dir: Path) -> dict[str, FileEntry]:
    """What the trainer committed on this disk: the manifest's files, or (multi-node) this node's share."""
    manifest, share = node_holdings(step_dir)
    if share is not None:
        return share
    if manifest is None:
        raise ManifestError(f"{step_dir.name}: neither a manifest nor this node's part")
    return dict(manifest.files)


__all__ = ["Handoff", "HandoffState"]
