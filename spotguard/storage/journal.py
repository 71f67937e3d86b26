"""The daemon's record of the multipart uploads it opened, so that a restarted daemon aborts exactly its
predecessor's unfinished ones instead of guessing from clocks.

A store lists when an upload began only to the second (S3's ``Initiated``), and other nodes of a job
share the prefix and may be uploading right now: a sweep by age must spare young uploads, and so spared
the upload of a daemon killed a moment before its restart, for good. The journal knows instead.

One file per bucket URL and checkpoint root in the daemon's state directory (two jobs on one host never
abort each other's uploads), of JSON lines::

    {"open": "<upload id>", "key": "<object key>"}     appended and fsynced before the first part is sent
    {"done": "<upload id>"}                            appended once it is completed or aborted

At start the daemon aborts every upload opened and not done, then rewrites the file empty. A daemon
runs for months, two lines per file uploaded: once the file has grown past :data:`COMPACT_AT`, the
next ``done`` rewrites it with only the uploads still open instead of taking a line. A torn last
line (a kill mid-append) is ignored: its upload is at most one whose id never reached the disk, which
the sweep by age still removes.

The state directory is on the root disk, which a VM running for months fills (or remounts read-only
after an I/O error). While it cannot be written, lines go to a spare file (the daemon's runtime
directory, in memory: it outlives a restart of the daemon, not a reboot); a start reads both, and a
rewrite that takes in the state directory removes the spare.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from spotguard.jsontext import parse_json
from spotguard.safefile import SpareFile, fsync_dir, replace_file

logger = logging.getLogger("spotguard.storage")

COMPACT_AT = 64 * 1024  # bytes of journal worth rewriting (some 400 uploads): one rewrite per so many


@dataclass(frozen=True)
class OpenUpload:
    key: str
    upload_id: str


class UploadJournal:
    """Append-only record of this daemon's open multipart uploads (thread-safe: uploads run in threads)."""

    def __init__(self, path: Path, spare: Path | None = None) -> None:
        self.file = SpareFile(path, spare, "the upload journal", logger)
        self.path, self.spare = path, self.file.spare
        self._lock = threading.Lock()
        self._open: dict[str, OpenUpload] = {}  # by upload id: recorded open here and not yet done

    @classmethod
    def path_for(cls, state_dir: Path, bucket_url: str, root: Path) -> Path:
        """The journal of one daemon: its bucket and checkpoint root, in the shared state directory."""
        digest = hashlib.sha256(f"{bucket_url}\0{root}".encode()).hexdigest()[:16]
        return state_dir / f"uploads-{digest}.jsonl"

    def opened(self, key: str, upload_id: str) -> None:
        """Record an upload before any of its parts is sent."""
        with self._lock:
            self._append({"open": upload_id, "key": key})
            self._open[upload_id] = OpenUpload(key, upload_id)

    def done(self, upload_id: str) -> None:
        """Record that an upload was completed or aborted (nothing is left open in the store)."""
        with self._lock:
            if self._open.pop(upload_id, None) is None:
                return  # never recorded (its line could not be written): nothing to close
            if self._size() >= COMPACT_AT:
                with contextlib.suppress(OSError):  # then a line, where one can be written
                    self._rewrite(list(self._open.values()))  # the lines of finished uploads say nothing more
                    return
            self._append({"done": upload_id})

    def unfinished(self) -> list[OpenUpload]:
        """Uploads opened and not done, oldest first: in the state directory's file and the spare's."""
        opened: dict[str, OpenUpload] = {}
        done: set[str] = set()
        for path in self.file.places():
            for entry in _entries(path):
                upload_id, key, finished = entry.get("open"), entry.get("key"), entry.get("done")
                if isinstance(upload_id, str) and isinstance(key, str):
                    opened[upload_id] = OpenUpload(key, upload_id)
                elif isinstance(finished, str):
                    done.add(finished)
        return [upload for upload_id, upload in opened.items() if upload_id not in done]

    def keep_only(self, still_open: list[OpenUpload]) -> None:
        """Rewrite the journal with just ``still_open`` (after the start-up aborts)."""
        with self._lock:
            self._rewrite(still_open)

    def _size(self) -> int:
        """Of the file written to now: a spare written for weeks is compacted too."""
        try:
            return self.file.current().stat().st_size
        except FileNotFoundError:
            return 0

    def _rewrite(self, still_open: list[OpenUpload]) -> None:
        data = b"".join(json.dumps({"open": u.upload_id, "key": u.key}).encode() + b"\n" for u in still_open)
        self.file.write(replace_file, data, whole=True)
        self._open = {upload.upload_id: upload for upload in still_open}

    def _append(self, entry: dict[str, str]) -> None:
        self.file.write(_append_line, json.dumps(entry, separators=(",", ":")).encode() + b"\n", whole=False)


def _entries(path: Path) -> list[dict[str, object]]:
    """The journal lines of ``path`` that are JSON objects; a torn last line is skipped."""
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        return []
    entries = []
    for line in lines:
        with contextlib.suppress(ValueError):
            entry = parse_json(line)
            if isinstance(entry, dict):
                entries.append(entry)
    return entries


def _append_line(path: Path, line: bytes) -> None:
    """Append ``line`` whole or not at all: a disk that fills mid-line takes part of it without an
    error, and the next line, appended to the fragment, was lost with it (a killed daemon's fragment
    too). A short write is undone and raised as a full disk (the journal then goes to its spare); a
    file that does not end a line gets a newline first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    created = not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        start = os.fstat(fd).st_size
        if start and os.pread(fd, 1, start - 1) != b"\n":
            line = b"\n" + line
        written = os.write(fd, line)
        if written != len(line):
            os.ftruncate(fd, start)
            raise OSError(errno.ENOSPC, f"{written} of a journal line's {len(line)} bytes written", str(path))
        os.fsync(fd)
    finally:
        os.close(fd)
    if created:
        fsync_dir(path.parent)  # the file's name is durable too
