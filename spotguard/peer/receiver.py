"""The listening side of the peer tier: a daemon takes another's urgent checkpoint over the wire.

:class:`PeerReceiver` serves ``peer_listen`` (the protocol: docs/peer-protocol.md): it runs each
connection's handshake (spotguard/peer/channel.py), answers its requests and writes the data frames
of its replica to disk.

The port is bounded: connections still in their handshake have a pool of their own
(:data:`HANDSHAKE_POOL`, each with :data:`~spotguard.peer.channel.HANDSHAKE_TIMEOUT` seconds; while
several addresses wait, at most :data:`HANDSHAKES_PER_SOURCE` from one); a new one that finds the pool
full closes one that has sent nothing or stalled, a suspect's first (:meth:`PeerReceiver._make_room`),
and one over its address's share closes that address's oldest. Authenticated connections count
against ``max_connections`` only. So idle strangers, however many and from however many addresses,
never close a job's peer's handshake once it has begun. Refusals are counted, and logged a few lines
a minute at most (:data:`REFUSALS_LOGGED_EVERY`). A peer silent for ``io_timeout`` seconds
mid-record (or idle between frames for :data:`IDLE_TIMEOUT`) is dropped, and its unfinished replica
with it.

What becomes of a replica once received (verified against the sender's manifest, committed in the
shared bucket, removed) is its :class:`~spotguard.peer.replicas.ReplicaStore`'s.

:class:`~spotguard.peer.client.PeerClient` is the sending side. A fresh VM's daemon may fetch a
verified replica back to resume from it (spotguard/peer/fetch.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotguard.manifest import parse_step_dir
from spotguard.peer import noise, wire, workers
from spotguard.peer.admission import Admission, ReplicaLimits
from spotguard.peer.channel import IO_TIMEOUT, Channel, PeerGone, tune_socket
from spotguard.peer.files import (
    Extents,
    check_bucket_key,
    check_range,
    data_header,
    disk_write,
    make_parent,
    make_room,
    new_file_on_disk,
    write_range,
)
from spotguard.peer.handshake import GREETING, HANDSHAKE_TIMEOUT, accept, refusal
from spotguard.peer.replicas import Replica, ReplicaState, ReplicaStore
from spotguard.peer.tokens import JobToken, PeerToken
from spotguard.repeats import Latest, RepeatedEvents
from spotguard.storage.base import Storage

logger = logging.getLogger("spotguard.peers")

IDLE_TIMEOUT = 30.0  # seconds without a frame before an authenticated connection is dropped
HANDSHAKE_POOL = 16  # connections in their handshake at once
HANDSHAKES_PER_SOURCE = 4  # of which from one address
# A handshake still unfinished this many seconds after it began is stalled: a peer's takes milliseconds.
STALLED_AFTER = 1.0
# An address whose connection was dropped from the pool silent or stalled is suspect this long: its
# newcomers may take the place only of other suspects' connections.
SUSPECT_FOR = 60.0
SUSPECTS_KEPT = 4096  # addresses remembered as suspect (the newest)
REFUSALS_LOGGED_EVERY = 60.0  # seconds between two log lines of one kind of refusal (each one is counted)


# A request frame's handler: (receiver, header, channel, peer address); it writes its answer.
RequestHandler = Callable[["PeerReceiver", dict[str, Any], Channel, str], Awaitable[None]]


@dataclass
class _Session:
    """What one authenticated connection holds: the replica it opened, or joined (another flow of
    the sender's: its data frames count the same, but only the opener commits, and only the
    opener's end drops an unfinished replica)."""

    replica: Replica | None = None
    opened: bool = False


@dataclass
class _Pending:
    """A connection in its handshake: its address and port, its stream (which counts the bytes it
    sent) and when it was accepted."""

    who: str  # host:port
    stream: wire.FrameStream
    since: float = field(default_factory=time.monotonic)

    @property
    def source(self) -> str:
        """Its address (the per-source limit and the suspects go by address, not port)."""
        return self.who.rpartition(":")[0]

    def stale(self, now: float) -> bool:
        """Whether it has sent nothing, or stalled: nothing a peer ever does."""
        return not self.stream.received or now - self.since > STALLED_AFTER


class _Evicted(Exception):
    """A connection of the handshake pool closed for a newcomer (:meth:`PeerReceiver._evict`)."""


@dataclass(frozen=True)
class ReceiverLimits:
    """A receiver's bounds: the replicas it takes (``replicas``), the authenticated connections it serves
    at once (``max_connections``), the uploads of committed replicas it runs at once (``concurrency``), the
    seconds a peer may stay silent mid-record (``io_timeout``) and a handshake may take (``handshake_timeout``)."""

    replicas: ReplicaLimits = field(default_factory=ReplicaLimits)
    max_connections: int = 16  # two senders of 8 flows each
    concurrency: int = 8
    io_timeout: float = IO_TIMEOUT
    handshake_timeout: float = HANDSHAKE_TIMEOUT


class PeerReceiver:
    """Takes replicas from authenticated peers and commits them in ``storage``.

    >>> receiver = PeerReceiver(root / "peer-replicas", storage, token=token, host="0.0.0.0", port=7140,
    ...                         busy=lambda: daemon_has_a_hard_notice)
    >>> address = await receiver.start()
    """

    def __init__(
        self,
        area: Path,
        storage: Storage | None,
        *,
        token: PeerToken,
        host: str,
        port: int,
        busy: Callable[[], bool] = lambda: False,
        limits: ReceiverLimits = ReceiverLimits(),
    ) -> None:
        self.area = area
        self.storage = storage
        self._token = JobToken.of(token)  # never logged, never sent
        self.host = host
        self.port = port
        self.busy = busy
        self.limits = limits
        # This daemon's, told in every state answer: a sender whose list names itself (one static
        # peers list for a whole fleet) knows its own receiver and passes it over.
        self.instance = uuid.uuid4().hex
        admission = Admission(area, limits.replicas)
        self.store = ReplicaStore(area, storage, concurrency=limits.concurrency, admission=admission)
        self.refused = 0  # connections that failed to authenticate or broke the protocol
        # Connections authenticated, by the token they proved: a rotation is over for this daemon's
        # peers once no more come with the previous one (status, metrics).
        self.handshakes = {"token": 0, "previous_token": 0}
        self.address: str | None = None
        self._server: asyncio.Server | None = None
        self._psk = b""  # from the token, at start
        self._previous_psk: bytes | None = None  # from the token it replaces, during a rotation
        self._connections = 0  # authenticated
        self._pending: dict[asyncio.StreamWriter, _Pending] = {}  # in their handshake, oldest first
        self._suspects: Latest[str, float] = Latest(SUSPECTS_KEPT)  # address -> when it became suspect
        self._refusals_logged = RepeatedEvents(REFUSALS_LOGGED_EVERY)
        self._writers: set[asyncio.StreamWriter] = set()  # open connections, closed with the receiver
        self.handlers: dict[str, RequestHandler] = {}  # more request types (frame type -> handler)

    @property
    def replicas(self) -> dict[str, Replica]:
        """The replicas held now, by id."""
        return self.store.replicas

    # --- serving ----------------------------------------------------------------------

    async def start(self) -> str:
        """Resume what a restart left in the area, then listen; returns ``host:port`` (the real port)."""
        await self.store.resume()
        self._psk = await asyncio.to_thread(noise.derive_psk, self._token.current)
        if self._token.previous is not None:
            self._previous_psk = await asyncio.to_thread(noise.derive_psk, self._token.previous)
        self._server = await wire.start_server(self._serve, self.host, self.port)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"{self.host}:{port}"
        logger.info("peer receiver listening on %s", self.address)
        return self.address

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.close()  # their handlers see the connection end and clean up unfinished replicas
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        await self.store.close()

    async def _serve(self, stream: wire.FrameStream, writer: asyncio.StreamWriter) -> None:
        peername = writer.get_extra_info("peername")
        who = f"{peername[0]}:{peername[1]}" if isinstance(peername, tuple) else "?"
        tune_socket(writer.get_extra_info("socket"), self.limits.io_timeout)
        channel: Channel | None = None
        session = _Session()
        self._writers.add(writer)
        try:
            channel = await self._handshake(stream, writer, who)
            channel.leave_when_gone = True  # a sender's host gone frees its replica's slot in seconds
            self.handshakes["previous_token" if channel.with_previous_token else "token"] += 1
            self._connections += 1
            if self._connections > self.limits.max_connections:
                raise wire.PeerError("busy", f"at most {self.limits.max_connections} peer connections")
            while True:
                # Between requests a sender may wait for its trainer (it pings): the idle limit applies.
                # Only the opener's commit may be big (it carries the manifest): no other frame makes
                # the daemon hold or parse MiBs of JSON.
                big = "commit" if session.opened and session.replica is not None else None
                header = await asyncio.wait_for(channel.read_frame(timeout=IDLE_TIMEOUT, big=big), IDLE_TIMEOUT)
                await self._request(header, channel, who, session)
                await channel.drain()
        except wire.PeerError as exc:
            # The replica goes before the answer does: a sender told "no" may open its next one at
            # once, and must find this one's slot and bytes free again.
            await self._drop_unfinished(session, f"refused: {exc}")
            self._refuse(writer, channel, who, exc)
        except PeerGone as exc:
            self._log_refusal("lost", logging.WARNING, "peer %s: connection lost: %s", who, exc)
        except TimeoutError:
            self.refused += 1
            slow = "peer %s: too slow (its handshake, a record, or idle); closing the connection"
            self._log_refusal("too slow", logging.WARNING, slow, who)
        except _Evicted:
            pass
        except (OSError, asyncio.IncompleteReadError) as exc:
            self._log_refusal("lost", logging.WARNING, "peer %s: connection lost: %s", who, exc)
        except Exception as exc:  # a bug of ours: this connection ends with an answer, the port goes on
            logger.exception("peer %s: internal error", who)
            await self._drop_unfinished(session)
            self._refuse(writer, channel, who, wire.PeerError("internal", f"internal error ({type(exc).__name__})"))
        finally:
            if channel is not None:
                self._connections -= 1
            self._writers.discard(writer)
            await self._drop_unfinished(session)
            writer.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.limits.io_timeout):
                    await writer.wait_closed()

    async def _drop_unfinished(self, session: _Session, why: str = "the sender went away unfinished") -> None:
        """The replica this connection opened and did not finish is deleted, its slot released: a sender
        that died or was refused mid-stream leaves nothing that could count as complete."""
        replica = session.replica if session.opened else None
        if replica is None or replica.state is not ReplicaState.RECEIVING:
            return
        session.replica = None
        with contextlib.suppress(Exception):
            await replica.settle()  # no write may land after the removal
        await asyncio.to_thread(self.store.move, replica, ReplicaState.DELETED, why)

    async def _handshake(self, stream: wire.FrameStream, writer: asyncio.StreamWriter, who: str) -> Channel:
        """The connection's handshake, in the bounded pool of unauthenticated connections."""
        pending = _Pending(who, stream)
        if not self._make_room(pending.source):
            writer.write(GREETING)  # then the refusal: an initiator reads it as the answer to its message
            raise wire.PeerError("busy", "too many connections in their handshake; try again")
        self._pending[writer] = pending
        try:
            async with asyncio.timeout(self.limits.handshake_timeout):
                return await accept(
                    stream, writer, self._psk, previous_psk=self._previous_psk, io_timeout=self.limits.io_timeout
                )
        except TimeoutError:
            self._suspects.put(pending.source, time.monotonic())
            raise
        except (OSError, asyncio.IncompleteReadError, wire.PeerError):
            # Closed by _evict for a newcomer (counted and logged there): not a lost connection, nor
            # one that closed before its handshake as an old daemon does.
            if writer not in self._pending:
                raise _Evicted from None
            raise
        finally:
            self._pending.pop(writer, None)

    def _make_room(self, source: str) -> bool:
        """Room in the handshake pool for a newcomer from ``source``; False if it has none. While others
        wait too, an address keeps at most :data:`HANDSHAKES_PER_SOURCE` (its oldest silent one goes,
        else its oldest). A full pool loses a connection that sent nothing, or stalled, and of those
        first a suspect's (an address whose connection was dropped so before), the oldest first: a
        peer sends its first message at once and finishes within milliseconds, so no number of idle
        strangers can drop it, and they become suspects themselves. A suspect's newcomer may take the
        place only of another suspect's connection. One address alone may burst up to the pool (a
        sender's several flows, a resume's probes)."""
        mine = [writer for writer, pending in self._pending.items() if pending.source == source]
        if len(mine) >= HANDSHAKES_PER_SOURCE and len(mine) < len(self._pending):
            silent = [writer for writer in mine if not self._pending[writer].stream.received]
            self._evict((silent or mine)[0])
        if len(self._pending) < HANDSHAKE_POOL:
            return True
        now = time.monotonic()
        stale = [writer for writer, pending in self._pending.items() if pending.stale(now)]
        suspects = [writer for writer in stale if self._suspect(self._pending[writer].source, now)]
        choices = suspects if self._suspect(source, now) else suspects + stale
        if not choices:
            return False
        victim = min(choices, key=lambda writer: bool(self._pending[writer].stream.received))  # silent first
        self._suspects.put(self._pending[victim].source, now)
        self._evict(victim)
        return True

    def _suspect(self, source: str, now: float) -> bool:
        since = self._suspects.get(source)
        return since is not None and now - since < SUSPECT_FOR

    def _evict(self, writer: asyncio.StreamWriter) -> None:
        """Close a connection of the handshake pool for a newcomer: a refusal like any other, counted
        (an idle stranger flooding the pool shows in ``refused``) and logged once a minute at most."""
        pending = self._pending.pop(writer)
        self.refused += 1
        dropped = "peer %s: still in its handshake while newer ones wait; closing it"
        self._log_refusal("dropped for a newcomer", logging.INFO, dropped, pending.who)
        writer.transport.abort()

    def _log_refusal(self, kind: str, level: int, message: str, *args: object) -> None:
        """A refusal's log line, for the first of ``kind`` and then one every
        :data:`REFUSALS_LOGGED_EVERY` seconds, saying how many went unlogged meanwhile: strangers can
        cause thousands a second (each is still counted in ``refused``)."""
        unlogged = self._refusals_logged.due(kind)
        if unlogged is None:
            return
        if unlogged:
            message += " (and %d more like it since the last one logged)"
            args = (*args, unlogged)
        logger.log(level, message, *args)

    def _refuse(self, writer: asyncio.StreamWriter, channel: Channel | None, who: str, exc: wire.PeerError) -> None:
        if exc.code == "closed":
            if channel is None:  # a spotguard-peer/1 daemon closes on our greeting: it is refused there
                self._log_refusal("closed", logging.INFO, "peer %s: closed the connection before its handshake"
                                  " (an old daemon needs an upgrade to spotguard-peer/2)", who)  # fmt: skip
            return
        self.refused += 1
        kind = f"{'peer' if channel is not None else 'handshake'} {exc.code}"
        self._log_refusal(kind, logging.WARNING, "peer %s: %s; closing the connection", who, exc)
        with contextlib.suppress(OSError, RuntimeError):
            if channel is not None:
                channel.write(wire.error_frame(exc.code, exc.message))
            else:
                writer.write(refusal(exc.code, exc.message))

    async def _request(self, header: dict[str, Any], channel: Channel, who: str, session: _Session) -> None:
        kind = header["t"]
        if kind == "ping":
            return  # a sender waiting for its trainer's next file keeps the connection alive
        if kind == "query":
            channel.write(wire.encode(self.state_frame()))
            return
        if kind in ("replica", "join"):
            if session.replica is not None:
                raise wire.PeerError("bad-frame", "one replica per connection")
            session.opened = kind == "replica"
            session.replica = await self._open(header, who) if session.opened else self._join(header, who)
            # Data frames follow: a worker to receive each flow's, another to write the last one.
            workers.pool().warm(2 * self._connections)
            channel.write(wire.encode({"t": "ok", "id": session.replica.id}))
            return
        if kind in self.handlers:  # e.g. list and fetch: spotguard/peer/fetch.py
            await self.handlers[kind](self, header, channel, who)
            return
        replica = session.replica
        if replica is None:
            raise wire.PeerError("bad-frame", f"{kind!r} before a replica was opened")
        if kind == "data":
            await self._data(replica, header, channel)
        elif kind == "done" and not session.opened:  # a joined flow's last request
            session.replica = None
            channel.write(wire.encode({"t": "ok"}))
        elif kind == "commit" and session.opened:
            self._refuse_if_going()
            replica.committing = True  # no joined flow's frame may land while (or after) it is checked
            await self.store.commit(replica, header)
            channel.write(wire.encode({"t": "ok", "state": str(replica.state)}))
            self.store.schedule_upload(replica)
            session.replica = None  # the connection no longer holds it
        elif kind in ("done", "commit"):
            how = "opened" if session.opened else "joined"
            raise wire.PeerError("bad-frame", f"{kind!r} on a connection that {how} the replica")
        else:
            raise wire.PeerError("bad-frame", f"unknown frame type {kind!r}")

    def _join(self, header: dict[str, Any], who: str) -> Replica:
        """The replica another connection from the same host opened and is still sending."""
        replica_id = wire.field(header, "id", str)
        replica = self.replicas.get(replica_id)
        if replica is None or not replica.receiving:
            raise wire.PeerError("gone", f"no replica {replica_id[:60]!r} is being received")
        if replica.sender.rpartition(":")[0] != who.rpartition(":")[0]:
            raise wire.PeerError("bad-field", f"replica {replica_id} was opened from another host")
        return replica

    def state_frame(self) -> dict[str, Any]:
        return {
            "t": "state",
            "busy": self.busy(),
            "bucket": self.storage.url if self.storage is not None else None,
            "replicas": len(self.replicas),
            "instance": self.instance,
        }

    async def _open(self, header: dict[str, Any], who: str) -> Replica:
        name = wire.field(header, "name", str)
        bucket = wire.field(header, "bucket", str)
        if self.storage is None or bucket != self.storage.url:
            raise wire.PeerError(
                "bucket", f"this daemon commits only to {self.storage.url if self.storage else 'no bucket'}"
            )
        if parse_step_dir(name) is None:
            raise wire.PeerError("bad-field", f"{name[:40]!r} is not a checkpoint name")
        self._refuse_if_going()
        announced = header.get("bytes")  # optional: the replica's size, when the sender knows it
        if announced is not None and (isinstance(announced, bool) or not isinstance(announced, int) or announced < 0):
            raise wire.PeerError("bad-field", "'bytes' must be a non-negative integer")
        return await self.store.create(name, bucket, who, announced)  # slot and bytes taken before it awaits

    def _refuse_if_going(self) -> None:
        """A daemon with a hard notice of its own takes no more of a replica still coming in: its disk
        and link go to its own checkpoint, and its VM goes soon. Its sender hears ``busy`` (or finds
        the connection closed) and hands the replica to another peer; replicas already verified
        are still committed in the bucket, as far as the time allows."""
        if self.busy():
            raise wire.PeerError("busy", "this daemon got a hard notice of its own; send the replica elsewhere")

    async def _data(self, replica: Replica, header: dict[str, Any], channel: Channel) -> None:
        if not replica.receiving:
            raise wire.PeerError("gone", f"{replica.id} is no longer being received")
        self._refuse_if_going()
        rel, size, offset, length = data_header(header)
        check_range(rel, size, offset, length)
        sizes = replica.sizes
        if sizes.get(rel, size) != size:
            raise wire.PeerError("bad-field", f"{rel}: size {size}, announced before as {sizes[rel]}")
        if rel not in sizes:  # a new file: declared, and counted with the directories it makes, before any await
            if self.storage is not None:
                check_bucket_key(self.storage.url, replica.name, rel)
            taken, fresh = new_file_on_disk(rel, size, replica.directories)
            disk = replica.disk + taken
            self.store.admission.grow(replica.id, replica.bytes + size, len(sizes) + 1, size, disk)
            replica.directories.update(fresh)
            replica.disk, sizes[rel] = disk, size
            # Its directory, once per file (only this daemon writes in its area); a frame of the same
            # file on another flow waits for it too.
            replica.parents[rel] = asyncio.ensure_future(asyncio.to_thread(make_parent, replica.step_dir, rel))
        await replica.parents[rel]
        # The write goes on in a thread while the next frame is read; a few at most per connection, each
        # holding its buffer until it is done.
        if replica.taken.setdefault(rel, Extents()).add(offset, offset + length):
            # It overlaps a range that may still be being written (a file the sender's trainer wrote
            # again, a piece sent again after a flow failed): that one lands first. (The overlap then
            # makes the commit read the file back.) Ranges of other flows that only adjoin need not wait.
            await replica.settle()
        await make_room(replica.writes)
        worker = workers.take_for(length) if channel.can_hand_over() else None
        if worker is not None:
            await self._data_by(worker, replica, channel, (rel, offset, length))
            return
        free = replica.buffers
        buffer = free.pop() if free else bytearray(wire.SEND_CHUNK)
        if len(buffer) < length:  # a bigger frame (at most MAX_DATA): the smaller buffer goes
            buffer = bytearray(length)
        data = memoryview(buffer)[:length]
        await channel.readinto(data)  # decrypted straight into the buffer the disk write takes
        if not replica.receiving:  # committed (or dropped) while this frame came in on a joined flow
            free.append(buffer)
            raise wire.PeerError("gone", f"{replica.id} is no longer being received")
        ranges = replica.ranges.setdefault(rel, [])
        written = asyncio.to_thread(write_range, replica.step_dir, rel, offset, data, ranges)
        write = asyncio.ensure_future(disk_write(written, f"{replica.name}/{rel}"))
        write.add_done_callback(lambda _: free.append(buffer))
        replica.writes.add(write)  # the set as it is now: another flow's settle may have run meanwhile

    @staticmethod
    async def _data_by(
        worker: workers.Worker, replica: Replica, channel: Channel, header: tuple[str, int, int]
    ) -> None:
        """A data frame's payload received by a worker process (spotguard/peer/workers.py), then written
        by it while the connection's next frame is read (counted among the replica's writes)."""
        rel, offset, length = header
        await channel.receive_payload_by(worker, length)
        if not replica.receiving:  # committed (or dropped) while this frame came in on a joined flow
            await worker.drop()
            raise wire.PeerError("gone", f"{replica.id} is no longer being received")
        written = worker.write(replica.step_dir / rel, offset, length, replica.ranges.setdefault(rel, []))
        write = asyncio.ensure_future(disk_write(written, f"{replica.name}/{rel}"))
        replica.writes.add(write)

    def status(self) -> dict[str, Any]:
        return {
            "listen": self.address,
            "replicas": [replica.to_json() for replica in self.replicas.values()],
            "refused": self.refused,
            "handshakes": dict(self.handshakes),
            "workers": workers.pool().status(),
        }


__all__ = ["HANDSHAKES_PER_SOURCE", "HANDSHAKE_POOL", "IDLE_TIMEOUT", "PeerReceiver", "RequestHandler"]
