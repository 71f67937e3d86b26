"""The peer receiver of a real daemon (moto as the shared bucket): authentication, bounds, checks."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spotguard.control import request
from spotguard.harness import Vm, wait_for
from spotguard.manifest import load_manifest
from spotguard.peer import noise, wire
from spotguard.peer.client import PeerClient, choose_peer
from spotguard.peer.flows import send_committed
from spotguard.peer.handshake import PROLOGUE
from spotguard.peer.receiver import PeerReceiver
from spotguard.peer.replicas import AREA
from spotguard.storage.checkpoints import list_remote
from spotguard.storage.file import FileStorage
from spotguard.storage.s3 import S3Storage
from tests.checkpoints import write_checkpoint
from tests.peers import TOKEN, address, bucket_keys, replica_area

MiB = 1 << 20


def raw_exchange(where: tuple[str, int], data: bytes) -> bytes:
    """Send ``data`` on a fresh connection and read until the receiver closes it."""
    with socket.create_connection(where, timeout=10) as sock:
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        return received


def test_wrong_tokens_and_garbage_are_refused_and_change_nothing(receiver_vm: Vm, url: str, tmp_path: Path) -> None:
    where = address(receiver_vm)
    step_dir = write_checkpoint(tmp_path / "sender", 7, {"weights.bin": os.urandom(MiB)})

    async def wrong_token() -> str:
        with pytest.raises(wire.PeerError) as caught:
            await PeerClient.connect(*where, b"not-the-job-s-token-at-all")
        return caught.value.code

    assert asyncio.run(wrong_token()) == "auth"
    # Garbage from the first byte: an HTTP request is a frame of ~1.2 GB, far over the pre-auth limit.
    assert b'"code":"too-large"' in raw_exchange(where, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    # A payload frame instead of the handshake: refused before any byte of it is kept.
    frame = wire.encode({"t": "data", "name": "weights.bin", "size": 4, "offset": 0, "len": 4}) + b"abcd"
    assert b'"code":"auth"' in raw_exchange(where, frame)
    # A first handshake message sealed with another token's psk.
    guess = noise.HandshakeState(initiator=True, psk=noise.derive_psk(b"a-guess-at-the-token-0123"), prologue=PROLOGUE)
    message = guess.write_message()
    assert b'"code":"auth"' in raw_exchange(where, struct.pack(">H", len(message)) + message)

    status = receiver_vm.status()["peers"]
    assert status["refused"] == 4 and status["replicas"] == []
    assert replica_area(receiver_vm) == [] and bucket_keys(url) == []
    log = receiver_vm.log.read_text()
    assert TOKEN not in log and "authentication failed" in log

    # Still serving: the right token gets in and the checkpoint is committed in the bucket.
    async def hand_over() -> dict[str, object]:
        client = await PeerClient.connect(*where, TOKEN.encode())
        try:
            return await send_committed(client, step_dir, url, TOKEN.encode(), flows=1)
        finally:
            await client.close()

    assert asyncio.run(hand_over())["state"] == "verified"
    storage = S3Storage(url)
    try:
        committed = wait_for(
            lambda: [i for i in list_remote(storage) if i.status == "complete"], 30, "the replica in the bucket"
        )
    finally:
        storage.close()
    assert [info.name for info in committed] == ["step-000000007"]
    assert committed[0].manifest is not None and committed[0].manifest.files == load_manifest(step_dir).files
    wait_for(lambda: replica_area(receiver_vm) == [], 10, "the replica to be deleted once committed")
    assert receiver_vm.status()["peers"]["replicas"] == []
    assert not (receiver_vm.root / "step-000000007").exists()  # never taken for its own checkpoint


def test_a_replica_with_one_flipped_byte_is_rejected(receiver_vm: Vm, url: str, tmp_path: Path) -> None:
    step_dir = write_checkpoint(tmp_path / "sender", 8, {"a.bin": os.urandom(3 * MiB), "sub/b.bin": b"bytes"})

    async def send_flipped() -> str:
        client = await PeerClient.connect(*address(receiver_vm), TOKEN.encode())
        try:
            await client.open_replica(step_dir.name, url)
            data = bytearray((step_dir / "a.bin").read_bytes())
            data[MiB + 12345] ^= 0x01
            flipped = tmp_path / "a.bin.flipped"
            flipped.write_bytes(data)
            with flipped.open("rb", buffering=0) as file:  # in two ranges, as the handoff sends a file being written
                await client.send_part(file, "a.bin", len(data), 0, 2 * MiB)
                await client.send_part(file, "a.bin", len(data), 2 * MiB, len(data) - 2 * MiB)
            await client.send_file(step_dir / "sub" / "b.bin", "sub/b.bin")
            with pytest.raises(wire.PeerError) as caught:
                await client.commit(step_dir)
            return caught.value.message
        finally:
            await client.close()

    assert "a.bin: crc32c" in asyncio.run(send_flipped())
    wait_for(lambda: replica_area(receiver_vm) == [], 10, "the rejected replica to be removed")
    assert bucket_keys(url) == []


def test_names_buckets_and_sizes_are_bounded(receiver_vm: Vm, url: str, tmp_path: Path) -> None:
    where = address(receiver_vm)

    payload = tmp_path / "payload"
    payload.write_bytes(b"x" * 8)  # each frame below carries its one byte at its offset

    async def refused(*frames: dict[str, object], bucket: str = url) -> str:
        client = await PeerClient.connect(*where, TOKEN.encode())
        try:
            with pytest.raises(wire.PeerError) as caught, payload.open("rb", buffering=0) as file:
                await client.open_replica("step-000000009", bucket)
                for frame in frames:
                    await client.send_part(file, str(frame["name"]), int(frame["size"]), int(frame["offset"]), 1)  # type: ignore[call-overload]
                await client.query()  # an error, if any, comes back here
            # The replica went before the answer did, so a sender may open its next one at once.
            assert receiver_vm.status()["peers"]["replicas"] == []
            return caught.value.code
        finally:
            await client.close()

    assert asyncio.run(refused(bucket="s3://another-bucket/run")) == "bucket"
    assert asyncio.run(refused({"name": "../escape.bin", "size": 1, "offset": 0})) == "bad-path"
    assert asyncio.run(refused({"name": "/etc/passwd", "size": 1, "offset": 0})) == "bad-path"
    assert asyncio.run(refused({"name": "big.bin", "size": 1 << 41, "offset": 0})) == "too-large"
    assert asyncio.run(refused({"name": "a.bin", "size": 1, "offset": 5})) == "bad-field"
    wait_for(lambda: replica_area(receiver_vm) == [], 10, "unfinished replicas to be removed")
    assert bucket_keys(url) == [] and not (receiver_vm.dir / "escape.bin").exists()


def test_a_peer_with_its_own_hard_notice_is_not_chosen(receiver_vm: Vm, url: str) -> None:
    where = address(receiver_vm)

    async def choose() -> str | None:
        client = await choose_peer([("127.0.0.1", 1), where], TOKEN.encode(), url)  # the first is down
        if client is None:
            return None
        await client.close()
        return client.address

    assert asyncio.run(choose()) == f"{where[0]}:{where[1]}"
    request(receiver_vm.socket, "drill", deadline_s=60.0)
    assert asyncio.run(choose()) is None


def test_peers_without_a_token_are_a_config_error(tmp_path: Path, url: str) -> None:
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != wire.TOKEN_ENV}
    command = [sys.executable, "-m", "spotguard", "run", "--provider", "none", "--socket", str(tmp_path / "s.sock")]
    command += ["--checkpoint-dir", str(tmp_path / "ck"), "--state-dir", str(tmp_path / "st"), "--bucket", url]
    done = subprocess.run(
        [*command, "--peers", "127.0.0.1:7140"], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2 and "SPOTGUARD_PEER_TOKEN or peer_token_file" in done.stderr


def test_a_restarted_receiver_commits_verified_replicas_and_drops_unfinished_ones(tmp_path: Path, url: str) -> None:
    import json

    vm = Vm(tmp_path, "vm-r", url, extra_args=["--provider", "none", "--peer-listen", "127.0.0.1:0"])
    area = vm.root / AREA
    # What a receiver killed mid-upload leaves: one replica verified (manifest written), one still arriving.
    verified = write_checkpoint(area / "step-000000011-aaaa", 11, {"w.bin": os.urandom(MiB)})
    unfinished = write_checkpoint(area / "step-000000012-bbbb", 12, {"w.bin": os.urandom(MiB)})
    # And what no daemon writes: a record edited by hand (a name that is no text), a stray file.
    edited = write_checkpoint(area / "step-000000013-cccc", 13, {"w.bin": os.urandom(MiB)})
    for step_dir, state in ((verified, "verified"), (unfinished, "receiving"), (edited, "verified")):
        name = step_dir.name if step_dir is not edited else 13
        meta = {"name": name, "bucket": url, "sender": "127.0.0.1:1", "state": state}
        (step_dir.parent / "replica.json").write_text(json.dumps(meta))
    (area / "stray.txt").write_text("not a replica")
    vm.start_daemon(env={"SPOTGUARD_PEER_TOKEN": TOKEN})
    try:
        storage = S3Storage(url)
        try:
            committed = wait_for(
                lambda: [i.name for i in list_remote(storage) if i.status == "complete"], 30, "the verified replica"
            )
        finally:
            storage.close()
        assert committed == ["step-000000011"]
        wait_for(lambda: replica_area(vm) == [], 10, "the replica area to be empty")
        assert not any(key.startswith(("step-000000012", "step-000000013")) for key in bucket_keys(url))
    finally:
        vm.kill_daemon()


def test_a_node_s_share_of_a_multi_node_checkpoint_goes_to_the_bucket_without_a_manifest(
    receiver_vm: Vm, url: str, tmp_path: Path
) -> None:
    from spotguard.crc32c import crc32c_of_bytes
    from spotguard.manifest import FileEntry, write_part

    step_dir = tmp_path / "node1" / "step-000000021"
    step_dir.mkdir(parents=True)
    files = {"model.rank1.pt": os.urandom(2 * MiB), "optim/rank1.pt": os.urandom(MiB)}
    for rel, data in files.items():
        (step_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (step_dir / rel).write_bytes(data)
    write_part(step_dir, 1, 2, {rel: FileEntry(len(data), crc32c_of_bytes(data)) for rel, data in files.items()})

    async def hand_over() -> dict[str, object]:
        client = await PeerClient.connect(*address(receiver_vm), TOKEN.encode())
        try:
            await client.open_replica(step_dir.name, url)
            for rel in files:
                await client.ping()  # what a sender waiting for the trainer's next file sends
                await client.send_file(step_dir / rel, rel)
            return await client.commit(step_dir)
        finally:
            await client.close()

    assert asyncio.run(hand_over())["state"] == "verified"
    expected = sorted(f"step-000000021/{rel}" for rel in files)
    wait_for(lambda: bucket_keys(url) == expected, 30, "the share's files in the bucket")
    wait_for(lambda: replica_area(receiver_vm) == [], 10, "the replica to be deleted once uploaded")


def test_node_0_s_share_comes_with_the_job_s_manifest_committed_once_every_node_s_files_are_in(
    receiver_vm: Vm, url: str, tmp_path: Path
) -> None:
    from spotguard.crc32c import crc32c_of_bytes
    from spotguard.manifest import FileEntry, write_part

    # Node 0's disk: its own files, its part, and the job's manifest listing node 1's files as well.
    node0 = {"model.rank0.pt": os.urandom(2 * MiB), "ballast.rank0.pt": os.urandom(MiB)}
    node1 = {"model.rank1.pt": os.urandom(MiB)}
    step_dir = write_checkpoint(tmp_path / "node0", 31, {**node0, **node1})
    for rel in node1:
        (step_dir / rel).unlink()
    write_part(step_dir, 0, 2, {rel: FileEntry(len(data), crc32c_of_bytes(data)) for rel, data in node0.items()})

    async def hand_over() -> dict[str, object]:
        client = await PeerClient.connect(*address(receiver_vm), TOKEN.encode())
        try:
            await client.open_replica(step_dir.name, url)
            for rel in node0:
                await client.send_file(step_dir / rel, rel)
            return await client.commit(step_dir)
        finally:
            await client.close()

    assert asyncio.run(hand_over())["state"] == "verified"
    share_keys = sorted(f"{step_dir.name}/{rel}" for rel in node0)
    wait_for(lambda: bucket_keys(url) == share_keys, 30, "node 0's share in the bucket")
    assert replica_area(receiver_vm) != []  # held: the job's manifest waits for node 1's files

    storage = S3Storage(url)  # node 1's own daemon uploads its share
    try:
        for rel, data in node1.items():
            (tmp_path / rel).write_bytes(data)
            storage.put_file(tmp_path / rel, f"{step_dir.name}/{rel}", crc32c=crc32c_of_bytes(data))
        wait_for(
            lambda: [(i.name, i.status) for i in list_remote(storage)] == [(step_dir.name, "complete")],
            30,
            "the job's manifest committed by the peer",
        )
        remote = storage.read_bytes(f"{step_dir.name}/manifest.json")
    finally:
        storage.close()
    assert remote == (step_dir / "manifest.json").read_bytes()  # exactly what node 0 would have committed
    wait_for(lambda: replica_area(receiver_vm) == [], 10, "the replica to be deleted once committed")


FRAME_KINDS = ["ping", "query", "replica", "join", "done", "commit", "list", "fetch", "data", "bogus"]


def peer_frames(url: str) -> st.SearchStrategy[dict[str, Any]]:
    """Header frames an authenticated peer may send, each field of a type the receiver reads, with
    values no sender of ours sends. A data frame announces no payload (len 0): its bytes would
    otherwise be what the next header is read from."""
    texts = st.one_of(
        st.text(max_size=12),
        st.sampled_from(["step-000000009", "step-000000009\n", "w.bin", "../w.bin", "\x00", url, "s3://other/x"]),
    )
    numbers = st.one_of(st.integers(-2, 10), st.integers(-(2**70), 2**70))
    documents = st.one_of(
        texts,
        st.sampled_from(["{}", "[" * 5000 + "]" * 5000, '{"format": "spotguard/1", "step": 9, "files": {}}']),
        st.builds(
            lambda node, nodes: json.dumps({"node": node, "nodes": nodes, "files": {"w.bin": {"size": 1}}}),
            numbers,
            numbers,
        ),
    )
    fields = {
        "name": texts,
        "bucket": st.one_of(st.just(url), texts),
        "id": texts,
        "bytes": numbers,
        "size": numbers,
        "offset": numbers,
        "manifest": documents,
        "part": documents,
        "after": numbers,
    }
    return st.builds(
        lambda kind, chosen: {"t": kind, **chosen, **({"len": 0} if kind == "data" else {})},
        st.sampled_from(FRAME_KINDS),
        st.fixed_dictionaries({}, optional=fields),
    )


async def answered(client: PeerClient, sealed: bytearray) -> None:
    """Send one sealed frame and wait until the receiver took it: every answer comes before the state
    that a query after it gets. Raises what a refusal raises."""
    client.channel.write_sealed(sealed)
    client.channel.write(wire.encode({"t": "query"}))
    await client.channel.drain()
    while (await client.channel.read_frame(timeout=10))["t"] != "state":
        pass


async def as_a_peer(vm: Vm, send: Callable[[PeerClient], Awaitable[None]]) -> None:
    """``send`` on an authenticated connection to ``vm``'s receiver, until it is done or refused; then
    the next peer must be served. By its answer the first connection's handler has ended, and what it
    raised, if anything, is in the log."""
    client = await PeerClient.connect(*address(vm), TOKEN.encode())
    try:
        await send(client)
    except (wire.PeerError, ConnectionError, asyncio.IncompleteReadError):
        pass  # refused: the connection is over
    finally:
        await client.close()
    following = await PeerClient.connect(*address(vm), TOKEN.encode())
    try:
        assert (await following.query())["t"] == "state"
    finally:
        await following.close()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_sequence_of_frames_from_an_authenticated_peer_gets_the_protocols_answers(
    receiver_vm: Vm, url: str, data: st.DataObject
) -> None:
    """A peer that holds the token is not trusted with the receiver's state: whatever header frames it
    sends, in any order, each gets an answer or the protocol's error and the connection ends; no
    handler raises something else (a traceback in the log), and the receiver serves the next peer."""
    frames = data.draw(st.lists(peer_frames(url), min_size=1, max_size=5))

    async def send(client: PeerClient) -> None:
        for frame in frames:
            await answered(client, client.channel.seal(wire.encode(frame)))

    asyncio.run(as_a_peer(receiver_vm, send))
    # What the connection opened and did not finish goes with it: its slot and bytes are free again.
    wait_for(
        lambda: all(r["state"] != "receiving" for r in receiver_vm.status()["peers"]["replicas"]),
        10,
        "the connection's unfinished replica to go",
    )
    log = receiver_vm.log.read_text()
    assert "Traceback" not in log and "Unhandled exception" not in log, log[-3000:]


SMALL = 4096  # the largest payload an example sends: its bytes are what its header announces


def data_frames() -> st.SearchStrategy[tuple[dict[str, Any], bytes]]:
    """Data frames of a replica, each with its payload: names that try to leave the replica or are not
    canonical, ranges inside and outside their file, sizes that change from frame to frame. A frame
    announcing a payload it cannot carry (a length out of bounds) has none: it is refused before any
    payload would be read."""
    names = st.one_of(
        st.sampled_from(["w.bin", "d/w.bin", "../w.bin", "/tmp/w.bin", "d/../../w.bin", "./w.bin", "a\x00b", ""]),
        st.sampled_from(["manifest.json", "d//w.bin", "w.bin/", "x" * 300, "d/" * 60 + "w.bin", "w\nbin"]),
        st.text(max_size=8),
    )
    small = st.integers(0, SMALL)
    odd = st.sampled_from([-1, wire.MAX_DATA + 1, 2**63, 2**70])

    def frame(name: str, size: int, offset: int, length: int, fill: int) -> tuple[dict[str, Any], bytes]:
        header = {"t": "data", "name": name, "size": size, "offset": offset, "len": length}
        return header, bytes([fill]) * length if 0 <= length <= SMALL else b""

    number = st.one_of(small, odd)
    return st.builds(frame, names, number, number, number, st.integers(0, 255))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_data_frames_with_any_payload_stay_in_their_replica_and_get_the_protocols_answers(
    receiver_vm: Vm, url: str, data: st.DataObject
) -> None:
    """The data frames after a replica is opened carry payload the receiver writes to disk: whatever
    their names, ranges and order, each is written inside its replica or refused with the protocol's
    error, no handler raises something else, a commit of what was sent with a wrong checksum commits
    nothing, and what the connection held goes with it."""
    step = data.draw(st.integers(500, 999), label="step")
    name = f"step-{step:09d}"
    frames = data.draw(st.lists(data_frames(), min_size=1, max_size=6), label="frames")
    commit = data.draw(st.booleans(), label="commit")

    async def send(client: PeerClient) -> None:
        await client.open_replica(name, url)
        for header, payload in frames:
            await answered(client, client.channel.seal(wire.encode(header), payload))
        if commit:  # a manifest of the names sent, whose checksums cannot match
            files = {h["name"]: {"size": h["size"], "crc32c": "AAAAAA=="} for h, _ in frames}
            manifest = {"format": "spotguard/1", "step": step, "files": files}
            client.channel.write(wire.encode({"t": "commit", "manifest": json.dumps(manifest)}))
            await client.channel.drain()
            await client.channel.read_frame(timeout=10)

    asyncio.run(as_a_peer(receiver_vm, send))
    wait_for(lambda: replica_area(receiver_vm) == [], 10, "the connection's replica to go")
    assert not [key for key in bucket_keys(url) if key.startswith(name + "/")]
    escaped = [p for p in receiver_vm.dir.parent.rglob("*") if p.is_file() and p.name in ("w.bin", "b")]
    assert escaped == [], "a data frame's file outside its replica"
    log = receiver_vm.log.read_text()
    assert "Traceback" not in log and "Unhandled exception" not in log, log[-3000:]


def test_a_request_that_fails_inside_the_receiver_is_answered_internal_and_the_port_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug in one request's handler ended its connection without a word to the peer, its traceback
    only in the event loop's log. Now the peer hears ``internal``, the receiver logs the traceback, the
    connection's unfinished replica goes, and the next peer is served."""
    (tmp_path / "bucket").mkdir()
    url = (tmp_path / "bucket").as_uri()

    async def broken(*_: object) -> None:
        raise KeyError("a bug")

    async def scenario() -> str:
        receiver = PeerReceiver(tmp_path / "peer", FileStorage(url), token=TOKEN.encode(), host="127.0.0.1", port=0)
        receiver.handlers["broken"] = broken
        where = wire.parse_address(await receiver.start())
        try:
            client = await PeerClient.connect(*where, TOKEN.encode())
            try:
                await client.open_replica("step-000000003", url)
                client.channel.write(wire.encode({"t": "broken"}))
                await client.channel.drain()
                with pytest.raises(wire.PeerError) as refused:
                    await client.channel.read_frame(timeout=10)
            finally:
                await client.close()
            following = await PeerClient.connect(*where, TOKEN.encode())
            try:
                assert (await following.query())["t"] == "state"
            finally:
                await following.close()
            return refused.value.code
        finally:
            await receiver.close()

    with caplog.at_level(logging.INFO):
        assert asyncio.run(scenario()) == "internal"
    failures = [r for r in caplog.records if r.name == "spotguard.peers" and r.exc_info is not None]
    assert len(failures) == 1 and "internal error" in failures[0].getMessage()
    assert not [r for r in caplog.records if r.name == "asyncio" and r.levelno >= logging.ERROR]
    assert not list((tmp_path / "peer").rglob("step-000000003")), "the unfinished replica is left behind"
