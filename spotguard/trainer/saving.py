"""The save paths of the trainer hook: making room, writing this rank's files, committing, telling the daemon.

An urgent save writes in the caller's thread and returns once committed locally; a periodic one is
staged into host memory and written by one background thread (at most one in flight, cancelled by an
urgent save, with several ranks too). Either way the daemon hears of each finished file (it may start
uploading) and of the commit, or of the failure.
"""

from __future__ import annotations

import logging
import shutil
import threading
import weakref
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotguard.localstore import CheckpointExists, CheckpointWriter, prune_local, remove_incomplete, scan_local
from spotguard.manifest import FileEntry, load_manifest_or_none, load_part
from spotguard.protocol import DISK_FULL, WRITE_FAILED
from spotguard.safefile import SaveCancelled
from spotguard.space import SpotguardDiskFull, free_bytes, full_disk_of, is_disk_full, make_room
from spotguard.trainer import dist
from spotguard.trainer.client import DaemonClient
from spotguard.trainer.notices import Message
from spotguard.trainer.state import Payloads, Stager, estimate_bytes, is_tensor, write_payloads
from spotguard.trainer.writer import ParallelWriter

if TYPE_CHECKING:  # DCP takes seconds to import: only multi-rank jobs do
    from torch.distributed import ProcessGroup

    from spotguard.trainer.sharded import ShardedStager, ShardedState

# Saves at a notice, racing its deadline: they prune no older checkpoint before they return (the
# next save does; one that is short of room makes its own).
HURRIED = frozenset({"urgent", "soft"})

logger = logging.getLogger("spotguard.trainer")


def _before_executors_shut_down(method: weakref.WeakMethod[Callable[[], None]]) -> None:
    """Call ``method`` (while its object lives) when the interpreter starts to shut down, before the
    thread pools the writes use refuse new work: plain atexit handlers run too late, after that. The
    hook is the one concurrent.futures registers with; without it a save in flight at exit is lost."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        return

    def call() -> None:
        bound = method()
        if bound is not None:
            bound()

    register(call)


class Saver:
    """Writes and commits one Guard's checkpoints under ``checkpoint_dir``; tells ``client`` of each."""

    def __init__(
        self,
        checkpoint_dir: Path,
        client: DaemonClient,
        *,
        keep: int,
        io_threads: int,
        on_commit: Callable[[], None] = lambda: None,
    ) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.client = client
        self.keep = keep
        self.rank = dist.rank()
        self.world_size = dist.world_size()
        self.io_threads = io_threads  # threads that write and read this rank's files
        self.on_commit = on_commit  # called at each local commit (the Guard's timeline)
        self.node_leader = self.rank == 0  # the rank that speaks for this disk: tells its daemon, clears leftovers
        self._leader_known = self.world_size == 1
        self.stager = Stager()
        # Writes the state files of urgent and periodic saves (never both at once: an urgent save
        # first cancels the periodic one); its staging buffers for CUDA tensors are kept across saves.
        self.files_writer = ParallelWriter(io_threads)
        self._background: tuple[threading.Thread, threading.Event] | None = None
        self._background_error: Exception | None = None
        # Several ranks: the gloo group of the background saves' collectives, and their stager.
        self._group: ProcessGroup | None = None
        self._sharded_stager: ShardedStager | None = None
        self.last_committed: Path | None = None  # the step directory of the newest commit
        self._last_bytes: int | None = None  # what the last checkpoint took on disk, to expect as much again
        _before_executors_shut_down(weakref.WeakMethod(self._finish_at_exit))

    # --- the two paths -------------------------------------------------------------------

    def save_now(self, writer: CheckpointWriter, state: Mapping[str, Any], notice: Message | None) -> None:
        """Write and commit in this thread; raise what stopped it (the daemon heard it already)."""
        self.write_and_report(writer, Payloads(state), notice, self.expected_bytes(state), raise_error=True)

    def save_in_background(self, writer: CheckpointWriter, state: Mapping[str, Any], notice: Message | None) -> None:
        """Stage ``state`` (the only part that stalls training: a copy into reused host buffers), then
        write and commit it in a background thread. With several ranks that thread's collectives go to
        a gloo group of the checkpoint's own, never interleaved with the training's (as DCP's
        ``async_save`` does): the group is made at the first such save, by every rank at once."""
        staged: Mapping[str, Any] | ShardedState
        if self.world_size > 1:
            from spotguard.trainer.sharded import ShardedStager, split_state

            if self._group is None:
                self._group = dist.new_checkpoint_group()
                self._sharded_stager = ShardedStager(self.stager)
            assert self._sharded_stager is not None
            with dist.settled(f"staging {writer.dir.name}"):  # a rank that cannot copy fails them all here
                staged = self._sharded_stager.stage(split_state(state))
            needed = self.expected_bytes(state)
        else:
            staged = self.stager.stage(Payloads(state))
            needed = estimate_bytes(staged)
        thread = threading.Thread(
            target=self._write_in_background,
            args=(writer, staged, notice, needed),
            name=f"spotguard-save-{writer.step}",
            daemon=True,  # finished at exit all the same: _finish_at_exit
        )
        assert writer.cancel is not None
        self._background = (thread, writer.cancel)
        thread.start()

    def _finish_at_exit(self) -> None:
        """A script that ends without close() still gets the periodic save it started, as it would
        from DCP's async_save or Lightning's AsyncCheckpointIO (their executors are waited for)."""
        if self._background is None or not self._background[0].is_alive():
            return
        name = self._background[0].name
        if self.world_size > 1 and not dist.active():  # its collectives cannot finish it: lost, not waited for
            logger.warning("spotguard: the process group was destroyed while %s was written: it is lost", name)
            return
        logger.info("spotguard: the script ended while %s was written; finishing it", name)
        self.wait(raise_error=False)

    def _write_in_background(
        self, writer: CheckpointWriter, staged: Mapping[str, Any] | ShardedState, notice: Message | None, needed: int
    ) -> None:
        with dist.on_group(self._group):
            self.write_and_report(writer, staged, notice, needed)

    def expected_bytes(self, state: Mapping[str, Any]) -> int:
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

    def cancel_background(self) -> None:
        """Before an urgent save: a periodic save still being written stops at its next write, and
        what it wrote is removed. With several ranks each rank's urgent save (every rank saves at the
        same step) cancels its own, and the ranks agree on it where they agree on a failure: after
        DCP's files, and after this rank's own (:func:`dist.agree_ok`). Past the last such point (its
        commit under way), the periodic save is finished instead."""
        if self._background is not None:
            thread, cancel = self._background
            if thread.is_alive():
                logger.info("spotguard: an urgent save pre-empts the periodic one being written")
                cancel.set()
        self.wait(raise_error=False)

    def write_and_report(
        self,
        writer: CheckpointWriter,
        payloads: Mapping[str, Any] | ShardedState,
        notice: Message | None,
        needed: int,
        raise_error: bool = False,
    ) -> None:
        try:
            self.write(writer, payloads, needed)
        except CheckpointExists:
            logger.info("spotguard: %s is already committed; not writing it again", writer.dir.name)
        except SaveCancelled:
            # Pre-empted by an urgent save, which waits for this thread: what it wrote goes now (the
            # urgent save may need the room, and does no housekeeping of its own). Several ranks
            # agreed on it, so none is still writing; each node's leader removes its disk's part.
            if self.node_leader:
                shutil.rmtree(writer.dir, ignore_errors=True)
                self.client.send("save-cancelled", step=writer.step, reason=writer.reason)
            return
        except Exception as exc:
            failure = self.save_failed(writer, exc, needed, notice)
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
        self.on_commit()
        self._last_bytes = sum(entry.size for entry in writer.files.values())
        self.report(writer.dir, writer.step, writer.reason, notice)

    # --- writing -------------------------------------------------------------------------

    def open_step_dir(self, writer: CheckpointWriter, needed: int = 0) -> None:
        """Rank 0 clears leftovers, makes the fresh step directory and room for ``needed`` bytes; every
        rank learns whether the step is already committed (raises :class:`CheckpointExists` on all ranks
        alike) or there is no room (:class:`SpotguardDiskFull` on all ranks). Collective."""
        exists = False
        no_room: SpotguardDiskFull | None = None
        if not self._leader_known:  # once: which rank speaks for this disk (collective, like this call)
            self.node_leader = dist.is_node_leader(self.checkpoint_dir)
            self._leader_known = True
        with dist.settled(f"preparing {writer.dir.name}"):  # any other failure on rank 0 reaches every rank
            if self.rank == 0:
                try:
                    self._prepare(writer, needed)
                except CheckpointExists:
                    exists = True
                except SpotguardDiskFull as exc:
                    no_room = exc
            elif self.node_leader:
                # Another node's disk: its leftovers (a failed or killed save's share) go as on rank 0's.
                self._remove_incomplete(writer)
        # Also keeps the other ranks from writing before rank 0 has made the directory.
        exists, full = dist.agree_any([exists, no_room is not None])
        if exists:
            raise CheckpointExists(str(writer.dir))
        if full:
            free = free_bytes(self.checkpoint_dir)
            raise no_room or SpotguardDiskFull(self.checkpoint_dir, needed, free, "no room on rank 0's disk")

    def _prepare(self, writer: CheckpointWriter, needed: int) -> None:
        # Leftovers of a writer killed mid-save; the daemon never loads or uploads them. Every save
        # removes them, an urgent one too: they exist only after a crash (otherwise this is one look
        # at the directory), and they hold room the save may need.
        self._remove_incomplete(writer)
        writer.prepare()
        make_room(self.checkpoint_dir, needed, safe=self.safe_in_bucket, exclude={writer.dir.name})

    def _remove_incomplete(self, writer: CheckpointWriter) -> None:
        removed = remove_incomplete(self.checkpoint_dir, except_names=frozenset({writer.dir.name}))
        if removed:
            logger.info("spotguard: removed incomplete checkpoints %s", ", ".join(removed))

    def safe_in_bucket(self) -> Collection[str] | None:
        """What the daemon says is complete in the bucket; None when no daemon answers."""
        reply = self.client.ask("safe-steps", timeout=2.0)
        if reply is None or reply["type"] != "safe-steps" or not isinstance(reply.get("names"), list):
            return None
        return frozenset(str(name) for name in reply["names"])

    def write(self, writer: CheckpointWriter, payloads: Mapping[str, Any] | ShardedState, needed: int) -> None:
        try:
            self.write_once(writer, payloads, needed)
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
            self.write_once(writer, payloads, 2 * max(needed, had))

    def write_once(self, writer: CheckpointWriter, payloads: Mapping[str, Any] | ShardedState, needed: int) -> None:
        dist.require_group(self.world_size, writer.dir.name)
        self.open_step_dir(writer, needed)

        def announce(name: str, entry: FileEntry) -> None:
            # The daemon can start uploading this file while the next one is written.
            self.client.send("file", path=str(writer.dir), name=name, size=entry.size, crc32c=entry.crc32c)

        if self.world_size > 1:
            from spotguard.trainer.sharded import save_sharded  # DCP: seconds to import, only multi-rank jobs

            if isinstance(payloads, Payloads):
                payloads = payloads.state  # the live state, split as it is written
            self.node_leader = save_sharded(
                writer, payloads, announce=announce, threads=self.io_threads, parallel=self.files_writer
            )
        else:
            assert isinstance(payloads, Mapping), "one process writes payloads, not a sharded state"
            write_payloads(
                writer,
                payloads,
                on_file=lambda name: announce(name, writer.files[name]),
                on_range=lambda name, tmp, size, offset, length: self.client.send(
                    "file-range", path=str(writer.dir), name=name, tmp=tmp, size=size, offset=offset, length=length
                ),
                parallel=self.files_writer,
            )
        dist.require_group(self.world_size, writer.dir.name)  # never a commit of one rank's part alone
        with dist.settled(f"committing {writer.dir.name}"):  # nobody goes on (or exits) before the commit
            if self.rank == 0:
                writer.commit()

    # --- what the daemon hears -----------------------------------------------------------

    def save_failed(self, writer: CheckpointWriter, exc: Exception, needed: int, notice: Message | None) -> Exception:
        """Nothing was committed: remove the partial directory, tell the daemon, and return the error
        to raise (a raw ENOSPC becomes :class:`SpotguardDiskFull` with the numbers)."""
        failure = exc
        # With several ranks agree_ok decided already, alike on every rank (RankDiskFull or not).
        if self.world_size == 1 and not isinstance(exc, SpotguardDiskFull):
            full = full_disk_of(exc, self.checkpoint_dir)
            if full is not None:
                failure = SpotguardDiskFull(
                    self.checkpoint_dir, max(needed, full.bytes_needed), full.bytes_free, f"{writer.dir.name}: {exc}"
                )
        if not self.node_leader:
            # The directory is its disk's leader's to judge: it may be removing it at this moment.
            return failure
        partial = load_manifest_or_none(writer.dir) is None and load_part(writer.dir) is None
        if partial and (self.world_size == 1 or isinstance(exc, SpotguardDiskFull)):
            # Several ranks: only a full disk, which every rank agreed on (RankDiskFull), so no rank is
            # still writing; its room is wanted now. Other leftovers go at the next save.
            shutil.rmtree(writer.dir, ignore_errors=True)
        self._tell_save_failed(writer, failure, notice)
        return failure

    def _tell_save_failed(self, writer: CheckpointWriter, failure: Exception, notice: Message | None) -> None:
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
            error=DISK_FULL if isinstance(failure, SpotguardDiskFull) else WRITE_FAILED,
            message=str(failure),
            event_id=notice["notice"]["event_id"] if notice else None,
            **details,
        )

    def report(self, target: Path, step: int, reason: str, notice: Message | None, *, here: bool = True) -> None:
        """After a commit: tell the daemon (each node's leader speaks for its disk, unless ``here`` is
        False: its disk holds nothing of the checkpoint) and keep the disk in bounds."""
        self.last_committed = target
        if not self.node_leader or not here:
            return
        self.client.send(
            "saved",
            path=str(target),
            step=step,
            reason=reason,
            event_id=notice["notice"]["event_id"] if notice else None,
        )
        if not self.client.connected.is_set() and reason not in HURRIED:
            # No daemon: nobody uploads these (a bucket set only for resume changes nothing); keep the
            # disk from filling. After a save racing a deadline the next save does it (one more
            # checkpoint on disk meanwhile; a save short of room makes its own).
            prune_local(self.checkpoint_dir, self.keep)
