"""A trainer side that writes one big file progressively the way the parallel writer does: pwrite of
MiB-sized chunks into the file's temporary name, a ``file-range`` message per finished chunk through
the real socket (``DaemonClient``), then fsync, rename, ``file`` and the commit with ``saved``.

The bytes are random, so the bucket copy can be checked against the CRC32C computed as they go.
Also the raw looks into moto that the streaming tests poll: open multipart uploads and their parts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import boto3
import google_crc32c

from spotguard.crc32c import crc32c_hex
from spotguard.localstore import CheckpointWriter
from spotguard.manifest import FileEntry
from spotguard.safefile import TMP_MARK, fsync_dir
from spotguard.storage import open_storage
from spotguard.storage.checkpoints import is_committed
from spotguard.trainer.client import DaemonClient

MiB = 1 << 20


class ProgressiveWriter:
    def __init__(
        self, root: Path, step: int, socket: Path, *, size: int, rel: str = "model.bin", chunk: int = 4 * MiB
    ) -> None:
        self.writer = CheckpointWriter(root, step, reason="urgent")
        self.rel = rel
        self.size = size
        self.chunk = chunk
        self.target = self.writer.dir / rel
        self.tmp = self.target.with_name(f".{self.target.name}{TMP_MARK}{os.getpid()}")
        self.written = 0
        self.replies: list[dict[str, Any]] = []
        self._crc = 0
        self._fd: int | None = None
        self.client = DaemonClient(
            socket,
            {"rank": 0, "world_size": 1, "pid": os.getpid(), "checkpoint_dir": str(root)},
            self.replies.append,
        ).start()

    @property
    def step_dir(self) -> Path:
        return self.writer.dir

    def begin(self) -> None:
        self.writer.prepare()
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

    def write_until(self, offset: int) -> None:
        """Write (and announce) the chunks up to ``offset`` of the file."""
        assert self._fd is not None
        while self.written < min(offset, self.size):
            length = min(self.chunk, self.size - self.written)
            data = os.urandom(length)
            os.pwrite(self._fd, data, self.written)
            self._crc = int(google_crc32c.extend(self._crc, data))
            self.client.send(
                "file-range",
                path=str(self.step_dir),
                name=self.rel,
                tmp=self.tmp.relative_to(self.step_dir).as_posix(),
                size=self.size,
                offset=self.written,
                length=length,
            )
            self.written += length

    def finish_file(self, *, announce: bool = True) -> FileEntry:
        """The file fsynced and renamed to its name; its ``file`` message sent unless ``announce`` is False."""
        assert self._fd is not None and self.written == self.size
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        self.tmp.rename(self.target)
        fsync_dir(self.target.parent)
        entry = FileEntry(size=self.size, crc32c=crc32c_hex(self._crc))
        self.writer.files[self.rel] = entry
        if announce:
            self.announce_file(entry)
        return entry

    def announce_file(self, entry: FileEntry) -> None:
        self.client.send("file", path=str(self.step_dir), name=self.rel, size=entry.size, crc32c=entry.crc32c)

    def commit(self) -> None:
        self.writer.commit()
        self.client.send("saved", path=str(self.step_dir), step=self.writer.step, reason="urgent")

    def write_whole(self) -> None:
        """The whole save at once: begun, written, its file reported, committed."""
        self.begin()
        self.write_until(self.size)
        self.finish_file()
        self.commit()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.client.close()


class S3Look:
    """Raw views of a moto bucket, not through spotguard."""

    def __init__(self, endpoint: str, bucket: str) -> None:
        self.bucket = bucket
        self.client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")

    def open_uploads(self, prefix: str) -> list[dict[str, Any]]:
        resp = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=prefix)
        return list(resp.get("Uploads", []))

    def parts_sent(self, prefix: str) -> int:
        """Parts uploaded so far to the open multipart uploads under ``prefix``."""
        count = 0
        for upload in self.open_uploads(prefix):
            resp = self.client.list_parts(Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"])
            count += len(resp.get("Parts", []))
        return count

    def parts(self, prefix: str) -> list[tuple[int, int]]:
        """(number, size) of the parts uploaded so far to the one open multipart upload under
        ``prefix``, in number order; none before it opens. Parts go up concurrently: while the upload
        runs, a later part may be there before an earlier one."""
        uploads = self.open_uploads(prefix)
        if not uploads:
            return []
        (upload,) = uploads
        pages = self.client.get_paginator("list_parts").paginate(
            Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
        )
        return sorted((part["PartNumber"], part["Size"]) for page in pages for part in page.get("Parts", []))

    def objects(self, prefix: str) -> dict[str, Any]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return {obj["Key"]: obj for page in pages for obj in page.get("Contents", [])}

    def close(self) -> None:
        self.client.close()


def complete_in(bucket: str, name: str) -> bool:
    """Whether ``name`` is a complete checkpoint in the bucket at URL ``bucket``."""
    storage = open_storage(bucket)
    try:
        return is_committed(storage, name)
    finally:
        storage.close()
