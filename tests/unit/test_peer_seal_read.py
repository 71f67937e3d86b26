"""A data frame sealed in place from a file is byte for byte the frame :meth:`Channel.seal` makes of
the same header and bytes (same key, same counter), whatever the sizes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, cast

import pytest

from spotguard.peer import noise
from spotguard.peer.channel import MAX_PLAINTEXT, Channel, sealed_size

KEY = bytes(range(32))


def channel() -> Channel:
    # Sealing touches the sending cipher only: no stream, no socket.
    return Channel(cast(Any, None), cast(Any, None), noise.CipherState(KEY), noise.CipherState(KEY))


@pytest.mark.parametrize(
    ("offset", "length"),
    [(0, 0), (0, 1), (5, MAX_PLAINTEXT), (3, MAX_PLAINTEXT + 1), (0, 4 * MAX_PLAINTEXT), (7, 300_000)],
)
def test_a_frame_sealed_in_place_equals_the_sealed_copy(tmp_path: Path, offset: int, length: int) -> None:
    data = os.urandom(offset + length + 11)
    (tmp_path / "f").write_bytes(data)
    header = b'{"t":"data"}' * 9
    expected = channel().seal(header, data[offset : offset + length])
    buffer = bytearray(b"\xee" * (sealed_size(len(header), length) + 5))  # stale bytes from a frame before
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        sealed = channel().seal_read(header, fd, offset, length, buffer)
    finally:
        os.close(fd)
    assert len(expected) == sealed_size(len(header), length)
    assert bytes(sealed) == bytes(expected)


def test_a_file_that_ends_first_or_a_small_buffer_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x" * 100)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        with pytest.raises(EOFError):
            channel().seal_read(b"h", fd, 50, 51, bytearray(sealed_size(1, 51)))
        with pytest.raises(ValueError, match="sealed_size"):
            channel().seal_read(b"h", fd, 0, 100, bytearray(sealed_size(1, 100) - 1))
    finally:
        os.close(fd)
