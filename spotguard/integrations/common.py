"""What the framework callbacks share: their settings, and finding a checkpoint to resume.

A framework writes its own resumable form (Lightning's ``.ckpt``, the Hugging Face ``checkpoint-N/``
folder) into a fresh spotguard step directory inside :meth:`Guard.external_save`, which records every
file in the manifest, commits it last, and tells the daemon, exactly as :meth:`Guard.save` does for its
own files. The manifest's ``meta`` says which framework wrote the checkpoint and where its form lies
(``meta["resume"]``), so :func:`find_resumable` returns a path the framework itself accepts.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from spotguard.errors import FatalError
from spotguard.localstore import newest_verified, scan_local
from spotguard.manifest import CheckpointInfo, Manifest, load_manifest_or_none
from spotguard.trainer.client import ask_daemon_for_root
from spotguard.trainer.schedule import check_periodic
from spotguard.trainer.settings import GuardOptions, TrainerSettings

logger = logging.getLogger("spotguard.integrations")

# In a checkpoint root: held by the one process fetching a checkpoint from the bucket into that root.
RESTORE_LOCK = ".spotguard-restore.lock"


def checked_options(options: GuardOptions) -> GuardOptions:
    """A callback's keyword arguments (those of :class:`spotguard.Guard`), checked when the callback is
    made: the Guard itself is built later, once the framework has set up ``torch.distributed``."""
    check_periodic(options.get("every_steps"), options.get("every_seconds"))
    return options


def resume_location(options: GuardOptions, root: str | os.PathLike[str] | None = None) -> tuple[Path, str | None]:
    """(the checkpoint root, the bucket) a callback resumes from: ``root``, else the options' (or the
    environment's) ``checkpoint_dir``, else the daemon's root."""
    checkpoint_dir = root if root is not None else options.get("checkpoint_dir")
    settings = TrainerSettings.from_env(checkpoint_dir, options.get("bucket"), options.get("socket"))
    if settings.checkpoint_dir is not None:
        return settings.checkpoint_dir, settings.bucket
    return ask_daemon_for_root(settings.socket), settings.bucket


# --- resume -------------------------------------------------------------------------------------


def find_resumable(
    root: Path,
    bucket: str | None,
    framework: str,
    *,
    wait: float = 600.0,
    clock: Callable[[], float] = time.monotonic,
    live: Mapping[str, Any] | None = None,
) -> Path | None:
    """The framework's own resumable form inside the newest complete checkpoint of ``framework``.

    Looks in the local root first (manifest valid, sizes and CRC32C checked); if none there, or a
    newer one there was found bad, and a bucket is given, downloads the bucket's newest complete one
    newer than the local one found (verified, falling back to older ones only where one is found
    bad: :class:`~spotguard.storage.checkpoints.CheckpointUnreadable` if the bucket or the disk fails).
    One process per root downloads: the first to take the root's restore lock. The others (the
    other ranks writing to that disk) wait up to ``wait`` seconds for it, then find its copy. A
    rank is not asked which it is: on nodes with disks of their own, each disk gets its own copy,
    however the launcher numbered the ranks.

    ``live`` (the model, the optimizer, named as they were when saved) is compared with the chosen
    checkpoint's recorded contents first, from its manifest alone: a mismatch raises
    :class:`~spotguard.SpotguardMismatch` before any data is fetched or handed to the framework.
    """
    found, skipped = _newest_local(root, framework, live)
    if found is not None and (not skipped or bucket is None):
        return found[0]
    if bucket is None:
        refuse_a_split_checkpoint(root)
        return None
    from spotguard.storage import open_storage  # a storage SDK only now, and only if needed
    from spotguard.storage.checkpoints import list_remote, restore

    with _restore_lock(root, wait, clock):
        found, skipped = _newest_local(root, framework, live)  # fetched by the process that held the lock before
        if found is not None and not skipped:
            return found[0]
        storage = open_storage(bucket)
        try:
            listing = list_remote(storage)
            if found is not None:  # a newer local one was bad: only the bucket's newer ones are worth a download
                listing = [info for info in listing if info.step > found[1]]
            complete = [info for info in listing if info.status == "complete"]
            if complete and complete[-1].manifest is not None:
                check_live(complete[-1].name, complete[-1].manifest, live)
            step_dir = restore(storage, root, log=logger.warning, candidates=listing)
        finally:
            storage.close()
    if step_dir is None:
        return None if found is None else found[0]
    logger.info("spotguard: restored %s from %s", step_dir.name, bucket)
    return _resume_target(step_dir, framework)


# What one rank's ``resume_path()`` found: (the step directory's name or None, the root it looked in);
# None where it was not asked.
ResumeAnswer = tuple[str | None, str] | None


def resume_for(
    options: GuardOptions, framework: str, live: Mapping[str, Any] | None, root: str | os.PathLike[str] | None = None
) -> tuple[Path | None, ResumeAnswer]:
    """A callback's ``resume_path()``: :func:`find_resumable` in :func:`resume_location`'s root and
    bucket, and what it found as the ranks compare it (the step directory the framework's form sits in)."""
    where, bucket = resume_location(options, root)
    found = find_resumable(where, bucket, framework, live=live)
    return found, (found.parent.name if found is not None else None, str(where))


class ResumeDisagreement(FatalError, RuntimeError):
    """The ranks of one job would resume from different checkpoints, or some from none."""


def check_ranks_resume_alike(answer: ResumeAnswer) -> None:
    """Under ``torch.distributed``, every rank's ``resume_path()`` answer compared, before the framework
    loads anything: a collective, so every rank calls it. Ranks resuming from different steps would
    meet in different collectives and hang, or fail with a transport error that says nothing of why;
    this raises :class:`ResumeDisagreement` on every rank instead, saying what each one found."""
    from spotguard.trainer import dist

    answers = [(rank, found) for rank, found in enumerate(dist.all_gather(answer)) if found is not None]
    if len({name for _, (name, _) in answers}) <= 1:
        return
    found = "; ".join(f"rank {rank}: {name or 'none'} in {root}" for rank, (name, root) in answers)
    raise ResumeDisagreement(
        f"the ranks would resume from different checkpoints ({found}). A rank whose checkpoint_dir has "
        "no complete checkpoint fetches the newest from the bucket, where it counts once every node's "
        "share is in: on nodes with disks of their own set bucket=, or put checkpoint_dir on a "
        "filesystem every node mounts"
    )


class SplitCheckpoint(FatalError, RuntimeError):
    """A checkpoint written across several nodes' disks, with no bucket to gather it from."""


def refuse_a_split_checkpoint(root: Path) -> None:
    """Raise :class:`SplitCheckpoint` where ``root`` holds this node's committed share of a multi-node
    checkpoint and nothing resumable: no disk holds the whole of it, and starting over would silently
    throw the job's progress away."""
    shares = [info for info in scan_local(root) if info.status != "complete" and info.node_files is not None]
    if shares:
        raise SplitCheckpoint(
            f"{root / shares[-1].name} holds only this node's share of a checkpoint written across several "
            "nodes' disks, and no bucket is set to fetch the rest from: set bucket= (each node's daemon "
            "uploads its share, and a resume fetches the whole), or put checkpoint_dir on a filesystem "
            "every node mounts. To start over instead, move the step directories away"
        )


@contextlib.contextmanager
def _restore_lock(root: Path, wait: float, clock: Callable[[], float]) -> Iterator[None]:
    """Hold ``root``'s restore lock (``flock`` on :data:`RESTORE_LOCK`), waiting up to ``wait`` s for
    the process holding it (polled, so that the deadline holds). A lock needs no write access to its
    file, which is opened read-only; the lock ends with the descriptor, even when its holder is
    killed mid-fetch."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / RESTORE_LOCK, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        deadline = clock() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if clock() >= deadline:
                    raise TimeoutError(
                        f"another process has been restoring a checkpoint into {root} for {wait:.0f} s"
                    ) from None
                time.sleep(0.2)  # polled, not blocked on: a blocking flock has no deadline
        yield
    finally:
        os.close(fd)  # and the lock with it


def check_live(name: str, manifest: Manifest, live: Mapping[str, Any] | None) -> None:
    """Raise :class:`~spotguard.SpotguardMismatch` if ``live`` does not fit what ``manifest`` records.

    Only the entries ``live`` names are compared (the framework's checkpoint holds more). The framework
    loads the checkpoint itself, strictly, so there is no partial load here.
    """
    if not live:
        return
    if manifest.contents is None:
        logger.info("spotguard: %s records no contents (written by an older spotguard): not checked", name)
        return
    from spotguard.trainer.contents import SpotguardMismatch, compare, describe_entry

    differences = compare(manifest, {key: describe_entry(value) for key, value in live.items()}, per_rank=False)
    if differences:
        raise SpotguardMismatch(name, differences)


def _newest_local(root: Path, framework: str, live: Mapping[str, Any] | None) -> tuple[tuple[Path, int] | None, bool]:
    """The framework's resumable form in the newest verified local checkpoint and that checkpoint's
    step (None if none), and whether a newer one was skipped as bad: the bucket may hold an intact
    copy of it, newer than what this disk has."""

    def pick(info: CheckpointInfo) -> tuple[Path, int] | None:
        target = _resume_target(root / info.name, framework)
        if target is None:
            return None
        assert info.manifest is not None  # complete
        check_live(info.name, info.manifest, live)
        return target, info.step

    return newest_verified(root, pick)


def _resume_target(step_dir: Path, framework: str) -> Path | None:
    manifest = load_manifest_or_none(step_dir)
    if manifest is None:
        return None
    if manifest.meta.get("framework") != framework or not isinstance(manifest.meta.get("resume"), str):
        logger.warning(
            "spotguard: skipping %s: not a %s checkpoint (meta %s)", step_dir.name, framework, dict(manifest.meta)
        )
        return None
    target = step_dir / manifest.meta["resume"]
    return target if target.exists() else None
