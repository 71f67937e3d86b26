"""The sending side of the peer tier: on a notice routed to ``peer``, hand the urgent checkpoint over.

While a notice is pending the daemon tells :class:`Handoff` of every range the trainer has written
(``file-range`` messages: the file's temporary name, validated by the daemon, is opened with
``O_NOFOLLOW`` at its first range and followed across the rename), of every file it finishes
(``file``) and of the commit (``saved``): spotguard/peer/announced.py keeps it. Once the plan's
route is ``peer`` a task picks the first configured peer that answers, shares the bucket and has no
hard notice of its own, opens a replica for the newest checkpoint announced (telling its size, or
the plan's while the trainer writes: a peer without a free slot or the room refuses at once, and the
next peer that answers is asked, nothing having been sent; where room was short for the plan's size,
the refused peers are asked again once the trainer commits), and sends every announced range as it
comes, alongside the trainer's writing and the bucket upload. A peer that fails once bytes went (its
disk filled, it went away, it got a notice of its own), whose host is gone (what is in flight, or a
keepalive probe, unanswered for :data:`~spotguard.peer.channel.GONE_AFTER` seconds), or that takes
nothing (nothing acknowledged for :data:`STALL_SHARE` of the time left while bytes wait), is left
for the next one that answers, which is sent the replica again from its first byte: at most
:data:`MAX_MOVES` times, and not past the deadline. A file's ``file`` message only confirms it: what
none of its ranges covered (a file written without ranges: all of it) goes then. After the trainer's
commit it sends whatever the manifest lists that was not sent yet, then the manifest. The peer
checks every file against it (the CRC32C combined from the ranges it received, or the file read back
where they overlap) and commits the checkpoint in the bucket; the handoff is ``handed`` once the
peer answered ``verified``.

Ranges of a file that never gets its ``file`` message (its writer gave up, removed or rewrote it)
may reach the peer, but count for nothing: the peer checks against the manifest only at commit. A
sender that dies mid-stream leaves nothing on the peer that counts (the peer drops a replica whose
connection ends before its manifest), so there is nothing to clean up there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from enum import StrEnum
from pathlib import Path
from typing import Any

from spotguard.manifest import FileEntry, ManifestError
from spotguard.peer import wire, workers
from spotguard.peer.announced import Announced, Streamed
from spotguard.peer.channel import IO_TIMEOUT
from spotguard.peer.client import PeerClient, choose_peer
from spotguard.peer.flows import KEEPALIVE, MAX_FLOWS, Flows, Piece, open_flows
from spotguard.peer.tokens import PeerToken

logger = logging.getLogger("spotguard.handoff")

# Worker processes started at a notice whose route is a peer (spotguard/peer/workers.py): the first
# flow's, and one for a second flow; the pool grows on from there as frames need.
_WARM_WORKERS = 2

# Peers a handoff moves on to after one failed with bytes sent: each is sent the whole replica again,
# so the bound keeps a fleet-wide fault (every peer's disk nearly full) from sending it many times.
MAX_MOVES = 2

# A handoff racing a deadline takes a peer that acknowledged nothing for this share of the time left
# (at least STALL_MIN seconds, at most the channel's io_timeout) while bytes waited as lost
# (Flows.watch), and moves on: its host still answers, but its disk or its daemon has stalled, and the
# kernel would give up on it only io_timeout (30 s) later, a whole GCP or Azure notice. A host that
# answers nothing at all (a VM reclaimed at once sends no FIN) is left sooner, after GONE_AFTER.
STALL_SHARE = 0.25
STALL_MIN = 5.0

# Refusals of an open for the room the replica was said to need (the bytes told at the open).
_ROOM = frozenset({"no-space", "too-large"})

# Refusals that say something of the peer (its disk, its slots, its own notice, its going away), not of
# the replica: another peer may take it. The rest (a file that does not match its manifest, a bad
# name, a replica over the bounds) would be refused anywhere.
_PEER_SIDE = frozenset({"closed", "gone", "busy", "full", "no-space", "disk", "internal"})


class HandoffState(StrEnum):
    IDLE = "idle"
    CHOOSING = "choosing"
    SENDING = "sending"
    HANDED = "handed"  # the peer holds a verified replica and commits it in the bucket
    FAILED = "failed"


Candidates = Callable[[], Awaitable[list[tuple[str, int]]]]  # the peers to ask, preferred first


class _NotOpened(Exception):
    """The peer chosen did not open the replica (refused, or gone before it answered)."""


class _Unreadable(Exception):
    """A file of the checkpoint could not be opened here: no peer can be sent it."""


class Handoff:
    def __init__(
        self,
        candidates: Candidates,
        token: PeerToken,
        bucket: str,
        *,
        io_timeout: float = IO_TIMEOUT,
        max_flows: int = MAX_FLOWS,
    ) -> None:
        self._candidates = candidates  # asked at each handoff: with discovery, the fleet changes
        self._token = token
        self.bucket = bucket
        self._io_timeout = io_timeout  # the channel's record deadline (spotguard/peer/channel.py)
        self.max_flows = max_flows  # connections one replica may use (spotguard/peer/flows.py)
        self.own_instance: str | None = None  # this daemon's receiver's (passed over as a peer)
        self._expected = 0  # bytes the plan expects the checkpoint to hold
        self._sized_from_commit = False  # whether the last open told a peer the committed checkpoint's size
        self._deadline: float | None = None  # monotonic; None: no deadline known (one flow)
        self.state = HandoffState.IDLE
        self.peer: str | None = None
        self.name: str | None = None
        self.bytes_sent = 0
        self.seconds: float | None = None
        self.error: str | None = None
        self.moves = 0  # peers this handoff left after bytes went to them
        # For the daemon's life (its metrics): handoffs ended, by outcome, and peers left mid-stream.
        self.totals = {"handed": 0, "failed": 0, "moves": 0}
        self._announced = Announced()  # what the daemon told of the notice's checkpoints
        self._queued_files: set[str] = set()  # files of the replica wholly handed to its flows
        self._flows: Flows | None = None  # the current (or last) handoff's
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._reset_at_end = False  # the notice ended while the handoff sent its save: forget at its end
        self._start_pending = False  # a notice came while a handoff still sent: its own starts at that one's end
        self._ending: asyncio.Task[None] | None = None  # one cancelled by reset, closing its connections

    # --- what the daemon tells it -------------------------------------------------------

    def file_range(self, step_dir: Path, rel: str, *, tmp: str, size: int, offset: int, length: int) -> None:
        """Bytes ``[offset, offset + length)`` of ``rel`` are written under ``tmp`` (relative to
        ``step_dir``; the daemon validated both names). Never raises: a file that cannot be opened
        here goes whole at its ``file`` message."""
        if self._announced.file_range(step_dir, rel, tmp=tmp, size=size, offset=offset, length=length):
            self._wake.set()

    def file_ready(self, step_dir: Path, rel: str, entry: FileEntry) -> None:
        self._announced.file_ready(step_dir, rel, entry)
        if self._task is None:
            self._announced.drop((step_dir.name, rel))  # not handing over (yet): the file goes whole if it must
        self._wake.set()

    def saved(self, step_dir: Path) -> None:
        self._announced.saved(step_dir)
        self._wake.set()

    def start(self, *, expected_bytes: int = 0, deadline: float | None = None) -> None:
        """The route is ``peer``: start handing over (once per notice). ``expected_bytes`` (the
        plan's size) and ``deadline`` (monotonic) decide how many flows the handoff needs."""
        self._expected, self._deadline = expected_bytes, deadline
        workers.pool().warm(_WARM_WORKERS)  # ready by the time the trainer's first bytes are
        if self._task is not None and not self._task.done():
            # Still sending a checkpoint of an earlier notice (a rebalance recommendation's, with the
            # interruption right behind it): this notice's goes once that one ends. Ignored, it went
            # nowhere, and the end of the earlier one forgot it.
            self._start_pending = True
            return
        if self._task is not None:  # the last notice's handoff ended (handed or failed) and was not reset
            self._forget_sent()
        self._begin()

    def _begin(self) -> None:
        """A new handoff: what the status says of the last one (and the pacer's count of bytes sent,
        which it takes from the plan's size) starts again."""
        self.peer = self.name = self.error = None
        self.bytes_sent, self.seconds, self.moves = 0, None, 0
        self._reset_at_end = self._start_pending = False
        self._task = asyncio.create_task(self._run(), name="peer-handoff")

    def reset(self) -> None:
        """The notice is over: forget what it announced. A handoff in flight with a save to send goes
        on to its end (a soft notice is over as soon as its checkpoint is saved) and forgets then; one
        with nothing saved is ended now: it would wait for a save that no longer comes, holding a
        replica slot on its peer, and the next notice would find it still running."""
        if self._task is not None and not self._task.done():
            if self._start_pending and not self._announced.saved_after(self.name):
                self._start_pending = False  # the later notice ended with nothing saved for it
            if self._announced.any_saved():
                self._reset_at_end = True
                return
            why = "the notice ended before a checkpoint was saved for it"
            self._task.cancel(why)
            self._ending = self._task
            self.error = why
            self._move(HandoffState.FAILED, why)
        self._forget()

    def _forget_sent(self) -> None:
        """Forget what the last handoff sent, and older: a later notice's newer checkpoint stays."""
        self._announced.forget(up_to=self.name)
        self._queued_files.clear()

    def _forget(self) -> None:
        self._task = None
        self._reset_at_end = self._start_pending = False
        self._announced.forget()
        self._queued_files.clear()
        self.state = HandoffState.IDLE

    async def close(self) -> None:
        running = [task for task in (self._task, self._ending) if task is not None]
        for task in running:
            task.cancel("daemon shutting down")
        await asyncio.gather(*running, return_exceptions=True)
        self._announced.drop_streams()

    def _move(self, state: HandoffState, why: str) -> None:
        logger.warning(
            "peer handoff of %s to %s: %s -> %s (%s)", self.name or "-", self.peer or "-", self.state, state, why
        )
        self.state = state
        if state in (HandoffState.HANDED, HandoffState.FAILED):
            self.totals[str(state)] += 1

    # --- the handover -----------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._hand_over()
        except asyncio.CancelledError:  # reset or shut down: nothing starts after it
            self._start_pending = False
            raise
        finally:
            if self._start_pending:  # a later notice's checkpoint
                self._forget_sent()
                self._begin()
            elif self._reset_at_end:
                self._forget()

    async def _hand_over(self) -> None:
        started = time.monotonic()
        addresses = await self._candidates()
        self._move(HandoffState.CHOOSING, f"asking {len(addresses)} peer(s)")
        refused: list[str] = []  # peers that would not open the replica: nothing was sent to them
        failed: list[str] = []  # peers that failed once bytes went to them
        short_of_room = asked_again = False  # a peer refused for room; the refused were asked again
        while True:
            left = [(host, port) for host, port in addresses if f"{host}:{port}" not in refused + failed]
            client = await choose_peer(
                left, self._token, self.bucket, io_timeout=self._io_timeout, own_instance=self.own_instance
            )
            if client is None and short_of_room and not asked_again and await self._committed_since_refused(refused):
                asked_again = True
                refused.clear()
                continue
            if client is None:
                if failed:  # what the last one failed with says more than that no other answered
                    self.error = f"{self.error}; no other peer took the replica"
                else:
                    self.error = "no peer answered with the same bucket and no hard notice of its own"
                if refused:
                    self.error += f" ({len(refused)} had no room for it)"
                self._move(HandoffState.FAILED, self.error)
                return
            self.peer = client.address
            try:
                await self._send(client)
                self.seconds = time.monotonic() - started
                self._move(HandoffState.HANDED, f"{self.bytes_sent} bytes verified by the peer in {self.seconds:.1f} s")
                return
            except _NotOpened as exc:
                # Its slots are taken (a wave of notices picks the same freshest peer) or its disk is
                # short: nothing went to it yet, so the next peer takes the replica from the start.
                logger.warning("peer handoff: %s did not open the replica (%s); asking the others", client.address, exc)
                refused.append(client.address)
                cause = exc.__cause__
                # Short of room for the plan's size, told before the commit: the committed size may fit.
                room = isinstance(cause, wire.PeerError) and cause.code in _ROOM
                short_of_room |= room and not self._sized_from_commit
            except (OSError, TimeoutError, wire.PeerError) as exc:
                self.error = str(exc)
                if not self._may_move(exc):
                    self._move(HandoffState.FAILED, self.error)
                    return
                logger.warning(
                    "peer handoff: %s failed after %d bytes (%s); sending the replica again to the next peer",
                    client.address, self.bytes_sent, exc,
                )  # fmt: skip
                failed.append(client.address)
                self.moves += 1
                self.totals["moves"] += 1
                self._send_again()
            except (ManifestError, _Unreadable) as exc:
                self.error = str(exc)
                self._move(HandoffState.FAILED, self.error)
                return
            finally:
                await client.close()

    def _may_move(self, exc: BaseException) -> bool:
        """Whether a handoff that failed with ``exc`` once bytes went may go to another peer."""
        if self.moves >= MAX_MOVES or (self._deadline is not None and time.monotonic() >= self._deadline):
            return False
        return not isinstance(exc, wire.PeerError) or exc.code in _PEER_SIDE

    def _send_again(self) -> None:
        """The next peer gets the replica from its first byte: every range sent (or queued) goes again,
        and every finished file whole, from its name on disk."""
        for stream in self._announced.streams.values():
            stream.todo[:0] = stream.queued
            stream.queued = []
        self._queued_files.clear()
        self.bytes_sent = 0

    async def _send(self, client: PeerClient) -> None:
        flows: Flows | None = None
        helpers: list[asyncio.Task[None]] = []  # the flows' pacer and watch, with a deadline
        # A peer whose host goes while the trainer has not written yet (or with no deadline, while its
        # one flow sends) ends the connection: the open fails within seconds, not io_timeout.
        client.channel.leave_when_gone = True
        try:
            while True:
                self._wake.clear()
                if flows is None and self._announced:
                    try:
                        flows = self._flows = await self._open(client)
                    except (OSError, TimeoutError, wire.PeerError) as exc:
                        raise _NotOpened(str(exc)) from exc
                    flows.on_failure = self._wake.set  # a peer lost while the trainer writes: move now
                    if self._deadline is not None:
                        client.channel.leave_when_gone = False  # the watch fails every flow at once instead
                        helpers.append(asyncio.create_task(flows.watch(self._stall_limit), name="peer-watch"))
                        if self.max_flows > 1:
                            pace = flows.pace(self._remaining, self._deadline_at)
                            helpers.append(asyncio.create_task(pace, name="peer-flows"))
                if flows is not None:
                    flows.raise_if_failed()
                if flows is not None and await self._queue_announced(flows):
                    assert self.name is not None
                    await flows.sent()
                    try:
                        await client.commit(self._announced.step_dir(self.name))
                    except (OSError, wire.PeerError):
                        flows.raise_if_failed()  # the watch ended it (the peer's host is gone): say so
                        raise
                    return
                try:
                    await asyncio.wait_for(self._wake.wait(), KEEPALIVE)
                except TimeoutError:
                    if flows is None:  # else its flows ping while they wait for pieces
                        try:
                            await client.ping()  # the peer drops idle connections
                        except (OSError, wire.PeerError) as exc:  # gone, or closed: nothing was sent to it
                            raise _NotOpened(str(exc)) from exc
        finally:
            for helper in helpers:
                helper.cancel("handoff over")
            await asyncio.gather(*helpers, return_exceptions=True)
            if flows is not None:
                await flows.close()

    async def _open(self, client: PeerClient) -> Flows:
        """The replica of the newest checkpoint announced, and its flows (one, to begin with)."""
        self.name = self._announced.newest()
        # Before the size is read: a commit in between only has the refused asked once more.
        self._sized_from_commit = self._announced.is_saved(self.name)
        flows = await open_flows(
            client,
            self.name,
            self.bucket,
            self._token,
            io_timeout=self._io_timeout,
            max_flows=self.max_flows,
            # A peer short of room says so now.
            nbytes=await self._announced.replica_bytes(self.name, self._expected) or None,
        )
        self._move(HandoffState.SENDING, f"replica of {self.name} opened")
        return flows

    async def _committed_since_refused(self, refused: list[str]) -> bool:
        """Wait until the trainer commits the checkpoint the ``refused`` peers had no room for (their
        open told them the plan's size, sized from the last checkpoint: this one may be smaller, and its
        open tells its own size), if it is not committed yet; whether it is, before the deadline. The
        commit may have come since they refused: that is no reason not to ask them again."""
        while not self._announced.is_saved(self._announced.newest()):
            left = self._deadline_at() - time.monotonic()
            if left <= 0:
                return False
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), min(left, KEEPALIVE))
        logger.warning(
            "peer handoff: %d peer(s) refused the plan's size; asking again with the committed checkpoint's",
            len(refused),
        )
        return True

    async def _queue_announced(self, flows: Flows) -> bool:
        """Hand the flows what was announced of the replica's checkpoint since the last call;
        whether it is all queued (the trainer committed it)."""
        assert self.name is not None
        step_dir, files = self._announced.step_dir(self.name), self._announced.finished(self.name)
        for (name, rel), stream in list(self._announced.streams.items()):
            if name == self.name and rel not in self._queued_files:
                self._queue_ranges(flows, stream)
        for rel in [rel for rel in files if rel not in self._queued_files]:
            await self._finish_file(flows, step_dir, rel)
        if not self._announced.is_saved(self.name):
            return False
        listed = await self._announced.committed_files(self.name)
        for rel in sorted(set(listed) - self._queued_files):  # files never announced
            await self._queue_file(flows, step_dir, rel)
        return True

    def _queue_ranges(self, flows: Flows, stream: Streamed) -> None:
        for offset, length in stream.todo:
            flows.send(stream.source, offset, length, self._count)
        stream.queued += stream.todo
        stream.todo.clear()

    async def _queue_file(self, flows: Flows, step_dir: Path, rel: str) -> None:
        """All of ``rel`` (finished: no ranges were announced, or they do not fit it)."""
        try:
            await flows.send_file(step_dir / rel, rel, self._count)
        except OSError as exc:
            raise _Unreadable(f"{step_dir.name}/{rel} cannot be opened to send: {exc}") from exc
        self._queued_files.add(rel)

    async def _finish_file(self, flows: Flows, step_dir: Path, rel: str) -> None:
        """``rel`` is finished (its ``file`` message came): queue what its ranges did not cover."""
        assert self.name is not None
        stream = self._announced.streams.get((self.name, rel))
        if stream is None or stream.size != self._announced.finished(self.name)[rel].size:
            self._announced.drop((self.name, rel), stale=True)
            await self._queue_file(flows, step_dir, rel)
            return
        self._queue_ranges(flows, stream)
        stream.todo.extend(_gaps(stream.queued, stream.size))  # the file message is the last word on it
        self._queue_ranges(flows, stream)
        self._announced.drop((self.name, rel))
        self._queued_files.add(rel)

    @property
    def flows(self) -> int:
        """Connections the current (or last) handoff opened; 0 before the first."""
        return self._flows.opened if self._flows is not None else 0

    def _count(self, piece: Piece) -> None:
        self.bytes_sent += piece.length

    def _stall_limit(self) -> float:
        """Seconds a peer may acknowledge nothing while bytes wait before it is left (Flows.watch)."""
        left = self._deadline_at() - time.monotonic()
        return max(STALL_MIN, min(self._io_timeout, STALL_SHARE * left))

    def _deadline_at(self) -> float:
        """The current plan's deadline (monotonic): a plan revised while the handoff runs moves it."""
        return self._deadline if self._deadline is not None else math.inf

    def _remaining(self) -> int:
        """Bytes still to cross: the plan's size less what went, at least what is queued."""
        backlog = self._flows.backlog if self._flows is not None else 0
        return max(self._expected - self.bytes_sent, backlog)

    def status(self) -> dict[str, Any]:
        return {
            "state": str(self.state),
            "peer": self.peer,
            "name": self.name,
            "bytes_sent": self.bytes_sent,
            "seconds": None if self.seconds is None else round(self.seconds, 3),
            "error": self.error,
            "flows": self.flows,
            "moves": self.moves,
            "totals": dict(self.totals),
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


__all__ = ["MAX_MOVES", "Handoff", "HandoffState"]
