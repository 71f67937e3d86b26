"""Which replicas a receiver takes: its slots and its disk, reserved before anything is awaited.

A receiver holds at most ``max_replicas`` replicas, and never takes one that would leave no room for
this node's own next urgent checkpoint. Both are decided by :meth:`Admission.reserve`, which runs
without yielding to the event loop: two offers arriving together cannot both see the last free slot.

The bytes reserved for a replica are those its ``replica`` frame announces (the optional ``bytes``
field; none announced reserves nothing). As its ``data`` frames declare its files, what they take on
disk counts against the reservation too (:meth:`Admission.grow`): each file its size in whole blocks
(one for an empty file) and each directory it makes one block
(:func:`~spotguard.peer.files.on_disk`), so that a replica of many empty files in fresh directories
reserves what it takes. What goes beyond the reservation is reserved then, under the same rule, or
the replica is refused. An offer is refused when

    reserved bytes + this node's next urgent checkpoint + what other receiving replicas reserved
        > free bytes of the replica area's filesystem

where this node's next checkpoint is :attr:`Admission.own_bytes` when the daemon knows the state's
size, else the size of the newest checkpoint in the local checkpoint root. A reservation is released
when its replica is deleted; once verified its bytes are on disk (and in the free space), so it then
reserves nothing more. A replica still receiving is counted twice for the bytes it has already
written (in the free space and in its reservation): the rule errs towards refusing.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from spotguard.manifest import load_manifest_or_none, load_part, parse_step_dir
from spotguard.peer import wire

logger = logging.getLogger("spotguard.peers")

MAX_FILES = 100_000  # files in one replica
MAX_FILE_BYTES = 1 << 40  # bytes in one file of a replica
_OWN_SIZE_TTL = 5.0  # seconds the newest local checkpoint's size, read from disk, is taken as known


@dataclass(frozen=True)
class ReplicaLimits:
    """What a receiver takes: at most ``max_replicas`` replicas at once, each taking at most
    ``max_replica_bytes`` bytes on disk in at most ``max_files`` files of at most ``max_file_bytes`` bytes."""

    max_replicas: int = 2
    max_replica_bytes: int = 1 << 40
    max_files: int = MAX_FILES
    max_file_bytes: int = MAX_FILE_BYTES


class Admission:
    """Slots and bytes reserved for the replicas of one receiver's ``area`` (under the checkpoint root).

    >>> admission = Admission(root / "peer-replicas", ReplicaLimits(max_replicas=2))
    >>> admission.reserve(replica_id, announced=10 << 30)  # raises PeerError "full" / "no-space"
    >>> admission.grow(replica_id, total=…, files=…, size=…, disk=…)  # on each new file a data frame declares
    >>> admission.release(replica_id)                       # the replica is gone
    """

    def __init__(self, area: Path, limits: ReplicaLimits = ReplicaLimits()) -> None:
        self.area = area
        self.limits = limits
        # This node's own state size, when the daemon knows it (a trainer announced it); else the
        # newest local checkpoint's size is taken.
        self.own_bytes: Callable[[], int | None] = lambda: None
        self.held: dict[str, int] = {}  # replica id -> bytes reserved and not yet on disk
        self._own_read: tuple[float, int] | None = None  # (when, bytes) of the last look at the disk

    # --- the rule ---------------------------------------------------------------------------

    def reserve(self, key: str, announced: int | None) -> None:
        """Take a slot and ``announced`` bytes for the replica ``key``, or raise
        :class:`~spotguard.peer.wire.PeerError` (``full``, ``too-large``, ``no-space``). Never awaits."""
        if len(self.held) >= self.limits.max_replicas:
            raise wire.PeerError("full", f"already holding {len(self.held)} replica(s)")
        want = announced or 0
        if want > self.limits.max_replica_bytes:
            raise wire.PeerError("too-large", f"a replica may hold at most {self.limits.max_replica_bytes} bytes")
        self._check_room(want, key)
        self.held[key] = want

    def grow(self, key: str, total: int, files: int, size: int, disk: int | None = None) -> None:
        """A data frame of the replica ``key`` declares a file of ``size`` bytes, making ``files`` files
        of ``total`` bytes in all, which take ``disk`` bytes on disk with their directories (None:
        ``total``): what goes beyond the reservation is reserved now, or refused."""
        limits = self.limits
        if files > limits.max_files:
            raise wire.PeerError("too-many-files", f"a replica may hold at most {limits.max_files} files")
        if size > limits.max_file_bytes:
            raise wire.PeerError("too-large", f"a file of a replica may hold at most {limits.max_file_bytes} bytes")
        need = total if disk is None else max(total, disk)
        if need > limits.max_replica_bytes:
            limit = limits.max_replica_bytes
            raise wire.PeerError("too-large", f"a replica may take at most {limit} bytes on disk, directories included")
        reserved = self.held.get(key, 0)
        if need > reserved:
            self._check_room(need - reserved, key)
            self.held[key] = need

    def settled(self, key: str) -> None:
        """The replica ``key`` is whole on disk: it keeps its slot, its bytes are in the free space now."""
        if key in self.held:
            self.held[key] = 0

    def hold(self, key: str) -> None:
        """A replica already on disk (found again after a restart) takes a slot."""
        self.held.setdefault(key, 0)

    def release(self, key: str) -> None:
        self.held.pop(key, None)

    # --- the disk ---------------------------------------------------------------------------

    def _check_room(self, want: int, key: str) -> None:
        others = sum(nbytes for other, nbytes in self.held.items() if other != key)
        own = self.own_next_bytes()
        try:
            free = shutil.disk_usage(self.area if self.area.exists() else self.area.parent).free
        except OSError as exc:
            raise wire.PeerError("no-space", f"cannot tell the free space here: {exc}") from None
        if want + own + others > free:
            raise wire.PeerError(
                "no-space",
                f"{want} bytes do not fit: {free} free, {own} kept for this node's own next checkpoint"
                f", {others} reserved for other replicas",
            )

    def own_next_bytes(self) -> int:
        """Room kept for this node's own next urgent checkpoint (blocking, but brief: one small file read)."""
        told = self.own_bytes()
        if told is not None:
            return max(0, told)
        now = time.monotonic()
        if self._own_read is None or now - self._own_read[0] > _OWN_SIZE_TTL:  # not once per file of a replica
            self._own_read = (now, newest_local_bytes(self.area.parent))
        return self._own_read[1]


def newest_local_bytes(root: Path) -> int:
    """The size of the newest committed checkpoint (or this node's committed share of one) in ``root``."""
    try:
        steps = sorted(((step, entry) for entry in root.iterdir() if (step := parse_step_dir(entry.name)) is not None),
                       reverse=True)  # fmt: skip
    except OSError:
        return 0
    for _, entry in steps:
        share = load_part(entry)  # a multi-node job's node: its share (node 0's manifest lists every node's)
        if share is not None:
            return sum(e.size for e in share.values())
        manifest = load_manifest_or_none(entry)
        if manifest is not None:
            return manifest.total_bytes
    return 0


__all__ = ["MAX_FILES", "MAX_FILE_BYTES", "Admission", "newest_local_bytes"]
