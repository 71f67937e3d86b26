"""Checkpoint-level operations on a bucket: list, verify, upload, restore, prune.

Blocking, like the backends; the daemon runs them in threads. The layout in
the bucket is the local one: ``<prefix>/step-NNNNNNNNN/<files>`` with
``manifest.json`` uploaded last (the remote commit) and deleted first.
"""

from __future__ import annotations

import errno
import logging
import shutil
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from pathlib import Path

from spotguard.cloudclock import cloud_now
from spotguard.crc32c import crc32c_of_bytes
from spotguard.manifest import (
    FORMAT,
    MANIFEST,
    CheckpointInfo,
    FileEntry,
    Manifest,
    ManifestError,
    foreign_format,
    load_manifest,
    parse_step_dir,
    verify_dir,
)
from spotguard.safefile import fsync_dir, read_nofollow
from spotguard.storage.base import ObjectExists, ObjectInfo, ObjectNotFound, Progress, Storage, StorageError, retry
from spotguard.storage.transfer import Download, download_files

logger = logging.getLogger("spotguard.storage")


class UploadCancelled(StorageError):
    pass


class CommitLost(StorageError):
    """Another writer committed a different checkpoint under this name first. Nothing of theirs
    was overwritten; sending ours again would change nothing, so it is not retried."""


def _group_by_checkpoint(objects: Iterable[ObjectInfo]) -> dict[str, dict[str, ObjectInfo]]:
    groups: dict[str, dict[str, ObjectInfo]] = defaultdict(dict)
    for obj in objects:
        name, _, rest = obj.key.partition("/")
        if rest and parse_step_dir(name) is not None:
            groups[name][rest] = obj
    return groups


def read_remote_manifest(storage: Storage, name: str) -> Manifest:
    return _parse_manifest(name, storage.read_bytes(f"{name}/{MANIFEST}"))


def _parse_manifest(name: str, data: bytes) -> Manifest:
    manifest = Manifest.from_json(data)
    if parse_step_dir(name) != manifest.step:
        raise ManifestError(f"{name}: manifest says step {manifest.step}")
    return manifest


def _problems_against(manifest: Manifest, objects: dict[str, ObjectInfo], name: str) -> list[str]:
    problems = []
    for rel, entry in sorted(manifest.files.items()):
        obj = objects.get(rel)
        if obj is None:
            problems.append(f"{name}/{rel}: missing")
        elif obj.size != entry.size:
            problems.append(f"{name}/{rel}: size {obj.size}, manifest says {entry.size}")
        elif obj.crc32c is not None and obj.crc32c != entry.crc32c:
            problems.append(f"{name}/{rel}: crc32c {obj.crc32c}, manifest says {entry.crc32c}")
    return problems


class KnownManifests:
    """Manifests already read from a bucket, each with the listing of its object when it was read.

    A manifest is written once and never changed in place: while its object lists the same (size,
    checksum, time written) it need not be read again. For a daemon listing the bucket all day, that
    is one request per listing instead of one per checkpoint more. An object whose listing gives no
    time and no checksum is always read. Only the names of the last listing are kept."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[ObjectInfo, Manifest | None, str | None]] = {}
        self._lock = threading.Lock()  # examined from a pool of threads
        self.reads = 0  # manifests read from the bucket (the rest came from here)

    def get(self, name: str, listed: ObjectInfo) -> tuple[Manifest | None, str | None] | None:
        with self._lock:
            known = self._known.get(name)
        if known is None or known[0] != listed or (listed.modified is None and listed.crc32c is None):
            return None
        return known[1], known[2]

    def put(self, name: str, listed: ObjectInfo, manifest: Manifest | None, foreign: str | None) -> None:
        with self._lock:
            self._known[name] = (listed, manifest, foreign)
            self.reads += 1

    def keep_only(self, names: Iterable[str]) -> None:
        with self._lock:
            self._known = {name: self._known[name] for name in names if name in self._known}


def list_remote(
    storage: Storage,
    *,
    progress: Callable[[int, int], None] | None = None,
    workers: int = 8,
    known: KnownManifests | None = None,
    newer_than: int | None = None,
) -> list[CheckpointInfo]:
    """Checkpoints in the bucket, oldest first (only those of a step above ``newer_than``, when given:
    the others' manifests are not read). Complete: a valid manifest whose files are all there with the
    right sizes (and checksums, where the store reports them). Manifests are read ``workers`` at a time
    (those ``known`` already holds, not at all); ``progress(examined, found)`` is called after each
    checkpoint."""
    groups = _group_by_checkpoint(storage.list())
    if newer_than is not None:
        groups = {name: objects for name, objects in groups.items() if (parse_step_dir(name) or -1) > newer_than}
    return _examine(storage, groups, progress=progress, workers=workers, known=known)


def _examine(
    storage: Storage,
    groups: Mapping[str, dict[str, ObjectInfo]],
    *,
    progress: Callable[[int, int], None] | None = None,
    workers: int = 8,
    known: KnownManifests | None = None,
) -> list[CheckpointInfo]:
    """``list_remote`` for a listing already grouped by checkpoint."""
    if known is not None:
        known.keep_only(groups)
    lock = threading.Lock()
    examined = 0

    def examine(name: str, objects: dict[str, ObjectInfo]) -> CheckpointInfo:
        step = parse_step_dir(name)
        assert step is not None
        manifest, foreign = None, None
        if MANIFEST in objects:
            manifest, foreign = _manifest_of(storage, name, objects[MANIFEST], known)
        if progress:
            nonlocal examined
            with lock:
                examined += 1
                progress(examined, len(groups))
        if manifest is not None and not _problems_against(manifest, objects, name):
            return CheckpointInfo(name, step, "complete", manifest.total_bytes, manifest.created, manifest)
        size = sum(o.size for o in objects.values())
        return CheckpointInfo(name, step, "incomplete", size, None, foreign_format=foreign)

    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(groups) or 1))) as pool:
        infos = list(pool.map(lambda item: examine(*item), groups.items()))
    return sorted(infos, key=lambda info: info.step)


def _manifest_of(
    storage: Storage, name: str, listed: ObjectInfo, known: KnownManifests | None
) -> tuple[Manifest | None, str | None]:
    """A checkpoint's manifest (None if unreadable or invalid) and its foreign format, if any."""
    if known is not None and (seen := known.get(name, listed)) is not None:
        return seen
    try:
        data = storage.read_bytes(f"{name}/{MANIFEST}")
    except StorageError:
        return None, None  # not remembered: the next listing reads it again
    foreign = foreign_format(data)
    try:
        manifest = None if foreign is not None else _parse_manifest(name, data)
    except ManifestError:
        manifest = None
    if known is not None:
        known.put(name, listed, manifest, foreign)
    return manifest, foreign


def verify_remote(storage: Storage, name: str, *, streams: int = 16, progress: Progress | None = None) -> list[str]:
    """Read every file of one checkpoint back from the bucket and check it against the manifest
    (CRC32C computed as the bytes arrive; nothing is written locally)."""
    try:
        manifest = read_remote_manifest(storage, name)
    except (ManifestError, StorageError) as exc:
        return [f"{name}: {exc}"]
    problems = _problems_against(manifest, {o.key.partition("/")[2]: o for o in storage.list(f"{name}/")}, name)
    if problems:
        return problems
    items = [Download(f"{name}/{rel}", entry.size, entry.crc32c) for rel, entry in sorted(manifest.files.items())]
    return download_files(storage, items, streams=streams, progress=progress)


def is_committed(storage: Storage, name: str) -> bool:
    return any(info.name == name and info.status == "complete" for info in list_remote(storage))


def upload_files(
    storage: Storage,
    step_dir: Path,
    files: Mapping[str, FileEntry],
    *,
    concurrency: int = 8,
    deadline: float | None = None,
    cancel: threading.Event | None = None,
    progress: UploadProgress | None = None,
) -> None:
    """Upload data files of a checkpoint in parallel (never its manifest).

    Restart-safe: a file already in the bucket with the same size and CRC32C (as the store keeps
    it, :func:`stored_crc32c`), or sent by this process already, is not sent again; a size match
    alone proves nothing when writers share a prefix. Nothing at all is sent when the bucket holds
    another writer's manifest for this checkpoint (other files, or a format this version does not
    know): its files are someone else's commit, and the commit tells the caller so.
    ``deadline`` is a ``time.monotonic()`` value bounding retries.
    """
    name = step_dir.name
    existing = {o.key.partition("/")[2]: o for o in storage.list(f"{name}/")}
    if progress is not None:
        for rel, entry in files.items():
            progress.expect(rel, entry.size)
    if MANIFEST in existing and not _lists_the_same(storage, name, files):
        logger.info("%s: %s holds another writer's commit there; not sending its files", name, storage.url)
        return

    def send(rel: str) -> None:
        entry = files[rel]
        have = existing.get(rel)
        sent_here = progress is not None and progress.sent_here(rel, entry)
        if sent_here or (have and have.size == entry.size and stored_crc32c(storage, have) == entry.crc32c):
            if progress is not None:
                progress.present(rel)
            return
        if cancel is not None and cancel.is_set():
            raise UploadCancelled(f"{name}: upload cancelled")
        put_with_retry(storage, step_dir, rel, entry, deadline=deadline, progress=progress, cancel=cancel)

    # Largest first: the long transfers start early and small files fill the gaps.
    order = sorted(files, key=lambda rel: -files[rel].size)
    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(order) or 1))) as pool:
        for future in [pool.submit(send, rel) for rel in order]:
            future.result()


def _lists_the_same(storage: Storage, name: str, files: Mapping[str, FileEntry]) -> bool:
    """Whether the manifest in the bucket lists ``files`` as they are here (then sending what is
    missing of them completes that checkpoint and overwrites nothing of anyone's)."""
    try:
        theirs = read_remote_manifest(storage, name)
    except (ManifestError, ObjectNotFound):
        return False
    return all(theirs.files.get(rel) == entry for rel, entry in files.items())


def stored_crc32c(storage: Storage, obj: ObjectInfo) -> str | None:
    """The CRC32C (hex) the store keeps for ``obj``, or None when it keeps none worth trusting.

    The one place a stored checksum is looked up: a listing that carries none (S3's) costs one
    ``stat`` (HeadObject with checksum mode), and a store whose CRC32C cannot be trusted says None
    there, which sends the file again rather than take it on its size."""
    if obj.crc32c is not None:
        return obj.crc32c
    info = storage.stat(obj.key)
    return None if info is None else info.crc32c


def put_with_retry(
    storage: Storage,
    step_dir: Path,
    rel: str,
    entry: FileEntry,
    *,
    deadline: float | None = None,
    progress: UploadProgress | None = None,
    cancel: threading.Event | None = None,
    what: str = "uploading",
) -> None:
    """One data file of a checkpoint to the bucket, transient failures retried until ``deadline``.

    ``cancel`` set stops the file after the part in flight (the backend aborts its unfinished
    multipart upload): an urgent checkpoint need not wait for the rest of a file of tens of GB.
    """
    key = f"{step_dir.name}/{rel}"
    sent = progress.sender(rel) if progress is not None else None

    def part_done(length: int) -> None:
        if sent is not None:
            sent(length)
        if cancel is not None and cancel.is_set():
            raise UploadCancelled(f"{key}: upload cancelled between parts")

    retry(
        lambda: storage.put_file(step_dir / rel, key, crc32c=entry.crc32c, progress=part_done),
        is_transient=storage.is_transient,
        deadline=deadline,
        what=f"{what} {key}",
    )
    if progress is not None:
        progress.present(rel)  # whatever the parts did not report (a file of one request)
        progress.mark_sent(rel, entry)


def commit_remote(storage: Storage, step_dir: Path, *, deadline: float | None = None) -> bool:
    """Upload the manifest, only if the bucket holds none for this checkpoint yet: only now does
    the checkpoint exist there. Of writers racing on one manifest exactly one writes it.

    True: this call committed it. False: the bucket already holds the same checkpoint (the same
    files and CRC32Cs), committed by another writer or by an attempt of ours whose answer was lost.
    Raises :class:`CommitLost` when it holds a different one, which is left as it is."""
    name = step_dir.name
    ours = read_nofollow(step_dir / MANIFEST)
    key = f"{name}/{MANIFEST}"
    try:
        retry(
            lambda: storage.put_bytes_if_absent(key, ours, crc32c=crc32c_of_bytes(ours)),
            is_transient=storage.is_transient,
            deadline=deadline,
            what=f"committing {name}",
        )
        return True
    except ObjectExists:
        pass
    theirs = retry(
        lambda: storage.read_bytes(key), is_transient=storage.is_transient, deadline=deadline, what=f"reading {key}"
    )
    difference = _difference(name, ours, theirs)
    if difference is None:
        logger.info("%s: the bucket already holds this checkpoint (same files and CRC32Cs); counted as committed", name)
        return False
    raise CommitLost(f"{storage.url}/{name} already holds another writer's checkpoint ({difference}); not overwritten")


def _difference(name: str, ours: bytes, theirs: bytes) -> str | None:
    """How the manifest in the bucket differs from ours as a checkpoint (None: the same files,
    sizes and CRC32Cs; when or why each was written does not matter)."""
    if (found := foreign_format(theirs)) is not None:
        return f"its manifest is of format {found!r}"
    try:
        mine, other = _parse_manifest(name, ours), _parse_manifest(name, theirs)
    except ManifestError as exc:
        return f"its manifest is unreadable: {exc}"
    return files_difference(mine, other)


def files_difference(mine: Manifest, other: Manifest) -> str | None:
    """None when two manifests list the same files with the same sizes and CRC32Cs, else how not."""
    if mine.files == other.files:
        return None
    changed = sorted(set(mine.files) ^ set(other.files)) or sorted(
        rel for rel in mine.files if mine.files[rel] != other.files[rel]
    )
    return f"{len(changed)} file(s) differ, first {changed[0]}"


class OtherNodesMissing(StorageError):
    """The other nodes' shares of a multi-node checkpoint did not reach the bucket in time."""


def wait_for_other_nodes(
    storage: Storage,
    manifest: Manifest,
    name: str,
    *,
    deadline: float,
    cancel: threading.Event | None = None,
    poll: float = 1.0,
) -> None:
    """Block until every file the global manifest lists is in the bucket (the other nodes' shares)."""
    while True:
        objects = {o.key.partition("/")[2]: o for o in storage.list(f"{name}/")}
        missing = _problems_against(manifest, objects, name)
        if not missing:
            return
        if time.monotonic() + poll > deadline:
            raise OtherNodesMissing(
                f"{name}: other nodes' files never reached the bucket: {missing[0]} (and {len(missing) - 1} more)"
            )
        if cancel is not None and cancel.wait(poll):
            raise UploadCancelled(f"{name}: upload cancelled")
        if cancel is None:
            time.sleep(poll)


def upload_checkpoint(
    storage: Storage,
    step_dir: Path,
    *,
    concurrency: int = 8,
    deadline: float | None = None,
    cancel: threading.Event | None = None,
    progress: UploadProgress | None = None,
) -> Manifest:
    """Upload a locally committed checkpoint: data files in parallel, then the manifest."""
    manifest = load_manifest(step_dir)
    upload_files(
        storage, step_dir, manifest.files, concurrency=concurrency, deadline=deadline, cancel=cancel, progress=progress
    )
    if cancel is not None and cancel.is_set():
        raise UploadCancelled(f"{step_dir.name}: upload cancelled before commit")
    commit_remote(storage, step_dir, deadline=deadline)
    return manifest


def restore(
    storage: Storage,
    dest_root: Path,
    *,
    step: int | None = None,
    streams: int = 16,
    progress: Progress | None = None,
    log: Callable[[str], None] | None = None,
    candidates: list[CheckpointInfo] | None = None,
) -> Path | None:
    """Download the newest complete checkpoint (or ``step``) into ``dest_root``, verified.

    Falls back to the previous complete checkpoint when the newest fails verification (unless a
    step was asked for). The local copy is committed the same way as a local save: data files,
    then the manifest. Returns the local step directory, or None if the bucket has none.
    ``candidates``: a listing the caller already has (``list_remote``), to save listing again.
    """
    listing = candidates if candidates is not None else list_remote(storage)
    candidates = [info for info in listing if info.status == "complete"]
    if step is not None:
        candidates = [info for info in candidates if info.step == step]
        if not candidates:
            raise StorageError(f"{storage.url}: no complete checkpoint at step {step}")
    for info in reversed(candidates):
        target = dest_root / info.name
        try:
            if _already_restored(target):
                return target
            _download(storage, info, target, streams=streams, progress=progress)
            return target
        except (StorageError, ManifestError, OSError) as exc:
            shutil.rmtree(target, ignore_errors=True)
            if step is not None:
                raise
            if not found_bad(exc):
                raise unreadable(info.name, exc, dest_root) from exc
            if log:
                log(f"{info.name} failed verification ({exc}); trying the previous checkpoint")
    return None


class CheckpointUnreadable(StorageError):
    """A checkpoint could not be restored for a reason that says nothing bad of it (a bucket that
    kept failing past its retries, a full or failing local disk): a resume stops there instead of
    going back to an older checkpoint, which would give up every step since without a word."""


def found_bad(exc: BaseException) -> bool:
    """Whether ``exc``, raised while restoring a checkpoint, says the checkpoint itself is bad or gone
    (a file that does not match its manifest, a missing object, a manifest that cannot be read):
    only then is the previous checkpoint tried."""
    return isinstance(exc, ManifestError | ObjectNotFound)


def unreadable(name: str, exc: BaseException, dest_root: Path) -> CheckpointUnreadable:
    """The error for ``name`` not restored because of ``exc`` (not :func:`found_bad`)."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        fix = f"make room on {dest_root} (the checkpoint needs its size there)"
    elif isinstance(exc, OSError):
        fix = f"check the disk under {dest_root}"
    else:
        fix = "check the bucket (its access, its answers) or wait until it answers"
    return CheckpointUnreadable(
        f"{name} could not be restored ({exc}); it was not found bad, so no older checkpoint is tried"
        f" (that would give up the steps since): {fix}, then start again"
    )


def _already_restored(step_dir: Path) -> bool:
    return step_dir.is_dir() and not verify_dir(step_dir)


def _download(storage: Storage, info: CheckpointInfo, target: Path, *, streams: int, progress: Progress | None) -> None:
    # A complete listing entry carries the manifest it was judged by: no second GET for it.
    manifest = info.manifest if info.manifest is not None else read_remote_manifest(storage, info.name)
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    items = [
        Download(f"{info.name}/{rel}", entry.size, entry.crc32c, target / rel) for rel, entry in manifest.files.items()
    ]
    problems = download_files(storage, items, streams=streams, progress=progress)
    if problems:
        raise ManifestError(f"{problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    for sub in {(target / rel).parent for rel in manifest.files}:
        fsync_dir(sub)
    # Written last, as in a local save: the local copy counts only once everything verified.
    storage.get_file(f"{info.name}/{MANIFEST}", target / MANIFEST)
    fsync_dir(target)
    load_manifest(target)


DEFAULT_INCOMPLETE_GRACE = timedelta(hours=1)


def prune_remote(
    storage: Storage,
    keep: int,
    *,
    protected: frozenset[str] = frozenset(),
    grace: timedelta = DEFAULT_INCOMPLETE_GRACE,
    now: datetime | None = None,
    known: KnownManifests | None = None,
) -> list[str]:
    """Keep the newest ``keep`` complete checkpoints and delete the older complete ones; delete
    incomplete ones nothing has written to for ``grace`` (leftovers of a VM that died mid-upload;
    a younger one may be another node's share, or an upload still under way elsewhere). Never
    touches the newest complete checkpoint or any name in ``protected`` (uploads in flight here).
    Manifests go first, so a half-deleted checkpoint is never mistaken for a complete one.

    The temporary files of a file:// store's copies go with the checkpoint they were written into,
    and a copy's write counts as a write to its checkpoint; one left anywhere else (by a writer
    killed mid-copy) is deleted once untouched for ``grace``, like an incomplete checkpoint."""
    now = now or cloud_now()  # the store's stamps are the cloud's time (spotguard/cloudclock.py)
    objects, temporaries = storage.listing()  # one listing serves the status, the keys and the copies
    groups = _group_by_checkpoint(objects)
    copies = _group_by_checkpoint(temporaries)
    infos = _examine(storage, groups, known=known)
    for info in infos:
        if info.foreign_format is not None:
            logger.warning(
                "%s/%s: manifest format %r is not %r (a newer spotguard's?); retention leaves it alone",
                storage.url, info.name, info.foreign_format, FORMAT,
            )  # fmt: skip
    infos = [info for info in infos if info.foreign_format is None]
    complete = [info for info in infos if info.status == "complete"]
    newest = complete[-1].name if complete else None

    def stale(name: str) -> bool:
        written = (*groups.get(name, {}).values(), *copies.get(name, {}).values())
        return all(_untouched(obj, grace, now) for obj in written)

    doomed = [info for info in complete[: -max(keep, 1)]]
    doomed += [info for info in infos if info.status == "incomplete" and stale(info.name)]
    doomed = [info for info in doomed if info.name not in protected and info.name != newest]
    for info in doomed:
        keys = list(groups.get(info.name, {}))
        if MANIFEST in keys:
            storage.delete([f"{info.name}/{MANIFEST}"])
        keys += copies.get(info.name, {})  # else it stays, unlisted, in the bucket forever
        storage.delete(f"{info.name}/{rel}" for rel in keys if rel != MANIFEST)
    spared = {info.name for info in doomed} | protected  # gone already; in flight here
    left = [obj.key for obj in temporaries if obj.key.partition("/")[0] not in spared and _untouched(obj, grace, now)]
    if left:
        storage.delete(left)
    return [info.name for info in doomed]


def _untouched(obj: ObjectInfo, grace: timedelta, now: datetime) -> bool:
    # An object whose store gives no time counts as young: never delete what may be in use.
    return obj.modified is not None and obj.modified + grace <= now


class UploadProgress:
    """How much of one checkpoint is in the bucket, how fast it is going, and when it will be done.

    Counted per file and capped at each file's size, so bytes reported twice (a retried part, a
    file sent ahead of the commit and then found present) count once. The rate covers only bytes
    this process sent, from the first of them: files found already in the bucket shorten what is
    left without making the link look faster. Thread-safe: parts report from worker threads.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._created = clock()
        self._lock = threading.Lock()
        self._sizes: dict[str, int] = {}
        self._done: dict[str, int] = {}
        self._sent = 0
        self._first_sent: float | None = None
        self._put: dict[str, FileEntry] = {}  # files this process put and the store took, as they were then
        self._ahead: dict[str, FileEntry] = {}  # files taken to go up ahead of the commit, as announced

    def expect(self, rel: str, size: int) -> None:
        with self._lock:
            self._sizes[rel] = size
            self._done.setdefault(rel, 0)

    def sender(self, rel: str) -> Progress:
        """The ``progress`` callback for uploading ``rel``."""

        def sent(count: int) -> None:
            with self._lock:
                size = self._sizes.get(rel, 0)
                step = max(0, min(count, size - self._done.get(rel, 0)))
                if not step:
                    return
                self._done[rel] = self._done.get(rel, 0) + step
                self._sent += step
                if self._first_sent is None:
                    self._first_sent = self._clock() - 1e-3  # the part's bytes took time too

        return sent

    def files(self) -> list[str]:
        """Every file of the checkpoint announced so far (what this process may have put in the store)."""
        with self._lock:
            return sorted(self._sizes)

    def present(self, rel: str) -> None:
        """``rel`` is in the bucket, whoever sent it."""
        with self._lock:
            self._done[rel] = self._sizes.get(rel, 0)

    def mark_sent(self, rel: str, entry: FileEntry) -> None:
        """``rel`` as ``entry`` says went up from this process and the store took it (checked by the backend)."""
        with self._lock:
            self._put[rel] = entry

    def sent_here(self, rel: str, entry: FileEntry) -> bool:
        """Whether this process put ``rel`` with the size and CRC32C of ``entry`` (a save of the same
        step begun again after a crash may have written other bytes under that name)."""
        with self._lock:
            return self._put.get(rel) == entry

    def take_ahead(self, rel: str, entry: FileEntry) -> bool:
        """True the first time ``rel`` as ``entry`` says is taken to go up ahead of the commit; False
        when it was already (its file message repeated, or come after the commit finished its stream)."""
        with self._lock:
            if self._ahead.get(rel) == entry:
                return False
            self._ahead[rel] = entry
            return True

    @property
    def total(self) -> int:
        """Bytes of every file announced so far (while the trainer writes, more may come)."""
        with self._lock:
            return sum(self._sizes.values())

    @property
    def done(self) -> int:
        with self._lock:
            return sum(self._done.values())

    def elapsed(self) -> float:
        """Seconds since the first byte was sent (since this tracker began, if none was)."""
        with self._lock:
            return self._clock() - (self._first_sent if self._first_sent is not None else self._created)

    def rate(self) -> float | None:
        """Bytes per second this process has sent, or None before there is anything to go on."""
        with self._lock:
            if self._first_sent is None:
                return None
            elapsed = self._clock() - self._first_sent
            return self._sent / elapsed if elapsed > 0.05 else None

    def eta(self) -> float | None:
        """Seconds until everything announced is in the bucket, at the rate so far."""
        rate = self.rate()
        remaining = self.total - self.done
        if remaining <= 0:
            return 0.0
        return remaining / rate if rate else None
