"""What the peer port costs the daemon, against a real receiver: big frames from a token holder,
floods of refused strangers, idle strangers from many addresses churning the handshake pool, and a
worker process started where another local user can write."""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotguard.harness import Vm, wait_for
from spotguard.manifest import MANIFEST
from spotguard.peer import wire, workers
from spotguard.peer.client import PeerClient
from spotguard.peer.handshake import GREETING
from spotguard.peer.receiver import HANDSHAKE_POOL
from tests.checkpoints import write_checkpoint
from tests.peers import TOKEN as PEER_TOKEN
from tests.peers import address, hand_over, receiving_daemon

TOKEN = PEER_TOKEN.encode()
MiB = 1 << 20


@pytest.fixture
def receiver_vm(tmp_path: Path, url: str) -> Iterator[Vm]:
    with receiving_daemon(tmp_path, url, {"SPOTGUARD_PEER_IO_TIMEOUT": "2"}) as vm:
        yield vm


async def until_closed(reader: asyncio.StreamReader, timeout: float = 10.0) -> None:
    """Read what the receiver still sends until it closes the connection (it must, within ``timeout``)."""
    async with asyncio.timeout(timeout):
        with contextlib.suppress(ConnectionResetError):
            while await reader.read(65536):
                pass


# --- a token holder's big frames -------------------------------------------------------------------


def test_only_the_openers_commit_may_be_a_big_frame(receiver_vm: Vm, url: str, tmp_path: Path) -> None:
    """A 1 MiB ping is refused (``too-large``) before it is parsed, with or without a replica opened
    on the connection; a real commit whose manifest is over the small limit is still taken."""
    where = address(receiver_vm)
    big_ping = wire.encode({"t": "ping", "x": "a" * MiB})

    async def answer_to_big_ping(open_replica: bool) -> str:
        client = await PeerClient.connect(*where, TOKEN)
        try:
            if open_replica:
                await client.open_replica("step-000000021", url)
            client.channel.write(big_ping)
            try:
                await client.channel.drain()
                await client.query()
            except wire.PeerError as exc:
                return exc.code
            except ConnectionError:
                # Refused before its body was read: the kernel may answer the unread rest with a reset,
                # which can overtake the error frame. The receiver's count says what it did.
                return "reset"
            return "answered"
        finally:
            await client.close()

    refused_before = receiver_vm.status()["peers"]["refused"]
    assert asyncio.run(answer_to_big_ping(open_replica=False)) in ("too-large", "reset")
    assert asyncio.run(answer_to_big_ping(open_replica=True)) in ("too-large", "reset")
    assert receiver_vm.status()["peers"]["refused"] == refused_before + 2
    wait_for(lambda: receiver_vm.status()["peers"]["replicas"] == [], 10, "the refused replica dropped")

    files = {f"{'d' * 200}/{index:04d}.bin": bytes([index % 256]) for index in range(400)}
    step_dir = write_checkpoint(tmp_path / "sender", 22, files)
    assert (step_dir / MANIFEST).stat().st_size > wire.MAX_HEADER

    assert hand_over(where, step_dir, url, TOKEN)["state"] == "verified"


# --- a worker's import path ------------------------------------------------------------------------


def test_a_worker_never_imports_a_package_planted_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``spotguard`` package in the daemon's working directory (which another local user may be
    able to write) is not what its worker processes import: they start and serve."""
    planted = tmp_path / "cwd" / "spotguard"
    planted.mkdir(parents=True)
    ran = tmp_path / "planted-code-ran"
    (planted / "__init__.py").write_text(f"open({str(ran)!r}, 'w').close()\nraise SystemExit(0)\n")
    monkeypatch.chdir(planted.parent)
    pool = workers.WorkerPool(1)
    try:
        pool.warm(1)
        wait_for(lambda: ran.exists() or pool.status()["idle"] == 1, 30, "a worker started, or the planted code")
        assert not ran.exists()
        worker = pool.take()
        assert worker is not None and worker.process.poll() is None
        worker.release()
    finally:
        pool.close()


# --- strangers without the token -------------------------------------------------------------------


def test_a_flood_of_refused_strangers_logs_one_line_and_counts_each(receiver_vm: Vm) -> None:
    """200 connections from 200 addresses, each a message 1 under another key: every one is refused
    and counted, and the log says so once (then once a minute, with a count), not 200 times."""
    where = address(receiver_vm)

    async def knock(count: int) -> None:
        for index in range(count):
            source = f"127.0.{2 + index // 100}.{2 + index % 100}"
            reader, writer = await asyncio.open_connection(*where, local_addr=(source, 0))
            writer.write(struct.pack(">H", 48) + os.urandom(48))
            await writer.drain()
            await until_closed(reader)
            writer.close()

    asyncio.run(knock(200))
    wait_for(lambda: receiver_vm.status()["peers"]["refused"] == 200, 10, "every refusal counted")
    assert receiver_vm.log.read_text().count("authentication failed") == 1


def test_idle_strangers_from_many_addresses_never_turn_a_peer_away(receiver_vm: Vm) -> None:
    """40 addresses each hold an idle connection and reconnect as soon as it is dropped: a peer's 20
    handshakes meanwhile all get through (before, about half were dropped for a newcomer). Each
    stranger dropped for a newcomer is a refusal: counted, and logged once, not once a drop."""
    where = address(receiver_vm)
    stop = threading.Event()
    connects = [0]

    async def hold(source: str) -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError, TimeoutError):
                reader, writer = await asyncio.open_connection(*where, local_addr=(source, 0))
                connects[0] += 1
                try:
                    async with asyncio.timeout(6.0):  # past the handshake deadline: held until dropped
                        await reader.read()
                finally:
                    writer.close()

    async def strangers() -> None:
        tasks = [asyncio.ensure_future(hold(f"127.1.{index}.1")) for index in range(40)]
        while not stop.is_set():
            await asyncio.sleep(0.05)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def peer() -> int:
        for _ in range(20):
            client = await PeerClient.connect(*where, TOKEN)
            try:
                assert (await client.query())["t"] == "state"
            finally:
                await client.close()
            await asyncio.sleep(0.1)  # a stranger's turn between two: the pool keeps churning
        return 20

    thread = threading.Thread(target=asyncio.run, args=(strangers(),))
    thread.start()
    try:
        wait_for(lambda: connects[0] >= 100, 30, "the strangers churning the pool")
        assert asyncio.run(peer()) == 20
    finally:
        stop.set()
        thread.join()
    # Each stranger's connect beyond the pool's 16 places closed another stranger's connection for it
    # (or was turned away, or ran into the 5 s deadline): a refusal each. Left out: what each stranger
    # still held when it stopped (one connection each, in the pool or not yet accepted), which it
    # closed itself.
    assert receiver_vm.status()["peers"]["refused"] >= connects[0] - HANDSHAKE_POOL - 40
    log = receiver_vm.log.read_text()
    assert log.count("still in its handshake while newer ones wait") == 1, log[-2000:]


def unread_by_receiver(listen_port: int, peer_ports: set[int]) -> int | None:
    """Bytes the kernel holds for the receiver on its connections from ``peer_ports`` (its end's
    receive queue, ``/proc/net/tcp``), not read yet; None until it has accepted them all."""
    queued, seen = 0, set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, queues = (int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16), fields[4])
        if local == listen_port and remote in peer_ports:
            seen.add(remote)
            queued += int(queues.split(":")[1], 16)
    return queued if seen == peer_ports else None


def test_a_peer_turned_away_by_a_pool_of_fresh_handshakes_gets_in_on_a_later_try(receiver_vm: Vm) -> None:
    """The pool is full of handshakes that have begun (a byte of their first message each, read by
    the receiver) and are younger than a stall: a newcomer is turned away (busy), as no place may go.
    The peer tries again (HANDSHAKE_RETRY_PAUSES) and gets in once those have stalled; before, it gave
    up at the first refusal, and its handoff went to another peer or the bucket."""
    where = address(receiver_vm)

    async def scenario() -> str:
        held = []
        for _ in range(HANDSHAKE_POOL):
            reader, writer = await asyncio.open_connection(*where)
            writer.write(b"\x00")  # its first message begun: not silent
            await writer.drain()
            held.append((reader, writer))
        try:
            ports = {writer.get_extra_info("sockname")[1] for _, writer in held}
            for reader, _ in held:  # each accepted: its greeting came
                await reader.readexactly(len(GREETING))
            await asyncio.to_thread(wait_for, lambda: unread_by_receiver(where[1], ports) == 0, 10, "the bytes read")
            client = await PeerClient.connect(*where, TOKEN)
            try:
                return str((await client.query())["t"])
            finally:
                await client.close()
        finally:
            for _, writer in held:
                writer.close()

    assert asyncio.run(scenario()) == "state"
    assert receiver_vm.status()["peers"]["refused"] >= 1  # turned away at least once before it got in
