"""The protected peer channel against a real receiver daemon (moto as the shared bucket): a relayed
handshake, records changed on the path, idle strangers, a silent sender, an old daemon. Each case
shows that nothing of it reaches the replica area or the bucket."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from spotguard.harness import Vm, wait_for
from spotguard.peer import wire
from spotguard.peer.client import PeerClient
from spotguard.peer.flows import send_committed
from spotguard.peer.handshake import PROTOCOL
from spotguard.peer.receiver import HANDSHAKE_POOL, HANDSHAKES_PER_SOURCE
from tests.checkpoints import write_checkpoint
from tests.peers import TOKEN as PEER_TOKEN
from tests.peers import address, bucket_keys, hand_over, receiving_daemon, replica_area

TOKEN = PEER_TOKEN.encode()
IO_TIMEOUT = 2.0  # the receiver's deadline on a record (SPOTGUARD_PEER_IO_TIMEOUT)
KiB = 1 << 10


@pytest.fixture
def receiver_vm(tmp_path: Path, url: str) -> Iterator[Vm]:
    with receiving_daemon(tmp_path, url, {"SPOTGUARD_PEER_IO_TIMEOUT": str(IO_TIMEOUT)}) as vm:
        yield vm


def assert_nothing_kept(vm: Vm, url: str) -> None:
    wait_for(lambda: replica_area(vm) == [] and vm.status()["peers"]["replicas"] == [], 10, "no replica left")
    assert bucket_keys(url) == []


async def read_message(reader: asyncio.StreamReader) -> bytes:
    """One handshake message or record, with its 2-byte length."""
    head = await reader.readexactly(2)
    return head + await reader.readexactly(struct.unpack(">H", head)[0])


async def read_greeting(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readexactly(4)
    return head + await reader.readexactly(struct.unpack(">I", head)[0])


async def until_closed(reader: asyncio.StreamReader, timeout: float = 10.0) -> bytes:
    """What the other side still sends until it closes the connection (it must, within ``timeout``)."""
    received = b""
    async with asyncio.timeout(timeout):
        while True:
            try:
                chunk = await reader.read(65536)
            except ConnectionResetError:
                return received
            if not chunk:
                return received
            received += chunk


# --- 1. a relayed handshake, and records changed on the path ------------------------------------


def test_a_relayed_handshake_gives_the_relay_no_session(receiver_vm: Vm, url: str) -> None:
    """An attacker without the token that a daemon connects to relays the receiver's handshake
    messages to it and its answers back (the v1 relay attack), then drops the daemon and speaks
    itself: whatever it sends, forged, replayed or in clear, the receiver ends the connection."""
    where = address(receiver_vm)

    async def relay(forward_first_record: bool, own: Callable[[bytes], bytes]) -> bytes:
        answered: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        async def on_daemon(daemon_in: asyncio.StreamReader, daemon_out: asyncio.StreamWriter) -> None:
            peer_in, peer_out = await asyncio.open_connection(*where)
            daemon_out.write(await read_greeting(peer_in))
            peer_out.write(await read_message(daemon_in))  # -> psk, e
            daemon_out.write(await read_message(peer_in))  # <- e, ee
            first = await read_message(daemon_in)  # the daemon's first record (a ping)
            if forward_first_record:
                peer_out.write(first)
            daemon_out.transport.abort()  # the daemon is dropped: the relay speaks on its own now
            peer_out.write(own(first))
            answered.set_result(await until_closed(peer_in))
            peer_out.close()

        server = await asyncio.start_server(on_daemon, "127.0.0.1", 0)
        try:
            daemon = await PeerClient.connect("127.0.0.1", server.sockets[0].getsockname()[1], TOKEN)
            await daemon.close()  # the real daemon did complete a handshake, through the relay
            return await asyncio.wait_for(answered, 15)
        finally:
            server.close()

    frames = wire.encode({"t": "list"}) + wire.encode({"t": "replica", "name": "step-000000001", "bucket": url})
    forged = struct.pack(">H", 64) + os.urandom(64)
    refused_before = receiver_vm.status()["peers"]["refused"]
    # Without the daemon's first record the relay is not authenticated at all: refused in clear.
    assert b'"code":"auth"' in asyncio.run(relay(False, lambda first: forged))
    assert b'"code":"auth"' in asyncio.run(relay(False, lambda first: frames))
    assert b'"code":"auth"' in asyncio.run(relay(False, lambda first: first[:-1] + bytes([first[-1] ^ 1])))
    # With it, the daemon's session exists, but the relay has no key: its own records, a replay of
    # the daemon's, or frames in clear end it; what comes back is sealed (no "replicas" frame in clear).
    for own in (lambda first: forged, lambda first: first, lambda first: frames):
        answer = asyncio.run(relay(True, own))
        assert b"replicas" not in answer and b"step-" not in answer
    assert receiver_vm.status()["peers"]["refused"] == refused_before + 6
    assert_nothing_kept(receiver_vm, url)
    log = receiver_vm.log.read_text()
    assert "authentication failed" in log and "bad-record" in log and TOKEN.decode() not in log


Mutation = Callable[[list[bytes]], list[bytes]]


# The records of a data frame as they leave the sender: its header, then its payload's records.
def flip(records: list[bytes]) -> list[bytes]:
    record = bytearray(records[2])
    record[100] ^= 0x10
    return [*records[:2], bytes(record), *records[3:]]


def replay(records: list[bytes]) -> list[bytes]:
    return [*records[:3], records[2], *records[3:]]


def reorder(records: list[bytes]) -> list[bytes]:
    return [*records[:2], records[3], records[2], *records[4:]]


def inject(records: list[bytes]) -> list[bytes]:
    return [*records[:2], struct.pack(">H", 200) + os.urandom(200), *records[2:]]


def drop(records: list[bytes]) -> list[bytes]:
    return [*records[:2], *records[3:]]


@pytest.mark.parametrize("mutate", [flip, replay, reorder, inject, drop])
def test_a_record_changed_on_the_path_ends_the_connection_and_its_replica(
    receiver_vm: Vm, url: str, tmp_path: Path, mutate: Mutation
) -> None:
    """A relay on the path passes a real handoff through, but changes the sender's records once its
    data flows (a bit flipped, one replayed, two swapped, one injected, one dropped): the receiver
    ends the connection, drops the replica, and nothing reaches the bucket."""
    where = address(receiver_vm)
    step_dir = write_checkpoint(tmp_path / "sender", 7, {"weights.bin": os.urandom(512 * KiB)})

    async def handoff_through_relay() -> BaseException | None:
        async def on_daemon(daemon_in: asyncio.StreamReader, daemon_out: asyncio.StreamWriter) -> None:
            peer_in, peer_out = await asyncio.open_connection(*where)

            async def back() -> None:  # receiver -> daemon, unchanged
                while data := await peer_in.read(65536):
                    daemon_out.write(data)
                daemon_out.close()

            back_task = asyncio.create_task(back())
            peer_out.write(await read_message(daemon_in))  # -> psk, e
            records: list[bytes] = []
            try:
                for _ in range(2):  # the first record (a ping) and the replica request, unchanged
                    peer_out.write(await read_message(daemon_in))
                while len(records) < 6:  # the data frame's header, then its payload's records
                    records.append(await read_message(daemon_in))
                for record in mutate(records):
                    peer_out.write(record)
                while data := await daemon_in.read(65536):
                    peer_out.write(data)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            await asyncio.wait_for(back_task, 15)

        server = await asyncio.start_server(on_daemon, "127.0.0.1", 0)
        try:
            client = await PeerClient.connect("127.0.0.1", server.sockets[0].getsockname()[1], TOKEN)
            try:
                await asyncio.wait_for(send_committed(client, step_dir, url, TOKEN, flows=1), 15)
            except (wire.PeerError, OSError) as exc:
                return exc
            finally:
                await client.close()
            return None
        finally:
            server.close()

    assert asyncio.run(handoff_through_relay()) is not None  # the sender learns it was not handed
    assert_nothing_kept(receiver_vm, url)
    log = receiver_vm.log.read_text()
    # A record that fails to decrypt, or (a record dropped from a batch of full ones) the bytes still
    # missing at the record deadline.
    assert "bad-record" in log or "too slow" in log


# --- 2. idle strangers ----------------------------------------------------------------------------


def test_idle_strangers_never_keep_a_jobs_peer_out(receiver_vm: Vm, url: str, tmp_path: Path) -> None:
    """50 sockets that connect and say nothing (half from the peer's own address, half from 25
    others): the receiver keeps at most its handshake pool of them, and a real peer's checkpoint is
    handed over while they are all still connected."""
    where = address(receiver_vm)
    step_dir = write_checkpoint(tmp_path / "sender", 9, {"weights.bin": os.urandom(256 * KiB)})
    idle = []
    for index in range(50):
        sock = socket.socket()
        sock.bind(("127.0.0.1" if index % 2 else f"127.0.0.{2 + index // 2}", 0))
        sock.connect(where)
        idle.append(sock)

    try:
        assert replica_area(receiver_vm) == [] and bucket_keys(url) == []  # strangers leave nothing
        still_open = [sock for sock in idle if is_open(sock)]
        assert 0 < len(still_open) <= HANDSHAKE_POOL  # held, within the pool
        assert sum(sock.getsockname()[0] == "127.0.0.1" for sock in still_open) <= HANDSHAKES_PER_SOURCE
        assert hand_over(where, step_dir, url, TOKEN)["state"] == "verified"  # served meanwhile
        # and the rest go at the handshake deadline
        wait_for(lambda: not any(is_open(sock) for sock in still_open), 15, "the strangers dropped")
    finally:
        for sock in idle:
            sock.close()


def is_open(sock: socket.socket) -> bool:
    """Whether the receiver still holds ``sock`` (it sent its greeting, then nothing, and no close)."""
    sock.settimeout(0.05)
    try:
        while True:
            if not sock.recv(65536):
                return False
    except TimeoutError:
        return True
    except OSError:
        return False


# --- 3. a silent sender ---------------------------------------------------------------------------


def test_a_sender_silent_mid_payload_is_dropped_within_the_deadline(receiver_vm: Vm, url: str, tmp_path: Path) -> None:
    """A sender that stops in the middle of a record of its payload, without closing: within the
    receiver's deadline its connection ends and its replica slot is free again."""
    where = address(receiver_vm)

    async def go() -> float:
        client = await PeerClient.connect(*where, TOKEN)
        try:
            await client.open_replica("step-000000011", url)
            wait_for(lambda: len(receiver_vm.status()["peers"]["replicas"]) == 1, 5, "the replica opened")
            # Idle between requests (a sender waiting for its trainer) is not silence mid-record: the
            # connection outlives the record deadline there (the idle limit is 30 s).
            await asyncio.sleep(IO_TIMEOUT + 1.5)  # the time itself is what is tested
            assert (await client.query())["replicas"] == 1
            header = {"t": "data", "name": "weights.bin", "size": 1 << 20, "offset": 0, "len": 1 << 20}
            sealed = client.channel.seal(wire.encode(header), os.urandom(300 * KiB))
            client.channel.write_sealed(sealed[:-1000])  # and then nothing: no more bytes, no FIN
            await client.channel.drain()
            started = time.monotonic()
            async with asyncio.timeout(IO_TIMEOUT + 10):
                with pytest.raises(wire.PeerError):  # the receiver ends it (its error comes sealed)
                    await wire.read_frame(client.channel)
            return time.monotonic() - started
        finally:
            await client.close()

    assert asyncio.run(go()) < IO_TIMEOUT + 3
    assert_nothing_kept(receiver_vm, url)
    assert "too slow" in receiver_vm.log.read_text()


# --- 4. an old daemon ------------------------------------------------------------------------------


def test_a_v1_daemon_is_refused_with_a_clear_message_on_both_sides(receiver_vm: Vm, url: str) -> None:
    """A spotguard-peer/1 sender reads this receiver's greeting as a version error; a v2 sender that
    reaches a v1 receiver (a challenge) says so, and tells that receiver why."""
    where = address(receiver_vm)

    async def v1_sender() -> wire.PeerError:
        reader, writer = await asyncio.open_connection(*where)
        try:
            with pytest.raises(wire.PeerError) as caught:
                await wire.read_frame(reader, 1024)  # v1 waits for {"t": "challenge"}
            return caught.value
        finally:
            writer.close()

    refused = asyncio.run(v1_sender())
    assert refused.code == "version" and PROTOCOL in refused.message and "upgrade" in refused.message
    wait_for(lambda: "closed the connection before its handshake" in receiver_vm.log.read_text(), 5, "the log")

    async def v1_receiver() -> tuple[wire.PeerError, wire.PeerError]:
        told: asyncio.Future[wire.PeerError] = asyncio.get_running_loop().create_future()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(wire.encode({"t": "challenge", "v": 1, "nonce": "0" * 32}))
            try:
                await wire.read_frame(reader, 1024)
            except wire.PeerError as exc:
                told.set_result(exc)
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        try:
            with pytest.raises(wire.PeerError) as caught:
                await PeerClient.connect("127.0.0.1", server.sockets[0].getsockname()[1], TOKEN)
            return caught.value, await asyncio.wait_for(told, 5)
        finally:
            server.close()

    ours, theirs = asyncio.run(v1_receiver())
    assert ours.code == "version" and "peer speaks spotguard-peer/1; this daemon needs /2" in ours.message
    assert theirs.code == "version" and PROTOCOL in theirs.message
    assert_nothing_kept(receiver_vm, url)
