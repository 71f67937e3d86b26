"""The checkpoint layout and ``manifest.json``, the commit marker: names, the model, reading and checking.

::

    <root>/step-000001234/     a fresh directory per checkpoint, never overwritten
        manifest.json          written last: the commit marker
        <data files>

A directory without a valid manifest, or whose files do not match it, is incomplete and never loaded.
Writing lives in :mod:`spotguard.localstore`, durable files in :mod:`spotguard.safefile`, checksums in
:mod:`spotguard.crc32c`.
"""

from __future__ import annotations

import json
import logging
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from spotguard.crc32c import crc32c_of_files
from spotguard.errors import SpotguardError
from spotguard.jsontext import parse_json
from spotguard.safefile import atomic_file, fsync_dir, is_temporary, read_nofollow
from spotguard.version import __version__

FORMAT_VERSION = 1

FORMAT = f"spotguard/{FORMAT_VERSION}"

_FORMAT_NAME = re.compile(r"spotguard/([0-9]{1,9})")  # fullmatch: ASCII digits, a number int() takes

MANIFEST = "manifest.json"

REASONS = ("urgent", "periodic", "soft", "final")

STEP_WIDTH = 9  # digits of a step directory's name: step-000001234

MAX_STEP = 10**STEP_WIDTH - 1

# Exactly "step-" and STEP_WIDTH ASCII digits: no other digits (int() takes Arabic-Indic ones), no
# trailing newline ($ would allow one), no longer or shorter names. Used with fullmatch only.
_STEP_DIR = re.compile(rf"step-([0-9]{{{STEP_WIDTH}}})", re.ASCII)

# Names that look like a step directory but are not one, reported once each (bounded).
_REPORTED: set[str] = set()
_REPORT_AT_MOST = 1000

Status = Literal["complete", "incomplete"]

logger = logging.getLogger("spotguard.manifest")


class ManifestError(SpotguardError, ValueError):
    """A manifest that is missing, malformed, or does not match the files beside it."""


class ManifestFormatError(ManifestError):
    """A manifest written by a newer checkpoint format than this spotguard reads."""

    def __init__(self, found: str) -> None:
        super().__init__(
            f"checkpoint format {found!r} is newer than this spotguard ({__version__}) reads ({FORMAT!r}); "
            f"install a spotguard release that reads {found!r} to load it"
        )
        self.found = found


def step_dir_name(step: int) -> str:
    """The one name of step ``step``'s directory (0 <= step <= :data:`MAX_STEP`)."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        shown = f"{step!r}"[:40] if isinstance(step, int) and abs(step) < 10**40 else type(step).__name__
        raise ValueError(f"step must be an integer in 0..{MAX_STEP}, got {shown}")
    return f"step-{step:0{STEP_WIDTH}d}"


def parse_step_dir(name: str) -> int | None:
    """The step of the directory ``name`` if it is one, by the one rule every reader uses (local
    store, peer receiver and fetch, bucket listings, restore, verify); None for anything else. A name
    that starts like one but is not (``step-5``, ``step-000000005\\n``, other digits) is logged once
    and never parsed."""
    if not isinstance(name, str):
        return None
    match = _STEP_DIR.fullmatch(name)
    if match is not None:
        return int(match.group(1))
    if name.startswith("step") and name not in _REPORTED and len(_REPORTED) < _REPORT_AT_MOST:
        _REPORTED.add(name)
        logger.warning("ignoring %.80r: not a checkpoint name (step- and %d digits 0-9)", name, STEP_WIDTH)
    return None


# An object key's bound in S3 and GCS alike, in bytes of UTF-8.
MAX_KEY_BYTES = 1024
# A file's bucket key is <prefix>step-NNNNNNNNN/<name>: the name's bound with no prefix.
MAX_NAME_BYTES = MAX_KEY_BYTES - len("step-/") - STEP_WIDTH
MAX_SEGMENT_BYTES = 255  # a file or directory name, as the filesystems take it
# Directories a name goes through, the file included. Checkpoints are shallow (DCP, Lightning and
# Hugging Face write one or two levels); the bound keeps a peer from making a directory per byte sent.
MAX_NAME_DEPTH = 32


# A name's characters that no segment may hold: C0 and C1 controls, DEL, and the backslash (a
# separator elsewhere). One search of the whole name: the check runs once per file of every manifest
# read (100,000 files for a large sharded state), where a look at each character in Python cost most
# of a manifest's parse.
_NOT_IN_NAMES = re.compile(r"[\x00-\x1f\x7f-\x9f\\]")
_NOT_SEGMENTS = frozenset(("", ".", ".."))


def _shown(relpath: str) -> str:
    return f"{relpath[:80]!r}" + (f" ({len(relpath)} characters)" if len(relpath) > 80 else "")


def check_relpath(relpath: str) -> str:
    """A file name inside a checkpoint, in its one canonical form: a relative POSIX path of plain
    segments (none empty, ``.``, ``..`` or holding a control character), no backslash, no leading
    ``/``, text that encodes as UTF-8 (no lone surrogate), at most :data:`MAX_NAME_BYTES` bytes in at
    most :data:`MAX_NAME_DEPTH` segments of at most :data:`MAX_SEGMENT_BYTES` bytes: a name every
    filesystem and bucket takes. Anything else (``./manifest.json``, ``a//b``, ``a/../b``) raises
    :class:`ManifestError`: a name is never rewritten into another one. Returns ``relpath``."""
    if not isinstance(relpath, str):
        raise ManifestError(f"file name {relpath!r} is not text")
    try:
        encoded = relpath.encode("utf-8")
    except UnicodeEncodeError:
        raise ManifestError(
            f"file name {_shown(relpath)} is not valid UTF-8 (a lone surrogate): no bucket takes it"
        ) from None
    segments = encoded.split(b"/")
    if len(encoded) > MAX_NAME_BYTES or len(segments) > MAX_NAME_DEPTH:
        raise ManifestError(
            f"file name {_shown(relpath)} is too long: at most {MAX_NAME_BYTES} bytes in {MAX_NAME_DEPTH} segments"
        )
    if len(encoded) > MAX_SEGMENT_BYTES and any(len(segment) > MAX_SEGMENT_BYTES for segment in segments):
        raise ManifestError(f"file name {_shown(relpath)} has a segment over {MAX_SEGMENT_BYTES} bytes")
    # Segments none empty, "." or "..": the name is its own normal form (a leading "/" or a "//"
    # makes an empty one), so it is never rewritten into another by a path library.
    if _NOT_IN_NAMES.search(relpath) or not _NOT_SEGMENTS.isdisjoint(relpath.split("/")) or relpath == MANIFEST:
        raise ManifestError(f"file name {_shown(relpath)} is not a plain relative path inside the checkpoint")
    if is_temporary(relpath.rpartition("/")[2]):
        raise ManifestError(f"file name {_shown(relpath)} looks like a temporary file")
    return relpath


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
            document = parse_json(data)
        except ValueError as exc:
            raise ManifestError(f"manifest is not JSON: {exc}") from None
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            found = document.get("format") if isinstance(document, dict) else None
            match = _FORMAT_NAME.fullmatch(found) if isinstance(found, str) else None
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
        document = parse_json(data)
    except ValueError:
        return None
    if isinstance(document, dict) and "format" in document and document["format"] != FORMAT:
        return str(document["format"])
    return None


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a non-negative integer")
    return value


_CRC_HEX = re.compile(r"[0-9a-f]{8}")


def _crc(value: Any) -> str:
    if not isinstance(value, str) or not _CRC_HEX.fullmatch(value):
        raise ValueError(f"{value!r} is not 8 lowercase hex digits")
    return value


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
    """This node's committed share of a multi-node checkpoint, if its marker is valid and its files present
    (None for a directory removed meanwhile: a trainer's or the daemon's retention prunes while others scan)."""
    try:
        markers = list(step_dir.glob(f"{PART_PREFIX}*.json"))
    except FileNotFoundError:
        return None
    for marker in markers:
        try:
            document = parse_json(read_nofollow(marker))
            files = {
                check_relpath(name): FileEntry(size=_int(entry["size"]), crc32c=_crc(entry["crc32c"]))
                for name, entry in document["files"].items()
            }
        except (OSError, ValueError, KeyError, TypeError, AttributeError, ManifestError):
            continue
        if all(_regular_file_size(step_dir / name) == e.size for name, e in files.items()):
            return files
    return None


def _regular_file_size(path: Path) -> int | None:
    """``path``'s size if it is a regular file, None if it is not (or no longer) one."""
    try:
        info = path.stat()
    except OSError:
        return None
    return info.st_size if stat.S_ISREG(info.st_mode) else None


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
        return foreign_format(read_nofollow(step_dir / MANIFEST))
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

    @property
    def held(self) -> bool:
        """Committed on this disk: a complete checkpoint, or (a multi-node job's node other than 0) this
        node's committed share. Local retention and the room kept for the next save count both: a
        node holding only shares would otherwise keep every one it ever wrote."""
        return self.status == "complete" or self.node_files is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "step": self.step,
            "bytes": self.bytes,
            "created": self.created,
            "status": self.status,
            "contents": self.manifest.contents if self.manifest is not None else None,
        }
