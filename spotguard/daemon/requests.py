"""The daemon's socket requests: what trainers and the CLI send, checked, acted on and answered."""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

from spotguard import protocol
from spotguard.config import DaemonConfig
from spotguard.daemon.events import CheckpointSaved, EventBus, SaveFailed
from spotguard.daemon.notices import NoticeBook
from spotguard.daemon.peering import Peering
from spotguard.daemon.plan import Planner
from spotguard.daemon.server import Peer, Reply, SocketServer
from spotguard.daemon.stall import StallWatch
from spotguard.daemon.uploader import Uploader
from spotguard.localstore import prune_local
from spotguard.manifest import (
    MAX_STEP,
    FileEntry,
    ManifestError,
    check_relpath,
    load_manifest,
    load_part,
    parse_step_dir,
    step_dir_name,
)
from spotguard.notice import Action, Kind, Notice, utcnow
from spotguard.peer.handoff import Handoff
from spotguard.safefile import TMP_MARK
from spotguard.space import keep_room_for_one
from spotguard.storage.base import Storage
from spotguard.version import __version__

logger = logging.getLogger("spotguard.daemon")

_SAVE_FAILED_FIELDS = ("step", "reason", "error", "message", "bytes_needed", "bytes_free", "path", "event_id")


class RequestHost(Protocol):
    """The parts of the daemon its socket requests read and change."""

    config: DaemonConfig
    provider: str
    root: Path
    storage: Storage | None
    uploader: Uploader
    planner: Planner
    notices: NoticeBook
    server: SocketServer
    stalls: StallWatch
    peering: Peering
    last_notice: dict[str, Any] | None  # the latest notice's timeline
    bus: EventBus  # CheckpointSaved, SaveFailed
    save_failures: list[dict[str, Any]]

    @property
    def pending(self) -> tuple[Notice, Action] | None: ...

    @property
    def handoff(self) -> Handoff | None: ...

    def status(self) -> dict[str, Any]: ...

    async def on_notice(self, notice: Notice) -> bool: ...


def checkpoint_now(notice: Notice, action: Action) -> Reply:
    """What a trainer is told of a pending notice."""
    return "checkpoint-now", {
        "notice": notice.to_dict(),
        "stop": action is Action.STOP,
        # A held notice may be past its deadline: the trainer has no time left, not negative time.
        "deadline_s": round(max(0.0, notice.seconds_left()), 3),
    }


def _resolved(text: str, what: str) -> Path:
    """``text`` as an absolute path without links, or the protocol's error: a NUL byte is no path."""
    try:
        return Path(text).resolve()
    except (ValueError, RuntimeError):  # a NUL byte; a loop of links
        raise protocol.ProtocolError("bad-path", f"{what}: {text!r} is not a path") from None


class RequestHandler:
    """Answers the daemon's socket messages (``handle``) and forgets a writer that goes (``on_disconnect``);
    ``stopping`` says whether the daemon is shutting down."""

    def __init__(self, host: RequestHost, *, stopping: Callable[[], bool]) -> None:
        self.host = host
        self._stopping = stopping
        self._discards: set[asyncio.Task[list[str]]] = set()  # failed or cancelled saves being removed

    async def handle(self, peer: Peer, message: dict[str, Any]) -> list[Reply]:
        kind = message["type"]
        if kind == "hello":
            return self._hello(peer, message)
        if kind == "state-size":
            self._state_size(peer, message["bytes"], sharded=message["sharded"])
            return []  # a hint for the next plan: the trainer does not wait
        if kind == "file":
            self._file(message)
            return []  # fire and forget: the trainer is busy writing the next file
        if kind == "file-range":
            self._file_range(peer, message)
            return []  # no reply either: a range per written chunk, the trainer does not wait
        if kind == "saved":
            return [await self._saved(peer, message)]
        if kind == "checkpoint-started":
            self.host.stalls.acted(peer, message["event_id"], f"reached a checkpoint point at step {message['step']}")
            return []
        if kind == "save-failed":
            self._save_failed(peer, message)
            return []  # nothing to answer: the trainer goes on (or stops) either way
        if kind == "save-cancelled":
            step, reason = message["step"], message["reason"]
            logger.info("trainer pid %d: %s checkpoint at step %d cancelled", peer.pid, reason, step)
            self._discard(step, "the save was cancelled")
            return []
        if kind == "safe-steps":
            # Local copies of these may be dropped when the disk is short of room. (A name bucket
            # retention removed since stays listed until the next rescan: it is older than
            # keep_remote complete ones, and local retention drops it anyway.)
            return [("safe-steps", {"names": sorted(self.host.uploader.committed), "bucket": self.host.config.bucket})]
        if kind == "peer-resume":
            return [await self.host.peering.resume(message)]
        if kind == "drill":
            return [await self._drill(message)]
        return [("status", self.host.status())]

    def _hello(self, peer: Peer, message: dict[str, Any]) -> list[Reply]:
        peer.hello = message
        claimed = message.get("checkpoint_dir") or ""
        fields: dict[str, Any] = {
            "checkpoint_dir": str(self.host.root),
            "bucket": self.host.config.bucket,
            "daemon_pid": os.getpid(),
            "version": __version__,
            "peers": self.host.peering.can_resume(),  # the hook asks (peer-resume) before a resume
        }
        if claimed and _resolved(claimed, "hello: checkpoint_dir") != self.host.root.resolve():
            fields["warning"] = (
                f"the trainer writes to {claimed} but this daemon uploads from {self.host.root}: "
                "set the same directory on both sides"
            )
            logger.warning("trainer pid %d: %s", peer.pid, fields["warning"])
        hook = message.get("version")
        logger.info(
            "trainer connected: pid %d rank %s/%s (spotguard %s)",
            peer.pid, message["rank"], message["world_size"], hook or "of a version that does not say it",
        )  # fmt: skip
        if hook != __version__:
            # A fleet upgraded in turn: the protocol is the same, but what one side added since the other's
            # version (a message, a field) the other refuses or ignores, and says so in its log.
            logger.warning(
                "trainer pid %d runs spotguard %s and this daemon %s: upgrade the older of the two so that "
                "both sides know the same messages", peer.pid, hook or "(older, unnamed)", __version__,
            )  # fmt: skip
        if isinstance(message.get("state_bytes"), int):
            self._state_size(peer, message["state_bytes"], sharded=bool(message.get("sharded")))
        replies: list[Reply] = [("welcome", fields)]
        pending = self.host.pending
        if pending is not None:
            # A trainer that (re)connects while a notice is pending is told at once.
            replies.append(checkpoint_now(*pending))
            self.host.stalls.mark_told([peer], pending[0])
        return replies

    def _state_size(self, peer: Peer, nbytes: int, *, sharded: bool) -> None:
        """A trainer's state takes ``nbytes`` now: the next plan counts with it, the pending one at once."""
        if peer.hello is None:
            raise protocol.ProtocolError("no-hello", "state-size: say hello first")
        if self.host.planner.announced.of(peer.id) != (nbytes, sharded):  # a hello and its queued message may agree
            share = " (its share of sharded state)" if sharded else ""
            logger.info("trainer pid %d: its state takes %d bytes%s", peer.pid, nbytes, share)
        self.host.planner.announced.set(peer.id, nbytes, sharded=sharded)
        if self.host.pending is not None:
            self.host.planner.revise(self.host.uploader.forecast())

    def _step_dir(self, path: Path) -> Path:
        """A reported checkpoint directory, resolved; it must be a direct child of the checkpoint root."""
        try:
            resolved = path.resolve(strict=True)
        except (OSError, RuntimeError):
            raise protocol.ProtocolError("bad-path", f"{path} does not exist") from None
        except ValueError:  # a NUL byte: no path at all
            raise protocol.ProtocolError("bad-path", f"{str(path)!r} is not a path") from None
        if resolved.parent != self.host.root.resolve() or parse_step_dir(resolved.name) is None:
            raise protocol.ProtocolError("bad-path", f"{path} is not a checkpoint directory inside {self.host.root}")
        return resolved

    def _file(self, message: dict[str, Any]) -> None:
        step_dir = self._step_dir(Path(message["path"]))
        try:
            name = check_relpath(message["name"])
        except ManifestError as exc:
            raise protocol.ProtocolError("bad-path", str(exc)) from None
        entry = FileEntry(size=message["size"], crc32c=message["crc32c"])
        self.host.uploader.file_ready(step_dir, name, entry, urgent=self.host.pending is not None)
        if self.host.pending is not None:
            self.host.planner.observe_file(step_dir.name, name, entry.size)
            self.host.planner.revise(self.host.uploader.forecast())  # now: a big file may call for the peer route
            if self.host.handoff is not None:
                self.host.handoff.file_ready(step_dir, name, entry)

    def _file_range(self, peer: Peer, message: dict[str, Any]) -> None:
        step_dir = self._step_dir(Path(message["path"]))
        try:
            name = check_relpath(message["name"])
        except ManifestError as exc:
            raise protocol.ProtocolError("bad-path", str(exc)) from None
        tmp = PurePosixPath(message["tmp"])
        # The writer's temporary name sits beside the file it becomes, and says it is one.
        if tmp.is_absolute() or tmp.parent != PurePosixPath(name).parent or TMP_MARK not in tmp.name:
            raise protocol.ProtocolError(
                "bad-path", f"file-range: {message['tmp']!r} is not a temporary name beside {name!r}"
            )
        if not (step_dir / tmp).parent.resolve().is_relative_to(step_dir):
            # A subdirectory that is a symlink: O_NOFOLLOW guards only the last component.
            raise protocol.ProtocolError("bad-path", f"file-range: {message['tmp']!r} leads out of {step_dir}")
        # Writers that gave up on a file (its temporary name removed) leave no upload open.
        self.host.uploader.abort_streams("its temporary file was removed before it was finished")
        try:
            self.host.uploader.file_range(
                step_dir,
                name,
                tmp=str(tmp),
                size=message["size"],
                offset=message["offset"],
                length=message["length"],
                owner=peer.id,
                urgent=self.host.pending is not None,
            )
        except FileNotFoundError:
            if (step_dir / name).is_file():
                return  # announced late: the file is finished already, and goes whole at its file message
            raise protocol.ProtocolError("bad-path", f"file-range: {step_dir / tmp} does not exist") from None
        except ValueError as exc:
            raise protocol.ProtocolError("bad-field", str(exc)) from None
        except OSError as exc:  # a symlink (refused), a directory, no permission
            raise protocol.ProtocolError("bad-path", f"file-range: {step_dir / tmp}: {exc}") from None
        if self.host.handoff is not None and self.host.pending is not None:
            self.host.handoff.file_range(
                step_dir, name, tmp=str(tmp), size=message["size"], offset=message["offset"], length=message["length"]
            )

    async def _saved(self, peer: Peer, message: dict[str, Any]) -> Reply:
        resolved = self._step_dir(Path(message["path"]))
        self.host.uploader.abort_streams("its temporary file was removed before it was finished")
        urgent = message["reason"] in ("urgent", "soft", "final")
        if isinstance(message.get("event_id"), str):
            self.host.stalls.acted(peer, message["event_id"], f"committed {resolved.name}")
        try:
            manifest = await asyncio.to_thread(load_manifest, resolved)
        except (OSError, ValueError) as exc:
            # Multi-node jobs: this disk may hold only this node's committed share.
            if (share := await asyncio.to_thread(load_part, resolved)) is None:
                raise protocol.ProtocolError("not-committed", f"{resolved.name}: {exc}") from None
            logger.info("trainer pid %d committed this node's share of %s", peer.pid, resolved.name)
            self._handoff_saved(resolved)  # the peer route carries this node's share
            self._record_saved(message.get("event_id"), resolved.name, parse_step_dir(resolved.name) or 0)
            self._observe_saved(share)
            return await self._upload_or_prune(resolved, urgent=urgent)
        logger.info(
            "trainer pid %d committed %s (%s, %d bytes)", peer.pid, resolved.name, manifest.reason, manifest.total_bytes
        )
        self.host.bus.emit(CheckpointSaved(resolved.name, manifest))
        self._handoff_saved(resolved)
        self._record_saved(message.get("event_id"), resolved.name, manifest.step)
        # Node 0 of a multi-node job holds the whole job's manifest but uploads only its share.
        share = await asyncio.to_thread(load_part, resolved) if manifest.meta.get("nodes", 1) > 1 else None
        self._observe_saved(manifest.files if share is None else share)
        return await self._upload_or_prune(resolved, urgent=urgent)

    def _handoff_saved(self, resolved: Path) -> None:
        """Tell the peer route of a save made while a notice is pending, before the save is recorded:
        that ends a soft notice (its checkpoint is taken), and the handoff must know by then what it
        still has to send."""
        if self.host.handoff is not None and self.host.pending is not None:
            self.host.handoff.saved(resolved)

    async def _upload_or_prune(self, resolved: Path, *, urgent: bool) -> Reply:
        """A checkpoint (or this node's share of one) committed on this disk: queue its upload, or
        without a bucket keep only the newest ``keep_local``."""
        if self.host.storage is None:
            await asyncio.to_thread(self._prune_without_bucket)
        else:
            self.host.uploader.submit(resolved, urgent=urgent)
            # Uploads failing for hours must not fill the disk the next urgent save needs.
            await asyncio.to_thread(keep_room_for_one, self.host.root, protected=self.host.uploader.in_flight())
        return "ok", {"queued": self.host.storage is not None, "name": resolved.name}

    def _observe_saved(self, files: Mapping[str, FileEntry]) -> None:
        """What this node uploads of the checkpoint just committed sizes the next notice's plan, and
        the pending one's now."""
        self.host.planner.observe_size(sum(entry.size for entry in files.values()))
        if self.host.pending is not None:
            self.host.planner.revise(self.host.uploader.forecast())

    def _discard(self, step: int, why: str) -> None:
        """A save that committed nothing: its files already streamed or sent ahead of the commit must
        not stay in the bucket (nor keep uploading beside the next save's)."""
        if self.host.storage is None or not 0 <= step <= MAX_STEP:
            return
        name = step_dir_name(step)
        task = asyncio.create_task(self.host.uploader.discard(name, why), name=f"discard-{name}")
        self._discards.add(task)
        task.add_done_callback(self._discards.discard)

    def _save_failed(self, peer: Peer, message: dict[str, Any]) -> None:
        failure = {name: message.get(name) for name in _SAVE_FAILED_FIELDS}
        failure.update(pid=peer.pid, at=utcnow().isoformat())
        logger.error(
            "trainer pid %d: %s checkpoint at step %d failed (%s): %s",
            peer.pid,
            message["reason"],
            message["step"],
            message["error"],
            message["message"],
        )
        self._discard(message["step"], "the save failed")
        self.host.save_failures.append(failure)
        del self.host.save_failures[:-20]
        event_id = message.get("event_id")
        if (
            self.host.last_notice is not None
            and isinstance(event_id, str)
            and self.host.last_notice.get("event_id") == event_id
        ):
            self.host.last_notice["save_failed"] = failure
        self.host.bus.emit(SaveFailed(failure))

    def _record_saved(self, event_id: object, name: str, step: int) -> None:
        """The trainer saved for a notice: remember it (across restarts) and for the timeline."""
        if self.host.last_notice and self.host.last_notice.get("event_id") == event_id:
            self.host.last_notice.update(saved_at=utcnow().isoformat(), saved_step=step, checkpoint=name)
        self.host.notices.checkpointed(event_id, saved_step=step)

    def _prune_without_bucket(self) -> None:
        prune_local(self.host.root, self.host.config.keep_local)

    async def _drill(self, message: dict[str, Any]) -> Reply:
        if self._stopping():
            raise protocol.ProtocolError("stopping", "the daemon is shutting down")
        seconds = float(message.get("deadline_s") or self.host.config.drill_deadline)
        if not 0 < seconds <= protocol.MAX_DRILL_SECONDS:
            raise protocol.ProtocolError(
                "bad-field", f"drill: deadline_s must be in (0, {protocol.MAX_DRILL_SECONDS:.0f}]"
            )
        notice = Notice.in_seconds(
            self.host.provider, Kind.DRILL, seconds, identity=uuid.uuid4().hex, raw={"drill": True}
        )
        await self.host.on_notice(notice)
        return "ok", {
            "event_id": notice.event_id,
            "trainers_told": len(self.host.server.trainers()),
            "deadline_s": seconds,
        }

    def on_disconnect(self, peer: Peer) -> None:
        self.host.stalls.forget(peer)
        self.host.planner.announced.drop(peer.id)  # a pending plan keeps its number (the state may be mid-write)
        # Nothing it was writing can be finished now (a reconnected writer's file goes whole).
        self.host.uploader.abort_streams("the writer disconnected before finishing it", owner=peer.id)
        if peer.is_trainer:
            logger.info("trainer pid %d disconnected", peer.pid)
