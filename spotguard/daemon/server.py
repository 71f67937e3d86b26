"""The daemon's Unix socket: trainer hooks and the CLI talk to it here.

Garbage on the socket gets an error reply and a log line, never a crash; a
client the daemon cannot trust (wrong uid/gid) or cannot serve (too many
connections) is refused with an error and disconnected.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import stat
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotguard import protocol

logger = logging.getLogger("spotguard.daemon")

_PEERCRED = struct.Struct("3i")  # struct ucred { pid_t pid; uid_t uid; gid_t gid; }
_WRITE_TIMEOUT = 2.0  # a client that does not read its replies must not stall the others


def _groups_of(pid: int, primary_gid: int) -> set[int]:
    """The peer's primary and supplementary groups: a trainer is often in the spotguard group
    only as a supplementary one. SO_PEERCRED carries the primary gid; /proc has the rest."""
    groups = {primary_gid}
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("Groups:"):
                    groups.update(int(g) for g in line.split()[1:])
                    break
    except (OSError, ValueError):
        pass  # the peer exited, or no /proc: the primary gid still counts
    return groups


@dataclass
class Peer:
    id: int
    pid: int
    uid: int
    gid: int
    writer: asyncio.StreamWriter = field(repr=False)
    hello: dict[str, Any] | None = None  # set once a trainer introduced itself
    # Notices this trainer was told of (event id -> loop time) and those it reached a checkpoint point for.
    told: dict[str, float] = field(default_factory=dict)
    acted: set[str] = field(default_factory=set)

    @property
    def is_trainer(self) -> bool:
        return self.hello is not None

    async def send(self, message_type: str, **fields: Any) -> bool:
        """Send one message; False if the peer is gone or too slow (it is then disconnected)."""
        if self.writer.is_closing():
            return False
        try:
            self.writer.write(protocol.encode(message_type, **fields))
            await asyncio.wait_for(self.writer.drain(), _WRITE_TIMEOUT)
        except (OSError, TimeoutError, ConnectionError):
            self.writer.close()
            return False
        return True


Reply = tuple[str, dict[str, Any]]
# A handler answers one decoded message with one or more replies, or raises ProtocolError.
Handler = Callable[[Peer, dict[str, Any]], Awaitable[list[Reply]]]


class SocketServer:
    def __init__(
        self,
        path: Path,
        handler: Handler,
        *,
        allowed_uids: tuple[int, ...],
        allowed_gids: tuple[int, ...] = (),
        trainer_uids: tuple[int, ...] = (),
        max_message_bytes: int = protocol.MAX_MESSAGE_BYTES,
        max_connections: int = 64,
        on_disconnect: Callable[[Peer], None] | None = None,
    ) -> None:
        self.path = path
        self._handler = handler
        self._allowed_uids = allowed_uids
        self._allowed_gids = frozenset(allowed_gids)
        self._trainer_uids = frozenset(trainer_uids)
        self._limit = max_message_bytes
        self._max_connections = max_connections
        self._on_disconnect = on_disconnect
        self._ids = itertools.count(1)
        self.peers: dict[int, Peer] = {}
        self._server: asyncio.base_events.Server | None = None
        self.refused = 0

    async def start(self) -> None:
        self._remove_stale_socket()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # The stream limit is the largest line we accept; longer ones raise in readline.
        self._server = await asyncio.start_unix_server(self._serve, path=os.fspath(self.path), limit=self._limit)
        os.chmod(self.path, 0o660)  # the owner and the trainers' group; see allowed_uids/gids
        logger.info("listening on %s", self.path)

    def _remove_stale_socket(self) -> None:
        try:
            mode = self.path.lstat().st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            # Never unlink what we did not make: a symlink here could point anywhere.
            kind = "a symlink" if stat.S_ISLNK(mode) else "not a socket"
            raise RuntimeError(f"{self.path} exists and is {kind}; refusing to replace it (remove it by hand)")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(os.fspath(self.path))
        except OSError:
            self.path.unlink()  # left behind by a daemon that died; nobody listens
        else:
            raise RuntimeError(f"another spotguard daemon is already listening on {self.path}")
        finally:
            probe.close()

    async def stop_accepting(self) -> None:
        """Take no new connections; the ones open keep being served."""
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    async def close(self) -> None:
        await self.stop_accepting()
        for peer in list(self.peers.values()):
            peer.writer.close()
        if self._server is not None:
            await self._server.wait_closed()

    def trainers(self) -> list[Peer]:
        return [peer for peer in self.peers.values() if peer.is_trainer]

    async def broadcast(self, message_type: str, **fields: Any) -> int:
        """Send to every connected trainer at once; returns how many got it."""
        results = await asyncio.gather(*(peer.send(message_type, **fields) for peer in self.trainers()))
        return sum(results)

    def _credentials(self, writer: asyncio.StreamWriter) -> tuple[int, int, int]:
        sock = writer.get_extra_info("socket")
        pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        return pid, uid, gid

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pid, uid, gid = self._credentials(writer)
        peer = Peer(next(self._ids), pid, uid, gid, writer)
        if (
            uid not in self._allowed_uids
            and uid not in self._trainer_uids
            and not self._allowed_gids.intersection(_groups_of(pid, gid))
        ):
            logger.warning(
                "refused pid %d: uid %d / gid %d not in allowed_uids/allowed_gids/trainer_uids", pid, uid, gid
            )
            await self._refuse(peer, "forbidden", f"uid {uid} may not use this socket; see allowed_uids, trainer_uids")
            return
        if len(self.peers) >= self._max_connections:
            logger.warning("refused pid %d: %d connections already (max_connections)", pid, len(self.peers))
            await self._refuse(peer, "busy", f"the daemon serves at most {self._max_connections} connections")
            return
        self.peers[peer.id] = peer
        try:
            await self._read_loop(peer, reader)
        finally:
            self.peers.pop(peer.id, None)
            writer.close()
            if self._on_disconnect:
                self._on_disconnect(peer)

    async def _refuse(self, peer: Peer, code: str, message: str) -> None:
        self.refused += 1
        await peer.send("error", code=code, message=message)
        peer.writer.close()

    async def _read_loop(self, peer: Peer, reader: asyncio.StreamReader) -> None:
        while True:
            try:
                line = await reader.readline()
            except (ValueError, asyncio.LimitOverrunError):
                # Framing is lost once a line overruns the limit; say why and hang up.
                logger.warning("pid %d sent a message over %d bytes; disconnecting it", peer.pid, self._limit)
                await peer.send("error", code="too-large", message=f"messages are limited to {self._limit} bytes")
                return
            except ConnectionError:
                return
            if not line:
                return
            if not line.strip():
                continue
            # An error names the request it answers (``re``) once that decoded: a hook waiting for
            # another reply is not woken by it.
            answering: dict[str, str] = {}
            try:
                message = protocol.decode(line, allowed=protocol.CLIENT_TYPES, limit=self._limit)
                answering = {"re": message["type"]}
                replies = await self._handler(peer, message)
            except protocol.ProtocolError as exc:
                logger.warning("pid %d: %s: %s", peer.pid, exc.code, exc)
                replies = [("error", {"code": exc.code, "message": str(exc), **answering})]
            except Exception as exc:  # a bug in one request must not take the daemon down
                logger.exception("pid %d: internal error handling a request", peer.pid)
                replies = [("error", {"code": "internal", "message": f"internal error: {exc}", **answering})]
            for reply_type, fields in replies:
                if not await peer.send(reply_type, **fields):
                    return
