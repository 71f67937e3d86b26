"""A fault-injecting HTTP/1.1 proxy for tests: real TCP on 127.0.0.1, random port.

Put it in front of moto or the GCS emulator and point the client at ``.url``::

    with FaultProxy(moto_url, fault_rate=0.1, seed=7) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
        ...
        assert proxy.injected["503"] > 0

On a seeded random fraction of requests it injects one of:

- ``"503"``: answers 503 (S3 ``SlowDown`` XML, or a GCS JSON error with ``flavor="gcs"``);
- ``"500"``: answers 500 (``InternalError``);
- ``"reset"``: reads the whole request, then resets the connection (RST, no response);
- ``"stall"``: holds the request for ``stall_seconds``, then forwards it (a client
  whose read timeout is shorter sees a timeout; a patient one sees a slow server).

Other requests are forwarded unchanged (``Host`` included, so signatures and
server-built URLs such as GCS resumable session URLs keep pointing at the proxy).
Which requests are hit is random (reproducible for a seed: the n-th request
decides the same way each run, though with a concurrent client which request
is n-th depends on thread scheduling); the kinds are taken in turn, in the
order of ``faults``, so that every kind shows up after a few faults.
"""

from __future__ import annotations

import http.client
import random
import socket
import socketserver
import struct
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import BinaryIO
from urllib.parse import urlsplit

FAULTS = ("503", "500", "reset", "stall")

# Headers that describe one hop, not the message; never forwarded as-is.
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
}

_S3_BODIES = {
    503: b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>",
    500: b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
    b"<Message>We encountered an internal error. Please try again.</Message></Error>",
    403: b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
    b"<Message>Access Denied (injected)</Message></Error>",
}
_GCS_BODIES = {
    503: b'{"error": {"code": 503, "message": "Backend Error (injected)", "errors": []}}',
    500: b'{"error": {"code": 500, "message": "Internal Error (injected)", "errors": []}}',
    403: b'{"error": {"code": 403, "message": "Forbidden (injected)", "errors": []}}',
}


class _Request:
    def __init__(self, method: str, target: str, version: str, headers: list[tuple[str, str]], body: bytes):
        self.method = method
        self.target = target
        self.version = version
        self.headers = headers
        self.body = body

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    @property
    def keep_alive(self) -> bool:
        conn = (self.header("connection") or "").lower()
        if self.version == "HTTP/1.0":
            return conn == "keep-alive"
        return conn != "close"


def _read_request(reader: BinaryIO, writer: BinaryIO) -> _Request | None:
    line = reader.readline(65537)
    if not line:
        return None
    while line in (b"\r\n", b"\n"):  # tolerate stray CRLF between pipelined requests
        line = reader.readline(65537)
        if not line:
            return None
    method, target, version = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
    headers: list[tuple[str, str]] = []
    while True:
        h = reader.readline(65537)
        if h in (b"\r\n", b"\n", b""):
            break
        name, _, value = h.decode("latin-1").partition(":")
        headers.append((name.strip(), value.strip()))
    req = _Request(method, target, version, headers, b"")
    if (req.header("expect") or "").lower() == "100-continue":
        # Clients (botocore) wait up to a second for this before sending the body.
        # The proxy always takes the body, then decides; the faults come after it.
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        writer.flush()
        req.headers = [(k, v) for k, v in req.headers if k.lower() != "expect"]
    if (req.header("transfer-encoding") or "").lower() == "chunked":
        chunks = []
        while True:
            size_line = reader.readline(65537)
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while reader.readline(65537) not in (b"\r\n", b"\n", b""):
                    pass  # trailers are dropped: the body is re-sent with a Content-Length
                break
            chunks.append(reader.read(size))
            reader.readline(65537)
        req.body = b"".join(chunks)
        req.headers = [(k, v) for k, v in req.headers if k.lower() != "transfer-encoding"]
        req.headers.append(("Content-Length", str(len(req.body))))
    else:
        length = int(req.header("content-length") or 0)
        req.body = reader.read(length) if length else b""
    return req


class FaultProxy:
    """Context manager: a threaded proxy that injects faults into a fraction of requests."""

    def __init__(
        self,
        upstream_url: str,
        *,
        fault_rate: float = 0.1,
        faults: Sequence[str] = FAULTS,
        seed: int = 0,
        stall_seconds: float = 1.0,
        flavor: str = "s3",
    ) -> None:
        unknown = set(faults) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; known: {FAULTS}")
        if not 0.0 <= fault_rate <= 1.0:
            raise ValueError("fault_rate must be within [0, 1]")
        if flavor not in ("s3", "gcs"):
            raise ValueError("flavor must be 's3' or 'gcs'")
        parts = urlsplit(upstream_url if "://" in upstream_url else f"http://{upstream_url}")
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"upstream_url needs host and port: {upstream_url!r}")
        self.upstream_host: str = parts.hostname
        self.upstream_port: int = parts.port
        self.fault_rate = fault_rate
        self.faults = tuple(faults)
        self.stall_seconds = stall_seconds
        self.flavor = flavor
        self.injected: Counter[str] = Counter()
        self.requests = 0
        self.seen: list[tuple[str, str]] = []  # (method, target) of every request, in arrival order
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._server: socketserver.ThreadingTCPServer | None = None
        self._thread: threading.Thread | None = None
        self._hold: Callable[[str, str], bool] | None = None
        self._lose: Callable[[str, str], bool] | None = None
        self._fail: tuple[Callable[[str, str], bool], int] | None = None
        self.answers_lost = 0
        self._released = threading.Event()
        self.held = threading.Event()  # set once a request is being held

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> FaultProxy:
        proxy = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                proxy._serve_connection(self)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True
            request_queue_size = 128

        self._server = Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="faultproxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._closing.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def total_injected(self) -> int:
        with self._lock:
            return sum(self.injected.values())

    def set_fault_rate(self, rate: float) -> None:
        with self._lock:
            self.fault_rate = rate

    def hold(self, when: Callable[[str, str], bool]) -> None:
        """Hold every request that ``when(method, target)`` picks until :meth:`release`: a
        transfer kept in flight on purpose (say, the CompleteMultipartUpload of an upload)."""
        self._released.clear()
        self._hold = when

    def release(self) -> None:
        self._hold = None
        self._released.set()

    def fail(self, when: Callable[[str, str], bool] | None, status: int = 503) -> None:
        """Answer ``status`` (503, 500 or 403) to every request that ``when(method, target)`` picks,
        until ``fail(None)``: a bucket that keeps failing some requests past any retry, or refuses them."""
        self._fail = None if when is None else (when, status)

    def lose_answer(self, when: Callable[[str, str], bool]) -> None:
        """The next request that ``when(method, target)`` picks is forwarded, and the server's answer is
        replaced by a reset: the server did the work, the client never hears of it (an answer lost on
        the way). Once; then the hook is gone."""
        self._lose = when

    # -- per connection ------------------------------------------------------------

    def _decide(self, req: _Request) -> str | None:
        with self._lock:
            self.requests += 1
            self.seen.append((req.method, req.target))
            lose = self._lose
            if lose is not None and lose(req.method, req.target):
                self._lose = None  # once, even with requests on several connections at a time
                self.answers_lost += 1
                return "lost"
            fail = self._fail
            if fail is not None and fail[0](req.method, req.target):
                self.injected[str(fail[1])] += 1
                return str(fail[1])
            if self._rng.random() >= self.fault_rate:
                return None
            # Kinds in turn, not at random: a short test then sees every kind it asked for.
            fault = self.faults[sum(self.injected.values()) % len(self.faults)]
            self.injected[fault] += 1
            return fault

    def _serve_connection(self, handler: socketserver.StreamRequestHandler) -> None:
        conn: socket.socket = handler.connection
        try:
            while not self._closing.is_set():
                req = _read_request(handler.rfile, handler.wfile)
                if req is None:
                    return
                hold = self._hold
                if hold is not None and hold(req.method, req.target):
                    self.held.set()
                    while not (self._released.wait(0.1) or self._closing.is_set()):
                        pass
                fault = self._decide(req)
                if fault == "lost":  # the server does the work; its answer never comes back
                    self._forward(handler, req, answer=False)
                    fault = "reset"
                if fault == "reset":
                    # SO_LINGER 0 makes close() send RST: the client sees "connection reset by peer".
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    conn.close()
                    return
                if fault in ("503", "500", "403"):
                    self._send_error(handler, int(fault), req)
                elif fault == "stall":
                    self._closing.wait(self.stall_seconds)
                    self._forward(handler, req)
                else:
                    self._forward(handler, req)
                if not req.keep_alive:
                    return
        except (ConnectionError, TimeoutError, OSError, ValueError):
            return  # the client went away or spoke garbage; nothing to answer

    def _send_error(self, handler: socketserver.StreamRequestHandler, status: int, req: _Request) -> None:
        body = (_GCS_BODIES if self.flavor == "gcs" else _S3_BODIES)[status]
        ctype = "application/json" if self.flavor == "gcs" else "application/xml"
        reason = http.client.responses.get(status, "Error")
        head = (
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {0 if req.method == 'HEAD' else len(body)}\r\n"
            f"Connection: {'keep-alive' if req.keep_alive else 'close'}\r\n\r\n"
        )
        handler.wfile.write(head.encode("latin-1") + (b"" if req.method == "HEAD" else body))
        handler.wfile.flush()

    def _forward(self, handler: socketserver.StreamRequestHandler, req: _Request, *, answer: bool = True) -> None:
        upstream = http.client.HTTPConnection(self.upstream_host, self.upstream_port, timeout=120)
        try:
            upstream.putrequest(req.method, req.target, skip_host=True, skip_accept_encoding=True)
            for name, value in req.headers:
                if name.lower() not in _HOP_BY_HOP:
                    upstream.putheader(name, value)
            upstream.putheader("Connection", "close")
            upstream.endheaders(req.body if req.body else None)
            resp = upstream.getresponse()
            body = resp.read()
            if not answer:
                return
            out = [f"HTTP/1.1 {resp.status} {resp.reason}\r\n"]
            for name, value in resp.getheaders():
                lname = name.lower()
                if lname in _HOP_BY_HOP:
                    continue
                # HEAD keeps the upstream Content-Length (the size of the object); others are re-framed.
                if lname == "content-length" and req.method != "HEAD":
                    continue
                out.append(f"{name}: {value}\r\n")
            if req.method != "HEAD":
                out.append(f"Content-Length: {len(body)}\r\n")
            out.append(f"Connection: {'keep-alive' if req.keep_alive else 'close'}\r\n\r\n")
            handler.wfile.write("".join(out).encode("latin-1") + (b"" if req.method == "HEAD" else body))
            handler.wfile.flush()
        finally:
            upstream.close()
