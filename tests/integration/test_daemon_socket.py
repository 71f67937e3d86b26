"""Acceptance: socket abuse gets errors or refusals, and the daemon keeps serving the others."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spotguard import protocol
from spotguard.cli import main
from spotguard.control import request
from spotguard.harness import Vm, wait_for
from tests.checkpoints import write_checkpoint


def exchange(path: Path, payload: bytes, timeout: float = 5.0) -> list[dict]:
    """Send raw bytes, read replies until the daemon stops talking or hangs up."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(os.fspath(path))
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
        except BrokenPipeError:
            pass  # the daemon may refuse and hang up before reading: its reply is still there to read
        data = b""
        # A daemon that hangs up on unread bytes makes the kernel end the stream with ECONNRESET
        # after what it did send: the replies are all read by then.
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                data += chunk
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def assert_alive(vm: Vm) -> None:
    assert request(vm.socket, "status")["pid"] == vm.process.pid  # type: ignore[union-attr]


def test_invalid_json_gets_error_and_connection_survives(vm: Vm) -> None:
    replies = exchange(vm.socket, b"{nope\n" + protocol.encode("status"))
    assert replies[0]["type"] == "error" and replies[0]["code"] == "bad-json"
    assert replies[1]["type"] == "status"  # the same connection still works
    assert_alive(vm)


def test_oversized_message_is_refused_and_disconnected(vm: Vm) -> None:
    huge = b'{"v":1,"type":"status","pad":"' + b"x" * (200 * 1024) + b'"}\n'
    replies = exchange(vm.socket, huge + protocol.encode("status"))
    assert [r["code"] for r in replies] == ["too-large"]
    assert_alive(vm)


def test_unknown_type_and_bad_fields_get_errors(vm: Vm) -> None:
    replies = exchange(
        vm.socket,
        b'{"v":1,"type":"format-disk"}\n{"v":1,"type":"saved","path":3,"step":1,"reason":"urgent"}\n[]\n',
    )
    assert [r["code"] for r in replies] == ["unknown-type", "bad-field", "bad-message"]
    assert_alive(vm)


def test_reported_paths_outside_the_root_are_refused(vm: Vm, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere" / "step-000000001"
    outside.mkdir(parents=True)
    vm.root.mkdir(parents=True, exist_ok=True)
    (vm.root / "link").symlink_to(outside)
    attempts = [
        str(outside),
        str(vm.root / ".." / "elsewhere"),
        str(vm.root / "link"),
        "/etc",
        str(vm.root / "step-000000404"),
    ]
    payload = b"".join(protocol.encode("saved", path=p, step=1, reason="urgent") for p in attempts)
    replies = exchange(vm.socket, payload)
    assert [r["code"] for r in replies] == ["bad-path"] * len(attempts)
    uncommitted = vm.root / "step-000000002"
    uncommitted.mkdir()
    [reply] = exchange(vm.socket, protocol.encode("saved", path=str(uncommitted), step=2, reason="urgent"))
    assert reply["code"] == "not-committed"
    assert_alive(vm)


def test_fifty_clients_at_once_are_all_served(vm: Vm) -> None:
    def one(i: int) -> str:
        hello = protocol.encode("hello", rank=i, world_size=50, pid=os.getpid(), checkpoint_dir=str(vm.root))
        return exchange(vm.socket, hello + b"garbage\n" + protocol.encode("status"))[-1]["type"]

    with ThreadPoolExecutor(50) as pool:
        results = list(pool.map(one, range(50)))
    assert results == ["status"] * 50
    assert_alive(vm)


def test_connections_over_the_limit_are_refused_politely(vm_factory: Callable[..., Vm]) -> None:
    vm = vm_factory("small", env={"SPOTGUARD_MAX_CONNECTIONS": "3"})
    held = []
    try:
        for _ in range(3):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(os.fspath(vm.socket))
            sock.sendall(protocol.encode("status"))
            assert sock.recv(65536)  # served, and still holding its slot
            held.append(sock)
        replies = exchange(vm.socket, protocol.encode("status"))
        assert [r.get("code") for r in replies] == ["busy"]
    finally:
        for sock in held:
            sock.close()


def test_peers_with_other_uids_are_refused(vm_factory: Callable[..., Vm]) -> None:
    # Allow only a uid that is not ours: SO_PEERCRED must refuse us.
    other = "4242" if os.getuid() != 4242 else "4243"
    vm = vm_factory("strict", env={"SPOTGUARD_ALLOWED_UIDS": other})
    replies = exchange(vm.socket, protocol.encode("status"))
    assert [r.get("code") for r in replies] == ["forbidden"]


def test_socket_file_mode_is_0660(vm: Vm) -> None:
    assert vm.socket.stat().st_mode & 0o777 == 0o660


def test_a_symlink_at_the_socket_path_is_refused_and_not_unlinked(
    vm_factory: Callable[..., Vm], tmp_path: Path
) -> None:
    precious = tmp_path / "precious"
    precious.write_text("not the daemon's to delete")
    vm = vm_factory("linked", start=False)
    vm.dir.mkdir(parents=True)
    vm.socket.symlink_to(precious)
    with pytest.raises(RuntimeError, match="exited with 1"):
        vm.start_daemon()
    assert vm.socket.is_symlink() and precious.read_text() == "not the daemon's to delete"
    assert "is a symlink; refusing to replace it" in vm.log.read_text()


def test_a_symlinked_file_in_a_step_directory_is_not_uploaded(vm: Vm, bucket: str, tmp_path: Path) -> None:
    # What a trainer could do to a daemon that reads as root: commit a checkpoint, then swap one of
    # its files for a link to a file of the same bytes that only the daemon may read.
    secret = tmp_path / "shadow"
    secret.write_bytes(b"root:$6$not-for-the-bucket")
    step_dir = write_checkpoint(vm.root, 3, {"model.pt": secret.read_bytes(), "extra.pt": b"x" * 100})
    (step_dir / "model.pt").unlink()
    (step_dir / "model.pt").symlink_to(secret)
    [reply] = exchange(vm.socket, protocol.encode("saved", path=str(step_dir), step=3, reason="urgent"))
    assert reply["type"] == "ok"
    wait_for(
        lambda: "not uploading step-000000003" in vm.log.read_text() and "symlink" in vm.log.read_text(),
        20,
        "the daemon to refuse the symlinked checkpoint",
    )
    remote = Path(bucket.removeprefix("file://")) / step_dir.name
    assert not (remote / "model.pt").exists() and not (remote / "manifest.json").exists()


def test_save_failed_is_recorded_and_safe_steps_names_what_is_in_the_bucket(vm: Vm) -> None:
    # A save-failed without its kind of error is refused; a whole one gets no reply, only a record.
    payload = b'{"v":1,"type":"save-failed","step":3,"reason":"urgent","message":"x"}\n' + protocol.encode(
        "save-failed", step=3, reason="periodic", error="write-failed", message="EIO on /nvme"
    )
    replies = exchange(vm.socket, payload + protocol.encode("safe-steps"))
    assert [r["type"] for r in replies] == ["error", "safe-steps"]
    assert replies[0]["code"] == "bad-field"
    assert replies[1]["names"] == [] and replies[1]["bucket"] == vm.bucket  # nothing committed yet
    [failure] = request(vm.socket, "status")["save_failures"]
    assert (failure["step"], failure["reason"], failure["error"]) == (3, "periodic", "write-failed")
    assert failure["bytes_needed"] is None and failure["message"] == "EIO on /nvme"
    assert_alive(vm)


FORGED = "\n2026-11-27 12:00:00,000 CRITICAL spotguard.daemon: forged by a trainer"
# What may not reach the log or a terminal from a trainer's words (spotguard/oneline.py).
CONTROLS = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
RECORD = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")


def assert_one_line_records(log: str) -> None:
    """Every line of the daemon's log is a record of its own, free of control characters."""
    for line in log.splitlines():
        assert RECORD.match(line) and not CONTROLS.search(line), line


def test_a_trainers_words_reach_the_log_and_status_on_one_line(vm: Vm, capsys: pytest.CaptureFixture[str]) -> None:
    """A failed save's reason, error and message are a trainer's own words. A newline in them started a
    line of its own in the daemon's log (the journal keeps each as an entry of the daemon's), so a
    trainer could forge a record; an escape sequence reached whoever read the log or ran status."""
    words = {"reason": "urgent" + FORGED, "error": "\x1b[2J\x1b[31m", "message": "disk\u202egone\r" + FORGED}
    exchange(vm.socket, protocol.encode("save-failed", step=7, **words))
    wait_for(lambda: "checkpoint at step 7 failed" in vm.log.read_text(), 10, "the failure to be logged")
    log = vm.log.read_text()
    assert_one_line_records(log)
    [line] = [line for line in log.splitlines() if "checkpoint at step 7 failed" in line]
    assert line.count("\\n2026-11-27 12:00:00,000 CRITICAL spotguard.daemon: forged") == 2
    assert "\\x1b[2J" in line and "disk\\u202egone\\r" in line
    assert main(["status", "--socket", str(vm.socket)]) == 0
    shown = capsys.readouterr().out
    [failed] = [line for line in shown.splitlines() if line.startswith("save failed: step 7")]
    assert not CONTROLS.search(shown) and failed.count("forged by a trainer") == 2
    assert not any(line.startswith("2026-11-27") for line in shown.splitlines())
    assert_alive(vm)


def test_numbers_no_one_can_compute_with_and_deep_nesting_get_errors_and_the_next_notice_is_planned(
    vm: Vm,
) -> None:
    """A state of 10**400 bytes announced on a trainer's hello used to be kept, and the next notice's
    deadline plan raised OverflowError (no route chosen); nesting and 5,000-digit numbers got an
    "internal" error instead of the protocol's own."""
    hello = {"rank": 0, "world_size": 1, "pid": os.getpid()}
    nested = b'{"v":1,"type":"status","x":' + b"[" * 20_000 + b"]" * 20_000 + b"}\n"
    digits = b'{"v":1,"type":"hello","rank":' + b"7" * 5000 + b',"world_size":1,"pid":1}\n'
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as trainer:  # stays connected through the notice
        trainer.settimeout(5)
        trainer.connect(os.fspath(vm.socket))
        reader = trainer.makefile("rb")
        refused = [
            protocol.encode("hello", **hello, state_bytes=10**400),
            protocol.encode("hello", **hello, state_bytes=2**63),
            protocol.encode("state-size", bytes=10**30, sharded=False),
            b'{"v":1,"type":"drill","deadline_s":NaN}\n',
            b'{"v":1,"type":"drill","deadline_s":Infinity}\n',
            nested,
            digits,
        ]
        codes = []
        for line in refused:
            trainer.sendall(line)
            codes.append(json.loads(reader.readline())["code"])
        assert codes == ["bad-field"] * 5 + ["bad-json"] * 2
        trainer.sendall(protocol.encode("hello", **hello, state_bytes=3 * 2**20))
        assert json.loads(reader.readline())["type"] == "welcome"
        request(vm.socket, "drill", deadline_s=60)
        assert json.loads(reader.readline())["type"] == "checkpoint-now"
        plan = vm.status()["plan"]
        assert plan["bytes"] == 3 * 2**20 and plan["size_from"] == "announced"
    assert_alive(vm)
    assert "internal error" not in vm.log.read_text()


def request_of(kind: str, root: Path) -> st.SearchStrategy[dict[str, Any]]:
    """A request of ``kind`` whose fields all have the declared types (it passes ``decode``), with values
    a trainer should never send: paths outside the root, NUL bytes, negative and huge numbers."""
    step = root / "step-000000001"
    paths = st.one_of(
        st.text(max_size=16),
        st.sampled_from(
            [str(root), str(step), f"{step}/w.bin", f"{step}/../..", "/", "\x00", f"{step}\x00", "a" * 5000]
        ),
    )
    names = st.one_of(st.text(max_size=8), st.sampled_from(["w.bin", "../w.bin", "a/b", "\x00", "manifest.json", ""]))

    def value(name: str, kind_of: type | tuple[type, ...]) -> st.SearchStrategy[Any]:
        kinds = kind_of if isinstance(kind_of, tuple) else (kind_of,)
        choices: list[st.SearchStrategy[Any]] = []
        for each in kinds:
            if each is bool:
                choices.append(st.booleans())
            elif each is int:
                choices.append(st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(-2, 2)))
            elif each is float:
                choices.append(st.floats(allow_nan=False, allow_infinity=False))
            elif each is dict:
                choices.append(st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
            else:
                choices.append(paths if name in ("path", "tmp", "checkpoint_dir") else names)
        return st.one_of(*choices)

    required = {name: value(name, of) for name, of in protocol.REQUIRED_FIELDS[kind].items()}
    optional = {name: value(name, of) for name, of in protocol.OPTIONAL_FIELDS.get(kind, {}).items()}
    return st.fixed_dictionaries(required, optional=optional).map(lambda f: {"v": protocol.VERSION, "type": kind, **f})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_request_of_the_declared_types_gets_the_protocols_answer_never_an_internal_error(
    vm: Vm, data: st.DataObject
) -> None:
    """The daemon's handlers behind ``decode``: a NUL byte in a reported path, or a hello's
    checkpoint_dir of another type, reached them and came back as "internal" with a traceback logged."""
    if not (vm.root / "step-000000001").exists():
        write_checkpoint(vm.root, 1, {"w.bin": b"x"})  # reported paths may then lead somewhere real
    kinds = st.sampled_from(sorted(protocol.CLIENT_TYPES))
    batch = data.draw(st.lists(kinds.flatmap(lambda kind: request_of(kind, vm.root)), min_size=1, max_size=4))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(os.fspath(vm.socket))
        replies = sock.makefile("rb")
        for message in batch:
            # A status after each: every request is answered (or not) before it.
            sock.sendall(json.dumps(message).encode() + b"\n" + protocol.encode("status"))
            statuses = 1 + (message["type"] == "status")
            while statuses:
                reply = json.loads(replies.readline())
                assert reply.get("code") != "internal", (message, reply)
                statuses -= reply["type"] == "status"
    log = vm.log.read_text()
    assert "Traceback" not in log
    assert_one_line_records(log)
