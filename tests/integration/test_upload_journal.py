"""A restarted daemon aborts exactly the multipart uploads its killed predecessor opened, however young.

S3 lists when an upload began only to the second, and other nodes of a job share the prefix, so the
start-up sweep by age must spare young uploads: a daemon killed within a second of opening one and
restarted at once used to leave it open for good. The upload journal in the state directory knows
instead. Real moto over HTTP; the predecessor is a real process that opens the upload, sends a part and
is SIGKILLed.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import boto3
import pytest

from spotguard.harness import wait_for
from spotguard.storage.journal import COMPACT_AT, OpenUpload, UploadJournal
from spotguard.storage.s3 import S3Storage, parse_s3_url
from tests.diskspace import fill, make_read_only
from tests.servers import S3Server

MiB = 1 << 20
KEY = "step-000000001/model.pt"
ROUNDS = 20

# The predecessor: opens a streamed upload recorded in the journal, sends its first part, then waits to
# be killed (no finally, no abort: what SIGKILL leaves).
PREDECESSOR = """
import os, sys, threading
from pathlib import Path
from spotguard.storage.journal import UploadJournal
from spotguard.storage.s3 import S3Storage
url, journal, local, key, spare = sys.argv[1:6]
storage = S3Storage(url, part_size=5 * 1024 * 1024, max_concurrency=2)
storage.keep_journal(UploadJournal(Path(journal), spare=Path(spare) if spare else None))
fd = os.open(local, os.O_RDONLY)
stream = storage.begin_stream(key, os.fstat(fd).st_size, fd)
stream.add(0, 5 * 1024 * 1024)
threading.Event().wait()
"""


def open_uploads(client: Any, bucket: str, prefix: str) -> list[dict[str, Any]]:
    return list(client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []))


def parts_sent(client: Any, bucket: str, upload: dict[str, Any]) -> int:
    listed = client.list_parts(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
    return len(listed.get("Parts", []))


@pytest.mark.slow
def test_a_daemon_restarted_within_a_second_of_its_upload_aborts_exactly_that_upload(
    url: str, server: S3Server, tmp_path: Path
) -> None:
    bucket, prefix = parse_s3_url(url)
    client = boto3.client("s3", endpoint_url=server.endpoint_url)
    local = tmp_path / "model.pt"
    local.write_bytes(os.urandom(12 * MiB))
    journal_path = UploadJournal.path_for(tmp_path / "state", url, tmp_path / "ckpt")
    # Another writer's young upload under the same prefix (another node of the job, in flight): spared.
    other = client.create_multipart_upload(Bucket=bucket, Key=f"{prefix}step-000000001/other-node.pt")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}
    try:
        for round_ in range(ROUNDS):
            key = f"{prefix}{KEY}.{round_}"
            predecessor = subprocess.Popen(
                [sys.executable, "-c", PREDECESSOR, url, str(journal_path), str(local), f"{KEY}.{round_}", ""], env=env
            )
            try:
                [upload] = wait_for(
                    lambda key=key: [u for u in open_uploads(client, bucket, key) if parts_sent(client, bucket, u)],
                    30,
                    "the predecessor's upload to be open with a part sent",
                )
                opened_at = time.monotonic()
            finally:
                predecessor.send_signal(signal.SIGKILL)
                predecessor.wait()

            restarted = S3Storage(url)
            try:
                # The sweep by age alone spares it: it began less than stale_upload_age ago.
                restarted.abort_stale_multipart_uploads(older_than=dt.timedelta(hours=1))
                assert [u["UploadId"] for u in open_uploads(client, bucket, key)] == [upload["UploadId"]]
                assert restarted.keep_journal(UploadJournal(journal_path)) == 1
                assert time.monotonic() - opened_at < 10  # the restart came right after (seconds, on a busy box)
            finally:
                restarted.close()
            assert open_uploads(client, bucket, key) == [], f"round {round_}: the killed daemon's upload is open"
            assert UploadJournal(journal_path).unfinished() == []
        still_open = [u["UploadId"] for u in open_uploads(client, bucket, prefix)]
        assert still_open == [other["UploadId"]]  # never in this daemon's journal: not this daemon's to abort
    finally:
        client.abort_multipart_upload(Bucket=bucket, Key=other["Key"], UploadId=other["UploadId"])
        client.close()


def test_a_finished_or_aborted_upload_leaves_the_journal(url: str, tmp_path: Path) -> None:
    journal = UploadJournal(tmp_path / "uploads.jsonl")
    storage = S3Storage(url, part_size=5 * MiB, multipart_threshold=5 * MiB)
    try:
        assert storage.keep_journal(journal) == 0
        local = tmp_path / "big.bin"
        local.write_bytes(os.urandom(11 * MiB))
        from spotguard.crc32c import crc32c_of_file

        storage.put_file(local, "step-000000002/big.bin", crc32c=crc32c_of_file(local))
        lines = journal.path.read_text().splitlines()
        assert len(lines) == 2 and '"open"' in lines[0] and '"done"' in lines[1]
        assert journal.unfinished() == []
    finally:
        storage.close()


def test_an_upload_completed_before_its_journal_line_leaves_the_journal_at_the_next_start(
    server: S3Server, url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A daemon killed between an upload's completion and its "done" line: the restart's abort gets
    NoSuchUpload, which means gone. It used to count as a failed abort: kept in the journal, tried
    again every interval and warned of at every start, for as long as the daemon ran."""
    client = boto3.client("s3", endpoint_url=server.endpoint_url)
    bucket, prefix = parse_s3_url(url)
    key = f"{prefix}{KEY}"
    upload_id = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    etag = client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=1, Body=b"x" * MiB)["ETag"]
    client.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": etag}]}
    )
    client.close()
    journal = UploadJournal(tmp_path / "uploads.jsonl")
    journal.opened(key, upload_id)  # and no "done": the kill came first
    storage = S3Storage(url)
    try:
        assert storage.keep_journal(journal) == 1
        assert journal.unfinished() == [] and UploadJournal(journal.path).unfinished() == []
        assert storage.retry_aborts() == 0  # nothing kept to try again
        assert "could not abort" not in caplog.text
    finally:
        storage.close()


def test_a_torn_journal_line_is_ignored(tmp_path: Path) -> None:
    journal = UploadJournal(tmp_path / "uploads.jsonl")
    journal.opened("a/key", "upload-1")
    journal.opened("b/key", "upload-2")
    journal.done("upload-1")
    with journal.path.open("ab") as handle:
        handle.write(b'{"open": "upload-3", "ke')  # a kill mid-append
    assert [(u.key, u.upload_id) for u in journal.unfinished()] == [("b/key", "upload-2")]


def test_a_line_the_full_disk_takes_only_part_of_goes_whole_to_the_spare_and_loses_no_other(
    tmp_path: Path, tmpfs: Callable[[int], Path]
) -> None:
    """A disk that fills mid-line takes part of it without an error: the fragment stayed, the next line
    was appended to it, and a restart found neither upload to abort."""
    state = tmpfs(256 * 1024)
    journal = UploadJournal(state / "uploads.jsonl", spare=tmp_path / "run" / "uploads.jsonl")
    journal.opened("step-000000001/f0.bin", "upload-0")
    number = 1
    while journal.path.stat().st_size % 4096 < 4096 - 80:  # until the last page has under 80 bytes free
        journal.opened(f"step-000000001/f{number}.bin", f"upload-{number}")
        number += 1
    filler = fill(state, leave=0)  # the journal's last page still has a few bytes free: a short write
    long_key = "step-000000002/" + "k" * 300 + ".bin"
    journal.opened(long_key, "upload-long")
    journal.opened("step-000000002/next.bin", "upload-next")
    assert journal.path.read_bytes().endswith(b"\n")  # no fragment left behind
    assert journal.spare is not None and b"upload-long" in journal.spare.read_bytes()
    filler.unlink()
    journal.done("upload-0")  # the state directory takes writes again
    expected = {f"upload-{n}" for n in range(1, number)} | {"upload-long", "upload-next"}
    assert {u.upload_id for u in UploadJournal(journal.path, spare=journal.spare).unfinished()} == expected


def test_a_line_torn_by_a_kill_does_not_swallow_the_next_one(tmp_path: Path) -> None:
    journal = UploadJournal(tmp_path / "uploads.jsonl")
    journal.opened("a/key", "upload-1")
    with journal.path.open("ab") as handle:
        handle.write(b'{"open": "upload-2", "ke')  # a kill mid-append
    journal.opened("c/key", "upload-3")
    assert [u.upload_id for u in UploadJournal(journal.path).unfinished()] == ["upload-1", "upload-3"]


def test_a_journal_of_many_finished_uploads_is_rewritten_with_only_the_open_ones(tmp_path: Path) -> None:
    """Two lines per uploaded file, for the months a daemon runs: past ``COMPACT_AT`` the journal is
    rewritten with the uploads still open, which a restart must still find."""
    journal = UploadJournal(tmp_path / "uploads.jsonl")
    journal.keep_only([OpenUpload("step-000000001/left.bin", "upload-left")])  # a failed abort at start
    journal.opened("step-000000002/open.bin", "upload-open")
    largest = 0
    for number in range(2000):
        journal.opened(f"step-{number:09d}/weights.bin", f"upload-{number}")
        journal.done(f"upload-{number}")
        largest = max(largest, journal.path.stat().st_size)
    assert largest < COMPACT_AT + 1024  # without the rewrite: some 300 KB by now
    assert sorted((u.key, u.upload_id) for u in journal.unfinished()) == [
        ("step-000000001/left.bin", "upload-left"),
        ("step-000000002/open.bin", "upload-open"),
    ]
    journal.done("upload-open")
    assert [u.upload_id for u in UploadJournal(journal.path).unfinished()] == ["upload-left"]


def test_an_upload_whose_abort_failed_is_aborted_once_the_store_answers_again(
    server: S3Server, url: str, tmp_path: Path
) -> None:
    """A streamed upload given up while the store fails cannot be aborted either: its parts stay open and
    billed. A daemon restarted aborts it from its journal, but one runs for months between restarts:
    it tries again every so often, and the journal forgets the upload once it is gone."""
    from tests.faultproxy import FaultProxy

    client = boto3.client("s3", endpoint_url=server.endpoint_url)
    local = tmp_path / "big.bin"
    local.write_bytes(os.urandom(6 * MiB))
    journal = UploadJournal(tmp_path / "uploads.jsonl")
    with FaultProxy(server.endpoint_url, fault_rate=0.0, faults=("500",)) as proxy:
        storage = S3Storage(url, endpoint_url=proxy.url, part_size=5 * MiB, max_attempts=1, attempts=1)
        storage.keep_journal(journal)
        storage._multipart.failed_aborts.interval = 0.2  # a minute in the daemon
        fd = os.open(local, os.O_RDONLY)
        try:
            stream = storage.begin_stream(KEY, 6 * MiB, fd)
            assert stream is not None
            stream.add(0, 5 * MiB)
            wait_for(lambda: open_uploads(client, server.bucket, "") != [], 30, "the upload to open")
            upload = open_uploads(client, server.bucket, "")[0]
            wait_for(lambda: parts_sent(client, server.bucket, upload) == 1, 30, "its first part")
            proxy.set_fault_rate(1.0)
            stream.abort()  # the checkpoint was given up, and the store fails the abort too
            assert [u["UploadId"] for u in open_uploads(client, server.bucket, "")] == [upload["UploadId"]]
            assert [u.upload_id for u in journal.unfinished()] == [upload["UploadId"]]
            assert storage.retry_aborts() == 0  # not before its interval, and the store still fails
            proxy.set_fault_rate(0.0)
            wait_for(lambda: storage.retry_aborts() == 1, 30, "the abort to be tried again")
            assert open_uploads(client, server.bucket, "") == []
            assert journal.unfinished() == []
            assert storage.retry_aborts() == 0  # nothing left to try
        finally:
            os.close(fd)
            storage.close()
            client.close()


def test_a_read_only_state_directory_keeps_the_journal_in_the_spare_for_the_restart(
    url: str, server: S3Server, tmp_path: Path, tmpfs: Callable[[int], Path]
) -> None:
    """The kernel remounts a root filesystem read-only after an I/O error. The journal's rewrite at start
    then raised, and the daemon exited at every start: no notice was watched for. Now its lines go to the
    spare (the daemon's runtime directory), where a restart finds the upload a killed daemon left open."""
    bucket, prefix = parse_s3_url(url)
    client = boto3.client("s3", endpoint_url=server.endpoint_url)
    local = tmp_path / "model.pt"
    local.write_bytes(os.urandom(12 * MiB))
    state = tmpfs(1 * MiB)
    make_read_only(state)
    journal_path = UploadJournal.path_for(state, url, tmp_path / "ckpt")
    spare = UploadJournal.path_for(tmp_path / "run", url, tmp_path / "ckpt")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-c", PREDECESSOR, url, str(journal_path), str(local), KEY, str(spare)]
    predecessor = subprocess.Popen(command, env=env)
    try:
        [upload] = wait_for(
            lambda: [u for u in open_uploads(client, bucket, prefix + KEY) if parts_sent(client, bucket, u)],
            30,
            "the predecessor's upload to be open with a part sent",
        )
    finally:
        predecessor.send_signal(signal.SIGKILL)
        predecessor.wait()
    assert not journal_path.exists() and upload["UploadId"] in spare.read_text()
    restarted = S3Storage(url)
    try:
        assert restarted.keep_journal(UploadJournal(journal_path, spare=spare)) == 1
    finally:
        restarted.close()
        client.close()
    assert open_uploads(boto3.client("s3", endpoint_url=server.endpoint_url), bucket, prefix + KEY) == []


def test_a_spare_written_for_weeks_is_compacted_and_goes_once_the_state_directory_takes_writes(
    tmp_path: Path, tmpfs: Callable[[int], Path]
) -> None:
    state = tmpfs(1 * MiB)
    make_read_only(state)
    journal = UploadJournal(state / "uploads.jsonl", spare=tmp_path / "run" / "uploads.jsonl")
    assert journal.spare is not None
    journal.keep_only([OpenUpload("step-000000001/left.bin", "upload-left")])
    largest = 0
    for number in range(2000):
        journal.opened(f"step-{number:09d}/weights.bin", f"upload-{number}")
        journal.done(f"upload-{number}")
        largest = max(largest, journal.spare.stat().st_size)
    assert largest < COMPACT_AT + 1024 and not journal.path.exists()
    journal.opened("step-000002001/open.bin", "upload-open")
    subprocess.run(["mount", "-o", "remount,rw", str(state)], check=True)
    journal.done("upload-left")  # a line in the state directory; the spare still holds the open upload
    assert [u.upload_id for u in UploadJournal(journal.path, spare=journal.spare).unfinished()] == ["upload-open"]
    journal.keep_only(journal.unfinished())  # as a start does: all of it in the state directory
    assert not journal.spare.exists()
    assert [u.upload_id for u in UploadJournal(journal.path).unfinished()] == ["upload-open"]
