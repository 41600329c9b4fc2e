"""The engine's side of prefetch: warming the disk tier, pins, evict, and the GET latency histogram."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from tiering.blocks import MIN_BLOCK_SIZE, BlockKey, ObjectRef, block_count
from tiering.clock import FakeClock
from tiering.tiers.disk import DiskTier, block_file_size, object_footprint
from tiering.engine.blockcache import BlockCache
from tiering.engine.loads import WarmOutcome
from tiering.errors import ObjectChangedError
from tiering.latency import LatencyHistogram
from tiering.objectstore.memory import InMemoryObjectStore
from tiering.policy.pins import PinError, PinLimitError, load_pin_file, pinned_block_keys, save_pin_file
from tiering.tiers.ram import RamTier
from tiering.settings import CacheSettings

BS = MIN_BLOCK_SIZE


class CountingStore(InMemoryObjectStore):
    def __init__(self) -> None:
        self.gets: list[tuple[str, int, int]] = []
        super().__init__(on_get=lambda key, start, end: self.gets.append((key, start, end)))


def put(store: InMemoryObjectStore, key: str, size: int) -> ObjectRef:
    info = store.put_object(key, random.Random(key).randbytes(size))
    return ObjectRef(info.key, info.etag, info.size)


def make_cache(tmp_path: Path, store, *, disk_bytes: int = 64 * BS, ram_bytes: int = 16 * BS,
               max_pinned: int | None = None, clock=None) -> BlockCache:
    settings = CacheSettings(block_size=BS, ram_bytes=ram_bytes, disk_bytes=disk_bytes, max_pinned_bytes=max_pinned)
    disk = DiskTier(tmp_path / "cache", disk_bytes) if disk_bytes else None
    return BlockCache(settings, store, RamTier(ram_bytes), disk, clock=clock)


async def test_warm_fills_disk_not_ram_and_skips_cached_blocks_without_io(tmp_path: Path) -> None:
    store = CountingStore()
    ref = put(store, "a/big.bin", 5 * BS + 77)
    cache = make_cache(tmp_path, store)
    counts = await cache.warm(ref)
    assert counts == {WarmOutcome.FETCHED: 6}
    assert len(store.gets) == 6
    assert len(cache.ram) == 0  # prefetch never fills RAM
    assert cache.cached_blocks(ref) == 6
    assert cache.stats.warm_bytes == ref.size
    # Second time: index lookups only, no GET and no disk read.
    disk_hits = cache.disk.stats.hits
    assert await cache.warm(ref) == {WarmOutcome.SKIPPED: 6}
    assert len(store.gets) == 6 and cache.disk.stats.hits == disk_hits
    assert cache.stats.warm_skipped_bytes == ref.size
    # A read afterwards is served from disk, byte for byte.
    data = await cache.read(ref, 0, ref.size)
    assert data == random.Random("a/big.bin").randbytes(ref.size)
    assert len(store.gets) == 6
    assert cache.stats.hit_ratio() == 1.0  # prefetch fetches are not read misses


async def test_warm_writes_ram_blocks_to_disk_without_a_get(tmp_path: Path) -> None:
    store = CountingStore()
    ref = put(store, "f", 2 * BS)
    settings = CacheSettings(block_size=BS, ram_bytes=16 * BS, disk_bytes=64 * BS)
    ram = RamTier(16 * BS)
    ram_only = BlockCache(settings, store, ram)  # read with RAM only first
    await ram_only.read(ref, 0, ref.size)
    await ram_only.close()
    gets = len(store.gets)
    # Then the same RAM tier under an engine with a disk tier (an engine's tiers are wired once).
    cache = BlockCache(settings, store, ram, DiskTier(tmp_path / "cache", 64 * BS))
    assert await cache.warm(ref) == {WarmOutcome.FROM_RAM: 2}
    assert len(store.gets) == gets and cache.cached_blocks(ref) == 2


async def test_warm_and_read_of_one_block_share_one_get(tmp_path: Path) -> None:
    store = CountingStore()
    ref = put(store, "f", 3 * BS)
    cache = make_cache(tmp_path, store)
    warm = asyncio.ensure_future(cache.warm_block(ref, 1))
    await asyncio.sleep(0)  # the warm load is in flight
    data = await cache.read(ref, BS, BS)  # joins it
    outcome, length = await warm
    assert outcome is WarmOutcome.FETCHED and length == BS
    assert data == random.Random("f").randbytes(3 * BS)[BS : 2 * BS]
    assert [g for g in store.gets if g[1] == BS] == [("f", BS, 2 * BS)]
    # And the other way round: a read load in flight, a warm joins it (and waits for its disk write).
    read = asyncio.ensure_future(cache.read(ref, 2 * BS, BS))
    await asyncio.sleep(0)
    outcome, _ = await cache.warm_block(ref, 2)
    await read
    assert outcome in (WarmOutcome.JOINED, WarmOutcome.SKIPPED)
    assert len([g for g in store.gets if g[1] == 2 * BS]) == 1
    assert cache.cached_blocks(ref) == 2  # blocks 1 and 2


async def test_cancelled_warm_still_lands_the_block(tmp_path: Path) -> None:
    store = CountingStore()
    ref = put(store, "f", BS)
    cache = make_cache(tmp_path, store)
    warm = asyncio.ensure_future(cache.warm_block(ref, 0))
    await asyncio.sleep(0)
    warm.cancel()
    with pytest.raises(asyncio.CancelledError):
        await warm
    await cache.close()  # waits for loads in flight
    assert cache.cached_blocks(ref) == 1


async def test_warm_of_a_changed_object_raises(tmp_path: Path) -> None:
    store = CountingStore()
    ref = put(store, "f", BS)
    store.put_object("f", b"x" * BS)
    cache = make_cache(tmp_path, store)
    with pytest.raises(ObjectChangedError):
        await cache.warm_block(ref, 0)
    assert cache.cached_blocks(ref) == 0


async def test_warm_without_disk_tier_stores_nothing(tmp_path: Path) -> None:
    store = CountingStore()
    ref = put(store, "f", BS)
    cache = make_cache(tmp_path, store, disk_bytes=0)
    assert await cache.warm_block(ref, 0) == (WarmOutcome.NOT_STORED, BS)
    assert store.gets == []


async def test_pinned_blocks_survive_eviction_pressure(tmp_path: Path) -> None:
    store = CountingStore()
    disk_bytes = 20 * (BS + 200)
    pinned = put(store, "keep", 4 * BS)
    cache = make_cache(tmp_path, store, disk_bytes=disk_bytes, max_pinned=disk_bytes // 2)
    cache.pin([pinned])
    await cache.warm(pinned)
    for i in range(10):  # 40 blocks of other data through a 20-block disk tier
        await cache.warm(put(store, f"other{i}", 4 * BS))
    assert cache.disk.stats.evictions > 0
    assert cache.cached_blocks(pinned) == 4
    assert cache.pin_stats()["cached_bytes"] == object_footprint("keep", pinned.etag, pinned.size, BS)
    # Unpinned, they go like any other block.
    assert cache.unpin(["keep"]) == [pinned]
    assert cache.pin_stats() == {"objects": 0, "bytes": 0, "cached_bytes": 0, "limit_bytes": disk_bytes // 2}
    for i in range(10):
        await cache.warm(put(store, f"more{i}", 4 * BS))
    assert cache.cached_blocks(pinned) < 4


async def test_pin_limit_is_enforced_and_changes_nothing(tmp_path: Path) -> None:
    store = CountingStore()
    a, b = put(store, "a", 3 * BS), put(store, "b", 3 * BS)
    limit = object_footprint("a", a.etag, a.size, BS) + 100
    cache = make_cache(tmp_path, store, max_pinned=limit)
    cache.pin([a])
    with pytest.raises(PinLimitError, match=r"pin limit exceeded.*--max-pinned"):
        cache.pin([b])
    assert [r.key for r in cache.pins.refs()] == ["a"]
    assert not cache.is_pinned(BlockKey("b", b.etag, 0))
    # A new version of a pinned key replaces the old pin (and fits in its place).
    store.put_object("a", b"y" * 3 * BS)
    a2 = ObjectRef("a", store._objects["a"].info.etag, 3 * BS)
    cache.pin([a2])
    assert cache.pins.refs() == [a2]
    assert cache.is_pinned(BlockKey("a", a2.etag, 0)) and not cache.is_pinned(BlockKey("a", a.etag, 0))
    zero = make_cache(tmp_path / "z", store, max_pinned=0)
    with pytest.raises(PinLimitError, match="disabled"):
        zero.pin([a])
    with pytest.raises(PinError, match="no disk tier"):
        make_cache(tmp_path / "n", store, disk_bytes=0).pin([a])


async def test_evict_drops_clean_blocks_but_keeps_pinned_ones(tmp_path: Path) -> None:
    store = CountingStore()
    a, b = put(store, "a", 2 * BS), put(store, "b", 2 * BS)
    cache = make_cache(tmp_path, store)
    cache.pin([b])
    await cache.read(a, 0, a.size)  # RAM and disk
    await cache.read(b, 0, b.size)
    await cache.close()  # waits for the loads' disk writes
    assert await cache.evict(a) == (2, 2 * BS, 0)
    assert cache.cached_blocks(a) == 0 and not cache.ram.contains(BlockKey("a", a.etag, 0))
    # RAM only: the pinned file's RAM copies go, its disk blocks stay.
    assert await cache.evict(b, disk=False) == (2, 2 * BS, 0)
    assert await cache.evict(b) == (0, 0, 2)
    assert cache.cached_blocks(b) == 2
    await cache.read(a, 0, a.size)
    await cache.close()
    blocks, freed = await cache.evict_all()
    assert blocks == 4 and freed > 0  # a's 2 blocks in RAM and 2 on disk
    assert len(cache.ram) == 0 and cache.cached_blocks(a) == 0 and cache.cached_blocks(b) == 2
    assert cache.stats.dropped_blocks == 2 + 2 + 4


def test_disk_tier_pins_survive_restart_and_lowered_capacity(tmp_path: Path) -> None:
    keys = [BlockKey("k", "e", i) for i in range(6)]
    tier = DiskTier(tmp_path, 100_000)
    for key in keys:
        tier.put(key, bytes([key.index]) * 1000)
    pinned = keys[:2]  # the least recently used ones: first to go without pins
    size = block_file_size(keys[0], 1000)
    # Restart with room for about 3 blocks: the start-up scan evicts, but never the pinned blocks.
    tier = DiskTier(tmp_path, 4 * size, pinned=pinned)
    assert all(tier.contains(k) for k in pinned)
    assert tier.pinned_bytes() == 2 * size
    assert tier.used_bytes() <= 4 * size
    # Capacity below the pinned data: the capacity wins (it is a hard limit).
    tier = DiskTier(tmp_path, size, pinned=pinned)
    assert tier.used_bytes() <= size
    assert tier.pinned_bytes() <= size


def test_disk_tier_touch_and_evict_unpinned(tmp_path: Path) -> None:
    keys = [BlockKey("k", "e", i) for i in range(4)]
    tier = DiskTier(tmp_path, 100_000)
    for key in keys:
        tier.put(key, b"x" * 100)
    assert tier.touch(keys[0]) and not tier.touch(BlockKey("none", "e", 0))
    assert tier.keys()[-1] == keys[0]  # most recently used now
    tier.pin([keys[1]])
    assert tier.evict_unpinned() == (3, 3 * block_file_size(keys[0], 100))
    assert len(tier) == 1 and tier.contains(keys[1])


def test_object_footprint_matches_the_block_format() -> None:
    for size, bs in [(0, BS), (1, BS), (BS, BS), (10 * BS + 3, BS), (123_456_789, BS)]:
        expected = sum(
            block_file_size(BlockKey("dir/é.bin", '"etag"', i), min(bs, size - i * bs))
            for i in range(block_count(size, bs))
        )
        assert object_footprint("dir/é.bin", '"etag"', size, bs) == expected


def test_pin_file_roundtrip_and_bad_files(tmp_path: Path) -> None:
    path = tmp_path / "pins.json"
    assert load_pin_file(path) == []
    refs = [ObjectRef("b", '"2"', 5), ObjectRef("a/é", '"1"', 0)]
    save_pin_file(path, refs)
    assert load_pin_file(path) == sorted(refs, key=lambda r: r.key)
    assert list(pinned_block_keys(path, 4)) == [BlockKey("b", '"2"', 0), BlockKey("b", '"2"', 1)]
    path.write_text("{not json")
    assert list(pinned_block_keys(path, 4)) == []  # logged, and the mount starts without pins


async def test_latency_histogram_records_gets(tmp_path: Path) -> None:
    clock = FakeClock()

    class SlowStore(CountingStore):
        async def get_range(self, key: str, etag: str, start: int, end: int, *, after: object = None) -> bytes:
            clock.advance(0.03)
            return await super().get_range(key, etag, start, end)

    store = SlowStore()
    ref = put(store, "f", 2 * BS)
    cache = make_cache(tmp_path, store, clock=clock)
    await cache.read(ref, 0, BS)  # one GET at a time: each sees only its own 30 ms
    await cache.read(ref, BS, BS)
    hist = cache.latency["get"]
    assert hist.count == 2 and hist.sum_s == pytest.approx(0.06)
    assert dict(hist.cumulative())[0.05] == 2 and dict(hist.cumulative())[0.025] == 0


def test_latency_histogram_buckets() -> None:
    hist = LatencyHistogram(bounds=(0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0, -1.0):
        hist.observe(value)
    assert hist.cumulative() == [(0.1, 3), (1.0, 4), (float("inf"), 5)]
    assert hist.snapshot()["buckets"] == {"0.1": 3, "1.0": 4, "+Inf": 5}
    with pytest.raises(ValueError):
        LatencyHistogram(bounds=(1.0, 0.5))
