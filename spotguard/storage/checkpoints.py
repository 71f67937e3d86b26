"""Checkpoint-level operations on a bucket: list, verify, upload, restore, prune.

Blocking, like the backends; the daemon runs them in threads. The layout in
the bucket is the local one: ``<prefix>/step-NNNNNNNNN/<files>`` with
``manifest.json`` uploaded last (the remote commit) and deleted first.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from spotguard.manifest import (
    MANIFEST,
    CheckpointInfo,
    FileEntry,
    Manifest,
    ManifestError,
    crc32c_of_file,
    fsync_dir,
    load_manifest,
    parse_step_dir,
    verify_dir,
)
from spotguard.storage.base import ObjectInfo, Storage, StorageError, retry

Progress = Callable[[int], None]  # called with a number of bytes just transferred


class UploadCancelled(StorageError):
    pass


def _group_by_checkpoint(objects: Iterable[ObjectInfo]) -> dict[str, dict[str, ObjectInfo]]:
    groups: dict[str, dict[str, ObjectInfo]] = defaultdict(dict)
    for obj in objects:
        name, _, rest = obj.key.partition("/")
        if rest and parse_step_dir(name) is not None:
            groups[name][rest] = obj
    return groups


def read_remote_manifest(storage: Storage, name: str) -> Manifest:
    manifest = Manifest.from_json(storage.read_bytes(f"{name}/{MANIFEST}"))
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


def list_remote(storage: Storage) -> list[CheckpointInfo]:
    """Checkpoints in the bucket, oldest first. Complete: a valid manifest whose files are all there
    with the right sizes (and checksums, where the store reports them)."""
    infos = []
    for name, objects in _group_by_checkpoint(storage.list()).items():
        step = parse_step_dir(name)
        assert step is not None
        manifest = None
        if MANIFEST in objects:
            try:
                manifest = read_remote_manifest(storage, name)
            except (ManifestError, StorageError):
                manifest = None
        if manifest is not None and not _problems_against(manifest, objects, name):
            infos.append(CheckpointInfo(name, step, "complete", manifest.total_bytes, manifest.created, manifest))
        else:
            infos.append(CheckpointInfo(name, step, "incomplete", sum(o.size for o in objects.values()), None))
    return sorted(infos, key=lambda info: info.step)


def verify_remote(storage: Storage, name: str, *, progress: Progress | None = None) -> list[str]:
    """Download every file of one checkpoint to a scratch directory and check it against the manifest."""
    try:
        manifest = read_remote_manifest(storage, name)
    except (ManifestError, StorageError) as exc:
        return [f"{name}: {exc}"]
    problems = _problems_against(manifest, {o.key.partition("/")[2]: o for o in storage.list(f"{name}/")}, name)
    if problems:
        return problems
    with tempfile.TemporaryDirectory(prefix="spotguard-verify-") as scratch:
        for rel, entry in sorted(manifest.files.items()):
            local = Path(scratch) / "f"
            storage.get_file(f"{name}/{rel}", local)
            if (actual := crc32c_of_file(local)) != entry.crc32c:
                problems.append(f"{name}/{rel}: crc32c {actual}, manifest says {entry.crc32c}")
            if progress:
                progress(entry.size)
            local.unlink()
    return problems


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
    progress: Progress | None = None,
) -> None:
    """Upload data files of a checkpoint in parallel (never its manifest).

    Restart-safe: a file already in the bucket with the same size (and checksum, where the store
    reports it) is not sent again. ``deadline`` is a ``time.monotonic()`` value bounding retries.
    """
    name = step_dir.name
    existing = {o.key.partition("/")[2]: o for o in storage.list(f"{name}/")}

    def send(rel: str) -> None:
        entry = files[rel]
        have = existing.get(rel)
        if have and have.size == entry.size and have.crc32c in (None, entry.crc32c):
            if progress:
                progress(entry.size)
            return
        if cancel is not None and cancel.is_set():
            raise UploadCancelled(f"{name}: upload cancelled")
        retry(
            lambda: storage.put_file(step_dir / rel, f"{name}/{rel}", crc32c=entry.crc32c),
            is_transient=storage.is_transient,
            deadline=deadline,
            what=f"uploading {name}/{rel}",
        )
        if progress:
            progress(entry.size)

    # Largest first: the long transfers start early and small files fill the gaps.
    order = sorted(files, key=lambda rel: -files[rel].size)
    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(order) or 1))) as pool:
        for future in [pool.submit(send, rel) for rel in order]:
            future.result()


def commit_remote(storage: Storage, step_dir: Path, *, deadline: float | None = None) -> None:
    """Upload the manifest: only now does the checkpoint exist in the bucket."""
    manifest_crc = crc32c_of_file(step_dir / MANIFEST)
    retry(
        lambda: storage.put_file(step_dir / MANIFEST, f"{step_dir.name}/{MANIFEST}", crc32c=manifest_crc),
        is_transient=storage.is_transient,
        deadline=deadline,
        what=f"committing {step_dir.name}",
    )


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
            raise StorageError(
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
    progress: Progress | None = None,
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
    concurrency: int = 8,
    progress: Progress | None = None,
    log: Callable[[str], None] | None = None,
) -> Path | None:
    """Download the newest complete checkpoint (or ``step``) into ``dest_root``, verified.

    Falls back to the previous complete checkpoint when the newest fails verification (unless a
    step was asked for). The local copy is committed the same way as a local save: data files,
    then the manifest. Returns the local step directory, or None if the bucket has none.
    """
    candidates = [info for info in list_remote(storage) if info.status == "complete"]
    if step is not None:
        candidates = [info for info in candidates if info.step == step]
        if not candidates:
            raise StorageError(f"{storage.url}: no complete checkpoint at step {step}")
    for info in reversed(candidates):
        target = dest_root / info.name
        try:
            if _already_restored(target):
                return target
            _download(storage, info, target, concurrency=concurrency, progress=progress)
            return target
        except (StorageError, ManifestError, OSError) as exc:
            shutil.rmtree(target, ignore_errors=True)
            if step is not None:
                raise
            if log:
                log(f"{info.name} failed verification ({exc}); trying the previous checkpoint")
    return None


def _already_restored(step_dir: Path) -> bool:
    return step_dir.is_dir() and not verify_dir(step_dir)


def _download(
    storage: Storage, info: CheckpointInfo, target: Path, *, concurrency: int, progress: Progress | None
) -> None:
    manifest = read_remote_manifest(storage, info.name)
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)

    def fetch(rel: str) -> None:
        local = target / rel
        retry(
            lambda: storage.get_file(f"{info.name}/{rel}", local),
            is_transient=storage.is_transient,
            what=f"downloading {info.name}/{rel}",
        )
        entry = manifest.files[rel]
        if local.stat().st_size != entry.size or crc32c_of_file(local) != entry.crc32c:
            raise ManifestError(f"{info.name}/{rel}: downloaded bytes do not match the manifest")
        if progress:
            progress(entry.size)

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        for future in [pool.submit(fetch, rel) for rel in manifest.files]:
            future.result()
    for sub in {(target / rel).parent for rel in manifest.files}:
        fsync_dir(sub)
    # Written last, as in a local save: the local copy counts only once everything verified.
    storage.get_file(f"{info.name}/{MANIFEST}", target / MANIFEST)
    fsync_dir(target)
    load_manifest(target)


def prune_remote(storage: Storage, keep: int, *, protected: frozenset[str] = frozenset()) -> list[str]:
    """Keep the newest ``keep`` complete checkpoints; delete older complete ones and incomplete ones
    older than the newest complete one (leftovers no uploader will finish). Never touches the newest
    complete checkpoint or any name in ``protected`` (uploads in flight). Manifests go first, so a
    half-deleted checkpoint is never mistaken for a complete one."""
    infos = list_remote(storage)
    complete = [info for info in infos if info.status == "complete"]
    if not complete:
        return []
    newest = complete[-1]
    doomed = [info for info in complete[: -max(keep, 1)]]
    doomed += [info for info in infos if info.status == "incomplete" and info.step < newest.step]
    doomed = [info for info in doomed if info.name not in protected and info.name != newest.name]
    groups = _group_by_checkpoint(storage.list())
    for info in doomed:
        keys = list(groups.get(info.name, {}))
        if MANIFEST in keys:
            storage.delete([f"{info.name}/{MANIFEST}"])
        storage.delete(f"{info.name}/{rel}" for rel in keys if rel != MANIFEST)
    return [info.name for info in doomed]


class Throughput:
    """Bytes/second over the transfer so far, for status and deadline estimates."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.started = clock()
        self.bytes = 0

    def add(self, count: int) -> None:
        with self._lock:
            self.bytes += count

    def rate(self) -> float | None:
        elapsed = self._clock() - self.started
        return self.bytes / elapsed if elapsed > 0.05 and self.bytes else None
