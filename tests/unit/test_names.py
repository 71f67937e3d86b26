"""Step and file names in one canonical form: properties over arbitrary text, and the known bad ones."""

from __future__ import annotations

import logging
from pathlib import Path, PurePosixPath

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spotguard.manifest import (
    MAX_NAME_BYTES,
    MAX_NAME_DEPTH,
    MAX_SEGMENT_BYTES,
    MAX_STEP,
    STEP_WIDTH,
    ManifestError,
    check_relpath,
    load_manifest_or_none,
    parse_step_dir,
    step_dir_name,
    verify_dir,
)
from tests.checkpoints import write_checkpoint

# Text with the characters that matter here over-represented: separators, dots, digits of any
# script, control characters.
PIECES = st.sampled_from(["/", ".", "..", "\\", "\n", "\x00", "\x7f", "\x85", "step-", "0", "9", "\u0665", "a"])
NAMEISH = st.lists(st.one_of(PIECES, st.text(max_size=4)), max_size=12).map("".join)
TEXT = st.one_of(st.text(), NAMEISH)


@settings(max_examples=2000)
@given(TEXT)
def test_parse_step_dir_answers_every_text_with_a_step_or_none(name: str) -> None:
    step = parse_step_dir(name)
    if step is not None:
        assert 0 <= step <= MAX_STEP and step_dir_name(step) == name  # only the canonical name parses


@given(st.integers(min_value=0, max_value=MAX_STEP))
def test_a_step_s_name_parses_back_to_it(step: int) -> None:
    name = step_dir_name(step)
    assert len(name) == len("step-") + STEP_WIDTH and parse_step_dir(name) == step


@pytest.mark.parametrize(
    "step", [-1, MAX_STEP + 1, 10**5000, True], ids=["negative", "10-digits", "5001-digits", "bool"]
)
def test_a_step_out_of_range_has_no_name(step: int) -> None:
    with pytest.raises(ValueError):
        step_dir_name(step)


@pytest.mark.parametrize(
    "name",
    [
        "step-000000005\n",
        "step-000000005 ",
        " step-000000005",
        "step-" + "\u0660" * 8 + "\u0665",  # Arabic-Indic digits, which int() takes
        "step-" + "\uff10" * 9,  # fullwidth digits
        "step-" + "9" * 5000,  # int() of it raises ValueError (the digit limit)
        "step-0000000005",
        "step-00000005",
        "step-+00000005",
        "step-0000_0005",
        "STEP-000000005",
    ],
)
def test_names_that_only_look_like_steps_are_ignored_and_reported_once(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="spotguard.manifest"):
        assert parse_step_dir(name) is None
        assert parse_step_dir(name) is None
    reported = [r.getMessage() for r in caplog.records if "not a checkpoint name" in r.getMessage()]
    assert len(reported) <= 1  # once per name (none if an earlier test reported it already)
    assert all(len(message) < 300 for message in reported)  # a 5,000-digit name is cut short


@settings(max_examples=3000)
@given(TEXT)
def test_an_accepted_file_name_is_canonical_and_stays_inside(rel: str) -> None:
    try:
        accepted = check_relpath(rel)
    except ManifestError:
        return
    assert accepted == rel == str(PurePosixPath(rel))
    assert all(segment not in ("", ".", "..") for segment in rel.split("/"))
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in rel) and "\\" not in rel
    encoded = rel.encode("utf-8")  # a lone surrogate would raise: no bucket takes it
    assert len(encoded) <= MAX_NAME_BYTES and len(rel.split("/")) <= MAX_NAME_DEPTH
    assert all(len(segment.encode()) <= MAX_SEGMENT_BYTES for segment in rel.split("/"))
    root = Path("/nonexistent-root") / "step-000000001"
    assert (root / rel).resolve().is_relative_to(root.resolve())


@pytest.mark.parametrize(
    "rel",
    ["./manifest.json", "a/../b", "a//b", "/etc/x", "a/", "", ".", "..", "a\\b", "a\x00b", "a\nb", "x\x1b", "a\x85b"],
)
def test_non_canonical_file_names_are_refused(rel: str) -> None:
    with pytest.raises(ManifestError):
        check_relpath(rel)


@pytest.mark.parametrize(
    "rel",
    [
        "w\udcff.bin",  # a lone surrogate (JSON can carry one escaped)
        "\ud800",
        "/".join(["d"] * MAX_NAME_DEPTH) + "/f",
        "x" * (MAX_SEGMENT_BYTES + 1),
        "ü" * 128,  # 256 bytes in UTF-8
        "/".join(["y" * 200] * 6),  # 1,205 bytes: the bucket key would pass 1,024
    ],
    ids=["surrogate", "lone-high-surrogate", "too-deep", "long-segment", "long-segment-utf8", "too-long"],
)
def test_names_no_bucket_or_filesystem_takes_are_refused(rel: str) -> None:
    with pytest.raises(ManifestError) as caught:
        check_relpath(rel)
    assert len(str(caught.value)) < 300  # a long name is shown cut short


def test_names_at_the_bounds_are_taken() -> None:
    deepest = "/".join(["d"] * (MAX_NAME_DEPTH - 1)) + "/f"
    longest = "/".join(["y" * MAX_SEGMENT_BYTES] * 3) + "/" + "z" * (MAX_NAME_BYTES - 3 * (MAX_SEGMENT_BYTES + 1))
    assert len(longest.encode()) == MAX_NAME_BYTES
    for rel in (deepest, longest, "ü" * 127):
        assert check_relpath(rel) == rel


@pytest.mark.parametrize("rel", ["w.bin", "sub/o.bin", "a b/ü.pt", "optim/rank1.pt", "..hidden", "x..y/z"])
def test_ordinary_file_names_are_taken_as_they_are(rel: str) -> None:
    assert check_relpath(rel) == rel


def test_the_manifest_of_a_checkpoint_refuses_non_canonical_names(tmp_path: Path) -> None:
    step_dir = write_checkpoint(tmp_path, 3, {"w.bin": b"w"})
    manifest = step_dir / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"w.bin"', '"./w.bin"'))
    assert load_manifest_or_none(step_dir) is None and verify_dir(step_dir) != []
