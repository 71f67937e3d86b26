"""Properties of what several flows rely on: the receiver's overlap test, and the fetch's slices."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from spotguard.manifest import FileEntry, Manifest
from spotguard.peer.fetch import slice_pieces
from spotguard.peer.files import Extents
from spotguard.peer.flows import PIECE

ranges = st.lists(st.tuples(st.integers(0, 200), st.integers(1, 50)), max_size=30)


@given(ranges)
def test_extents_say_whether_a_range_overlaps_any_before_it(spans: list[tuple[int, int]]) -> None:
    extents, seen = Extents(), set[int]()
    for start, length in spans:
        covered = set(range(start, start + length))
        assert extents.add(start, start + length) == bool(covered & seen)
        seen |= covered


def manifest_of(sizes: list[int]) -> Manifest:
    files = {f"f{i}.bin": FileEntry(size=size, crc32c="00000000") for i, size in enumerate(sizes)}
    return Manifest(step=1, reason="urgent", world_size=1, files=files)


@given(st.lists(st.integers(0, 3 * PIECE + 5), min_size=1, max_size=5), st.integers(1, 6))
def test_the_slices_of_a_fetch_cover_every_byte_once(sizes: list[int], parts: int) -> None:
    manifest = manifest_of(sizes)
    got: dict[str, list[tuple[int, int]]] = {}
    for part in range(parts):
        for rel, offset, length in slice_pieces(manifest, part, parts):
            assert 0 < length <= PIECE or (length == 0 and manifest.files[rel].size == 0)
            got.setdefault(rel, []).append((offset, length))
    for rel, entry in manifest.files.items():
        pieces = sorted(got[rel])  # every file, an empty one too, is in some slice
        end = 0
        for offset, length in pieces:
            assert offset == end
            end += length
        assert end == entry.size
