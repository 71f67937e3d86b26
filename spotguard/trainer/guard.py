"""``Guard``: the few lines a training loop needs to survive a spot interruption.

The Guard is the public face; the jobs behind it live in their own modules: ``notices`` (what the
daemon and signals said, and what all ranks agreed on), ``schedule`` (periodic saves), ``saving`` (the
save paths), ``restore`` (resume), ``external`` (committing a framework's own checkpoint) and
``settings`` (arguments, environment, defaults).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any

from spotguard.localstore import CheckpointWriter
from spotguard.notice import EXIT_STOPPED
from spotguard.space import SpotguardDiskFull
from spotguard.trainer import dist, threads
from spotguard.trainer.announce import SizeAnnouncer
from spotguard.trainer.client import DaemonClient, root_of
from spotguard.trainer.contents import ResumeReport, SpotguardMismatch, describe_state
from spotguard.trainer.external import AlreadyCommitted, commit_external
from spotguard.trainer.notices import Message, NoticeFlags
from spotguard.trainer.restore import Resumer
from spotguard.trainer.saving import Saver
from spotguard.trainer.schedule import Periodic
from spotguard.trainer.settings import TrainerSettings
from spotguard.trainer.state import StateError, check_state
from spotguard.version import __version__

logger = logging.getLogger("spotguard.trainer")


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

    #: The save paths; a subclass may put a faulty one here (tests do).
    saver_type: type[Saver] = Saver
    #: What the daemon's messages and SIGTERM set; a subclass may put a recording one here (tests do).
    flags_type: type[NoticeFlags] = NoticeFlags

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
        self._schedule = Periodic(every_steps, every_seconds)
        io_threads = threads.write_threads(write_threads)  # checked before anything starts
        dist.check_initialised()
        settings = TrainerSettings.from_env(checkpoint_dir, bucket, socket)
        self.bucket = settings.bucket
        self.keep = keep
        self.rank = dist.rank()
        self.world_size = dist.world_size()
        self._flags = self.flags_type()
        self.last_resume_report: ResumeReport | None = None  # what the last resume loaded and left
        self.client, self.checkpoint_dir = self._connect(settings, daemon_wait)
        #: Tells the daemon how big the state is (its deadline plan needs it before the first save).
        self.state_size = SizeAnnouncer(self.client)
        self._saver = self.saver_type(
            self.checkpoint_dir, self.client, keep=keep, io_threads=io_threads, on_commit=self._flags.committed_locally
        )
        self._resumer = Resumer(
            self.checkpoint_dir, self.bucket, self.client, io_threads=io_threads, daemon_wait=daemon_wait
        )
        self._previous_handler: Any = None
        if handle_sigterm and threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _connect(self, settings: TrainerSettings, daemon_wait: float) -> tuple[DaemonClient, Path]:
        """Start the daemon connection; the checkpoint root is the argument's, else the daemon's."""
        root = settings.checkpoint_dir
        hello = {
            "rank": self.rank,
            "world_size": self.world_size,
            "pid": os.getpid(),
            "checkpoint_dir": str(root or ""),
            "version": __version__,
        }
        client = DaemonClient(settings.socket, hello, self._flags.on_daemon_message).start()
        if root is None:
            try:
                root = root_of(client, settings.socket, daemon_wait)
            except ValueError:
                client.close()
                raise
        root.mkdir(parents=True, exist_ok=True)
        return client, root

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self._flags.sigterm = True
        if callable(self._previous_handler):
            self._previous_handler(signum, frame)

    # --- what integrations and harnesses may ask or tell -----------------------------------

    @property
    def every_steps(self) -> int | None:
        return self._schedule.every_steps

    @property
    def every_seconds(self) -> float | None:
        return self._schedule.every_seconds

    @property
    def timeline(self) -> dict[str, float]:
        """Wall-clock times of the last urgent save (``told``, ``committed_local``), for reports."""
        return self._flags.timeline

    @property
    def pending_notice(self) -> Message | None:
        """The daemon's ``checkpoint-now`` message not yet answered by a save (``notice``, ``stop``,
        ``deadline_s``), or None."""
        return self._flags.pending

    @property
    def notice_pending(self) -> bool:
        """True from the moment a notice (or SIGTERM) reaches this rank until a save answers it, before
        any agreement between ranks: for a loop or harness that waits for one to arrive."""
        return self._flags.local()[0]

    def notify_sigterm(self) -> None:
        """Treat the process as told to go away, as Guard's own SIGTERM handler does: for a framework
        whose handler caught the signal (Lightning's ``trainer.received_sigterm``). The next
        :meth:`should_checkpoint` answers with an urgent save and :attr:`stop_requested`."""
        self._flags.sigterm = True

    def save_reason(self) -> str:
        """The manifest ``reason`` a save taken now gets: ``urgent``, ``soft`` or ``periodic``."""
        return self._flags.save_reason()[0]

    @contextmanager
    def external_save(
        self, step: int, meta: Mapping[str, Any], live: Mapping[str, Any] | None = None
    ) -> Iterator[Path]:
        """A checkpoint a framework writes itself, committed like :meth:`save` commits its own.

        >>> with guard.external_save(step, {"framework": "lightning", "resume": "lightning.ckpt"}) as step_dir:
        ...     trainer.save_checkpoint(step_dir / "lightning.ckpt")

        Every rank must enter (the directory exists on all ranks before anyone writes, and nobody leaves
        before rank 0 committed). Where nodes have disks of their own and the framework writes on
        several of them (a sharded save), each node commits its share, as :meth:`save` does. Raises
        :class:`AlreadyCommitted` (before yielding) if the step is already complete. On a clean exit
        every file is recorded in the manifest, the manifest is committed, the daemon is told and the
        notice counts as answered. ``live`` (e.g. ``{"model": ..., "optimizer": ...}``) is described in
        the manifest, so that a resume can be checked against it.

        On an exception nothing is committed, the daemon hears the save failed, and the directory stays
        incomplete for the next writer to remove (at once on a full disk). A full disk (however the
        framework wrapped ``ENOSPC``) is raised from an urgent save as :class:`spotguard.SpotguardDiskFull`;
        a periodic one is logged, the ``with`` block ends as if it had committed and training goes on, as
        in :meth:`save` (:attr:`last_checkpoint` tells the two apart).
        """
        reason, notice = self._flags.save_reason()
        # A periodic save of save() still being written ends first: its directory is not a leftover.
        self._saver.wait(raise_error=False)
        full_meta: dict[str, Any] = dict(meta)
        if notice is not None:
            full_meta["event_id"] = notice["notice"]["event_id"]
        contents = describe_state(live, self.world_size) if live is not None else None
        writer = CheckpointWriter(
            self.checkpoint_dir, step, reason=reason, world_size=self.world_size, meta=full_meta, contents=contents
        )

        def done(here: bool) -> None:
            self._flags.committed_locally()
            self._saved(step, notice)
            self._saver.report(writer.dir, step, reason, notice, here=here)

        try:
            with commit_external(self._saver, writer, done, notice) as step_dir:
                yield step_dir
        except AlreadyCommitted:
            raise
        except SpotguardDiskFull as exc:
            if reason != "periodic":
                self._flags.stop_if_hard(notice)
                raise
            # As in save(): a full disk must not end training; the periodic clock restarts.
            logger.warning("spotguard: periodic checkpoint %s not written: %s", writer.dir.name, exc)
            self._saved(step, notice)
        except BaseException:
            self._flags.stop_if_hard(notice)  # as in save(): the notice stays pending, a hard one ends the loop
            raise

    # --- the loop's questions ------------------------------------------------------------

    @property
    def stop_requested(self) -> bool:
        """True once a hard notice (or SIGTERM) means the VM is going away: save, then leave the loop.

        It changes only inside :meth:`should_checkpoint`, never on its own: a signal landing between
        the two calls must not end the loop before the checkpoint it asked for is taken.
        """
        return self._flags.stop_agreed

    @property
    def exit_code(self) -> int:
        """``sys.exit(guard.exit_code)`` at the end of a training script: 0, or :data:`EXIT_STOPPED`
        once a hard notice stopped the loop (the run is to go on elsewhere)."""
        return EXIT_STOPPED if self.stop_requested else 0

    @property
    def node_leader(self) -> bool:
        """Whether this rank speaks for its disk: the lowest rank writing to the same host and
        ``checkpoint_dir``. Known from the first save on (inside :meth:`external_save` it is): before,
        rank 0 alone is taken for one."""
        return self._saver.node_leader

    @property
    def last_checkpoint(self) -> Path | None:
        """The step directory of the newest checkpoint this Guard committed (a periodic save written in
        the background once it is committed); None before the first."""
        return self._saver.last_committed

    @property
    def deadline(self) -> datetime | None:
        """When the VM goes away, if a notice said so."""
        return self._flags.deadline()

    def should_checkpoint(self, step: int, *, periodic: bool = True) -> bool:
        """Whether to save at this step boundary: a notice arrived on any rank, or a periodic save is due.

        Under ``torch.distributed`` this is one small all-reduce, and every rank gets the same answer.
        Call it also where the loop waits outside a step (evaluation, before the first step) with
        ``periodic=False``: a notice is then answered with a checkpoint of the last completed step, and
        the daemon reports a loop that does not ask within its bound.
        """
        urgent, due = self._flags.agree(periodic and self._schedule.due(step))
        if not urgent:  # (an urgent save measures after it is committed)
            self.state_size.poll()  # re-measures the remembered state at most every 30 s (ms for a big model)
        if urgent:
            # Once per notice: the daemon watches for loops that never reach a checkpoint point
            # (stuck in eval or a data-loader start) and reports them.
            event_id = self._flags.to_acknowledge()
            if event_id is not None:
                self.client.send("checkpoint-started", event_id=event_id, step=step)
        return urgent or due

    # --- save ----------------------------------------------------------------------------

    def save(self, state: MutableMapping[str, Any], step: int, *, reason: str | None = None) -> Path:
        """Checkpoint ``state`` at ``step`` and return its directory.

        Urgent saves (a notice, SIGTERM) return once the checkpoint is committed locally. Periodic
        saves return as soon as the state is copied to host memory; a background thread writes and
        commits it (at most one in flight: a new periodic save first waits for the previous one;
        :meth:`wait` and :meth:`close` wait too). An urgent save first stops a periodic save still
        being written; with several ranks it waits for it instead, since their background saves
        agree on the commit with collectives (on a gloo group of their own, made at the first
        periodic save). Call :meth:`close` (or :meth:`wait`) before ``destroy_process_group()``.
        The daemon (if any) is told of each commit and uploads it. A step that is already
        committed is not written again: checkpoints are never overwritten.

        When the local disk is short of room, local checkpoints already complete in the bucket
        are dropped first, oldest first. If nothing can make room, an urgent save raises
        :class:`spotguard.SpotguardDiskFull` (``stop_requested`` still turns true on a hard
        notice); a periodic one logs it and training goes on. The daemon is told either way.
        """
        check_state(state)
        decided, notice = self._flags.save_reason()
        reason = decided if reason is None else reason
        in_background = reason == "periodic" and dist.can_save_in_background()
        if in_background:
            self._saver.wait(raise_error=False)
        else:
            self._saver.cancel_background()
        meta: dict[str, Any] = {"keys": sorted(state), "rank_files": self.world_size > 1}
        if notice is not None:
            meta["event_id"] = notice["notice"]["event_id"]
        writer = CheckpointWriter(
            self.checkpoint_dir,
            step,
            reason=reason,
            world_size=self.world_size,
            meta=meta,
            cancel=threading.Event(),
            contents=describe_state(state, self.world_size),
        )
        if in_background:
            self._saved(step, notice)  # no notice here: the periodic clock restarts
            self._saver.save_in_background(writer, state, notice)
            self.state_size.remember(state)  # after the save: measuring (ms) must not delay it
            return writer.dir
        try:
            self._saver.save_now(writer, state, notice)
        except BaseException:
            # The notice is handled only by a commit: it stays pending here (the daemon heard
            # save-failed), but a hard one still ends the loop, cleanly.
            self._flags.stop_if_hard(notice)
            raise
        self._saved(step, notice)
        self.state_size.remember(state)
        return writer.dir

    def wait(self, *, raise_error: bool = True) -> None:
        """Wait for the periodic save running in the background, if any; re-raise its error."""
        self._saver.wait(raise_error=raise_error)

    def _saved(self, step: int, notice: Message | None) -> None:
        """Bookkeeping at the step the save is taken: the notice is handled, the periodic clock restarts."""
        self._schedule.restart(step)
        self._flags.saved(notice)

    # --- resume --------------------------------------------------------------------------

    def resume(self, state: MutableMapping[str, Any], strict: bool = True) -> int:
        """Load the newest complete checkpoint into ``state``; returns the step to run next (0 if none).

        Looks in the local root first, then in the bucket. With a daemon that has peers configured,
        asks it first whether a peer holds a verified checkpoint newer than both (a rescued one not yet
        committed in the bucket); the daemon fetches that into the local root (the rule:
        spotguard/peer/fetch.py). A checkpoint that fails verification is
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
        try:
            report = self._resumer.choose(state, strict=strict)
            if report is None:
                return 0
            manifest = self._resumer.load(report, state)
        finally:
            # Every loop resumes before its first step: the daemon hears the size from here on
            # (loaded optimizer state included), long before the first save.
            self.state_size.remember(state)
        self._schedule.last_step = manifest.step
        self.last_resume_report = report
        return manifest.step

    def announce_state(self, state: Mapping[str, Any]) -> None:
        """Tell the daemon how big ``state`` is, for a loop that does not call :meth:`resume`.

        >>> guard.announce_state({"model": model, "optimizer": opt})

        The daemon's deadline plan counts with it when a notice comes before the first save. A
        reference to ``state`` is kept (nothing is copied) and measured again at
        :meth:`should_checkpoint` at most every 30 s, so that state created later (an optimizer's
        at its first step) is counted too. Never raises: a state that cannot be measured is skipped.
        """
        self.state_size.remember(state)

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


__all__ = ["AlreadyCommitted", "Guard", "ResumeReport", "SpotguardDiskFull", "SpotguardMismatch", "StateError"]
