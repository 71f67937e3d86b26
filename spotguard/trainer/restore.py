"""Resume: choose the newest complete checkpoint (a peer's, the local root's, the bucket's), check it
against the live state from its manifest alone, make it whole on this disk, and load it.

Under ``torch.distributed`` rank 0 chooses, every rank checks and loads the same checkpoint, and a
failure anywhere reaches every rank (``dist.settled``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any

from spotguard import protocol
from spotguard.localstore import newest_verified, scan_local
from spotguard.manifest import Manifest, ManifestError, load_manifest, verify_dir
from spotguard.trainer import dist
from spotguard.trainer.client import DaemonClient
from spotguard.trainer.contents import (
    SHOWN,
    ResumeReport,
    SpotguardMismatch,
    compare,
    describe_entry,
    make_report,
    refuse_newer_format,
)
from spotguard.trainer.state import DCP_LAYOUT, read_state

logger = logging.getLogger("spotguard.trainer")


@dataclass
class Resumer:
    """Finds, fetches and loads the checkpoint a Guard resumes from."""

    checkpoint_dir: Path
    bucket: str | None
    client: DaemonClient
    _: KW_ONLY
    io_threads: int
    daemon_wait: float

    def choose(self, state: Mapping[str, Any], *, strict: bool) -> ResumeReport | None:
        """The checkpoint to load, whole on this disk, with what of ``state`` it leaves out; None if
        there is none. Raises :class:`SpotguardMismatch` (every rank alike) on a mismatch when ``strict``."""
        candidates: list[tuple[str, Manifest, bool]] = []
        one_disk = self._one_disk()
        with dist.settled("choosing a checkpoint to resume"):  # e.g. a newer format: every rank raises it
            if dist.rank() == 0:
                self._ask_peers(fetch=one_disk)
                candidates = self._candidates()
        for name, manifest, verified in dist.broadcast_object(candidates):
            report = self._check(name, manifest, state)
            if report.differences and strict:
                raise SpotguardMismatch(name, report.differences)
            if self._fetch(name, manifest, verified=verified):
                return report
        return None

    def load(self, report: ResumeReport, state: MutableMapping[str, Any]) -> Manifest:
        """Load the chosen checkpoint into ``state``, leaving out what ``report`` says. Collective."""
        step_dir = self.checkpoint_dir / report.checkpoint
        with dist.settled(f"loading {report.checkpoint}"):
            manifest = load_manifest(step_dir)
            if manifest.meta.get("layout") == DCP_LAYOUT:
                from spotguard.trainer.sharded import load_sharded as load
            else:
                load = read_state
            load(
                step_dir,
                manifest,
                state,
                skip_entries=report.skipped_entries,
                skip_keys=report.skipped_keys,
                threads=self.io_threads,
            )
        if report.differences:
            logger.warning(
                "spotguard: resumed from %s partially (strict=False): left as they were %s",
                step_dir,
                "; ".join(str(difference) for difference in report.differences[:SHOWN]),
            )
        logger.info("spotguard: resumed from %s (%s)", step_dir, manifest.reason)
        return manifest

    def _one_disk(self) -> bool:
        """Whether every rank reads this checkpoint root (one node): only then can a checkpoint the
        daemon fetched onto this disk be resumed by all. Collective."""
        if not dist.active():
            return True
        return len(set(dist.all_gather(dist.node_key(self.checkpoint_dir)))) == 1

    def _daemon_has_peers(self) -> bool:
        if self.client.welcome is None and self.client.socket_path.exists():
            self.client.welcomed.wait(self.daemon_wait)  # a daemon is there: its welcome says
        return bool(self.client.welcome and self.client.welcome.get("peers"))

    def _ask_peers(self, *, fetch: bool) -> None:
        """A peer may hold a checkpoint newer than any here or in the bucket (its sender died and the
        peer is still committing it): the daemon fetches it, verified, into the checkpoint root,
        where the choice that follows finds it. The rule: spotguard/peer/fetch.py."""
        if not self._daemon_has_peers():
            return
        newest = max((i.step for i in scan_local(self.checkpoint_dir) if i.status == "complete"), default=-1)
        reply = self.client.ask("peer-resume", timeout=protocol.PEER_RESUME_TIMEOUT + 30, after=newest, fetch=fetch)
        if reply is None or reply["type"] != "peer-resume":
            return
        not_fetched = reply.get("not_fetched")
        for where in not_fetched[:SHOWN] if isinstance(not_fetched, list) else ():  # the reply's fields are unchecked
            logger.warning(
                "spotguard: %s is newer than step %s but was not fetched (a node's share, or a multi-node "
                "job): resuming from the newest complete checkpoint instead",
                where,
                reply["after"],
            )
        path = reply.get("path")
        if isinstance(path, str):
            if Path(path).parent.resolve() != self.checkpoint_dir.resolve():
                logger.warning("spotguard: the daemon fetched %s, outside %s: not used", path, self.checkpoint_dir)
            else:
                logger.info("spotguard: fetched %s from peer %s: newer than the bucket's", path, reply.get("peer"))

    def _check(self, name: str, manifest: Manifest, state: Mapping[str, Any]) -> ResumeReport:
        """Compare the checkpoint's recorded contents with ``state``; every rank gets the same answer."""
        sharded = manifest.meta.get("layout") == DCP_LAYOUT
        # Sharded: no plain state_dict() (a collective under FSDP); the model's keys as DCP sees them.
        live = {key: describe_entry(value, shapes=not sharded) for key, value in state.items()}
        if sharded:
            from spotguard.trainer.sharded import describe_dcp_model

            describe_dcp_model(state, live)
        differences = compare(manifest, live, per_rank=sharded)
        if dist.active():
            merged = [d for ranks_differences in dist.all_gather(differences) for d in ranks_differences]
            differences = list(dict.fromkeys(merged))
        if manifest.contents is None:
            logger.info(
                "spotguard: %s was written before checkpoints recorded their contents: only its entries "
                "are checked before loading",
                name,
            )
        return make_report(name, manifest, differences, live)

    def _candidates(self) -> list[tuple[str, Manifest, bool]]:
        """Checkpoints to resume from, best first, each with whether its local copy was verified
        here: the bucket's complete ones newer than the newest verified local one, then that one;
        without a local one, every complete one of the bucket (their manifests only: nothing else is
        fetched before the check). A local root can hold an old step while the bucket went on (a
        node's directory the job left, and came back to, or a newer local one skipped as bad, whose
        intact copy the bucket may hold)."""
        local, skipped = newest_verified(
            self.checkpoint_dir,
            lambda info: None if info.manifest is None else (info.name, info.manifest, True),
            threads=self.io_threads,
            on_incomplete=lambda info: refuse_newer_format(load_manifest, self.checkpoint_dir / info.name),
        )
        if local is None:
            return self._bucket_candidates()
        if skipped:
            return [*self._bucket_candidates(newer_than=local[1].step), local]
        return [*self._newer_in_bucket(local), local]

    def _newer_in_bucket(self, local: tuple[str, Manifest, bool]) -> list[tuple[str, Manifest, bool]]:
        """The bucket's complete checkpoints newer than ``local`` (a good one: a bucket that cannot be
        read, or a store whose SDK is not installed, leaves it the choice, logged)."""
        from spotguard.storage.base import StorageError  # stdlib only

        try:
            newer = self._bucket_candidates(newer_than=local[1].step)
        except (StorageError, OSError, ImportError) as exc:
            logger.warning(
                "spotguard: could not look in %s for a checkpoint newer than %s (%s): resuming from this disk's",
                self.bucket,
                local[0],
                exc,
            )
            return []
        if newer:
            logger.warning(
                "spotguard: %s holds %s, newer than this disk's newest %s (a root the job left and came back "
                "to?): resuming from the bucket's",
                self.bucket,
                newer[0][0],
                local[0],
            )
        return newer

    def _bucket_candidates(self, newer_than: int | None = None) -> list[tuple[str, Manifest, bool]]:
        """The bucket's complete checkpoints (of a step above ``newer_than``), newest first (none
        without a bucket)."""
        if self.bucket is None:
            return []
        from spotguard.storage import open_storage  # imports a storage SDK only now, if at all
        from spotguard.storage.checkpoints import list_remote, read_remote_manifest

        storage = open_storage(self.bucket)
        try:
            found = []
            for info in reversed(list_remote(storage, newer_than=newer_than)):
                if info.status == "complete" and info.manifest is not None:
                    found.append((info.name, info.manifest, False))
                elif not found:  # newer than every complete one: a format this reader cannot read?
                    refuse_newer_format(read_remote_manifest, storage, info.name)
            return found
        finally:
            storage.close()

    def _fetch(self, name: str, manifest: Manifest, *, verified: bool) -> bool:
        """Make ``name`` whole on this disk (the node's leader downloads it); False on every rank if
        it failed verification (the caller tries the previous one); :class:`CheckpointUnreadable` on
        every rank if it could not be read for another reason (the bucket, the disk). Collective. A bucket's checkpoint
        (not ``verified`` here) always goes through the restore, which keeps a local copy only once
        every byte of it matched: that copy may be the very one found corrupt."""
        failed = False
        leader = dist.is_node_leader(self.checkpoint_dir)
        with dist.settled(f"fetching {name}"):  # anything but a failed verification reaches every rank
            if leader and (not verified or verify_dir(self.checkpoint_dir / name, checksums=False)):
                # From the bucket, or not whole on this disk (another node's, or only this node's share).
                from spotguard.storage.base import StorageError  # stdlib only
                from spotguard.storage.checkpoints import found_bad, unreadable

                try:
                    self._restore_from_bucket(step=manifest.step)
                except (StorageError, ManifestError, OSError) as exc:
                    if not found_bad(exc):  # a bucket that keeps failing, a full disk: every rank raises
                        raise unreadable(name, exc, self.checkpoint_dir) from exc
                    logger.warning("spotguard: %s failed verification (%s); trying the previous checkpoint", name, exc)
                    failed = True
        return not dist.agree_any([failed])[0]  # also: nobody loads before the leader has fetched

    def _restore_from_bucket(self, step: int | None = None) -> Path | None:
        from spotguard.storage import open_storage  # imports a storage SDK only now, if at all
        from spotguard.storage.checkpoints import restore

        assert self.bucket is not None
        storage = open_storage(self.bucket)
        try:
            return restore(storage, self.checkpoint_dir, step=step, log=logger.warning)
        finally:
            storage.close()
