"""BlockCache: correct bytes, single flight, parallel block reads, tiers, failures, read-ahead."""

from __future__ import annotations

import asyncio
import errno
import random
import tempfile
import threading
from pathlib import Path
from typing import Iterable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiering.blocks import DEFAULT_BLOCK_SIZE, MIN_BLOCK_SIZE, BlockKey, ObjectRef, block_count
from tiering.clock import SystemClock
from tiering.tiers.disk import DiskTier
from tiering.engine.blockcache import BlockCache
from tiering.engine.loads import RECEIVER_PUT_BELOW_BYTES
from tiering.errors import ObjectChangedError, ObjectStoreError, ObjectStoreUnavailableError
from tiering.handoff import AfterReceive
from tiering.health import TierHealth
from tiering.objectstore.memory import FailingObjectStore, InMemoryObjectStore
from tiering.protocols import DiskBlockTier, Listing, ObjectInfo, TierStats
from tiering.tiers.ram import RamTier
from tiering.policy.readahead import ReadAhead
from tiering.settings import DEFAULT_HIGH_WATERMARK, DEFAULT_LOW_WATERMARK, CacheSettings

BS = MIN_BLOCK_SIZE  # 64 KiB: the smallest block the settings allow
KEY = "data/shard-0000.bin"
SIZE = 5 * BS + 12345  # five full blocks and a partial one
SOURCE = random.Random(1234).randbytes(SIZE)


# ------------------------------------------------------------------------------------------ helpers
class CountingStore(InMemoryObjectStore):
    """An in-memory store that records every GET it is asked for."""

    def __init__(self) -> None:
        self.gets: list[tuple[str, int, int]] = []
        super().__init__(on_get=lambda key, start, end: self.gets.append((key, start, end)))


class GatedStore:
    """Wraps a store; every GET waits on ``gate``, and how many wait at once is recorded."""

    def __init__(self, inner: InMemoryObjectStore) -> None:
        self.inner = inner
        self.gate = asyncio.Event()
        self.started = 0
        self.in_progress = 0
        self.max_in_progress = 0

    @property
    def stats(self):  # noqa: ANN201
        return self.inner.stats

    async def check(self) -> None:
        await self.inner.check()

    async def list_dir(self, prefix: str) -> Listing:
        return await self.inner.list_dir(prefix)

    async def head(self, key: str) -> ObjectInfo:
        return await self.inner.head(key)

    async def get_range(self, key: str, etag: str, start: int, end: int, *, after: object = None) -> bytes:
        self.started += 1
        self.in_progress += 1
        self.max_in_progress = max(self.max_in_progress, self.in_progress)
        try:
            await self.gate.wait()
            return await self.inner.get_range(key, etag, start, end)
        finally:
            self.in_progress -= 1

    async def close(self) -> None:
        await self.inner.close()


class YieldingStore(GatedStore):
    """Like GatedStore, but each GET just yields the loop a few times instead of waiting on a gate."""

    async def get_range(self, key: str, etag: str, start: int, end: int, *, after: object = None) -> bytes:
        self.started += 1
        self.in_progress += 1
        self.max_in_progress = max(self.max_in_progress, self.in_progress)
        try:
            for _ in range(5):
                await asyncio.sleep(0)
            return await self.inner.get_range(key, etag, start, end)
        finally:
            self.in_progress -= 1


class ReceivingStore(GatedStore):
    """Receives every GET in a thread of its own and claims the caller's ``after`` there, running it
    once the bytes are handed over, as S3's presigned path does (``tiering.handoff``)."""

    def __init__(self, inner: InMemoryObjectStore) -> None:
        super().__init__(inner)
        self.gate.set()
        self.claimed = 0

    async def get_range(self, key: str, etag: str, start: int, end: int, *, after: object = None) -> bytes:
        data = await self.inner.get_range(key, etag, start, end)
        if isinstance(after, AfterReceive):
            self.claimed += 1
            after.claim()
            threading.Thread(target=after.run, args=(data,), name="receiver").start()
        return data


class BrokenTier:
    """A DiskBlockTier whose every I/O operation fails, as a dead disk would without its own guard.

    It holds nothing: the calls that need no I/O answer as an empty tier would (not held, nothing
    pinned); only ``get``, ``get_for_reply``, ``put`` and ``absent`` count in ``calls``.
    """

    def __init__(self, exc: Exception, name: str = "disk") -> None:
        self.name = name
        self.capacity_bytes = 10 * BS
        self.stats = TierStats()
        self.health = TierHealth(SystemClock(), name=name)
        self.high_watermark = DEFAULT_HIGH_WATERMARK
        self.low_watermark = DEFAULT_LOW_WATERMARK
        self.exc = exc
        self.calls = 0

    def get(self, key: BlockKey) -> bytes | None:
        self.calls += 1
        raise self.exc

    def put(self, key: BlockKey, data: bytes) -> bool:
        self.calls += 1
        raise self.exc

    def contains(self, key: BlockKey) -> bool:
        return False

    def absent(self, key: BlockKey) -> bool:
        self.calls += 1
        raise self.exc  # the engine must then try get(), which fails too: still a miss for the reader

    def discard(self, key: BlockKey) -> None:
        pass

    def keys(self) -> list[BlockKey]:
        return []

    def used_bytes(self) -> int:
        return 0

    def __len__(self) -> int:
        return 0

    def pin(self, keys: Iterable[BlockKey]) -> None:
        pass

    def unpin(self, keys: Iterable[BlockKey]) -> None:
        pass

    def is_pinned(self, key: BlockKey) -> bool:
        return False

    def pinned_bytes(self) -> int:
        return 0

    def touch(self, key: BlockKey) -> bool:
        return False

    def get_for_reply(self, key: BlockKey) -> bytes | None:
        self.calls += 1
        raise self.exc

    def peek(self, key: BlockKey) -> bytes | None:
        self.calls += 1
        raise self.exc

    def evict_unpinned(self) -> tuple[int, int]:
        raise self.exc

    def reserve_space(self, nbytes: int, *, force: bool = False) -> bool:
        raise self.exc

    def release_space(self, nbytes: int) -> None:
        pass

    def reserved_space(self) -> int:
        return 0


def test_the_broken_tier_is_a_whole_disk_tier() -> None:
    assert isinstance(BrokenTier(OSError(errno.EIO, "dead disk")), DiskBlockTier)


def make_cache(store, *, ram_blocks: int = 64, disk: DiskBlockTier | None = None, ram: RamTier | None = None, **kw) -> BlockCache:
    settings = CacheSettings(block_size=BS, ram_bytes=ram_blocks * BS, **kw)
    return BlockCache(settings, store, ram if ram is not None else RamTier(ram_blocks * BS), disk)


def put(store: InMemoryObjectStore, key: str = KEY, data: bytes = SOURCE) -> ObjectRef:
    info = store.put_object(key, data, mtime=1_700_000_000)
    return ObjectRef(info.key, info.etag, info.size)


def bkey(ref: ObjectRef, index: int) -> BlockKey:
    return BlockKey(ref.key, ref.etag, index)


async def until(condition, what: str, polls: int = 2000) -> None:
    """Poll (bounded) until ``condition()``; fails the test with ``what`` if it never holds."""
    for _ in range(polls):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"never happened: {what}")


# ------------------------------------------------------------------------------------------ bytes
READS = st.lists(
    st.tuples(st.integers(min_value=0, max_value=SIZE + BS), st.integers(min_value=0, max_value=3 * BS)),
    min_size=1,
    max_size=8,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reads=READS)
def test_reads_return_exactly_the_source_bytes(reads: list[tuple[int, int]]) -> None:
    async def run() -> None:
        store = InMemoryObjectStore()
        ref = put(store)
        cache = make_cache(store)
        for offset, length in reads:
            assert await cache.read(ref, offset, length) == SOURCE[offset : offset + length]
        # The same reads again, now from RAM.
        for offset, length in reads:
            assert await cache.read(ref, offset, length) == SOURCE[offset : offset + length]

    asyncio.run(run())


async def test_reads_at_block_edges() -> None:
    store = CountingStore()
    ref = put(store)
    cache = make_cache(store)
    for offset, length in [(0, 1), (BS - 1, 2), (BS, BS), (2 * BS - 1, 2 * BS + 2), (0, SIZE), (SIZE - 1, 10)]:
        assert await cache.read(ref, offset, length) == SOURCE[offset : offset + length]
    assert await cache.read(ref, SIZE, 10) == b""
    assert await cache.read(ref, SIZE + 5 * BS, 10) == b""
    assert await cache.read(ref, 100, 0) == b""
    # Every block was fetched once, whole (the last one clipped to the object's end).
    assert sorted(store.gets) == [(KEY, i * BS, min((i + 1) * BS, SIZE)) for i in range(block_count(SIZE, BS))]


async def test_get_block_returns_a_whole_block() -> None:
    store = InMemoryObjectStore()
    ref = put(store)
    cache = make_cache(store)
    assert await cache.get_block(ref, 1) == SOURCE[BS : 2 * BS]
    assert await cache.get_block(ref, 5) == SOURCE[5 * BS :]


# ------------------------------------------------------------------------------------------ single flight
async def test_concurrent_misses_on_one_block_cause_one_get() -> None:
    store = CountingStore()
    ref = put(store)
    cache = make_cache(store)
    offsets = [BS + i * 100 for i in range(20)]
    results = await asyncio.gather(*(cache.read(ref, off, 1000) for off in offsets))
    assert results == [SOURCE[off : off + 1000] for off in offsets]
    assert store.gets == [(KEY, BS, 2 * BS)]
    assert cache.stats.singleflight_joins == 19
    assert cache.stats.store_fetches == 1


async def test_a_cancelled_reader_does_not_cancel_the_fetch_others_wait_on() -> None:
    store = GatedStore(InMemoryObjectStore())
    ref = put(store.inner)
    cache = make_cache(store)
    first = asyncio.create_task(cache.read(ref, 0, 100))
    second = asyncio.create_task(cache.read(ref, 50, 100))
    await until(lambda: store.started == 1, "the GET started")
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    store.gate.set()
    assert await second == SOURCE[50:150]
    assert store.started == 1
    assert cache.ram.contains(bkey(ref, 0))


# ------------------------------------------------------------------------------------------ parallelism
async def test_a_read_spanning_several_blocks_fetches_them_concurrently() -> None:
    store = GatedStore(InMemoryObjectStore())
    ref = put(store.inner)
    cache = make_cache(store)
    reader = asyncio.create_task(cache.read(ref, 10, 4 * BS))  # touches blocks 0..4
    await until(lambda: store.in_progress == 5, "five GETs in progress at once")
    assert not reader.done()
    store.gate.set()
    assert await reader == SOURCE[10 : 10 + 4 * BS]
    assert store.max_in_progress == 5
    assert store.started == 5


async def test_fetch_slots_bound_gets_in_flight_even_with_large_readahead() -> None:
    store = YieldingStore(InMemoryObjectStore())
    big = random.Random(7).randbytes(40 * BS)
    ref = put(store.inner, "big.bin", big)
    cache = make_cache(store, max_concurrent_fetches=2)
    got = await asyncio.gather(
        cache.read(ref, 0, 3 * BS, readahead_bytes=30 * BS),
        cache.read(ref, 20 * BS, 3 * BS, readahead_bytes=30 * BS),
    )
    assert got == [big[: 3 * BS], big[20 * BS : 23 * BS]]
    await cache.close()
    assert store.started == 40  # every block was loaded by a read or by read-ahead...
    assert store.max_in_progress == 2  # ...never more than two at a time, and two did overlap
    assert all(cache.is_cached(bkey(ref, i)) for i in range(40))


async def test_fetch_slots_are_held_until_the_disk_write_completes(tmp_path: Path, monkeypatch) -> None:
    """Memory in flight is bounded up to the disk write, not just the GET."""
    disk = DiskTier(tmp_path, 100 * BS)
    writing = 0
    most_writing = 0
    real_put = DiskTier.put

    def slow_put(self: DiskTier, key: BlockKey, data: bytes) -> bool:
        nonlocal writing, most_writing
        writing += 1
        most_writing = max(most_writing, writing)
        try:
            import time

            time.sleep(0.01)  # a slow device; not asserted on
            return real_put(self, key, data)
        finally:
            writing -= 1

    monkeypatch.setattr(DiskTier, "put", slow_put)
    store = YieldingStore(InMemoryObjectStore())
    ref = put(store.inner)
    cache = make_cache(store, disk=disk, max_concurrent_fetches=1)
    assert await cache.read(ref, 0, SIZE) == SOURCE
    await cache.close()
    assert most_writing == 1
    assert store.max_in_progress == 1
    assert all(disk.contains(bkey(ref, i)) for i in range(6))


async def test_a_small_block_is_written_to_disk_by_the_thread_that_received_it(tmp_path: Path, monkeypatch) -> None:
    """No hop to asyncio's pool for it (tiering.handoff), and the fetch slot is still held until it is
    on disk."""
    disk = DiskTier(tmp_path, 100 * BS)
    writers: list[str] = []
    writing = threading.Event()
    real_put = DiskTier.put

    def put_here(self: DiskTier, key: BlockKey, data: bytes) -> bool:
        writers.append(threading.current_thread().name)
        writing.set()
        try:
            import time

            time.sleep(0.01)  # a slow device: a GET started meanwhile would be seen
            return real_put(self, key, data)
        finally:
            writing.clear()

    monkeypatch.setattr(DiskTier, "put", put_here)
    store = ReceivingStore(InMemoryObjectStore())
    gets_during_a_write = 0

    def on_get(key: str, start: int, end: int) -> None:
        nonlocal gets_during_a_write
        gets_during_a_write += writing.is_set()

    store.inner.on_get = on_get
    ref = put(store.inner)
    cache = make_cache(store, disk=disk, max_concurrent_fetches=1)
    assert await cache.read(ref, 0, SIZE) == SOURCE
    await cache.close()
    assert store.claimed == 6 and writers == ["receiver"] * 6
    assert gets_during_a_write == 0  # one slot: the next GET waits for the write
    assert all(disk.contains(bkey(ref, i)) for i in range(6))
    assert cache.stats.disk_errors == 0


async def test_a_large_block_is_written_by_the_pool_not_the_receiving_thread(tmp_path: Path) -> None:
    """Blocks of RECEIVER_PUT_BELOW_BYTES and more are not offered to the receiving thread."""
    block = RECEIVER_PUT_BELOW_BYTES
    data = random.Random(5).randbytes(block + 10)
    store = ReceivingStore(InMemoryObjectStore())
    ref = put(store.inner, "big.bin", data)
    disk = DiskTier(tmp_path / "disk", 8 * block)
    settings = CacheSettings(block_size=block, ram_bytes=4 * block, disk_bytes=8 * block)
    cache = BlockCache(settings, store, RamTier(4 * block), disk)
    assert await cache.read(ref, 0, len(data)) == data
    await cache.close()
    assert store.claimed == 1  # the 10-byte tail block only
    assert disk.contains(bkey(ref, 0)) and disk.contains(bkey(ref, 1))


@pytest.mark.parametrize("exc", [OSError(errno.EIO, "dead disk"), RuntimeError("bug")])
async def test_a_disk_put_that_raises_in_the_receiving_thread_is_a_miss(
        exc: Exception, caplog: pytest.LogCaptureFixture) -> None:
    store = ReceivingStore(InMemoryObjectStore())
    ref = put(store.inner)
    disk = BrokenTier(exc)
    cache = make_cache(store, disk=disk)
    assert await cache.read(ref, 0, SIZE) == SOURCE
    await cache.close()
    assert store.claimed == 6
    assert disk.calls == 18  # every block: one index lookup, one get, one put
    assert cache.stats.disk_errors == 12  # the get in the pool, the put in the receiving thread
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and r.name == "tiering.engine.diskguard"]
    assert len(warnings) == 1 and warnings[0].exc_info is not None


# ------------------------------------------------------------------------------------------ tiers
async def test_second_read_is_a_ram_hit() -> None:
    store = CountingStore()
    ref = put(store)
    cache = make_cache(store)
    assert await cache.read(ref, 0, 3 * BS) == SOURCE[: 3 * BS]
    assert len(store.gets) == 3
    hits = cache.ram.stats.hits
    assert await cache.read(ref, 100, 2 * BS) == SOURCE[100 : 100 + 2 * BS]
    assert len(store.gets) == 3
    assert cache.ram.stats.hits == hits + 3
    assert cache.stats.ram_served == 3
    assert cache.stats.hit_ratio() == pytest.approx(0.5)


async def test_hit_bytes_count_the_bytes_served_not_the_whole_block(tmp_path: Path) -> None:
    """A 4 KiB read of an 8 MiB block is 4096 hit bytes (it was 8 MiB per lookup, issue 12)."""
    block = DEFAULT_BLOCK_SIZE
    data = random.Random(7).randbytes(block)
    store = CountingStore()
    ref = put(store, "big.bin", data)
    disk = DiskTier(tmp_path / "disk", 4 * block)
    settings = CacheSettings(block_size=block, ram_bytes=4 * block, disk_bytes=4 * block)
    first = BlockCache(settings, store, RamTier(4 * block), disk)
    assert await first.read(ref, 0, 4096) == data[:4096]  # a fetch: no tier hit
    assert (first.ram.stats.hit_bytes, disk.stats.hit_bytes) == (0, 0)
    assert await first.read(ref, 8192, 4096) == data[8192:12288]  # a RAM hit
    assert (first.ram.stats.hits, first.ram.stats.hit_bytes) == (1, 4096)
    await first.close()

    second = BlockCache(settings, store, RamTier(4 * block), disk)  # cold RAM, warm disk
    assert await second.read(ref, block - 4096, 4096) == data[-4096:]  # a disk hit
    assert (disk.stats.hits, disk.stats.hit_bytes) == (1, 4096)
    assert second.ram.stats.hit_bytes == 0
    assert len(store.gets) == 1
    assert await second.get_block(ref, 0) == data  # a caller of the whole block gets all of it
    assert second.ram.stats.hit_bytes == block


async def test_disk_hit_after_ram_is_cleared_and_promotion_to_ram(tmp_path: Path) -> None:
    store = CountingStore()
    ref = put(store)
    disk = DiskTier(tmp_path / "disk", 100 * BS)
    first = make_cache(store, disk=disk)
    assert await first.read(ref, 0, SIZE) == SOURCE
    await first.close()  # disk writes done
    assert len(store.gets) == 6
    assert all(disk.contains(bkey(ref, i)) for i in range(6))

    ram = RamTier(64 * BS)  # a fresh RAM tier, the same disk tier
    second = make_cache(store, disk=disk, ram=ram)
    assert not ram.contains(bkey(ref, 2))
    assert await second.read(ref, 2 * BS + 7, BS) == SOURCE[2 * BS + 7 : 3 * BS + 7]
    assert len(store.gets) == 6  # no GET
    assert second.stats.disk_served == 2
    assert ram.contains(bkey(ref, 2)) and ram.contains(bkey(ref, 3))  # promoted
    disk_hits = disk.stats.hits
    assert await second.read(ref, 2 * BS, BS) == SOURCE[2 * BS : 3 * BS]
    assert disk.stats.hits == disk_hits  # now served from RAM
    assert second.stats.ram_served == 1


async def test_disk_tier_survives_a_restart(tmp_path: Path) -> None:
    store = CountingStore()
    ref = put(store)
    cache = make_cache(store, disk=DiskTier(tmp_path, 100 * BS))
    await cache.read(ref, 0, SIZE)
    await cache.close()
    reopened = make_cache(store, disk=DiskTier(tmp_path, 100 * BS))
    assert await reopened.read(ref, 0, SIZE) == SOURCE
    assert len(store.gets) == 6


async def test_ram_tier_disabled_reads_come_from_disk(tmp_path: Path) -> None:
    store = CountingStore()
    ref = put(store)
    settings = CacheSettings(block_size=BS, ram_bytes=0)
    cache = BlockCache(settings, store, RamTier(0), DiskTier(tmp_path, 100 * BS))
    assert await cache.read(ref, 0, SIZE) == SOURCE
    await cache.close()
    assert await cache.read(ref, BS + 1, 2 * BS) == SOURCE[BS + 1 : 3 * BS + 1]
    assert len(store.gets) == 6
    assert cache.stats.disk_served == 3
    assert len(cache.ram) == 0


# ------------------------------------------------------------------------------------------ versions
async def test_a_changed_object_never_returns_old_bytes(tmp_path: Path) -> None:
    store = CountingStore()
    old_ref = put(store)
    cache = make_cache(store, disk=DiskTier(tmp_path, 100 * BS))
    assert await cache.read(old_ref, 0, SIZE) == SOURCE
    await cache.close()

    new_data = bytes(b ^ 0xFF for b in SOURCE)  # same size, other bytes
    new_ref = put(store, KEY, new_data)
    assert new_ref.size == old_ref.size and new_ref.etag != old_ref.etag
    assert await cache.read(new_ref, 0, SIZE) == new_data
    assert await cache.read(new_ref, BS - 3, 10) == new_data[BS - 3 : BS + 7]


async def test_reading_an_old_etag_after_overwrite_raises_object_changed() -> None:
    store = InMemoryObjectStore()
    old_ref = put(store)
    cache = make_cache(store)
    assert await cache.read(old_ref, 0, 100) == SOURCE[:100]  # block 0 cached
    put(store, KEY, bytes(reversed(SOURCE)))
    with pytest.raises(ObjectChangedError) as info:
        await cache.read(old_ref, 3 * BS, 100)
    assert info.value.errno == errno.ESTALE
    # A read mixing a cached old block and an uncached one fails as a whole: no mixed versions.
    with pytest.raises(ObjectChangedError):
        await cache.read(old_ref, BS - 10, 20)


VERSIONS = st.lists(st.binary(min_size=1, max_size=1).map(lambda b: b[0]), min_size=2, max_size=4)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seeds=VERSIONS, reads=READS)
def test_property_each_version_reads_its_own_bytes(seeds: list[int], reads: list[tuple[int, int]]) -> None:
    """Overwrite the object several times (same size); every read with the current ref sees the
    current bytes, from whatever tier, and never an older version's."""

    async def run(directory: str) -> None:
        store = InMemoryObjectStore()
        cache = make_cache(store, ram_blocks=4, disk=DiskTier(Path(directory), 8 * BS + 8192))
        for version, seed in enumerate(seeds):
            data = random.Random(seed * 1000 + version).randbytes(SIZE)
            ref = put(store, KEY, data)
            for offset, length in reads:
                assert await cache.read(ref, offset, length) == data[offset : offset + length]
        await cache.close()

    with tempfile.TemporaryDirectory() as directory:
        asyncio.run(run(directory))


# ------------------------------------------------------------------------------------------ failures
async def test_fetch_timeout_fails_the_read_with_eio() -> None:
    inner = InMemoryObjectStore()
    ref = put(inner)
    store = FailingObjectStore(inner, delay_s=30.0)
    cache = make_cache(store, fetch_timeout_s=0.2)
    with pytest.raises(ObjectStoreUnavailableError) as info:
        await cache.read(ref, 0, 10)
    assert info.value.errno == errno.EIO
    assert "0.2" in str(info.value)
    assert cache.stats.fetch_errors == 1
    assert not cache.ram.contains(bkey(ref, 0))
    # The store recovers: the failure was not remembered.
    store.delay_s = 0
    assert await cache.read(ref, 0, 10) == SOURCE[:10]


async def test_store_failure_fails_uncached_reads_while_cached_blocks_keep_flowing() -> None:
    inner = InMemoryObjectStore()
    ref = put(inner)
    store = FailingObjectStore(inner)
    cache = make_cache(store)
    assert await cache.read(ref, 0, BS) == SOURCE[:BS]
    store.fail_gets = True
    for _ in range(3):
        assert await cache.read(ref, 10, 1000) == SOURCE[10:1010]
    with pytest.raises(ObjectStoreUnavailableError):
        await cache.read(ref, 2 * BS, 10)
    with pytest.raises(ObjectStoreError):
        await cache.read(ref, BS - 5, 10)  # cached block 0 + uncached block 1: the read fails
    store.fail_gets = False
    assert await cache.read(ref, BS - 5, 10) == SOURCE[BS - 5 : BS + 5]


async def test_short_read_from_the_store_is_an_error() -> None:
    class ShortStore(CountingStore):
        async def get_range(self, key: str, etag: str, start: int, end: int, *, after: object = None) -> bytes:
            return (await super().get_range(key, etag, start, end))[:-1]

    store = ShortStore()
    ref = put(store)
    cache = make_cache(store)
    with pytest.raises(ObjectStoreError, match="short read"):
        await cache.read(ref, 0, 10)
    assert not cache.ram.contains(bkey(ref, 0))


async def test_a_failing_disk_tier_is_a_miss(tmp_path: Path, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise OSError(errno.EIO, "injected disk failure")

    store = CountingStore()
    ref = put(store)
    disk = DiskTier(tmp_path, 100 * BS)
    # Blocks on disk first, then the device starts failing on reads and writes.
    warm = make_cache(store, disk=disk)
    await warm.read(ref, 0, 2 * BS)
    await warm.close()
    monkeypatch.setattr(disk.files, "read", broken)
    monkeypatch.setattr(disk.files, "write", broken)
    assert disk.packs is not None  # small blocks are records of pack files (tiering.tiers.packs)
    monkeypatch.setattr(disk.packs, "read", broken)
    monkeypatch.setattr(disk.packs, "append", broken)
    cache = make_cache(store, disk=disk)
    assert await cache.read(ref, 0, SIZE) == SOURCE
    await cache.close()
    assert disk.stats.errors >= 1
    assert cache.ram.contains(bkey(ref, 5))


@pytest.mark.parametrize("exc", [OSError(errno.EIO, "dead disk"), OSError(errno.ENOSPC, "full"), RuntimeError("bug")])
async def test_a_disk_tier_that_raises_is_a_miss(exc: Exception, caplog: pytest.LogCaptureFixture) -> None:
    """The engine does not rely on the tier's own guard: whatever a cache tier raises, the reader
    gets the store's bytes."""
    store = CountingStore()
    ref = put(store)
    disk = BrokenTier(exc)
    cache = make_cache(store, disk=disk)
    assert await cache.read(ref, 0, SIZE) == SOURCE
    assert await cache.read(ref, BS, 10, readahead_bytes=2 * BS) == SOURCE[BS : BS + 10]
    await cache.close()
    assert disk.calls == 18  # every block: one index lookup, one get, one put
    assert cache.stats.disk_errors == 12
    assert len(store.gets) == 6
    assert cache.ram.contains(bkey(ref, 0))
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and r.name == "tiering.engine.diskguard"]
    assert len(warnings) == 1  # logged once, with the traceback
    assert warnings[0].exc_info is not None and warnings[0].exc_info[1] is exc


# ------------------------------------------------------------------------------------------ read-ahead
async def test_sequential_reads_read_the_next_blocks_ahead() -> None:
    store = CountingStore()
    big = random.Random(3).randbytes(20 * BS)
    ref = put(store, "seq.bin", big)
    cache = make_cache(store)
    policy = ReadAhead(BS, 4 * BS)
    chunk = BS // 2
    for i in range(4):  # the first two blocks, read sequentially
        offset = i * chunk
        assert await cache.read(ref, offset, chunk, policy.on_read(offset, chunk)) == big[offset : offset + chunk]
    await cache.close()
    # Windows of 1, 2, 4, 4 blocks past each read's end: blocks 1..5 came from read-ahead, the
    # reads themselves only ever fetched block 0.
    assert all(cache.is_cached(bkey(ref, i)) for i in range(6))
    assert not cache.is_cached(bkey(ref, 6))
    assert cache.stats.readahead_blocks == 5
    assert sorted(s for _, s, _ in store.gets) == [i * BS for i in range(6)]


async def test_random_reads_read_nothing_ahead() -> None:
    store = CountingStore()
    big = random.Random(4).randbytes(20 * BS)
    ref = put(store, "rand.bin", big)
    cache = make_cache(store)
    policy = ReadAhead(BS, 8 * BS)
    for block in [7, 2, 15, 11, 4]:
        offset = block * BS + 100
        assert await cache.read(ref, offset, 200, policy.on_read(offset, 200)) == big[offset : offset + 200]
    await cache.close()
    assert cache.stats.readahead_blocks == 0
    assert sorted(s // BS for _, s, _ in store.gets) == [2, 4, 7, 11, 15]


async def test_readahead_is_clipped_to_the_object_end() -> None:
    store = CountingStore()
    ref = put(store)
    cache = make_cache(store)
    await cache.read(ref, 4 * BS, 10, readahead_bytes=100 * BS)
    await cache.close()
    assert sorted(s // BS for _, s, _ in store.gets) == [4, 5]
    assert cache.read_ahead(ref, SIZE, BS) == 0


async def test_read_ahead_of_cached_or_inflight_blocks_starts_nothing() -> None:
    store = GatedStore(InMemoryObjectStore())
    ref = put(store.inner)
    cache = make_cache(store)
    store.gate.set()
    await cache.read(ref, 0, 2 * BS)
    assert store.started == 2
    assert cache.read_ahead(ref, 0, 2 * BS) == 0  # in RAM
    store.gate.clear()
    assert cache.read_ahead(ref, 2 * BS, 2 * BS) == 2  # blocks 2 and 3 start
    await until(lambda: store.started == 4, "two read-ahead GETs")
    assert cache.read_ahead(ref, 0, 4 * BS) == 0  # cached or in flight
    assert cache.read_ahead(ref, 0, 0) == 0
    store.gate.set()
    await cache.close()
    assert store.started == 4


async def test_read_ahead_of_disk_cached_blocks_fetches_nothing(tmp_path: Path) -> None:
    store = CountingStore()
    ref = put(store)
    disk = DiskTier(tmp_path, 100 * BS)
    warm = make_cache(store, disk=disk)
    await warm.read(ref, 0, SIZE)
    await warm.close()
    cold = make_cache(store, disk=disk, ram=RamTier(64 * BS))
    cold.read_ahead(ref, 0, SIZE)
    await cold.close()
    assert len(store.gets) == 6
    assert all(cold.ram.contains(bkey(ref, i)) for i in range(6))  # promoted for the reads to come


# ------------------------------------------------------------------------------------------ close
async def test_close_waits_for_pending_loads(tmp_path: Path) -> None:
    store = GatedStore(InMemoryObjectStore())
    ref = put(store.inner)
    disk = DiskTier(tmp_path, 100 * BS)
    cache = make_cache(store, disk=disk)
    assert cache.read_ahead(ref, 0, SIZE) == 6
    closing = asyncio.create_task(cache.close())
    for _ in range(20):
        await asyncio.sleep(0)
    assert not closing.done()  # the loads are held at the gate
    store.gate.set()
    await closing
    assert all(disk.contains(bkey(ref, i)) for i in range(6))


async def test_close_with_nothing_pending_returns() -> None:
    cache = make_cache(InMemoryObjectStore())
    await cache.close()
    assert cache.stats.hit_ratio() == 0.0


async def test_a_block_the_disk_tier_lacks_is_a_counted_miss_without_a_disk_read(tmp_path) -> None:
    """The engine asks the disk tier's index on the loop; only indexed blocks cost a read."""
    store = CountingStore()
    ref = put(store)
    disk = DiskTier(tmp_path / "disk", capacity_bytes=64 * BS)
    reads: list[BlockKey] = []
    real_get = disk.get

    def counting_get(key: BlockKey) -> bytes | None:
        reads.append(key)
        return real_get(key)

    disk.get = counting_get  # type: ignore[method-assign]
    cache = make_cache(store, disk=disk)
    assert await cache.read(ref, 0, SIZE) == SOURCE
    await cache.close()
    assert reads == []  # nothing was on disk: no block read
    assert disk.stats.misses == 6 and disk.stats.hits == 0
    warm = make_cache(store, disk=disk)  # a new engine (empty RAM tier) over the filled disk tier
    assert await warm.read(ref, 0, SIZE) == SOURCE
    await warm.close()
    assert len(reads) == 6 and disk.stats.hits == 6
    assert len(store.gets) == 6  # the second pass fetched nothing


# ------------------------------------------------------------------------------------------ promote
async def test_promote_puts_a_local_version_on_disk_and_readers_join_it(tmp_path: Path) -> None:
    """An upload's bytes go to the disk tier (not RAM) through the single-flight table: a reader
    arriving while a block is being promoted joins it (no GET), and later reads are disk hits."""
    store = CountingStore()
    ref = put(store)  # the version "just uploaded"
    disk = DiskTier(tmp_path / "disk", 100 * BS)
    cache = make_cache(store, disk=disk)
    gate = threading.Event()
    reads: list[tuple[int, int]] = []

    def read(start: int, end: int) -> bytes:
        reads.append((start, end))
        assert gate.wait(5.0)
        return SOURCE[start:end]

    promoting = asyncio.ensure_future(cache.promote(ref, read))
    await until(lambda: bool(reads), "the promotion reads its first block")
    joined = asyncio.ensure_future(cache.read(ref, 10, 20))  # block 0 is being promoted: join it
    await asyncio.sleep(0)
    gate.set()
    assert await joined == SOURCE[10:30]
    assert await promoting == SIZE
    assert store.gets == []
    assert cache.stats.singleflight_joins == 1
    assert all(disk.contains(bkey(ref, i)) for i in range(block_count(SIZE, BS)))
    assert not cache.ram.contains(bkey(ref, 3))  # not into RAM
    assert await cache.read(ref, 3 * BS, BS) == SOURCE[3 * BS : 4 * BS]
    assert store.gets == [] and cache.stats.disk_served == 1


async def test_promote_into_a_failing_disk_tier_stores_nothing_and_raises_nothing() -> None:
    store = CountingStore()
    ref = put(store)
    cache = make_cache(store, disk=BrokenTier(OSError(errno.EIO, "dead disk")))  # type: ignore[arg-type]
    assert await cache.promote(ref, lambda start, end: SOURCE[start:end]) == 0
    assert cache.stats.disk_errors == 1  # stopped at the first block not stored
    assert await cache.read(ref, 0, 10) == SOURCE[:10]  # reads still work (from the store)


async def test_promote_hands_a_joined_reader_to_a_load_when_the_local_copy_fails(tmp_path: Path) -> None:
    store = CountingStore()
    ref = put(store)
    cache = make_cache(store, disk=DiskTier(tmp_path / "disk", 100 * BS))
    gate = threading.Event()

    def read(start: int, end: int) -> bytes:
        assert gate.wait(5.0)
        raise OSError(errno.EIO, "staged data file unreadable")

    promoting = asyncio.ensure_future(cache.promote(ref, read))
    await until(lambda: len(cache.loads) > 0, "the promotion registers its first block")
    joined = asyncio.ensure_future(cache.read(ref, 0, 10))
    await asyncio.sleep(0)
    gate.set()
    assert await joined == SOURCE[:10]  # fetched from the store instead
    assert await promoting == 0
    assert len(store.gets) == 1
