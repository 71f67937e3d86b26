"""S3 multipart uploads: the store's side of the part engine (:mod:`spotguard.storage.stream`), the record
of the uploads this daemon opens (:mod:`spotguard.storage.journal`), the sweep of those an earlier run
left open, and the verdict on whether the store's CRC32Cs can be trusted.

Every part carries its CRC32C (or, once the store is seen to answer wrong CRC32Cs, its Content-MD5); the
engine checks the part CRC32Cs combined against the file's before ``complete`` sends the full-object one.
"""

from __future__ import annotations

import base64
import builtins
import datetime as dt
import hashlib
import logging
import threading
from typing import Any

import google_crc32c

from spotguard.cloudclock import cloud_now
from spotguard.crc32c import crc32c_int_to_base64 as _int_to_b64
from spotguard.storage.base import ChecksumMismatch, ObjectNotFound, RecentKeys, StorageError, read_exactly
from spotguard.storage.cleanups import FailedCleanups
from spotguard.storage.journal import UploadJournal
from spotguard.storage.s3_api import S3Api, error_code
from spotguard.storage.stream import Plan, streamed_plan

log = logging.getLogger(__name__)


def _upload_gone(exc: BaseException) -> bool:
    """Whether the store answered NoSuchUpload: that multipart upload was aborted or completed already."""
    return error_code(exc.__cause__ or exc) == "NoSuchUpload"


# ListMultipartUploads gives Initiated to the second: an upload begun in this client's first second
# may be listed as older than the client, and is not ours to abort.
_INITIATED_PRECISION = dt.timedelta(seconds=1)
_MAX_PARTS = 10_000
ABORT_RETRY_INTERVAL = 60.0  # seconds between tries to abort uploads whose abort failed
MIN_PART = 5 * 1024 * 1024  # S3's floor for every part but the last

Part = tuple[int, str, int, int]  # (number, ETag, CRC32C, length)


def crc_of(data: bytes | memoryview) -> int:
    return int(google_crc32c.value(bytes(data)))


def integrity_args(data: bytes, crc: int, md5: bool) -> dict[str, str]:
    """What a PutObject / UploadPart carries for the store to check the body against."""
    if md5:
        return {"ContentMD5": base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()}
    return {"ChecksumAlgorithm": "CRC32C", "ChecksumCRC32C": _int_to_b64(crc)}


class ChecksumVerdict:
    """One store, one verdict on its CRC32C, shared by every upload thread: ``md5`` once it is seen to
    answer CRC32Cs that do not match the bytes (``checksum="auto"``), a refusal once ``attempts`` are
    spent with ``checksum="crc32c"``."""

    def __init__(self, store_name: Any, checksum: str, attempts: int) -> None:
        self._store_name = store_name  # called for the name: the endpoint is known once a client exists
        self.checksum = checksum
        self.attempts = attempts
        self._lock = threading.Lock()
        self.md5 = checksum == "md5"
        self._disagreements = 0
        self._refusal: ChecksumMismatch | None = None  # pinned crc32c, attempts spent

    def use_md5(self) -> bool:
        """How the next upload is verified; raises the refusal once there is one."""
        with self._lock:
            refusal = self._refusal
            md5 = self.md5
        if refusal is not None:
            # Nothing is sent: the store would only answer the same wrong CRC32C again.
            raise ChecksumMismatch(str(refusal), sent=refusal.sent, answered=refusal.answered)
        return md5

    def adopt_md5(self) -> None:
        if self.checksum == "auto":
            with self._lock:
                self.md5 = True

    def disagreed(self, full: str, exc: ChecksumMismatch) -> None:
        """Count one CRC32C disagreement: return to upload ``full`` again (the same way or with
        Content-MD5), or raise once ``attempts`` are spent and ``checksum`` is pinned."""
        with self._lock:
            if self.md5:
                return  # another upload made the switch meanwhile: this one goes again with Content-MD5
            self._disagreements += 1
            count = self._disagreements
            if count < self.attempts:
                log.warning(
                    "s3: %s answered CRC32C %s for %s, sent %s: checksum disagreement %d of %d, uploading again",
                    self._store_name(),
                    exc.answered,
                    full,
                    exc.sent,
                    count,
                    self.attempts,
                )
                return
            if self.checksum == "crc32c":
                self._refusal = ChecksumMismatch(
                    f"s3: {self._store_name()} answers CRC32Cs that do not match the bytes (sent {exc.sent} for "
                    f"{full}, it answered {exc.answered}; {count} uploads disagreed); checksum = crc32c is set, so "
                    "there is no fallback: set checksum = auto or md5 for this store",
                    sent=exc.sent,
                    answered=exc.answered,
                )
                raise self._refusal from exc
            self.md5 = True
        log.warning(
            "s3: %s answers CRC32Cs that do not match the bytes (sent CRC32C %s for %s, it answered %s; "
            "%d uploads disagreed): verifying uploads to it with Content-MD5 from now on "
            "(checksum = md5 skips this detection)",
            self._store_name(),
            exc.sent,
            full,
            exc.answered,
            count,
        )


class S3Multipart:
    """Opening, sending, completing and aborting the multipart uploads of one bucket and prefix."""

    def __init__(self, api: S3Api, part_size: int, streams: threading.BoundedSemaphore) -> None:
        self.api = api
        self.part_size = part_size
        self._streams = streams  # the instance's one budget of requests in flight
        self.journal: UploadJournal | None = None  # the daemon's record (None: the CLI's restore)
        self._created = dt.datetime.now(dt.UTC)
        self._leftovers_lock = threading.Lock()
        self._leftovers_checked = RecentKeys()  # keys whose leftover multipart uploads are aborted
        self._folders_listed = RecentKeys()  # folders whose open uploads were listed
        self._leftovers: dict[str, builtins.list[str]] = {}  # by key: upload ids listed, opened before us
        # Uploads given up whose abort failed too (the store was failing): their parts stay billed until
        # aborted, and a daemon runs for months between restarts, so they are tried again now and then.
        self.failed_aborts: FailedCleanups[str] = FailedCleanups(ABORT_RETRY_INTERVAL)  # upload id -> key
        self._journal_lock = threading.Lock()
        self._journal_failing = False  # the last upload could not be recorded (its warning logged)

    def plan(self, size: int) -> Plan:
        part = self.part_size
        while -(-size // part) > _MAX_PARTS:
            part *= 2
        return [(i + 1, off, min(part, size - off)) for i, off in enumerate(range(0, size, part))]

    def stream_plan(self, size: int, streams: int) -> Plan:
        """The parts of a file sent while it is written: :func:`streamed_plan`'s taper toward the end,
        the part size doubled as :meth:`plan` does while the file would need more than 10,000."""
        part = self.part_size
        while len(plan := streamed_plan(size, part, min_part=MIN_PART, streams=streams)) > _MAX_PARTS:
            part *= 2
        return plan

    def create(self, full: str, *, md5: bool) -> str:
        self._abort_leftovers(full)
        created = self.api.on_key(
            "create_multipart_upload",
            full,
            **({} if md5 else {"ChecksumAlgorithm": "CRC32C", "ChecksumType": "FULL_OBJECT"}),
        )
        upload_id = str(created["UploadId"])
        self._record_opened(full, upload_id)
        return upload_id

    def _record_opened(self, full: str, upload_id: str) -> None:
        """Note the upload in the journal. One that cannot be (neither the state directory, on the root
        disk of a VM that ran for months, nor the journal's spare takes a line) is sent all the same: the
        checkpoint matters more than the record. Unrecorded, an upload a killed daemon leaves open goes
        with the sweep by age and the bucket's lifecycle rule instead; before, every multipart upload
        was aborted, the urgent one's included."""
        if self.journal is None:
            return
        try:
            self.journal.opened(full, upload_id)
        except OSError as exc:
            with self._journal_lock:
                first, self._journal_failing = not self._journal_failing, True
            if first:  # once until it can be written again, not once per file
                log.warning(
                    "s3: cannot record upload %s of %s in %s (%s): uploading it anyway. Free space there;"
                    " until then, an upload a killed daemon leaves open is only aborted once older than"
                    " stale_upload_age",
                    upload_id, full, self.journal.path, exc.strerror or exc,
                )  # fmt: skip
            return
        with self._journal_lock:
            recovered, self._journal_failing = self._journal_failing, False
        if recovered:
            log.info("s3: the upload journal %s is written again", self.journal.path)

    def send_part(self, fd: int, full: str, upload_id: str, where: tuple[int, int, int], md5: bool) -> tuple[str, int]:
        """Part ``where`` (number, offset, length) read from ``fd`` and sent with its checksum; its
        ETag and CRC32C."""
        number, offset, length = where
        # The budget before the read: only parts about to be sent are in memory.
        with self._streams:
            data = read_exactly(fd, offset, length, f"s3: {full} (part {number})")
            crc = crc_of(data)
            resp = self.api.on_key(
                "upload_part",
                full,
                f" #{number}",
                UploadId=upload_id,
                PartNumber=number,
                Body=data,
                **integrity_args(data, crc, md5),
            )
        return str(resp["ETag"]), crc

    def complete(self, full: str, upload_id: str, parts: list[Part], expected: int, *, md5: bool) -> bool:
        """Complete the upload; False when a retry after a lost response found it gone (the caller
        checks whether the first attempt made the object)."""
        checksums: dict[str, str] = {}
        if not md5:
            checksums = {"ChecksumCRC32C": _int_to_b64(expected), "ChecksumType": "FULL_OBJECT"}
        try:
            self.api.on_key(
                "complete_multipart_upload",
                full,
                UploadId=upload_id,
                MultipartUpload={
                    "Parts": [
                        {"PartNumber": n, "ETag": etag, **({} if md5 else {"ChecksumCRC32C": _int_to_b64(crc)})}
                        for n, etag, crc, _ in parts
                    ]
                },
                **checksums,
            )
        except StorageError as exc:
            if _upload_gone(exc):
                return False
            raise
        self.journal_done(upload_id)
        return True

    def journal_done(self, upload_id: str) -> None:
        if self.journal is None:
            return
        try:
            self.journal.done(upload_id)
        except OSError as exc:
            # Harmless: the next start aborts it again and finds it gone.
            log.warning("s3: cannot record the end of upload %s in %s: %s", upload_id, self.journal.path, exc)

    def keep_journal(self, journal: UploadJournal) -> int:
        """At start: abort every upload ``journal`` says this daemon opened and never finished (a killed
        predecessor's), however young, then record every upload opened from now on in it. Returns how many
        were aborted; those that could not be stay recorded for the next start."""
        unfinished = journal.unfinished()
        still_open = [upload for upload in unfinished if not self.abort(upload.key, upload.upload_id)]
        try:
            journal.keep_only(still_open)
        except OSError as exc:  # a read-only root disk must not keep the daemon from starting
            log.warning(
                "s3: cannot rewrite the upload journal %s: %s; lines are added as they can be", journal.path, exc
            )
        self.journal = journal
        return len(unfinished) - len(still_open)

    def abort(self, full: str, upload_id: str) -> bool:
        """Abort one multipart upload; whether nothing of it is left open (already gone counts)."""
        try:
            self.api.on_key("abort_multipart_upload", full, UploadId=upload_id)
        except ObjectNotFound:
            pass
        except Exception as exc:
            # Already aborted or completed (a daemon killed between an upload's completion and its
            # journal line): gone, as asked. Counted a failure, it stayed in the journal, was tried
            # again every interval and warned of at every start.
            if not _upload_gone(exc):
                # The journal keeps it: retry_aborts tries again, and so does the next start (and its sweep by age).
                again = self.failed_aborts.failed(upload_id, full)  # its traceback was logged the first time
                log.warning("s3: could not abort multipart upload %s of %s", upload_id, full, exc_info=not again)
                return False
        self.failed_aborts.cleaned(upload_id)
        self.journal_done(upload_id)
        return True

    def retry_aborts(self) -> int:
        """Abort again the uploads whose abort failed, once ``failed_aborts.interval`` has passed since
        the last try; how many are gone now."""
        aborted = sum(self.abort(full, upload_id) for upload_id, full in self.failed_aborts.due())
        if aborted:
            log.info("s3: aborted %d multipart uploads whose abort had failed", aborted)
        return aborted

    def _abort_leftovers(self, full: str) -> None:
        """Abort the multipart uploads of exactly ``full`` opened before this instance was made: an
        earlier daemon's, killed mid-upload (at start only those older than ``stale_upload_age`` go,
        since other nodes share the prefix; this key is ours to write now). Once per key.

        One listing per folder, not per key: the first key of a folder (a checkpoint's files) lists
        the folder's open uploads and keeps those opened before this instance (a leftover is older
        than the listing, so it is in it) for the folder's other keys to abort when they open; a
        checkpoint of many files costs one request, not one per file."""
        folder = full.rpartition("/")[0] + "/" if "/" in full else full
        with self._leftovers_lock:  # also while a folder is listed: its other keys wait for that one listing
            if full in self._leftovers_checked:
                return
            self._leftovers_checked.add(full)
            if folder not in self._folders_listed:
                try:
                    uploads = self.open_uploads(folder)
                except StorageError as exc:
                    # Not worth failing the upload for: abort_stale() gets them later.
                    log.warning("s3: cannot list the open multipart uploads of %s: %s", full, exc)
                    return
                self._folders_listed.add(folder)
                for upload in uploads:
                    initiated = upload.get("Initiated")
                    if initiated is None or initiated < self._created - _INITIATED_PRECISION:
                        self._leftovers.setdefault(upload["Key"], []).append(upload["UploadId"])
            leftovers = self._leftovers.pop(full, [])
        for upload_id in leftovers:
            log.info("s3: aborting multipart upload %s of %s left by an earlier run", upload_id, full)
            self.abort(full, upload_id)

    def open_uploads(self, prefix: str) -> builtins.list[dict[str, Any]]:
        """The unfinished multipart uploads of every key starting with ``prefix``."""
        api = self.api
        try:
            pages = list(api.client.get_paginator("list_multipart_uploads").paginate(Bucket=api.bucket, Prefix=prefix))
        except Exception as exc:
            raise api.wrap("list_multipart_uploads", exc) from exc
        return [upload for page in pages for upload in page.get("Uploads", [])]

    def abort_stale(self, older_than: dt.timedelta | None) -> int:
        """Abort the unfinished multipart uploads under the prefix older than ``older_than``; how many."""
        cutoff = cloud_now() - older_than if older_than is not None else None  # S3 stamps the cloud's time
        aborted = 0
        for upload in self.open_uploads(self.api.prefix):
            initiated = upload.get("Initiated")
            if cutoff is not None and initiated is not None and initiated > cutoff:
                continue
            self.abort(upload["Key"], upload["UploadId"])
            aborted += 1
        return aborted
