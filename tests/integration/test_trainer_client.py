"""The hook's daemon connection: bounded while the daemon is away, alive through its own bugs."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from spotguard import protocol
from spotguard.control import request
from spotguard.harness import Vm
from spotguard.trainer.client import DaemonClient, Lines


def wait_until(predicate: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


class ServeFailsOnce(DaemonClient):
    """A client whose first connection hits a bug (not an OSError) in its own code."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.failures = 0

    def _serve(self, sock: socket.socket) -> None:
        if self.failures == 0:
            self.failures += 1
            raise RuntimeError("injected bug in the connection loop")
        super()._serve(sock)


def test_client_thread_survives_an_unexpected_error_and_reconnects(vm: Vm) -> None:
    seen: list[dict[str, Any]] = []

    def on_message(message: dict[str, Any]) -> None:
        seen.append(message)
        if message["type"] == "welcome":
            raise KeyError("injected bug in the hook's handler")

    hello = {"rank": 0, "world_size": 1, "pid": 1, "checkpoint_dir": str(vm.root)}
    client = ServeFailsOnce(vm.socket, hello, on_message, retry_max=0.2).start()
    try:
        wait_until(client.welcomed.is_set)
        assert client.failures == 1 and client.connections == 1
        # The handler raised on the welcome; the connection still delivers what comes next.
        reply = request(vm.socket, "drill", deadline_s=60.0)
        assert reply["trainers_told"] == 1
        wait_until(lambda: any(m["type"] == "checkpoint-now" for m in seen))
        assert client._thread.is_alive()
    finally:
        client.close()


def test_outbox_stays_bounded_while_no_daemon_listens_and_keeps_what_matters(tmp_path: Path) -> None:
    path = tmp_path / "later.sock"
    hello = {"rank": 0, "world_size": 1, "pid": 1, "checkpoint_dir": str(tmp_path)}
    client = DaemonClient(path, hello, lambda message: None, max_outbox=10).start()
    try:
        for step in range(5):
            for n in range(40):
                client.send("file", path=str(tmp_path / f"step-{step}"), name=f"f{n}", size=1, crc32c="00000000")
            client.send("saved", path=str(tmp_path / f"step-{step}"), step=step, reason="periodic", event_id=None)
        assert len(client._outbox) == 10
        assert client.dropped == 5 * 41 - 10
        # The daemon comes up: what was kept goes out, every "saved" among it, in order.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(str(path))
            listener.listen(1)
            listener.settimeout(15)
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(15)
                received = b""
                while received.count(b"\n") < 11:
                    chunk = conn.recv(65536)
                    assert chunk, "the client hung up early"
                    received += chunk
        messages = [json.loads(line) for line in received.splitlines()]
        assert messages[0]["type"] == "hello"
        assert [m["step"] for m in messages if m["type"] == "saved"] == [0, 1, 2, 3, 4]
        assert len(messages) == 11
    finally:
        client.close()


def test_outbox_full_of_essential_messages_drops_the_oldest(tmp_path: Path) -> None:
    client = DaemonClient(tmp_path / "none.sock", {}, lambda message: None, max_outbox=3)
    for step in range(5):  # not started: nothing is sent, so the queue is all there is
        client.send("saved", path=str(tmp_path), step=step, reason="periodic", event_id=None)
    assert [json.loads(line)["step"] for _, line in client._outbox] == [2, 3, 4]
    assert client.dropped == 2


def test_a_daemon_that_refuses_the_connection_is_retried_with_a_growing_wait_and_logged_once(
    vm_factory: Callable[..., Vm], caplog: pytest.LogCaptureFixture
) -> None:
    """A refusal (``busy`` at the daemon's connection limit, a uid not allowed) closes the connection
    without a welcome. The hook must wait before it tries again, as after a failed connect: retrying
    at once spun a core of the training process (13,000 reconnects and warnings in 2 s)."""
    vm = vm_factory("vm-busy", env={"SPOTGUARD_MAX_CONNECTIONS": "1"})
    hello = {"rank": 0, "world_size": 1, "pid": 1, "checkpoint_dir": str(vm.root)}
    first = DaemonClient(vm.socket, hello, lambda message: None).start()
    refused = DaemonClient(vm.socket, {**hello, "rank": 1}, lambda message: None, retry_max=1.0)
    try:
        wait_until(first.welcomed.is_set)
        caplog.set_level(logging.INFO, logger="spotguard.trainer")
        refused.start()
        wait_until(lambda: "busy" in caplog.text)
        started, connections = time.monotonic(), refused.connections
        time.sleep(3.0)  # the window the reconnects are counted over, not a synchronisation
        tries = refused.connections - connections
        # 0.05 s doubled up to 1 s: some six tries in 3 s (without the wait: tens of thousands).
        assert 1 <= tries <= 10, f"{tries} reconnects in {time.monotonic() - started:.1f} s"
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "busy" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert not refused.welcomed.is_set()
        first.close()  # room again: the refused one is taken at its next try
        wait_until(refused.welcomed.is_set)
    finally:
        first.close()
        refused.close()


def test_an_error_about_another_message_does_not_end_a_waiting_request(vm: Vm) -> None:
    """The daemon names the request an error answers (``re``). An error about a ``file-range`` (its
    directory pruned meanwhile) made a ``safe-steps`` waiting at the time read as "no daemon", and a
    save short of room then applied the no-daemon rule to checkpoints not yet in the bucket."""
    hello = {"rank": 0, "world_size": 1, "pid": 1, "checkpoint_dir": str(vm.root)}
    errors: list[dict[str, Any]] = []
    client = DaemonClient(vm.socket, hello, lambda m: errors.append(m) if m["type"] == "error" else None).start()
    try:
        wait_until(client.welcomed.is_set)
        replies = []
        for _ in range(30):
            gone = vm.root / "step-000000001"  # never made: the daemon answers bad-path
            client.send("file-range", path=str(gone), name="w.bin", tmp="w.bin.tmp", size=10, offset=0, length=10)
            replies.append(client.ask("safe-steps", timeout=10.0))
        assert all(reply is not None and reply["type"] == "safe-steps" for reply in replies), replies
        wait_until(lambda: len(errors) == 30)
        assert {(error["code"], error.get("re")) for error in errors} == {("bad-path", "file-range")}
    finally:
        client.close()


def test_a_daemon_that_stops_reading_never_blocks_a_send_and_later_gets_every_kept_line_whole(tmp_path: Path) -> None:
    """A daemon stopped (SIGSTOP, a debugger) or stuck on a dying disk reads nothing: once the socket's
    buffer is full, a blocking send stopped the training thread for as long as the daemon did. Now the
    socket takes what it can, the rest waits in the bounded outbox, and it all goes, whole and in
    order, once the daemon reads again."""
    path = tmp_path / "stuck.sock"
    hello = {"rank": 0, "world_size": 1, "pid": 1, "checkpoint_dir": str(tmp_path)}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen(1)
        listener.settimeout(15)
        client = DaemonClient(path, hello, lambda message: None, max_outbox=50).start()
        try:
            conn, _ = listener.accept()
            wait_until(client.connected.is_set)
            steps, files_per_step, name = 20, 100, "n" * 1000
            sent = 0

            def a_training_loop() -> None:
                nonlocal sent
                for step in range(steps):
                    for n in range(files_per_step):
                        # 2 MB in all: ten times what a Unix socket's buffer takes.
                        client.send("file", path=str(tmp_path / f"step-{step}"), name=f"{name}{n}", size=1, crc32c="0")
                        sent += 1
                    client.send(
                        "saved", path=str(tmp_path / f"step-{step}"), step=step, reason="periodic", event_id=None
                    )
                    sent += 1

            loop = threading.Thread(target=a_training_loop, daemon=True)
            loop.start()
            loop.join(timeout=30)
            assert not loop.is_alive(), f"send() blocked on a daemon that reads nothing ({sent} messages sent)"
            assert client.dropped > 0, "the socket's buffer did fill: the outbox had to drop hints"

            with conn:
                conn.settimeout(15)
                received = b""
                expected = steps * (files_per_step + 1) - client.dropped + 1  # and the hello
                while received.count(b"\n") < expected:
                    chunk = conn.recv(1 << 20)
                    assert chunk, "the client hung up early"
                    received += chunk
                messages = [json.loads(line) for line in received.splitlines()]  # no line torn or spliced
        finally:
            client.close()
    assert messages[0]["type"] == "hello"
    assert [m["step"] for m in messages if m["type"] == "saved"] == list(range(steps)), "every commit arrives, in order"
    assert len(messages) - 1 + client.dropped == steps * (files_per_step + 1)
    assert not client._outbox


def test_a_daemon_that_sends_megabytes_without_an_end_of_line_costs_the_hook_nothing_and_loses_no_message(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Bytes without a newline (a broken or hostile daemon behind the socket) were all kept and copied
    whole at every read: 128 MiB held the interpreter's lock from the training thread for 150 s. Now
    a line over the protocol's limit is dropped as it comes (never held: ``Lines``), once said, and the
    next one is read."""
    path = tmp_path / "noisy.sock"
    hello = {"rank": 0, "world_size": 1, "pid": 1, "checkpoint_dir": str(tmp_path)}
    got: list[dict[str, Any]] = []
    caplog.set_level(logging.WARNING, logger="spotguard.trainer")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen(1)
        listener.settimeout(15)
        client = DaemonClient(path, hello, got.append).start()
        try:
            conn, _ = listener.accept()
            with conn:
                wait_until(client.connected.is_set)
                noise = b"x" * (1 << 20)
                for _ in range(32):
                    conn.sendall(noise)
                conn.sendall(b"\n" + protocol.encode("ok", step=1))
                wait_until(lambda: len(got) == 1)
        finally:
            client.close()
    assert [(m["type"], m.get("step")) for m in got] == [("ok", 1)]
    said = [r.getMessage() for r in caplog.records if "over" in r.getMessage() and "dropping" in r.getMessage()]
    assert len(said) == 1, said


def test_lines_are_split_whole_across_reads_and_an_overlong_one_is_dropped_up_to_its_end() -> None:
    lines = Lines(8)
    assert lines.feed(b"ab") == [] and lines.feed(b"c\nde") == [b"abc"]
    assert lines.feed(b"\n\n") == [b"de", b""]
    assert lines.feed(b"123456789") == [] and lines.dropped_one() and not lines.dropped_one()
    assert lines.feed(b"more of it") == [] and not lines.dropped_one()  # one line, dropped once
    assert lines.feed(b"tail\nok\nlast") == [b"ok"]
    assert lines.feed(b"!\n") == [b"last!"]


@pytest.mark.parametrize("not_fetched", ["step-000000009", {"a": 1}, 7])
def test_a_peer_resume_reply_with_a_malformed_list_leaves_the_resume_to_go_on(tmp_path: Path, not_fetched: Any) -> None:
    """The reply's own fields are not checked by the protocol: a ``not_fetched`` that is no list raised
    TypeError out of ``Guard.resume``."""
    from spotguard import Guard

    path, root = tmp_path / "odd.sock", tmp_path / "root"
    asked: list[dict[str, Any]] = []

    def a_daemon_with_peers(listener: socket.socket) -> None:
        conn, _ = listener.accept()
        with conn, conn.makefile("rb") as lines:
            json.loads(lines.readline())  # the hello
            conn.sendall(protocol.encode("welcome", checkpoint_dir=str(root), bucket=None, daemon_pid=1, peers=True))
            for line in lines:
                request = json.loads(line)
                if request["type"] == "peer-resume":
                    asked.append(request)
                    conn.sendall(
                        protocol.encode("peer-resume", after=request["after"], path=None, not_fetched=not_fetched)
                    )

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen(1)
        listener.settimeout(15)
        server = threading.Thread(target=a_daemon_with_peers, args=(listener,), daemon=True)
        server.start()
        with Guard(checkpoint_dir=root, socket=path, handle_sigterm=False) as guard:
            assert guard.resume({"w": 1}) == 0  # nothing anywhere: a fresh start, not a TypeError
    assert [r["after"] for r in asked] == [-1]


def test_a_loop_stopped_by_a_hard_notice_exits_with_exit_stopped(tmp_path: Path) -> None:
    from spotguard import EXIT_STOPPED, Guard

    with Guard(checkpoint_dir=tmp_path / "root", socket=tmp_path / "none.sock", handle_sigterm=False) as guard:
        assert guard.exit_code == 0
        assert not guard.should_checkpoint(1)
        guard.notify_sigterm()
        assert guard.should_checkpoint(2)
        guard.save({"w": 2}, 2)
        assert guard.stop_requested
    assert guard.exit_code == EXIT_STOPPED == 75
