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
from spotguard.manifest import MANIFEST
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
    saver: Saver, writer: CheckpointWriter, done: Callable[[], None], notice: Message | None = None
) -> Iterator[Path]:
    """Prepare ``writer``'s directory on every rank, yield it, then (rank 0) record and commit what was
    written there; ``done`` runs after the commit, or at once when the step was already committed
    (then :class:`AlreadyCommitted` is raised before yielding). Collective.

    On a failure the daemon hears ``save-failed`` and a partial directory on a full disk is removed,
    as for the Guard's own saves; the error raised is :class:`SpotguardDiskFull` for a full disk
    (however the framework wrapped it)."""
    try:
        saver.open_step_dir(writer)
    except CheckpointExists:
        logger.info("spotguard: %s is already committed; not writing it again", writer.dir.name)
        done()
        raise AlreadyCommitted(writer.dir) from None
    except Exception as exc:  # no room even for the directory
        _failed(saver, writer, exc, notice)
    # This rank speaks for a disk other than rank 0's (another node's): the step directory is made
    # there too, so that a framework writing there finds it, and must stay empty (see below).
    elsewhere = saver.rank != 0 and saver.node_leader
    if elsewhere:
        with contextlib.suppress(OSError):  # if it cannot be made, a write there fails in the block below
            writer.dir.mkdir(parents=True, exist_ok=True)
    try:
        # Every rank's files are in place, or all ranks hear why (a full disk by its free space too:
        # torch.save to a path reports one with no errno).
        with dist.settled(f"writing {writer.dir.name}", saver.checkpoint_dir):
            yield writer.dir
        if saver.world_size > 1:
            with dist.settled(f"checking {writer.dir.name}"):  # once every rank has written
                if elsewhere:
                    _nothing_written_here(saver, writer)
        with dist.settled(f"committing {writer.dir.name}"):  # nobody goes on (or exits) before the commit
            if saver.rank == 0:
                for relpath in files_under(writer.dir):
                    fsync_file(writer.dir / relpath)  # frameworks write without fsync; the manifest must not lie
                    writer.add_existing(relpath)
                writer.commit()
    except Exception as exc:
        _failed(saver, writer, exc, notice)
    done()


class WrittenOffRankZero(FatalError):
    """A framework wrote files of a checkpoint on a disk other than rank 0's, which its manifest
    (recorded from rank 0's disk) would leave out."""


def _nothing_written_here(saver: Saver, writer: CheckpointWriter) -> None:
    """On a disk other than rank 0's: the checkpoint is recorded from rank 0's disk only, so a file a
    framework wrote here (each rank's shard of a sharded save, on nodes with disks of their own)
    would be missing from it. Refuse the save rather than commit it incomplete; with nothing here,
    the empty directory goes."""
    written = files_under(writer.dir) if writer.dir.is_dir() else []
    if written:
        shown = ", ".join(written[:3]) + (", ..." if len(written) > 3 else "")
        raise WrittenOffRankZero(
            f"{len(written)} file(s) of {writer.dir.name} were written on {saver.checkpoint_dir}, a disk other"
            f" than rank 0's ({shown}): a checkpoint the framework writes itself is recorded from rank 0's disk"
            " only and would be incomplete; give every node the same checkpoint_dir on shared storage, or save"
            " through guard.save()"
        )
    shutil.rmtree(writer.dir, ignore_errors=True)


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
