"""The socket protocol between the daemon and its clients (trainer hooks, the CLI).

Newline-delimited JSON objects, each ``{"v": 1, "type": ..., ...}``, at most
``MAX_MESSAGE_BYTES`` per line by default. Stdlib only: both sides import it.

Client -> daemon:
  hello   {rank, world_size, pid, checkpoint_dir,    a trainer introduces itself; state_bytes/sharded once it
           state_bytes?, sharded?, version?}         knows its state's size (re-sent on every reconnect);
                                                     version: the hook's spotguard version
  state-size {bytes, sharded}                        the trainer's state now takes about bytes (its tensors'
                                                     storage, this rank's share when sharded); sent when it
                                                     changes by more than 5 % (no reply)
  file    {path, name, size, crc32c}                 one file of a checkpoint being written is complete
                                                     (uploading starts before the commit; no reply)
  file-range {path, name, tmp, size, offset,         bytes [offset, offset+length) of a file being written under
           length}                                   its temporary name tmp are written (not yet fsynced) and
                                                     never written again; ranges of a file arrive in any order,
                                                     never overlap, cover [0, size), and come before its file
                                                     message (streaming uploads; no reply)
  saved   {path, step, reason, event_id?}           a checkpoint is committed locally
  checkpoint-started {event_id, step}                the loop reached a checkpoint point for a notice
                                                     (the daemon's stall detector; no reply)
  save-failed {step, reason, error, message,         a save failed and nothing was committed (no reply);
           bytes_needed?, bytes_free?, path?,         error says what kind of failure: "disk-full", "write-failed"
           event_id?}
  save-cancelled {step, reason}                      a save was cancelled (an urgent one pre-empted a periodic
                                                     one) and nothing was committed: its files sent ahead go
                                                     (no reply)
  safe-steps {}                                      which local checkpoints are complete in the bucket
  peer-resume {after, fetch?}                        before a resume: fetch the newest checkpoint a peer holds
                                                     verified if it is newer than step after (the newest
                                                     complete one the trainer has) and than the bucket's
                                                     (at most PEER_RESUME_TIMEOUT s; fetch false: only look)
  drill   {deadline_s?}                              inject a simulated hard notice (default: drill_deadline)
  status  {}                                         what the daemon sees
Daemon -> client:
  welcome          {checkpoint_dir, bucket, daemon_pid, peers,     reply to hello (peers: ask peer-resume;
                    version?}                                      version: the daemon's spotguard version)
  checkpoint-now   {notice, stop, deadline_s}                      write an urgent checkpoint now
  ok               {...}                                           reply to saved/drill
  safe-steps       {names, bucket}                                 reply to safe-steps: step directory names
                                                                   committed in the bucket (may be dropped locally)
  peer-resume      {after, path, step, peer, not_fetched}          reply to peer-resume: path of the fetched,
                                                                   verified, locally committed checkpoint or
                                                                   null; after: the newest step it was compared
                                                                   with; not_fetched: newer ones left on peers
  status           {...}                                           reply to status
  error            {code, message}                                 what was wrong with the request
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from spotguard.errors import SpotguardError
from spotguard.jsontext import parse_json

VERSION = 1
MAX_MESSAGE_BYTES = 64 * 1024
MAX_DRILL_SECONDS = 3600.0  # the longest deadline a drill may give (a drill request's or drill_deadline)
PEER_RESUME_TIMEOUT = 600.0  # seconds the daemon spends at most asking peers and fetching from one
# Every integer field fits a C long long: sizes, offsets and steps go on to os.pwrite, struct and float
# arithmetic, where a bigger one raises OverflowError far from the socket. A state of 10**400 bytes
# announced on hello made the next notice's deadline plan raise: the trainers were told, but no route
# was chosen (no peer handoff) and no webhook or metric heard of the notice.
MAX_INT = 2**63 - 1


class ProtocolError(SpotguardError, ValueError):
    """A message that cannot be accepted; ``code`` goes into the error reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


# Required fields and their types, per message type.
REQUIRED_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "hello": {"rank": int, "world_size": int, "pid": int},
    "state-size": {"bytes": int, "sharded": bool},
    "file": {"path": str, "name": str, "size": int, "crc32c": str},
    "file-range": {"path": str, "name": str, "tmp": str, "size": int, "offset": int, "length": int},
    "saved": {"path": str, "step": int, "reason": str},
    "checkpoint-started": {"event_id": str, "step": int},
    "save-failed": {"step": int, "reason": str, "error": str, "message": str},
    "save-cancelled": {"step": int, "reason": str},
    "safe-steps": {},  # the request is empty; the reply carries names (a list of str) and bucket
    "peer-resume": {"after": int},  # request and reply: the reply's after is the step it compared with
    "drill": {},  # deadline_s optional: the daemon's drill_deadline when absent
    "status": {},
    "welcome": {"checkpoint_dir": str},
    "checkpoint-now": {"notice": dict, "stop": bool, "deadline_s": (int, float)},
    "ok": {},
    "error": {"code": str, "message": str},
}
# Fields that may be absent, and their types when present.
OPTIONAL_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "drill": {"deadline_s": (int, float)},
    "hello": {"checkpoint_dir": str, "state_bytes": int, "sharded": bool, "version": str},
    "saved": {"event_id": str},
    "save-failed": {"bytes_needed": int, "bytes_free": int, "path": str, "event_id": str},
    "peer-resume": {"fetch": bool},
    "error": {"re": str},  # the type of the request it answers, when that was known
    "welcome": {"version": str},
}
CLIENT_TYPES = frozenset(
    {
        "hello", "state-size", "file", "file-range", "saved", "checkpoint-started", "save-failed",
        "save-cancelled", "safe-steps", "peer-resume", "drill", "status",
    }
)  # fmt: skip
# What a save-failed message's "error" names (a trainer's own words are in its "message").
DISK_FULL = "disk-full"
WRITE_FAILED = "write-failed"
SAVE_FAILURES = (DISK_FULL, WRITE_FAILED)

DAEMON_TYPES = frozenset({"welcome", "checkpoint-now", "ok", "safe-steps", "peer-resume", "status", "error"})


def encode(message_type: str, **fields: Any) -> bytes:
    if message_type not in REQUIRED_FIELDS:
        raise ValueError(f"unknown message type {message_type!r}")
    return json.dumps({"v": VERSION, "type": message_type, **fields}, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes, *, allowed: frozenset[str] | None = None, limit: int = MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """Parse and validate one line. Raises :class:`ProtocolError` saying what is wrong."""
    if len(line) > limit:
        raise ProtocolError("too-large", f"message of {len(line)} bytes exceeds the limit of {limit}")
    try:
        message = parse_json(line)
    except ValueError as exc:
        raise ProtocolError("bad-json", f"not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError("bad-message", "a message must be a JSON object")
    if message.get("v") != VERSION:
        raise ProtocolError("bad-version", f"protocol version {message.get('v')!r} not supported (want {VERSION})")
    message_type = message.get("type")
    if not isinstance(message_type, str) or message_type not in REQUIRED_FIELDS:
        raise ProtocolError("unknown-type", f"unknown message type {message_type!r}")
    if allowed is not None and message_type not in allowed:
        raise ProtocolError("unknown-type", f"message type {message_type!r} not accepted here")
    _check_fields(message_type, message)
    if message_type == "file-range":
        _check_range(message)
    size = message.get("bytes" if message_type == "state-size" else "state_bytes")
    if message_type in ("hello", "state-size") and isinstance(size, int) and size < 0:
        raise ProtocolError("bad-field", f"{message_type}: the state's bytes must not be negative")
    return message


def _check_range(message: Mapping[str, Any]) -> None:
    size, offset, length = message["size"], message["offset"], message["length"]
    if size < 0 or offset < 0 or length < 0:
        raise ProtocolError("bad-field", "file-range: size, offset and length must not be negative")
    if offset + length > size:
        raise ProtocolError("bad-field", f"file-range: [{offset}, {offset + length}) is past the file's {size} bytes")


def _check_fields(message_type: str, message: Mapping[str, Any]) -> None:
    for name, expected in REQUIRED_FIELDS[message_type].items():
        value = message.get(name)
        if value is None or not _is_a(value, expected):
            raise ProtocolError("bad-field", f"{message_type}: field {name!r} missing or not {_type_name(expected)}")
    for name, expected in OPTIONAL_FIELDS.get(message_type, {}).items():
        value = message.get(name)
        if value is not None and not _is_a(value, expected):
            raise ProtocolError("bad-field", f"{message_type}: field {name!r} is not {_type_name(expected)}")


def _is_a(value: Any, expected: type | tuple[type, ...]) -> bool:
    """Whether ``value`` is of ``expected`` and, if a number, one the other side can compute with."""
    if isinstance(value, bool):  # bool is an int in Python; a number field must not take true/false
        return expected is bool
    if not isinstance(value, expected):
        return False
    if isinstance(value, int):
        return -MAX_INT - 1 <= value <= MAX_INT
    return not isinstance(value, float) or math.isfinite(value)  # JSON's NaN and Infinity are Python's


def _type_name(expected: type | tuple[type, ...]) -> str:
    kinds = expected if isinstance(expected, tuple) else (expected,)
    names = " or ".join(kind.__name__ for kind in kinds)
    if int in kinds or float in kinds:
        return f"{names} (finite, within ±2**63)"
    return names
