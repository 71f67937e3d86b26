"""sd_notify against a real AF_UNIX/SOCK_DGRAM socket standing in for systemd."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotguard.daemon.notify import SystemdNotifier, watchdog_loop


@pytest.fixture
def systemd_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A bound datagram socket in tmp_path, and the NOTIFY_SOCKET value naming it."""
    path = tmp_path / "n.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(2.0)
    yield sock, str(path)
    sock.close()


@pytest.fixture
def abstract_socket() -> Iterator[tuple[socket.socket, str]]:
    name = f"spotguard-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(2.0)
    yield sock, "@" + name
    sock.close()


def receive(sock: socket.socket) -> str:
    return sock.recv(65536).decode()


def drain(sock: socket.socket) -> list[str]:
    """Every datagram already queued, without waiting for more."""
    received = []
    sock.setblocking(False)
    try:
        while True:
            received.append(sock.recv(65536).decode())
    except BlockingIOError:
        pass
    finally:
        sock.settimeout(2.0)
    return received


def test_ready_status_watchdog_stopping_reach_path_socket(systemd_socket: tuple[socket.socket, str]) -> None:
    sock, address = systemd_socket
    notifier = SystemdNotifier({"NOTIFY_SOCKET": address})
    assert notifier.enabled

    assert notifier.ready("watching aws, 0 trainers")
    assert receive(sock) == "READY=1\nSTATUS=watching aws, 0 trainers"
    assert notifier.status("uploading step-000001234")
    assert receive(sock) == "STATUS=uploading step-000001234"
    assert notifier.watchdog()
    assert receive(sock) == "WATCHDOG=1"
    assert notifier.stopping()
    assert receive(sock) == "STOPPING=1"
    assert notifier.extend_timeout(30_000_000)
    assert receive(sock) == "EXTEND_TIMEOUT_USEC=30000000"
    notifier.close()


def test_ready_without_status_sends_only_ready(systemd_socket: tuple[socket.socket, str]) -> None:
    sock, address = systemd_socket
    SystemdNotifier({"NOTIFY_SOCKET": address}).ready()
    assert receive(sock) == "READY=1"


def test_abstract_socket_receives_notifications(abstract_socket: tuple[socket.socket, str]) -> None:
    sock, address = abstract_socket
    notifier = SystemdNotifier({"NOTIFY_SOCKET": address})

    assert notifier.ready("up")
    assert receive(sock) == "READY=1\nSTATUS=up"
    assert notifier.watchdog()
    assert receive(sock) == "WATCHDOG=1"
    assert notifier.stopping("draining uploads")
    assert receive(sock) == "STOPPING=1\nSTATUS=draining uploads"


def test_status_with_newlines_stays_one_field(systemd_socket: tuple[socket.socket, str]) -> None:
    sock, address = systemd_socket
    SystemdNotifier({"NOTIFY_SOCKET": address}).status("line one\nREADY=1")
    assert receive(sock) == "STATUS=line one READY=1"


def test_without_notify_socket_every_call_is_a_no_op() -> None:
    notifier = SystemdNotifier({})
    assert not notifier.enabled
    assert notifier.ready("x") is False
    assert notifier.status("x") is False
    assert notifier.watchdog() is False
    assert notifier.stopping() is False
    assert notifier.extend_timeout(1) is False


def test_send_error_is_logged_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    notifier = SystemdNotifier({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens.sock")})
    with caplog.at_level(logging.DEBUG, logger="spotguard.daemon.notify"):
        assert notifier.ready() is False
        assert notifier.watchdog() is False
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, "repeated failures must not log a warning each time"
    assert "READY=1" in warnings[0].getMessage()


def test_recovers_after_socket_appears(tmp_path: Path) -> None:
    path = tmp_path / "late.sock"
    notifier = SystemdNotifier({"NOTIFY_SOCKET": str(path)})
    assert notifier.watchdog() is False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(2.0)
        assert notifier.watchdog() is True
        assert receive(sock) == "WATCHDOG=1"


def test_unsupported_notify_socket_disables_notifier() -> None:
    notifier = SystemdNotifier({"NOTIFY_SOCKET": "vsock:2:1234"})
    assert not notifier.enabled
    assert notifier.ready() is False


def test_extend_timeout_rejects_non_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        SystemdNotifier({}).extend_timeout(0)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "4242"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "me"}, None),
    ],
)
def test_watchdog_interval_is_half_the_period_for_our_pid(env: dict[str, str], expected: float | None) -> None:
    assert SystemdNotifier(env, pid=4242).watchdog_interval() == expected


def test_watchdog_interval_defaults_to_own_pid() -> None:
    env = {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}
    assert SystemdNotifier(env).watchdog_interval() == 1.0


def test_watchdog_loop_pings_from_the_event_loop(systemd_socket: tuple[socket.socket, str]) -> None:
    sock, address = systemd_socket
    notifier = SystemdNotifier({"NOTIFY_SOCKET": address})

    async def run_then_cancel() -> None:
        task = asyncio.create_task(watchdog_loop(notifier, 0.02))
        await asyncio.sleep(0.15)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run_then_cancel())
    pings = drain(sock)
    assert len(pings) >= 3
    assert set(pings) == {"WATCHDOG=1"}
    time.sleep(0.06)
    assert drain(sock) == [], "a cancelled watchdog loop must stop pinging"


def test_watchdog_loop_stops_pinging_while_the_loop_is_blocked(
    systemd_socket: tuple[socket.socket, str],
) -> None:
    sock, address = systemd_socket
    notifier = SystemdNotifier({"NOTIFY_SOCKET": address})
    pings_while_blocked: list[str] = []

    async def block_the_loop() -> None:
        task = asyncio.create_task(watchdog_loop(notifier, 0.01))
        await asyncio.sleep(0.05)
        drain(sock)
        # A hung event loop (here: a blocking sleep on it) must starve the watchdog.
        time.sleep(0.2)
        pings_while_blocked.extend(drain(sock))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(block_the_loop())
    assert pings_while_blocked == []


def test_watchdog_loop_returns_at_once_when_off(systemd_socket: tuple[socket.socket, str]) -> None:
    sock, address = systemd_socket

    async def both() -> None:
        await asyncio.wait_for(watchdog_loop(SystemdNotifier({"NOTIFY_SOCKET": address}), None), 1.0)
        await asyncio.wait_for(watchdog_loop(SystemdNotifier({}), 0.01), 1.0)

    asyncio.run(both())
    assert drain(sock) == []
