"""Text from outside the process, shown on one line with no control characters.

The daemon's log and ``spotguard status`` show text that arrives from outside: what a trainer reports
over the socket (a failed save's kind, reason and message, a path), the metadata services' answers,
object keys in the bucket, a peer's error frames. A newline in that text started a line of its own in
the log: a trainer could write ``\\n2026-11-27 12:00:00,000 CRITICAL spotguard.daemon: ...`` and the
journal (which takes each line of the daemon's stderr as an entry) kept it as the daemon's own; an
escape sequence reached the terminal of whoever read the log or ran ``status``. So every record's text
goes through :func:`one_line`, as a record's first line: the C0 and C1 control characters, Unicode's
line and paragraph separators, the bidirectional overrides (which reorder what a reader sees) and lone
surrogates (which strict UTF-8 streams refuse) are written as ``\\n``, ``\\xNN`` or ``\\uNNNN``, as
Python writes them in a string's ``repr``. Backslashes are left as they are: a text that holds
``\\n`` itself reads the same as an escaped newline, which is ambiguous but starts no line.

Stdlib only: the daemon and the command line use it.
"""

from __future__ import annotations

import logging
import re
from types import TracebackType

_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None] | tuple[None, None, None]
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# A traceback keeps its lines (the daemon's own, and what it is read for); only its other controls go.
_CONTROLS_BUT_NEWLINE = re.compile(_CONTROLS.pattern.replace("\x00-\x1f", "\x00-\x09\x0b-\x1f"))


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    named = _NAMED.get(char)
    if named:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def one_line(text: str) -> str:
    """``text`` with every control character, line separator, bidirectional control and lone surrogate
    written as its escape: what is left prints on one line and changes no terminal's state."""
    return _CONTROLS.sub(_escape, text)


class OneLineFormatter(logging.Formatter):
    """A formatter whose records are one line each: the message (and whatever the format adds) goes
    through :func:`one_line`. A traceback or stack appended to a record keeps its newlines, nothing else."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return one_line(super().formatMessage(record))

    def formatException(self, ei: _ExcInfo) -> str:
        return _CONTROLS_BUT_NEWLINE.sub(_escape, super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _CONTROLS_BUT_NEWLINE.sub(_escape, super().formatStack(stack_info))


__all__ = ["OneLineFormatter", "one_line"]
