from __future__ import annotations

import json

import pytest

from spotguard import protocol


def test_round_trip() -> None:
    line = protocol.encode("saved", path="/x/step-000000001", step=1, reason="urgent")
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    message = protocol.decode(line.strip(), allowed=protocol.CLIENT_TYPES)
    assert message == {"v": 1, "type": "saved", "path": "/x/step-000000001", "step": 1, "reason": "urgent"}


@pytest.mark.parametrize(
    ("line", "code"),
    [
        (b"{not json", "bad-json"),
        (b"\xff\xfe", "bad-json"),
        (b"[1, 2]", "bad-message"),
        (b'{"v": 2, "type": "status"}', "bad-version"),
        (b'{"v": 1, "type": "launch-missiles"}', "unknown-type"),
        (b'{"v": 1, "type": "welcome", "checkpoint_dir": "/x"}', "unknown-type"),  # a daemon message sent to the daemon
        (b'{"v": 1, "type": "saved", "path": "/x", "step": "7", "reason": "urgent"}', "bad-field"),
        (b'{"v": 1, "type": "saved", "path": "/x", "step": true, "reason": "urgent"}', "bad-field"),
        (b'{"v": 1, "type": "drill", "deadline_s": "soon"}', "bad-field"),
        (b'{"v": 1, "type": "drill", "deadline_s": true}', "bad-field"),
        (b'{"v": 1, "type": "checkpoint-started", "step": 3}', "bad-field"),  # which notice?
    ],
)
def test_bad_messages_get_a_precise_error(line: bytes, code: str) -> None:
    with pytest.raises(protocol.ProtocolError) as info:
        protocol.decode(line, allowed=protocol.CLIENT_TYPES)
    assert info.value.code == code


def test_a_drill_may_leave_its_deadline_to_the_daemon() -> None:
    assert "deadline_s" not in protocol.decode(b'{"v": 1, "type": "drill"}', allowed=protocol.CLIENT_TYPES)
    assert protocol.decode(b'{"v": 1, "type": "drill", "deadline_s": 30}')["deadline_s"] == 30


def test_size_limit() -> None:
    big = json.dumps({"v": 1, "type": "status", "pad": "x" * 2000}).encode()
    with pytest.raises(protocol.ProtocolError) as info:
        protocol.decode(big, limit=1024)
    assert info.value.code == "too-large"
    assert protocol.decode(big, limit=4096)["type"] == "status"


def test_checkpoint_started_is_a_client_message() -> None:
    line = protocol.encode("checkpoint-started", event_id="drill-1", step=12)
    assert protocol.decode(line.strip(), allowed=protocol.CLIENT_TYPES) == {
        "v": 1,
        "type": "checkpoint-started",
        "event_id": "drill-1",
        "step": 12,
    }


def test_save_failed_carries_the_numbers_and_safe_steps_goes_both_ways() -> None:
    line = protocol.encode(
        "save-failed",
        step=6,
        reason="urgent",
        error="disk-full",
        message="no room",
        bytes_needed=10,
        bytes_free=4,
        path="/nvme",
    )
    message = protocol.decode(line.strip(), allowed=protocol.CLIENT_TYPES)
    assert (message["error"], message["bytes_needed"], message["bytes_free"]) == ("disk-full", 10, 4)
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(b'{"v": 1, "type": "save-failed", "step": 6, "reason": "urgent"}')
    assert protocol.decode(protocol.encode("safe-steps").strip(), allowed=protocol.CLIENT_TYPES)["type"] == "safe-steps"
    answer = protocol.encode("safe-steps", names=["step-000000005"], bucket=None)
    reply = protocol.decode(answer.strip(), allowed=protocol.DAEMON_TYPES)
    assert reply["names"] == ["step-000000005"]


def test_save_cancelled_is_a_client_message_naming_the_step_and_reason() -> None:
    line = protocol.encode("save-cancelled", step=6, reason="periodic")
    message = protocol.decode(line.strip(), allowed=protocol.CLIENT_TYPES)
    assert (message["step"], message["reason"]) == (6, "periodic")
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(b'{"v": 1, "type": "save-cancelled", "step": "6", "reason": "periodic"}')
    with pytest.raises(protocol.ProtocolError):  # a daemon never sends it
        protocol.decode(line.strip(), allowed=protocol.DAEMON_TYPES)


def test_file_range_is_a_client_message_with_every_field_checked() -> None:
    fields = {"path": "/c/step-000000002", "name": "model.pt", "tmp": ".model.pt.tmp-7", "size": 100}
    line = protocol.encode("file-range", **fields, offset=64, length=36)
    message = protocol.decode(line, allowed=protocol.CLIENT_TYPES)
    assert (message["type"], message["offset"], message["length"]) == ("file-range", 64, 36)
    with pytest.raises(protocol.ProtocolError, match="length"):
        protocol.decode(protocol.encode("file-range", **fields, offset=64), allowed=protocol.CLIENT_TYPES)
    with pytest.raises(protocol.ProtocolError, match="not accepted here"):
        protocol.decode(line, allowed=protocol.DAEMON_TYPES)


def _range(**fields: object) -> bytes:
    message = {"v": 1, "type": "file-range", "path": "/x/step-000000001", "name": "model.pt"}
    message.update({"tmp": ".model.pt.tmp-12", "size": 100, "offset": 0, "length": 10})
    message.update(fields)
    return json.dumps(message).encode()


def test_file_range_is_a_client_message() -> None:
    line = protocol.encode(
        "file-range", path="/x/step-000000001", name="a/b.pt", tmp="a/.b.pt.tmp-1", size=9, offset=4, length=5
    )
    message = protocol.decode(line.strip(), allowed=protocol.CLIENT_TYPES)
    assert (message["type"], message["offset"], message["length"]) == ("file-range", 4, 5)


@pytest.mark.parametrize(
    "fields",
    [
        {"offset": -1},
        {"length": -5},
        {"size": -1, "length": 0},
        {"offset": 95, "length": 10},  # past the end
        {"length": True},
        {"offset": 1.5},
        {"tmp": None},
    ],
)
def test_file_range_numbers_are_checked(fields: dict[str, object]) -> None:
    with pytest.raises(protocol.ProtocolError) as info:
        protocol.decode(_range(**fields), allowed=protocol.CLIENT_TYPES)
    assert info.value.code == "bad-field"


def test_peer_resume_asks_with_the_newest_step_known_and_is_answered_with_a_path_or_none() -> None:
    request = protocol.decode(protocol.encode("peer-resume", after=-1, fetch=True), allowed=protocol.CLIENT_TYPES)
    assert (request["after"], request["fetch"]) == (-1, True)
    with pytest.raises(protocol.ProtocolError, match="after"):
        protocol.decode(protocol.encode("peer-resume"), allowed=protocol.CLIENT_TYPES)
    answer = protocol.encode("peer-resume", after=5, path="/nvme/step-000000009", step=9, peer="10.0.0.2:7140")
    assert protocol.decode(answer, allowed=protocol.DAEMON_TYPES)["path"] == "/nvme/step-000000009"
    assert (
        protocol.decode(protocol.encode("peer-resume", after=5, path=None), allowed=protocol.DAEMON_TYPES)["path"]
        is None
    )


def test_state_size_is_a_client_message_and_hello_may_carry_it() -> None:
    line = protocol.encode("state-size", bytes=96 << 20, sharded=False)
    assert protocol.decode(line, allowed=protocol.CLIENT_TYPES)["bytes"] == 96 << 20
    assert "state-size" not in protocol.DAEMON_TYPES
    hello = {"rank": 0, "world_size": 2, "pid": 1, "checkpoint_dir": "/x"}
    assert "state_bytes" not in protocol.decode(protocol.encode("hello", **hello))  # still optional
    told = protocol.decode(protocol.encode("hello", **hello, state_bytes=5, sharded=True))
    assert told["state_bytes"] == 5 and told["sharded"] is True


def test_hello_and_welcome_may_name_their_sides_version_as_text() -> None:
    hello = {"rank": 0, "world_size": 1, "pid": 1, "checkpoint_dir": "/x"}
    assert protocol.decode(protocol.encode("hello", **hello, version="0.1.0"))["version"] == "0.1.0"
    welcome = protocol.encode("welcome", checkpoint_dir="/x", version="0.1.0")
    assert protocol.decode(welcome, allowed=protocol.DAEMON_TYPES)["version"] == "0.1.0"
    numbered = [protocol.encode("hello", **hello, version=1), protocol.encode("welcome", checkpoint_dir="", version=1)]
    for line in numbered:
        with pytest.raises(protocol.ProtocolError, match="field 'version' is not str"):
            protocol.decode(line)


@pytest.mark.parametrize(
    "line",
    [
        b'{"v": 1, "type": "state-size", "bytes": 5}',  # sharded or not?
        b'{"v": 1, "type": "state-size", "bytes": -1, "sharded": false}',
        b'{"v": 1, "type": "state-size", "bytes": true, "sharded": false}',
        b'{"v": 1, "type": "state-size", "bytes": 5, "sharded": 1}',
        b'{"v": 1, "type": "hello", "rank": 0, "world_size": 1, "pid": 1, "state_bytes": "96M"}',
        b'{"v": 1, "type": "hello", "rank": 0, "world_size": 1, "pid": 1, "state_bytes": -5}',
        b'{"v": 1, "type": "hello", "rank": 0, "world_size": 1, "pid": 1, "sharded": "yes"}',
    ],
)
def test_state_sizes_are_checked(line: bytes) -> None:
    with pytest.raises(protocol.ProtocolError) as info:
        protocol.decode(line, allowed=protocol.CLIENT_TYPES)
    assert info.value.code == "bad-field"
