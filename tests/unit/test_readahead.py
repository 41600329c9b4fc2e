"""The sequential read-ahead policy, a pure object."""

from __future__ import annotations

from tiering.policy.readahead import ReadAhead

BS = 1024
READ = 256  # a read smaller than a block, as the kernel sends (128 KiB of a 4 MiB block)


def sequential(ra: ReadAhead, start: int, count: int, size: int = BS) -> list[int]:
    out = []
    offset = start
    for _ in range(count):
        out.append(ra.on_read(offset, size))
        offset += size
    return out


def test_window_starts_at_one_block_and_doubles_up_to_the_max() -> None:
    ra = ReadAhead(BS, 8 * BS)
    assert sequential(ra, 0, 6) == [BS, 2 * BS, 4 * BS, 8 * BS, 8 * BS, 8 * BS]


def test_max_not_a_power_of_two_blocks_caps_the_window() -> None:
    ra = ReadAhead(BS, 3 * BS)
    assert sequential(ra, 0, 4) == [BS, 2 * BS, 3 * BS, 3 * BS]


def test_small_sequential_reads_grow_the_window_too() -> None:
    ra = ReadAhead(BS, 4 * BS)
    assert sequential(ra, 0, 4, size=READ) == [BS, 2 * BS, 4 * BS, 4 * BS]


def test_first_read_not_at_zero_gets_no_readahead() -> None:
    ra = ReadAhead(BS, 8 * BS)
    assert ra.on_read(10 * BS, BS) == 0
    # ...but continuing sequentially from there starts the window.
    assert ra.on_read(11 * BS, BS) == BS


def test_a_seek_resets_the_window() -> None:
    ra = ReadAhead(BS, 16 * BS)
    sequential(ra, 0, 4)
    assert ra.window == 8 * BS
    assert ra.on_read(100 * BS, BS) == 0
    assert ra.window == 0
    # Sequential again after the seek: starts over at one block.
    assert sequential(ra, 101 * BS, 3) == [BS, 2 * BS, 4 * BS]


def test_backward_seek_resets_the_window() -> None:
    ra = ReadAhead(BS, 16 * BS)
    sequential(ra, 0, 5)
    assert ra.on_read(0, BS) == 0


def test_small_reordering_within_one_block_counts_as_sequential() -> None:
    ra = ReadAhead(BS, 64 * BS)
    assert ra.on_read(0, READ) == BS
    # Two requests in flight arrive swapped: [2R, 3R) before [R, 2R).
    assert ra.on_read(2 * READ, READ) == 2 * BS
    assert ra.on_read(READ, READ) == 4 * BS
    # The late one did not pull the expected position back: the next in-order read continues.
    assert ra.on_read(3 * READ, READ) == 8 * BS
    assert ra.on_read(4 * READ, READ) == 16 * BS


def test_a_jump_of_more_than_one_block_is_a_seek() -> None:
    ra = ReadAhead(BS, 64 * BS)
    ra.on_read(0, READ)
    assert ra.on_read(READ + BS + 1, READ) == 0


def test_max_zero_disables_readahead() -> None:
    ra = ReadAhead(BS, 0)
    assert sequential(ra, 0, 10) == [0] * 10
    assert ra.window == 0


def test_handles_are_independent() -> None:
    a, b = ReadAhead(BS, 8 * BS), ReadAhead(BS, 8 * BS)
    sequential(a, 0, 3)
    assert b.on_read(50 * BS, BS) == 0
    assert a.on_read(3 * BS, BS) == 8 * BS
