"""CRC32C, the checksum S3 and GCS both verify natively: of bytes, files and ranges, and combined.

Manifests record it as 8 lowercase hex digits of the big-endian value; the stores speak base64 of the
same 4 bytes (:func:`crc32c_int_to_base64`, :func:`base64_to_hex`).
"""

from __future__ import annotations

import base64
import binascii
import errno
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import google_crc32c

from spotguard.safefile import open_nofollow

_CHUNK = 8 * 1024 * 1024

_RANGE = 64 * 1024 * 1024  # what one thread reads of a file being checked in parallel


def crc32c_hex(value: int) -> str:
    return f"{value:08x}"


def crc32c_of_file(path: Path) -> str:
    checksum = google_crc32c.Checksum()
    with open(open_nofollow(path), "rb") as handle:
        while chunk := handle.read(_CHUNK):
            checksum.update(chunk)
    return checksum.digest().hex()


def crc32c_of_bytes(data: bytes) -> str:
    return crc32c_hex(google_crc32c.value(data))


def crc32c_hex_to_int(crc_hex: str) -> int:
    try:
        value = int(crc_hex, 16)
    except ValueError:
        raise ValueError(f"crc32c must be 8 hex characters, got {crc_hex!r}") from None
    if len(crc_hex) != 8 or value >> 32:
        raise ValueError(f"crc32c must be 8 hex characters, got {crc_hex!r}")
    return value


def crc32c_int_to_base64(value: int) -> str:
    return base64.b64encode(value.to_bytes(4, "big")).decode("ascii")


_CRC32C_POLY = 0x82F63B78  # reflected Castagnoli polynomial


def _multmodp(a: int, b: int) -> int:
    """a*b modulo the CRC polynomial (zlib's multmodp, Castagnoli polynomial)."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ _CRC32C_POLY if b & 1 else b >> 1
    return p


def _build_x2n_table() -> list[int]:
    table = [1 << 30]  # x^1
    for _ in range(31):
        table.append(_multmodp(table[-1], table[-1]))
    return table


_X2N = _build_x2n_table()


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of ``A + B`` from ``crc(A)``, ``crc(B)`` and ``len(B)``, without the data (zlib's
    crc32_combine): multipart uploads and ranged downloads check whole files from their parts."""
    p = 1 << 31  # x^0
    n, k = len2, 3  # x^(8 * len2): one factor per bit of the byte count
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


def crc32c_of_range(path: Path, start: int, length: int) -> int:
    """CRC32C of ``length`` bytes of ``path`` from ``start`` (positional reads: threads share nothing)."""
    checksum = google_crc32c.Checksum()
    fd = open_nofollow(path)
    try:
        end = start + length
        while start < end:
            chunk = os.pread(fd, min(_CHUNK, end - start), start)
            if not chunk:
                raise OSError(errno.EIO, f"{path}: ends at {start}, before {end}")
            checksum.update(chunk)
            start += len(chunk)
    finally:
        os.close(fd)
    return int.from_bytes(checksum.digest(), "big")


def crc32c_of_files(paths: Sequence[Path], threads: int = 1, *, range_bytes: int = _RANGE) -> list[str]:
    """CRC32C of each file, in the order given, read by ``threads`` threads at once.

    A file of more than one range (``range_bytes``, 64 MiB) is read in ranges whose checksums combine into the file's,
    so that one large file is read in parallel too: each range is read start to end, which keeps the
    kernel's readahead for it. On a local disk the reads wait on the device (more in flight give more
    bandwidth) and the checksum runs at several GB/s, so threads pay off even on few cores.
    """
    if threads <= 1:
        return [crc32c_of_file(path) for path in paths]
    sizes = [path.stat().st_size for path in paths]
    ranges = [
        (index, start, min(range_bytes, size - start))
        for index, size in enumerate(sizes)
        for start in range(0, size, range_bytes)
    ]
    with ThreadPoolExecutor(min(threads, max(1, len(ranges)))) as pool:
        checksums = list(pool.map(lambda job: crc32c_of_range(paths[job[0]], job[1], job[2]), ranges))
    crcs = [0] * len(paths)  # an empty file has no range; its CRC32C is 0
    for (index, _, length), crc in zip(ranges, checksums, strict=True):
        crcs[index] = crc32c_combine(crcs[index], crc, length)
    return [crc32c_hex(crc) for crc in crcs]


def base64_to_hex(crc_b64: str) -> str:
    """A store's base64 CRC32C (``x-amz-checksum-crc32c``, GCS's ``crc32c``) as a manifest's 8 hex digits.

    Raises ``ValueError`` when the value is not base64 of exactly 4 bytes.
    """
    try:
        raw = base64.b64decode(crc_b64, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"crc32c {crc_b64!r} is not base64") from None
    if len(raw) != 4:
        raise ValueError(f"crc32c {crc_b64!r} is not 4 bytes")
    return raw.hex()
