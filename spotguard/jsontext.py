"""JSON read from outside the process, with one way to fail.

The standard library fails on a malformed text in four ways: ``JSONDecodeError``, ``UnicodeDecodeError``
(bytes that are not UTF-8), a plain ``ValueError`` (an integer of more than 4,300 digits, Python's guard
against quadratic conversion) and ``RecursionError`` (arrays or objects nested about a thousand deep,
which a 64 KiB socket message holds thirty times over). The first three are ``ValueError``\\ s; the
last is not, and code that caught only ``JSONDecodeError`` let the others through: a nested answer on
one metadata path hid a termination notice on another, and a manifest in the bucket could end a
resume instead of being skipped. Every JSON text from a socket, a metadata service, a bucket or a
file is read with :func:`parse_json`, and its callers catch ``ValueError``.

Stdlib only: both the daemon and the trainer hook import it.
"""

from __future__ import annotations

import json
from typing import Any


def parse_json(data: bytes | bytearray | memoryview | str) -> Any:
    """The JSON document ``data``; ``ValueError`` saying what is wrong for anything else (not UTF-8,
    not JSON, an integer past Python's digit limit, nesting past the interpreter's recursion limit)."""
    try:
        return json.loads(bytes(data) if isinstance(data, memoryview) else data)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


__all__ = ["parse_json"]
