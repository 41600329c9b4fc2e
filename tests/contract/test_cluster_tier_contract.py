"""The ``ClusterBlockTier`` contract, run on every implementation.

The same bodies run on ``InMemoryClusterTier`` (the engine tests' double), on ``ClusterTier`` over
``InMemoryObjectStore`` and on ``ClusterTier`` over ``S3ObjectStore`` against SeaweedFS: a put is
read back, a miss is None, a block is returned only for its own key (ETag and index included) and
length, and a failing store is a miss, never an exception. The cases that need the objects behind
the tier (a corrupted, truncated or foreign object; the key layout) run on the ``ClusterTier``s,
writing the objects through the backing store.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import AsyncIterator

import pytest

from tiering.blocks import BlockKey
from tiering.clock import FakeClock
from tiering.tiers.cluster import ClusterTier, InMemoryClusterTier, WriteBehind, cluster_object_key, cluster_token, collect_garbage
from tiering.objectstore import FailingObjectStore, InMemoryObjectStore, S3ObjectStore
from tests.support.clusterkeys import OTHER_KEY, TEST_KEY
from tiering.tiers.blockformat import frame_header
from tiering.protocols import ClusterBlockTier, ObjectStore

ROOT = "cluster/"
SOURCE_ID = "s3://source-bucket/data/"
BLOCK_SIZE = 64 * 1024
KEY = BlockKey("dir/file.bin", '"etag-1"', 3)
DATA = bytes(range(256)) * 64  # 16 KiB, a short last block


@dataclass
class Backend:
    name: str
    tier: ClusterBlockTier
    store: ObjectStore | None  # the objects behind the tier, None for the in-memory double


def _tier(store: ObjectStore, **kwargs: object) -> ClusterTier:
    return ClusterTier(store, source_id=SOURCE_ID, block_size=BLOCK_SIZE, key=TEST_KEY, timeout_s=5.0,  # type: ignore[arg-type]
                       **kwargs)


@pytest.fixture(params=["double", "memory-store", pytest.param("seaweed", marks=pytest.mark.s3)])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    if request.param == "double":
        yield Backend("double", InMemoryClusterTier(), None)
        return
    if request.param == "memory-store":
        store: ObjectStore = InMemoryObjectStore()
    else:
        server = request.getfixturevalue("seaweed")
        bucket = request.getfixturevalue("seaweed_bucket")
        store = S3ObjectStore(bucket, ROOT, endpoint_url=server.endpoint_url, connect_timeout_s=2.0,
                              read_timeout_s=10.0, environ=server.env())
    tier = _tier(store)
    try:
        yield Backend(request.param, tier, store)
    finally:
        await tier.close()


def needs_store(backend: Backend) -> ObjectStore:
    if backend.store is None:
        pytest.skip("the in-memory double has no objects behind it")
    return backend.store


async def test_put_then_get(backend: Backend) -> None:
    assert isinstance(backend.tier, ClusterBlockTier)
    assert await backend.tier.get(KEY, len(DATA)) is None
    assert not await backend.tier.contains(KEY)
    assert await backend.tier.put(KEY, DATA)
    assert await backend.tier.contains(KEY)
    assert await backend.tier.get(KEY, len(DATA)) == DATA
    assert backend.tier.stats.hits == 1 and backend.tier.stats.hit_bytes == len(DATA)
    assert backend.tier.stats.misses == 1 and backend.tier.stats.puts == 1


async def test_a_block_is_only_returned_for_its_own_key_and_length(backend: Backend) -> None:
    assert await backend.tier.put(KEY, DATA)
    assert await backend.tier.get(KEY._replace(etag='"etag-2"'), len(DATA)) is None
    assert await backend.tier.get(KEY._replace(index=4), len(DATA)) is None
    assert await backend.tier.get(KEY._replace(key="dir/other.bin"), len(DATA)) is None
    assert await backend.tier.get(KEY, len(DATA) - 1) is None


async def test_put_replaces(backend: Backend) -> None:
    assert await backend.tier.put(KEY, DATA)
    assert await backend.tier.put(KEY, DATA[::-1])
    assert await backend.tier.get(KEY, len(DATA)) == DATA[::-1]


async def test_empty_block(backend: Backend) -> None:
    key = KEY._replace(index=0)
    assert await backend.tier.put(key, b"")
    assert await backend.tier.get(key, 0) == b""


async def test_a_hit_or_a_miss_is_one_request(backend: Backend) -> None:
    """A lookup is one GET (no HEAD first): a hit on node 2..N costs one round trip, and so does a miss."""
    store = needs_store(backend)
    assert await backend.tier.put(KEY, DATA)
    before = store.stats.requests, store.stats.head_requests
    assert await backend.tier.get(KEY, len(DATA)) == DATA
    assert await backend.tier.get(KEY._replace(index=9), len(DATA)) is None
    assert (store.stats.requests - before[0], store.stats.head_requests - before[1]) == (2, 0)


async def test_objects_are_framed_under_the_hashed_key(backend: Backend) -> None:
    store = needs_store(backend)
    assert await backend.tier.put(KEY, DATA)
    name = cluster_object_key(cluster_token(SOURCE_ID, BLOCK_SIZE, KEY))
    assert name.startswith("blocks/") and name.split("/")[1] == name.split("/")[2][:2]
    info = await store.head(name)
    blob = bytes(await store.get_range(name, info.etag, 0, info.size))  # a view, from the S3 store
    assert blob[:4] == b"CFS3" and blob.endswith(DATA)
    assert cluster_token(SOURCE_ID, BLOCK_SIZE, KEY) in blob


async def test_a_frame_written_with_another_key_is_never_served(backend: Backend,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Whoever can write to the store but lacks the cluster key (a tenant with the store's S3
    credentials) forges a well-formed frame: it is a counted miss, deleted, and logged once per
    object however often it is planted again (issue 34: counted and logged once)."""
    store = needs_store(backend)
    forger = ClusterTier(store, source_id=SOURCE_ID, block_size=BLOCK_SIZE, key=OTHER_KEY, timeout_s=5.0)
    poison = b"POISONED".ljust(len(DATA), b"!")
    caplog.set_level(logging.WARNING, logger="tiering.tiers.cluster")
    for planted in (1, 2):
        assert await forger.put(KEY, poison)
        assert await backend.tier.get(KEY, len(DATA)) is None
        assert (backend.tier.stats.corrupt_blocks, backend.tier.stats.forged_blocks) == (planted, planted)
        assert not await backend.tier.contains(KEY)
    logged = [r for r in caplog.records if r.name == "tiering.tiers.cluster" and "failed its check" in r.getMessage()]
    assert len(logged) == 1, [r.getMessage() for r in logged]


async def test_a_frame_of_the_previous_format_is_a_plain_miss(backend: Backend) -> None:
    """An object of the unauthenticated format (before the cluster key) is neither data nor an error:
    a miss, counted as stale, left for the write-behind to overwrite."""
    store = needs_store(backend)
    token = cluster_token(SOURCE_ID, BLOCK_SIZE, KEY)
    old = frame_header(token, DATA) + DATA
    name = cluster_object_key(token)
    await store.put(name, len(old), lambda s, e: old[s:e])
    assert await backend.tier.get(KEY, len(DATA)) is None
    stats = backend.tier.stats
    assert (stats.misses, stats.stale_blocks, stats.corrupt_blocks, stats.errors) == (1, 1, 0, 0)
    assert await backend.tier.put(KEY, DATA)
    assert await backend.tier.get(KEY, len(DATA)) == DATA


@pytest.mark.parametrize("damage", ["flip-data", "truncate", "flip-header", "empty"])
async def test_a_damaged_object_is_a_counted_miss_and_deleted(backend: Backend, damage: str) -> None:
    store = needs_store(backend)
    assert await backend.tier.put(KEY, DATA)
    name = cluster_object_key(cluster_token(SOURCE_ID, BLOCK_SIZE, KEY))
    info = await store.head(name)
    blob = bytearray(await store.get_range(name, info.etag, 0, info.size))
    if damage == "flip-data":
        blob[-10] ^= 0xFF
    elif damage == "truncate":
        del blob[-100:]
    elif damage == "flip-header":
        blob[8] ^= 0x01
    else:
        blob = bytearray()
    data = bytes(blob)
    await store.put(name, len(data), lambda s, e: data[s:e])
    assert await backend.tier.get(KEY, len(DATA)) is None
    assert backend.tier.stats.corrupt_blocks == 1
    assert not await backend.tier.contains(KEY)  # deleted before the miss was answered
    assert await backend.tier.put(KEY, DATA)
    assert await backend.tier.get(KEY, len(DATA)) == DATA


async def test_a_foreign_object_under_the_name_is_a_miss(backend: Backend) -> None:
    """Another source's (or block size's) block at this name: the token in the header differs."""
    store = needs_store(backend)
    other = _tier(store)
    other.source_id = "s3://another/"
    assert await other.put(KEY, DATA)
    name_other = cluster_object_key(cluster_token("s3://another/", BLOCK_SIZE, KEY))
    info = await store.head(name_other)
    blob = await store.get_range(name_other, info.etag, 0, info.size)
    name = cluster_object_key(cluster_token(SOURCE_ID, BLOCK_SIZE, KEY))
    await store.put(name, len(blob), lambda s, e: blob[s:e])
    assert await backend.tier.get(KEY, len(DATA)) is None
    assert backend.tier.stats.corrupt_blocks == 1


async def test_a_failing_store_is_a_miss_and_opens_the_circuit() -> None:
    inner = InMemoryObjectStore()
    failing = FailingObjectStore(inner)
    clock = FakeClock()
    tier = ClusterTier(failing, source_id=SOURCE_ID, block_size=BLOCK_SIZE, key=TEST_KEY, timeout_s=1.0, clock=clock)
    assert await tier.put(KEY, DATA)
    failing.fail_gets = True  # a lookup is one GET (no HEAD)
    assert await tier.get(KEY, len(DATA)) is None
    assert tier.stats.errors == 1 and not tier.health.reachable
    assert await tier.get(KEY, len(DATA)) is None  # no request while the circuit is open
    assert tier.stats.skipped == 1 and tier.stats.errors == 1
    assert not await tier.put(KEY, DATA)
    failing.fail_gets = False
    clock.advance(10)
    tier.health.maybe_probe()
    for _ in range(100):
        if tier.health.reachable:
            break
        await asyncio.sleep(0.01)
    assert await tier.get(KEY, len(DATA)) == DATA
    await tier.close()


async def test_a_slow_store_is_a_miss_within_the_timeout() -> None:
    failing = FailingObjectStore(InMemoryObjectStore())
    tier = ClusterTier(failing, source_id=SOURCE_ID, block_size=BLOCK_SIZE, key=TEST_KEY, timeout_s=0.05)
    failing.delay_s = 30
    assert await asyncio.wait_for(tier.get(KEY, len(DATA)), 10) is None
    assert tier.stats.errors == 1 and tier.health.snapshot()["timeouts"] == 1
    await tier.close()


async def test_write_behind_is_bounded_and_drops_when_full() -> None:
    tier = InMemoryClusterTier()
    queue = WriteBehind(tier, max_blocks=2, max_bytes=10 * len(DATA), workers=1)
    keys = [KEY._replace(index=i) for i in range(4)]
    accepted = [queue.offer(k, DATA) for k in keys]  # no await in between: nothing uploaded yet
    assert accepted == [True, True, False, False]
    assert queue.stats.dropped == 2 and queue.depth() == 2
    assert await queue.drain(10)
    assert queue.depth() == 0 and queue.queued_bytes() == 0 and queue.stats.written == 2
    assert set(tier.blocks) == set(keys[:2])
    small = WriteBehind(tier, max_blocks=100, max_bytes=len(DATA) + 1)
    assert small.offer(keys[2], DATA) and not small.offer(keys[3], DATA)
    assert await small.drain(10)


async def test_collect_garbage_deletes_oldest_first() -> None:
    store = InMemoryObjectStore()
    tier = _tier(store)
    keys = [KEY._replace(index=i) for i in range(4)]
    for k in keys:
        assert await tier.put(k, DATA)
    names = [cluster_object_key(cluster_token(SOURCE_ID, BLOCK_SIZE, k)) for k in keys]
    for age, name in enumerate(names):  # keys[0] written last, keys[3] first
        stored = store._objects[name]
        store.put_object(name, stored.data, mtime=1000.0 - age)
    one = (await store.head(names[0])).size
    report = await collect_garbage(store, 2 * one)
    assert (report.blocks, report.deleted, report.deleted_bytes) == (4, 2, 2 * one)
    assert await tier.get(keys[0], len(DATA)) == DATA and await tier.get(keys[1], len(DATA)) == DATA
    assert await tier.get(keys[3], len(DATA)) is None and await tier.get(keys[2], len(DATA)) is None
    await tier.close()

