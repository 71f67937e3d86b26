"""Acceptance: the daemon uploads a file while the trainer is still writing it (``file-range``).

A real daemon subprocess; the trainer side (``tests.streaming.ProgressiveWriter``) writes one big
file in chunks through the real socket. On moto, ListParts shows parts in the bucket while the file
is half written; a writer that goes away mid-file leaves no object and no open multipart upload;
``file-range`` messages that point outside the checkpoint root, or contradict themselves, are refused
and the daemon keeps serving.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from spotguard import protocol
from spotguard.harness import Vm, wait_for
from spotguard.manifest import MANIFEST
from spotguard.storage import open_storage
from spotguard.storage.checkpoints import verify_remote
from tests.faultproxy import FaultProxy
from tests.integration.test_daemon_socket import assert_alive, exchange
from tests.servers import S3Server, moto_s3, point_at
from tests.streaming import MiB, ProgressiveWriter, S3Look, complete_in

PART = 16 * MiB  # the S3 backend's default part size


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    with moto_s3() as server:
        yield server


@pytest.fixture
def s3_bucket(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    return point_at(s3, monkeypatch)


@pytest.fixture
def look(s3: S3Server) -> Iterator[S3Look]:
    view = S3Look(s3.endpoint_url, s3.bucket)
    yield view
    view.close()


def s3_vm(vm_factory: Callable[..., Vm], bucket: str) -> Vm:
    vm = vm_factory("vm", start=False)
    vm.bucket = bucket
    vm.start_daemon()
    return vm


def finish_and_commit(writer: ProgressiveWriter, bucket: str) -> str:
    """The writer's file finished and its checkpoint committed; its name, once complete in ``bucket``."""
    writer.finish_file()
    writer.commit()
    name = writer.step_dir.name
    wait_for(lambda: complete_in(bucket, name), 60, "the checkpoint to be complete in the bucket")
    return name


def test_parts_go_up_while_the_file_is_still_being_written(
    vm_factory: Callable[..., Vm], s3_bucket: str, look: S3Look
) -> None:
    vm = s3_vm(vm_factory, s3_bucket)
    prefix = s3_bucket.partition(f"{look.bucket}/")[2] + "/"
    writer = ProgressiveWriter(vm.root, 5, vm.socket, size=6 * PART + 3 * MiB)
    try:
        writer.begin()
        writer.write_until(3 * PART)
        # The proof that it streams: parts in the bucket while the file is half written.
        wait_for(lambda: look.parts_sent(prefix) >= 2, 30, "parts of the half-written file in the bucket")
        assert writer.written < writer.size
        assert look.objects(prefix) == {}  # nothing completed before the file is finished
        writer.write_until(writer.size)
        name = finish_and_commit(writer, s3_bucket)
    finally:
        writer.close()
    objects = look.objects(prefix)
    manifest = objects[f"{prefix}{name}/{MANIFEST}"]
    assert all(obj["LastModified"] <= manifest["LastModified"] for obj in objects.values())
    assert look.open_uploads(prefix) == []
    storage = open_storage(s3_bucket)
    try:
        assert verify_remote(storage, name) == []
    finally:
        storage.close()
    status = vm.status()["uploads"]["last_committed"]
    assert status["name"] == name and status["bytes"] == writer.size


def test_a_streamed_files_parts_shrink_toward_its_end_and_the_object_is_bit_identical(
    vm_factory: Callable[..., Vm], s3_bucket: str, look: S3Look
) -> None:
    """The tail of a streamed upload: the last part is S3's 5 MiB minimum and the ones before it grow
    back to the 16 MiB part size, so that little is left to send once the last byte is written."""
    vm = s3_vm(vm_factory, s3_bucket)
    prefix = s3_bucket.partition(f"{look.bucket}/")[2] + "/"
    writer = ProgressiveWriter(vm.root, 8, vm.socket, size=12 * PART + 3 * MiB + 5)
    try:
        writer.begin()
        writer.write_until(writer.size)
        # Every byte is announced: every part goes before the file is finished; list them then.
        wait_for(lambda: sum(size for _, size in look.parts(prefix)) == writer.size, 60, "every part in the bucket")
        parts = look.parts(prefix)
        name = finish_and_commit(writer, s3_bucket)
    finally:
        writer.close()
    assert [number for number, _ in parts] == list(range(1, len(parts) + 1))  # numbered with no gap
    sizes = [size for _, size in parts]
    assert sum(sizes) == writer.size  # every byte in exactly one part
    assert sizes[0] == PART  # big parts away from the end: few requests
    assert sizes[-1] == 5 * MiB  # the tail: one part of S3's minimum
    assert all(size >= 5 * MiB for size in sizes)  # S3's floor for every part but the last
    assert sizes[-3:] == sorted(sizes[-3:], reverse=True) and sizes[-3] < PART  # tapering, not one cut
    assert len(sizes) > -(-writer.size // PART)
    key = f"{prefix}{name}/{writer.rel}"
    head = look.client.head_object(Bucket=look.bucket, Key=key)
    assert head["ETag"].strip('"').endswith(f"-{len(sizes)}")  # the object is made of exactly those parts
    body = look.client.get_object(Bucket=look.bucket, Key=key)["Body"].read()
    assert body == (writer.step_dir / writer.rel).read_bytes()


def test_a_file_message_read_after_the_commit_finished_its_stream_sends_nothing_again(
    vm_factory: Callable[..., Vm], s3: S3Server, s3_bucket: str, look: S3Look
) -> None:
    """The commit's job may finish a stream before the file's own message is read (a rescan finds the
    manifest first, on a busy daemon): the message that comes then must not send the file again."""
    prefix = s3_bucket.partition(f"{look.bucket}/")[2] + "/"
    with FaultProxy(s3.endpoint_url, fault_rate=0.0) as proxy:
        vm = vm_factory("vm", start=False)
        vm.bucket = s3_bucket
        vm.start_daemon({"AWS_ENDPOINT_URL_S3": proxy.url})
        writer = ProgressiveWriter(vm.root, 9, vm.socket, size=2 * PART + 5 * MiB + 3)
        try:
            writer.begin()
            writer.write_until(writer.size)
            wait_for(lambda: sum(size for _, size in look.parts(prefix)) == writer.size, 60, "every part in the bucket")
            proxy.hold(lambda method, target: method == "POST" and "uploadId=" in target)  # the stream's completion
            entry = writer.finish_file(announce=False)
            writer.commit()
            wait_for(proxy.held.is_set, 30, "the commit's job to complete the stream")
            writer.announce_file(entry)  # late: the job has finished the stream already
            assert writer.client.ask("safe-steps", timeout=10) is not None  # read after the file message
            wait_for(lambda: "already going up ahead of its commit" in vm.log.read_text(), 10, "the message ignored")
            proxy.release()
            wait_for(lambda: complete_in(s3_bucket, writer.step_dir.name), 60, "the checkpoint in the bucket")
        finally:
            proxy.release()
            writer.close()
    creates = [target for method, target in proxy.seen if method == "POST" and target.endswith("?uploads")]
    assert len(creates) == 1, f"the file went up twice: {creates}"
    assert look.open_uploads(prefix) == []
    storage = open_storage(s3_bucket)
    try:
        assert verify_remote(storage, writer.step_dir.name) == []
    finally:
        storage.close()


@pytest.mark.parametrize("how", ["disconnect", "save-failed"])
def test_a_writer_that_gives_up_mid_file_leaves_nothing_in_the_bucket(
    vm_factory: Callable[..., Vm], s3_bucket: str, look: S3Look, how: str
) -> None:
    vm = s3_vm(vm_factory, s3_bucket)
    prefix = s3_bucket.partition(f"{look.bucket}/")[2] + "/"
    writer = ProgressiveWriter(vm.root, 6, vm.socket, size=4 * PART)
    try:
        writer.begin()
        writer.write_until(2 * PART)
        wait_for(lambda: look.parts_sent(prefix) >= 1, 30, "a part of the half-written file in the bucket")
        if how == "save-failed":
            writer.tmp.unlink()  # what a failed save does with its temporary file
            writer.client.send("save-failed", step=6, reason="urgent", error="write-failed", message="test")
        else:
            writer.client.close()  # the writer is gone; its temporary file stays behind
        wait_for(lambda: look.open_uploads(prefix) == [], 30, "the streamed upload to be aborted")
        assert look.objects(prefix) == {}
        assert_alive(vm)
    finally:
        writer.close()


def test_streaming_to_a_directory_bucket(vm: Vm, bucket: str) -> None:
    writer = ProgressiveWriter(vm.root, 7, vm.socket, size=20 * MiB + 5, chunk=3 * MiB)
    try:
        writer.begin()
        writer.write_until(writer.size)
        name = finish_and_commit(writer, bucket)
    finally:
        writer.close()
    storage = open_storage(bucket)
    try:
        assert verify_remote(storage, name) == []
    finally:
        storage.close()
    left = [p.name for p in Path(bucket.removeprefix("file://")).rglob("*") if ".tmp-" in p.name]
    assert left == []


def test_garbage_file_ranges_are_refused_and_the_daemon_keeps_serving(vm: Vm, tmp_path: Path) -> None:
    step_dir = vm.root / "step-000000009"
    step_dir.mkdir(parents=True)
    (step_dir / ".model.bin.tmp-1").write_bytes(b"x" * 100)
    outside = tmp_path / "outside"
    outside.write_bytes(b"secret")
    (step_dir / ".link.bin.tmp-1").symlink_to(outside)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / ".x.bin.tmp-1").write_bytes(b"secret")
    (step_dir / "sub").symlink_to(tmp_path / "elsewhere")
    os.mkfifo(step_dir / ".fifo.bin.tmp-1")  # its open would wait for a writer: on the event loop, for ever
    good = {"path": str(step_dir), "name": "model.bin", "tmp": ".model.bin.tmp-1", "size": 100}

    def message(**fields: object) -> bytes:
        return protocol.encode("file-range", **{**good, "offset": 0, "length": 10, **fields})

    refused = [
        (message(path=str(tmp_path)), "bad-path"),  # not a checkpoint directory inside the root
        (message(path=str(vm.root / ".." / "outside")), "bad-path"),
        (message(name="../model.bin"), "bad-path"),
        (message(name="/etc/passwd"), "bad-path"),
        (message(tmp="model.bin"), "bad-path"),  # not a temporary name
        (message(tmp="sub/.model.bin.tmp-1"), "bad-path"),  # not beside the file
        (message(tmp="/tmp/.model.bin.tmp-1"), "bad-path"),
        (message(tmp="../.model.bin.tmp-1"), "bad-path"),
        (message(name="link.bin", tmp=".link.bin.tmp-1"), "bad-path"),  # a symlink: never followed
        (message(name="sub/x.bin", tmp="sub/.x.bin.tmp-1"), "bad-path"),  # through a symlinked directory
        (message(name="other.bin", tmp=".other.bin.tmp-404"), "bad-path"),  # does not exist
        (message(name="fifo.bin", tmp=".fifo.bin.tmp-1"), "bad-path"),  # not a regular file
        (message(offset=95, length=10), "bad-field"),  # past the end
        (message(offset=-1), "bad-field"),
        (message(size=200, offset=50), "bad-field"),  # another size than announced before
        (message(offset=5, length=10), "bad-field"),  # overlaps [0, 10), announced before
    ]
    replies = exchange(vm.socket, message() + b"".join(line for line, _ in refused))
    assert [r["code"] for r in replies] == [code for _, code in refused], replies
    assert_alive(vm)
    assert os.path.exists(outside)
