"""What a peer holding the job's token sends is bounded like everything else: the checkpoint a resume
fetches, the names of a replica's files, the disk its files and directories take, the bytes it really
sent. Real daemons on 127.0.0.1 (moto as the shared bucket), frames crafted here; each case shows
that nothing of it is written to the disk or the bucket."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from spotguard.control import request
from spotguard.crc32c import crc32c_of_bytes
from spotguard.harness import Vm, wait_for
from spotguard.manifest import MANIFEST, MAX_NAME_BYTES, MAX_NAME_DEPTH, MAX_SEGMENT_BYTES, FileEntry, Manifest
from spotguard.peer import noise, wire
from spotguard.peer.channel import Channel
from spotguard.peer.client import PeerClient
from spotguard.peer.handshake import accept
from spotguard.peer.replicas import AREA
from spotguard.storage.checkpoints import upload_checkpoint
from spotguard.storage.s3 import S3Storage
from tests.checkpoints import write_checkpoint
from tests.peers import TOKEN, address, bucket_keys, hand_over, receiving_daemon, replica_area

MiB = 1 << 20


def send_data(channel: Channel, name: str, size: int, offset: int, payload: bytes) -> None:
    """One ``data`` frame as a peer may craft it: any name, any declared size."""
    header = {"t": "data", "name": name, "size": size, "offset": offset, "len": len(payload)}
    channel.write_sealed(channel.seal(wire.encode(header), payload))


async def refusal(client: PeerClient) -> wire.PeerError:
    """The receiver's answer to what was sent: it must be an error frame (a query comes back otherwise)."""
    with pytest.raises(wire.PeerError) as caught:
        await client.query()
    return caught.value


def in_the_bucket(url: str, step: int) -> list[str]:
    return [key for key in bucket_keys(url) if f"step-{step:09d}/" in key]


# --- 1. a fetch takes the checkpoint offered, and never replaces a step directory -----------------


def newer_format(step_dir: Path) -> Path:
    """``step_dir`` as a newer spotguard would have written it: a format this one cannot verify."""
    manifest = json.loads((step_dir / MANIFEST).read_text())
    (step_dir / MANIFEST).write_text(json.dumps({**manifest, "format": "spotguard/9"}))
    return step_dir


def contents(step_dir: Path) -> dict[str, bytes]:
    return {p.relative_to(step_dir).as_posix(): p.read_bytes() for p in sorted(step_dir.rglob("*")) if p.is_file()}


@contextlib.asynccontextmanager
async def forging_holder(url: str, offered: str, sends: list[tuple[str, Path]]) -> AsyncIterator[int]:
    """A peer with the job's token that lists ``offered`` and answers each fetch with the next of
    ``sends`` (the name it gives, the checkpoint whose manifest and bytes go with it); yields its port."""
    psk = noise.derive_psk(TOKEN.encode())

    async def serve(stream: wire.FrameStream, writer: Any) -> None:
        channel = await accept(stream, writer, psk)
        with contextlib.suppress(wire.PeerError, OSError, asyncio.IncompleteReadError, TimeoutError):
            while True:
                header = await channel.read_frame(timeout=30)
                if header["t"] == "list":
                    item = {"id": "r1", "name": offered, "bucket": url, "state": "verified", "bytes": 800}
                    channel.write(wire.encode({"t": "replicas", "items": [{**item, "share": False}]}))
                elif header["t"] == "fetch":
                    name, step_dir = sends.pop(0)
                    text = (step_dir / MANIFEST).read_text()
                    channel.write(wire.encode({"t": "checkpoint", "id": "r1", "name": name, "manifest": text}))
                    data = (step_dir / "w.bin").read_bytes()
                    send_data(channel, "w.bin", len(data), 0, data)
                    channel.write(wire.encode({"t": "end"}))
                await channel.drain()

    server = await wire.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


def test_a_fetch_takes_only_the_checkpoint_offered_and_never_replaces_a_step_directory(
    tmp_path: Path, url: str
) -> None:
    """A peer offers step 200 and sends step 50 (older than the bucket's step 100); then sends step
    200 itself, which the fresh VM's disk holds already in a format it cannot verify. Both fetches are
    refused, the local directories stay as they were, and nothing reaches the bucket."""
    storage = S3Storage(url)
    try:
        upload_checkpoint(storage, write_checkpoint(tmp_path / "seed", 100, {"w.bin": b"in the bucket" * 100}))
    finally:
        storage.close()
    before_bucket = bucket_keys(url)
    forged = tmp_path / "forged"
    sends = [("step-000000050", write_checkpoint(forged, 50, {"w.bin": b"forged 50" * 100})),
             ("step-000000200", write_checkpoint(forged, 200, {"w.bin": b"forged 200" * 100}))]  # fmt: skip
    vm_dir = tmp_path / "fresh"
    root = vm_dir / "nvme"
    held = {step: newer_format(write_checkpoint(root, step, {"w.bin": os.urandom(99)})) for step in (50, 200)}
    before = {step: contents(step_dir) for step, step_dir in held.items()}

    async def scenario() -> list[dict[str, Any]]:
        async with forging_holder(url, "step-000000200", sends) as port:
            vm = Vm(tmp_path, "fresh", url, extra_args=["--provider", "none", "--peers", f"127.0.0.1:{port}"])
            await asyncio.to_thread(vm.start_daemon, {"SPOTGUARD_PEER_TOKEN": TOKEN})
            try:
                return [await asyncio.to_thread(request, vm.socket, "peer-resume", 60, after=-1) for _ in range(2)]
            finally:
                vm.kill_daemon()

    replies = asyncio.run(scenario())
    assert sends == [] and [reply["path"] for reply in replies] == [None, None]
    assert [reply["after"] for reply in replies] == [100, 100]
    assert {step: contents(step_dir) for step, step_dir in held.items()} == before
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(("step-", ".peer-fetch"))) == [
        "step-000000050",
        "step-000000200",
    ]
    log = (vm_dir / "daemon.log").read_text()
    assert "asked for step-000000200, the peer sent 'step-000000050'" in log
    assert "step-000000200 exists already: a fetch never replaces a checkpoint directory" in log
    assert bucket_keys(url) == before_bucket


# --- 2. names no bucket or filesystem takes ----------------------------------------------------------


def test_file_names_no_bucket_takes_are_refused_and_hold_no_slot(tmp_path: Path, url: str) -> None:
    """A lone surrogate, a name too deep, a segment or a name too long, a key too long with the
    bucket's prefix: each replica is refused
    (``bad-path``) with nothing kept, and a genuine peer still finds both slots free; one an earlier
    daemon verified before a restart is removed at start, not retried for good."""
    bad = [
        "w\udcff.bin",
        "/".join(["d"] * MAX_NAME_DEPTH) + "/f",
        "x" * (MAX_SEGMENT_BYTES + 1),
        "/".join(["y" * 200] * (MAX_NAME_BYTES // 200 + 1)),
        # Within a name's bound, over a key's once the bucket's prefix (run-...) comes before it.
        "/".join(["z" * 200] * 5) + "/" + "z" * (MAX_NAME_BYTES - 1005),
    ]
    with receiving_daemon(tmp_path, url) as vm:

        async def refused(name: str) -> str:
            client = await PeerClient.connect(*address(vm), TOKEN.encode())
            try:
                await client.open_replica("step-000000001", url)
                send_data(client.channel, name, 100, 0, b"x" * 100)
                return (await refusal(client)).code
            finally:
                await client.close()

        assert [asyncio.run(refused(name)) for name in bad] == ["bad-path"] * len(bad)
        wait_for(lambda: replica_area(vm) == [] and vm.status()["peers"]["replicas"] == [], 10, "nothing kept")

        # As a daemon before this check left it: verified, with a name its bucket refuses.
        left = vm.root / AREA / "step-000000002-0123abcd"
        (left / "step-000000002").mkdir(parents=True)
        (left / "step-000000002" / os.fsdecode(b"w\xff.bin")).write_bytes(b"x" * 100)
        files = {"w\udcff.bin": FileEntry(100, crc32c_of_bytes(b"x" * 100))}
        (left / "step-000000002" / MANIFEST).write_bytes(Manifest(2, "urgent", 1, files).to_json())
        meta = {"name": "step-000000002", "bucket": url, "sender": "127.0.0.1:1", "state": "verified"}
        (left / "replica.json").write_text(json.dumps(meta))
        vm.kill_daemon()
        vm.start_daemon(env={"SPOTGUARD_PEER_TOKEN": TOKEN})
        wait_for(lambda: replica_area(vm) == [], 10, "the unreadable replica removed at start")

        genuine = [write_checkpoint(tmp_path / "vm-a", step, {"w.bin": os.urandom(1000)}) for step in (3, 4)]

        assert [hand_over(address(vm), step_dir, url)["state"] for step_dir in genuine] == ["verified", "verified"]
        wait_for(lambda: in_the_bucket(url, 3) and in_the_bucket(url, 4), 30, "the genuine replicas committed")
    assert in_the_bucket(url, 1) == [] and in_the_bucket(url, 2) == []


# --- 3. directories count against the disk they take --------------------------------------------------


def test_empty_files_in_fresh_directories_count_against_the_replica_s_bytes(tmp_path: Path, url: str) -> None:
    """A replica that announces 0 bytes and sends only empty files, each in a chain of fresh
    directories: each file and directory counts one block, so with at most 1 MiB a replica the
    ninth such file (8 x 32 blocks of 4 KiB) is refused and everything it made is removed."""
    depth = MAX_NAME_DEPTH - 1  # directories above each file: as deep as a name may go
    with receiving_daemon(tmp_path, url, {"SPOTGUARD_PEER_MAX_REPLICA_BYTES": str(MiB)}) as vm:

        async def flood() -> tuple[str, int]:
            """The refusal's code, and how many files were taken before it."""
            client = await PeerClient.connect(*address(vm), TOKEN.encode())
            taken = 0
            try:
                client.channel.write(wire.encode({"t": "replica", "name": "step-000000007", "bucket": url, "bytes": 0}))
                await client.channel.drain()
                assert (await client.channel.read_frame(timeout=10))["t"] == "ok"
                for i in range(100):
                    send_data(client.channel, f"d{i}/" + "a/" * (depth - 1) + "f", 0, 0, b"")
                    await client.query()  # answered while the file is taken, an error frame once it is not
                    taken += 1
                raise AssertionError(f"{taken} empty files in {taken * depth} directories were all taken")
            except wire.PeerError as exc:
                return exc.code, taken
            finally:
                await client.close()

        assert asyncio.run(flood()) == ("too-large", 8)
        wait_for(lambda: replica_area(vm) == [] and vm.status()["peers"]["replicas"] == [], 10, "nothing kept")
    assert bucket_keys(url) == []


# --- 4. bytes never sent ----------------------------------------------------------------------------


def test_a_file_whose_bytes_never_all_arrived_is_refused_at_commit(tmp_path: Path, url: str) -> None:
    """A 16 MiB file declared, one byte sent at its end, a manifest with the CRC32C of the mostly-zero
    file: refused, naming the bytes never received, and nothing goes to the bucket. A file sent in
    overlapping ranges that cover it (pieces sent again) is still verified, read back."""
    size = 16 * MiB
    sparse = Manifest(42, "urgent", 1, {"w.bin": FileEntry(size, crc32c_of_bytes(bytes(size - 1) + b"\x01"))})
    data = os.urandom(3 * MiB)
    overlapping = Manifest(43, "urgent", 1, {"w.bin": FileEntry(len(data), crc32c_of_bytes(data))})
    with receiving_daemon(tmp_path, url) as vm:

        async def send(step: str, manifest: Manifest, frames: list[tuple[int, bytes]]) -> dict[str, Any]:
            """A replica of ``manifest``'s one file, sent as ``frames`` (offset, payload); the commit's answer."""
            client = await PeerClient.connect(*address(vm), TOKEN.encode())
            try:
                await client.open_replica(step, url)
                for offset, payload in frames:
                    send_data(client.channel, "w.bin", manifest.files["w.bin"].size, offset, payload)
                client.channel.write(wire.encode({"t": "commit", "manifest": manifest.to_json().decode()}))
                await client.channel.drain()
                return await client.channel.read_frame(timeout=60)
            finally:
                await client.close()

        with pytest.raises(wire.PeerError) as caught:
            asyncio.run(send("step-000000042", sparse, [(size - 1, b"\x01")]))
        assert caught.value.code == "mismatch"
        assert caught.value.message == f"w.bin: bytes [0, {size - 1}) of {size} never received"
        wait_for(lambda: replica_area(vm) == [] and vm.status()["peers"]["replicas"] == [], 10, "nothing kept")

        answer = asyncio.run(send("step-000000043", overlapping, [(0, data[: 2 * MiB]), (MiB, data[MiB:])]))
        assert answer == {"t": "ok", "state": "verified"}
        wait_for(lambda: in_the_bucket(url, 43), 30, "the overlapping replica committed")
    assert in_the_bucket(url, 42) == []
