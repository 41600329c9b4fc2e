"""Announced read orders: positions follow opens, windows are bounded, limits refuse, eviction ranks.

A fake store and clock: no timing assertions. The prefetcher's rounds are driven by hand
(``round`` then ``drain``) so every check sees a settled state.
"""

from __future__ import annotations

import asyncio
import math
import tempfile
from pathlib import Path

import pytest

from tiering.engine.blockcache import BlockCache
from tiering.blocks import MIN_BLOCK_SIZE, BlockKey, ObjectRef
from tiering.clock import FakeClock
from tiering.tiers.disk import DiskTier
from tiering.objectstore.memory import FailingObjectStore, InMemoryObjectStore
from tiering.engine.orderprefetch import OrderPrefetcher, window_limit
from tiering.tiers import ram as ram_module
from tiering.tiers.ram import RamTier
from tiering.policy.readorder import SLACK, ReadOrder, ReadOrderLimitError, ReadOrderSettings
from tiering.settings import CacheSettings

BS = MIN_BLOCK_SIZE


def refs(n: int, size: int = 1000, prefix: str = "f") -> list[ObjectRef]:
    return [ObjectRef(f"{prefix}{i:05d}", f"e{i}", size) for i in range(n)]


def key(ref: ObjectRef, index: int = 0) -> BlockKey:
    return BlockKey(ref.key, ref.etag, index)


def never_cached(_key: BlockKey) -> bool:
    return False


# ------------------------------------------------------------------------------------------ order state
def test_next_use_follows_the_order_and_the_position() -> None:
    order = ReadOrder(BS)
    files = refs(10)
    order.announce("s", files)
    assert [order.next_use(key(r)) for r in files] == list(range(10))
    assert order.next_use(BlockKey("other", "x", 0)) == math.inf
    assert order.opened(files[3], never_cached)  # a skip of three: the position follows
    assert order.next_use(key(files[3])) == 0
    assert order.next_use(key(files[9])) == 6
    # Skipped entries within SLACK behind the position are still needed (a lagging worker), sooner
    # than anything ahead.
    assert order.next_use(key(files[1])) < 0


def test_opened_entries_behind_the_position_are_not_needed_again() -> None:
    order = ReadOrder(BS)
    files = refs(5)
    order.announce("s", files)
    for r in files[:3]:
        order.opened(r, never_cached)
    assert order.next_use(key(files[0])) == math.inf
    assert order.next_use(key(files[2])) == 0  # being read now


def test_multi_block_files_count_blocks() -> None:
    order = ReadOrder(BS)
    big = ObjectRef("big", "e", 3 * BS)
    small = ObjectRef("small", "e", 10)
    order.announce("s", [big, small])
    assert order.next_use(key(big, 2)) == 2
    assert order.next_use(key(small)) == 3


def test_a_repeated_file_matches_its_next_occurrence() -> None:
    order = ReadOrder(BS)
    a, b = refs(2)
    order.announce("s", [a, b, a])
    order.opened(a, never_cached)
    order.opened(b, never_cached)
    assert order.next_use(key(a)) == 1  # the second occurrence, one entry after b
    order.opened(a, never_cached)
    assert order.stats.unmatched_opens == 0
    assert order.opened(a, never_cached) is False  # a repeat beyond the order: no match, no harm
    assert order.stats.unmatched_opens == 1


def test_a_far_skip_does_not_move_the_position() -> None:
    order = ReadOrder(BS)
    files = refs(6000)
    order.announce("s", files)
    assert order.opened(files[5000], never_cached) is False  # beyond MATCH_AHEAD
    assert order.streams()[0].position == 0


def test_hits_and_stalls_are_counted_at_open() -> None:
    order = ReadOrder(BS)
    a, b = refs(2)
    order.announce("s", [a, b])
    order.opened(a, lambda k: True)
    order.opened(b, never_cached)
    assert (order.stats.order_hits, order.stats.stalls) == (1, 1)


def test_two_streams_the_nearest_use_wins() -> None:
    order = ReadOrder(BS)
    files = refs(4)
    order.announce("one", files)
    order.announce("two", list(reversed(files)))
    assert order.next_use(key(files[3])) == 0
    assert order.next_use(key(files[1])) == 1


def test_passed_entries_are_compacted_and_paging_appends() -> None:
    order = ReadOrder(BS)
    files = refs(5000)
    order.announce("s", files[:3000])
    for r in files[:2900]:
        order.opened(r, never_cached)
    order.announce("s", files[3000:], append=True)
    stream = order.streams()[0]
    assert len(stream) == 5000 - 2899 + SLACK  # the reader is at entry 2899
    assert order.next_use(key(files[4999])) == 4999 - 2899
    assert order.next_use(key(files[0])) == math.inf


def test_an_empty_order_ends_the_stream() -> None:
    order = ReadOrder(BS)
    order.announce("s", refs(3))
    assert order.active()
    order.announce("s", [])
    assert not order.active()


# ------------------------------------------------------------------------------------------ bounds
def test_limits_refuse_with_one_line_and_change_nothing() -> None:
    clock = FakeClock()
    order = ReadOrder(BS, ReadOrderSettings(max_page_entries=10, max_stream_entries=15, max_total_entries=20,
                                            max_streams=2, stale_after_s=60), clock=clock)
    with pytest.raises(ReadOrderLimitError, match="11 files is over the limit of 10 per request"):
        order.announce("a", refs(11))
    order.announce("a", refs(10))
    with pytest.raises(ReadOrderLimitError, match="would hold 20 files, over the limit of 15 per stream"):
        order.announce("a", refs(10, prefix="g"), append=True)
    order.announce("b", refs(10, prefix="h"))
    with pytest.raises(ReadOrderLimitError, match="over its limit of 20"):
        order.announce("c", refs(1, prefix="i"))
    assert order.held_entries() == 20
    for message in ("", "x" * 201):
        with pytest.raises(ReadOrderLimitError, match="stream id"):
            order.announce(message, refs(1))
    # An idle stream is dropped to make room, a recent one is not.
    clock.advance(61)
    order.opened(refs(1, prefix="h")[0], never_cached)  # b is active again
    order.announce("c", refs(5, prefix="i"))
    assert sorted(s.id for s in order.streams()) == ["b", "c"]
    assert order.stats.streams_dropped == 1


# ------------------------------------------------------------------------------------------ eviction
def test_ram_tier_evicts_unannounced_first_then_farthest() -> None:
    order = ReadOrder(BS)
    ram = RamTier(4 * 100, victim_order=order)
    files = refs(6, size=100)
    stray = ObjectRef("stray", "e", 100)
    ram.put(key(stray), b"s" * 100)  # least recently used, not announced
    for r in files[:3]:
        ram.put(key(r), b"x" * 100)
    order.announce("s", files)
    ram.put(key(files[5]), b"x" * 100)  # stray goes first (nobody needs it)
    assert not ram.contains(key(stray))
    ram.put(key(files[4]), b"x" * 100)  # then the farthest announced: files[5]
    assert not ram.contains(key(files[5]))
    assert all(ram.contains(key(r)) for r in files[:3])
    assert ram.stats.ordered_evictions == 2


def counted_next_use(order: ReadOrder) -> list[int]:
    """From now on, ``order.next_use`` counts its calls in the list returned (its only item)."""
    calls = [0]
    next_use = order.next_use

    def counted(k: BlockKey) -> float:
        calls[0] += 1
        return next_use(k)

    order.next_use = counted  # type: ignore[method-assign]
    return calls


def follow_the_order(window: int) -> tuple[int, int, RamTier]:
    """A reader following a 3,000-file order with blocks put ``window`` files ahead of it into a tier
    of 500: its misses, and the ``next_use`` calls the tier made."""
    order = ReadOrder(BS)
    files = refs(3000, size=100)
    order.announce("s", files)
    calls = counted_next_use(order)
    ram = RamTier(500 * 100, victim_order=order)
    for r in files[:window]:
        ram.put(key(r), b"x" * 100)
    misses = 0
    calls[0] = 0
    for position, ref in enumerate(files):
        if position + window < len(files):
            ram.put(key(files[position + window]), b"x" * 100)  # fetched ahead
        if ram.get(key(ref)) is None:
            misses += 1
        order.opened(ref, ram.contains)
    assert ram.stats.evictions > 2000 and ram.stats.ordered_evictions == ram.stats.evictions
    return misses, calls[0], ram


@pytest.mark.parametrize("window", [100, 600])  # ahead of the reader: within the tier, and over it
def test_a_full_tier_asks_the_order_a_bounded_number_of_times_per_insert(
        window: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranking every held block at every eviction made each insert into a full tier cost O(blocks held)
    (400-417 ``next_use`` calls per insert here; half the loop's CPU per cold file in a benchmark). A
    ranking is now reused, and the reader misses no more than when the tier uses no ranking twice."""
    misses, calls, _ = follow_the_order(window)
    assert calls <= 5 * 3000
    monkeypatch.setattr(ram_module, "RERANK_MIN_BLOCKS", 10**9)  # no ranking used twice
    exact_misses, _, _ = follow_the_order(window)
    assert misses <= exact_misses


def test_without_an_active_order_eviction_is_lru() -> None:
    order = ReadOrder(BS)
    ram = RamTier(2 * 100, victim_order=order)
    a, b, c = refs(3, size=100)
    ram.put(key(a), b"x" * 100)
    ram.put(key(b), b"x" * 100)
    ram.put(key(c), b"x" * 100)
    assert not ram.contains(key(a)) and ram.stats.ordered_evictions == 0


def test_a_disk_tier_batch_asks_the_order_about_the_blocks_it_walks_not_its_whole_index() -> None:
    """A batch taken from blocks no one needs stops asking there: a tier of a million blocks is not
    ranked whole (~1.3 s under its lock) for every batch of a tenth of it."""
    order = ReadOrder(BS)
    with tempfile.TemporaryDirectory() as tmp:
        block = 4096
        files = refs(400, size=block)
        disk = DiskTier(Path(tmp), 330 * (block + 32), high_watermark=0.9, low_watermark=0.8, victim_order=order)
        order.announce("s", files[150:])  # the last blocks put are the ones still needed
        put = 0
        while disk.stats.evictions == 0:
            before = len(disk)
            if put == 150:  # every block put from here on is needed: count the questions of the batch
                calls = counted_next_use(order)
            disk.put(key(files[put]), b"x" * block)
            put += 1
        evicted = before + 1 - len(disk)
        assert put > 151 and evicted > 20 and disk.stats.ordered_evictions == evicted
        assert all(disk.contains(key(r)) for r in files[150:put])  # needed: kept
        assert calls[0] <= evicted + 1 < before  # was one per block held


def test_disk_tier_ranks_victims_too() -> None:
    order = ReadOrder(BS)
    with tempfile.TemporaryDirectory() as tmp:
        block = 4096
        disk = DiskTier(Path(tmp), 10 * (block + 200), high_watermark=0.9, low_watermark=0.5, victim_order=order)
        files = refs(12, size=block)
        order.announce("s", files)
        for r in reversed(files[:9]):  # nearest inserted last: LRU would evict the nearest first
            disk.put(key(r), b"x" * block)
        disk.put(key(files[9]), b"x" * block)
        kept = [i for i, r in enumerate(files[:9]) if disk.contains(key(r))]  # files[9] is the new block
        assert kept == list(range(len(kept))) and disk.stats.ordered_evictions == 9 - len(kept) > 0


# ------------------------------------------------------------------------------------------ prefetcher
def make_cache(store: InMemoryObjectStore, ram_bytes: int = 64 * BS, fetches: int = 8) -> BlockCache:
    settings = CacheSettings(block_size=BS, ram_bytes=ram_bytes, disk_bytes=0, max_concurrent_fetches=fetches)
    return BlockCache(settings, store, RamTier(ram_bytes))


def stored(store: InMemoryObjectStore, n: int, size: int) -> list[ObjectRef]:
    out = []
    for i in range(n):
        info = store.put_object(f"d/{i:04d}", bytes([i % 251]) * size)
        out.append(ObjectRef(info.key, info.etag, info.size))
    return out


def test_prefetcher_fetches_within_the_window_and_follows_opens() -> None:
    async def main() -> None:
        store = InMemoryObjectStore()
        files = stored(store, 40, 10_000)
        cache = make_cache(store)
        order = ReadOrder(BS)
        pf = OrderPrefetcher(order, cache, window_bytes=50_000)
        order.announce("s", files)
        await pf.round()
        await pf.drain()
        fetched = [r for r in files if cache.is_cached(key(r))]
        assert fetched == files[:5]  # five files of 10,000 bytes fill the 50,000-byte window
        assert order.window_bytes() <= 50_000
        for r in files[:5]:
            order.opened(r, cache.is_cached)
        await pf.round()
        await pf.drain()
        assert [r for r in files if cache.is_cached(key(r))] == files[:9]
        assert order.stats.order_hits == 5 and order.stats.stalls == 0
        # Reads of prefetched blocks are RAM hits, not fetches.
        gets = store.stats.get_requests
        for i in range(4, 9):
            assert bytes(await cache.read(files[i], 0, 10_000)) == bytes([i % 251]) * 10_000
        assert store.stats.get_requests == gets
        await pf.stop()

    asyncio.run(main())


def test_a_diverging_reader_reads_correct_bytes_and_waste_is_bounded() -> None:
    async def main() -> None:
        store = InMemoryObjectStore()
        files = stored(store, 60, 10_000)
        cache = make_cache(store)
        order = ReadOrder(BS)
        pf = OrderPrefetcher(order, cache, window_bytes=30_000)
        order.announce("s", files[:50])
        pf.start()
        # Skips, repeats, reads of files never announced, then stops.
        for i in [0, 1, 1, 7, 3, 55, 20, 20, 21]:
            r = files[i]
            order.opened(r, cache.is_cached)
            data = await cache.read(r, 0, r.size)
            assert bytes(data) == bytes([i % 251]) * 10_000
            await asyncio.sleep(0)
        await pf.drain()
        # At most one window beyond the furthest entry opened (index 21) was fetched.
        assert order.streams()[0].cursor <= 21 + 1 + 3
        await pf.stop()

    asyncio.run(main())


def test_each_announced_load_is_counted_once_settled_and_gives_its_slot_back() -> None:
    """Failed loads count as errors, fetched ones as prefetched; either way the slot comes back, and
    stopping the prefetcher leaves a load a reader joined to finish for that reader."""
    async def main() -> None:
        inner = InMemoryObjectStore()
        files = stored(inner, 12, 10_000)
        store = FailingObjectStore(inner, fail_gets=True)
        cache = BlockCache(CacheSettings(block_size=BS, ram_bytes=64 * BS, disk_bytes=0, max_concurrent_fetches=8),
                           store, RamTier(64 * BS))
        order = ReadOrder(BS)
        pf = OrderPrefetcher(order, cache, window_bytes=40_000)
        order.announce("s", files)
        await pf.round()
        await pf.drain()
        assert order.stats.prefetch_errors == 4 and order.stats.prefetched_blocks == 0
        assert pf._slots._value == pf.slot_count  # every slot given back
        store.fail_gets = False
        for r in files[:4]:
            order.opened(r, cache.is_cached)
        store.delay_s = 0.05
        await pf.round()  # the next ones, slow
        in_flight = pf.slot_count - pf._slots._value
        assert in_flight == len(pf._loads) > 0  # a slot held by each load until it settles
        joined = asyncio.ensure_future(cache.read(files[4], 0, 10_000))
        await asyncio.sleep(0)
        await pf.stop()  # ...stopped while they are in flight: the loads go on
        assert bytes(await joined) == bytes([4]) * 10_000
        await pf.drain()
        assert order.stats.prefetched_blocks == in_flight and order.stats.prefetch_errors == 4
        assert pf._slots._value == pf.slot_count
        assert all(cache.is_cached(key(r)) for r in files[4:4 + in_flight])
        assert inner.stats.get_requests == in_flight  # the reader joined its load: no GET of its own

    asyncio.run(main())


def test_window_is_bounded_by_the_cache() -> None:
    store = InMemoryObjectStore()
    cache = make_cache(store, ram_bytes=8 * BS)
    assert window_limit(cache, 1 << 40) == 2 * BS


def test_announced_loads_leave_fetch_slots_to_reads() -> None:
    async def main() -> None:
        store = InMemoryObjectStore()
        cache = make_cache(store, fetches=8)
        pf = OrderPrefetcher(ReadOrder(BS), cache)
        assert pf.slot_count == 6

    asyncio.run(main())


def test_a_file_larger_than_the_window_is_fetched_up_to_the_window() -> None:
    async def main() -> None:
        store = InMemoryObjectStore()
        info = store.put_object("big", b"b" * (10 * BS))
        big = ObjectRef(info.key, info.etag, info.size)
        cache = make_cache(store)
        order = ReadOrder(BS)
        pf = OrderPrefetcher(order, cache, window_bytes=3 * BS)
        order.announce("s", [big])
        await pf.round()
        await pf.drain()
        assert [i for i in range(10) if cache.is_cached(key(big, i))] == [0, 1, 2]

    asyncio.run(main())
