"""``Guard``: the few lines a training loop needs to survive a spot interruption."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Collection, Mapping, MutableMapping
from datetime import datetime
from pathlib import Path
from socket import gethostname
from types import FrameType
from typing import Any

from spotguard import protocol
from spotguard.config import trainer_settings
from spotguard.localstore import CheckpointExists, CheckpointWriter, prune_local, remove_incomplete, scan_local
from spotguard.manifest import FileEntry, Manifest, ManifestError, load_manifest, load_manifest_or_none, verify_dir
from spotguard.notice import parse_iso
from spotguard.safefile import SaveCancelled
from spotguard.space import SpotguardDiskFull, free_bytes, is_disk_full, make_room
from spotguard.trainer import dist, threads
from spotguard.trainer.client import DaemonClient
from spotguard.trainer.contents import (
    SHOWN,
    ResumeReport,
    SpotguardMismatch,
    compare,
    describe_entry,
    describe_state,
    make_report,
    refuse_newer_format,
)
from spotguard.trainer.state import (
    DCP_LAYOUT,
    Payloads,
    Stager,
    StateError,
    check_state,
    estimate_bytes,
    is_tensor,
    read_state,
    write_payloads,
)
from spotguard.trainer.writer import ParallelWriter

logger = logging.getLogger("spotguard.trainer")


def check_periodic(every_steps: int | None, every_seconds: float | None) -> None:
    if every_steps is not None and every_steps < 1:
        raise ValueError(f"every_steps must be >= 1, got {every_steps}")
    if every_seconds is not None and every_seconds <= 0:
        raise ValueError(f"every_seconds must be > 0, got {every_seconds}")


def root_of(client: DaemonClient, socket_path: Path, wait: float) -> Path:
    """The checkpoint root the daemon behind ``client`` serves (its welcome says it)."""
    if client.welcomed.wait(wait) and client.welcome:
        return Path(client.welcome["checkpoint_dir"])
    raise ValueError(
        "Guard needs a checkpoint directory: pass checkpoint_dir=, set SPOTGUARD_CHECKPOINT_DIR, "
        f"or run the spotguard daemon (no answer on {socket_path})"
    )


def ask_daemon_for_root(socket_path: Path, wait: float = 2.0) -> Path:
    """The daemon's checkpoint root, asked before any Guard exists (and before torch.distributed is up)."""
    hello = {"rank": 0, "world_size": 1, "pid": os.getpid(), "checkpoint_dir": ""}
    client = DaemonClient(socket_path, hello, lambda _message: None).start()
    try:
        return root_of(client, socket_path, wait)
    finally:
        client.close()


class Guard:
    """Checkpoint when the VM is about to go away, and resume exactly where training stopped.

    >>> guard = Guard(checkpoint_dir="/nvme/ckpt", bucket="s3://b/run1")
    >>> state = {"model": model, "optimizer": opt, "scheduler": sched, "loader": loader}
    >>> step = guard.resume(state)             # 0 when there is nothing to resume
    >>> while step < total_steps:
    ...     train_one_step(); step += 1
    ...     if guard.should_checkpoint(step):  # a notice arrived (all ranks agree) or periodic due
    ...         guard.save(state, step)        # returns once committed locally
    ...     if guard.stop_requested:           # a hard notice: the VM is going away
    ...         break
    >>> guard.close()

    Without a daemon it still saves and resumes local checkpoints, and SIGTERM to the trainer
    works as a hard notice (the handler only sets a flag; the save happens at the next step).

    ``write_threads`` threads write the state files of each save (default ``$SPOTGUARD_WRITE_THREADS``,
    else one per CPU, at least 4 and at most 16: the disk's queue depth matters more than the cores).
    """

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        bucket: str | None = None,
        socket: str | os.PathLike[str] | None = None,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        *,
        keep: int = 2,
        handle_sigterm: bool = True,
        daemon_wait: float = 2.0,
        write_threads: int | None = None,
    ) -> None:
        check_periodic(every_steps, every_seconds)
        io_threads = threads.write_threads(write_threads)  # checked before anything starts
        dist.check_initialised()
        settings = trainer_settings(checkpoint_dir, bucket, socket)
        self.bucket = settings.bucket
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.keep = keep
        self.rank = dist.rank()
        self.world_size = dist.world_size()
        self._io_threads = io_threads  # threads that write and read this rank's files
        self._daemon_wait = daemon_wait

        self._lock = threading.Lock()
        self._notice: dict[str, Any] | None = None  # the checkpoint-now message not yet saved for
        self._notice_received: float | None = None
        self._handled_events: set[str] = set()
        self._acknowledged: set[str] = set()  # notices the daemon was told we are acting on
        self._sigterm = False  # set by the signal handler: a plain store, safe there
        self._stop_agreed = False
        self._urgent_agreed = False
        self._last_save_step: int | None = None
        self._last_save_time = time.monotonic()
        self.timeline: dict[str, float] = {}  # wall-clock times of the last urgent save, for reports
        self._stager = Stager()
        # Writes the state files of urgent and periodic saves (never both at once: an urgent save
        # first cancels the periodic one); its staging buffers for CUDA tensors are kept across saves.
        self._files_writer = ParallelWriter(io_threads)
        self._background: tuple[threading.Thread, threading.Event] | None = None
        self._background_error: Exception | None = None
        self._node_leader = self.rank == 0  # the rank that tells this node's daemon about commits
        self.last_resume_report: ResumeReport | None = None  # what the last resume loaded and left
        self._last_bytes: int | None = None  # what the last checkpoint took on disk, to expect as much again

        root = settings.checkpoint_dir
        hello = {
            "rank": self.rank,
            "world_size": self.world_size,
            "pid": os.getpid(),
            "checkpoint_dir": str(root or ""),
        }
        self.client = DaemonClient(settings.socket, hello, self._on_daemon_message).start()
        if root is None:
            try:
                root = root_of(self.client, settings.socket, daemon_wait)
            except ValueError:
                self.client.close()
                raise
        self.checkpoint_dir = root
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)

        self._previous_handler: Any = None
        if handle_sigterm and threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

    # --- flags, set from other threads ---------------------------------------------------

    def _on_daemon_message(self, message: dict[str, Any]) -> None:
        if message["type"] != "checkpoint-now":
            return
        event_id = str(message["notice"].get("event_id", ""))
        with self._lock:
            if event_id in self._handled_events or (self._notice and self._notice["notice"]["event_id"] == event_id):
                return
            self._notice = message
            self._notice_received = time.time()
            self.timeline = {"told": self._notice_received}
        logger.warning(
            "spotguard: %s notice (%s), %.0f s to the deadline: checkpointing at the next step",
            message["notice"].get("kind"),
            "stop" if message["stop"] else "keep training",
            message["deadline_s"],
        )

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self._sigterm = True
        if callable(self._previous_handler):
            self._previous_handler(signum, frame)

    # --- the loop's questions ------------------------------------------------------------

    @property
    def stop_requested(self) -> bool:
        """True once a hard notice (or SIGTERM) means the VM is going away: save, then leave the loop.

        It changes only inside :meth:`should_checkpoint`, never on its own: a signal landing between
        the two calls must not end the loop before the checkpoint it asked for is taken.
        """
        return self._stop_agreed

    @property
    def deadline(self) -> datetime | None:
        """When the VM goes away, if a notice said so."""
        with self._lock:
            notice = self._notice
        return parse_iso(notice["notice"]["deadline"]) if notice else None

    def _local_flags(self) -> tuple[bool, bool]:
        with self._lock:
            notice = self._notice
        urgent = notice is not None or self._sigterm
        stop = bool(notice and notice["stop"]) or self._sigterm
        return urgent, stop

    def should_checkpoint(self, step: int, *, periodic: bool = True) -> bool:
        """Whether to save at this step boundary: a notice arrived on any rank, or a periodic save is due.

        Under ``torch.distributed`` this is one small all-reduce, and every rank gets the same answer.
        Call it also where the loop waits outside a step (evaluation, before the first step) with
        ``periodic=False``: a notice is then answered with a checkpoint of the last completed step, and
        the daemon reports a loop that does not ask within its bound.
        """
        urgent, stop = self._local_flags()
        periodic = (
            periodic
            and step != self._last_save_step
            and (
                (self.every_steps is not None and step % self.every_steps == 0)
                or (self.every_seconds is not None and time.monotonic() - self._last_save_time >= self.every_seconds)
            )
        )
        urgent, stop, periodic = dist.agree_any([urgent, stop, periodic])
        self._urgent_agreed = urgent
        self._stop_agreed = self._stop_agreed or stop
        if urgent:
            self._acknowledge(step)
        return urgent or periodic

    def _acknowledge(self, step: int) -> None:
        """Tell the daemon, once per notice, that this loop reached a checkpoint point: it watches for
        trainers that do not (a loop stuck in eval or a data-loader start) and reports them."""
        with self._lock:
            notice = self._notice
        if notice is None:
            return
        event_id = str(notice["notice"]["event_id"])
        if event_id not in self._acknowledged:
            self._acknowledged.add(event_id)
            self.client.send("checkpoint-started", event_id=event_id, step=step)

    # --- save ----------------------------------------------------------------------------

    def save(self, state: MutableMapping[str, Any], step: int, *, reason: str | None = None) -> Path:
        """Checkpoint ``state`` at ``step`` and return its directory.

        Urgent saves (a notice, SIGTERM) return once the checkpoint is committed locally, and
        first cancel a periodic save still being written. Periodic saves return as soon as the
        state is copied to host memory; a background thread writes and commits it (at most one
        in flight: a new periodic save first waits for the previous one; :meth:`wait` waits too).
        The daemon (if any) is told of each commit and uploads it. A step that is already
        committed is not written again: checkpoints are never overwritten.

        When the local disk is short of room, local checkpoints already complete in the bucket
        are dropped first, oldest first. If nothing can make room, an urgent save raises
        :class:`spotguard.SpotguardDiskFull` (``stop_requested`` still turns true on a hard
        notice); a periodic one logs it and training goes on. The daemon is told either way.
        """
        check_state(state)
        with self._lock:
            notice = self._notice
        urgent = notice is not None or self._sigterm or self._urgent_agreed
        if reason is None:
            reason = "urgent" if urgent else "periodic"
            if notice is not None and not notice["stop"]:
                reason = "soft"
        meta: dict[str, Any] = {"keys": sorted(state), "rank_files": self.world_size > 1}
        if notice is not None:
            meta["event_id"] = notice["notice"]["event_id"]
        in_background = reason == "periodic" and self.world_size == 1
        if in_background:
            self.wait(raise_error=False)
        else:
            self._cancel_background()
        cancel = threading.Event()
        writer = CheckpointWriter(
            self.checkpoint_dir,
            step,
            reason=reason,
            world_size=self.world_size,
            meta=meta,
            cancel=cancel,
            contents=describe_state(state, self.world_size),
        )
        if in_background:
            self._mark_saved(step, notice)  # no notice here: the periodic clock restarts
            # The only part that stalls training: copying the state into reused host buffers.
            staged = self._stager.stage(Payloads(state))
            self._background = (
                threading.Thread(
                    target=self._write_and_report,
                    args=(writer, staged, notice, estimate_bytes(staged)),
                    name=f"spotguard-save-{step}",
                    daemon=True,
                ),
                cancel,
            )
            self._background[0].start()
        else:
            needed = self._expected_bytes(state)
            try:
                self._write_and_report(writer, Payloads(state), notice, needed, raise_error=True)
            except BaseException:
                # The notice is handled only by a commit: it stays pending here (the daemon heard
                # save-failed), but a hard one still ends the loop, cleanly.
                if (notice is not None and notice["stop"]) or self._sigterm:
                    self._stop_agreed = True
                raise
            self._mark_saved(step, notice)
        return writer.dir

    def _expected_bytes(self, state: Mapping[str, Any]) -> int:
        """The room an urgent save asks for before writing: what the last checkpoint took (this run's, or
        the newest on disk), at least the tensors held directly in ``state``. Taking every entry's
        ``state_dict()`` up front would hold back the first file's upload; a state that grew past the
        expectation is caught by the write itself (ENOSPC), which then makes more room once."""
        if self._last_bytes is None:
            complete = [info for info in scan_local(self.checkpoint_dir) if info.status == "complete"]
            self._last_bytes = complete[-1].bytes if complete else 0
        return max(self._last_bytes, estimate_bytes({k: v for k, v in state.items() if is_tensor(v)}))

    def wait(self, *, raise_error: bool = True) -> None:
        """Wait for the periodic save running in the background, if any; re-raise its error."""
        if self._background is not None:
            self._background[0].join()
            self._background = None
        error, self._background_error = self._background_error, None
        if error is not None:
            if raise_error:
                raise error
            logger.error("spotguard: the previous periodic save failed: %s", error)

    def _cancel_background(self) -> None:
        if self._background is not None:
            thread, cancel = self._background
            if thread.is_alive():
                logger.info("spotguard: an urgent save pre-empts the periodic one being written")
                cancel.set()
        self.wait(raise_error=False)

    def _write_and_report(
        self,
        writer: CheckpointWriter,
        payloads: Mapping[str, Any],
        notice: dict[str, Any] | None,
        needed: int,
        raise_error: bool = False,
    ) -> None:
        try:
            self._write(writer, payloads, needed)
        except CheckpointExists:
            logger.info("spotguard: %s is already committed; not writing it again", writer.dir.name)
        except SaveCancelled:
            return  # the directory stays incomplete; the next writer removes it
        except Exception as exc:
            failure = self._save_failed(writer, exc, needed, notice)
            if writer.reason == "periodic" and isinstance(failure, SpotguardDiskFull):
                # A full disk must never take down training: the next periodic save tries again.
                logger.warning("spotguard: periodic checkpoint %s not written: %s", writer.dir.name, failure)
                return
            logger.error("spotguard: %s checkpoint %s not written: %s", writer.reason, writer.dir.name, failure)
            if raise_error:
                if failure is exc:
                    raise
                raise failure from exc
            self._background_error = failure
            return
        with self._lock:
            self.timeline["committed_local"] = time.time()
        self._last_bytes = sum(entry.size for entry in writer.files.values())
        self._report(writer.dir, writer.step, writer.reason, notice)

    def _open_step_dir(self, writer: CheckpointWriter, needed: int = 0) -> None:
        """Rank 0 clears leftovers, makes the fresh step directory and room for ``needed`` bytes; every
        rank learns whether the step is already committed (raises :class:`CheckpointExists` on all ranks
        alike) or there is no room (:class:`SpotguardDiskFull` on all ranks). Collective."""
        exists = False
        no_room: SpotguardDiskFull | None = None
        with dist.settled(f"preparing {writer.dir.name}"):  # any other failure on rank 0 reaches every rank
            if self.rank == 0:
                # Leftovers of a writer killed mid-save; the daemon never loads or uploads them.
                removed = remove_incomplete(self.checkpoint_dir, except_names=frozenset({writer.dir.name}))
                if removed:
                    logger.info("spotguard: removed incomplete checkpoints %s", ", ".join(removed))
                try:
                    writer.prepare()
                except CheckpointExists:
                    exists = True
                else:
                    try:
                        make_room(self.checkpoint_dir, needed, safe=self._safe_in_bucket, exclude={writer.dir.name})
                    except SpotguardDiskFull as exc:
                        no_room = exc
        # Also keeps the other ranks from writing before rank 0 has made the directory.
        exists, full = dist.agree_any([exists, no_room is not None])
        if exists:
            raise CheckpointExists(str(writer.dir))
        if full:
            free = free_bytes(self.checkpoint_dir)
            raise no_room or SpotguardDiskFull(self.checkpoint_dir, needed, free, "no room on rank 0's disk")

    def _safe_in_bucket(self) -> Collection[str] | None:
        """What the daemon says is complete in the bucket; None when no daemon answers."""
        reply = self.client.ask("safe-steps", timeout=2.0)
        if reply is None or reply["type"] != "safe-steps" or not isinstance(reply.get("names"), list):
            return None
        return frozenset(str(name) for name in reply["names"])

    def _write(self, writer: CheckpointWriter, payloads: Mapping[str, Any], needed: int) -> None:
        try:
            self._write_once(writer, payloads, needed)
        except OSError as exc:
            if not is_disk_full(exc) or isinstance(exc, SpotguardDiskFull) or self.world_size > 1:
                raise
            # The estimate fell short (or someone else took the room). What the failed attempt had
            # (the free space once its partial files are gone) was not enough: start over once,
            # with room for twice that.
            shutil.rmtree(writer.dir, ignore_errors=True)
            writer.files.clear()
            had = free_bytes(self.checkpoint_dir)
            logger.warning("spotguard: %s ran out of room in %d bytes; retrying with more room", writer.dir, had)
            self._write_once(writer, payloads, 2 * max(needed, had))

    def _write_once(self, writer: CheckpointWriter, payloads: Mapping[str, Any], needed: int) -> None:
        per_rank = self.world_size > 1
        self._open_step_dir(writer, needed)

        def announce(name: str, entry: FileEntry) -> None:
            # The daemon can start uploading this file while the next one is written.
            self.client.send("file", path=str(writer.dir), name=name, size=entry.size, crc32c=entry.crc32c)

        if per_rank:
            from spotguard.trainer.sharded import save_sharded  # DCP: seconds to import, only multi-rank jobs

            assert isinstance(payloads, Payloads), "distributed saves are written from the live state"
            self._node_leader = save_sharded(
                writer, payloads.state, announce=announce, threads=self._io_threads, parallel=self._files_writer
            )
        else:
            write_payloads(
                writer,
                payloads,
                on_file=lambda name: announce(name, writer.files[name]),
                on_range=lambda name, tmp, size, offset, length: self.client.send(
                    "file-range", path=str(writer.dir), name=name, tmp=tmp, size=size, offset=offset, length=length
                ),
                parallel=self._files_writer,
            )
        with dist.settled(f"committing {writer.dir.name}"):  # nobody goes on (or exits) before the commit
            if self.rank == 0:
                writer.commit()

    def _save_failed(
        self, writer: CheckpointWriter, exc: Exception, needed: int, notice: dict[str, Any] | None
    ) -> Exception:
        """Nothing was committed: remove the partial directory, tell the daemon, and return the error
        to raise (a raw ENOSPC becomes :class:`SpotguardDiskFull` with the numbers)."""
        failure = exc
        if is_disk_full(exc) and not isinstance(exc, SpotguardDiskFull):
            free = free_bytes(self.checkpoint_dir)
            failure = SpotguardDiskFull(self.checkpoint_dir, max(needed, free + 1), free, f"{writer.dir.name}: {exc}")
        partial = load_manifest_or_none(writer.dir) is None
        if partial and self.rank == 0 and (self.world_size == 1 or isinstance(exc, SpotguardDiskFull)):
            shutil.rmtree(writer.dir, ignore_errors=True)
        if self._node_leader:
            details: dict[str, Any] = {}
            if isinstance(failure, SpotguardDiskFull):
                details = {
                    "bytes_needed": failure.bytes_needed,
                    "bytes_free": failure.bytes_free,
                    "path": str(failure.path),
                }
            self.client.send(
                "save-failed",
                step=writer.step,
                reason=writer.reason,
                error="disk-full" if isinstance(failure, SpotguardDiskFull) else "write-failed",
                message=str(failure),
                event_id=notice["notice"]["event_id"] if notice else None,
                **details,
            )
        return failure

    def _mark_saved(self, step: int, notice: dict[str, Any] | None) -> None:
        """Bookkeeping at the step the save is taken: the notice is handled, the periodic clock restarts."""
        self._last_save_step = step
        self._last_save_time = time.monotonic()
        with self._lock:
            if notice is not None:
                self._handled_events.add(str(notice["notice"]["event_id"]))
                if self._notice is notice:
                    self._notice = None
        self._urgent_agreed = False
        if (notice is not None and notice["stop"]) or self._sigterm:
            self._stop_agreed = True

    def _after_save(self, step: int, target: Path, reason: str, notice: dict[str, Any] | None) -> None:
        """For integrations that write and commit a checkpoint themselves (Lightning, HF): the same
        bookkeeping and daemon report as :meth:`save` does after its own commit."""
        with self._lock:
            self.timeline["committed_local"] = time.time()
        self._mark_saved(step, notice)
        self._report(target, step, reason, notice)

    def _report(self, target: Path, step: int, reason: str, notice: dict[str, Any] | None) -> None:
        """After a commit: tell the daemon (each node's leader speaks for its disk) and keep the disk in bounds."""
        if not self._node_leader:
            return
        self.client.send(
            "saved",
            path=str(target),
            step=step,
            reason=reason,
            event_id=notice["notice"]["event_id"] if notice else None,
        )
        if not self.client.connected.is_set():
            # No daemon: nobody uploads these (a bucket set only for resume changes nothing); keep the
            # disk from filling.
            prune_local(self.checkpoint_dir, self.keep)

    # --- resume --------------------------------------------------------------------------

    def resume(self, state: MutableMapping[str, Any], strict: bool = True) -> int:
        """Load the newest complete checkpoint into ``state``; returns the step to run next (0 if none).

        Looks in the local root first, then in the bucket. With a daemon that has peers configured,
        asks it first whether a peer holds a verified checkpoint newer than both (a rescued one not yet
        committed in the bucket); the daemon fetches that into the local root (the rule:
        spotguard/daemon/peerfetch.py). A checkpoint that fails verification is
        skipped for the previous complete one. Under ``torch.distributed`` rank 0 chooses and every
        rank loads the same checkpoint; one saved by another number of ranks is resharded.

        Before a byte of data is fetched or loaded, the checkpoint's manifest is compared with
        ``state``: state_dict keys, shapes and dtypes, the optimizer's class and parameter groups.
        A mismatch raises :class:`SpotguardMismatch` (every rank alike) and ``state`` is left as it
        was. With ``strict=False`` what matches is loaded and :attr:`last_resume_report` says what
        was not:

        >>> step = guard.resume(state, strict=False)
        >>> guard.last_resume_report.skipped_entries      # e.g. ["optimizer"] after a switch to SGD
        """
        check_state(state)
        self.wait(raise_error=False)  # a periodic save still being written may be the newest
        self.last_resume_report = None
        candidates: list[tuple[str, Manifest]] = []
        one_disk = self._one_disk()
        with dist.settled("choosing a checkpoint to resume"):  # e.g. a newer format: every rank raises it
            if self.rank == 0:
                self._ask_peers(fetch=one_disk)
                candidates = self._candidates()
        candidates = dist.broadcast_object(candidates)
        for name, manifest in candidates:
            report = self._check(name, manifest, state)
            if report.differences and strict:
                raise SpotguardMismatch(name, report.differences)
            if self._fetch(name, manifest):
                break
        else:
            return 0
        step_dir = self.checkpoint_dir / name
        with dist.settled(f"loading {name}"):
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
                threads=self._io_threads,
            )
        self._last_save_step = manifest.step
        self.last_resume_report = report
        if report.differences:
            logger.warning(
                "spotguard: resumed from %s partially (strict=False): left as they were %s",
                step_dir,
                "; ".join(str(difference) for difference in report.differences[:SHOWN]),
            )
        logger.info("spotguard: resumed from %s (%s)", step_dir, manifest.reason)
        return manifest.step

    def _one_disk(self) -> bool:
        """Whether every rank reads this checkpoint root (one node): only then can a checkpoint the
        daemon fetched onto this disk be resumed by all. Collective."""
        if not dist.active():
            return True
        return len(set(dist.all_gather((gethostname(), str(self.checkpoint_dir.resolve()))))) == 1

    def _daemon_has_peers(self) -> bool:
        if self.client.welcome is None and self.client.socket_path.exists():
            self.client.welcomed.wait(self._daemon_wait)  # a daemon is there: its welcome says
        return bool(self.client.welcome and self.client.welcome.get("peers"))

    def _ask_peers(self, *, fetch: bool) -> None:
        """A peer may hold a checkpoint newer than any here or in the bucket (its sender died and the
        peer is still committing it): the daemon fetches it, verified, into the checkpoint root,
        where the choice that follows finds it. The rule: spotguard/daemon/peerfetch.py."""
        if not self._daemon_has_peers():
            return
        newest = max((i.step for i in scan_local(self.checkpoint_dir) if i.status == "complete"), default=-1)
        reply = self.client.ask("peer-resume", timeout=protocol.PEER_RESUME_TIMEOUT + 30, after=newest, fetch=fetch)
        if reply is None or reply["type"] != "peer-resume":
            return
        for where in reply.get("not_fetched") or []:
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

    def _candidates(self) -> list[tuple[str, Manifest]]:
        """Checkpoints to resume from, best first: the newest verified local one, else the bucket's
        complete ones (their manifests only: nothing else is fetched before the check)."""
        for info in reversed(scan_local(self.checkpoint_dir)):
            if info.status != "complete":
                refuse_newer_format(load_manifest, self.checkpoint_dir / info.name)
                continue
            problems = verify_dir(self.checkpoint_dir / info.name, threads=self._io_threads)
            if not problems and info.manifest is not None:
                return [(info.name, info.manifest)]
            logger.warning("spotguard: skipping %s: %s", info.name, "; ".join(problems))
        if self.bucket is None:
            return []
        from spotguard.storage import open_storage  # imports a storage SDK only now, if at all
        from spotguard.storage.checkpoints import list_remote, read_remote_manifest

        storage = open_storage(self.bucket)
        try:
            found = []
            for info in reversed(list_remote(storage)):
                if info.status == "complete" and info.manifest is not None:
                    found.append((info.name, info.manifest))
                elif not found:  # newer than every complete one: a format this reader cannot read?
                    refuse_newer_format(read_remote_manifest, storage, info.name)
            return found
        finally:
            storage.close()

    def _fetch(self, name: str, manifest: Manifest) -> bool:
        """Make ``name`` whole on this disk (the node's leader downloads it); False on every rank if
        it failed verification (the caller tries the previous one). Collective."""
        failed = False
        leader = dist.is_node_leader(self.checkpoint_dir)
        with dist.settled(f"fetching {name}"):  # anything but a failed verification reaches every rank
            if leader and verify_dir(self.checkpoint_dir / name, checksums=False):
                # Not whole on this disk (only in the bucket, another node's, or only this node's share).
                from spotguard.storage.base import StorageError  # stdlib only

                try:
                    self._restore_from_bucket(step=manifest.step)
                except (StorageError, ManifestError, OSError) as exc:
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

    # --- lifetime ------------------------------------------------------------------------

    def close(self) -> None:
        """Finish a periodic save still being written, then disconnect from the daemon."""
        self.wait(raise_error=False)
        self.client.close()
        if self._previous_handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Guard", "ResumeReport", "SpotguardDiskFull", "SpotguardMismatch", "StateError"]
