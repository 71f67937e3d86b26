"""What the framework callbacks share: their settings, and finding a checkpoint to resume.

A framework writes its own resumable form (Lightning's ``.ckpt``, the Hugging Face ``checkpoint-N/``
folder) into a fresh spotguard step directory inside :meth:`Guard.external_save`, which records every
file in the manifest, commits it last, and tells the daemon, exactly as :meth:`Guard.save` does for its
own files. The manifest's ``meta`` says which framework wrote the checkpoint and where its form lies
(``meta["resume"]``), so :func:`find_resumable` returns a path the framework itself accepts.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from spotguard.localstore import scan_local
from spotguard.manifest import Manifest, load_manifest_or_none, verify_dir
from spotguard.trainer.client import ask_daemon_for_root
from spotguard.trainer.schedule import check_periodic
from spotguard.trainer.settings import GuardOptions, TrainerSettings

logger = logging.getLogger("spotguard.integrations")


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
