"""Data frames carried by worker processes (spotguard/peer/workers.py), against a real daemon: the
bytes arrive whole and checked, and a changed record, a silent sender or a worker killed mid-frame
ends that connection only, keeps nothing, and leaves the daemon serving. A worker driven directly,
with a second thread overlapping a frame's steps and without: its frames are the ones sealed here,
and a changed record ends its receive at once."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import functools
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import google_crc32c
import pytest

from spotguard.harness import Vm, wait_for, worker_pids
from spotguard.peer import noise, wire, workers
from spotguard.peer.channel import Channel
from spotguard.peer.client import PeerClient
from spotguard.peer.fetch import fetch_replica, list_replicas
from spotguard.peer.flows import send_committed
from spotguard.peer.records import BATCH_RECORDS, FULL_RECORD, MAX_PLAINTEXT, records_of, seal_frame, sealed_size
from tests.checkpoints import write_checkpoint
from tests.peers import TOKEN as PEER_TOKEN
from tests.peers import address, bucket_keys, receiving_daemon, replica_area

TOKEN = PEER_TOKEN.encode()
IO_TIMEOUT = 2.0  # the receiver's deadline on a record (SPOTGUARD_PEER_IO_TIMEOUT)
MiB = 1 << 20


@pytest.fixture
def receiver_vm(tmp_path: Path, url: str) -> Iterator[Vm]:
    with receiving_daemon(tmp_path, url, {"SPOTGUARD_PEER_IO_TIMEOUT": str(IO_TIMEOUT)}) as vm:
        yield vm


def vm_pid(vm: Vm) -> int:
    assert vm.process is not None
    return vm.process.pid


def frames(vm: Vm) -> int:
    return int(vm.status()["peers"]["workers"]["frames"])


def hand_over(vm: Vm, step_dir: Path, url: str, flows: int = 1) -> dict[str, object]:
    async def go() -> dict[str, object]:
        client = await PeerClient.connect(*address(vm), TOKEN)
        try:
            return await send_committed(client, step_dir, url, TOKEN, flows=flows)
        finally:
            await client.close()

    return asyncio.run(go())


def warm_up(vm: Vm, url: str, tmp_path: Path) -> None:
    """Workers start on the first big frames (those go the in-process way meanwhile): hand over
    until frames crossed in workers on both sides, each replica committed and gone from the bucket."""
    step_dir = write_checkpoint(tmp_path / "warm", 1, {"w.bin": os.urandom(8 * MiB)})
    deadline = time.monotonic() + 60
    while not (frames(vm) and workers.pool().frames):
        assert time.monotonic() < deadline, "no worker process carried a frame"
        assert hand_over(vm, step_dir, url)["state"] == "verified"
        wait_for(lambda: vm.status()["peers"]["replicas"] == [], 30, "the warm-up replica committed")
    wait_for(lambda: bucket_keys(url) != [], 30, "the warm-up checkpoint in the bucket")


async def send_frame(client: PeerClient, url: str, name: str, edit: Callable[[bytearray], bytearray]) -> None:
    """Open a replica ``name`` and send one 1 MiB data frame of it, sealed, as ``edit`` leaves it."""
    await client.open_replica(name, url)
    header = {"t": "data", "name": "weights.bin", "size": MiB, "offset": 0, "len": MiB}
    sealed = client.channel.seal(wire.encode(header), os.urandom(MiB))
    client.channel.write_sealed(edit(sealed))
    await client.channel.drain()


def half(sealed: bytearray) -> bytearray:
    """The frame's first half, and then nothing: no more bytes, no FIN."""
    return sealed[: len(sealed) // 2]


def assert_nothing_kept(vm: Vm) -> None:
    wait_for(lambda: replica_area(vm) == [] and vm.status()["peers"]["replicas"] == [], 10, "no replica left")


def test_a_warmed_pool_has_its_workers_ready_before_a_frame_and_they_end_with_it() -> None:
    pool = workers.WorkerPool(2)
    try:
        pool.warm(5)  # at most the pool's size
        assert pool.status()["workers"] == 2
        wait_for(lambda: pool.status()["idle"] == 2, 30, "two workers ready")
        taken = [pool.take(), pool.take()]
        assert all(worker is not None for worker in taken)
        assert pool.take() is None and pool.status() == {"workers": 2, "bound": 2, "idle": 0, "busy": 2, "frames": 0}
        for worker in taken:
            assert worker is not None
            worker.release()
        processes = [worker.process for worker in taken if worker is not None]
    finally:
        pool.close()
    assert [process.poll() is not None for process in processes] == [True, True]


@contextlib.contextmanager
def two_taken_workers() -> Iterator[tuple[workers.WorkerPool, workers.Worker, workers.Worker]]:
    """A pool of two workers, both started and taken for a job; its idle time 1 s from then on."""
    # Long enough at first for both to start on a loaded machine, without the first one ending meanwhile.
    pool = workers.WorkerPool(2, retire_after=60.0)
    try:
        pool.warm(2)
        wait_for(lambda: pool.status()["idle"] == 2, 30, "two workers ready")
        first, second = pool.take(), pool.take()
        assert first is not None and second is not None
        pool.retire_after = 1.0
        yield pool, first, second
    finally:
        pool.close()


def test_idle_workers_end_after_a_while_and_a_busy_one_does_not() -> None:
    """A daemon runs for months: workers a notice started must not stay for the rest of them."""
    with two_taken_workers() as (pool, busy, other):
        other.release()  # idle from now on (and the pool's retiring thread woken to see the new bound)
        # The idle one ends; the one busy with a job (longer than the idle time) does not.
        wait_for(lambda: pool.status()["workers"] == 1, 30, "the idle worker to end")
        assert pool.status() == {"workers": 1, "bound": 2, "idle": 0, "busy": 1, "frames": 0}
        assert busy.process.poll() is None
        idle_from = time.monotonic()
        busy.release()
        wait_for(lambda: pool.status()["workers"] == 0, 30, "the worker given back to end")
        assert time.monotonic() - idle_from >= 1.0  # not before its idle time was up
        wait_for(lambda: busy.process.poll() is not None, 10, "its process to exit")
        # The pool starts workers again when asked (and keeps this one while the test looks).
        pool.retire_after = 60.0
        assert pool.take() is None
        wait_for(lambda: pool.status()["idle"] == 1, 30, "a fresh worker ready")


def test_workers_idle_one_behind_another_each_end_at_their_own_time() -> None:
    """The retiring thread is woken only when the first worker goes idle (a handoff gives one back at
    every frame): one that joins behind it is not woken for, and still ends after its own idle time."""
    with two_taken_workers() as (pool, first, second):
        first.release()  # the first idle one: the retiring thread is woken to wait for its time
        second_idle_from = time.monotonic()
        second.release()  # behind it: nothing the retiring thread waits for changes
        wait_for(lambda: pool.status()["workers"] == 0, 30, "both idle workers to end")
        assert time.monotonic() - second_idle_from >= 1.0  # not before its own idle time was up
        wait_for(lambda: first.process.poll() is not None and second.process.poll() is not None, 10, "both to exit")


def process_state(pid: int) -> str:
    """The state letter of ``/proc/PID/stat`` (``T``: stopped, ``Z``: ended), or ``gone``."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return "gone"


def queued_unread(control: socket.socket) -> int:
    """Bytes sent on ``control`` that its other end has not read yet (``SIOCOUTQ``)."""
    return struct.unpack("i", fcntl.ioctl(control, termios.TIOCOUTQ, b"\0" * 4))[0]


def test_a_worker_that_died_before_or_while_it_had_a_job_is_reported_as_ended() -> None:
    pool = workers.WorkerPool(2)
    try:
        pool.warm(2)
        wait_for(lambda: pool.status()["idle"] == 2, 30, "two workers ready")
        dead, stopped = pool.take(), pool.take()
        assert dead is not None and stopped is not None
        dead.process.kill()  # before its job is sent
        dead.process.wait()
        with pytest.raises(workers.WorkerLost, match="ended during a frame"):
            asyncio.run(dead.call({"t": "drop"}, []))
        stopped.process.send_signal(signal.SIGSTOP)  # its job waits unread, then it dies
        wait_for(lambda: process_state(stopped.process.pid) == "T", 10, "the worker stopped")
        with concurrent.futures.ThreadPoolExecutor(1) as executor:
            try:
                call = executor.submit(asyncio.run, stopped.call({"t": "drop"}, []))
                wait_for(lambda: queued_unread(stopped.control) > 0, 10, "the job queued to the stopped worker")
            finally:
                stopped.process.kill()  # the call's wait ends with it, whatever happened above
            with pytest.raises(workers.WorkerLost, match="ended during a frame"):
                call.result(timeout=10)
        stopped.process.wait()
        assert pool.status() == {"workers": 0, "bound": 2, "idle": 0, "busy": 0, "frames": 0}  # both counted as lost
    finally:
        pool.close()


def test_a_replica_opened_on_a_fresh_daemon_warms_its_workers_before_any_frame(receiver_vm: Vm, url: str) -> None:
    async def go() -> None:
        client = await PeerClient.connect(*address(receiver_vm), TOKEN)
        try:
            await client.open_replica("step-000000019", url)
            ready = min(2, os.cpu_count() or 1)
            wait_for(lambda: receiver_vm.status()["peers"]["workers"]["idle"] >= ready, 30, "workers ready")
        finally:
            await client.close()

    assert receiver_vm.status()["peers"]["workers"]["workers"] == 0  # none before: an idle daemon keeps none
    asyncio.run(go())
    assert frames(receiver_vm) == 0 and len(worker_pids(vm_pid(receiver_vm))) >= 1


def test_big_frames_cross_in_worker_processes_on_both_sides_and_arrive_whole(
    receiver_vm: Vm, url: str, tmp_path: Path
) -> None:
    warm_up(receiver_vm, url, tmp_path)
    files = {"a.bin": os.urandom(9 * MiB + 5), "b/c.bin": os.urandom(5 * MiB), "small.bin": os.urandom(1000)}
    step_dir = write_checkpoint(tmp_path / "sender", 200, files)
    theirs, ours = frames(receiver_vm), workers.pool().frames

    # Four flows at once: every file's CRC32C is checked by the receiver before it answers verified.
    assert hand_over(receiver_vm, step_dir, url, flows=4)["state"] == "verified"
    # Some of the 4 MiB frames crossed in workers on each side (a frame that finds every worker busy
    # goes in-process; the small file always does).
    assert frames(receiver_vm) > theirs and workers.pool().frames > ours
    assert worker_pids(vm_pid(receiver_vm))
    wait_for(lambda: any("step-000000200" in key for key in bucket_keys(url)), 30, "the replica committed")


def test_a_replica_fetched_back_crosses_in_workers_bit_for_bit(receiver_vm: Vm, url: str, tmp_path: Path) -> None:
    """A fresh VM fetching a replica (two connections, each its slice) receives and writes its big
    frames in this process's workers: the files are the sender's, byte for byte."""
    warm_up(receiver_vm, url, tmp_path)
    files = {"a.bin": os.urandom(10 * MiB + 3), "b.bin": os.urandom(6 * MiB)}
    step_dir = write_checkpoint(tmp_path / "sender", 18, files)

    async def hand_and_fetch() -> tuple[Path, int]:
        client = await PeerClient.connect(*address(receiver_vm), TOKEN)
        try:
            assert (await send_committed(client, step_dir, url, TOKEN, flows=1))["state"] == "verified"
            held = [item for item in await list_replicas(client) if item["name"] == step_dir.name]
            connect = functools.partial(PeerClient.connect, *address(receiver_vm), TOKEN)
            (tmp_path / "fresh").mkdir()
            ours = workers.pool().frames  # from here on, this process only receives
            fetched = await fetch_replica(client, held[0]["id"], tmp_path / "fresh", connect=connect, flows=2)
            return fetched, workers.pool().frames - ours
        finally:
            await client.close()

    fetched, received_in_workers = asyncio.run(hand_and_fetch())
    assert received_in_workers > 0
    for rel, data in files.items():
        assert (fetched / rel).read_bytes() == data, rel


def test_workers_outlive_the_signals_that_are_the_daemons_notices(receiver_vm: Vm, url: str, tmp_path: Path) -> None:
    """SIGTERM (a notice) and SIGINT (a terminal's, to the process group) are the daemon's to handle:
    its handoff still needs its workers, which end only with it."""
    warm_up(receiver_vm, url, tmp_path)
    pids = worker_pids(vm_pid(receiver_vm))
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGINT)
    step_dir = write_checkpoint(tmp_path / "sender", 17, {"weights.bin": os.urandom(8 * MiB)})
    carried = frames(receiver_vm)
    assert hand_over(receiver_vm, step_dir, url)["state"] == "verified"
    assert frames(receiver_vm) > carried  # by the same workers: none was started again
    assert set(worker_pids(vm_pid(receiver_vm))) >= set(pids)
    receiver_vm.kill_daemon()
    for pid in pids:  # the daemon's end of each pair closed: each worker ends
        wait_for(lambda pid=pid: process_state(pid) in ("gone", "Z"), 10, "the worker to end")


def test_a_worker_signalled_while_it_starts_still_starts_and_serves() -> None:
    """A notice's SIGTERM and a terminal's SIGINT may come while a worker's interpreter starts (workers
    start at a notice): it must not die of them, nor leave the pool without workers."""
    before = set(worker_pids(os.getpid()))
    pool = workers.WorkerPool(1)
    try:
        pool.warm(1)
        (pid,) = wait_for(lambda: set(worker_pids(os.getpid())) - before, 10, "the worker process")
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGINT)
        signalled_while_starting = pool.status()["idle"] == 0
        wait_for(lambda: pool.status()["idle"] == 1, 30, "the worker ready")
        worker = pool.take()
        assert worker is not None and worker.process.pid == pid and worker.process.poll() is None
        assert asyncio.run(worker.call({"t": "drop"}, [])) is None  # it serves jobs
        assert signalled_while_starting  # the signals did come before it was ready
    finally:
        pool.close()


def test_a_worker_whose_daemon_went_while_it_started_leaves_quietly() -> None:
    """A daemon stopped or killed just after a replica warmed its workers closes their pairs while their
    interpreters start: each worker died of a BrokenPipeError, its traceback in the daemon's log."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    command = [sys.executable, "-m", "spotguard.peer.workers", str(theirs.fileno())]
    process = subprocess.Popen(command, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    theirs.close()
    ours.close()  # before the worker's interpreter is up: its "ready" finds nobody
    _, errors = process.communicate(timeout=30)
    assert process.returncode == 0 and errors == b"", errors.decode()


def test_a_worker_that_cannot_start_leaves_frames_in_process_for_a_while_then_one_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A start that fails (a fork refused under memory pressure) must not cost the daemon its workers
    for the months it runs: none is tried again within the retry interval, then one is; the failure
    is logged once however many retries fail, and the recovery once."""
    retry_after = 3.0
    monkeypatch.setattr(workers, "RETRY_START_AFTER", retry_after)
    caplog.set_level(logging.INFO, "spotguard.peers")
    tries = tmp_path / "tries"
    failing = tmp_path / "python-that-fails"
    failing.write_text(f"#!/bin/sh\necho try >> {tries}\nexit 1\n")  # ends before it says ready
    failing.chmod(0o755)
    real_python = sys.executable
    monkeypatch.setattr(sys, "executable", str(failing))

    def starts_tried() -> int:
        return len(tries.read_text().splitlines()) if tries.exists() else 0

    def warnings() -> list[str]:
        return [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]

    pool = workers.WorkerPool(1)

    def idle_when_warmed() -> int:
        pool.warm(1)  # a notice routed to a peer, a replica opened: the pool is asked for workers
        return pool.status()["idle"]

    try:
        # The start fails after this moment, so the next try may come no sooner than it + retry_after.
        # (A time taken once the failure is seen lies later by however long seeing it took: on a loaded
        # machine the second try, on time, once came 0.5 ms before that time + retry_after.)
        asked_at = time.monotonic()
        pool.warm(1)
        wait_for(lambda: warnings() and pool.status()["workers"] == 0, 30, "the failed start")
        seen_at = time.monotonic()
        assert pool.take() is None and pool.status()["workers"] == 0  # no new try within the interval
        assert time.monotonic() - seen_at < retry_after  # (the check above ran inside it)
        assert starts_tried() == 1
        wait_for(lambda: idle_when_warmed() == 0 and starts_tried() == 2, 30, "a second try after the interval")
        wait_for(lambda: pool.status()["workers"] == 0, 30, "the second try failed")
        assert time.monotonic() - asked_at >= retry_after
        assert len(warnings()) == 1 and "tried again every 3 s" in warnings()[0]

        monkeypatch.setattr(sys, "executable", real_python)  # the node has room again
        wait_for(lambda: idle_when_warmed() == 1, 30, "a worker started again")
        worker = pool.take()
        assert worker is not None and asyncio.run(worker.call({"t": "drop"}, [])) is None  # it serves jobs
        assert starts_tried() == 2 and len(warnings()) == 1
        assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO] == [
            "peer worker processes start again"
        ]
    finally:
        pool.close()


def test_a_changed_record_in_a_workers_payload_ends_the_connection_and_keeps_nothing(
    receiver_vm: Vm, url: str, tmp_path: Path
) -> None:
    warm_up(receiver_vm, url, tmp_path)
    before = bucket_keys(url)

    async def go() -> wire.PeerError:
        client = await PeerClient.connect(*address(receiver_vm), TOKEN)
        try:

            def change(sealed: bytearray) -> bytearray:
                sealed[len(sealed) // 2] ^= 0x01  # a record of the payload, changed on the path
                return sealed

            await send_frame(client, url, "step-000000012", change)
            with pytest.raises(wire.PeerError) as caught:
                await wire.read_frame(client.channel)  # the receiver's error, sealed
            return caught.value
        finally:
            await client.close()

    assert asyncio.run(go()).code == "bad-record"
    assert_nothing_kept(receiver_vm)
    assert bucket_keys(url) == before
    # Still serving, workers and all.
    step_dir = write_checkpoint(tmp_path / "sender", 13, {"weights.bin": os.urandom(6 * MiB)})
    assert hand_over(receiver_vm, step_dir, url)["state"] == "verified"


def test_a_sender_silent_mid_payload_in_a_worker_is_dropped_within_the_deadline(
    receiver_vm: Vm, url: str, tmp_path: Path
) -> None:
    warm_up(receiver_vm, url, tmp_path)
    before = bucket_keys(url)

    async def go() -> float:
        client = await PeerClient.connect(*address(receiver_vm), TOKEN)
        try:
            await send_frame(client, url, "step-000000014", half)
            started = time.monotonic()
            wait_for(lambda: receiver_vm.status()["peers"]["workers"]["busy"] >= 1, 1, "a worker holding the frame")
            async with asyncio.timeout(IO_TIMEOUT + 10):
                with pytest.raises(wire.PeerError):
                    await wire.read_frame(client.channel)
            return time.monotonic() - started
        finally:
            await client.close()

    assert asyncio.run(go()) < IO_TIMEOUT + 3
    assert_nothing_kept(receiver_vm)
    assert bucket_keys(url) == before
    assert "too slow" in receiver_vm.log.read_text()


def test_a_worker_killed_mid_frame_ends_that_connection_only_and_is_replaced(
    receiver_vm: Vm, url: str, tmp_path: Path
) -> None:
    warm_up(receiver_vm, url, tmp_path)
    before = bucket_keys(url)

    async def go() -> float:
        client = await PeerClient.connect(*address(receiver_vm), TOKEN)
        try:
            await send_frame(client, url, "step-000000015", half)
            # A worker has the frame and waits for the rest of it.
            wait_for(lambda: receiver_vm.status()["peers"]["workers"]["busy"] >= 1, 10, "a worker busy")
            for pid in worker_pids(vm_pid(receiver_vm)):
                os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            async with asyncio.timeout(IO_TIMEOUT):
                with pytest.raises((wire.PeerError, OSError, asyncio.IncompleteReadError)):
                    await wire.read_frame(client.channel)
            return time.monotonic() - killed
        finally:
            await client.close()

    assert asyncio.run(go()) < 1.0  # at once, not at the record deadline
    assert "a peer worker process ended during a frame" in receiver_vm.log.read_text()
    assert_nothing_kept(receiver_vm)
    assert bucket_keys(url) == before
    # The daemon is still serving, and its new workers carry frames again.
    step_dir = write_checkpoint(tmp_path / "sender", 16, {"weights.bin": os.urandom(8 * MiB)})
    carried = frames(receiver_vm)
    deadline = time.monotonic() + 60
    while frames(receiver_vm) == carried:
        assert time.monotonic() < deadline, "no worker carried a frame after the kill"
        assert hand_over(receiver_vm, step_dir, url)["state"] == "verified"
        wait_for(lambda: receiver_vm.status()["peers"]["replicas"] == [], 30, "the replica committed")


@pytest.fixture(params=[True, False], ids=["beside", "in-turn"])
def direct_pool(request: pytest.FixtureRequest) -> Iterator[workers.WorkerPool]:
    """A pool of one worker, with a second thread that overlaps a frame's steps (the default where
    the cores outnumber the pool's workers) or without (its steps take turns)."""
    pool = workers.WorkerPool(1, beside=request.param)
    try:
        yield pool
    finally:
        pool.close()


def idle_worker(pool: workers.WorkerPool) -> workers.Worker:
    if pool.status()["workers"] == 0:
        pool.warm(1)
    wait_for(lambda: pool.status()["idle"] == 1, 30, "the worker ready")
    worker = pool.take()
    assert worker is not None
    return worker


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


KEY = bytes(range(32))


def send_beside(sock: socket.socket, data: bytes | bytearray) -> None:
    """``data`` sent on ``sock`` by a thread of its own (a socket pair holds less than a payload)."""
    threading.Thread(target=sock.sendall, args=(data,), daemon=True).start()


def test_a_frame_a_worker_seals_and_sends_is_the_frame_sealed_here(
    direct_pool: workers.WorkerPool, tmp_path: Path
) -> None:
    length = 3 * BATCH_RECORDS * MAX_PLAINTEXT + 777  # several batches
    data = os.urandom(length + 9)
    (tmp_path / "f").write_bytes(data)
    header = wire.encode({"t": "data", "name": "f", "size": len(data), "offset": 9, "len": length})
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    ours, theirs = socket.socketpair()
    try:
        expected = bytes(
            seal_frame(
                noise.CipherState(KEY, 40), header, fd, 9, length, out=bytearray(sealed_size(len(header), length))
            )
        )
        ours.setblocking(False)  # as the event loop's sockets are: the worker's waits have deadlines
        job = {"t": "send", "key": KEY, "n": 40, "timeout": 30.0, "header": header, "offset": 9, "length": length}
        worker = idle_worker(direct_pool)
        with concurrent.futures.ThreadPoolExecutor(1) as reader:
            received = reader.submit(lambda: theirs.recv(len(expected), socket.MSG_WAITALL))
            assert asyncio.run(worker.call(job, [ours.fileno(), fd])) is None
            assert received.result(timeout=30) == expected
        assert (threads_of(worker.process.pid) > 1) == direct_pool.beside
    finally:
        os.close(fd)
        ours.close()
        theirs.close()


def test_a_changed_record_ends_a_workers_receive_at_once_and_the_worker_serves_on(
    direct_pool: workers.WorkerPool, tmp_path: Path
) -> None:
    """The first batch holds a changed record and the sender then says nothing more: the worker
    answers bad-record at once (not at its 60 s deadline), then receives and writes the next payload."""
    payload = os.urandom(3 * BATCH_RECORDS * MAX_PLAINTEXT)
    sender = Channel(cast(Any, None), cast(Any, None), noise.CipherState(KEY), noise.CipherState(KEY))
    sealed = bytearray(sender.seal(payload))
    good = bytes(sender.seal(payload))  # the next nonces: what the second job opens
    sealed[300] ^= 0x01
    ours, theirs = socket.socketpair()
    try:
        ours.setblocking(False)
        send_beside(theirs, sealed[: BATCH_RECORDS * FULL_RECORD + 100])  # then silence, the socket left open
        job = {"t": "receive", "key": KEY, "n": 0, "timeout": 60.0, "ahead": b"", "length": len(payload)}
        started = time.monotonic()
        with pytest.raises(wire.PeerError) as caught:
            asyncio.run(idle_worker(direct_pool).call(job, [ours.fileno()], more=True))
        assert caught.value.code == "bad-record"
        assert time.monotonic() - started < 10
    finally:
        ours.close()
        theirs.close()
    ours, theirs = socket.socketpair()
    try:
        ours.setblocking(False)
        send_beside(theirs, good[100:])
        worker = idle_worker(direct_pool)
        job = {
            "t": "receive",
            "key": KEY,
            "n": records_of(len(payload)),
            "timeout": 30.0,
            "ahead": good[:100],
            "length": len(payload),
        }
        asyncio.run(worker.call(job, [ours.fileno()], more=True))
        crc = asyncio.run(worker.call({"t": "write", "path": str(tmp_path / "out"), "offset": 0}, []))
        assert (tmp_path / "out").read_bytes() == payload
        assert crc == google_crc32c.value(payload)
    finally:
        ours.close()
        theirs.close()


def test_a_caller_cancelled_mid_job_leaves_its_worker_to_finish_and_serve_on(direct_pool: workers.WorkerPool) -> None:
    """A handler cancelled while its worker waits on a silent peer (a connection lost, a daemon
    stopping): the cancellation is the caller's at once; the job ends when the socket is shut, its
    answer is still read, and the worker goes back to its pool, serving the next job, not lost."""
    ours, theirs = socket.socketpair()
    worker = idle_worker(direct_pool)
    fds_before = len(os.listdir(f"/proc/{worker.process.pid}/fd"))

    async def cancel_mid_job() -> None:
        job = {"t": "receive", "key": KEY, "n": 0, "timeout": 60.0, "ahead": b"", "length": 4 * MAX_PLAINTEXT}
        call = asyncio.ensure_future(worker.call(job, [ours.fileno()], more=True))
        deadline = time.monotonic() + 30
        while len(os.listdir(f"/proc/{worker.process.pid}/fd")) <= fds_before:  # it holds the socket
            assert time.monotonic() < deadline, "the worker never took its job"
            await asyncio.sleep(0.01)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert direct_pool.exchanges  # the job goes on without its caller
        ours.shutdown(socket.SHUT_RDWR)  # what run_handed does on a cancellation
        done, _ = await asyncio.wait(set(direct_pool.exchanges), timeout=30)
        assert done and not direct_pool.exchanges

    try:
        started = time.monotonic()
        asyncio.run(cancel_mid_job())
        assert time.monotonic() - started < 20  # not the job's 60 s deadline
        assert direct_pool.status() == {"workers": 1, "bound": 1, "idle": 1, "busy": 0, "frames": 0}
        again = direct_pool.take()
        assert again is worker and worker.process.poll() is None
        assert asyncio.run(worker.call({"t": "drop"}, [])) is None  # it serves jobs
    finally:
        ours.close()
        theirs.close()
