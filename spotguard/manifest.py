"""Checkpoint layout, ``manifest.json``, CRC32C and the atomic commit. Both sides import it.

::

    <root>/step-000001234/     a fresh directory per checkpoint, never overwritten
        manifest.json          written last: the commit marker
        <data files>

Every data file is written under a temporary name (``.<name>.tmp-<pid>``),
fsynced and renamed, so a finished file can be uploaded while the rest are
still being written. The manifest goes last the same way, then the directory is
fsynced: the manifest *is* the commit. A directory without a valid manifest, or
whose files do not match it, is incomplete and never loaded.

Within one file the order of the bytes is free: the trainer's state files
(``spotguard.trainer.writer``) are written skeleton first (every zip record of
``torch.save`` with holes where the tensors' bytes go), then the holes are
filled by several threads with ``pwrite``, in any order; only the fsync, the
rename and the manifest are ordered. The files are standard ``torch.save``
archives either way.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import logging
import os
import re
import shutil
import stat
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import IO, Any, Literal

import google_crc32c

FORMAT_VERSION = 1
FORMAT = f"spotguard/{FORMAT_VERSION}"
_FORMAT_NAME = re.compile(r"^spotguard/(\d+)$")
MANIFEST = "manifest.json"
REASONS = ("urgent", "periodic", "soft", "final")
_STEP_DIR = re.compile(r"^step-(\d{9,})$")
_TMP_MARK = ".tmp-"  # in the names of files being written (atomic_file)
_CHUNK = 8 * 1024 * 1024
_RANGE = 64 * 1024 * 1024  # what one thread reads of a file being checked in parallel

Status = Literal["complete", "incomplete"]

logger = logging.getLogger("spotguard.manifest")


class ManifestError(ValueError):
    """A manifest that is missing, malformed, or does not match the files beside it."""


class ManifestFormatError(ManifestError):
    """A manifest written by a newer checkpoint format than this spotguard reads."""

    def __init__(self, found: str) -> None:
        from spotguard import __version__

        super().__init__(
            f"checkpoint format {found!r} is newer than this spotguard ({__version__}) reads ({FORMAT!r}); "
            f"install a spotguard release that reads {found!r} to load it"
        )
        self.found = found


class SaveCancelled(Exception):
    """A save was abandoned half-way (an urgent save pre-empts a periodic one); nothing was committed."""


class CheckpointExists(FileExistsError):
    """The step directory already holds a complete checkpoint; checkpoints are never overwritten."""


class SymlinkRefused(OSError):
    """A file in a checkpoint is a symbolic link: the daemon reads step directories that a trainer
    writes, and must not be led by one to read (and upload) a file the trainer could not."""


def is_unlinked(fd: int) -> bool:
    """Whether the file open at ``fd`` has no name left on disk (its writer removed it)."""
    try:
        return os.fstat(fd).st_nlink == 0
    except OSError:
        return True


def open_nofollow(path: Path) -> int:
    """A read-only descriptor for ``path``, refusing a symlink as its last component (race-free:
    ``O_NOFOLLOW`` is checked by the same call that opens)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SymlinkRefused(
                errno.ELOOP, "a symlink in a checkpoint directory; refusing to read it", str(path)
            ) from None
        raise


# --- names and checksums --------------------------------------------------------------------


def step_dir_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:09d}"


def parse_step_dir(name: str) -> int | None:
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def read_nofollow(path: Path) -> bytes:
    with open(open_nofollow(path), "rb") as handle:
        return handle.read()


def crc32c_hex(value: int) -> str:
    return f"{value:08x}"


def crc32c_of_file(path: Path) -> str:
    checksum = google_crc32c.Checksum()
    with open(open_nofollow(path), "rb") as handle:
        while chunk := handle.read(_CHUNK):
            checksum.update(chunk)
    return checksum.digest().hex()


def crc32c_of_bytes(data: bytes) -> str:
    return crc32c_hex(google_crc32c.value(data))


def hex_to_base64(crc_hex: str) -> str:
    """The form S3 (``x-amz-checksum-crc32c``) and GCS (``crc32c``) use: base64 of 4 big-endian bytes."""
    return base64.b64encode(bytes.fromhex(crc_hex)).decode()


def base64_to_hex(crc_b64: str) -> str:
    return base64.b64decode(crc_b64).hex()


def crc32c_hex_to_int(crc_hex: str) -> int:
    try:
        value = int(crc_hex, 16)
    except ValueError:
        raise ValueError(f"crc32c must be 8 hex characters, got {crc_hex!r}") from None
    if len(crc_hex) != 8 or value >> 32:
        raise ValueError(f"crc32c must be 8 hex characters, got {crc_hex!r}")
    return value


def crc32c_int_to_base64(value: int) -> str:
    return base64.b64encode(value.to_bytes(4, "big")).decode("ascii")


_CRC32C_POLY = 0x82F63B78  # reflected Castagnoli polynomial


def _multmodp(a: int, b: int) -> int:
    """a*b modulo the CRC polynomial (zlib's multmodp, Castagnoli polynomial)."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ _CRC32C_POLY if b & 1 else b >> 1
    return p


def _build_x2n_table() -> list[int]:
    table = [1 << 30]  # x^1
    for _ in range(31):
        table.append(_multmodp(table[-1], table[-1]))
    return table


_X2N = _build_x2n_table()


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of ``A + B`` from ``crc(A)``, ``crc(B)`` and ``len(B)``, without the data (zlib's
    crc32_combine): multipart uploads and ranged downloads check whole files from their parts."""
    p = 1 << 31  # x^0
    n, k = len2, 3  # x^(8 * len2): one factor per bit of the byte count
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


def check_relpath(relpath: str) -> str:
    """A manifest key must stay inside its checkpoint directory."""
    path = PurePosixPath(relpath)
    if not relpath or path.is_absolute() or ".." in path.parts or "\\" in relpath or relpath == MANIFEST:
        raise ManifestError(f"file name {relpath!r} is not a plain relative path inside the checkpoint")
    if _TMP_MARK in path.name:
        raise ManifestError(f"file name {relpath!r} looks like a temporary file")
    return relpath


# --- the manifest ---------------------------------------------------------------------------


@dataclass(frozen=True)
class FileEntry:
    size: int
    crc32c: str  # 8 lowercase hex digits of the big-endian CRC32C


@dataclass(frozen=True)
class Manifest:
    step: int
    reason: str
    world_size: int
    files: Mapping[str, FileEntry]
    created: str = field(default_factory=lambda: datetime.now(UTC).isoformat())
    meta: Mapping[str, Any] = field(default_factory=dict)
    # What each state entry holds (keys, shapes, dtypes, optimizer layout, versions): checked before a
    # resume loads anything. None in checkpoints written before it was recorded.
    contents: Mapping[str, Any] | None = None

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files.values())

    def to_json(self) -> bytes:
        document = {
            "format": FORMAT,
            "step": self.step,
            "created": self.created,
            "reason": self.reason,
            "world_size": self.world_size,
            "files": {name: {"size": e.size, "crc32c": e.crc32c} for name, e in sorted(self.files.items())},
            "meta": dict(self.meta),
        }
        if self.contents is not None:
            # Tensors are described as "float32[16,8]": one line per key, however big the model.
            document["contents"] = dict(self.contents)
        return json.dumps(document, indent=1, sort_keys=False).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        try:
            document = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError(f"manifest is not JSON: {exc}") from None
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            found = document.get("format") if isinstance(document, dict) else None
            match = _FORMAT_NAME.match(found) if isinstance(found, str) else None
            if isinstance(found, str) and match and int(match.group(1)) > FORMAT_VERSION:
                raise ManifestFormatError(found)
            raise ManifestError(f"manifest format is not {FORMAT!r}")
        contents = document.get("contents")
        if contents is not None and not isinstance(contents, dict):
            raise ManifestError("manifest is malformed: 'contents' is not an object")
        try:
            files = {
                check_relpath(name): FileEntry(size=_int(entry["size"]), crc32c=_crc(entry["crc32c"]))
                for name, entry in document["files"].items()
            }
            return cls(
                step=_int(document["step"]),
                reason=str(document["reason"]),
                world_size=_int(document["world_size"]),
                files=files,
                created=str(document["created"]),
                meta=dict(document.get("meta") or {}),
                contents=contents,
            )
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ManifestError(f"manifest is malformed: {exc!r}") from None


def foreign_format(data: bytes) -> str | None:
    """The ``format`` of a manifest that another (newer) spotguard wrote, or None when the
    manifest is ours or no manifest at all. Such a checkpoint may well be complete: it is never
    deleted nor overwritten here, only skipped."""
    try:
        document = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if isinstance(document, dict) and "format" in document and document["format"] != FORMAT:
        return str(document["format"])
    return None


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a non-negative integer")
    return value


def _crc(value: Any) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"[0-9a-f]{8}", value):
        raise ValueError(f"{value!r} is not 8 lowercase hex digits")
    return value


# --- durable writes -------------------------------------------------------------------------


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _ChecksummingWriter:
    """A write-only file wrapper that computes size and CRC32C as bytes go by (no second read)."""

    def __init__(self, raw: IO[bytes], cancel: threading.Event | None = None) -> None:
        self._raw = raw
        self._cancel = cancel
        self._crc = google_crc32c.Checksum()
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        if self._cancel is not None and self._cancel.is_set():
            raise SaveCancelled("save cancelled")
        view = memoryview(data).cast("B")
        written = self._raw.write(view)
        # google-crc32c's C extension accepts only bytes, so feed it bounded copies (memcpy speed).
        for start in range(0, len(view), _CHUNK):
            self._crc.update(bytes(view[start : start + _CHUNK]))
        self.size += len(view)
        return written if written is not None else len(view)

    def flush(self) -> None:
        self._raw.flush()

    def writable(self) -> bool:
        return True

    @property
    def crc32c(self) -> str:
        return self._crc.digest().hex()


def tmp_path_for(path: Path) -> Path:
    """Where ``path`` is written before its rename: beside it, hidden, with the temporary mark."""
    return path.with_name(f".{path.name}{_TMP_MARK}{os.getpid()}")


@contextlib.contextmanager
def atomic_file(path: Path, cancel: threading.Event | None = None) -> Iterator[_ChecksummingWriter]:
    """Write ``path`` durably: temp name, fsync, rename. On error (or ``cancel``) the temp file is removed."""
    tmp = tmp_path_for(path)
    try:
        with tmp.open("wb", buffering=_CHUNK) as raw:
            writer = _ChecksummingWriter(raw, cancel)
            yield writer
            raw.flush()
            os.fsync(raw.fileno())
        tmp.rename(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class CheckpointWriter:
    """Writes one checkpoint directory and commits it with its manifest.

    >>> writer = CheckpointWriter(root, step=100, reason="urgent")
    >>> with writer.create("model.pt") as out:
    ...     torch.save(model.state_dict(), out)
    >>> manifest = writer.commit()
    """

    def __init__(
        self,
        root: Path,
        step: int,
        *,
        reason: str,
        world_size: int = 1,
        meta: Mapping[str, Any] | None = None,
        cancel: threading.Event | None = None,
        contents: Mapping[str, Any] | None = None,
    ) -> None:
        if reason not in REASONS:
            raise ValueError(f"reason must be one of {REASONS}, got {reason!r}")
        self.root = root
        self.step = step
        self.reason = reason
        self.world_size = world_size
        self.meta = dict(meta or {})
        self.contents = dict(contents) if contents is not None else None
        self.dir = root / step_dir_name(step)
        self.files: dict[str, FileEntry] = {}
        self.cancel = cancel

    def prepare(self) -> None:
        """Create the step directory; clear a leftover of a killed writer at the same step."""
        if load_manifest_or_none(self.dir) is not None:
            raise CheckpointExists(f"{self.dir} is already a complete checkpoint")
        if (found := local_foreign_format(self.dir)) is not None:
            raise CheckpointExists(f"{self.dir} holds a checkpoint of format {found!r} (a newer spotguard's)")
        if self.dir.exists():
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True)
        fsync_dir(self.root)

    def target(self, relpath: str) -> Path:
        """Where ``relpath`` goes in the step directory (its parent made); the name is checked."""
        target = self.dir / check_relpath(relpath)
        target.parent.mkdir(parents=True, exist_ok=True)
        return target

    @contextlib.contextmanager
    def create(self, relpath: str) -> Iterator[_ChecksummingWriter]:
        target = self.target(relpath)
        with atomic_file(target, self.cancel) as writer:
            yield writer
        self.files[relpath] = FileEntry(size=writer.size, crc32c=writer.crc32c)

    def write_bytes(self, relpath: str, data: bytes) -> FileEntry:
        with self.create(relpath) as out:
            out.write(data)
        return self.files[relpath]

    def add_existing(self, relpath: str) -> FileEntry:
        """Record a file someone else wrote into the directory (another rank, DCP)."""
        path = self.dir / check_relpath(relpath)
        entry = FileEntry(size=path.stat().st_size, crc32c=crc32c_of_file(path))
        self.files[relpath] = entry
        return entry

    def commit(self) -> Manifest:
        if self.cancel is not None and self.cancel.is_set():
            raise SaveCancelled(f"{self.dir.name}: cancelled before its commit")
        manifest = Manifest(
            step=self.step,
            reason=self.reason,
            world_size=self.world_size,
            files=dict(self.files),
            meta=self.meta,
            contents=self.contents,
        )
        for sub in {(self.dir / name).parent for name in self.files}:
            fsync_dir(sub)
        with atomic_file(self.dir / MANIFEST) as out:
            out.write(manifest.to_json())
        fsync_dir(self.dir)
        return manifest


# --- node parts (multi-node jobs) ------------------------------------------------------------
#
# With one local disk per VM, no VM holds a whole checkpoint. Each node's leader commits its own
# share locally with ``part-<node>.json`` (written last, like a manifest); its daemon uploads those
# files. The global ``manifest.json`` (on node 0) lists every node's files and is uploaded only once
# all of them are in the bucket. A step directory with a part marker but no complete manifest is a
# *node commit*: never loaded locally, but kept until it is safe in the bucket.

PART_PREFIX = "part-"


def part_name(node: int) -> str:
    return f"{PART_PREFIX}{node}.json"


def write_part(step_dir: Path, node: int, nodes: int, files: Mapping[str, FileEntry]) -> None:
    document = {
        "format": FORMAT,
        "node": node,
        "nodes": nodes,
        "files": {name: {"size": e.size, "crc32c": e.crc32c} for name, e in sorted(files.items())},
    }
    with atomic_file(step_dir / part_name(node)) as out:
        out.write(json.dumps(document, indent=1).encode())
    fsync_dir(step_dir)


def load_part(step_dir: Path) -> dict[str, FileEntry] | None:
    """This node's committed share of a multi-node checkpoint, if its marker is valid and its files present."""
    for marker in step_dir.glob(f"{PART_PREFIX}*.json"):
        try:
            document = json.loads(read_nofollow(marker))
            files = {
                check_relpath(name): FileEntry(size=_int(entry["size"]), crc32c=_crc(entry["crc32c"]))
                for name, entry in document["files"].items()
            }
        except (OSError, ValueError, KeyError, TypeError, AttributeError, ManifestError):
            continue
        if all((step_dir / name).is_file() and (step_dir / name).stat().st_size == e.size for name, e in files.items()):
            return files
    return None


# --- reading and checking -------------------------------------------------------------------


def load_manifest(step_dir: Path) -> Manifest:
    try:
        data = read_nofollow(step_dir / MANIFEST)
    except FileNotFoundError:
        raise ManifestError(f"{step_dir.name}: no {MANIFEST} (never committed)") from None
    manifest = Manifest.from_json(data)
    if parse_step_dir(step_dir.name) != manifest.step:
        raise ManifestError(f"{step_dir.name}: manifest says step {manifest.step}")
    return manifest


def local_foreign_format(step_dir: Path) -> str | None:
    """:func:`foreign_format` of the manifest in ``step_dir``, if it has one."""
    try:
        return foreign_format((step_dir / MANIFEST).read_bytes())
    except OSError:
        return None


def load_manifest_or_none(step_dir: Path) -> Manifest | None:
    try:
        return load_manifest(step_dir)
    except (ManifestError, OSError):
        return None


def node_holdings(step_dir: Path) -> tuple[Manifest | None, dict[str, FileEntry] | None]:
    """What this disk holds of a committed checkpoint: its manifest (None if none), and this node's
    share of it (None unless the manifest's files are not all here: a multi-node job's node, whose
    manifest, on node 0 only, lists every node's files)."""
    manifest = load_manifest_or_none(step_dir)
    share = None if manifest is not None and not verify_dir(step_dir, checksums=False) else load_part(step_dir)
    return manifest, share


def crc32c_of_range(path: Path, start: int, length: int) -> int:
    """CRC32C of ``length`` bytes of ``path`` from ``start`` (positional reads: threads share nothing)."""
    checksum = google_crc32c.Checksum()
    fd = open_nofollow(path)
    try:
        end = start + length
        while start < end:
            chunk = os.pread(fd, min(_CHUNK, end - start), start)
            if not chunk:
                raise OSError(errno.EIO, f"{path}: ends at {start}, before {end}")
            checksum.update(chunk)
            start += len(chunk)
    finally:
        os.close(fd)
    return int.from_bytes(checksum.digest(), "big")


def crc32c_of_files(paths: Sequence[Path], threads: int = 1, *, range_bytes: int = _RANGE) -> list[str]:
    """CRC32C of each file, in the order given, read by ``threads`` threads at once.

    A file of more than one range (``range_bytes``, 64 MiB) is read in ranges whose checksums combine into the file's,
    so that one large file is read in parallel too: each range is read start to end, which keeps the
    kernel's readahead for it. On a local disk the reads wait on the device (more in flight give more
    bandwidth) and the checksum runs at several GB/s, so threads pay off even on few cores.
    """
    if threads <= 1:
        return [crc32c_of_file(path) for path in paths]
    sizes = [path.stat().st_size for path in paths]
    ranges = [
        (index, start, min(range_bytes, size - start))
        for index, size in enumerate(sizes)
        for start in range(0, size, range_bytes)
    ]
    with ThreadPoolExecutor(min(threads, max(1, len(ranges)))) as pool:
        checksums = list(pool.map(lambda job: crc32c_of_range(paths[job[0]], job[1], job[2]), ranges))
    crcs = [0] * len(paths)  # an empty file has no range; its CRC32C is 0
    for (index, _, length), crc in zip(ranges, checksums, strict=True):
        crcs[index] = crc32c_combine(crcs[index], crc, length)
    return [crc32c_hex(crc) for crc in crcs]


def verify_dir(step_dir: Path, *, checksums: bool = True, threads: int = 1) -> list[str]:
    """Problems with a local checkpoint (empty: complete and matching its manifest).

    ``threads``: how many threads read the files to check their CRC32C (see :func:`crc32c_of_files`).
    """
    try:
        manifest = load_manifest(step_dir)
    except (ManifestError, OSError) as exc:
        return [str(exc)]
    problems: dict[str, str] = {}
    to_check: dict[str, Path] = {}
    for name, entry in sorted(manifest.files.items()):
        path = step_dir / name
        try:
            info = path.lstat()
        except OSError:
            problems[name] = f"{step_dir.name}/{name}: missing"
            continue
        if not stat.S_ISREG(info.st_mode) or not path.resolve().is_relative_to(step_dir.resolve()):
            problems[name] = f"{step_dir.name}/{name}: not a regular file inside the checkpoint (a symlink?)"
            continue
        size = info.st_size
        if size != entry.size:
            problems[name] = f"{step_dir.name}/{name}: size {size}, manifest says {entry.size}"
        elif checksums:
            to_check[name] = path
    if to_check:
        actual = dict(zip(to_check, crc32c_of_files(list(to_check.values()), threads), strict=True))
        for name, crc in actual.items():
            if crc != manifest.files[name].crc32c:
                problems[name] = f"{step_dir.name}/{name}: crc32c {crc}, manifest says {manifest.files[name].crc32c}"
    return [problems[name] for name in sorted(problems)]


@dataclass(frozen=True)
class CheckpointInfo:
    name: str
    step: int
    status: Status
    bytes: int
    created: str | None
    manifest: Manifest | None = field(default=None, compare=False, repr=False)
    node_files: Mapping[str, FileEntry] | None = field(default=None, compare=False, repr=False)  # a node commit
    foreign_format: str | None = field(default=None, compare=False, repr=False)  # a newer spotguard's manifest

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "step": self.step,
            "bytes": self.bytes,
            "created": self.created,
            "status": self.status,
            "contents": self.manifest.contents if self.manifest is not None else None,
        }


def scan_local(root: Path) -> list[CheckpointInfo]:
    """Every step directory under ``root``, oldest first. Complete means: manifest valid, files present
    with the right sizes (checksums are ``verify``'s job)."""
    infos = []
    try:
        entries = list(root.iterdir())
    except FileNotFoundError:
        return []
    for entry in entries:
        step = parse_step_dir(entry.name)
        if step is None or not entry.is_dir():
            continue
        manifest = load_manifest_or_none(entry)
        if manifest is not None and not verify_dir(entry, checksums=False):
            infos.append(CheckpointInfo(entry.name, step, "complete", manifest.total_bytes, manifest.created, manifest))
        else:
            try:
                size = sum(p.stat().st_size for p in entry.rglob("*") if p.is_file())
            except FileNotFoundError:
                continue  # removed while we looked (the daemon's retention, another rank's clean-up)
            foreign = local_foreign_format(entry) if manifest is None else None
            infos.append(
                CheckpointInfo(entry.name, step, "incomplete", size, None, manifest, load_part(entry), foreign)
            )
    return sorted(infos, key=lambda info: info.step)


def remove_incomplete(root: Path, *, except_names: frozenset[str] = frozenset()) -> list[str]:
    """Remove leftovers of killed writers (step directories with no valid manifest and no node commit).
    A checkpoint whose manifest is of a format this version does not know is left alone."""
    removed = []
    for info in scan_local(root):
        if info.foreign_format is not None:
            logger.warning(
                "%s: manifest format %r is not %r (a newer spotguard's?); not touching it",
                root / info.name, info.foreign_format, FORMAT,
            )  # fmt: skip
            continue
        if info.status == "incomplete" and info.node_files is None and info.name not in except_names:
            shutil.rmtree(root / info.name, ignore_errors=True)
            removed.append(info.name)
    return removed


def prune_local(root: Path, keep: int, *, protected: frozenset[str] = frozenset()) -> list[str]:
    """Keep the newest ``keep`` complete checkpoints (and every name in ``protected``); delete older
    complete ones. Incomplete directories are left alone: a writer may be filling one."""
    complete = [info for info in scan_local(root) if info.status == "complete" or info.node_files is not None]
    doomed = [info.name for info in complete[:-keep] if info.name not in protected] if keep > 0 else []
    for name in doomed:
        shutil.rmtree(root / name, ignore_errors=True)
    return doomed
