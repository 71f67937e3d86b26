"""Acceptance: a daemon SIGKILLed while it streams a file the trainer is still writing, then
restarted, still ends with the checkpoint complete in the bucket, verified, its manifest written
after every data object, and no multipart upload left open (the killed daemon's upload of that key
is younger than ``stale_upload_age``: only the per-key clean-up before the file's upload removes it).

Two ways the trainer goes on: it keeps writing and announcing ranges to the restarted daemon (its
connection reconnects), or it finishes and commits while no daemon runs, and the restarted daemon
finds the committed checkpoint on disk. The kill is timed by polling moto's ListParts, never by sleeps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import pytest

from spotguard.harness import Vm, wait_for
from spotguard.manifest import MANIFEST
from spotguard.storage import open_storage
from spotguard.storage.checkpoints import verify_remote
from tests.servers import S3Server, moto_s3, point_at
from tests.streaming import MiB, ProgressiveWriter, S3Look, complete_in

PART = 16 * MiB
# moto dates every multipart upload 2010-11-10: the daemon's start-up clean-up (uploads older than
# stale_upload_age) would abort the killed daemon's upload before the per-key one is ever needed.
# Twenty years spares it, as a real store spares an upload a minute old.
DAEMON_ENV = {"SPOTGUARD_STALE_UPLOAD_AGE": str(20 * 365 * 86400)}


@pytest.fixture
def s3() -> Iterator[S3Server]:
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    with moto_s3() as server:
        yield server


@pytest.mark.parametrize("trainer", ["keeps-writing", "commits-while-down"])
def test_daemon_killed_mid_stream_finishes_the_checkpoint_cleanly_after_restart(
    s3: S3Server, vm_factory: Callable[..., Vm], monkeypatch: pytest.MonkeyPatch, trainer: str
) -> None:
    bucket = point_at(s3, monkeypatch)
    prefix = bucket.partition(f"{s3.bucket}/")[2] + "/"
    look = S3Look(s3.endpoint_url, s3.bucket)
    vm = vm_factory("vm", start=False)
    vm.bucket = bucket
    vm.start_daemon(env=DAEMON_ENV)
    writer = ProgressiveWriter(vm.root, 11, vm.socket, size=8 * PART + 1234)
    try:
        writer.begin()
        writer.write_until(4 * PART)
        wait_for(lambda: look.parts_sent(prefix) >= 2, 60, "parts of the half-written file in the bucket")
        vm.kill_daemon()
        killed = {upload["UploadId"] for upload in look.open_uploads(prefix)}
        assert killed, "the killed daemon left its multipart upload open"
        assert look.objects(prefix) == {}
        if trainer == "commits-while-down":
            writer.client.close()  # no daemon to tell: the restarted one finds the commit on disk
            writer.write_until(writer.size)
            writer.finish_file()
            writer.commit()
            vm.start_daemon(env=DAEMON_ENV)
        else:
            vm.start_daemon(env=DAEMON_ENV)
            writer.write_until(writer.size)
            writer.finish_file()
            writer.commit()
        name = writer.step_dir.name
        wait_for(lambda: complete_in(bucket, name), 120, "the checkpoint to complete after the restart")
        objects = look.objects(prefix)
        manifest = objects[f"{prefix}{name}/{MANIFEST}"]
        assert sorted(objects) == [f"{prefix}{name}/{MANIFEST}", f"{prefix}{name}/{writer.rel}"]
        assert all(obj["LastModified"] <= manifest["LastModified"] for obj in objects.values())
        wait_for(lambda: look.open_uploads(prefix) == [], 30, "no multipart upload left open")
        storage = open_storage(bucket)
        try:
            assert verify_remote(storage, name) == []
        finally:
            storage.close()
        log = vm.log.read_text()
        assert "stale multipart" not in log  # not by the start-up clean-up: by the per-key one
        assert "s3: aborting multipart upload" in log
    finally:
        writer.close()
        look.close()
