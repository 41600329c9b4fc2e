"""One contract for every ``BlockTier``: the same test bodies run on the RAM and the disk tier.

The fixture hands out a factory ``make(capacity_bytes)`` rather than a tier, so each test picks the
capacity it needs in units of one block's footprint (the disk tier counts its header too). All keys
used for capacity arithmetic have tokens of equal length, so every block of a test has the same
footprint.
"""

from __future__ import annotations

import itertools
from typing import Callable

import pytest

from tiering.blocks import BlockKey
from tiering.disk import DiskTier
from tiering.protocols import BlockTier
from tiering.ram import RamTier

BLOCK_LEN = 1000

MakeTier = Callable[[int], BlockTier]


def key(i: int, etag: str = "etag-1") -> BlockKey:
    assert 0 <= i < 10, "one digit keeps every token, hence every footprint, the same length"
    return BlockKey("bucket/dir/object.bin", etag, i)


def block(i: int, length: int = BLOCK_LEN) -> bytes:
    return bytes([i % 256]) * length


@pytest.fixture(params=["ram", "disk"])
def make_tier(request: pytest.FixtureRequest, tmp_path) -> MakeTier:
    counter = itertools.count()

    def make(capacity_bytes: int) -> BlockTier:
        if request.param == "ram":
            return RamTier(capacity_bytes)
        return DiskTier(tmp_path / f"cache-{next(counter)}", capacity_bytes)

    return make


@pytest.fixture
def footprint(make_tier: MakeTier) -> int:
    """Bytes one test block occupies in this kind of tier."""
    probe = make_tier(10**9)
    assert probe.put(key(0), block(0))
    return probe.used_bytes()


def held(tier: BlockTier, n: int = 10) -> list[int]:
    return [i for i in range(n) if tier.contains(key(i))]


def test_implements_the_protocol(make_tier: MakeTier) -> None:
    assert isinstance(make_tier(10**6), BlockTier)


def test_get_of_an_absent_block_is_a_miss(make_tier: MakeTier) -> None:
    tier = make_tier(10**6)
    assert tier.get(key(1)) is None
    assert not tier.contains(key(1))
    assert len(tier) == 0 and tier.used_bytes() == 0
    assert tier.stats.misses == 1 and tier.stats.hits == 0


def test_absent_answers_from_the_index_and_counts_a_miss(make_tier: MakeTier) -> None:
    tier = make_tier(10**6)
    assert tier.absent(key(1))
    assert tier.stats.misses == 1
    assert tier.put(key(1), b"x" * 100)
    assert not tier.absent(key(1))
    assert tier.stats.misses == 1 and tier.stats.hits == 0  # "may be held" counts nothing
    tier.discard(key(1))
    assert tier.absent(key(1))


def test_put_then_get_returns_the_same_bytes(make_tier: MakeTier) -> None:
    tier = make_tier(10**6)
    data = bytes(range(256)) * 7
    assert tier.put(key(1), data)
    assert tier.contains(key(1))
    assert tier.get(key(1)) == data
    assert len(tier) == 1
    assert tier.used_bytes() >= len(data)


def test_empty_block_roundtrips(make_tier: MakeTier) -> None:
    tier = make_tier(10**6)
    assert tier.put(key(1), b"")
    assert tier.get(key(1)) == b""


def test_put_of_an_existing_key_replaces_it(make_tier: MakeTier, footprint: int) -> None:
    tier = make_tier(10 * footprint)
    assert tier.put(key(1), block(1))
    assert tier.put(key(1), block(2))
    assert tier.get(key(1)) == block(2)
    assert len(tier) == 1
    assert tier.used_bytes() == footprint


def test_blocks_of_another_etag_are_never_returned(make_tier: MakeTier) -> None:
    tier = make_tier(10**6)
    old, new = key(1, "etag-old"), key(1, "etag-new")
    assert tier.put(old, b"old bytes")
    assert tier.get(new) is None
    assert tier.put(new, b"new bytes")
    assert tier.get(new) == b"new bytes"
    assert tier.get(old) == b"old bytes"


def test_capacity_is_never_exceeded(make_tier: MakeTier, footprint: int) -> None:
    capacity = 3 * footprint + footprint // 2
    tier = make_tier(capacity)
    for i in range(10):
        assert tier.put(key(i), block(i))
        assert tier.used_bytes() <= capacity
        assert len(tier) <= 3
        assert tier.get(key(i)) == block(i)  # what was just put is there
    assert tier.stats.evictions >= 7
    assert tier.used_bytes() == len(tier) * footprint


def test_least_recently_used_block_is_evicted_first(make_tier: MakeTier, footprint: int) -> None:
    tier = make_tier(4 * footprint)
    for i in range(3):
        assert tier.put(key(i), block(i))
    assert tier.get(key(0)) == block(0)  # 0 is now the most recently used: order 1, 2, 0
    recency = [1, 2, 0]
    for i in range(3, 10):
        assert tier.put(key(i), block(i))
        recency.append(i)
        now_held = held(tier)
        # Whatever the batch size, what is held is always the most recent suffix of the order.
        assert now_held == sorted(recency[len(recency) - len(now_held) :])
        if not tier.contains(key(1)):
            break
    assert not tier.contains(key(1)), "nothing was ever evicted"
    assert tier.contains(key(0)), "the block refreshed by get went before an older one"


def test_block_larger_than_capacity_is_rejected(make_tier: MakeTier, footprint: int) -> None:
    tier = make_tier(footprint - 1)
    assert not tier.put(key(1), block(1))
    assert tier.get(key(1)) is None
    assert len(tier) == 0 and tier.used_bytes() == 0
    assert tier.stats.rejected == 1 and tier.stats.inserts == 0


def test_block_filling_the_whole_capacity_fits(make_tier: MakeTier, footprint: int) -> None:
    tier = make_tier(footprint)
    assert tier.put(key(1), block(1))
    assert tier.put(key(2), block(2))  # evicts 1
    assert tier.get(key(2)) == block(2)
    assert tier.get(key(1)) is None
    assert tier.used_bytes() == footprint


def test_rejected_replacement_drops_the_old_version(make_tier: MakeTier, footprint: int) -> None:
    tier = make_tier(2 * footprint)
    assert tier.put(key(1), block(1))
    assert not tier.put(key(1), block(1, 3 * BLOCK_LEN))
    assert tier.get(key(1)) is None
    assert tier.used_bytes() == 0


def test_discard(make_tier: MakeTier, footprint: int) -> None:
    tier = make_tier(10 * footprint)
    assert tier.put(key(1), block(1))
    assert tier.put(key(2), block(2))
    tier.discard(key(1))
    tier.discard(key(7))  # absent: no-op
    assert tier.get(key(1)) is None
    assert tier.get(key(2)) == block(2)
    assert len(tier) == 1 and tier.used_bytes() == footprint


def test_stats_are_counted(make_tier: MakeTier, footprint: int) -> None:
    tier = make_tier(2 * footprint)
    for i in range(4):
        assert tier.put(key(i), block(i))
    assert tier.get(key(3)) == block(3)
    assert tier.get(key(0)) is None
    assert tier.get(key(3)) == block(3)
    s = tier.stats
    assert (s.inserts, s.hits, s.misses, s.hit_bytes) == (4, 2, 1, 2 * BLOCK_LEN)
    assert s.evictions == 4 - len(tier)
    assert s.evicted_bytes == s.evictions * footprint
    assert s.errors == 0 and s.corrupt_blocks == 0 and s.rejected == 0


def test_zero_capacity_stores_nothing(make_tier: MakeTier) -> None:
    tier = make_tier(0)
    assert not tier.put(key(1), block(1))
    assert not tier.put(key(2), b"")
    assert tier.get(key(1)) is None
    assert len(tier) == 0 and tier.used_bytes() == 0
    assert tier.stats.rejected == 2


def test_keys_lists_held_blocks_in_lru_order(make_tier: MakeTier, footprint: int) -> None:
    tier = make_tier(10 * footprint)
    for i in range(3):
        tier.put(key(i), block(i))
    tier.get(key(0))
    assert tier.keys() == [key(1), key(2), key(0)]  # type: ignore[attr-defined]
