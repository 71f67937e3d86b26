"""What the daemon told a handoff (spotguard/peer/handoff.py) of a notice's checkpoints: the ranges
the trainer wrote of each file (``file-range``), the files it finished (``file``) and the checkpoints
it committed (``saved``); and, from those, what a replica of one of them will take.

A file being written is opened with ``O_NOFOLLOW`` at its first range, on its temporary name, and
followed across the rename; one given up and written again (another size or name, or unlinked)
starts over, and what was sent of it counts for nothing (the peer checks against the manifest only at
the commit).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path

from spotguard.manifest import FileEntry, ManifestError, node_holdings, parse_step_dir
from spotguard.peer.flows import Source
from spotguard.safefile import is_unlinked, open_nofollow

logger = logging.getLogger("spotguard.handoff")


@dataclass
class Streamed:
    """A file being written, sent by ranges as the trainer announces them."""

    tmp: str
    source: Source  # opened on the temporary name: it stays valid across the rename
    todo: list[tuple[int, int]] = field(default_factory=list)  # (offset, length) announced, not yet queued
    queued: list[tuple[int, int]] = field(default_factory=list)  # handed to the flows (they send it or fail)

    @property
    def size(self) -> int:
        return self.source.size


class Announced:
    """The checkpoints announced while a notice is pending, by step name (``step-000000042``)."""

    def __init__(self) -> None:
        self._checkpoints: dict[str, tuple[Path, dict[str, FileEntry]]] = {}  # name -> (dir, files finished)
        self._saved: set[str] = set()
        self._committed: dict[str, dict[str, FileEntry]] = {}  # a saved checkpoint's files on this disk, once read
        self.streams: dict[tuple[str, str], Streamed] = {}  # (step name, file) -> its ranges

    def __bool__(self) -> bool:
        """Whether anything was announced."""
        return bool(self._checkpoints)

    def file_range(self, step_dir: Path, rel: str, *, tmp: str, size: int, offset: int, length: int) -> bool:
        """Bytes ``[offset, offset + length)`` of ``rel`` are written under ``tmp`` (relative to
        ``step_dir``; the daemon validated both names); whether they were taken. Never raises: a file
        that cannot be opened here goes whole once finished."""
        key = (step_dir.name, rel)
        stream = self.streams.get(key)
        if stream is not None and (
            (stream.tmp, stream.size) != (tmp, size) or is_unlinked(stream.source.file.fileno())
        ):  # given up and written again: what was sent of it counts for nothing (the peer checks at commit)
            self.drop(key, stale=True)
            stream = None
        if stream is None:
            try:
                fd = open_nofollow(step_dir / tmp)
            except OSError as exc:
                logger.info("peer handoff: %s/%s goes whole at its file message (%s)", step_dir.name, rel, exc)
                return False
            file = open(fd, "rb", buffering=0)  # noqa: SIM115  # closed by its Source once dropped and sent
            stream = self.streams[key] = Streamed(tmp, Source(file, rel, size))
        stream.todo.append((offset, length))
        self._checkpoints.setdefault(step_dir.name, (step_dir, {}))
        return True

    def file_ready(self, step_dir: Path, rel: str, entry: FileEntry) -> None:
        self._checkpoints.setdefault(step_dir.name, (step_dir, {}))[1][rel] = entry

    def saved(self, step_dir: Path) -> None:
        self._checkpoints.setdefault(step_dir.name, (step_dir, {}))
        self._saved.add(step_dir.name)

    def drop(self, key: tuple[str, str], *, stale: bool = False) -> None:
        """Forget a file's stream; ``stale``: its pieces not sent yet need not go either."""
        stream = self.streams.pop(key, None)
        if stream is not None:
            stream.source.drop(stale=stale)

    def drop_streams(self) -> None:
        for key in list(self.streams):
            self.drop(key)

    def forget(self, up_to: str | None = None) -> None:
        """The notice is over: nothing it announced counts any more. ``up_to``: only the checkpoints
        of that step and older (what a handoff sent), the next notice's newer ones staying."""
        last = None if up_to is None else parse_step_dir(up_to)

        def gone(name: str) -> bool:
            return last is None or (parse_step_dir(name) or 0) <= last

        for key in [key for key in self.streams if gone(key[0])]:
            self.drop(key)
        for name in [name for name in self._checkpoints if gone(name)]:
            del self._checkpoints[name]
            self._saved.discard(name)
            self._committed.pop(name, None)

    # --- what was announced ---------------------------------------------------------------

    def newest(self) -> str:
        """The newest checkpoint announced: the one a replica is opened for."""
        return max(self._checkpoints, key=lambda name: parse_step_dir(name) or 0)

    def any_saved(self) -> bool:
        return bool(self._saved)

    def saved_after(self, name: str | None) -> bool:
        """Whether a checkpoint newer than ``name`` (any, for None) was saved."""
        last = -1 if name is None else parse_step_dir(name) or 0
        return any((parse_step_dir(saved) or 0) > last for saved in self._saved)

    def is_saved(self, name: str) -> bool:
        return name in self._saved

    def step_dir(self, name: str) -> Path:
        return self._checkpoints[name][0]

    def finished(self, name: str) -> dict[str, FileEntry]:
        """The files of ``name`` the trainer finished so far (their ``file`` messages)."""
        return self._checkpoints[name][1]

    async def committed_files(self, name: str) -> dict[str, FileEntry]:
        """What the trainer committed of ``name`` here (:func:`committed_files`), read once for the
        open's size and the files never announced, at every move too: a committed checkpoint does not change."""
        if name not in self._committed:
            self._committed[name] = await asyncio.to_thread(committed_files, self.step_dir(name))
        return self._committed[name]

    async def replica_bytes(self, name: str, expected: int) -> int:
        """What a replica of ``name`` will take: once committed, what this disk holds of it (a soft
        notice's, or at a move: a plan sized from a larger checkpoint would have peers with room refuse
        it); before, the plan's size ``expected``, or what the trainer announced so far where that is more."""
        if self.is_saved(name):
            try:
                files = await self.committed_files(name)
            except (ManifestError, OSError):
                pass  # the sending says what is wrong with it
            else:
                return sum(entry.size for entry in files.values())
        return max(expected, self.announced_bytes(name))

    def announced_bytes(self, name: str) -> int:
        """Bytes the trainer announced of ``name`` so far (finished files and files being written):
        what a peer is told at the open where the plan guessed fewer."""
        files = self.finished(name)
        writing = (s.size for (step, rel), s in self.streams.items() if step == name and rel not in files)
        return sum(entry.size for entry in files.values()) + sum(writing)


def committed_files(step_dir: Path) -> dict[str, FileEntry]:
    """What the trainer committed on this disk: the manifest's files, or (multi-node) this node's share."""
    manifest, share = node_holdings(step_dir)
    if share is not None:
        return share
    if manifest is None:
        raise ManifestError(f"{step_dir.name}: neither a manifest nor this node's part")
    return dict(manifest.files)


__all__ = ["Announced", "Streamed", "committed_files"]
