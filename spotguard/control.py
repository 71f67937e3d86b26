"""Talking to a running daemon over its socket: one request, one reply (``drill``, ``status``, the demo, doctor)."""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import Any

from spotguard import protocol
from spotguard.config import DEFAULT_SOCKET
from spotguard.errors import SpotguardError


class CommandError(SpotguardError):
    """A failure with a one-line reason for the user (exit 1)."""


def daemon_socket(explicit: str | None) -> Path:
    return Path(explicit or os.environ.get("SPOTGUARD_SOCKET") or DEFAULT_SOCKET)


def request(socket_path: Path, message_type: str, timeout: float = 5.0, **fields: Any) -> dict[str, Any]:
    """One request/reply with the daemon."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(os.fspath(socket_path))
        except OSError as exc:
            raise CommandError(f"no spotguard daemon at {socket_path}: {exc.strerror or exc}") from None
        buffer = b""
        try:
            # A daemon that refuses us answers with an error and hangs up, maybe before we finish sending.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(protocol.encode(message_type, **fields))
            while b"\n" not in buffer and (chunk := sock.recv(65536)):
                buffer += chunk
        except OSError as exc:
            raise CommandError(f"talking to the daemon at {socket_path}: {exc}") from None
    if b"\n" not in buffer:
        raise CommandError("the daemon closed the connection without answering")
    reply = protocol.decode(buffer.split(b"\n", 1)[0], allowed=protocol.DAEMON_TYPES)
    if reply["type"] == "error":
        raise CommandError(f"daemon: {reply['message']}")
    return reply


def trainers_on_another_version(status: dict[str, Any]) -> str:
    """From a ``status`` reply: the connected trainers whose hook's spotguard is not the daemon's, as
    ``"1 on spotguard 0.0.9, this daemon 0.1.0"``, or "" where there are none."""
    daemon = status.get("version")
    others = [t.get("version") or "(older, unnamed)" for t in status.get("trainers", []) if t.get("version") != daemon]
    if not others:
        return ""
    return f"{len(others)} on spotguard {', '.join(sorted(set(others)))}, this daemon {daemon}"


__all__ = ["CommandError", "daemon_socket", "request", "trainers_on_another_version"]
