"""Where reads were answered (tiering.traffic) through the real block cache: RAM, disk, cluster, source.

Each count is checked exactly: a reader is credited to the place its block came from, readers that
join a load in flight to the place that load got it from, read-ahead and warming to nobody when they
load, and the first read of what they brought from the source to the source (issue 37, item 6: a
fetch, not a saving), and a failed load to nobody.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from tiering.engine.blockcache import BlockCache
from tiering.blocks import MIN_BLOCK_SIZE, ObjectRef, block_count
from tiering.tiers.cluster import InMemoryClusterTier
from tiering.tiers.disk import DiskTier
from tiering.errors import ObjectStoreError
from tiering.objectstore.memory import FailingObjectStore, InMemoryObjectStore
from tiering.tiers.ram import RamTier
from tiering.settings import CacheSettings
from tiering.traffic import ReadTraffic

BS = MIN_BLOCK_SIZE
KEY = "data/shard.bin"
SIZE = 3 * BS + 777
DATA = random.Random(3).randbytes(SIZE)
BLOCKS = block_count(SIZE, BS)


def _engine(tmp_path: Path, store: FailingObjectStore, cluster: InMemoryClusterTier | None = None) -> BlockCache:
    settings = CacheSettings(block_size=BS, ram_bytes=16 * BS, disk_bytes=16 * BS, disk_dir=tmp_path,
                             fetch_timeout_s=5)
    return BlockCache(settings, store, RamTier(16 * BS), DiskTier(tmp_path, 16 * BS), cluster=cluster)


def _source() -> tuple[FailingObjectStore, ObjectRef]:
    inner = InMemoryObjectStore()
    info = inner.put_object(KEY, DATA)
    return FailingObjectStore(inner), ObjectRef(KEY, info.etag, SIZE)


def test_snapshot_sums_what_did_not_reach_the_source() -> None:
    t = ReadTraffic()
    t.served("ram", 100)
    t.served("disk", 50)
    t.waiting("k", 30)
    t.waiting("k", 20)
    t.settle("k", "cluster")
    t.waiting("j", 200)
    t.settle("j", "source")
    t.waiting("x", 7)
    t.drop("x")
    t.settle("never-waited", "source", 100)  # a read-ahead load: nobody to credit yet
    snap = t.snapshot()
    assert snap["served_bytes"] == {"ram": 100, "disk": 50, "cluster": 50, "source": 200}
    assert snap["served_blocks"] == {"ram": 1, "disk": 1, "cluster": 2, "source": 1}
    assert snap["avoided_source_bytes"] == 200 and snap["avoided_source_requests"] == 4
    assert snap["hit_ratios"] == {"local": 0.375, "cluster": 0.125, "source": 0.5}
    assert snap["hit_ratio"] == 0.5  # the one hit ratio: not from the source
    assert t.waiting_loads == 0


def test_an_idle_snapshot_has_zero_ratios() -> None:
    assert ReadTraffic().snapshot()["hit_ratios"] == {"local": 0.0, "cluster": 0.0, "source": 0.0}


async def test_cold_then_ram_then_disk_then_cluster(tmp_path: Path) -> None:
    store, ref = _source()
    cluster = InMemoryClusterTier()
    cache = _engine(tmp_path / "a", store, cluster)
    assert bytes(await cache.read(ref, 0, SIZE)) == DATA
    t = cache.traffic.snapshot()
    assert t["served_bytes"] == {"ram": 0, "disk": 0, "cluster": 0, "source": SIZE}
    assert t["served_blocks"]["source"] == BLOCKS and t["avoided_source_requests"] == 0
    assert bytes(await cache.read(ref, 10, 100)) == DATA[10:110]  # RAM
    await cache.close()  # disk writes done, write-behind drained into the cluster tier
    await cache.evict_all(disk=False)
    assert bytes(await cache.read(ref, BS, BS)) == DATA[BS:2 * BS]  # disk
    t = cache.traffic.snapshot()
    assert t["served_bytes"] == {"ram": 100, "disk": BS, "cluster": 0, "source": SIZE}
    assert t["avoided_source_bytes"] == 100 + BS and t["avoided_source_requests"] == 2
    assert cluster.store_stats.put_requests == BLOCKS and cluster.store_stats.bytes_written == SIZE

    other = _engine(tmp_path / "b", store, cluster)  # a second node: only the cluster tier has it
    assert bytes(await other.read(ref, 0, SIZE)) == DATA
    t = other.traffic.snapshot()
    assert t["served_bytes"] == {"ram": 0, "disk": 0, "cluster": SIZE, "source": 0}
    assert t["hit_ratios"] == {"local": 0.0, "cluster": 1.0, "source": 0.0}
    # One lookup per block on each node (misses on the first), bytes only from the hits.
    assert cluster.store_stats.get_requests == 2 * BLOCKS and cluster.store_stats.bytes_read == SIZE
    await other.close()


async def test_readers_joining_a_load_are_credited_to_its_place_and_read_ahead_to_nobody(tmp_path: Path) -> None:
    store, ref = _source()
    cache = _engine(tmp_path, store)
    cache.read_ahead(ref, BS, BS)  # block 1 loads for nobody
    first, second = await asyncio.gather(cache.read(ref, 0, 10), cache.read(ref, 20, 30))  # both wait on block 0
    assert bytes(first) == DATA[:10] and bytes(second) == DATA[20:50]
    await cache.close()
    assert cache.traffic.snapshot()["served_bytes"] == {"ram": 0, "disk": 0, "cluster": 0, "source": 40}
    assert cache.traffic.served_blocks["source"] == 2
    assert bytes(await cache.read(ref, BS, 5)) == DATA[BS:BS + 5]  # read ahead: in RAM, but the source served it
    assert cache.traffic.served_bytes["source"] == 45 and cache.traffic.served_bytes["ram"] == 0
    assert bytes(await cache.read(ref, BS + 5, BS - 5)) == DATA[BS + 5:2 * BS]  # the rest: still the source's
    assert cache.traffic.served_bytes["source"] == 40 + BS and cache.traffic.served_bytes["ram"] == 0
    assert bytes(await cache.read(ref, BS, 5)) == DATA[BS:BS + 5]  # read again: a hit
    assert cache.traffic.served_bytes["ram"] == 5 and cache.traffic.waiting_loads == 0


async def test_a_cold_pass_that_read_ahead_fetched_shows_no_saving(tmp_path: Path) -> None:
    """Issue 37, item 6: one cold pass the source served whole (every block read ahead before the
    reader got to it) reported its read-ahead hits as savings. Now it saves nothing; a second pass
    saves it all, and the hit ratio is the share not served by the source."""
    store, ref = _source()
    cache = _engine(tmp_path, store)
    assert cache.read_ahead(ref, 0, SIZE) == BLOCKS
    await cache.close()  # every block loaded, into RAM and onto disk, for nobody
    assert bytes(await cache.read(ref, 0, SIZE)) == DATA
    t = cache.traffic.snapshot()
    assert t["served_bytes"] == {"ram": 0, "disk": 0, "cluster": 0, "source": SIZE}
    assert t["avoided_source_bytes"] == 0 and t["avoided_source_requests"] == 0 and t["hit_ratio"] == 0.0
    assert store.stats.get_requests == BLOCKS
    assert bytes(await cache.read(ref, 0, SIZE)) == DATA
    t = cache.traffic.snapshot()
    assert t["avoided_source_bytes"] == SIZE and t["avoided_source_requests"] == BLOCKS
    assert t["hit_ratio"] == 0.5 == 1 - t["hit_ratios"]["source"]


async def test_the_first_read_of_a_warmed_block_is_the_sources(tmp_path: Path) -> None:
    """A warm (cachefs prefetch) fetches from the source ahead of the job: reading it back once is
    what the source served, not a saving; reading it again is."""
    store, ref = _source()
    cache = _engine(tmp_path, store)
    await cache.warm(ref)
    await cache.evict_all(disk=False)
    assert bytes(await cache.read(ref, 0, 100)) == DATA[:100]  # from disk
    assert cache.traffic.served_bytes == {"ram": 0, "disk": 0, "cluster": 0, "source": 100}
    assert bytes(await cache.read(ref, 100, SIZE - 100)) == DATA[100:]  # the rest, read once: the source's
    assert cache.traffic.served_bytes == {"ram": 0, "disk": 0, "cluster": 0, "source": SIZE}
    assert bytes(await cache.read(ref, 0, 100)) == DATA[:100]  # read again: a hit
    assert cache.traffic.served_bytes == {"ram": 100, "disk": 0, "cluster": 0, "source": SIZE}
    await cache.close()


def test_what_is_remembered_of_unread_loads_is_bounded() -> None:
    t = ReadTraffic(unread_limit=2)
    for key in ("a", "b", "c"):
        t.settle(key, "source", 10)  # read-ahead of three blocks of 10 bytes, nobody waiting
    for key in ("a", "b", "c"):
        t.hit(key, "ram", 10)
    assert t.served_bytes["source"] == 20 and t.served_bytes["ram"] == 10  # "a" was forgotten: a hit


async def test_a_failed_load_credits_nothing(tmp_path: Path) -> None:
    store, ref = _source()
    store.fail_gets = True
    cache = _engine(tmp_path, store)
    with pytest.raises(ObjectStoreError):
        await cache.read(ref, 0, SIZE)
    await cache.close()
    assert sum(cache.traffic.served_bytes.values()) == 0 and cache.traffic.waiting_loads == 0


async def test_a_block_read_in_pieces_the_first_time_is_the_sources_whole(tmp_path: Path) -> None:
    """The kernel reads 128 KiB at a time: a reader waits on its block's load for the first piece and
    finds the block in RAM for the others. Those pieces are the first reading of bytes the source
    just sent (issue 37, item 6: a cold pass of 256 MiB in 109 GETs showed 158 MiB 'saved')."""
    store, ref = _source()
    cache = _engine(tmp_path, store)
    piece = 4096
    for offset in range(0, SIZE, piece):
        assert bytes(await cache.read(ref, offset, piece)) == DATA[offset:offset + piece]
    t = cache.traffic.snapshot()
    assert t["served_bytes"] == {"ram": 0, "disk": 0, "cluster": 0, "source": SIZE}
    assert t["avoided_source_bytes"] == 0 and t["avoided_source_requests"] == 0
    for offset in range(0, SIZE, piece):  # the second pass: every piece a hit
        await cache.read(ref, offset, piece)
    t = cache.traffic.snapshot()
    assert t["avoided_source_bytes"] == SIZE and t["hit_ratio"] == 0.5
    await cache.close()
