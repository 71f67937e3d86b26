"""A connection's socket handed to a worker process for a data frame (spotguard/peer/workers.py),
while the event loop leaves it alone.

:class:`HandedSocket` is a duplicate of the socket: the daemon passes it to the worker (which gets
its own duplicate, and reads or writes it with a deadline on every wait), and keeps it to shut the
socket down if the connection is lost or its handler cancelled meanwhile, which ends the worker's
wait at once. :func:`run_handed` awaits the worker's answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from spotguard.peer import wire

T = TypeVar("T")


class HandedSocket:
    """A duplicate of a connection's socket, for one worker's job."""

    def __init__(self, fd: int) -> None:
        self.sock = socket.socket(fileno=os.dup(fd))  # keeps the fd's O_NONBLOCK: waits go through poll()
        self._lock = threading.Lock()
        self._closed = False

    def shut(self, how: int = socket.SHUT_RDWR) -> None:
        """End the job's I/O now (from any thread): the worker's wait returns, its next call fails.
        ``how``: ``SHUT_RD`` ends a receive only, so that the connection can still answer with an error."""
        with self._lock, contextlib.suppress(OSError):
            if not self._closed:
                self.sock.shutdown(how)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self.sock.close()

    def recv_exactly(self, view: memoryview, timeout: float) -> None:
        """Fill ``view`` from the socket within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while view:
            try:
                got = self.sock.recv_into(view)
            except BlockingIOError:
                self._wait(select.POLLIN, deadline, timeout)
                continue
            if got == 0:
                raise wire.PeerError("closed", "the connection closed mid-record")
            view = view[got:]

    def send_all(self, view: memoryview, timeout: float) -> None:
        """Hand all of ``view`` to the kernel within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while view:
            try:
                sent = self.sock.send(view)
            except BlockingIOError:
                self._wait(select.POLLOUT, deadline, timeout)
                continue
            view = view[sent:]

    def _wait(self, events: int, deadline: float, timeout: float) -> None:
        poller = select.poll()
        poller.register(self.sock, events)
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            what = "no whole record" if events == select.POLLIN else "the peer read nothing"
            raise TimeoutError(f"{what} for {timeout:g} s")


async def run_handed(stream: wire.FrameStream, handed: HandedSocket, work: Callable[[], Awaitable[T]]) -> T:
    """``await work()``, a worker's job that uses ``handed`` (closed once it is answered). If the
    connection is lost or this task is cancelled meanwhile, the socket is shut and the job ends at once."""

    async def run() -> T:
        try:
            return await work()
        finally:
            handed.close()

    stream.on_lost = handed.shut
    future = asyncio.ensure_future(run())
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        handed.shut()
        await asyncio.wait([future])  # at once: the job's socket is shut; the worker is free again
        if not future.cancelled():
            future.exception()  # retrieved: the cancellation is what this task reports
        raise
    finally:
        stream.on_lost = None


__all__ = ["HandedSocket", "run_handed"]
