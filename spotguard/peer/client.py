"""The sending side of the peer tier: one protected connection to a peer's receiver, and
choosing the peer to hand a checkpoint to (spotguard/peer/handoff.py). The protocol:
docs/peer-protocol.md (the channel: spotguard/peer/channel.py; the frames: spotguard/peer/wire.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any, BinaryIO

from spotguard.manifest import MANIFEST, PART_PREFIX, ManifestError, node_holdings
from spotguard.peer import wire, workers
from spotguard.peer.channel import IO_TIMEOUT, Channel
from spotguard.peer.handshake import HANDSHAKE_TIMEOUT, open_channel
from spotguard.peer.records import sealed_size
from spotguard.peer.tokens import PeerToken

logger = logging.getLogger("spotguard.peers")

_CHOOSE_TIMEOUT = 2.0  # seconds a candidate has to connect, authenticate and answer
_PREFER_GRACE = 0.25  # seconds an earlier-listed candidate still answering may take once another is found
# Seconds the receiver may take to answer a commit: it checks every file against the manifest first
# (reading back those whose ranges overlapped), so this grows with the checkpoint; a dead host is
# noticed sooner (spotguard/peer/flows.py: Flows.watch).
COMMIT_TIMEOUT = 600.0


class PeerClient:
    """One authenticated connection to a peer's receiver.

    >>> client = await PeerClient.connect("10.0.0.2", 7140, token)
    >>> (await client.query())["busy"]
    False
    >>> await client.open_replica("step-000000100", "s3://b/run1")
    >>> await client.send_file(step_dir / "weights.bin", "weights.bin")
    >>> await client.commit(step_dir)
    """

    def __init__(self, channel: Channel, address: str) -> None:
        self.channel = channel
        self.address = address
        self._frames = [bytearray(), bytearray()]  # data frames are sealed into these by turns
        self._turn = 0

    @property
    def reader(self) -> Channel:
        return self.channel

    @property
    def writer(self) -> Channel:
        return self.channel

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        token: PeerToken,
        *,
        timeout: float = HANDSHAKE_TIMEOUT,
        io_timeout: float = IO_TIMEOUT,
        leave_when_gone: bool = False,
    ) -> PeerClient:
        """``leave_when_gone``: the connection ends on its own once the peer's host is gone (a fetch's;
        a handoff's flows are watched together instead: spotguard/peer/flows.py)."""
        channel = await open_channel(host, port, token, timeout=timeout, io_timeout=io_timeout)
        channel.leave_when_gone = leave_when_gone
        # Enough in the socket's buffer that the next chunk is read and sealed while this one goes out,
        # and no more: what waits here is this connection's alone (a handoff's other flows cannot take it).
        channel.transport.set_write_buffer_limits(high=wire.SEND_CHUNK)
        return cls(channel, f"{host}:{port}")

    async def _ask(self, header: dict[str, Any], answer: str = "ok", *, timeout: float | None = None) -> dict[str, Any]:
        self.channel.write(wire.encode(header))
        await self.channel.drain()
        reply = await self.channel.read_frame(timeout=timeout)
        wire.expect(reply, answer)
        return reply

    async def query(self) -> dict[str, Any]:
        return await self._ask({"t": "query"}, "state")

    async def ping(self) -> None:
        """Keep the connection alive while there is nothing to send (no answer comes)."""
        self.channel.write(wire.encode({"t": "ping"}))
        await self.channel.drain()

    async def open_replica(self, name: str, bucket: str, nbytes: int | None = None) -> str:
        """Open a replica of ``name`` on this connection; its id, for the flows that join it.
        ``nbytes``, the size expected, lets the peer refuse at once what its disk cannot take."""
        header: dict[str, Any] = {"t": "replica", "name": name, "bucket": bucket}
        if nbytes:
            header["bytes"] = nbytes
        reply = await self._ask(header)
        return wire.field(reply, "id", str)

    async def join(self, replica_id: str) -> None:
        """Carry data frames of ``replica_id``, opened by another connection from this host."""
        await self._ask({"t": "join", "id": replica_id})

    async def finish(self) -> None:
        """A joined connection's last request: answered once the peer has read its frames."""
        await self._ask({"t": "done"})

    async def send_part(
        self, file: BinaryIO, rel: str, size: int, offset: int, length: int, *, chunk: int = wire.SEND_CHUNK
    ) -> None:
        """Bytes ``[offset, offset+length)`` of the open ``file`` (``rel``, ``size`` bytes in all) in data
        frames of at most ``chunk`` bytes. A big frame goes to a worker process (spotguard/peer/workers.py)
        that reads, seals and sends it; otherwise it is read and sealed in a thread into one of
        this connection's two frame buffers, while the previous one goes out (a buffer is sealed into
        again only once the transport has handed all of it to the kernel)."""
        end = offset + length
        while True:  # at least once: an empty file is sent as one empty range
            want = min(chunk, end - offset)
            header = wire.encode({"t": "data", "name": rel, "size": size, "offset": offset, "len": want})
            worker = workers.take_for(want)
            try:
                if worker is not None:
                    await self.channel.send_frame_by(worker, header, file.fileno(), offset, want)
                else:
                    await self._send_in_process(header, file.fileno(), offset, want)
            except EOFError:  # the frame's header promises more: the connection cannot go on
                raise OSError(f"{rel} ended before byte {offset + want} while it was sent") from None
            offset += want
            if offset >= end:
                return

    async def _send_in_process(self, header: bytes, fd: int, offset: int, length: int) -> None:
        buffer = self._frame_buffer(sealed_size(len(header), length))
        records = await asyncio.to_thread(self.channel.seal_read, header, fd, offset, length, buffer)
        self.channel.write_sealed(records)
        await self.channel.flush_to(len(records))  # the other buffer's frame is out: it may be reused

    def _frame_buffer(self, need: int) -> bytearray:
        """The frame buffer not holding the frame written last (the two take turns)."""
        self._turn ^= 1
        if len(self._frames[self._turn]) < need:
            self._frames[self._turn] = bytearray(need)  # a new one: a bytearray with views out cannot grow
        return self._frames[self._turn]

    async def send_file(self, path: Path, rel: str, *, chunk: int = wire.SEND_CHUNK) -> int:
        """All of ``path`` as ``rel``; returns its size."""
        fd = await asyncio.to_thread(os.open, path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with open(fd, "rb", buffering=0) as file:
            size = os.fstat(fd).st_size
            await self.send_part(file, rel, size, 0, size, chunk=chunk)
        return size

    async def commit(self, step_dir: Path) -> dict[str, Any]:
        """Send the manifest, or in a multi-node job this node's part (with the job's manifest from
        node 0, which commits it): the receiver verifies every file against it before answering."""
        manifest, share = await asyncio.to_thread(node_holdings, step_dir)
        header: dict[str, Any] = {"t": "commit"}
        if share is not None:
            parts = await asyncio.to_thread(lambda: sorted(step_dir.glob(f"{PART_PREFIX}*.json")))
            header["part"] = await asyncio.to_thread(parts[0].read_text)
        if manifest is not None:
            header["manifest"] = await asyncio.to_thread((step_dir / MANIFEST).read_text)
        if len(header) == 1:
            raise ManifestError(f"{step_dir.name}: neither a manifest nor a node's part to send")
        return await self._ask(header, timeout=COMMIT_TIMEOUT)

    async def close(self) -> None:
        self.channel.close()
        await self.channel.wait_closed()


async def choose_peer(
    addresses: list[tuple[str, int]],
    token: PeerToken,
    bucket: str,
    *,
    timeout: float = _CHOOSE_TIMEOUT,
    io_timeout: float = IO_TIMEOUT,
    own_instance: str | None = None,
) -> PeerClient | None:
    """The first peer in ``addresses`` that answers, shares ``bucket``, has no hard notice of its
    own and is not this daemon (``own_instance``: its receiver's); None if none. All are asked at
    once (connect, authenticate, query: ``timeout`` seconds for the three), so dead or stale
    candidates cost no time while another answers; once one is found, earlier-listed ones still
    answering get ``_PREFER_GRACE`` more. The others are closed."""
    tasks = [
        asyncio.create_task(
            _ask(host, port, token, bucket, timeout=timeout, io_timeout=io_timeout, own_instance=own_instance),
            name=f"ask-peer-{host}:{port}",
        )
        for host, port in addresses
    ]
    chosen: PeerClient | None = None
    try:
        chosen = await _first_in_order(tasks)
    finally:
        for task in tasks:
            task.cancel("another peer was chosen")
        await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            other = _answer(task)
            if other is not None and other is not chosen:
                await other.close()
    return chosen


async def _ask(
    host: str,
    port: int,
    token: PeerToken,
    bucket: str,
    *,
    timeout: float,
    io_timeout: float,
    own_instance: str | None = None,
) -> PeerClient | None:
    """A connection to ``host:port`` if that peer may be chosen; else None (and it is closed)."""
    client: PeerClient | None = None
    try:
        async with asyncio.timeout(timeout):
            client = await PeerClient.connect(host, port, token, timeout=timeout, io_timeout=io_timeout)
            state = await client.query()
    except (OSError, TimeoutError, wire.PeerError) as exc:
        logger.warning("peer %s:%d did not answer: %s", host, port, exc or type(exc).__name__)
        state = None
    except BaseException:  # cancelled: another peer was chosen
        if client is not None:
            await client.close()
        raise
    if state is None:
        pass
    elif own_instance is not None and state.get("instance") == own_instance:
        # A replica on this VM's own disk rescues nothing; its notice is this VM's too.
        logger.info("peer %s:%d is this daemon itself: not choosing it", host, port)
    elif state.get("busy"):
        logger.warning("peer %s:%d has a hard notice of its own: not choosing it", host, port)
    elif state.get("bucket") != bucket:
        logger.warning("peer %s:%d commits to %s, not %s: not choosing it", host, port, state.get("bucket"), bucket)
    else:
        return client
    if client is not None:
        await client.close()
    return None


def _answer(task: asyncio.Task[PeerClient | None]) -> PeerClient | None:
    return task.result() if task.done() and not task.cancelled() and task.exception() is None else None


async def _first_in_order(tasks: list[asyncio.Task[PeerClient | None]]) -> PeerClient | None:
    """The answer of the earliest-listed task that found a peer: the first one found, unless an
    earlier-listed task still asking finds one within ``_PREFER_GRACE`` of it."""
    loop = asyncio.get_running_loop()
    grace_ends: float | None = None
    while True:
        possible = [task for task in tasks if not task.done() or _answer(task) is not None]
        found = [task for task in possible if task.done()]
        if found and grace_ends is None:
            grace_ends = loop.time() + _PREFER_GRACE
        preferred_or_late = found and (found[0] is possible[0] or loop.time() >= (grace_ends or 0.0))
        if not possible or preferred_or_late:
            return _answer(found[0]) if found else None
        wait = None if grace_ends is None else grace_ends - loop.time()
        await asyncio.wait([t for t in possible if not t.done()], timeout=wait, return_when=asyncio.FIRST_COMPLETED)


__all__ = ["COMMIT_TIMEOUT", "PeerClient", "choose_peer"]
