"""Block arithmetic: spans() tiles a read exactly; block_range/block_count agree."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiering.blocks import BlockKey, BlockSpan, block_count, block_range, spans


def test_spans_of_a_read_across_three_blocks() -> None:
    assert list(spans(5, 20, 100, 10)) == [BlockSpan(0, 5, 10), BlockSpan(1, 0, 10), BlockSpan(2, 0, 5)]


def test_spans_are_clipped_to_the_object_end() -> None:
    assert list(spans(95, 50, 100, 10)) == [BlockSpan(9, 5, 10)]
    assert list(spans(100, 10, 100, 10)) == []
    assert list(spans(150, 10, 100, 10)) == []
    assert list(spans(0, 0, 100, 10)) == []
    assert list(spans(0, 10, 0, 10)) == []


def test_block_count_and_range_examples() -> None:
    assert block_count(0, 10) == 0
    assert block_count(1, 10) == 1
    assert block_count(10, 10) == 1
    assert block_count(11, 10) == 2
    assert block_range(0, 25, 10) == (0, 10)
    assert block_range(2, 25, 10) == (20, 25)


def test_block_key_identity_includes_the_etag() -> None:
    a = BlockKey("k", '"e1"', 0)
    b = BlockKey("k", '"e2"', 0)
    assert a != b
    assert a.digest() != b.digest()
    assert a.token() != b.token()
    assert len(a.digest()) == 64
    assert a.digest() == BlockKey("k", '"e1"', 0).digest()


@given(
    size=st.integers(min_value=0, max_value=10_000),
    block_size=st.integers(min_value=1, max_value=700),
    offset=st.integers(min_value=0, max_value=12_000),
    length=st.integers(min_value=0, max_value=12_000),
)
def test_spans_tile_the_clipped_range(size: int, block_size: int, offset: int, length: int) -> None:
    parts = list(spans(offset, length, size, block_size))
    end = min(offset + length, size)
    covered = []
    for span in parts:
        # Each piece lies inside one block of the object and is not empty.
        start_in_block, end_in_block = block_range(span.index, size, block_size)
        assert 0 <= span.start < span.end <= end_in_block - start_in_block
        covered.append((span.index * block_size + span.start, span.index * block_size + span.end))
    if offset >= end:
        assert parts == []
        return
    # Contiguous, non-overlapping, from offset to the clipped end, in increasing block order.
    assert covered[0][0] == offset
    assert covered[-1][1] == end
    for (_, a_end), (b_start, _) in zip(covered, covered[1:]):
        assert a_end == b_start
    assert [s.index for s in parts] == list(range(offset // block_size, (end - 1) // block_size + 1))
    assert sum(s.end - s.start for s in parts) == end - offset


@given(size=st.integers(min_value=0, max_value=100_000), block_size=st.integers(min_value=1, max_value=5_000))
def test_block_ranges_partition_the_object(size: int, block_size: int) -> None:
    count = block_count(size, block_size)
    ranges = [block_range(i, size, block_size) for i in range(count)]
    pos = 0
    for start, end in ranges:
        assert start == pos
        assert 0 < end - start <= block_size
        pos = end
    assert pos == size
    # Every block but the last is full.
    assert all(end - start == block_size for start, end in ranges[:-1])


@pytest.mark.parametrize("size", [1, 9, 10, 11, 99, 100, 101])
def test_spans_of_a_whole_object_name_every_block(size: int) -> None:
    parts = list(spans(0, size, size, 10))
    assert [s.index for s in parts] == list(range(block_count(size, 10)))
    assert [(s.start, s.end) for s in parts] == [
        (0, block_range(i, size, 10)[1] - block_range(i, size, 10)[0]) for i in range(block_count(size, 10))
    ]
