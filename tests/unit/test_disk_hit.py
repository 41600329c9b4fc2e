"""``BlockCache.disk_hit``: a read of one whole block that only the disk tier holds, served by the
calling thread from its reply buffer (``tiering.engine.diskhit``), and every read that is not one."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tiering.blocks import MIN_BLOCK_SIZE, BlockKey, ObjectRef
from tiering.engine.blockcache import BlockCache
from tiering.engine.diskhit import MAX_REPLY_BLOCK_BYTES
from tiering.health import TierState
from tiering.objectstore.memory import InMemoryObjectStore
from tiering.settings import CacheSettings
from tiering.tiers.disk import DiskTier
from tiering.tiers.ram import RamTier
from tiering.traffic import DISK

BS = MIN_BLOCK_SIZE
SIZE = 2 * BS + 5000  # two full blocks and a short last one
SOURCE = random.Random(7).randbytes(SIZE)


def make(tmp_path: Path, store: InMemoryObjectStore, block_size: int = BS) -> BlockCache:
    settings = CacheSettings(block_size=block_size, ram_bytes=64 * block_size)
    return BlockCache(settings, store, RamTier(64 * block_size), DiskTier(tmp_path / "disk", 256 * block_size))


async def on_disk_only(tmp_path: Path, block_size: int = BS, data: bytes = SOURCE) -> tuple[BlockCache, ObjectRef]:
    """A cache whose disk tier holds every block of the object and whose RAM tier holds none."""
    store = InMemoryObjectStore()
    info = store.put_object("data/obj", data, mtime=1_700_000_000)
    ref = ObjectRef(info.key, info.etag, info.size)
    cache = make(tmp_path, store, block_size)
    assert await cache.read(ref, 0, len(data)) == data
    await cache.close()
    for key in cache.ram.keys():
        cache.ram.discard(key)
    return cache, ref


async def test_a_whole_block_on_disk_only_is_read_by_the_caller_and_not_put_in_ram(tmp_path: Path) -> None:
    cache, ref = await on_disk_only(tmp_path)
    served, requests = cache.stats.disk_served, cache.stats.block_requests
    traffic = cache.traffic.snapshot()["served_blocks"][DISK]
    for index, (start, end) in enumerate([(0, BS), (BS, 2 * BS), (2 * BS, SIZE)]):
        hit = cache.disk_hit(ref, start, BS)  # the last block is short: a READ of BS covers it
        assert hit is not None and hit.key == BlockKey(ref.key, ref.etag, index)
        hit.run()
        data = hit.finish()
        assert data is not None and bytes(data) == SOURCE[start:end]
    assert len(cache.ram) == 0, "no RAM-tier copy: the reader that asked has the bytes"
    assert cache.stats.disk_served - served == 3 and cache.stats.block_requests - requests == 3
    assert cache.traffic.snapshot()["served_blocks"][DISK] - traffic == 3


@pytest.mark.parametrize("offset, length", [(0, BS - 1), (1, BS), (0, 2 * BS), (BS // 2, BS), (SIZE, BS), (-1, BS)],
                         ids=["part", "unaligned", "two-blocks", "across", "past-the-end", "negative"])
async def test_a_range_that_is_not_one_whole_block_is_left_to_read(tmp_path: Path, offset: int, length: int) -> None:
    cache, ref = await on_disk_only(tmp_path)
    assert cache.disk_hit(ref, offset, length) is None


async def test_a_block_in_ram_or_being_loaded_or_not_on_disk_is_left_to_read(tmp_path: Path) -> None:
    cache, ref = await on_disk_only(tmp_path)
    assert await cache.read(ref, 0, 10) == SOURCE[:10]  # block 0 now in RAM
    assert cache.disk_hit(ref, 0, BS) is None
    cache.loads.register(BlockKey(ref.key, ref.etag, 1))  # block 1 being loaded
    assert cache.disk_hit(ref, BS, BS) is None
    assert cache.disk is not None
    cache.disk.discard(BlockKey(ref.key, ref.etag, 2))
    assert cache.disk_hit(ref, 2 * BS, BS) is None


async def test_a_block_larger_than_a_read_is_left_to_read(tmp_path: Path) -> None:
    block = 2 * MAX_REPLY_BLOCK_BYTES
    data = random.Random(3).randbytes(block + 10)
    cache, ref = await on_disk_only(tmp_path, block_size=block, data=data)
    assert cache.disk_hit(ref, 0, block) is None
    assert cache.disk_hit(ref, block, block) is not None  # its short last block is small enough


async def test_a_block_gone_meanwhile_is_a_miss_and_read_then_fetches_it(tmp_path: Path) -> None:
    cache, ref = await on_disk_only(tmp_path)
    hit = cache.disk_hit(ref, 0, BS)
    assert hit is not None and cache.disk is not None
    cache.disk.discard(hit.key)  # evicted between the lookup and the read
    hit.run()
    assert hit.finish() is None
    assert await cache.read(ref, 0, BS) == SOURCE[:BS]


async def test_a_disk_tier_that_raises_is_a_counted_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    cache, ref = await on_disk_only(tmp_path)
    assert cache.disk is not None

    def broken(key: BlockKey) -> None:
        raise RuntimeError("a bug in the tier")

    monkeypatch.setattr(cache.disk, "get_for_reply", broken)
    hit = cache.disk_hit(ref, 0, BS)
    assert hit is not None
    hit.run()  # never raises
    assert hit.finish() is None
    assert cache.stats.disk_errors == 1
    assert any(r.name == "tiering.engine.diskguard" and r.exc_info for r in caplog.records)


async def test_a_read_that_stalls_takes_the_disk_tier_out_of_the_next_reads(tmp_path: Path) -> None:
    """The FUSE session's stall watch tells a hit whose read has hung (``stalled``): the disk tier goes
    down at once, so the next reads are not served from it (the RAM tier or the source serves them)."""
    cache, ref = await on_disk_only(tmp_path)
    hit = cache.disk_hit(ref, 0, BS)
    assert hit is not None
    hit.stalled(12.0)  # (from the loop, while the reader would still be blocked in ``run``)
    assert cache.disk_hit(ref, BS, BS) is None  # another block: not read from the disk any more
    assert await cache.read(ref, BS, BS) == SOURCE[BS:2 * BS]  # served from below instead
    health = cache.disk.health  # type: ignore[union-attr]
    assert health.state is TierState.DOWN
    health.record_success()  # (what the stalled read does when it returns after all)
    assert cache.disk_hit(ref, 2 * BS, BS) is not None
