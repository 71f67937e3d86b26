"""Retention after a commit: old checkpoints pruned in the bucket, then on the local disk."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from spotguard.localstore import prune_local, scan_local
from spotguard.storage.base import Storage, StorageError
from spotguard.storage.checkpoints import KnownManifests, prune_remote

logger = logging.getLogger("spotguard.uploader")


async def apply_retention(
    storage: Storage,
    root: Path,
    *,
    keep_remote: int,
    keep_local: int,
    grace: timedelta,
    in_flight: frozenset[str],
    settled: Callable[[], set[str]],
    bucket: bool = True,
    known: KnownManifests | None = None,
) -> None:
    """Keep the newest ``keep_remote`` checkpoints in the bucket (never one ``in_flight``; not done
    unless ``bucket``: a multi-node job's node other than 0 leaves the bucket to node 0, which
    commits) and the newest ``keep_local`` under ``root``, never deleting a checkpoint or share held
    here and not in ``settled()`` (asked once the bucket is pruned: committed there, this node's
    share sent there, or another writer's there)."""
    if bucket:
        try:
            removed = await asyncio.to_thread(
                prune_remote, storage, keep_remote, protected=in_flight, grace=grace, known=known
            )
            if removed:
                logger.info("bucket retention removed %s", ", ".join(removed))
        except (StorageError, OSError) as exc:
            logger.warning("bucket retention failed: %s", exc)
    # Locally, never delete what is not yet safe in the bucket.
    safe = settled()

    def prune() -> None:
        local = scan_local(root)
        not_uploaded = frozenset(info.name for info in local if info.held and info.name not in safe)
        prune_local(root, keep_local, protected=not_uploaded)

    await asyncio.to_thread(prune)
