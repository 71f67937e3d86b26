"""Text from outside, shown on one line: whatever it holds, nothing in it starts a line or reaches a
terminal as a control, and text without such characters is shown as it is."""

from __future__ import annotations

import io
import logging
import unicodedata

from hypothesis import example, given
from hypothesis import strategies as st

from spotguard.oneline import OneLineFormatter, one_line

BIDI_CONTROLS = {"\u061c", "\u200e", "\u200f", *map(chr, range(0x202A, 0x202F)), *map(chr, range(0x2066, 0x206A))}


def shown_as_is(char: str) -> bool:
    return unicodedata.category(char) not in ("Cc", "Cs", "Zl", "Zp") and char not in BIDI_CONTROLS


@given(st.text(alphabet=st.characters(exclude_categories=())))  # surrogates included
@example("\n2026-11-27 12:00:00,000 CRITICAL spotguard.daemon: forged")
@example("\x1b[2J\u202egone\r\x85\u2028\ud800")
def test_any_text_is_one_line_of_printable_utf8(text: str) -> None:
    line = one_line(text)
    assert len(line.splitlines()) <= 1
    assert all(shown_as_is(char) for char in line)
    line.encode("utf-8")  # strict: no lone surrogate left
    # Each character that cannot be shown is written as Python's repr writes it, the others as they are.
    assert line == "".join(char if shown_as_is(char) else repr(char)[1:-1] for char in text)


def test_escapes_read_as_in_a_repr() -> None:
    assert one_line("a\nb\r\tc") == "a\\nb\\r\\tc"
    assert one_line("\x00\x1b\x7f\x85") == "\\x00\\x1b\\x7f\\x85"
    assert one_line("\u2028\u202e\ud800") == "\\u2028\\u202e\\ud800"
    assert one_line("ünïcödé 名前 \\n") == "ünïcödé 名前 \\n"


def test_a_record_is_one_line_and_its_traceback_keeps_its_lines() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(OneLineFormatter("%(levelname)s %(name)s: %(message)s"))
    log = logging.getLogger("spotguard.test-oneline")
    log.addHandler(handler)
    log.propagate = False
    try:
        try:
            raise ValueError("bad\x1b[31m")
        except ValueError:
            log.exception("failed (%s)", "reason\nCRITICAL spotguard.daemon: forged")
    finally:
        log.removeHandler(handler)
    first, *traceback = out.getvalue().splitlines()
    assert first == "ERROR spotguard.test-oneline: failed (reason\\nCRITICAL spotguard.daemon: forged)"
    assert traceback[0] == "Traceback (most recent call last):"
    assert traceback[-1] == "ValueError: bad\\x1b[31m"
