"""The local checkpoint root: writing a checkpoint and committing it, listing, clearing and pruning.

::

    <root>/step-000001234/     a fresh directory per checkpoint, never overwritten
        manifest.json          written last: the commit marker
        <data files>

The manifest goes last (:mod:`spotguard.safefile`'s temporary name, fsync and rename), then the directory is
fsynced: the manifest *is* the commit. Within one file the order of the bytes is free: the trainer's state
files (``spotguard.trainer.writer``) are written skeleton first, then their holes are filled by several
threads; only the fsync, the rename and the manifest are ordered.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from spotguard.crc32c import crc32c_of_file
from spotguard.errors import SpotguardError
from spotguard.manifest import (
    FORMAT,
    MANIFEST,
    REASONS,
    CheckpointInfo,
    FileEntry,
    Manifest,
    ManifestError,
    check_relpath,
    load_manifest,
    load_manifest_or_none,
    load_part,
    local_foreign_format,
    parse_step_dir,
    step_dir_name,
    verify_dir,
)
from spotguard.safefile import (
    ChecksummingWriter,
    NotARegularFile,
    SaveCancelled,
    SymlinkRefused,
    atomic_file,
    fsync_dir,
)

logger = logging.getLogger("spotguard.localstore")


class CheckpointExists(SpotguardError, FileExistsError):
    """The step directory already holds a complete checkpoint; checkpoints are never overwritten."""


class CheckpointWriter:
    """Writes one checkpoint directory and commits it with its manifest.

    >>> writer = CheckpointWriter(root, step=100, reason="urgent")
    >>> with writer.create("model.pt") as out:
    ...     torch.save(model.state_dict(), out)
    >>> manifest = writer.commit()
    """

    def __init__(
        self,
        root: Path,
        step: int,
        *,
        reason: str,
        world_size: int = 1,
        meta: Mapping[str, Any] | None = None,
        cancel: threading.Event | None = None,
        contents: Mapping[str, Any] | None = None,
    ) -> None:
        if reason not in REASONS:
            raise ValueError(f"reason must be one of {REASONS}, got {reason!r}")
        self.root = root
        self.step = step
        self.reason = reason
        self.world_size = world_size
        self.meta = dict(meta or {})
        self.contents = dict(contents) if contents is not None else None
        self.dir = root / step_dir_name(step)
        self.files: dict[str, FileEntry] = {}
        self.cancel = cancel

    def prepare(self) -> None:
        """Create the step directory; clear a leftover of a killed writer at the same step."""
        if load_manifest_or_none(self.dir) is not None:
            raise CheckpointExists(f"{self.dir} is already a complete checkpoint")
        if (found := local_foreign_format(self.dir)) is not None:
            raise CheckpointExists(f"{self.dir} holds a checkpoint of format {found!r} (a newer spotguard's)")
        if self.dir.exists():
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True)
        fsync_dir(self.root)

    def target(self, relpath: str) -> Path:
        """Where ``relpath`` goes in the step directory (its parent made); the name is checked."""
        target = self.dir / check_relpath(relpath)
        target.parent.mkdir(parents=True, exist_ok=True)
        return target

    @contextlib.contextmanager
    def create(self, relpath: str) -> Iterator[ChecksummingWriter]:
        target = self.target(relpath)
        with atomic_file(target, self.cancel) as writer:
            yield writer
        self.files[relpath] = FileEntry(size=writer.size, crc32c=writer.crc32c)

    def write_bytes(self, relpath: str, data: bytes) -> FileEntry:
        with self.create(relpath) as out:
            out.write(data)
        return self.files[relpath]

    def add_existing(self, relpath: str) -> FileEntry:
        """Record a file someone else wrote into the directory (another rank, DCP)."""
        path = self.dir / check_relpath(relpath)
        entry = FileEntry(size=path.stat().st_size, crc32c=crc32c_of_file(path))
        self.files[relpath] = entry
        return entry

    def commit(self) -> Manifest:
        if self.cancel is not None and self.cancel.is_set():
            raise SaveCancelled(f"{self.dir.name}: cancelled before its commit")
        manifest = Manifest(
            step=self.step,
            reason=self.reason,
            world_size=self.world_size,
            files=dict(self.files),
            meta=self.meta,
            contents=self.contents,
        )
        for sub in {(self.dir / name).parent for name in self.files}:
            fsync_dir(sub)
        with atomic_file(self.dir / MANIFEST) as out:
            out.write(manifest.to_json())
        fsync_dir(self.dir)
        return manifest


def scan_local(root: Path) -> list[CheckpointInfo]:
    """Every step directory under ``root``, oldest first. Complete means: manifest valid, files present
    with the right sizes (checksums are ``verify``'s job)."""
    infos = []
    try:
        entries = list(root.iterdir())
    except FileNotFoundError:
        return []
    for entry in entries:
        step = parse_step_dir(entry.name)
        if step is None or not entry.is_dir():
            continue
        manifest = load_manifest_or_none(entry)
        if manifest is not None and not verify_dir(entry, checksums=False):
            infos.append(CheckpointInfo(entry.name, step, "complete", manifest.total_bytes, manifest.created, manifest))
        else:
            try:
                size = sum(p.stat().st_size for p in entry.rglob("*") if p.is_file())
            except FileNotFoundError:
                continue  # removed while we looked (a trainer's or the daemon's retention, another rank's clean-up)
            foreign = local_foreign_format(entry) if manifest is None else None
            share = load_part(entry)  # None for a directory removed since
            infos.append(CheckpointInfo(entry.name, step, "incomplete", size, None, manifest, share, foreign))
    return sorted(infos, key=lambda info: info.step)


Picked = TypeVar("Picked")


def newest_verified(
    root: Path,
    pick: Callable[[CheckpointInfo], Picked | None],
    *,
    threads: int = 1,
    on_incomplete: Callable[[CheckpointInfo], None] | None = None,
) -> tuple[Picked | None, bool]:
    """What ``pick`` makes of the newest complete checkpoint under ``root`` whose files match its
    manifest (checksums included) and that it does not refuse (None), and whether a newer complete
    one was skipped as bad: the bucket may hold an intact copy of it, newer than what this disk has.
    ``on_incomplete`` sees each incomplete checkpoint newer than the one picked (it may raise)."""
    skipped = False
    for info in reversed(scan_local(root)):
        if info.status != "complete":
            if on_incomplete is not None:
                on_incomplete(info)
            continue
        problems = verify_dir(root / info.name, threads=threads)
        if problems:
            logger.warning("spotguard: skipping %s: %s", info.name, "; ".join(problems))
            skipped = True
            continue
        picked = pick(info)
        if picked is not None:
            return picked, skipped
    return None, skipped


def remove_incomplete(root: Path, *, except_names: frozenset[str] = frozenset()) -> list[str]:
    """Remove leftovers of killed writers (step directories with no valid manifest and no node commit).
    A checkpoint whose manifest is of a format this version does not know is left alone."""
    removed = []
    for info in scan_local(root):
        if info.foreign_format is not None:
            logger.warning(
                "%s: manifest format %r is not %r (a newer spotguard's?); not touching it",
                root / info.name, info.foreign_format, FORMAT,
            )  # fmt: skip
            continue
        if info.status == "incomplete" and info.node_files is None and info.name not in except_names:
            if _manifest_unreadable(root / info.name):
                continue
            shutil.rmtree(root / info.name, ignore_errors=True)
            removed.append(info.name)
    return removed


def _manifest_unreadable(step_dir: Path) -> bool:
    """Whether ``step_dir``'s manifest could not be read for a reason that says nothing of it (the
    process out of descriptors, an I/O error, a permission): such a checkpoint may be complete, and
    was removed as a killed writer's leftover. Logged."""
    try:
        load_manifest(step_dir)
    except (ManifestError, SymlinkRefused, NotARegularFile):
        return False  # none, or not one: a leftover
    except OSError as exc:
        logger.warning("%s: its manifest cannot be read (%s): not removed as a leftover", step_dir, exc)
        return True
    return False


def prune_local(root: Path, keep: int, *, protected: frozenset[str] = frozenset()) -> list[str]:
    """Keep the newest ``keep`` complete checkpoints (or committed shares: :attr:`CheckpointInfo.held`)
    and every name in ``protected``; delete older ones. Incomplete directories are left alone: a
    writer may be filling one."""
    complete = [info for info in scan_local(root) if info.held]
    doomed = [info.name for info in complete[:-keep] if info.name not in protected] if keep > 0 else []
    for name in doomed:
        shutil.rmtree(root / name, ignore_errors=True)
    return doomed
