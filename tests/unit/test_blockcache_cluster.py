"""BlockCache with a cluster tier: RAM -> disk -> cluster -> source, write-behind, failures as misses."""

from __future__ import annotations

import random
from pathlib import Path

from tiering.engine.blockcache import BlockCache
from tiering.engine.loads import WarmOutcome
from tiering.blocks import MIN_BLOCK_SIZE, BlockKey, ObjectRef, block_count
from tiering.clock import FakeClock
from tiering.tiers.cluster import ClusterTier, InMemoryClusterTier, WriteBehind
from tiering.tiers.disk import DiskTier
from tiering.errors import ObjectStoreUnavailableError
from tiering.objectstore.memory import FailingObjectStore, InMemoryObjectStore
from tiering.tiers.ram import RamTier
from tiering.settings import CacheSettings
from tiering.storehealth import StoreHealth
from tests.support.clusterkeys import TEST_KEY

BS = MIN_BLOCK_SIZE
KEY = "data/shard.bin"
SIZE = 3 * BS + 777
SOURCE = random.Random(7).randbytes(SIZE)
BLOCKS = block_count(SIZE, BS)


def _engine(tmp_path: Path, source: FailingObjectStore, cluster: object, **kwargs: object) -> BlockCache:
    settings = CacheSettings(block_size=BS, ram_bytes=16 * BS, disk_bytes=16 * BS, disk_dir=tmp_path,
                             fetch_timeout_s=5)
    return BlockCache(settings, source, RamTier(16 * BS), DiskTier(tmp_path, 16 * BS),
                      cluster=cluster, **kwargs)  # type: ignore[arg-type]


def _source() -> tuple[FailingObjectStore, ObjectRef]:
    inner = InMemoryObjectStore()
    info = inner.put_object(KEY, SOURCE)
    return FailingObjectStore(inner), ObjectRef(KEY, info.etag, SIZE)


async def test_source_fetches_are_written_behind_and_a_second_node_reads_from_the_cluster(tmp_path: Path) -> None:
    source, ref = _source()
    cluster = InMemoryClusterTier()
    first = _engine(tmp_path / "a", source, cluster)
    assert bytes(await first.read(ref, 0, SIZE)) == SOURCE
    assert first.write_behind is not None and await first.write_behind.drain(10)
    assert len(cluster.blocks) == BLOCKS and first.stats.store_fetches == BLOCKS
    await first.close()

    # A second node: empty RAM and disk. It reads a byte while the source is up, which proves to the
    # source that this volume may read the object (a cluster hit is served only after that:
    # tiering.engine.authorize), then the rest with the source unreachable (its circuit open).
    health = StoreHealth(FakeClock())
    second = _engine(tmp_path / "b", source, cluster, health=health)
    assert bytes(await second.read(ref, 0, 1)) == SOURCE[:1]
    source.fail_gets = source.fail_heads = True
    health.record_failure(ObjectStoreUnavailableError("down"))
    assert bytes(await second.read(ref, 0, SIZE)) == SOURCE
    assert second.stats.cluster_served == BLOCKS and second.stats.store_fetches == 0
    assert second.stats.cluster_authorizations == 1
    assert second.stats.hit_ratio() == 1.0
    await second.close()  # waits for the loads' disk writes
    assert second.disk is not None and all(second.disk.contains(BlockKey(KEY, ref.etag, i)) for i in range(BLOCKS))


async def test_a_failing_cluster_tier_falls_through_to_the_source(tmp_path: Path) -> None:
    source, ref = _source()
    cluster_store = FailingObjectStore(InMemoryObjectStore())
    cluster_store.fail_heads = cluster_store.fail_gets = cluster_store.fail_writes = True
    cluster = ClusterTier(cluster_store, source_id="s3://b/", block_size=BS, key=TEST_KEY, timeout_s=1)
    engine = _engine(tmp_path, source, cluster)
    assert bytes(await engine.read(ref, 0, SIZE)) == SOURCE
    assert engine.stats.store_fetches == BLOCKS and engine.stats.cluster_served == 0
    assert cluster.stats.errors >= 1 and not cluster.health.reachable
    await engine.close()
    await cluster.close()


async def test_a_full_write_behind_queue_never_blocks_the_reader_and_catches_up_from_disk(tmp_path: Path) -> None:
    """Blocks offered to a full queue are uploaded later, read back from the disk tier: the cluster
    store ends with every block, and the read-backs are neither hits nor misses of the disk tier."""
    source, ref = _source()
    cluster = InMemoryClusterTier()
    queue = WriteBehind(cluster, max_blocks=1, max_bytes=BS, workers=1)
    engine = _engine(tmp_path, source, cluster, write_behind=queue)
    assert bytes(await engine.read(ref, 0, SIZE)) == SOURCE
    assert await queue.drain(10)
    stats = queue.stats
    assert stats.deferred >= 1 and stats.caught_up == stats.deferred and stats.gone == stats.dropped == 0, stats
    assert stats.written == BLOCKS and set(cluster.blocks) == {BlockKey(KEY, ref.etag, i) for i in range(BLOCKS)}
    assert all(cluster.blocks[BlockKey(KEY, ref.etag, i)] == SOURCE[i * BS:(i + 1) * BS] for i in range(BLOCKS))
    assert engine.disk is not None and (engine.disk.stats.hits, engine.disk.stats.misses) == (0, BLOCKS)
    assert queue.snapshot()["depth"] == 0 and queue.snapshot()["deferred_now"] == 0
    await engine.close()


async def test_a_full_write_behind_queue_drops_without_a_disk_tier(tmp_path: Path) -> None:
    source, ref = _source()
    cluster = InMemoryClusterTier()
    queue = WriteBehind(cluster, max_blocks=1, max_bytes=BS, workers=1)
    settings = CacheSettings(block_size=BS, ram_bytes=16 * BS, fetch_timeout_s=5)
    engine = BlockCache(settings, source, RamTier(16 * BS), None, cluster=cluster, write_behind=queue)
    assert bytes(await engine.read(ref, 0, SIZE)) == SOURCE
    assert await queue.drain(10)
    assert queue.stats.dropped >= 1 and queue.stats.deferred == 0
    assert queue.stats.written + queue.stats.dropped == BLOCKS
    await engine.close()


async def test_warm_cluster_block_fills_only_the_cluster_tier(tmp_path: Path) -> None:
    source, ref = _source()
    cluster = InMemoryClusterTier()
    engine = _engine(tmp_path, source, cluster)
    outcomes = [(await engine.warm_cluster_block(ref, i))[0] for i in range(BLOCKS)]
    assert outcomes == [WarmOutcome.FETCHED] * BLOCKS
    assert len(cluster.blocks) == BLOCKS and engine.cached_blocks(ref) == 0 and len(engine.ram) == 0
    assert await engine.cluster_cached_blocks(ref) == BLOCKS
    assert (await engine.warm_cluster_block(ref, 0))[0] is WarmOutcome.SKIPPED
    # A disk warm on this node now takes the blocks from the cluster, not the source.
    fetches = engine.stats.store_fetches
    assert (await engine.warm_block(ref, 1))[0] is WarmOutcome.FETCHED
    assert engine.stats.store_fetches == fetches and engine.stats.warm_from_cluster_blocks == 1
    await engine.close()
