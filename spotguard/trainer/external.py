"""Committing a checkpoint that a framework wrote itself (Lightning's ``.ckpt``, a Hugging Face
``checkpoint-N/`` folder) into a fresh spotguard step directory: every file is fsynced and recorded in
the manifest, the manifest is committed last, and the daemon is told, as for the Guard's own saves.
``Guard.external_save`` is the public entry."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from spotguard.errors import FatalError
from spotguard.localstore import CheckpointExists, CheckpointWriter
from spotguard.manifest import MANIFEST, FileEntry, write_part
from spotguard.trainer import dist
from spotguard.trainer.notices import Message
from spotguard.trainer.saving import Saver

logger = logging.getLogger("spotguard.trainer")


class AlreadyCommitted(FatalError):
    """The step is already a complete checkpoint; nothing was written (checkpoints are never overwritten)."""

    def __init__(self, step_dir: Path) -> None:
        super().__init__(f"{step_dir} is already committed")
        self.step_dir = step_dir


@contextmanager
def commit_external(
    saver: Saver, writer: CheckpointWriter, done: Callable[[bool], None], notice: Message | None = None
) -> Iterator[Path]:
    """Prepare ``writer``'s directory on every rank, yield it, then record and commit what was
    written there (:func:`_commit_shares`); ``done(here)`` runs after the commit (``here``: this rank's
    disk holds the checkpoint or a share of it), or at once when the step was already committed
    (then :class:`AlreadyCommitted` is raised before yielding). Collective.

    On a failure the daemon hears ``save-failed`` and a partial directory on a full disk is removed,
    as for the Guard's own saves; the error raised is :class:`SpotguardDiskFull` for a full disk
    (however the framework wrapped it)."""
    try:
        saver.open_step_dir(writer)
    except CheckpointExists:
        logger.info("spotguard: %s is already committed; not writing it again", writer.dir.name)
        done(True)
        raise AlreadyCommitted(writer.dir) from None
    except Exception as exc:  # no room even for the directory
        _failed(saver, writer, exc, notice)
    # This rank speaks for a disk other than rank 0's (another node's): the step directory is made
    # there too, so that a framework writing there finds it.
    if saver.rank != 0 and saver.node_leader:
        with contextlib.suppress(OSError):  # if it cannot be made, a write there fails in the block below
            writer.dir.mkdir(parents=True, exist_ok=True)
    try:
        # Every rank's files are in place, or all ranks hear why (a full disk by its free space too:
        # torch.save to a path reports one with no errno).
        with dist.settled(f"writing {writer.dir.name}", saver.checkpoint_dir):
            yield writer.dir
        with dist.settled(f"recording {writer.dir.name}", saver.checkpoint_dir):
            mine = _record(writer) if saver.node_leader else {}
        me = dist.node_key(saver.checkpoint_dir)
        here = _commit_shares(saver, writer, me, dist.all_gather((me, mine)))
    except Exception as exc:
        _failed(saver, writer, exc, notice)
    done(here)


def _record(writer: CheckpointWriter) -> dict[str, FileEntry]:
    """Every file the framework wrote on this disk, fsynced (frameworks write without fsync; the
    manifest must not lie) and recorded."""
    for relpath in files_under(writer.dir) if writer.dir.is_dir() else []:
        fsync_file(writer.dir / relpath)
        writer.add_existing(relpath)
    return dict(writer.files)


def _commit_shares(saver: Saver, writer: CheckpointWriter, me: dist.NodeKey, gathered: list[dist.NodeShare]) -> bool:
    """Commit what every disk's leader recorded (``gathered``: each rank's node and files, empty but
    for leaders; ``me``: this rank's node); returns whether this rank's disk holds the checkpoint or a
    share of it. On one disk rank 0 commits it; where nodes have disks of their own (each rank's shard
    of a sharded save on its node's disk), each node's leader first commits its node's share
    (``part-<node>.json``, as :meth:`Guard.save` does) and rank 0's manifest lists every node's
    files: each node's daemon uploads its share, and the checkpoint counts in the bucket once every
    share is there. Collective.

    A name on several disks (a framework saving the whole checkpoint on every node, Hugging Face's
    ``save_on_each_node``) is the first node's: rank 0's, else the lowest rank's. A node left with
    nothing of its own (none written there: a framework writing from rank 0 alone) keeps nothing."""
    shares: dict[dist.NodeKey, dict[str, FileEntry]] = {}
    everything: dict[str, FileEntry] = {}
    for rank, (key, files) in enumerate(gathered):  # rank 0's node first, then in order of their leaders
        own = {name: entry for name, entry in files.items() if name not in everything}
        differ = [name for name in sorted(files.keys() - own.keys()) if files[name] != everything[name]]
        if differ and saver.rank == 0:
            logger.warning(
                "spotguard: %s: %s differ between nodes' disks; the checkpoint holds the copy of the first node"
                " that wrote them (rank 0's, else the lowest rank's)",
                writer.dir.name,
                ", ".join(differ[:3]) + (", ..." if len(differ) > 3 else ""),
            )
        everything.update(own)
        if own or rank == 0:  # rank 0's node always counts: its disk takes the manifest
            shares[key] = own
    nodes = list(shares)
    with dist.settled(f"committing {writer.dir.name}"):  # nobody goes on (or exits) before the commit
        if saver.node_leader and me not in nodes:
            shutil.rmtree(writer.dir, ignore_errors=True)  # empty, or only copies of another node's files
        if len(nodes) > 1 and saver.node_leader and me in nodes:
            write_part(writer.dir, nodes.index(me), len(nodes), shares[me])
        if saver.rank == 0:
            writer.files.update(everything)
            if len(nodes) > 1:
                writer.meta["nodes"] = len(nodes)
            writer.commit()
    return me in nodes


def _failed(saver: Saver, writer: CheckpointWriter, exc: Exception, notice: Message | None) -> NoReturn:
    failure = saver.save_failed(writer, exc, bytes_under(writer.dir), notice)
    if failure is exc:
        raise exc
    raise failure from exc


def bytes_under(step_dir: Path) -> int:
    """What a failed write left in ``step_dir``: at least that much was needed."""
    try:
        return sum(path.stat().st_size for path in step_dir.rglob("*") if path.is_file())
    except OSError:
        return 0


def files_under(step_dir: Path) -> list[str]:
    """Every file below ``step_dir`` but the manifest, as sorted relative POSIX paths."""
    return sorted(
        path.relative_to(step_dir).as_posix()
        for path in step_dir.rglob("*")
        if path.is_file() and path.relative_to(step_dir).as_posix() != MANIFEST
    )


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
