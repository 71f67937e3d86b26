"""Resuming from a peer: a checkpoint a peer holds that the bucket does not have yet.

A VM that handed its urgent checkpoint to a peer dies; the peer then commits it in the bucket, which
takes a while for a big state. A replacement VM that starts before that is done asks its daemon
(``peer-resume`` on the socket, which :meth:`spotguard.Guard.resume` sends before it chooses), and the
daemon asks its configured peers (``list``, then ``fetch``: docs/peer-protocol.md) on the same
protected channel the handoff uses.

The consistency rule: **the newest complete checkpoint wins**: a peer's replica of the same bucket is
fetched when it is newer than every complete checkpoint on the local disk and in the bucket (between
those two, ``Guard.resume`` keeps its order). A replica counts only once its receiver has
verified it against its sender's manifest (state ``verified``, or ``uploaded`` and not yet deleted),
and only if it is a whole checkpoint (a manifest of its own) of this daemon's bucket: never a
replica of another bucket, and never a peer that does not prove it knows the job's token. A node's
share of a multi-node checkpoint is not fetched (the other nodes' shares are elsewhere): one newer
than everything else is named in a warning, and the resume goes on from the newest complete one.

The fetch checks every file against the manifest's CRC32C once more, on this side, and commits the
way a trainer does: the files are written under ``<root>/.peer-fetch-XXXXXXXX/`` (never a step
directory, so nothing scans it), the manifest last, and only then is the directory renamed into the
checkpoint root. A fetch cut short leaves nothing that counts. The checkpoint must be the one the
peer offered, newer than every complete one, and a fetch never removes nor replaces a step directory
the root holds already (one of that name with a manifest is left as it is, and the fetch refused; one
without, a save cut short, is removed). Every byte of every
file must have arrived in a data frame (spotguard/peer/files.py). That staging directory is made anew
for each fetch (``mkdtemp``: a fresh name, mode 0700, never one that exists), each file in it is
created exclusively and never through a link, and its removal follows no link: a path another local
user planted there beforehand (``.peer-fetch`` as a link, say) is neither used nor followed.

The fetched checkpoint is an ordinary local one: the uploader may upload it too, and since its bytes
and manifest are the peer's own, that skips the files already in the bucket and counts an identical
manifest there as committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotguard.manifest import MANIFEST, Manifest, ManifestError, load_part, node_holdings, parse_step_dir
from spotguard.peer import wire, workers
from spotguard.peer.channel import IO_TIMEOUT, Channel
from spotguard.peer.client import PeerClient
from spotguard.peer.files import (
    Ranges,
    check_files,
    check_range,
    create_exclusive,
    data_header,
    footprint,
    make_parent,
    make_room,
    parse_manifest,
    write_range,
)
from spotguard.peer.flows import MAX_FLOWS, cut
from spotguard.peer.receiver import PeerReceiver
from spotguard.peer.replicas import Replica, ReplicaState
from spotguard.peer.tokens import PeerToken
from spotguard.safefile import atomic_file, fsync_dir, open_nofollow, rename_new
from spotguard.space import free_bytes

logger = logging.getLogger("spotguard.peers")

STAGING = ".peer-fetch"  # prefix of the staging directories under the checkpoint root: never a step directory
_FETCHABLE = frozenset({ReplicaState.VERIFIED, ReplicaState.UPLOADED})
PROBE_TIMEOUT = 5.0  # seconds one peer has to connect, authenticate and list what it holds
PROBE_DEADLINE = 20.0  # seconds asking every candidate takes at most, all of them together
MAX_PROBES = 16  # connections asking peers at once
MAX_FETCH_FLOWS = 16  # connections one fetch may use (the receiver serves at most 16 at once)
FETCH_BYTES_PER_FLOW = 256 << 20  # a fetch uses one more connection per this many bytes, up to peer_max_flows


# --- the holding side (a receiver's connection) ---------------------------------------------------


async def serve(
    receiver: PeerReceiver,
    header: dict[str, Any],
    channel: Channel,
    who: str,
) -> None:
    """Answer a ``list`` or ``fetch`` request on an authenticated connection."""
    if header["t"] == "list":
        bucket = receiver.storage.url if receiver.storage is not None else None
        held = [r for r in receiver.replicas.values() if r.state in _FETCHABLE and r.bucket == bucket]
        items = await asyncio.to_thread(lambda: [item for r in held if (item := _describe(r)) is not None])
        channel.write(wire.encode({"t": "replicas", "items": items}))
        return
    replica_id = wire.field(header, "id", str)
    replica = receiver.replicas.get(replica_id)
    if replica is None or replica.state not in _FETCHABLE:
        channel.write(wire.error_frame("gone", f"no verified replica {replica_id!r} here"))
        return
    try:
        if await asyncio.to_thread(load_part, replica.step_dir) is not None:
            channel.write(wire.error_frame("share", f"{replica.name}: a node's share, not a whole checkpoint"))
            return
        text = await asyncio.to_thread((replica.step_dir / MANIFEST).read_text)
        manifest = Manifest.from_json(text.encode())
    except (OSError, ManifestError) as exc:
        channel.write(wire.error_frame("gone", f"{replica.name}: {exc}"))
        return
    part, parts = _slice(header)
    logger.info("replica %s (%s): %s fetches it (slice %d of %d)", replica.id, replica.name, who, part + 1, parts)
    channel.write(wire.encode({"t": "checkpoint", "id": replica.id, "name": replica.name, "manifest": text}))
    channel.transport.set_write_buffer_limits(high=wire.SEND_CHUNK)  # as the handoff's sender does
    sender = PeerClient(channel, who)  # its data frames are the handoff's
    try:
        for rel, pieces in itertools.groupby(slice_pieces(manifest, part, parts), key=lambda piece: piece[0]):
            if replica.state is ReplicaState.DELETED:  # committed in the bucket meanwhile, or dropped
                raise FileNotFoundError(f"{replica.name} was deleted")
            fd = await asyncio.to_thread(open_nofollow, replica.step_dir / rel)
            with open(fd, "rb", buffering=0) as file:  # once per file: its pieces in this slice follow each other
                for _, offset, length in pieces:
                    await sender.send_part(file, rel, manifest.files[rel].size, offset, length)
    except OSError as exc:
        logger.warning("replica %s: its fetch by %s ended early: %s", replica.id, who, exc)
        channel.write(wire.error_frame("gone", f"{replica.name}: {exc}"))
        return
    channel.write(wire.encode({"t": "end"}))


def _slice(header: dict[str, Any]) -> tuple[int, int]:
    """A fetch's ``slice`` ``[k, n]``: the k-th of n connections fetching one replica (none: all of it)."""
    value = header.get("slice", [0, 1])
    valid = isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value)
    if not valid or not 0 <= value[0] < value[1] <= MAX_FETCH_FLOWS:
        raise wire.PeerError("bad-field", f"fetch: slice must be [k, n] with 0 <= k < n <= {MAX_FETCH_FLOWS}")
    return value[0], value[1]


def slice_pieces(manifest: Manifest, part: int, parts: int) -> Iterator[tuple[str, int, int]]:
    """The (file, offset, length) pieces of slice ``part`` of ``parts``: every file cut in pieces as
    a handoff cuts them (:func:`~spotguard.peer.flows.cut`), numbered in order of the sorted names,
    dealt round-robin."""
    index = 0
    for rel in sorted(manifest.files):
        for offset, length in cut(0, manifest.files[rel].size):
            if index % parts == part:
                yield rel, offset, length
            index += 1


def attach(receiver: PeerReceiver) -> None:
    """Let ``receiver`` answer ``list`` and ``fetch``."""
    receiver.handlers.update(list=serve, fetch=serve)


def _describe(replica: Replica) -> dict[str, Any] | None:
    """A held replica as ``list`` shows it; None if it is gone meanwhile."""
    try:
        manifest, share = node_holdings(replica.step_dir)
    except OSError:
        return None
    if share is not None:  # node 0's share holds the job's manifest too, but not the other nodes' files
        size = sum(entry.size for entry in share.values())
    elif manifest is not None:
        size = manifest.total_bytes
    else:
        return None
    return {"id": replica.id, "name": replica.name, "bucket": replica.bucket, "state": str(replica.state),
            "bytes": size, "share": share is not None}  # fmt: skip


# --- the fetching side ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Offer:
    """A verified replica a peer holds."""

    peer: tuple[str, int]
    id: str
    name: str
    step: int
    bytes: int
    share: bool

    @property
    def where(self) -> str:
        return f"{self.name} on {self.peer[0]}:{self.peer[1]}"


@dataclass
class PeerResume:
    """What asking the peers found: the fetched checkpoint (None if none), and newer shares not fetched."""

    path: Path | None = None
    offer: Offer | None = None
    after: int = -1  # the newest complete step elsewhere it was compared with
    not_fetched: list[str] = field(default_factory=list)


async def list_replicas(client: PeerClient) -> list[dict[str, Any]]:
    client.channel.write(wire.encode({"t": "list"}))
    await client.channel.drain()
    reply = await wire.read_frame(client.channel)
    wire.expect(reply, "replicas")
    items = wire.field(reply, "items", list)
    return [item for item in items if isinstance(item, dict)]


async def fetch_replica(
    client: PeerClient,
    replica_id: str,
    root: Path,
    *,
    name: str | None = None,
    after: int = -1,
    connect: Callable[[], Awaitable[PeerClient]] | None = None,
    flows: int = 1,
) -> Path:
    """Fetch a verified replica into ``root`` as a committed step directory; returns it. The peer must
    send the checkpoint ``name`` (the one it offered; None: any) of a step newer than ``after``, and
    ``root`` must not hold a directory of that name: a fetch never replaces one. With ``flows`` > 1,
    ``connect`` opens that many more connections less one to the same peer, and each fetches its
    slice of the replica's pieces. Raises :class:`~spotguard.wire.PeerError` (``mismatch`` for a
    file that fails its CRC32C or a checkpoint other than the one offered), ``FileExistsError`` or
    another ``OSError``; nothing of a failed fetch is left behind."""
    clients = [client]
    try:
        if connect is not None:
            for _ in range(flows - 1):
                clients.append(await connect())  # one at a time: a failed connect leaves the others closable
        workers.pool().warm(2 * len(clients))  # a worker to receive each connection's frames, one to write
        heads = [await _ask_fetch(each, replica_id, k, len(clients)) for k, each in enumerate(clients)]
        if len({(head["name"], head["manifest"]) for head in heads}) != 1:
            raise wire.PeerError("mismatch", f"replica {replica_id}: its connections sent different manifests")
        _check_offered(heads[0]["name"], name, after)
        return await _receive(clients, heads[0]["name"], heads[0]["manifest"], root)
    finally:
        for other in clients[1:]:
            await other.close()


async def _ask_fetch(client: PeerClient, replica_id: str, part: int, parts: int) -> dict[str, Any]:
    request: dict[str, Any] = {"t": "fetch", "id": replica_id}
    if parts > 1:
        request["slice"] = [part, parts]
    client.channel.write(wire.encode(request))
    await client.channel.drain()
    head = await wire.read_frame(client.channel, big="checkpoint")  # it carries the manifest
    wire.expect(head, "checkpoint")
    return {"name": wire.field(head, "name", str), "manifest": wire.field(head, "manifest", str)}


def _check_offered(sent: str, offered: str | None, after: int) -> None:
    """The checkpoint a peer sends must be the one it offered, and newer than ``after``: a peer that
    offers one step and sends another could put an old checkpoint in place of a newer one."""
    if offered is not None and sent != offered:
        raise wire.PeerError("mismatch", f"asked for {offered}, the peer sent {sent[:40]!r}")
    step = parse_step_dir(sent)
    if step is None or step <= after:
        raise wire.PeerError("mismatch", f"the peer sent {sent[:40]!r}, not a checkpoint newer than step {after}")


def _clear_the_name(target: Path) -> None:
    """Make way at ``target`` for the fetched checkpoint, or refuse: a step directory with a manifest
    (a checkpoint committed here, or restored, or written by a newer spotguard in a format this one
    cannot verify: it may be the only copy of that step), a link or anything but a directory is left
    as it is (``FileExistsError``); a directory without a manifest (a save cut short: no checkpoint,
    nothing lost) is removed, as the local store removes one."""
    if not os.path.lexists(target):
        return
    if target.is_symlink() or not target.is_dir() or os.path.lexists(target / MANIFEST):
        raise FileExistsError(f"{target} exists already: a fetch never replaces a checkpoint directory")
    shutil.rmtree(target)


async def _receive(clients: list[PeerClient], name: str, text: str, root: Path) -> Path:
    """Every client's data frames into a fresh staging directory, checked, then committed in ``root``."""
    manifest = await wire.parse_off_loop(parse_manifest, text, name)
    await asyncio.to_thread(_clear_the_name, root / name)
    await asyncio.to_thread(remove_stale_staging, root)
    need = footprint(manifest.files)
    if (free := await asyncio.to_thread(free_bytes, root)) < need:
        raise OSError(f"{name} needs {need} bytes on disk, {root} has {free} free")
    staging = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix=f"{STAGING}-", dir=root))  # 0700, a new name
    step_dir = staging / name
    try:
        await asyncio.to_thread(step_dir.mkdir)
        files = _Staged(manifest, step_dir)
        receiving = [asyncio.ensure_future(files.receive(each)) for each in clients]
        try:
            await asyncio.gather(*receiving)
        finally:
            for task in receiving:
                task.cancel("another connection of the fetch failed")
            # Every write has landed (or failed) before the files are checked or removed.
            results = await asyncio.gather(*receiving, *files.writes, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                raise result
        problems = await asyncio.to_thread(check_files, step_dir, manifest.files, files.sizes, files.ranges)
        if problems:
            raise wire.PeerError("mismatch", problems[0])
        return await asyncio.to_thread(_commit, step_dir, text, root / name)
    finally:
        await asyncio.to_thread(shutil.rmtree, staging, True)


@dataclass
class _Staged:
    """The files of one fetch as they arrive, on one connection or several: what was received, and
    the disk writes in flight."""

    manifest: Manifest
    step_dir: Path
    sizes: dict[str, int] = field(default_factory=dict)
    ranges: Ranges = field(default_factory=dict)  # as the receiver keeps them
    writes: set[asyncio.Future[None]] = field(default_factory=set)  # going on while the next frame is read
    created: dict[str, asyncio.Future[None]] = field(default_factory=dict)  # each file, made once

    async def receive(self, client: PeerClient) -> None:
        """Data frames until ``end``, each checked against the manifest before a byte of it is written."""
        while await self._one_frame(client):
            pass

    async def _one_frame(self, client: PeerClient) -> bool:
        frame = await wire.read_frame(client.channel)
        if frame["t"] == "end":
            return False
        wire.expect(frame, "data")
        rel, size, offset, length = data_header(frame)
        entry = self.manifest.files.get(rel)
        if entry is None or size != entry.size:
            raise wire.PeerError("bad-field", f"{rel}: {size} bytes, not a file of the manifest")
        check_range(rel, size, offset, length)
        if rel not in self.created:  # the first range of it on any connection makes it
            self.created[rel] = asyncio.ensure_future(asyncio.to_thread(self._create, rel))
        await self.created[rel]
        await make_room(self.writes)
        ranges = self.ranges.setdefault(rel, [])
        worker = workers.take_for(length) if client.channel.can_hand_over() else None
        if worker is not None:  # it receives the payload, then writes it while the next frame is read
            await client.channel.receive_payload_by(worker, length)
            write = worker.write(self.step_dir / rel, offset, length, ranges)
        else:
            data = memoryview(bytearray(length))
            await client.channel.readinto(data)  # decrypted straight into it, each record in time
            write = asyncio.to_thread(write_range, self.step_dir, rel, offset, data, ranges)
        self.sizes[rel] = size
        self.writes.add(asyncio.ensure_future(write))
        return True

    def _create(self, rel: str) -> None:
        make_parent(self.step_dir, rel)
        # Created here, never found: readable by the trainer, as a checkpoint it wrote itself.
        create_exclusive(self.step_dir, rel, 0o644)


def remove_stale_staging(root: Path) -> None:
    """Staging directories a fetch cut short left (blocking). Only real directories are removed,
    without following a link inside them; a link of that name is left as it is."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        if entry.name.startswith(f"{STAGING}-") and entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)


def _commit(step_dir: Path, manifest_text: str, target: Path) -> Path:
    """Manifest last, then the whole directory into the checkpoint root in one rename."""
    for path in step_dir.rglob("*"):
        if path.is_file() and not path.is_symlink():
            with contextlib.suppress(OSError):
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
    with atomic_file(step_dir / MANIFEST) as out:
        out.write(manifest_text.encode())
    fsync_dir(step_dir)
    # A checkpoint that took the name meanwhile (restored from the bucket, written by a trainer) stays.
    _clear_the_name(target)
    rename_new(step_dir, target)
    fsync_dir(target.parent)
    return target


async def resume_from_peers(
    addresses: list[tuple[str, int]],
    token: PeerToken,
    bucket: str,
    root: Path,
    after: int,
    *,
    fetch: bool = True,
    deadline: float = PROBE_DEADLINE,
    limit: int = MAX_PROBES,
    io_timeout: float = IO_TIMEOUT,
    max_flows: int = MAX_FLOWS,
) -> PeerResume:
    """Fetch the newest whole verified replica of ``bucket`` newer than step ``after`` that a peer holds
    (an older one, if the newest fails its checks); shares newer than everything are named. The peers
    are asked what they hold all at once (``limit`` connections at most in flight), within one
    ``deadline`` for them all: a dead or silent candidate costs its slot, never the others' time. A
    replica is fetched on one connection per :data:`FETCH_BYTES_PER_FLOW` bytes, ``max_flows`` at most."""
    ask = functools.partial(_ask_one, token=token, bucket=bucket, after=after, io_timeout=io_timeout)
    offers = await _ask_all(addresses, ask, deadline=deadline, limit=limit)
    found = PeerResume(after=after)
    for offer in sorted((o for o in offers if not o.share), key=lambda o: -o.step):
        if not fetch:
            break
        # A holder whose host vanishes mid-fetch is left within seconds: the bucket, or the next offer.
        connect = functools.partial(PeerClient.connect, *offer.peer, token, io_timeout=io_timeout, leave_when_gone=True)
        try:
            client = await connect()
        except (OSError, TimeoutError, wire.PeerError) as exc:
            logger.warning("%s: not fetched: %s", offer.where, exc)
            continue
        flows = max(1, min(max_flows, MAX_FETCH_FLOWS, -(-offer.bytes // FETCH_BYTES_PER_FLOW)))
        try:
            found.path = await fetch_replica(
                client, offer.id, root, name=offer.name, after=after, connect=connect, flows=flows
            )
            found.offer = offer
            logger.warning("%s: fetched and verified (%d bytes): newer than the bucket's", offer.where, offer.bytes)
            break
        except (OSError, wire.PeerError) as exc:
            logger.warning("%s: refused: %s", offer.where, exc)
        finally:
            await client.close()
    best = found.offer.step if found.offer is not None else after
    found.not_fetched = sorted({o.where for o in offers if (o.share or not fetch) and o.step > best})
    return found


async def _ask_all(
    addresses: list[tuple[str, int]], ask: Callable[[str, int], Awaitable[list[Offer]]], *, deadline: float, limit: int
) -> list[Offer]:
    """Every candidate's offers, asked in parallel (at most ``limit`` at once) within ``deadline``."""
    if not addresses:
        return []
    gate = asyncio.Semaphore(max(1, limit))

    async def one(host: str, port: int) -> list[Offer]:
        async with gate:
            return await ask(host, port)

    tasks = [asyncio.create_task(one(host, port), name=f"list-peer-{host}:{port}") for host, port in addresses]
    done, pending = await asyncio.wait(tasks, timeout=deadline)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    if pending:
        logger.warning("%d peer(s) not asked or not answering within %.0f s: left out", len(pending), deadline)
    return [offer for task in done if not task.cancelled() and task.exception() is None for offer in task.result()]


async def _ask_one(
    host: str, port: int, *, token: PeerToken, bucket: str, after: int, io_timeout: float
) -> list[Offer]:
    """What one peer offers; nothing if it cannot be reached or asked within :data:`PROBE_TIMEOUT`."""
    try:
        async with asyncio.timeout(PROBE_TIMEOUT):
            client = await PeerClient.connect(host, port, token, timeout=PROBE_TIMEOUT, io_timeout=io_timeout)
            try:
                return _offers((host, port), await list_replicas(client), bucket, after)
            finally:
                await client.close()
    except (OSError, TimeoutError, wire.PeerError) as exc:
        logger.warning("peer %s:%d: not asked for a newer checkpoint: %s", host, port, exc or type(exc).__name__)
        return []


def _offers(peer: tuple[str, int], items: list[dict[str, Any]], bucket: str, after: int) -> list[Offer]:
    offers = []
    for item in items:
        name, replica_id = item.get("name"), item.get("id")
        step = parse_step_dir(name) if isinstance(name, str) else None
        if step is None or not isinstance(replica_id, str) or item.get("bucket") != bucket or step <= after:
            continue  # never another bucket's, never an older one
        size = item.get("bytes")
        offers.append(
            Offer(peer, replica_id, str(name), step, size if isinstance(size, int) else 0, item.get("share") is True)
        )
    return offers


__all__ = [
    "STAGING",
    "Offer",
    "PeerResume",
    "attach",
    "fetch_replica",
    "list_replicas",
    "resume_from_peers",
    "serve",
    "slice_pieces",
]
