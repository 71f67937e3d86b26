"""One replica over several connections ("flows") to the same peer.

Clouds cap a single TCP flow far below the NIC (AWS: 5 Gbit/s between VMs outside a cluster
placement group), so a large share cannot cross in a 30 s notice on one connection however fast
the link is. :class:`Flows` sends a replica's pieces over the connection that opened it and over
connections joined to it (``{"t":"join","id":...}``, each with a handshake of its own: the receiver
authenticates every connection and checks every range as on the first). A free flow takes the
next piece of a file no other flow is sending (:class:`PieceQueue`), so that the receiver writes
several files at once; a joined flow that fails hands its piece back to the others, while the
opener's failure ends the handoff (the receiver drops a replica whose opener goes away).

How many flows: one to begin with. :meth:`Flows.pace` measures what each flow carries and adds one
whenever the bytes left cannot cross before the deadline on the flows open, up to ``max_flows``.
A fast link keeps one flow; a capped one gets as many as the deadline needs.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from spotguard.manifest import load_manifest
from spotguard.peer import wire, workers
from spotguard.peer.channel import IO_TIMEOUT
from spotguard.peer.client import PeerClient
from spotguard.peer.tokens import PeerToken
from spotguard.safefile import open_nofollow

logger = logging.getLogger("spotguard.handoff")

KEEPALIVE = 10.0  # seconds a flow waits for a piece before a ping (the receiver's idle limit is 30 s)
PIECE = wire.SEND_CHUNK  # bytes of one piece: what a flow takes from the queue at once (one frame)
MAX_FLOWS = 8  # the default bound (a receiver takes 16 connections: two senders' worth)
PACE_INTERVAL = 0.25  # seconds between looks at the rate
COMMIT_RESERVE = 0.2  # share of the time left kept for the receiver's checks and the commit
WATCH_INTERVAL = 0.5  # seconds between looks at what the peer acknowledged (Flows.watch)


class FlowsFailed(wire.PeerError):
    """Every flow failed, or the one that opened the replica did."""


@dataclass
class Source:
    """An open file that pieces are read from: closed once dropped and no piece holds it."""

    file: BinaryIO
    rel: str
    size: int
    holds: int = 0
    dropped: bool = False
    stale: bool = False  # its pieces not sent yet need not go (the file was given up or rewritten)

    def hold(self) -> None:
        self.holds += 1

    def release(self) -> None:
        self.holds -= 1
        if self.dropped and self.holds == 0:
            self.file.close()

    def drop(self, *, stale: bool = False) -> None:
        """No more pieces will be queued from it; ``stale``: those queued need not go."""
        self.stale = self.stale or stale
        if not self.dropped:
            self.dropped = True
            if self.holds == 0:
                self.file.close()


def cut(offset: int, length: int) -> Iterator[tuple[int, int]]:
    """``[offset, offset + length)`` as (offset, length) pieces of at most :data:`PIECE` bytes; an
    empty range is one empty piece (an empty file is sent too)."""
    end = offset + length
    while True:
        take = min(PIECE, end - offset)
        yield offset, take
        offset += take
        if offset >= end:
            return


@dataclass
class Piece:
    source: Source
    offset: int
    length: int
    sent: Callable[[Piece], None] | None = None  # called once it went out


class PieceQueue:
    """Pieces waiting for a flow: a file's in the order they came, files in the order their first
    waiting piece came. A flow takes the next piece of the first file no other flow is sending,
    where there is one (else of the first file): the receiver's writes to one file
    take turns (the kernel's lock on the file), so flows on different files write in parallel there,
    as a plain copy dealing whole files to its connections does."""

    def __init__(self) -> None:
        self._files: OrderedDict[int, deque[Piece]] = OrderedDict()  # by id() of the piece's Source; none empty

    def __bool__(self) -> bool:
        return bool(self._files)

    def __len__(self) -> int:
        return sum(map(len, self._files.values()))

    def push(self, piece: Piece) -> None:
        self._files.setdefault(id(piece.source), deque()).append(piece)

    def push_front(self, piece: Piece) -> None:
        """A piece a failed flow gave back: the next to go."""
        key = id(piece.source)
        self._files.setdefault(key, deque()).appendleft(piece)
        self._files.move_to_end(key, last=False)

    def take(self, sending: Counter[int]) -> Piece:
        """The oldest piece of the first file not in ``sending`` (ids of the files flows are sending
        now), else the oldest piece. Looks at no more than ``len(sending) + 1`` files: one of those
        is free when flows send that many. Raises :class:`IndexError` when empty."""
        if not self._files:
            raise IndexError("no piece queued")
        chosen = next(iter(self._files))
        for seen, key in enumerate(self._files):
            if key not in sending:
                chosen = key
                break
            if seen >= len(sending):
                break
        pieces = self._files[chosen]
        piece = pieces.popleft()
        if not pieces:
            del self._files[chosen]
        return piece

    def drain(self) -> Iterator[Piece]:
        """Every piece left, taken out."""
        while self._files:
            _, pieces = self._files.popitem(last=False)
            yield from pieces


class Flows:
    """The flows of one replica: ``opener`` carries the replica; ``connect`` opens another
    authenticated connection to the same peer, which joins ``replica_id``.

    >>> flows = Flows(client, "step-000000100-1a2b3c4d", connect, max_flows=8)
    >>> flows.send(source, 0, source.size)
    >>> await flows.sent()       # every piece out, every joined flow's frames read by the peer
    >>> await client.commit(step_dir)
    >>> await flows.close()
    """

    def __init__(
        self,
        opener: PeerClient,
        replica_id: str,
        connect: Callable[[], Awaitable[PeerClient]],
        *,
        max_flows: int = MAX_FLOWS,
    ) -> None:
        if max_flows < 1:
            raise ValueError("max_flows must be at least 1")
        self.opener = opener
        self.replica_id = replica_id
        self.max_flows = max_flows
        self.bytes_sent = 0
        self.opened = 1  # flows opened in all (the opener included), for status and tests
        self._connect = connect
        self._queue = PieceQueue()
        self._sending: Counter[int] = Counter()  # id() of each Source flows are sending now: how many
        self._queued_bytes = 0
        self._more = asyncio.Event()  # a piece was queued
        self._progress = asyncio.Event()  # a piece went out, or a flow failed
        self._error: BaseException | None = None
        self._workers: dict[asyncio.Task[None], PeerClient] = {}
        self._finishing: list[PeerClient] = []  # joined flows waiting for the peer's "done" (sent())
        # What each joined flow sent that its peer has not yet confirmed reading (its "done", at sent()):
        # a joined flow that fails alone gives them back, since the bytes still in its socket's buffers
        # are lost with it (the replica was refused as never received in full, a healthy peer's).
        self._unconfirmed: dict[PeerClient, list[Piece]] = {}
        self.on_failure: Callable[[], None] = lambda: None  # called once the flows failed (the owner wakes)
        self._start(opener)

    @property
    def count(self) -> int:
        """Flows open now."""
        return len(self._workers)

    @property
    def buffered(self) -> int:
        """Bytes the flows took that still wait in their connections' buffers (counted as sent)."""
        return sum(client.channel.transport.get_write_buffer_size() for client in self._workers.values())

    @property
    def backlog(self) -> int:
        """Bytes queued or going out."""
        return self._queued_bytes

    def send(self, source: Source, offset: int, length: int, sent: Callable[[Piece], None] | None = None) -> None:
        """Queue ``[offset, offset + length)`` of ``source`` in pieces (:func:`cut`)."""
        for start, take in cut(offset, length):
            source.hold()
            self._queue.push(Piece(source, start, take, sent))
            self._queued_bytes += take
        self._more.set()

    async def send_file(self, path: Path, rel: str, sent: Callable[[Piece], None] | None = None) -> None:
        """Queue all of the finished file ``path`` as ``rel`` (opened without following a link; closed
        once its pieces went out)."""
        fd = await asyncio.to_thread(open_nofollow, path)
        source = Source(open(fd, "rb", buffering=0), rel, os.fstat(fd).st_size)  # noqa: SIM115  # closed by drop()
        self.send(source, 0, source.size, sent)
        source.drop()

    async def sent(self) -> None:
        """The last call before the commit: wait until every queued piece went out, stop the flows,
        and wait until the peer has read each joined flow's frames (it answers a ``done`` once the
        frames before it are in). A joined flow lost before its ``done`` gives its pieces back, and
        the opener sends them. Raises :class:`FlowsFailed` (or the error that ended the opener) if
        the flows could not carry them."""
        while True:
            while self._queue or self._sending:
                self.raise_if_failed()
                self._progress.clear()
                await self._progress.wait()
            self.raise_if_failed()
            workers, self._workers = self._workers, {}
            for task in workers:
                task.cancel("every piece went out")  # each waits for a piece, or pings
            await asyncio.gather(*workers, return_exceptions=True)
            if not await self._finish([client for client in workers.values() if client is not self.opener]):
                return
            self._start(self.opener)  # what a joined flow lost goes again on the opener

    async def _finish(self, finishing: list[PeerClient]) -> bool:
        """Each joined flow's ``done`` from the peer; whether one was lost before it (its pieces
        queued again)."""
        self._finishing = finishing
        lost = False
        try:
            for client in finishing:
                try:
                    await client.finish()
                except (OSError, wire.PeerError) as exc:
                    self.raise_if_failed()  # the watch ended it: say why
                    self._give_back(client, exc)
                    lost = True
        finally:
            self._finishing = []
            for client in finishing:
                await client.close()
                self._release_unconfirmed(client)
        return lost

    async def grow(self) -> bool:
        """One more flow, if the bound allows and the peer takes it; whether one was added."""
        if self._error is not None or self.count >= self.max_flows:
            return False
        client: PeerClient | None = None
        try:
            client = await self._connect()
            await client.join(self.replica_id)
        except (OSError, TimeoutError, wire.PeerError) as exc:
            logger.warning("peer handoff: flow %d to %s not opened: %s", self.count + 1, self.opener.address, exc)
            if client is not None:
                await client.close()
            return False
        self.opened += 1
        self._start(client)
        workers.pool().warm(self.count)  # a worker per sending flow
        return True

    async def pace(self, remaining: Callable[[], int], deadline: Callable[[], float]) -> None:
        """Until cancelled: add a flow whenever ``remaining()`` bytes would not cross on the flows
        open, at the rate each carried in the last interval, before ``deadline()`` (monotonic; less a
        share kept for the commit). Both are asked at each look: a revised plan may change them."""
        last, last_time = self._delivered(), time.monotonic()
        while True:
            await asyncio.sleep(PACE_INTERVAL)
            now, delivered = time.monotonic(), self._delivered()
            measured = [key for key in delivered if key in last]  # a flow opened since counts next time
            carried = sum(delivered[key] - last[key] for key in measured)
            flows = self.count if self in delivered else len(measured)
            elapsed, last, last_time = now - last_time, delivered, now
            buffered = self.buffered
            if not (self._queue or self._sending or buffered) or carried <= 0 or not flows:
                continue  # nothing waiting to go (the trainer is the limit), or nothing measured yet
            if self.count >= self.max_flows:
                continue
            per_flow = carried / elapsed / flows
            left = deadline() - now
            seconds = max(left * (1 - COMMIT_RESERVE), PACE_INTERVAL)
            needed = math.ceil((remaining() + buffered) / seconds / per_flow)
            if needed > self.count and await self.grow():
                logger.info(
                    "peer handoff: %d flows to %s (%.1f MB/s each, %d MiB left, %.1f s to the deadline)",
                    self.count, self.opener.address, per_flow / 1e6, remaining() >> 20, left,
                )  # fmt: skip

    async def watch(self, limit: Callable[[], float]) -> None:
        """Until cancelled: leave a peer that is gone, or one that takes nothing for too long.

        A peer whose VM vanished (no FIN, no RST: a host reclaimed or cut off) is otherwise noticed
        only when the kernel gives up on the unacknowledged bytes, ``io_timeout`` later: past a 30 s
        notice's deadline. Once a flow's bytes in flight, or its keepalive probes, got no answer for
        ``GONE_AFTER`` seconds (:meth:`~spotguard.peer.channel.Channel.gone_for`) the peer is gone, and
        the flows fail (:meth:`_leave_if_gone`). A peer that acknowledges what it is sent but takes
        nothing more (its disk stalls) fails them once nothing was acknowledged for ``limit()`` seconds
        while they had a piece to send. Where the OS does not say what was acknowledged, it returns
        (``io_timeout`` rules, as before)."""
        acked, since = -1, time.monotonic()
        while self._error is None:
            await asyncio.sleep(WATCH_INTERVAL)
            self._leave_if_gone()
            if self._error is not None:
                return
            counts = [client.channel.delivered() for client in self._workers.values()]
            if any(count is None for count in counts):
                return
            if not counts:
                continue  # the joined flows finish, or the opener commits: only a gone host is looked for
            now, total = time.monotonic(), sum(count for count in counts if count is not None)
            if total != acked or not self._sending:  # progress, or nothing to send (the trainer is the limit)
                acked, since = total, now
            elif now - since > limit():
                self.fail(TimeoutError(f"the peer acknowledged nothing for {now - since:.1f} s while bytes waited"))

    def _leave_if_gone(self) -> None:
        """Fail the flows once the peer's host is gone on one of them: it answered nothing for
        ``GONE_AFTER`` seconds (:meth:`~spotguard.peer.channel.Channel.gone_for`: bytes in flight, or probes).

        All of them, not that one alone: the pieces a flow sent before its last may still be in flight
        with it, and are counted as sent, so the replica on that peer could not be completed. The flows
        finishing and the opener waiting for the commit's answer are looked at too."""
        for client in self._watched():
            quiet = client.channel.gone_for()
            if quiet is not None:
                self.fail(
                    TimeoutError(
                        f"{client.address} answered nothing for {quiet:.1f} s, with bytes in flight or probes "
                        "(its host, or the way to it, is gone)"
                    )
                )
                return

    def _watched(self) -> list[PeerClient]:
        return list(dict.fromkeys([self.opener, *self._workers.values(), *self._finishing]))

    def fail(self, error: BaseException) -> None:
        """End every flow with ``error`` (what :meth:`sent` raises from now on), the opener's
        connection with them (a commit waiting on it ends too)."""
        if self._error is None:
            self._error = error
        for client in self._watched():
            client.channel.abort()  # each flow's send or wait ends; _ended keeps the first error
        self._progress.set()
        self.on_failure()

    def _delivered(self) -> dict[object, int]:
        """Bytes each flow's peer acknowledged; where the OS does not say, the bytes of the pieces
        sent, for all flows at once (coarser: a piece at a time)."""
        acked = {client: client.channel.delivered() for client in self._workers.values()}
        if any(count is None for count in acked.values()):
            return {self: self.bytes_sent}
        return {client: count for client, count in acked.items() if count is not None}

    async def close(self) -> None:
        """Stop every flow and close the joined ones (the opener is its owner's to close)."""
        workers, self._workers = self._workers, {}
        for task in workers:
            task.cancel("handoff over")
        await asyncio.gather(*workers, return_exceptions=True)
        for client in workers.values():
            if client is not self.opener:
                await client.close()
        for piece in self._queue.drain():
            self._queued_bytes -= piece.length
            piece.source.release()
        for client in list(self._unconfirmed):
            self._release_unconfirmed(client)

    def _give_back(self, client: PeerClient, exc: BaseException | None) -> None:
        """A joined flow failed alone: what it sent unconfirmed goes again, first (the receiver takes
        overlapping ranges)."""
        lost = self._unconfirmed.pop(client, [])
        for piece in reversed(lost):
            self._queue.push_front(Piece(piece.source, piece.offset, piece.length))
            self._queued_bytes += piece.length
        logger.warning(
            "peer handoff: a flow to %s failed (%s); %d go on, sending again the %d piece(s) it had sent",
            client.address, exc, self.count, len(lost),
        )  # fmt: skip
        self._more.set()

    def _release_unconfirmed(self, client: PeerClient) -> None:
        for piece in self._unconfirmed.pop(client, []):
            piece.source.release()

    # --- one flow ------------------------------------------------------------------------

    def _start(self, client: PeerClient) -> None:
        task = asyncio.create_task(self._work(client), name=f"peer-flow-{self.opened}")
        self._workers[task] = client
        task.add_done_callback(self._ended)

    async def _work(self, client: PeerClient) -> None:
        while True:
            if not self._queue:
                self._more.clear()
                try:
                    await asyncio.wait_for(self._more.wait(), KEEPALIVE)
                except TimeoutError:
                    await client.ping()  # the trainer is slow to write: the peer drops idle connections
                continue
            piece = self._queue.take(self._sending)
            source = piece.source
            held = False  # a joined flow's piece, until the peer says it read it (sent())
            if not source.stale:
                self._sending[id(source)] += 1
                try:
                    await client.send_part(source.file, source.rel, source.size, piece.offset, piece.length)
                except BaseException:
                    self._queue.push_front(piece)  # another flow sends it (or close() releases it)
                    raise
                finally:
                    self._sending[id(source)] -= 1
                    if not self._sending[id(source)]:
                        del self._sending[id(source)]
                self.bytes_sent += piece.length
                if piece.sent is not None:
                    piece.sent(piece)
                held = client is not self.opener
                if held:
                    self._unconfirmed.setdefault(client, []).append(piece)
            self._queued_bytes -= piece.length
            if not held:
                source.release()
            self._progress.set()

    def _ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task not in self._workers:
            return
        client = self._workers.pop(task)
        exc = task.exception()
        if client is self.opener or not self._workers:
            if self._error is None:
                self._error = exc if exc is not None else FlowsFailed("closed", "a flow ended")
            self.on_failure()
        else:
            self._give_back(client, exc)
            client.channel.close()  # its transport goes; nothing to wait for
        self._progress.set()
        self._more.set()  # the others take what it left

    def raise_if_failed(self) -> None:
        """Raise what ended the flows, if they failed (:meth:`sent` raises it too)."""
        if self._error is not None:
            error = self._error
            if isinstance(error, wire.PeerError | OSError | TimeoutError):
                raise error
            raise FlowsFailed("closed", f"the flows failed: {error}") from error


async def open_flows(
    client: PeerClient,
    name: str,
    bucket: str,
    token: PeerToken,
    *,
    io_timeout: float = IO_TIMEOUT,
    max_flows: int,
    nbytes: int | None = None,
) -> Flows:
    """A replica of ``name`` (``nbytes`` expected, if known) opened on ``client``, and its
    :class:`Flows` (more connect to the same peer with ``token``)."""
    replica_id = await client.open_replica(name, bucket, nbytes)
    host, _, port = client.address.rpartition(":")

    async def connect() -> PeerClient:
        return await PeerClient.connect(host, int(port), token, io_timeout=io_timeout)

    return Flows(client, replica_id, connect, max_flows=max_flows)


async def send_committed(
    client: PeerClient, step_dir: Path, bucket: str, token: PeerToken, *, flows: int
) -> dict[str, Any]:
    """A whole locally committed checkpoint to ``client``'s peer over ``flows`` connections at once
    (resends, benchmarks); the peer's answer to the commit."""
    files = await asyncio.to_thread(lambda: dict(load_manifest(step_dir).files))
    replica = await open_flows(client, step_dir.name, bucket, token, max_flows=flows)
    try:
        while replica.count < flows and await replica.grow():
            pass
        for rel in sorted(files):
            await replica.send_file(step_dir / rel, rel)
        await replica.sent()
        return await client.commit(step_dir)
    finally:
        await replica.close()


__all__ = [
    "KEEPALIVE",
    "MAX_FLOWS",
    "PIECE",
    "Flows",
    "FlowsFailed",
    "Piece",
    "PieceQueue",
    "Source",
    "cut",
    "open_flows",
    "send_committed",
]
