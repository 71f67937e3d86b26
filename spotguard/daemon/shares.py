"""Checkpoints of several nodes, as this node's uploader sees them. Each node's daemon sends its own
share; node 0's commits the checkpoint once every share is in the bucket, waiting for the others'
on a first attempt. A node that died before its share was in never sends it: node 0 tried again for
good, each attempt holding the one upload slot for the whole wait, while newer checkpoints queued
behind it. Now an attempt after one that found shares missing only looks, and a checkpoint whose
shares never came is given up once a newer one is committed (it can no longer be what a resume takes).
"""

from __future__ import annotations

import logging

from spotguard.manifest import parse_step_dir
from spotguard.storage.checkpoints import OtherNodesMissing

logger = logging.getLogger("spotguard.uploader")

OTHER_NODES_WAIT = 600.0  # seconds node 0 waits for the other nodes' shares on a first attempt (no notice)


class NodeShares:
    def __init__(self, wait: float = OTHER_NODES_WAIT) -> None:
        self.wait = wait
        self.uploaded: set[str] = set()  # this node's share is in the bucket
        self.missing: set[str] = set()  # node 0: other nodes' shares were missing at the last attempt
        self.superseded: set[str] = set()  # given up for a newer checkpoint committed meanwhile

    def wait_for(self, name: str) -> float:
        """How long node 0's attempt at ``name`` waits for the other shares: the whole wait at first,
        a look only after an attempt that found them missing (its retries are spaced already)."""
        return 0.0 if name in self.missing else self.wait

    def failed(self, name: str, exc: Exception) -> None:
        if isinstance(exc, OtherNodesMissing):
            self.missing.add(name)

    def committed(self, name: str) -> list[str]:
        """``name`` is committed: the checkpoints before it whose shares were missing are given up
        (returned, for the caller to stop retrying; logged)."""
        self.missing.discard(name)
        step = parse_step_dir(name)
        older = sorted(n for n in self.missing if step is not None and (parse_step_dir(n) or 0) < step)
        for old in older:
            self.missing.discard(old)
            self.superseded.add(old)
            logger.warning(
                "not committing %s: other nodes' shares never reached the bucket, and %s is committed since",
                old,
                name,
            )
        return older

    def settled(self) -> set[str]:
        """What this node will send no more of (retention may prune it here)."""
        return self.uploaded | self.superseded

    def keep_only(self, names: set[str]) -> None:
        """Forget the checkpoints not in ``names`` (gone from this disk)."""
        self.uploaded &= names
        self.missing &= names
        self.superseded &= names


__all__ = ["OTHER_NODES_WAIT", "NodeShares"]
