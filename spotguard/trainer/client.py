"""The hook's connection to the daemon: a background thread that keeps it up.

The training loop never waits on this thread: messages from the daemon only
set flags (through ``on_message``), and messages to it are queued and sent
whenever a connection is up, so a daemon restart goes unnoticed by the loop.
Nor does it wait on the daemon: a send takes what the socket takes at once, and
the thread sends the rest when the daemon reads again (a daemon stopped or stuck
on a dying disk must not stop training once the socket's buffer is full).
The queue is bounded: with no daemon for days, a trainer that saves often must
not grow it without end. Full, it drops the oldest ``file`` or ``file-range`` message first (early-upload
hints; the checkpoint's ``saved`` covers the same files), else the
oldest message (the daemon rescans the checkpoint root when it starts anyway).
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spotguard import protocol
from spotguard.repeats import RepeatedErrors
from spotguard.version import __version__

logger = logging.getLogger("spotguard.trainer")

_NON_ESSENTIAL = frozenset({"file", "file-range"})  # hints the daemon can do without; dropped first when full
_REPEAT_ERROR_AFTER = 600.0  # seconds before the same error from the daemon is logged again
_HELLO_TIMEOUT = 5.0  # seconds a new connection may take to accept the hello


class DaemonClient:
    def __init__(
        self,
        socket_path: Path,
        hello: dict[str, Any],
        on_message: Callable[[dict[str, Any]], None],
        *,
        retry_min: float = 0.05,
        retry_max: float = 1.0,
        max_outbox: int = 1000,
    ) -> None:
        if max_outbox < 1:
            raise ValueError("max_outbox must be at least 1")
        self.socket_path = socket_path
        self._hello = hello
        self._on_message = on_message
        self._retry_min = retry_min
        self._retry_max = retry_max
        self._outbox: deque[tuple[str, bytes]] = deque()
        self._sent = 0  # bytes of the outbox's first line already on the current connection
        self._max_outbox = max_outbox
        self.dropped = 0  # messages dropped from a full outbox
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._closing = threading.Event()
        self.connected = threading.Event()
        self.welcome: dict[str, Any] | None = None
        self.welcomed = threading.Event()
        self.connections = 0  # how many times a connection was made (reconnects show here)
        self._welcomes = 0  # connections the daemon took (answered with a welcome)
        self._version_warned: str | None = __version__  # the daemon version last warned of (this hook's: none)
        self._errors = RepeatedErrors(_REPEAT_ERROR_AFTER)  # a refusal that lasts comes at every reconnect
        self._waiting: dict[str, tuple[threading.Event, list[dict[str, Any]]]] = {}  # reply type -> its slot
        # Tells the thread that the outbox has lines the socket did not take (to wait until it is writable).
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_writer.setblocking(False)
        self._thread = threading.Thread(target=self._run, name="spotguard-daemon-client", daemon=True)

    def start(self) -> DaemonClient:
        self._thread.start()
        return self

    def update_hello(self, **fields: Any) -> None:
        """Fields the hello of every later (re)connection carries (e.g. the state's size once known)."""
        with self._lock:
            self._hello = {**self._hello, **fields}

    def send(self, message_type: str, **fields: Any) -> None:
        """Queue a message; it goes out now if connected, else right after the next reconnect."""
        line = protocol.encode(message_type, **fields)
        with self._lock:
            if len(self._outbox) >= self._max_outbox and not self._drop_one_locked():
                self._count_dropped_locked(message_type)  # nothing else could go: this one does
                return
            self._outbox.append((message_type, line))
            self._flush_locked()

    def _drop_one_locked(self) -> bool:
        first = 1 if self._sent else 0  # a line partly on the wire stays whole
        kinds = [kind for kind, _ in self._outbox]
        victim = next((i for i in range(first, len(kinds)) if kinds[i] in _NON_ESSENTIAL), first)
        if victim >= len(kinds):
            return False
        del self._outbox[victim]
        self._count_dropped_locked(kinds[victim])
        return True

    def _count_dropped_locked(self, kind: str) -> None:
        self.dropped += 1
        if self.dropped == 1 or self.dropped % 100 == 0:
            logger.warning(
                "spotguard daemon unreachable: %d messages queued, dropped the oldest %r (%d dropped so far)",
                len(self._outbox),
                kind,
                self.dropped,
            )

    def ask(self, message_type: str, timeout: float, **fields: Any) -> dict[str, Any] | None:
        """One request on the live connection, answered by a reply of the same type; None when not
        connected, or when the daemon does not answer in ``timeout`` (or answers with an error)."""
        if not self.connected.is_set():
            return None
        answered, slot = threading.Event(), list[dict[str, Any]]()
        with self._lock:
            self._waiting[message_type] = (answered, slot)
        try:
            self.send(message_type, **fields)
            answered.wait(timeout)
        finally:
            with self._lock:
                self._waiting.pop(message_type, None)
        return slot[0] if slot else None

    def close(self, timeout: float = 2.0) -> None:
        self._closing.set()
        with self._lock:
            if self._sock is not None:
                self._sock.shutdown(socket.SHUT_RDWR)
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self._wake_reader.close()
            self._wake_writer.close()

    # --- thread side ---------------------------------------------------------------------

    def _flush_locked(self) -> bool:
        """Send what the socket takes now, without waiting; False when the connection is broken (the
        thread notices and reconnects). What is left waits for the thread to see the socket writable."""
        while self._sock is not None and self._outbox:
            line = memoryview(self._outbox[0][1])
            try:
                self._sent += self._sock.send(line[self._sent :], socket.MSG_DONTWAIT)
            except BlockingIOError:
                self._wake()
                return True
            except OSError:
                return False
            if self._sent == len(line):
                self._outbox.popleft()
                self._sent = 0
        return True

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (the thread is woken already), or closed
            self._wake_writer.send(b"w")

    def _run(self) -> None:
        delay = self._retry_min
        while not self._closing.is_set():
            try:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(os.fspath(self.socket_path))
            except OSError:
                sock.close()
                self._closing.wait(delay)
                delay = min(delay * 2, self._retry_max)
                continue
            welcomes, broken = self._welcomes, False
            try:
                self._serve(sock)
            except OSError as exc:
                logger.debug("spotguard daemon connection lost: %s", exc)
            except Exception:
                # A bug must not end the connection for good: the notice of the next
                # termination would never arrive.
                logger.exception("spotguard daemon connection: unexpected error; reconnecting")
                broken = True
            finally:
                with self._lock:
                    self._sock = None
                    self._sent = 0  # a line cut short goes whole on the next connection
                self.connected.clear()
                sock.close()
            if broken:
                self._closing.wait(self._retry_max)  # so a bug that repeats does not spin
            elif self._welcomes > welcomes:
                delay = self._retry_min  # a connection the daemon took: the next reconnect is prompt
            else:
                # Closed without a welcome (refused: busy, a uid not allowed; or a daemon stopping):
                # wait as after a failed connect, or this thread reconnects in a loop on a core the
                # training shares (thousands of times a second).
                self._closing.wait(delay)
                delay = min(delay * 2, self._retry_max)

    def _serve(self, sock: socket.socket) -> None:
        with self._lock:
            hello = self._hello
        sock.settimeout(_HELLO_TIMEOUT)  # a daemon that accepted but never reads is a failed connect
        sock.sendall(protocol.encode("hello", **hello))
        sock.settimeout(None)
        with self._lock:
            self._sock = sock
            self._sent = 0
            self._flush_locked()
        self.connections += 1
        self.connected.set()
        lines = Lines(protocol.MAX_MESSAGE_BYTES)
        with selectors.DefaultSelector() as selector:
            selector.register(sock, selectors.EVENT_READ)
            selector.register(self._wake_reader, selectors.EVENT_READ)
            writing = False
            while not self._closing.is_set():
                with self._lock:
                    pending = bool(self._outbox)
                if pending != writing:  # wait for room in the socket only while there is something to send
                    selector.modify(sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if pending else 0))
                    writing = pending
                for key, events in selector.select(timeout=0.5):
                    if key.fileobj is self._wake_reader:
                        self._wake_reader.recv(4096)
                        continue
                    if events & selectors.EVENT_WRITE:
                        with self._lock:
                            if not self._flush_locked():
                                return
                    if events & selectors.EVENT_READ:
                        chunk = sock.recv(65536)
                        if not chunk:
                            return
                        for line in lines.feed(chunk):
                            self._dispatch(line)
                        if lines.dropped_one():
                            logger.warning(
                                "spotguard: dropping a message from the daemon over %d bytes (the limit), up to "
                                "its end",
                                protocol.MAX_MESSAGE_BYTES,
                            )

    def _woken_by_error_locked(self, error: dict[str, Any]) -> list[tuple[threading.Event, list[dict[str, Any]]]]:
        """The requests an error ends: the one it names (``re``), or, from a daemon that names none (an
        older one; a request it could not parse), whichever is waiting. An error about another message
        (a ``file-range`` of a pruned directory) must not make a waiting ``safe-steps`` read as "no
        daemon": a save short of room would then drop checkpoints not yet in the bucket."""
        named = error.get("re")
        if not isinstance(named, str):
            return list(self._waiting.values())
        return [self._waiting[named]] if named in self._waiting else []

    def _log_error(self, text: str) -> None:
        """An error from the daemon, logged when it differs from the last one or that one was logged
        :data:`_REPEAT_ERROR_AFTER` seconds ago: a refusal that lasts (a uid not allowed) comes at every
        reconnect, for as long as the training runs."""
        if self._errors.due("daemon", text):
            logger.warning("%s", text)
        else:
            logger.debug("%s (again)", text)

    def _check_version(self, daemon: str | None) -> None:
        """Warn, once per daemon version met, of a daemon whose spotguard is not this hook's (the daemon
        warns of the same mismatch in its own log): one upgraded before the other."""
        if daemon in (__version__, self._version_warned):
            return
        self._version_warned = daemon
        logger.warning(
            "spotguard: the daemon runs spotguard %s and this hook %s: upgrade the older of the two so that "
            "both sides know the same messages", daemon or "(older, unnamed)", __version__,
        )  # fmt: skip

    def _dispatch(self, line: bytes) -> None:
        try:
            message = protocol.decode(line, allowed=protocol.DAEMON_TYPES)
        except protocol.ProtocolError as exc:
            logger.warning("ignoring a message from the spotguard daemon: %s", exc)
            return
        if message["type"] == "welcome":
            self.welcome = message
            self._welcomes += 1
            self.welcomed.set()
            self._check_version(message.get("version"))
        elif message["type"] == "error":
            self._log_error(f"spotguard daemon: {message['code']}: {message['message']}")
        with self._lock:
            waiting = self._waiting.get(message["type"])
            woken = [waiting] if waiting else self._woken_by_error_locked(message) if message["type"] == "error" else []
        if waiting is not None:
            waiting[1].append(message)
        for answered, _ in woken:
            answered.set()
        try:
            self._on_message(message)
        except Exception:  # one message the hook cannot handle must not cost the ones after it
            logger.exception("spotguard: handling a %r message from the daemon failed", message["type"])


class Lines:
    """Newline-ended lines out of a byte stream, a line longer than ``limit`` dropped as it comes
    (what no reader would accept): bytes without a newline, from a broken or hostile daemon, kept
    every byte and were copied whole at every read, holding the interpreter's lock from the training
    thread for minutes (128 MiB: 150 s of CPU)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._partial = bytearray()
        self._dropping = False
        self._dropped = 0  # lines dropped since dropped_one() last answered

    def feed(self, chunk: bytes) -> list[bytes]:
        """The lines ``chunk`` completes, without their newlines."""
        lines = []
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            if self._dropping:
                self._dropping = False
            else:
                self._partial += chunk[start:end]
                lines.append(bytes(self._partial))
            self._partial.clear()
            start = end + 1
        if not self._dropping:
            self._partial += chunk[start:]
            if len(self._partial) > self._limit:
                self._partial.clear()
                self._dropping = True
                self._dropped += 1
        return lines

    def dropped_one(self) -> bool:
        """Whether a line began to be dropped since the last call."""
        dropped, self._dropped = self._dropped > 0, 0
        return dropped


def root_of(client: DaemonClient, socket_path: Path, wait: float) -> Path:
    """The checkpoint root the daemon behind ``client`` serves (its welcome says it)."""
    if client.welcomed.wait(wait) and client.welcome:
        return Path(client.welcome["checkpoint_dir"])
    raise ValueError(
        "Guard needs a checkpoint directory: pass checkpoint_dir=, set SPOTGUARD_CHECKPOINT_DIR, "
        f"or run the spotguard daemon (no answer on {socket_path})"
    )


def ask_daemon_for_root(socket_path: Path, wait: float = 2.0) -> Path:
    """The daemon's checkpoint root, asked before any Guard exists (and before torch.distributed is up)."""
    hello = {"rank": 0, "world_size": 1, "pid": os.getpid(), "checkpoint_dir": "", "version": __version__}
    client = DaemonClient(socket_path, hello, lambda _message: None).start()
    try:
        return root_of(client, socket_path, wait)
    finally:
        client.close()
