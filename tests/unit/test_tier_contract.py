"""One contract per tier Protocol, run on every implementation.

``BlockTier`` tests run on the RAM and the disk tier; ``DiskBlockTier`` tests (pins, recency
refresh, eviction of all unpinned blocks, staged space, health, watermarks) on every disk-tier
implementation. Every member of each Protocol is exercised on every implementation, and
``test_every_protocol_member_is_exercised`` fails when a member is added to a Protocol without being
listed here (and so, without a contract test).

The fixtures hand out a factory ``make(capacity_bytes)`` rather than a tier, so each test picks the
capacity it needs in units of one block's footprint (the disk tier counts its header too). All keys
used for capacity arithmetic have tokens of equal length, so every block of a test has the same
footprint.
"""

from __future__ import annotations

import dataclasses
import itertools
import typing
from typing import Callable

import pytest

from tiering.blocks import BlockKey
from tiering.tiers.disk import DiskTier
from tiering.health import TierState
from tiering.protocols import BlockTier, DiskBlockTier, SpaceBudget
from tiering.tiers.ram import RamTier

BLOCK_LEN = 1000

MakeTier = Callable[[int], BlockTier]
MakeDiskTier = Callable[[int], DiskBlockTier]


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


@pytest.fixture(params=["disk"])
def make_disk_tier(request: pytest.FixtureRequest, tmp_path) -> MakeDiskTier:
    counter = itertools.count()

    def make(capacity_bytes: int) -> DiskBlockTier:
        return DiskTier(tmp_path / f"disk-{next(counter)}", capacity_bytes)

    return make


@pytest.fixture
def disk_footprint(make_disk_tier: MakeDiskTier) -> int:
    probe = make_disk_tier(10**9)
    assert probe.put(key(0), block(0))
    return probe.used_bytes()


def protocol_members(protocol: type) -> set[str]:
    """The attributes and methods a Protocol (with its Protocol bases) declares."""
    members: set[str] = set()
    for cls in protocol.__mro__:
        if cls in (object, typing.Protocol, typing.Generic) or not getattr(cls, "_is_protocol", False):
            continue
        members |= set(vars(cls).get("__annotations__", {}))
        members |= {name for name, value in vars(cls).items()
                    if callable(value) and (not name.startswith("_") or name == "__len__")}
    return members


# What the tests below exercise. A member added to a Protocol must be added here, with its test.
EXERCISED = {
    BlockTier: {"name", "capacity_bytes", "stats", "get", "contains", "absent", "put", "discard", "keys",
                "used_bytes", "__len__"},
    DiskBlockTier: {"health", "high_watermark", "low_watermark", "pin", "unpin", "is_pinned", "pinned_bytes",
                    "touch", "evict_unpinned", "reserve_space", "release_space", "reserved_space", "get_for_reply",
                    "peek"},
}


def test_every_protocol_member_is_exercised() -> None:
    assert protocol_members(BlockTier) == EXERCISED[BlockTier]
    assert protocol_members(DiskBlockTier) == EXERCISED[BlockTier] | EXERCISED[DiskBlockTier]


def test_implements_the_protocol(make_tier: MakeTier) -> None:
    assert isinstance(make_tier(10**6), BlockTier)


def test_name_and_capacity(make_tier: MakeTier) -> None:
    tier = make_tier(12345)
    assert isinstance(tier.name, str) and tier.name
    assert tier.capacity_bytes == 12345


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
    assert (s.inserts, s.hits, s.misses) == (4, 2, 1)
    assert s.hit_bytes == 0  # bytes served are counted by the engine, which knows the reader's range
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
    assert tier.keys() == [key(1), key(2), key(0)]
    tier.discard(key(2))
    assert tier.keys() == [key(1), key(0)]


# ------------------------------------------------------------------------------------------ DiskBlockTier


def test_disk_tier_implements_both_protocols(make_disk_tier: MakeDiskTier) -> None:
    tier = make_disk_tier(10**6)
    assert isinstance(tier, DiskBlockTier) and isinstance(tier, BlockTier) and isinstance(tier, SpaceBudget)


def test_a_new_disk_tier_is_healthy_with_ordered_watermarks(make_disk_tier: MakeDiskTier) -> None:
    tier = make_disk_tier(10**6)
    assert tier.health.state is TierState.HEALTHY
    assert 0 < tier.low_watermark < tier.high_watermark <= 1


def test_eviction_crossing_the_high_watermark_goes_down_to_the_low_one(
    make_disk_tier: MakeDiskTier, disk_footprint: int
) -> None:
    tier = make_disk_tier(10 * disk_footprint)
    high, low = tier.high_watermark * tier.capacity_bytes, tier.low_watermark * tier.capacity_bytes
    for i in range(10):
        before = tier.used_bytes()
        assert tier.put(key(i), block(i))
        if before + disk_footprint > high:  # this put crossed the high watermark: a batch went first
            assert tier.used_bytes() <= max(low, disk_footprint)
            assert tier.stats.evictions >= 1
            break
        assert tier.stats.evictions == 0
    else:
        pytest.fail("ten blocks in a ten-block tier never crossed the high watermark")


def test_pinned_blocks_survive_eviction_and_are_counted(make_disk_tier: MakeDiskTier, disk_footprint: int) -> None:
    tier = make_disk_tier(3 * disk_footprint)
    tier.pin([key(0), key(5)])  # key(5) is pinned before it is written
    assert tier.is_pinned(key(0)) and tier.is_pinned(key(5)) and not tier.is_pinned(key(1))
    assert tier.pinned_bytes() == 0  # nothing pinned is held yet
    assert tier.put(key(0), block(0))
    assert tier.pinned_bytes() == disk_footprint
    for i in range(1, 5):
        assert tier.put(key(i), block(i))
    assert tier.contains(key(0)), "a pinned block was evicted"
    assert tier.put(key(5), block(5))
    assert tier.pinned_bytes() == 2 * disk_footprint
    tier.unpin([key(0)])
    assert not tier.is_pinned(key(0))
    assert tier.pinned_bytes() == disk_footprint
    for i in range(6, 9):
        assert tier.put(key(i), block(i))
    assert not tier.contains(key(0)), "an unpinned block is evictable again"
    assert tier.contains(key(5))


def test_touch_refreshes_recency_without_counting(make_disk_tier: MakeDiskTier, disk_footprint: int) -> None:
    tier = make_disk_tier(10 * disk_footprint)
    for i in range(3):
        assert tier.put(key(i), block(i))
    stats = dataclasses.replace(tier.stats)
    assert tier.touch(key(0))
    assert not tier.touch(key(7))  # not held
    assert tier.stats == stats  # no hit, no miss
    assert tier.keys() == [key(1), key(2), key(0)]


def test_get_for_reply_is_a_get_into_the_threads_buffer(make_disk_tier: MakeDiskTier, disk_footprint: int) -> None:
    tier = make_disk_tier(10 * disk_footprint)
    for i in range(3):
        assert tier.put(key(i), block(i))
    got = tier.get_for_reply(key(0))
    assert got is not None and bytes(got) == block(0)
    assert tier.get_for_reply(key(7)) is None
    assert (tier.stats.hits, tier.stats.misses) == (1, 1)  # counted as get counts
    assert tier.keys()[-1] == key(0)  # and its recency refreshed
    assert tier.get_for_reply(key(1)) is not None and bytes(got) == block(1)  # the same buffer, reused


def test_peek_reads_a_block_checked_without_counting_or_refreshing_it(make_disk_tier: MakeDiskTier,
                                                                        disk_footprint: int) -> None:
    """The cluster write-behind's catch-up reads a block for another tier: no reader asked for it."""
    tier = make_disk_tier(10 * disk_footprint)
    for i in range(3):
        assert tier.put(key(i), block(i))
    stats = dataclasses.replace(tier.stats)
    got = tier.peek(key(0))
    assert got is not None and bytes(got) == block(0)
    assert tier.peek(key(7)) is None
    assert tier.stats == stats  # no hit, no miss
    assert tier.keys() == [key(0), key(1), key(2)]  # key(0) still the least recently used
    assert tier.get(key(0)) is not None and tier.keys()[-1] == key(0)  # (as a reader's get would make it)


def test_evict_unpinned_keeps_only_pinned_blocks(make_disk_tier: MakeDiskTier, disk_footprint: int) -> None:
    tier = make_disk_tier(10 * disk_footprint)
    for i in range(4):
        assert tier.put(key(i), block(i))
    tier.pin([key(2)])
    assert tier.evict_unpinned() == (3, 3 * disk_footprint)
    assert held(tier) == [2]
    assert tier.used_bytes() == disk_footprint == tier.pinned_bytes()
    assert tier.evict_unpinned() == (0, 0)


def test_reserved_space_is_used_space_and_evicts_clean_blocks(
    make_disk_tier: MakeDiskTier, disk_footprint: int
) -> None:
    tier = make_disk_tier(10 * disk_footprint)
    for i in range(4):
        assert tier.put(key(i), block(i))
    tier.pin([key(0)])
    assert tier.reserved_space() == 0
    assert tier.reserve_space(2 * disk_footprint)
    assert tier.reserved_space() == 2 * disk_footprint
    assert tier.used_bytes() == 6 * disk_footprint
    # Room for staged data beyond what is free comes from clean, unpinned blocks only.
    assert tier.reserve_space(6 * disk_footprint)
    assert tier.used_bytes() <= tier.capacity_bytes
    assert tier.contains(key(0))
    assert tier.reserved_space() == 8 * disk_footprint
    assert not tier.reserve_space(2 * disk_footprint)  # only the pinned block and staged data left
    assert tier.reserved_space() == 8 * disk_footprint
    assert tier.reserve_space(2 * disk_footprint, force=True)  # replayed staged data is always kept
    assert tier.used_bytes() > tier.capacity_bytes
    assert not tier.put(key(5), block(5))  # blocks are refused until staged data is released
    tier.release_space(10 * disk_footprint)
    assert tier.reserved_space() == 0
    assert tier.used_bytes() == disk_footprint
    tier.release_space(disk_footprint)  # more than reserved: nothing goes below zero
    assert tier.reserved_space() == 0 and tier.used_bytes() == disk_footprint
