"""The sending side of the peer tier: on a notice routed to ``peer``, hand the urgent checkpoint over.

While a notice is pending the daemon tells :class:`Handoff` of every range the trainer has written
(``file-range`` messages: the file's temporary name, validated by the daemon, is opened here with
``O_NOFOLLOW`` at its first range and followed across the rename), of every file it finishes
(``file``) and of the commit (``saved``). Once the plan's route is ``peer`` a task picks the first
configured peer that answers, shares the bucket and has no hard notice of its own, opens a replica
for the newest checkpoint announced, and sends every announced range as it comes, alongside the
trainer's writing and the bucket upload. A file's ``file`` message only confirms it: what none of
its ranges covered (a file written without ranges: all of it) goes then. After the trainer's commit
it sends whatever the manifest lists that was not sent yet, then the manifest. The peer checks every
file against it (the CRC32C combined from the ranges it received, or the file read back where they
overlap) and commits the checkpoint in the bucket; the handoff is ``handed`` once the peer answered
``verified``.

Ranges of a file that never gets its ``file`` message (its writer gave up, removed or rewrote it)
may reach the peer, but count for nothing: the peer checks against the manifest only at commit. A
sender that dies mid-stream leaves nothing on the peer that counts (the peer drops a replica whose
connection ends before its manifest), so there is nothing to clean up there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, BinaryIO

from spotguard.manifest import FileEntry, ManifestError, node_holdings, parse_step_dir
from spotguard.peer import wire
from spotguard.peer.channel import IO_TIMEOUT
from spotguard.peer.client import PeerClient, choose_peer
from spotguard.safefile import is_unlinked, open_nofollow

logger = logging.getLogger("spotguard.handoff")

_KEEPALIVE = 10.0  # seconds without a file to send before a ping (the receiver's idle limit is 30 s)


class HandoffState(StrEnum):
    IDLE = "idle"
    CHOOSING = "choosing"
    SENDING = "sending"
    HANDED = "handed"  # the peer holds a verified replica and commits it in the bucket
    FAILED = "failed"


Candidates = Callable[[], Awaitable[list[tuple[str, int]]]]  # the peers to ask, preferred first


@dataclass
class _Streamed:
    """A file being written, sent by ranges as the trainer announces them."""

    tmp: str
    size: int
    file: BinaryIO  # opened on the temporary name: it stays valid across the rename
    todo: list[tuple[int, int]] = field(default_factory=list)  # (offset, length) announced, not yet sent
    done: list[tuple[int, int]] = field(default_factory=list)  # sent
    sending: bool = False  # a range is going out: closing the file now is left to the sender
    dropped: bool = False


class Handoff:
    def __init__(self, candidates: Candidates, token: bytes, bucket: str, *, io_timeout: float = IO_TIMEOUT) -> None:
        self._candidates = candidates  # asked at each handoff: with discovery, the fleet changes
        self._token = token
        self.bucket = bucket
        self._io_timeout = io_timeout  # the channel's record deadline (spotguard/peer/channel.py)
        self.state = HandoffState.IDLE
        self.peer: str | None = None
        self.name: str | None = None
        self.bytes_sent = 0
        self.seconds: float | None = None
        self.error: str | None = None
        self._announced: dict[str, tuple[Path, dict[str, FileEntry]]] = {}  # step name -> (dir, files)
        self._saved: set[str] = set()
        self._streams: dict[tuple[str, str], _Streamed] = {}  # (step name, file) -> its ranges
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # --- what the daemon tells it -------------------------------------------------------

    def file_range(self, step_dir: Path, rel: str, *, tmp: str, size: int, offset: int, length: int) -> None:
        """Bytes ``[offset, offset + length)`` of ``rel`` are written under ``tmp`` (relative to
        ``step_dir``; the daemon validated both names). Never raises: a file that cannot be opened
        here goes whole at its ``file`` message."""
        key = (step_dir.name, rel)
        stream = self._streams.get(key)
        if stream is not None and (
            (stream.tmp, stream.size) != (tmp, size) or is_unlinked(stream.file.fileno())
        ):  # given up and written again: what was sent of it counts for nothing (the peer checks at commit)
            self._drop(key)
            stream = None
        if stream is None:
            try:
                fd = open_nofollow(step_dir / tmp)
            except OSError as exc:
                logger.info("peer handoff: %s/%s goes whole at its file message (%s)", step_dir.name, rel, exc)
                return
            stream = self._streams[key] = _Streamed(tmp, size, open(fd, "rb", buffering=0))  # noqa: SIM115  # closed by _drop
        stream.todo.append((offset, length))
        self._announced.setdefault(step_dir.name, (step_dir, {}))
        self._wake.set()

    def file_ready(self, step_dir: Path, rel: str, entry: FileEntry) -> None:
        self._announced.setdefault(step_dir.name, (step_dir, {}))[1][rel] = entry
        if self._task is None:
            self._drop((step_dir.name, rel))  # not handing over (yet): the file goes whole if it must
        self._wake.set()

    def _drop(self, key: tuple[str, str]) -> None:
        stream = self._streams.pop(key, None)
        if stream is not None:
            stream.dropped = True
            if not stream.sending:
                stream.file.close()

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
            for key in list(self._streams):
                self._drop(key)
            self._announced.clear()
            self._saved.clear()
            self.state = HandoffState.IDLE

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel("daemon shutting down")
            await asyncio.gather(self._task, return_exceptions=True)
        for key in list(self._streams):
            self._drop(key)

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
        client = await choose_peer(addresses, self._token, self.bucket, io_timeout=self._io_timeout)
        if client is None:
            self.error = "no peer answered with the same bucket and no hard notice of its own"
            self._move(HandoffState.FAILED, self.error)
            return
        self.peer = client.address
        try:
            await self._send(client)
            self.seconds = time.monotonic() - started
            self._move(HandoffState.HANDED, f"{self.bytes_sent} bytes verified by the peer in {self.seconds:.1f} s")
        except (OSError, TimeoutError, wire.PeerError, ManifestError) as exc:
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
                for (name, rel), stream in list(self._streams.items()):
                    if name == self.name and rel not in sent:
                        await self._send_ranges(client, rel, stream)
                for rel in [rel for rel in files if rel not in sent]:
                    await self._finish_file(client, step_dir, rel)
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

    async def _send_ranges(self, client: PeerClient, rel: str, stream: _Streamed) -> None:
        stream.sending = True
        try:
            while stream.todo and not stream.dropped:  # the trainer may announce more while these go
                offset, length = stream.todo.pop(0)
                await client.send_part(stream.file, rel, stream.size, offset, length)
                stream.done.append((offset, length))
                self.bytes_sent += length
        finally:
            stream.sending = False
            if stream.dropped:
                stream.file.close()

    async def _finish_file(self, client: PeerClient, step_dir: Path, rel: str) -> None:
        """``rel`` is finished (its ``file`` message came): send what its ranges did not cover."""
        assert self.name is not None
        stream = self._streams.get((self.name, rel))
        if stream is None or stream.size != self._announced[self.name][1][rel].size:
            self._drop((self.name, rel))
            self.bytes_sent += await client.send_file(step_dir / rel, rel)
            return
        try:
            await self._send_ranges(client, rel, stream)
            stream.todo.extend(_gaps(stream.done, stream.size))  # the file message is the last word on it
            await self._send_ranges(client, rel, stream)
        finally:
            self._drop((self.name, rel))

    def status(self) -> dict[str, Any]:
        return {
            "state": str(self.state),
            "peer": self.peer,
            "name": self.name,
            "bytes_sent": self.bytes_sent,
            "seconds": None if self.seconds is None else round(self.seconds, 3),
            "error": self.error,
        }


def _gaps(ranges: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The (offset, length) pieces of ``[0, size)`` that ``ranges`` do not cover (no ranges at all:
    the whole file, even an empty one, so that it is sent)."""
    gaps, end = [], 0
    for offset, length in sorted(ranges):
        if offset > end:
            gaps.append((end, offset - end))
        end = max(end, offset + length)
    if end < size or not ranges:
        gaps.append((end, size - end))
    return gaps


def _committed_files(step_dir: Path) -> dict[str, FileEntry]:
    """What the trainer committed on this disk: the manifest's files, or (multi-node) this node's share."""
    manifest, share = node_holdings(step_dir)
    if share is not None:
        return share
    if manifest is None:
        raise ManifestError(f"{step_dir.name}: neither a manifest nor this node's part")
    return dict(manifest.files)


__all__ = ["Handoff", "HandoffState"]
