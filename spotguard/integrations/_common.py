"""What the framework callbacks share: committing a checkpoint a framework wrote, and finding one to resume.

A framework writes its own resumable form (Lightning's ``.ckpt``, the Hugging Face ``checkpoint-N/``
folder) into a fresh spotguard step directory; :func:`commit_external` then records every file in
the manifest, commits it last, and tells the daemon, exactly as :meth:`Guard.save` does for its own
files. The manifest's ``meta`` says which framework wrote the checkpoint and where its form lies
(``meta["resume"]``), so :func:`find_resumable` returns a path the framework itself accepts.

Candidate for a public hook in ``Guard`` (kept here while ``guard.py`` is being reworked)::

    with guard.external_save(step, meta=...) as step_dir:   # prepares the directory, all ranks agree
        framework_writes_into(step_dir)
    # -> every file recorded, manifest committed by rank 0, daemon told, flags cleared

It uses ``Guard``'s private flags (``_notice``, ``_sigterm``, ``_urgent_agreed``) and ``_after_save``
to behave exactly like ``Guard.save``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotguard.localstore import CheckpointExists, CheckpointWriter, scan_local
from spotguard.manifest import MANIFEST, Manifest, load_manifest_or_none, verify_dir

if TYPE_CHECKING:
    from spotguard.trainer.guard import Guard

logger = logging.getLogger("spotguard.integrations")


class AlreadyCommitted(Exception):
    """The step is already a complete checkpoint; nothing was written (checkpoints are never overwritten)."""

    def __init__(self, step_dir: Path) -> None:
        super().__init__(f"{step_dir} is already committed")
        self.step_dir = step_dir


def pending_reason(guard: Guard) -> tuple[str, dict[str, Any] | None]:
    """The manifest ``reason`` for a save now, and the notice it answers (as ``Guard.save`` decides)."""
    with guard._lock:
        notice = guard._notice
    urgent = notice is not None or guard._sigterm or guard._urgent_agreed
    reason = "urgent" if urgent else "periodic"
    if notice is not None and not notice["stop"]:
        reason = "soft"
    return reason, notice


@contextmanager
def commit_external(
    guard: Guard, step: int, meta: Mapping[str, Any], live: Mapping[str, Any] | None = None
) -> Iterator[Path]:
    """Prepare ``<root>/step-N/`` for a framework to write into; on a clean exit commit it and tell the daemon.

    Every rank must enter (the directory exists on all ranks before anyone writes, and nobody leaves
    before rank 0 committed). Raises :class:`AlreadyCommitted` (before yielding) if the step is
    already complete. On an exception nothing is committed: the directory stays incomplete and the
    next writer removes it. ``live`` (e.g. ``{"model": ..., "optimizer": ...}``) is described in the
    manifest, so that a resume can be checked against it before anything is fetched.
    """
    from spotguard.trainer import dist

    reason, notice = pending_reason(guard)
    full_meta: dict[str, Any] = dict(meta)
    if notice is not None:
        full_meta["event_id"] = notice["notice"]["event_id"]
    contents = None
    if live is not None:
        from spotguard.trainer.contents import describe_state

        contents = describe_state(live, guard.world_size)  # what resume_path(model=...) checks
    writer = CheckpointWriter(
        guard.checkpoint_dir, step, reason=reason, world_size=guard.world_size, meta=full_meta, contents=contents
    )
    try:
        guard._open_step_dir(writer)
    except CheckpointExists:
        logger.info("spotguard: %s is already committed; not writing it again", writer.dir.name)
        guard._after_save(step, writer.dir, reason, notice)
        raise AlreadyCommitted(writer.dir) from None
    with dist.settled(f"writing {writer.dir.name}"):  # every rank's files are in place, or all ranks hear why not
        yield writer.dir
    with dist.settled(f"committing {writer.dir.name}"):  # nobody goes on (or exits) before the commit
        if guard.rank == 0:
            for relpath in _files_under(writer.dir):
                _fsync_file(writer.dir / relpath)  # frameworks write without fsync; the manifest must not lie
                writer.add_existing(relpath)
            writer.commit()
    guard._after_save(step, writer.dir, reason, notice)


def _files_under(step_dir: Path) -> list[str]:
    return sorted(
        path.relative_to(step_dir).as_posix()
        for path in step_dir.rglob("*")
        if path.is_file() and path.relative_to(step_dir).as_posix() != MANIFEST
    )


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- resume -------------------------------------------------------------------------------------


def find_resumable(
    root: Path,
    bucket: str | None,
    framework: str,
    *,
    local_rank: int = 0,
    wait: float = 600.0,
    clock: Callable[[], float] = time.monotonic,
    live: Mapping[str, Any] | None = None,
) -> Path | None:
    """The framework's own resumable form inside the newest complete checkpoint of ``framework``.

    Looks in the local root first (manifest valid, sizes and CRC32C checked); if none there and a
    bucket is given, downloads the newest complete one (verified, falling back to older ones).
    Only ``local_rank`` 0 downloads; other local ranks wait for its copy to appear.

    ``live`` (the model, the optimizer, named as they were when saved) is compared with the chosen
    checkpoint's recorded contents first, from its manifest alone: a mismatch raises
    :class:`~spotguard.SpotguardMismatch` before any data is fetched or handed to the framework.
    """
    found = _newest_local(root, framework, live)
    if found is not None or bucket is None:
        return found
    from spotguard.storage import open_storage  # a storage SDK only now, and only if needed
    from spotguard.storage.checkpoints import list_remote, restore

    storage = open_storage(bucket)
    try:
        listing = list_remote(storage)
        complete = [info for info in listing if info.status == "complete"]
        if complete and complete[-1].manifest is not None:
            check_live(complete[-1].name, complete[-1].manifest, live)
        if local_rank == 0:
            step_dir = restore(storage, root, log=logger.warning, candidates=listing)
            if step_dir is None:
                return None
            logger.info("spotguard: restored %s from %s", step_dir.name, bucket)
            return _resume_target(step_dir, framework)
        names = [info.name for info in complete]
    finally:
        storage.close()
    if not names:
        return None
    # Another process on this machine downloads; wait for any complete checkpoint it leaves.
    deadline = clock() + wait
    while clock() < deadline:
        found = _newest_local(root, framework, None)
        if found is not None:
            return found
        time.sleep(0.2)
    raise TimeoutError(f"local rank 0 did not restore a checkpoint into {root} within {wait:.0f} s")


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


def _newest_local(root: Path, framework: str, live: Mapping[str, Any] | None) -> Path | None:
    for info in reversed(scan_local(root)):
        if info.status != "complete":
            continue
        problems = verify_dir(root / info.name)
        if problems:
            logger.warning("spotguard: skipping %s: %s", info.name, "; ".join(problems))
            continue
        target = _resume_target(root / info.name, framework)
        if target is not None:
            assert info.manifest is not None  # complete
            check_live(info.name, info.manifest, live)
            return target
    return None


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


def env_local_rank() -> int:
    """This process's rank on its machine before ``torch.distributed`` is up (launchers set LOCAL_RANK)."""
    try:
        return int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        return 0
