"""The peer tier: a daemon holds another's urgent checkpoint and commits it in the shared bucket.

:class:`PeerReceiver` serves ``peer_listen`` (wire format and authentication: spotguard/peerwire.py).
A replica lives under ``<checkpoint root>/peer-replicas/<id>/`` (``peer-replicas`` is never a step
directory, so the daemon's own scans, retention and resume never see it) as ``replica.json`` (its
state and bucket) and the checkpoint's own step directory. Its lifecycle, moved in one place:

``receiving`` -> ``verified`` (every file matches the sender's manifest, CRC32C included; the
manifest is then written last, as a trainer would) -> ``uploaded`` (committed in the bucket at the
keys the sender would have used, manifest last) -> ``deleted``.

A connection that ends before its replica is verified leaves nothing: the replica is deleted. After a
restart the area is read again: verified replicas are uploaded, anything else is deleted.

:class:`PeerClient` is the sending side. A fresh VM's daemon may fetch a verified replica back to
resume from it (spotguard/daemon/peerfetch.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, BinaryIO

from spotguard import peerwire
from spotguard.crc32c import crc32c_combine, crc32c_hex_to_int, crc32c_of_bytes, crc32c_of_file
from spotguard.manifest import (
    MANIFEST,
    PART_PREFIX,
    FileEntry,
    Manifest,
    ManifestError,
    check_relpath,
    load_manifest,
    load_part,
    node_holdings,
    parse_step_dir,
    verify_dir,
    write_part,
)
from spotguard.safefile import atomic_file, fsync_dir
from spotguard.storage.base import Storage, StorageError
from spotguard.storage.checkpoints import (
    CommitLost,
    OtherNodesMissing,
    commit_remote,
    upload_checkpoint,
    upload_files,
    wait_for_other_nodes,
)

logger = logging.getLogger("spotguard.peers")

AREA = "peer-replicas"
_META = "replica.json"
_AUTH_TIMEOUT = 5.0  # seconds a connection has to authenticate
_IDLE_TIMEOUT = 30.0  # seconds without a frame before an authenticated connection is dropped
_UPLOAD_RETRY = 5.0  # seconds between attempts to commit a verified replica
# How long a replica of node 0's share waits for the other nodes' files before it gives up (as node 0 would).
OTHER_NODES_WAIT = 600.0
# Disk writes of one connection in flight while its next frame is read (memory: one more than this
# x the frame size, at most MAX_DATA).
_WRITES_IN_FLIGHT = 8


# A request frame's handler: (receiver, header, reader, writer, peer address); it writes its answer.
RequestHandler = Callable[["PeerReceiver", dict[str, Any], peerwire.Reads, asyncio.StreamWriter, str], Awaitable[None]]


class ReplicaState(StrEnum):
    RECEIVING = "receiving"
    VERIFIED = "verified"
    UPLOADED = "uploaded"
    DELETED = "deleted"


@dataclass
class Replica:
    id: str
    name: str  # the checkpoint's step directory, as in the bucket
    bucket: str
    sender: str
    dir: Path  # <area>/<id>
    state: ReplicaState = ReplicaState.RECEIVING
    sizes: dict[str, int] = field(default_factory=dict)  # declared size of each file received so far
    error: str | None = None
    writes: set[asyncio.Future[None]] = field(default_factory=set)  # disk writes not yet finished
    # (offset, length, CRC32C) of every range written, per file: verified without reading the file back.
    ranges: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)
    buffers: list[bytearray] = field(default_factory=list)  # payload buffers no write holds, reused
    ends: dict[str, int] = field(default_factory=dict)  # per file, the furthest end of a range written

    async def settle(self) -> None:
        """Wait for every disk write in flight; raise the first that failed."""
        pending, self.writes = self.writes, set()
        results = await asyncio.gather(*pending, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    @property
    def step_dir(self) -> Path:
        return self.dir / self.name

    @property
    def bytes(self) -> int:
        return sum(self.sizes.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "state": str(self.state),
            "sender": self.sender,
            "bytes": self.bytes,
            "error": self.error,
        }


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
        token: bytes,
        host: str,
        port: int,
        busy: Callable[[], bool] = lambda: False,
        max_replica_bytes: int = 1 << 40,
        max_replicas: int = 2,
        max_connections: int = 8,
        concurrency: int = 8,
    ) -> None:
        self.area = area
        self.storage = storage
        self._token = token  # never logged, never sent
        self.host = host
        self.port = port
        self.busy = busy
        self.max_replica_bytes = max_replica_bytes
        self.max_replicas = max_replicas
        self.max_connections = max_connections
        self.concurrency = concurrency
        self.replicas: dict[str, Replica] = {}
        self.refused = 0  # connections that failed to authenticate or broke the protocol
        self.address: str | None = None
        self._server: asyncio.Server | None = None
        self._connections = 0
        self._writers: set[asyncio.StreamWriter] = set()  # open connections, closed with the receiver
        self._uploads: set[asyncio.Task[None]] = set()
        self._upload_slots = asyncio.Semaphore(1)  # one replica at a time: each is parallel inside
        self.handlers: dict[str, RequestHandler] = {}  # more request types (frame type -> handler)

    # --- lifecycle of a replica (the one place it moves) ---------------------------------

    def _move(self, replica: Replica, state: ReplicaState, why: str = "") -> None:
        old = replica.state if replica.id in self.replicas else "new"
        replica.state = state
        logger.info(
            "replica %s (%s from %s): %s -> %s%s", replica.id, replica.name, replica.sender, old, state,
            f" ({why})" if why else "",
        )  # fmt: skip
        if state is ReplicaState.DELETED:
            self.replicas.pop(replica.id, None)
            shutil.rmtree(replica.dir, ignore_errors=True)
            return
        self.replicas[replica.id] = replica
        meta = {"name": replica.name, "bucket": replica.bucket, "sender": replica.sender, "state": str(state)}
        with atomic_file(replica.dir / _META) as out:
            out.write(json.dumps(meta).encode())

    # --- serving ----------------------------------------------------------------------

    async def start(self) -> str:
        """Resume what a restart left in the area, then listen; returns ``host:port`` (the real port)."""
        await asyncio.to_thread(self.area.mkdir, parents=True, exist_ok=True)
        for replica in await asyncio.to_thread(self._recover):
            self._schedule_upload(replica)
        self._server = await peerwire.start_server(self._serve, self.host, self.port)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"{self.host}:{port}"
        logger.info("peer receiver listening on %s", self.address)
        return self.address

    def _recover(self) -> list[Replica]:
        """Verified replicas to upload again; everything else in the area is removed."""
        found = []
        for entry in sorted(self.area.iterdir()):
            replica = None
            try:
                meta = json.loads((entry / _META).read_bytes())
                replica = Replica(entry.name, meta["name"], meta["bucket"], meta["sender"], entry)
                replica.state = ReplicaState(meta["state"])
            except (OSError, ValueError, KeyError, TypeError):
                pass
            if (
                replica is not None
                and replica.state is ReplicaState.VERIFIED
                and self.storage is not None
                and replica.bucket == self.storage.url
                and parse_step_dir(replica.name) is not None
                and (not verify_dir(replica.step_dir) or load_part(replica.step_dir) is not None)
            ):
                logger.warning("replica %s (%s) was verified before a restart: committing it", entry.name, replica.name)
                self.replicas[replica.id] = replica
                found.append(replica)
                continue
            logger.warning("removing %s: a replica never verified before a restart", entry)
            shutil.rmtree(entry, ignore_errors=True)
        return found

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.close()  # their handlers see the connection end and clean up unfinished replicas
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        for task in list(self._uploads):
            task.cancel("daemon shutting down")
        await asyncio.gather(*self._uploads, return_exceptions=True)

    async def _serve(self, reader: peerwire.FrameStream, writer: asyncio.StreamWriter) -> None:
        peername = writer.get_extra_info("peername")
        who = f"{peername[0]}:{peername[1]}" if isinstance(peername, tuple) else "?"
        replica: Replica | None = None
        self._connections += 1
        self._writers.add(writer)
        try:
            if self._connections > self.max_connections:
                writer.write(peerwire.error_frame("busy", f"at most {self.max_connections} peer connections"))
                return
            await asyncio.wait_for(self._authenticate(reader, writer), _AUTH_TIMEOUT)
            while True:
                header = await asyncio.wait_for(peerwire.read_frame(reader), _IDLE_TIMEOUT)
                replica = await self._request(header, reader, writer, who, replica)
                await writer.drain()
        except peerwire.PeerError as exc:
            if exc.code != "closed":
                self.refused += 1
                logger.warning("peer %s: %s; closing the connection", who, exc)
                with contextlib.suppress(OSError):
                    writer.write(peerwire.error_frame(exc.code, exc.message))
        except TimeoutError:
            self.refused += 1
            logger.warning("peer %s: too slow (authentication or an idle connection); closing it", who)
        except (OSError, asyncio.IncompleteReadError) as exc:
            logger.warning("peer %s: connection lost: %s", who, exc)
        finally:
            self._connections -= 1
            self._writers.discard(writer)
            if replica is not None and replica.state is ReplicaState.RECEIVING:
                # A sender that died mid-stream leaves nothing that could count as complete.
                with contextlib.suppress(Exception):
                    await replica.settle()  # no write may land after the removal
                await asyncio.to_thread(self._move, replica, ReplicaState.DELETED, "the sender went away unfinished")
            with contextlib.suppress(Exception):
                writer.close()
                await writer.wait_closed()

    async def _authenticate(self, reader: peerwire.FrameStream, writer: asyncio.StreamWriter) -> None:
        nonce = peerwire.new_nonce()
        writer.write(peerwire.encode({"t": "challenge", "v": peerwire.VERSION, "nonce": nonce}))
        await writer.drain()
        header = await peerwire.read_frame(reader, peerwire.MAX_HEADER_BEFORE_AUTH)
        theirs = header.get("nonce")
        if (
            header["t"] != "auth"
            or header.get("v") != peerwire.VERSION
            or not peerwire.is_nonce(theirs)
            or not peerwire.proof_matches(peerwire.sender_proof(self._token, nonce, str(theirs)), header.get("mac"))
        ):
            raise peerwire.PeerError("auth", "authentication failed")
        proof = peerwire.receiver_proof(self._token, str(theirs), nonce)
        writer.write(peerwire.encode({"t": "welcome", "v": peerwire.VERSION, "mac": proof}))

    async def _request(
        self,
        header: dict[str, Any],
        reader: peerwire.FrameStream,
        writer: asyncio.StreamWriter,
        who: str,
        replica: Replica | None,
    ) -> Replica | None:
        kind = header["t"]
        if kind == "ping":
            return replica  # a sender waiting for its trainer's next file keeps the connection alive
        if kind == "query":
            writer.write(peerwire.encode(self.state_frame()))
            return replica
        if kind == "replica":
            if replica is not None:
                raise peerwire.PeerError("bad-frame", "one replica per connection")
            replica = await self._open(header, who)
            writer.write(peerwire.encode({"t": "ok", "id": replica.id}))
            return replica
        if kind in self.handlers:  # e.g. list and fetch: spotguard/daemon/peerfetch.py
            await self.handlers[kind](self, header, reader, writer, who)
            return replica
        if replica is None:
            raise peerwire.PeerError("bad-frame", f"{kind!r} before a replica was opened")
        if kind == "data":
            await self._data(replica, header, reader)
            return replica
        if kind == "commit":
            await self._commit(replica, header)
            writer.write(peerwire.encode({"t": "ok", "state": str(replica.state)}))
            self._schedule_upload(replica)
            return None  # the connection no longer holds it
        raise peerwire.PeerError("bad-frame", f"unknown frame type {kind!r}")

    def state_frame(self) -> dict[str, Any]:
        return {
            "t": "state",
            "busy": self.busy(),
            "bucket": self.storage.url if self.storage is not None else None,
            "replicas": len(self.replicas),
        }

    async def _open(self, header: dict[str, Any], who: str) -> Replica:
        name = peerwire.field(header, "name", str)
        bucket = peerwire.field(header, "bucket", str)
        if self.storage is None or bucket != self.storage.url:
            raise peerwire.PeerError(
                "bucket", f"this daemon commits only to {self.storage.url if self.storage else 'no bucket'}"
            )
        if parse_step_dir(name) is None:
            raise peerwire.PeerError("bad-field", f"{name!r} is not a checkpoint name")
        if self.busy():
            raise peerwire.PeerError("busy", "this daemon has a hard notice of its own pending")
        if len(self.replicas) >= self.max_replicas:
            raise peerwire.PeerError("full", f"already holding {len(self.replicas)} replica(s)")
        replica = Replica(f"{name}-{uuid.uuid4().hex[:8]}", name, bucket, who, self.area / "x")
        replica.dir = self.area / replica.id
        await asyncio.to_thread(replica.step_dir.mkdir, parents=True)
        await asyncio.to_thread(self._move, replica, ReplicaState.RECEIVING, f"{who} opened it")
        return replica

    async def _data(self, replica: Replica, header: dict[str, Any], reader: peerwire.FrameStream) -> None:
        try:
            rel = check_relpath(peerwire.field(header, "name", str))
        except ManifestError as exc:
            raise peerwire.PeerError("bad-path", str(exc)) from None
        size, offset, length = (peerwire.field(header, key, int) for key in ("size", "offset", "len"))
        if not (0 <= length <= peerwire.MAX_DATA and offset >= 0 and offset + length <= size):
            raise peerwire.PeerError("bad-field", f"{rel}: a range [{offset}, +{length}) outside 0..{size}")
        sizes = replica.sizes
        if sizes.get(rel, size) != size:
            raise peerwire.PeerError("bad-field", f"{rel}: size {size}, announced before as {sizes[rel]}")
        if replica.bytes - sizes.get(rel, 0) + size > self.max_replica_bytes:
            raise peerwire.PeerError("too-large", f"a replica may hold at most {self.max_replica_bytes} bytes")
        if rel not in sizes:  # its directory, once per file (only this daemon writes in its area)
            await asyncio.to_thread(_make_parent, replica.step_dir, rel)
        sizes[rel] = size
        # The write goes on in a thread while the next frame is read; a few at most per connection, each
        # holding its buffer until it is done.
        if offset < replica.ends.get(rel, 0):
            # It may overlap a range still being written (a file the sender's trainer wrote again):
            # that one lands first. (The overlap then makes the commit read the file back.)
            await replica.settle()
        replica.ends[rel] = max(replica.ends.get(rel, 0), offset + length)
        writes = replica.writes
        while len(writes) >= _WRITES_IN_FLIGHT:
            done, _ = await asyncio.wait(writes, return_when=asyncio.FIRST_COMPLETED)
            for finished in done:
                writes.discard(finished)
                finished.result()
        free = replica.buffers
        buffer = free.pop() if free else bytearray(peerwire.SEND_CHUNK)
        if len(buffer) < length:  # a bigger frame (at most MAX_DATA): the smaller buffer goes
            buffer = bytearray(length)
        data = memoryview(buffer)[:length]
        await reader.readinto(data)
        ranges = replica.ranges.setdefault(rel, [])
        write = asyncio.ensure_future(asyncio.to_thread(_write_range, replica.step_dir, rel, offset, data, ranges))
        write.add_done_callback(lambda _: free.append(buffer))
        writes.add(write)

    async def _commit(self, replica: Replica, header: dict[str, Any]) -> None:
        if "part" in header:
            await self._commit_share(replica, header)
            return
        text = peerwire.field(header, "manifest", str)
        await replica.settle()
        try:
            manifest = Manifest.from_json(text.encode())
        except ManifestError as exc:
            raise peerwire.PeerError("bad-manifest", str(exc)) from None
        if parse_step_dir(replica.name) != manifest.step:
            raise peerwire.PeerError("bad-manifest", f"{replica.name}: the manifest says step {manifest.step}")
        problems = await asyncio.to_thread(
            _check_files, replica.step_dir, manifest.files, replica.sizes, replica.ranges
        )
        if problems:
            replica.error = problems[0]
            await asyncio.to_thread(self._move, replica, ReplicaState.DELETED, f"rejected: {problems[0]}")
            raise peerwire.PeerError("mismatch", problems[0])

        def write_manifest() -> None:
            with atomic_file(replica.step_dir / MANIFEST) as out:
                out.write(text.encode())
            fsync_dir(replica.step_dir)
            self._move(replica, ReplicaState.VERIFIED, f"{len(manifest.files)} file(s), {manifest.total_bytes} bytes")

        await asyncio.to_thread(write_manifest)

    async def _commit_share(self, replica: Replica, header: dict[str, Any]) -> None:
        """A multi-node job's dying node sends its share: its files and its ``part-<node>.json``.
        The share's files go to the bucket. Node 0 also sends the job's manifest, which lists every
        node's files: this daemon then commits it once they are all in the bucket, as node 0 would;
        from any other node the manifest stays node 0's to commit."""
        text = peerwire.field(header, "part", str)
        await replica.settle()
        try:
            node, nodes, files = _parse_part(text)
        except (ValueError, KeyError, TypeError, AttributeError, ManifestError) as exc:
            raise peerwire.PeerError("bad-manifest", f"a node's part that cannot be read: {exc}") from None
        job_text = None if header.get("manifest") is None else peerwire.field(header, "manifest", str)
        job = None if job_text is None else self._job_manifest(replica, job_text, files)
        problems = await asyncio.to_thread(_check_files, replica.step_dir, files, replica.sizes, replica.ranges)
        if problems:
            replica.error = problems[0]
            await asyncio.to_thread(self._move, replica, ReplicaState.DELETED, f"rejected: {problems[0]}")
            raise peerwire.PeerError("mismatch", problems[0])

        def write() -> None:
            write_part(replica.step_dir, node, nodes, files)
            if job_text is not None:  # its bytes as node 0 would have committed them
                with atomic_file(replica.step_dir / MANIFEST) as out:
                    out.write(job_text.encode())
                fsync_dir(replica.step_dir)
            holds = f"node {node}'s share: {len(files)} file(s)" + (", and the job's manifest" if job else "")
            self._move(replica, ReplicaState.VERIFIED, holds)

        await asyncio.to_thread(write)

    @staticmethod
    def _job_manifest(replica: Replica, text: str, share: dict[str, FileEntry]) -> Manifest:
        """Node 0's copy of the job's manifest, which must list its share exactly as its part does."""
        try:
            manifest = Manifest.from_json(text.encode())
        except ManifestError as exc:
            raise peerwire.PeerError("bad-manifest", str(exc)) from None
        if parse_step_dir(replica.name) != manifest.step:
            raise peerwire.PeerError("bad-manifest", f"{replica.name}: the manifest says step {manifest.step}")
        differ = sorted(rel for rel, entry in share.items() if manifest.files.get(rel) != entry)
        if differ:
            raise peerwire.PeerError(
                "bad-manifest", f"{differ[0]}: the job's manifest lists it otherwise than the part"
            )
        return manifest

    # --- committing in the bucket ---------------------------------------------------------

    def _schedule_upload(self, replica: Replica) -> None:
        task = asyncio.create_task(self._upload(replica), name=f"replica-{replica.id}")
        self._uploads.add(task)
        task.add_done_callback(self._uploads.discard)

    async def _upload(self, replica: Replica) -> None:
        assert self.storage is not None
        storage = self.storage
        while True:
            try:
                async with self._upload_slots:
                    job_manifest = await asyncio.to_thread(_send_replica, storage, replica.step_dir, self.concurrency)
                if job_manifest is not None:  # node 0's share: the job's manifest once every node's files are in
                    await asyncio.to_thread(_commit_job, storage, replica.step_dir, job_manifest, OTHER_NODES_WAIT)
                break
            except CommitLost as exc:
                logger.warning("replica %s: %s", replica.id, exc)
                await asyncio.to_thread(self._move, replica, ReplicaState.DELETED, "another checkpoint holds its name")
                return
            except OtherNodesMissing as exc:
                replica.error = str(exc)
                # Its share is in the bucket; without the other nodes' the checkpoint cannot complete.
                await asyncio.to_thread(self._move, replica, ReplicaState.DELETED, f"given up: {exc}")
                return
            except (StorageError, OSError, ManifestError) as exc:
                replica.error = str(exc)
                logger.error("replica %s: committing %s failed: %s; retrying", replica.id, replica.name, exc)
                await asyncio.sleep(_UPLOAD_RETRY)
        await asyncio.to_thread(self._move, replica, ReplicaState.UPLOADED, f"committed in {storage.url}")
        await asyncio.to_thread(self._move, replica, ReplicaState.DELETED, "safe in the bucket")

    def status(self) -> dict[str, Any]:
        return {
            "listen": self.address,
            "replicas": [replica.to_json() for replica in self.replicas.values()],
            "refused": self.refused,
        }


def _make_parent(step_dir: Path, rel: str) -> None:
    path = step_dir / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.parent.resolve().is_relative_to(step_dir.resolve()):
        raise peerwire.PeerError("bad-path", f"{rel} leaves the replica")


def _write_range(
    step_dir: Path, rel: str, offset: int, data: bytes | memoryview, ranges: list[tuple[int, int, int]]
) -> None:
    """pwrite one range (in a thread) and note its CRC32C in ``ranges`` (a list append is atomic)."""
    fd = os.open(step_dir / rel, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)
    # google-crc32c takes no bytearray nor memoryview (only buffers that need no release); a ctypes
    # array over the same memory is one, without a copy.
    if isinstance(data, memoryview):  # a receiver's reused buffer (writable)
        crc = crc32c_of_bytes((ctypes.c_char * len(data)).from_buffer(data))  # type: ignore[arg-type]
    else:
        crc = crc32c_of_bytes(data)
    ranges.append((offset, len(data), crc32c_hex_to_int(crc)))


def _parse_part(text: str) -> tuple[int, int, dict[str, FileEntry]]:
    document = json.loads(text)
    node, nodes = document["node"], document["nodes"]
    if not (isinstance(node, int) and isinstance(nodes, int) and 0 <= node < nodes):
        raise ValueError(f"node {node!r} of {nodes!r}")
    files = {}
    for rel, entry in document["files"].items():
        size, crc = entry["size"], entry["crc32c"]
        if not isinstance(size, int) or size < 0 or not isinstance(crc, str):
            raise ValueError(f"{rel}: a bad size or crc32c")
        crc32c_hex_to_int(crc)
        files[check_relpath(rel)] = FileEntry(size=size, crc32c=crc)
    return node, nodes, files


def _send_replica(storage: Storage, step_dir: Path, concurrency: int) -> Manifest | None:
    """A verified replica's files to the bucket (blocking). A whole checkpoint goes with its manifest
    last; a node's share without it. Returns the job's manifest still to commit once the other
    nodes' files are in (the share of node 0, which commits for the job), else None."""
    manifest, share = node_holdings(step_dir)
    if share is None:
        if manifest is None:
            raise ManifestError(f"{step_dir.name}: neither a manifest nor a node's part")
        upload_checkpoint(storage, step_dir, concurrency=concurrency)
        return None
    upload_files(storage, step_dir, share, concurrency=concurrency)
    return manifest


def _commit_job(storage: Storage, step_dir: Path, manifest: Manifest, wait: float) -> None:
    """As node 0's daemon would: wait for every node's files in the bucket, then commit the job's manifest."""
    wait_for_other_nodes(storage, manifest, step_dir.name, deadline=time.monotonic() + wait)
    commit_remote(storage, step_dir)


def _combined_crc(ranges: list[tuple[int, int, int]], size: int) -> str | None:
    """The file's CRC32C from its ranges' when they tile ``[0, size)`` exactly; else None (read it)."""
    crc, end = 0, 0
    for offset, length, part in sorted(ranges):
        if offset != end:
            return None  # a gap or an overlap: only the file itself can say
        crc = crc32c_combine(crc, part, length)
        end += length
    return f"{crc:08x}" if end == size else None


def _check_files(
    step_dir: Path,
    files: dict[str, FileEntry] | Any,
    received: dict[str, int],
    ranges: dict[str, list[tuple[int, int, int]]],
) -> list[str]:
    """What is wrong with the received files against the manifest (empty: every one matches)."""
    problems = [f"{rel}: received but not in the manifest" for rel in sorted(set(received) - set(files))]
    for rel, entry in sorted(files.items()):
        path = step_dir / rel
        if not path.is_file() or path.is_symlink():
            problems.append(f"{rel}: never received")
        elif path.stat().st_size != entry.size:
            problems.append(f"{rel}: {path.stat().st_size} bytes, the manifest says {entry.size}")
        elif (crc := _combined_crc(ranges.get(rel, []), entry.size) or crc32c_of_file(path)) != entry.crc32c:
            problems.append(f"{rel}: crc32c {crc}, the manifest says {entry.crc32c}")
    return problems


# --- the sending side ----------------------------------------------------------------------


class PeerClient:
    """One authenticated connection to a peer's receiver.

    >>> client = await PeerClient.connect("10.0.0.2", 7140, token)
    >>> (await client.query())["busy"]
    False
    >>> await client.open_replica("step-000000100", "s3://b/run1")
    >>> await client.send_file(step_dir / "weights.bin", "weights.bin")
    >>> await client.commit(step_dir)
    """

    def __init__(self, reader: peerwire.Reads, writer: asyncio.StreamWriter, address: str) -> None:
        self.reader = reader
        self.writer = writer
        self.address = address

    @classmethod
    async def connect(cls, host: str, port: int, token: bytes, *, timeout: float = 5.0) -> PeerClient:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=1 << 20), timeout)
        # Enough in the socket's buffer that the next chunk is read from disk while this one goes out.
        writer.transport.set_write_buffer_limits(high=2 * peerwire.MAX_DATA)
        client = cls(reader, writer, f"{host}:{port}")
        try:
            await asyncio.wait_for(client._authenticate(token), timeout)
        except BaseException:
            await client.close()
            raise
        return client

    async def _authenticate(self, token: bytes) -> None:
        challenge = await peerwire.read_frame(self.reader, peerwire.MAX_HEADER_BEFORE_AUTH)
        peerwire.expect(challenge, "challenge")
        theirs = challenge.get("nonce")
        if challenge.get("v") != peerwire.VERSION or not peerwire.is_nonce(theirs):
            raise peerwire.PeerError("bad-frame", "a challenge of another version")
        ours = peerwire.new_nonce()
        proof = peerwire.sender_proof(token, str(theirs), ours)
        self.writer.write(peerwire.encode({"t": "auth", "v": peerwire.VERSION, "nonce": ours, "mac": proof}))
        welcome = await peerwire.read_frame(self.reader, peerwire.MAX_HEADER_BEFORE_AUTH)
        peerwire.expect(welcome, "welcome")
        if not peerwire.proof_matches(peerwire.receiver_proof(token, ours, str(theirs)), welcome.get("mac")):
            raise peerwire.PeerError("auth", f"{self.address} does not know the job's token")

    async def _ask(self, header: dict[str, Any], answer: str = "ok") -> dict[str, Any]:
        self.writer.write(peerwire.encode(header))
        await self.writer.drain()
        reply = await peerwire.read_frame(self.reader)
        peerwire.expect(reply, answer)
        return reply

    async def query(self) -> dict[str, Any]:
        return await self._ask({"t": "query"}, "state")

    async def ping(self) -> None:
        """Keep the connection alive while there is nothing to send (no answer comes)."""
        self.writer.write(peerwire.encode({"t": "ping"}))
        await self.writer.drain()

    async def open_replica(self, name: str, bucket: str) -> None:
        await self._ask({"t": "replica", "name": name, "bucket": bucket})

    async def send_range(self, rel: str, size: int, offset: int, data: bytes) -> None:
        header = {"t": "data", "name": rel, "size": size, "offset": offset, "len": len(data)}
        self.writer.write(peerwire.encode(header))
        self.writer.write(data)
        await self.writer.drain()

    async def send_part(
        self, file: BinaryIO, rel: str, size: int, offset: int, length: int, *, chunk: int = peerwire.SEND_CHUNK
    ) -> None:
        """Bytes ``[offset, offset+length)`` of the open ``file`` (``rel``, ``size`` bytes in all) in data
        frames of at most ``chunk`` bytes. The kernel sends them from the page cache (``sendfile``): no
        read into Python, no copy through the transport's buffer."""
        loop = asyncio.get_running_loop()
        end = offset + length
        while True:  # at least once: an empty file is sent as one empty range
            want = min(chunk, end - offset)
            self.writer.write(peerwire.encode({"t": "data", "name": rel, "size": size, "offset": offset, "len": want}))
            if want:
                sent = await loop.sendfile(self.writer.transport, file, offset, want)
                if sent < want:  # the frame's header promised more: the connection cannot go on
                    raise OSError(f"{rel} ended at {offset + sent} bytes while it was sent")
            else:
                await self.writer.drain()
            offset += want
            if offset >= end:
                return

    async def send_file(self, path: Path, rel: str, *, chunk: int = peerwire.SEND_CHUNK) -> int:
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
        return await self._ask(header)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


async def send_checkpoint(client: PeerClient, step_dir: Path, bucket: str) -> dict[str, Any]:
    """A whole locally committed checkpoint to ``client``'s peer (for tests and resends)."""
    manifest = await asyncio.to_thread(load_manifest, step_dir)
    await client.open_replica(step_dir.name, bucket)
    for rel in sorted(manifest.files):
        await client.send_file(step_dir / rel, rel)
    return await client.commit(step_dir)


_CHOOSE_TIMEOUT = 2.0  # seconds a candidate has to connect, authenticate and answer
_PREFER_GRACE = 0.25  # seconds an earlier-listed candidate still answering may take once another is found


async def choose_peer(
    addresses: list[tuple[str, int]], token: bytes, bucket: str, *, timeout: float = _CHOOSE_TIMEOUT
) -> PeerClient | None:
    """The first peer in ``addresses`` that answers, shares ``bucket`` and has no hard notice of its
    own; None if none. All are asked at once (connect, authenticate, query: ``timeout`` seconds for
    the three), so dead or stale candidates cost no time while another answers; once one is found,
    earlier-listed ones still answering get ``_PREFER_GRACE`` more. The others are closed."""

    async def ask(host: str, port: int) -> PeerClient | None:
        client: PeerClient | None = None
        try:
            async with asyncio.timeout(timeout):
                client = await PeerClient.connect(host, port, token, timeout=timeout)
                state = await client.query()
        except (OSError, TimeoutError, peerwire.PeerError) as exc:
            logger.warning("peer %s:%d did not answer: %s", host, port, exc or type(exc).__name__)
            state = None
        except BaseException:  # cancelled: another peer was chosen
            if client is not None:
                await client.close()
            raise
        if state is None:
            pass
        elif state.get("busy"):
            logger.warning("peer %s:%d has a hard notice of its own: not choosing it", host, port)
        elif state.get("bucket") != bucket:
            logger.warning("peer %s:%d commits to %s, not %s: not choosing it", host, port, state.get("bucket"), bucket)
        else:
            return client
        if client is not None:
            await client.close()
        return None

    def answer(task: asyncio.Task[PeerClient | None]) -> PeerClient | None:
        return task.result() if task.done() and not task.cancelled() and task.exception() is None else None

    tasks = [asyncio.create_task(ask(host, port), name=f"ask-peer-{host}:{port}") for host, port in addresses]
    chosen: PeerClient | None = None
    loop = asyncio.get_running_loop()
    grace_ends: float | None = None
    try:
        while True:
            possible = [task for task in tasks if not task.done() or answer(task) is not None]
            found = [task for task in possible if task.done()]
            if found and grace_ends is None:
                grace_ends = loop.time() + _PREFER_GRACE
            preferred_or_late = found and (found[0] is possible[0] or loop.time() >= (grace_ends or 0.0))
            if not possible or preferred_or_late:
                chosen = answer(found[0]) if found else None
                break
            wait = None if grace_ends is None else grace_ends - loop.time()
            await asyncio.wait([t for t in possible if not t.done()], timeout=wait, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel("another peer was chosen")
        await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            other = answer(task)
            if other is not None and other is not chosen:
                await other.close()
    return chosen


__all__ = ["AREA", "PeerClient", "PeerReceiver", "Replica", "ReplicaState", "choose_peer", "send_checkpoint"]
