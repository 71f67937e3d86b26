"""A TCP relay on 127.0.0.1 that paces each connection's uploads (client to server) to a byte rate.

Standing for a slow link to the bucket: point the S3 client at ``relay.url`` instead of moto's::

    with PacedRelay(s3.endpoint_url, 1_000_000) as relay:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", relay.url)

Answers (server to client) pass at full speed. Threads, not a process: pacing sleeps, which leaves
the GIL to whatever else the test runs (moto).
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from types import TracebackType

_CATCH_UP = 0.5  # seconds of lateness a connection may make up at once (oversleeping under load)


class PacedRelay:
    def __init__(
        self, upstream: str, bytes_per_s: float, *, buffer_bytes: int | None = None, host: str = "127.0.0.1"
    ) -> None:
        """``buffer_bytes``: the receive buffer of each paced connection (default: the kernel's,
        which on loopback grows to megabytes and takes a burst far over the cap before it paces);
        ``host``: the address it listens on (a network namespace's way out, tests/netns.py)."""
        upstream_host, _, port = upstream.removeprefix("http://").rstrip("/").partition(":")
        self.upstream = (upstream_host, int(port))
        self.rate = bytes_per_s
        self.listener = socket.create_server((host, 0))
        if buffer_bytes is not None:  # accepted connections take it from the listener
            self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
        self.url = f"http://{host}:{self.listener.getsockname()[1]}"
        self._closed = threading.Event()
        self._frozen = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._accepted = 0
        self._reset: tuple[int, int] | None = None  # (connection, bytes): reset_after()
        self.was_reset = threading.Event()

    def __enter__(self) -> PacedRelay:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Cut the link: every connection ends at once, requests half sent included (the kernel's
        buffers of a killed client would otherwise still carry its last bytes through)."""
        self._closed.set()
        self.listener.close()
        with self._lock:
            for sock in self._sockets:
                sock.close()

    def freeze(self) -> None:
        """Stop passing bytes either way and keep every connection open, as a host that vanished
        (no FIN, no RST): what a connection still sends fills the relay's buffers and is never
        acknowledged past them."""
        self._frozen.set()

    def reset_after(self, connection: int, nbytes: int) -> None:
        """Reset connection number ``connection`` (0 the first accepted) both ways once ``nbytes`` went
        upstream through it, as one TCP connection lost (a middlebox, a NAT entry dropped); the
        others go on. ``was_reset`` is set then."""
        self._reset = (connection, nbytes)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self.listener.accept()
                server = socket.create_connection(self.upstream)
            except OSError:
                return
            with self._lock:
                self._sockets += [client, server]
                index, self._accepted = self._accepted, self._accepted + 1
            threading.Thread(target=self._pump, args=(client, server, True, index), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, paced: bool, index: int | None = None) -> None:
        due = time.monotonic()  # when the bytes passed so far are due at the cap
        passed = 0
        try:
            while data := source.recv(64 * 1024):
                if self._frozen.is_set():
                    self._closed.wait()  # swallowed; nothing more is read until the relay closes
                    return
                if paced:
                    # A sleep that overslept is made up for; an idle spell is not (a kept-alive
                    # connection must be as slow as a new one).
                    due = max(due, time.monotonic() - _CATCH_UP) + len(data) / self.rate
                    ahead = due - time.monotonic()
                    if ahead > 0:
                        time.sleep(ahead)  # this connection's cap
                sink.sendall(data)
                passed += len(data)
                if self._reset is not None and self._reset[0] == index and passed >= self._reset[1]:
                    for each in (source, sink):  # RST both ways (linger 0): the bytes in flight are lost
                        each.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        each.close()
                    self.was_reset.set()
                    return
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass
