"""A receiver's replicas: where they live, the one place their state moves, and their commit.

A replica lives under ``<checkpoint root>/peer-replicas/<id>/`` (``peer-replicas`` is never a step
directory, so the daemon's own scans, retention and resume never see it) as ``replica.json`` (its
state and bucket) and the checkpoint's own step directory. Its lifecycle, moved in one place
(:meth:`ReplicaStore.move`):

``receiving`` -> ``verified`` (every file matches the sender's manifest, CRC32C included; the
manifest is then written last, as a trainer would) -> ``uploaded`` (committed in the bucket at the
keys the sender would have used, manifest last) -> ``deleted``.

A connection that ends before its replica is verified leaves nothing: the replica is deleted. After a
restart the area is read again: verified replicas are uploaded, anything else is deleted. How the
bytes arrive is the receiver's (spotguard/peer/receiver.py); what becomes of them is here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import stat
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from spotguard.backoff import backoff_delay
from spotguard.crc32c import crc32c_hex_to_int
from spotguard.jsontext import parse_json
from spotguard.manifest import (
    MANIFEST,
    FileEntry,
    Manifest,
    ManifestError,
    check_relpath,
    load_part,
    node_holdings,
    parse_step_dir,
    verify_dir,
    write_part,
)
from spotguard.peer import wire
from spotguard.peer.admission import Admission
from spotguard.peer.files import Extents, Ranges, check_files, parse_manifest
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
# A verified replica's commit in the bucket is retried until it holds: 5 s after the first failure,
# doubled per failure up to 5 min (a bucket down for hours is asked a dozen times an hour, not 720).
_UPLOAD_RETRY = 5.0
_UPLOAD_RETRY_MAX = 300.0
# How long a replica of node 0's share waits for the other nodes' files before it gives up (as node 0 would).
OTHER_NODES_WAIT = 600.0


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
    directories: set[str] = field(default_factory=set)  # made inside its step directory for those files
    parents: dict[str, asyncio.Future[None]] = field(default_factory=dict)  # per file, its directory made
    disk: int = 0  # what those files and directories take on disk at least (blocks, not bytes)
    error: str | None = None
    writes: set[asyncio.Future[None]] = field(default_factory=set)  # disk writes not yet finished
    # (offset, length, CRC32C) of every range written, per file: verified without reading the file back.
    ranges: Ranges = field(default_factory=dict)
    buffers: list[bytearray] = field(default_factory=list)  # payload buffers no write holds, reused
    taken: dict[str, Extents] = field(default_factory=dict)  # per file, the bytes data frames have covered
    committing: bool = False  # its commit has begun: no data frame may land any more

    @property
    def receiving(self) -> bool:
        return self.state is ReplicaState.RECEIVING and not self.committing

    async def settle(self) -> None:
        """Wait for every disk write in flight; raise the first that failed."""
        pending = set(self.writes)  # writes another flow adds meanwhile stay in self.writes
        results = await asyncio.gather(*pending, return_exceptions=True)
        self.writes -= pending
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


class ReplicaStore:
    """The replicas held under ``area``, and their commit in ``storage`` (one replica at a time,
    each with ``concurrency`` transfers)."""

    def __init__(
        self, area: Path, storage: Storage | None, *, concurrency: int, admission: Admission | None = None
    ) -> None:
        self.area = area
        self.storage = storage
        self.concurrency = concurrency
        self.admission = admission if admission is not None else Admission(area)
        self.replicas: dict[str, Replica] = {}
        self._uploads: set[asyncio.Task[None]] = set()
        self._upload_slots = asyncio.Semaphore(1)  # one replica at a time: each is parallel inside

    # --- lifecycle of a replica (the one place it moves) ---------------------------------

    def move(self, replica: Replica, state: ReplicaState, why: str = "") -> None:
        """Move ``replica`` to ``state`` (blocking): noted on disk, or removed from it when deleted."""
        old = replica.state if replica.id in self.replicas else "new"
        replica.state = state
        logger.info(
            "replica %s (%s from %s): %s -> %s%s", replica.id, replica.name, replica.sender, old, state,
            f" ({why})" if why else "",
        )  # fmt: skip
        if state is ReplicaState.DELETED:
            # Gone from the status and its slot free only once its files are: until then they are on
            # the disk (and in its space), and a status read meanwhile said so.
            shutil.rmtree(replica.dir, ignore_errors=True)
            self.replicas.pop(replica.id, None)
            self.admission.release(replica.id)
            return
        if state is ReplicaState.VERIFIED:
            self.admission.settled(replica.id)
        self.replicas[replica.id] = replica
        meta = {"name": replica.name, "bucket": replica.bucket, "sender": replica.sender, "state": str(state)}
        with atomic_file(replica.dir / _META) as out:
            out.write(json.dumps(meta).encode())

    async def resume(self) -> None:
        """Take up what a restart left in the area: verified replicas are committed again."""
        await asyncio.to_thread(make_private_dir, self.area)
        for replica in await asyncio.to_thread(self._recover):
            self.schedule_upload(replica)

    def _recover(self) -> list[Replica]:
        """Verified replicas to upload again; everything else in the area is removed."""
        found = []
        for entry in sorted(self.area.iterdir()):
            replica = None
            try:
                meta = parse_json((entry / _META).read_bytes())
                name, bucket, sender, state = meta["name"], meta["bucket"], meta["sender"], meta["state"]
                if not all(isinstance(field, str) for field in (name, bucket, sender, state)):
                    raise TypeError("a replica's record holds a field that is not text")  # edited, or bit rot
                replica = Replica(entry.name, name, bucket, sender, entry)
                replica.state = ReplicaState(state)
            except (OSError, ValueError, KeyError, TypeError):
                replica = None
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
                self.admission.hold(replica.id)
                found.append(replica)
                continue
            logger.warning("removing %s: a replica never verified before a restart", entry)
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)  # a stray file or link: rmtree would leave it there
        return found

    async def create(self, name: str, bucket: str, who: str, announced: int | None = None) -> Replica:
        """A new replica of ``name`` from ``who``, receiving: its slot and ``announced`` bytes are
        reserved before anything is awaited (:class:`~spotguard.peer.admission.Admission`), or
        :class:`~spotguard.peer.wire.PeerError` is raised and nothing is written."""
        replica = Replica(f"{name}-{uuid.uuid4().hex[:8]}", name, bucket, who, self.area / "x")
        replica.dir = self.area / replica.id
        self.admission.reserve(replica.id, announced)
        try:
            await asyncio.to_thread(replica.step_dir.mkdir, parents=True)
            await asyncio.to_thread(self.move, replica, ReplicaState.RECEIVING, f"{who} opened it")
        except BaseException:
            self.admission.release(replica.id)
            await asyncio.to_thread(shutil.rmtree, replica.dir, True)
            raise
        return replica

    async def close(self) -> None:
        for task in list(self._uploads):
            task.cancel("daemon shutting down")
        await asyncio.gather(*self._uploads, return_exceptions=True)

    # --- verifying what was received ------------------------------------------------------

    async def commit(self, replica: Replica, header: dict[str, Any]) -> None:
        """The sender's ``commit`` frame: verify every file against its manifest (or a node's part),
        then write that last, as a trainer would. Raises :class:`~spotguard.peer.wire.PeerError`
        (the replica is deleted when its files do not match)."""
        if "part" in header:
            await self._commit_share(replica, header)
            return
        text = wire.field(header, "manifest", str)
        await replica.settle()
        manifest = await wire.parse_off_loop(parse_manifest, text, replica.name)
        await self._reject_unless_matching(replica, manifest.files)

        def write_manifest() -> None:
            with atomic_file(replica.step_dir / MANIFEST) as out:
                out.write(text.encode())
            fsync_dir(replica.step_dir)
            self.move(replica, ReplicaState.VERIFIED, f"{len(manifest.files)} file(s), {manifest.total_bytes} bytes")

        await asyncio.to_thread(write_manifest)

    async def _commit_share(self, replica: Replica, header: dict[str, Any]) -> None:
        """A multi-node job's dying node sends its share: its files and its ``part-<node>.json``.
        The share's files go to the bucket. Node 0 also sends the job's manifest, which lists every
        node's files: this daemon then commits it once they are all in the bucket, as node 0 would;
        from any other node the manifest stays node 0's to commit."""
        text = wire.field(header, "part", str)
        await replica.settle()
        try:
            node, nodes, files = await wire.parse_off_loop(_parse_part, text)
        except (ValueError, KeyError, TypeError, AttributeError, ManifestError) as exc:
            raise wire.PeerError("bad-manifest", f"a node's part that cannot be read: {exc}") from None
        job_text = None if header.get("manifest") is None else wire.field(header, "manifest", str)
        job = None if job_text is None else await wire.parse_off_loop(_job_manifest, replica, job_text, files)
        await self._reject_unless_matching(replica, files)

        def write() -> None:
            write_part(replica.step_dir, node, nodes, files)
            if job_text is not None:  # its bytes as node 0 would have committed them
                with atomic_file(replica.step_dir / MANIFEST) as out:
                    out.write(job_text.encode())
                fsync_dir(replica.step_dir)
            holds = f"node {node}'s share: {len(files)} file(s)" + (", and the job's manifest" if job else "")
            self.move(replica, ReplicaState.VERIFIED, holds)

        await asyncio.to_thread(write)

    async def _reject_unless_matching(self, replica: Replica, files: Mapping[str, FileEntry]) -> None:
        problems = await asyncio.to_thread(check_files, replica.step_dir, files, replica.sizes, replica.ranges)
        if problems:
            replica.error = problems[0]
            await asyncio.to_thread(self.move, replica, ReplicaState.DELETED, f"rejected: {problems[0]}")
            raise wire.PeerError("mismatch", problems[0])

    # --- committing in the bucket ---------------------------------------------------------

    def schedule_upload(self, replica: Replica) -> None:
        """Commit the verified ``replica`` in the bucket, in the background, retrying until it is."""
        task = asyncio.create_task(self._upload(replica), name=f"replica-{replica.id}")
        self._uploads.add(task)
        task.add_done_callback(self._uploads.discard)

    async def _upload(self, replica: Replica) -> None:
        assert self.storage is not None
        storage = self.storage
        failures = 0
        while True:
            try:
                async with self._upload_slots:
                    job_manifest = await asyncio.to_thread(_send_replica, storage, replica.step_dir, self.concurrency)
                if job_manifest is not None:  # node 0's share: the job's manifest once every node's files are in
                    await asyncio.to_thread(_commit_job, storage, replica.step_dir, job_manifest, OTHER_NODES_WAIT)
                break
            except CommitLost as exc:
                logger.warning("replica %s: %s", replica.id, exc)
                await asyncio.to_thread(self.move, replica, ReplicaState.DELETED, "another checkpoint holds its name")
                return
            except OtherNodesMissing as exc:
                replica.error = str(exc)
                # Its share is in the bucket; without the other nodes' the checkpoint cannot complete.
                await asyncio.to_thread(self.move, replica, ReplicaState.DELETED, f"given up: {exc}")
                return
            except ManifestError as exc:
                replica.error = str(exc)
                # Its files on this disk are not what was verified any more (removed, changed): no
                # retry can commit them, and the slot and bytes it holds are wanted.
                await asyncio.to_thread(self.move, replica, ReplicaState.DELETED, f"given up: {exc}")
                return
            except (StorageError, OSError) as exc:
                replica.error = str(exc)
                failures += 1
                wait = backoff_delay(failures, _UPLOAD_RETRY, _UPLOAD_RETRY_MAX)
                logger.error(
                    "replica %s: committing %s failed (%d in a row): %s; retrying in %.0f s",
                    replica.id, replica.name, failures, exc, wait,
                )  # fmt: skip
                await asyncio.sleep(wait)
        await asyncio.to_thread(self.move, replica, ReplicaState.UPLOADED, f"committed in {storage.url}")
        await asyncio.to_thread(self.move, replica, ReplicaState.DELETED, "safe in the bucket")


def make_private_dir(path: Path) -> None:
    """``path`` as a directory of this user's only (0700), made if missing (blocking). A link, or a
    directory another user made there, is refused (OSError): peer data is never written through one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise OSError(f"{path} is not a directory of this user's (a link?): no peer data is kept there")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700, follow_symlinks=False)


def _job_manifest(replica: Replica, text: str, share: dict[str, FileEntry]) -> Manifest:
    """Node 0's copy of the job's manifest, which must list its share exactly as its part does."""
    manifest = parse_manifest(text, replica.name)
    differ = sorted(rel for rel, entry in share.items() if manifest.files.get(rel) != entry)
    if differ:
        raise wire.PeerError("bad-manifest", f"{differ[0]}: the job's manifest lists it otherwise than the part")
    return manifest


def _parse_part(text: str) -> tuple[int, int, dict[str, FileEntry]]:
    document = parse_json(text)
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


__all__ = ["AREA", "OTHER_NODES_WAIT", "Replica", "ReplicaState", "ReplicaStore", "make_private_dir"]
