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
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from spotguard.jsontext import parse_json
from spotguard.safefile import atomic_file, fsync_dir

logger = logging.getLogger("spotguard.storage")

COMPACT_AT = 64 * 1024  # bytes of journal worth rewriting (some 400 uploads): one rewrite per so many


@dataclass(frozen=True)
class OpenUpload:
    key: str
    upload_id: str


class UploadJournal:
    """Append-only record of this daemon's open multipart uploads (thread-safe: uploads run in threads)."""

    def __init__(self, path: Path) -> None:
        self.path = path
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
                self._rewrite(list(self._open.values()))  # the lines of finished uploads say nothing more
            else:
                self._append({"done": upload_id})

    def unfinished(self) -> list[OpenUpload]:
        """Uploads opened and not done, oldest first."""
        try:
            lines = self.path.read_bytes().splitlines()
        except FileNotFoundError:
            return []
        opened: dict[str, OpenUpload] = {}
        for line in lines:
            try:
                entry = parse_json(line)
            except ValueError:
                continue  # a torn last line
            if not isinstance(entry, dict):
                continue
            if isinstance(entry.get("open"), str) and isinstance(entry.get("key"), str):
                opened[entry["open"]] = OpenUpload(entry["key"], entry["open"])
            elif isinstance(entry.get("done"), str):
                opened.pop(entry["done"], None)
        return list(opened.values())

    def keep_only(self, still_open: list[OpenUpload]) -> None:
        """Rewrite the journal with just ``still_open`` (after the start-up aborts)."""
        with self._lock:
            self._rewrite(still_open)

    def _size(self) -> int:
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def _rewrite(self, still_open: list[OpenUpload]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(self.path) as out:
            for upload in still_open:
                out.write(json.dumps({"open": upload.upload_id, "key": upload.key}).encode() + b"\n")
        fsync_dir(self.path.parent)
        self._open = {upload.upload_id: upload for upload in still_open}

    def _append(self, entry: dict[str, str]) -> None:
        line = json.dumps(entry, separators=(",", ":")).encode() + b"\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        created = not self.path.exists()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        if created:
            fsync_dir(self.path.parent)  # the file's name is durable too
