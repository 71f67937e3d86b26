"""Properties of what several flows rely on: the receiver's overlap test and its check that every byte
arrived, the fetch's slices, and the sender's queue of pieces."""

from __future__ import annotations

import io
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from spotguard.manifest import FileEntry, Manifest
from spotguard.peer.fetch import slice_pieces
from spotguard.peer.files import Extents, missing_range
from spotguard.peer.flows import PIECE, Piece, PieceQueue, Source

ranges = st.lists(st.tuples(st.integers(0, 200), st.integers(1, 50)), max_size=30)


@given(ranges)
def test_extents_say_whether_a_range_overlaps_any_before_it(spans: list[tuple[int, int]]) -> None:
    extents, seen = Extents(), set[int]()
    for start, length in spans:
        covered = set(range(start, start + length))
        assert extents.add(start, start + length) == bool(covered & seen)
        seen |= covered


@given(ranges, st.integers(0, 260))
def test_the_first_missing_range_is_the_first_byte_no_range_covered(spans: list[tuple[int, int]], size: int) -> None:
    covered = {byte for start, length in spans for byte in range(start, start + length)}
    holes = [byte for byte in range(size) if byte not in covered]
    gap = missing_range([(start, length, 0) for start, length in spans], size)
    if not holes:
        assert gap is None
    else:
        assert gap is not None and gap[0] == holes[0] and gap[1] > gap[0]
        assert all(byte not in covered for byte in range(gap[0], min(gap[1], size)))


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


@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=40),  # the file of each piece queued, in order
    st.lists(st.sets(st.integers(0, 4), max_size=4), max_size=40),  # files being sent at each take
)
def test_a_flow_takes_the_next_piece_of_a_file_no_other_flow_is_sending(
    files_of_pieces: list[int], sending_at: list[set[int]]
) -> None:
    sources = [Source(io.BytesIO(), f"f{i}.bin", 0) for i in range(5)]
    queue = PieceQueue()
    waiting: dict[int, list[Piece]] = {}  # file -> its pieces left, files in the order they came
    for offset, index in enumerate(files_of_pieces):
        piece = Piece(sources[index], offset, 1)
        queue.push(piece)
        waiting.setdefault(index, []).append(piece)
    for busy in sending_at[: len(files_of_pieces)]:
        piece = queue.take(Counter(id(sources[index]) for index in busy))
        free = [index for index in waiting if index not in busy]
        index = free[0] if free else next(iter(waiting))  # the first free file, else the first file
        assert piece is waiting[index].pop(0)  # and its oldest piece
        if not waiting[index]:
            del waiting[index]
    assert len(queue) == sum(map(len, waiting.values()))
    assert list(queue.drain()) == [piece for pieces in waiting.values() for piece in pieces]
    assert len(queue) == 0


def test_a_piece_given_back_goes_first() -> None:
    one, two = Source(io.BytesIO(), "a.bin", 0), Source(io.BytesIO(), "b.bin", 0)
    queue = PieceQueue()
    for offset in range(3):
        queue.push(Piece(one, offset, 1))
    queue.push(Piece(two, 0, 1))
    first = queue.take(Counter())
    queue.push_front(Piece(two, 9, 1))  # a failed flow's piece
    assert (first.source, first.offset) == (one, 0)
    again = queue.take(Counter())
    assert (again.source, again.offset) == (two, 9)
    assert [(p.source.rel, p.offset) for p in queue.drain()] == [("b.bin", 0), ("a.bin", 1), ("a.bin", 2)]
