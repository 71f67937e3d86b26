"""A data frame sealed in place from a file, or from the file's mapped pages (a worker's way), is
byte for byte the frame :meth:`Channel.seal` makes of the same header and bytes (same key, same
counter), whatever the sizes, and no mapping outlives it; sealed batch by batch, what
was handed out is never touched again; a payload received beside its opening arrives whole, and a
changed record stops the receive still under way."""

from __future__ import annotations

import concurrent.futures
import errno
import mmap
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, cast

import pytest

from spotguard.peer import noise, wire
from spotguard.peer.channel import Channel
from spotguard.peer.records import (
    BATCH_RECORDS,
    FULL_RECORD,
    MAX_PLAINTEXT,
    batch_buffers,
    open_payload,
    seal_batches,
    seal_frame,
    sealed_size,
)
from spotguard.peer.sockio import HandedSocket

KEY = bytes(range(32))


def mapped_files() -> list[str]:
    """The files this process has mapped (``/proc/self/maps``: a path is a line's sixth field)."""
    lines = [line.split(maxsplit=5) for line in Path("/proc/self/maps").read_text().splitlines()]
    return [fields[5] for fields in lines if len(fields) == 6]


def sealed_from(fd: int, header: bytes, offset: int, length: int, out: bytearray, *, mapped: bool) -> bytes:
    if mapped:
        return bytes(seal_frame(noise.CipherState(KEY), header, fd, offset, length, out=out, mapped=True))
    return bytes(channel().seal_read(header, fd, offset, length, out))


def channel() -> Channel:
    # Sealing touches the sending cipher only: no stream, no socket.
    return Channel(cast(Any, None), cast(Any, None), noise.CipherState(KEY), noise.CipherState(KEY))


@pytest.mark.parametrize("mapped", [False, True], ids=["read", "mapped"])
@pytest.mark.parametrize(
    ("offset", "length"),
    [
        (0, 0),
        (0, 1),
        (5, MAX_PLAINTEXT),
        (3, MAX_PLAINTEXT + 1),
        (0, 4 * MAX_PLAINTEXT),
        (7, 300_000),
        (3 * 4096 + 17, 300_000),  # a mapping starts on a page: this one 17 bytes before the range
    ],
)
def test_a_frame_sealed_in_place_equals_the_sealed_copy(tmp_path: Path, offset: int, length: int, mapped: bool) -> None:
    data = os.urandom(offset + length + 11)
    (tmp_path / "f").write_bytes(data)
    header = b'{"t":"data"}' * 9
    expected = channel().seal(header, data[offset : offset + length])
    buffer = bytearray(b"\xee" * (sealed_size(len(header), length) + 5))  # stale bytes from a frame before
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        sealed = sealed_from(fd, header, offset, length, buffer, mapped=mapped)
    finally:
        os.close(fd)
    assert len(expected) == sealed_size(len(header), length)
    assert sealed == bytes(expected)
    assert str(tmp_path / "f") not in mapped_files()


def test_a_file_its_filesystem_will_not_map_is_read_instead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENODEV, "No such device")  # what mmap(2) says where a filesystem maps no files

    data = os.urandom(300_000)
    (tmp_path / "f").write_bytes(data)
    monkeypatch.setattr(mmap, "mmap", refuse)
    header = b'{"t":"data"}'
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        sealed = sealed_from(fd, header, 9, 200_000, bytearray(sealed_size(len(header), 200_000)), mapped=True)
    finally:
        os.close(fd)
    assert sealed == bytes(channel().seal(header, data[9:200_009]))


@pytest.mark.parametrize("mapped", [False, True], ids=["read", "mapped"])
def test_a_file_that_ends_first_or_a_small_buffer_is_refused(tmp_path: Path, mapped: bool) -> None:
    (tmp_path / "f").write_bytes(b"x" * 100)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        with pytest.raises(EOFError):  # mapped, a page past the file's end would have raised SIGBUS
            sealed_from(fd, b"h", 50, 51, bytearray(sealed_size(1, 51)), mapped=mapped)
        with pytest.raises(ValueError, match="sealed_size"):
            sealed_from(fd, b"h", 0, 100, bytearray(sealed_size(1, 100) - 1), mapped=mapped)
    finally:
        os.close(fd)
    assert str(tmp_path / "f") not in mapped_files()


@pytest.mark.parametrize("mapped", [False, True], ids=["read", "mapped"])
def test_a_frame_sealed_into_two_batch_buffers_in_turn_leaves_each_batch_whole_until_the_one_after_next(
    tmp_path: Path, mapped: bool
) -> None:
    # A worker sends each batch while the next is sealed into the other buffer: a batch handed out
    # is never touched while the next is sealed, and the batches in order are the whole frame.
    length = 3 * BATCH_RECORDS * MAX_PLAINTEXT + 12_345  # four batches, the header's record in the first
    data = os.urandom(length + 3)
    (tmp_path / "f").write_bytes(data)
    header = b'{"t":"data"}'
    expected = bytes(channel().seal(header, data[3:]))
    buffers = batch_buffers()
    handed_out: list[bytes] = []
    last: tuple[memoryview, bytes] | None = None
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        for sealed in seal_batches(noise.CipherState(KEY), header, fd, 3, length, batches=buffers, mapped=mapped):
            if last is not None:
                assert bytes(last[0]) == last[1], "the batch before was touched while this one was sealed"
            handed_out.append(bytes(sealed))
            last = (sealed, bytes(sealed))
        with pytest.raises(ValueError, match="batch buffers"):
            next(seal_batches(noise.CipherState(KEY), header, fd, 3, length, batches=(bytearray(10), buffers[1])))
    finally:
        os.close(fd)
    assert len(handed_out) == 4
    assert b"".join(handed_out) == expected
    assert str(tmp_path / "f") not in mapped_files()


def _payload_over_a_socket(payload: bytes, ahead: int, change_at: int | None = None, stall_after: int | None = None):
    """A payload's records (as a data frame lays them out) sent by a thread on one end of a socket
    pair: ``ahead`` bytes of them returned as read ahead, one byte changed at ``change_at``, the
    sender going silent (its end left open) after ``stall_after`` bytes."""
    sealed = bytearray(channel().seal(payload))
    if change_at is not None:
        sealed[change_at] ^= 0x01
    theirs, ours = socket.socketpair()
    ours.setblocking(False)
    rest = sealed[ahead:] if stall_after is None else sealed[ahead:stall_after]
    sender = threading.Thread(target=theirs.sendall, args=(rest,), daemon=True)
    sender.start()
    return bytes(sealed[:ahead]), ours, theirs


@pytest.mark.parametrize("use_thread", [True, False], ids=["beside", "in-turn"])
@pytest.mark.parametrize("ahead", [0, 100, FULL_RECORD + 7])
def test_a_payload_received_beside_its_opening_or_in_turn_arrives_whole(ahead: int, use_thread: bool) -> None:
    payload = os.urandom(3 * BATCH_RECORDS * MAX_PLAINTEXT + 999)
    read_ahead, ours, theirs = _payload_over_a_socket(payload, ahead)
    handed = HandedSocket(ours.fileno())
    view = memoryview(bytearray(len(payload)))
    batches = batch_buffers()
    with concurrent.futures.ThreadPoolExecutor(1) as beside, ours, theirs:
        open_payload(
            noise.CipherState(KEY),
            batches,
            lambda chunk: handed.recv_exactly(chunk, 10),
            read_ahead,
            view,
            beside=beside if use_thread else None,
            stop=lambda: handed.shut(socket.SHUT_RD),
        )
        handed.close()
    assert bytes(view) == payload


def test_a_changed_record_stops_the_batch_still_coming_at_once() -> None:
    # The first batch holds a changed record and the sender then goes silent: the error comes at
    # once, not after the receive's deadline, and the thread beside is free again.
    payload = os.urandom(3 * BATCH_RECORDS * MAX_PLAINTEXT)
    read_ahead, ours, theirs = _payload_over_a_socket(
        payload, 0, change_at=500, stall_after=BATCH_RECORDS * FULL_RECORD + 10
    )
    handed = HandedSocket(ours.fileno())
    batches = batch_buffers()
    with concurrent.futures.ThreadPoolExecutor(1) as beside, ours, theirs:
        started = time.monotonic()
        with pytest.raises(wire.PeerError) as caught:
            open_payload(
                noise.CipherState(KEY),
                batches,
                lambda chunk: handed.recv_exactly(chunk, 60),
                read_ahead,
                memoryview(bytearray(len(payload))),
                beside=beside,
                stop=lambda: handed.shut(socket.SHUT_RD),
            )
        assert caught.value.code == "bad-record"
        assert time.monotonic() - started < 10  # the receive's deadline is 60 s
        assert beside.submit(lambda: "free").result(timeout=5) == "free"
        handed.close()
