"""Worker processes that carry a peer connection's data frames, so that each flow gets a core.

A daemon's peer connections share one event loop and one GIL. Measured on 16 cores, that held a
four-flow handoff to 1.5 GB/s against 6-7 GB/s for a plain copy over four connections: every byte
is received (or read), sealed or opened and written under one interpreter, a record at a time,
and threads do not help (the records' Python steps serialize on the GIL). A data frame's payload
is the bulk of a connection's bytes and needs nothing from the loop while it crosses, so it is
handed to a worker process: the loop advances its own nonce counter past the records the frame
takes, then sends the worker the socket (``SCM_RIGHTS``), the direction's key and the frame's first
nonce and the frame's place in its file; the worker seals and sends (or receives and opens, then
writes on the loop's word) the frame and answers, while the loop carries on with the connection.
Nothing else crosses: the worker's answer is a CRC32C or an error.

An idle daemon keeps no workers. They start (a Python process each, ~0.1 s) when they will be
needed: at a notice routed to a peer, when a replica opens or a fetch connects, and on a big frame
that finds none free (it goes the in-process way meanwhile); up to one per core the daemon may keep
busy (its affinity, capped by its cgroup's CPU quota: spotguard/cpus.py) and :data:`MAX_WORKERS`;
one that dies is replaced. One idle for :data:`RETIRE_IDLE_AFTER` ends: a
daemon runs for months between the rare minutes that need its workers, and each holds an interpreter
(35 MiB resident) and up to 10 MiB of frame buffers; the next notice warms the pool again. One that
cannot start (a fork refused under memory pressure, a full process table) sends frames the
in-process way for :data:`RETRY_START_AFTER` seconds, then the pool tries again: a daemon runs for
months, and a failure at one notice must not cost every later handoff its workers. A worker reads
jobs only from its own socket pair with the daemon, inherits nothing else, and ends when the
daemon's end closes. The socket a job carries is shut down by the loop if the connection is lost or
its handler cancelled, which ends the worker's wait at once; every wait in the worker also has the
connection's deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from spotguard.cpus import usable_cores
from spotguard.errors import SpotguardError
from spotguard.peer import noise, wire
from spotguard.peer.files import write_at
from spotguard.peer.records import batch_buffers, open_payload, seal_batches
from spotguard.peer.sockio import HandedSocket

logger = logging.getLogger("spotguard.peers")

# Two per flow of a handoff's bound (flows.MAX_FLOWS, 8): a receiving flow holds one worker receiving
# its next frame and one writing the last. With 8, a receiver of eight flows received a third of
# their frames in-process; with 16, all, and twice the throughput on 16 cores (BENCHMARKS.md).
MAX_WORKERS = 16
# Above this many cores each worker keeps a second thread: on 16 cores four flows carried 15 % more
# with it; on 2, one flow carried 15-25 % less (BENCHMARKS.md).
BESIDE_FROM_CORES = 8
# Payloads at least this big go to a worker; smaller ones are not worth the round trip (~0.1 ms).
WORKER_PAYLOAD = 256 * 1024
# Seconds a worker may stay idle before it ends (the most recently used are taken first, so that the
# pool shrinks to what the traffic needs). Longer than a handoff's gaps between frames by far.
RETIRE_IDLE_AFTER = 300.0
_READY = b"ready"
_MAX_MESSAGE = 64 * 1024  # a job (a frame's header, up to 4 KiB read ahead) or an answer
_START_TIMEOUT = 30.0
# After a worker could not start, the in-process way for this long before the pool tries again: a
# few tries within an AWS notice's two minutes, and no retry storm while the node is out of memory.
RETRY_START_AFTER = 30.0
_FRAME_JOBS = ("send", "receive")
_BESIDE = "beside"  # the worker's argument: overlap a frame's steps in a second thread
# A notice's signal is the daemon's to handle, and its handoff still needs the workers: they ignore
# these from their first instruction on, and end when the daemon's end of their socket pair closes.
_NOTICE_SIGNALS = {signal.SIGTERM, signal.SIGINT}


class WorkerLost(SpotguardError, OSError):
    """The worker process died during a job."""


class Worker:
    """A worker process and the daemon's end of its socket pair: taken from its pool for one job,
    given back once the job's last :meth:`call` returns."""

    def __init__(self, process: subprocess.Popen[bytes], control: socket.socket, owner: WorkerPool) -> None:
        self.process = process
        self.control = control
        self._owner = owner
        self.idle_since = time.monotonic()

    async def call(self, job: dict[str, Any], fds: list[int], *, more: bool = False) -> Any:
        """Run ``job``; its result, or the error it raised in the worker. The worker goes back to its
        pool after, unless ``more`` calls of the same job follow (a received payload's ``write`` or
        ``drop``) and this one succeeded. Raises :class:`WorkerLost` if the worker died.

        The answer is awaited on the event loop, not in a thread: a thread per frame cost the loop a
        hand-off each way, and threads waiting to take the GIL back in turn delayed every flow's next
        frame (on 16 cores four flows carried 4.9 GB/s without them against 4.1, BENCHMARKS.md). A
        caller cancelled meanwhile does not end the exchange: the worker's answer is still read
        before it is given back, as a job it was sent must finish (its socket shut, at once)."""
        exchange = asyncio.ensure_future(self._exchange(job, fds, more=more))
        self._owner.exchanges.add(exchange)  # held while it runs, its caller gone or not
        exchange.add_done_callback(self._owner.exchanges.discard)
        return await asyncio.shield(exchange)

    async def _exchange(self, job: dict[str, Any], fds: list[int], *, more: bool) -> Any:
        try:
            # One small message at a time, the answer read before the next: the pair's buffer has room.
            socket.send_fds(self.control, [pickle.dumps(job)], fds)
            answer = await asyncio.get_running_loop().sock_recv(self.control, _MAX_MESSAGE)
            if not answer:
                raise WorkerLost("a peer worker process ended during a frame")
        except asyncio.CancelledError:
            self._owner.lost(self)  # the loop is closing with the job's answer unread: it cannot serve on
            raise
        except OSError as exc:
            self._owner.lost(self)
            if isinstance(exc, WorkerLost):
                raise
            if exc.errno in (errno.ECONNRESET, errno.EPIPE):
                # Its end closed with our job unread (ECONNRESET) or before we sent it (EPIPE): it died.
                raise WorkerLost("a peer worker process ended during a frame") from exc
            raise WorkerLost(f"a peer worker process failed: {exc}") from exc
        result = pickle.loads(answer)  # our own worker, over a socket pair only we hold
        if "error" not in result and job["t"] in _FRAME_JOBS:
            self._owner.carried()
        if "error" in result or not more:
            self._owner.give_back(self)
        if "error" in result:
            raise _error(result)
        return result["ok"]

    def release(self) -> None:
        """Give the worker back without a job."""
        self._owner.give_back(self)

    async def write(self, path: Path, offset: int, length: int, ranges: list[tuple[int, int, int]]) -> None:
        """Write the payload this worker received at ``offset`` of ``path``; note its CRC32C in
        ``ranges``. The worker is given back."""
        crc = await self.call({"t": "write", "path": str(path), "offset": offset}, [])
        ranges.append((offset, length, crc))

    async def drop(self) -> None:
        """Forget the payload this worker received (its replica is no longer being received)."""
        await self.call({"t": "drop"}, [])

    def close(self) -> None:
        self.control.close()  # the worker reads end of file and exits
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _error(result: dict[str, Any]) -> Exception:
    kind, message = result["error"], result["message"]
    if kind == "peer":
        return wire.PeerError(result["code"], message)
    if kind == "timeout":
        return TimeoutError(message)
    if kind == "eof":
        return EOFError(message)
    return OSError(result.get("errno") or 0, message)


class WorkerPool:
    """The process's workers: :meth:`take` an idle one (None: go the in-process way), :meth:`give_back`
    it after its job, :meth:`lost` one that failed. ``beside``: each worker overlaps a frame's two
    steps in a second thread (:class:`_Jobs`)."""

    def __init__(self, size: int, *, beside: bool = False, retire_after: float = RETIRE_IDLE_AFTER) -> None:
        self.size = size
        self.beside = beside
        self.retire_after = retire_after
        self._idle: list[Worker] = []
        self._count = 0  # started or starting
        self._busy = 0  # taken for a job
        self._no_start_until = 0.0  # monotonic: a worker could not start, none is tried before then
        self._failing = False  # the last start failed (its warning logged once, until one starts again)
        self.frames = 0  # data frames the workers carried
        self.exchanges: set[asyncio.Future[Any]] = set()  # jobs sent, their answers awaited
        self._lock = threading.Lock()
        self._idle_changed = threading.Condition(self._lock)  # a worker went idle, or the pool closed
        self._retirer: threading.Thread | None = None  # started with the first worker
        self._closed = False
        self._starter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="spotguard-peer-workers")

    def take(self) -> Worker | None:
        """An idle worker (the one used last), or None (and one more starts, if the pool may grow)."""
        with self._lock:
            while self._idle:
                worker = self._idle.pop()
                if worker.process.poll() is None:
                    self._busy += 1
                    return worker
                self._count -= 1  # it died idle (killed, out of memory): another takes its place
                worker.control.close()
            if self._count >= self.size or not self._may_start():
                return None
            self._count += 1
        self._starter.submit(self._start)
        return None

    def _may_start(self) -> bool:
        return time.monotonic() >= self._no_start_until

    def warm(self, count: int) -> None:
        """Have ``count`` workers (at most the pool's size) running or starting, so that the frames of a
        handoff about to begin find them ready: a notice's first frames follow within seconds."""
        with self._lock:
            more = min(count, self.size) - self._count if self._may_start() else 0
            self._count += max(more, 0)
        for _ in range(more):
            self._starter.submit(self._start)

    def give_back(self, worker: Worker) -> None:
        """A worker taken for a job is idle again."""
        with self._lock:
            self._busy -= 1
            self._went_idle(worker)

    def _went_idle(self, worker: Worker) -> None:
        """(Under the lock.) ``worker`` joins the idle ones, the last in line to retire."""
        worker.idle_since = time.monotonic()
        self._idle.append(worker)
        if self._retirer is None:
            self._retirer = threading.Thread(target=self._retire_idle, name="spotguard-peer-retire", daemon=True)
            self._retirer.start()
        if len(self._idle) == 1:
            # The retirer waits for the oldest idle worker's time, or for ever when none is idle. One
            # joining behind others retires after them and changes nothing it waits for: not woken
            # then, which is every frame of a handoff (each wake-up took the GIL from the event loop).
            self._idle_changed.notify()

    def _retire_idle(self) -> None:
        """End each worker idle for :attr:`retire_after` seconds, until the pool closes. The idle list
        is in the order they went idle (:meth:`take` takes from its end), so its first is the oldest."""
        while True:
            with self._idle_changed:
                if self._closed:
                    return
                now = time.monotonic()
                retiring = []
                while self._idle and now - self._idle[0].idle_since >= self.retire_after:
                    retiring.append(self._idle.pop(0))
                self._count -= len(retiring)
                if not retiring:
                    self._idle_changed.wait(self._idle[0].idle_since + self.retire_after - now if self._idle else None)
                    continue
            for worker in retiring:
                worker.close()
            logger.debug("%d idle peer worker(s) ended", len(retiring))

    def carried(self) -> None:
        with self._lock:
            self.frames += 1

    def status(self) -> dict[str, int]:
        """Workers running (or starting), the most that may run (``bound``: the cores the daemon may
        keep busy, at most :data:`MAX_WORKERS`), those idle and those busy with a frame, and the data
        frames they carried, for the daemon's status."""
        with self._lock:
            return {
                "workers": self._count,
                "bound": self.size,
                "idle": len(self._idle),
                "busy": self._busy,
                "frames": self.frames,
            }

    def lost(self, worker: Worker) -> None:
        """A worker taken for a job died."""
        with self._lock:
            self._count -= 1
            self._busy -= 1
        self._starter.submit(worker.close)  # off the event loop: the process may take a moment to end

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
            self._count -= len(idle)
            self._closed = True
            self._idle_changed.notify()
        for worker in idle:
            worker.close()

    def _start(self) -> None:
        try:
            worker = _spawn(self)
        except (OSError, ValueError) as exc:
            with self._lock:
                self._count -= 1
                self._no_start_until = time.monotonic() + RETRY_START_AFTER
                first, self._failing = not self._failing, True
            if first:  # once per outage, not at every retry
                logger.warning(
                    "a peer worker process could not start (%s): frames are carried in-process, and the"
                    " start is tried again every %.0f s",
                    exc,
                    RETRY_START_AFTER,
                )
            return
        with self._lock:
            recovered, self._failing = self._failing, False
        if recovered:  # told before the worker is handed out: the log has it before any use of it
            logger.info("peer worker processes start again")
        with self._lock:
            self._went_idle(worker)


def _spawn(owner: WorkerPool) -> Worker:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        # -P: the daemon's working directory is not put first on the worker's path, so that a
        # package planted there (by any user who can write it) is never imported as spotguard's own.
        command = [sys.executable, "-P", "-m", "spotguard.peer.workers", str(theirs.fileno())]
        if owner.beside:
            command.append(_BESIDE)
        # The worker starts with the notices' signals blocked (a thread's mask is inherited through
        # fork and exec), so that one sent to it while the interpreter starts (a notice's SIGTERM to
        # the whole unit, a terminal's SIGINT to the group) waits until it ignores them, and is lost.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _NOTICE_SIGNALS)
        try:
            process = subprocess.Popen(command, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    finally:
        theirs.close()
    ours.settimeout(_START_TIMEOUT)
    try:
        if ours.recv(len(_READY)) != _READY:
            raise ValueError("a peer worker process did not start")
    except (OSError, ValueError):
        process.kill()
        process.wait()
        ours.close()
        raise
    ours.setblocking(False)  # its answers are awaited on an event loop
    return Worker(process, ours, owner)


_POOL: tuple[int, WorkerPool] | None = None  # (the process it belongs to, the pool)
_POOL_LOCK = threading.Lock()


def pool() -> WorkerPool:
    """The process's pool (one per process: workers outlive event loops; a forked child makes its
    own, never using its parent's workers)."""
    global _POOL  # one per process, made on first use
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            cores = usable_cores()  # a container's CPU limit counts, not only its cpuset
            _POOL = (os.getpid(), WorkerPool(min(MAX_WORKERS, cores), beside=cores > BESIDE_FROM_CORES))
        return _POOL[1]


def take_for(length: int) -> Worker | None:
    """An idle worker of the process's pool for a data frame's payload of ``length`` bytes; None for a
    small payload (not worth the round trip) or when none is free: the frame goes the in-process way."""
    return pool().take() if length >= WORKER_PAYLOAD else None


# --- the worker's side ------------------------------------------------------------------------


class _Jobs:
    """A worker's buffers, reused from frame to frame, and (``beside``) its second thread: a frame's
    sealed batches go out while the next one is read and sealed; a payload's next batch comes in
    while this one is opened (the file's read, AES-GCM and the socket's copy all leave the GIL).
    Without it, the steps take turns in one thread, batch by batch, as they cost less there on few
    cores."""

    def __init__(self, *, beside: bool) -> None:
        self.batches = batch_buffers()  # a frame's batches, sealed into these in turn or received into them
        self.payload = bytearray()
        self.received: memoryview | None = None  # a payload received and not yet written
        self.beside = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="spotguard-peer-beside") if beside else None
        )

    def send(self, job: dict[str, Any], fds: list[int]) -> None:
        """Seal a data frame from the file, batch by batch, and send it on the connection."""
        connection, file = fds
        cipher = noise.CipherState(job["key"], job["n"])
        handed = HandedSocket(connection)
        try:
            batches = seal_batches(
                cipher, job["header"], file, job["offset"], job["length"], batches=self.batches, mapped=True
            )
            if self.beside is None:
                self._send_in_turn(handed, batches, job["timeout"])
            else:
                self._send_beside(self.beside, handed, batches, job["timeout"])
        finally:
            handed.close()

    @staticmethod
    def _send_in_turn(handed: HandedSocket, batches: Iterator[memoryview], timeout: float) -> None:
        """Send each sealed batch as soon as it is sealed, before the next is: the socket's copy reads it
        while it is still in the cache, and the receiver opens the frame's first batches while its last
        ones are sealed (the whole frame sealed first cost one flow a tenth of its rate; at four flows
        on two cores it was 6 % ahead, within the noise: BENCHMARKS.md)."""
        for sealed in batches:
            handed.send_all(sealed, timeout)

    @staticmethod
    def _send_beside(
        beside: concurrent.futures.Executor, handed: HandedSocket, batches: Iterator[memoryview], timeout: float
    ) -> None:
        """Send each sealed batch in the thread ``beside`` while the next is sealed (into the other
        buffer: the batch before it has gone by then)."""
        going: concurrent.futures.Future[None] | None = None
        try:
            for sealed in batches:
                if going is not None:
                    going.result()
                going = beside.submit(handed.send_all, sealed, timeout)
            if going is not None:
                going.result()
        except BaseException:
            if going is not None and not going.done():
                # The frame cannot be finished (its header promised it whole), so the connection
                # cannot go on: a batch still going out returns at once.
                handed.shut(socket.SHUT_WR)
                concurrent.futures.wait([going])
            raise

    def receive(self, job: dict[str, Any], fds: list[int]) -> None:
        """Receive and open a payload, kept for the ``write`` (or ``drop``) that follows: the
        connection is the daemon's again meanwhile, and its next frame goes to another worker."""
        (connection,) = fds
        length = job["length"]
        self.received = None
        if len(self.payload) < length:
            self.payload = bytearray(length)
        view = memoryview(self.payload)[:length]
        cipher = noise.CipherState(job["key"], job["n"])
        handed = HandedSocket(connection)
        try:
            open_payload(
                cipher,
                self.batches,
                lambda chunk: handed.recv_exactly(chunk, job["timeout"]),
                job["ahead"],
                view,
                beside=self.beside,
                stop=lambda: handed.shut(socket.SHUT_RD),
            )
        finally:
            handed.close()
        self.received = view

    def write(self, job: dict[str, Any], fds: list[int]) -> int:
        """The received payload at its place in its file; its CRC32C."""
        view, self.received = self.received, None
        if view is None:
            raise OSError(errno.EINVAL, "no payload received to write")
        return write_at(job["path"], job["offset"], view)

    def drop(self, job: dict[str, Any], fds: list[int]) -> None:
        self.received = None


def _serve(control: socket.socket, *, beside: bool) -> None:
    jobs = _Jobs(beside=beside)
    control.sendall(_READY)
    while True:
        message, fds, _, _ = socket.recv_fds(control, _MAX_MESSAGE, 2)
        if not message:
            return  # the daemon's end closed
        try:
            job = pickle.loads(message)  # from the daemon that started us, over our pair
            answer: dict[str, Any] = {"ok": getattr(jobs, job["t"])(job, fds)}
        except wire.PeerError as exc:
            answer = {"error": "peer", "code": exc.code, "message": exc.message}
        except TimeoutError as exc:
            answer = {"error": "timeout", "message": str(exc)}
        except EOFError as exc:
            answer = {"error": "eof", "message": str(exc)}
        except OSError as exc:
            answer = {"error": "os", "errno": exc.errno, "message": exc.strerror or str(exc)}
        finally:
            for fd in fds:
                os.close(fd)
        control.sendall(pickle.dumps(answer))


if __name__ == "__main__":
    for number in _NOTICE_SIGNALS:
        signal.signal(number, signal.SIG_IGN)  # one pending since the start (blocked) is dropped here
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _NOTICE_SIGNALS)
    # The daemon may go (stopped, killed) while this worker starts or answers: its end of the pair is
    # closed, and this worker has nobody left to serve. Not an error of the worker's: no traceback.
    with contextlib.suppress(BrokenPipeError, ConnectionResetError), socket.socket(fileno=int(sys.argv[1])) as pair:
        _serve(pair, beside=sys.argv[2:] == [_BESIDE])


__all__ = [
    "MAX_WORKERS",
    "RETIRE_IDLE_AFTER",
    "RETRY_START_AFTER",
    "WORKER_PAYLOAD",
    "Worker",
    "WorkerLost",
    "WorkerPool",
    "pool",
    "take_for",
]
