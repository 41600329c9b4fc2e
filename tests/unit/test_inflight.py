"""Blocks in flight count against the RAM tier (tiering.engine.inflight, RamTier.reserve)."""

from __future__ import annotations

import asyncio
import random

import pytest

from tiering.blocks import MIN_BLOCK_SIZE, BlockKey, ObjectRef
from tiering.engine.blockcache import BlockCache
from tiering.engine.inflight import InFlight
from tiering.settings import CacheSettings
from tiering.tiers.ram import RamTier
from tests.unit.test_blockcache import CountingStore, GatedStore

BS = MIN_BLOCK_SIZE


def key(i: int) -> BlockKey:
    return BlockKey("k", "e", i)


# ------------------------------------------------------------------------------------------ RamTier
def test_a_reservation_evicts_held_blocks_at_once_and_shrinks_the_room_for_puts() -> None:
    ram = RamTier(4 * BS)
    for i in range(4):
        assert ram.put(key(i), bytes(BS))
    ram.reserve(2 * BS)
    assert ram.used_bytes() == 2 * BS  # the two least recently used went
    assert ram.keys() == [key(2), key(3)]
    assert ram.put(key(4), bytes(BS))  # evicts key(2): used + reserved stays within capacity
    assert ram.used_bytes() + ram.reserved_bytes() == 4 * BS
    ram.reserve(2 * BS)
    assert ram.used_bytes() == 0
    assert not ram.put(key(5), bytes(BS))  # no room left: refused, counted
    assert ram.stats.rejected == 1
    ram.unreserve(4 * BS)
    assert ram.reserved_bytes() == 0
    assert ram.put(key(5), bytes(BS))


# ------------------------------------------------------------------------------------------ InFlight
def test_the_limit_is_half_the_tier_and_nothing_is_counted_without_one() -> None:
    async def main() -> None:
        assert InFlight(RamTier(8 * BS)).limit_bytes == 4 * BS
        for off in (None, RamTier(0)):
            budget = InFlight(off)
            held = [await budget.reserve(100 * BS) for _ in range(3)]  # nothing waits
            assert budget.reserved_bytes == 0 and budget.waits == 0
            for r in held:
                r.release()
    asyncio.run(main())


def test_grants_wait_for_releases_in_arrival_order() -> None:
    async def main() -> None:
        ram = RamTier(8 * BS)
        budget = InFlight(ram)
        first = await budget.reserve(3 * BS)
        assert ram.reserved_bytes() == 3 * BS
        big = asyncio.ensure_future(budget.reserve(2 * BS))  # 5 > 4: waits
        small = asyncio.ensure_future(budget.reserve(BS))  # would fit, but must not overtake `big`
        await asyncio.sleep(0)
        assert not big.done() and not small.done()
        assert budget.waits == 2
        first.release()
        first.release()  # idempotent: counted once
        got_big, got_small = await big, await small
        assert budget.reserved_bytes == ram.reserved_bytes() == 3 * BS
        got_big.release()
        got_small.release()
        assert budget.reserved_bytes == ram.reserved_bytes() == 0
    asyncio.run(main())


def test_one_reservation_larger_than_the_limit_is_granted_when_nothing_else_is_held() -> None:
    async def main() -> None:
        budget = InFlight(RamTier(2 * BS))  # limit: one block
        huge = await budget.reserve(8 * BS)
        assert budget.reserved_bytes == 8 * BS
        waiting = asyncio.ensure_future(budget.reserve(BS))
        await asyncio.sleep(0)
        assert not waiting.done()
        huge.release()
        (await waiting).release()
    asyncio.run(main())


def test_a_cancelled_waiter_is_never_granted_and_does_not_block_those_behind_it() -> None:
    async def main() -> None:
        ram = RamTier(8 * BS)
        budget = InFlight(ram)
        held = await budget.reserve(4 * BS)
        doomed = asyncio.ensure_future(budget.reserve(4 * BS))
        behind = asyncio.ensure_future(budget.reserve(BS))
        await asyncio.sleep(0)
        doomed.cancel()
        held.release()  # in the same loop turn as the cancel: the cancelled waiter is skipped
        got = await behind
        with pytest.raises(asyncio.CancelledError):
            await doomed
        assert budget.reserved_bytes == ram.reserved_bytes() == BS
        got.release()
        assert budget.reserved_bytes == ram.reserved_bytes() == 0
    asyncio.run(main())


# ------------------------------------------------------------------------------------------ engine
def test_loads_in_flight_stay_within_half_the_ram_tier_and_every_block_arrives_whole() -> None:
    async def main() -> None:
        inner = CountingStore()
        data = random.Random(7).randbytes(12 * BS)
        info = inner.put_object("big", data)
        store = GatedStore(inner)
        settings = CacheSettings(block_size=BS, ram_bytes=4 * BS, max_concurrent_fetches=16,
                                 readahead_max_bytes=12 * BS)
        cache = BlockCache(settings, store, RamTier(settings.ram_bytes))  # type: ignore[arg-type]
        ref = ObjectRef("big", info.etag, len(data))
        assert cache.read_ahead(ref, 0, 12 * BS) == 12
        for _ in range(20):
            await asyncio.sleep(0)
        # 16 fetch slots, but only half the 4-block RAM tier may be in flight.
        assert store.in_progress == 2
        assert cache.loads.inflight.waits >= 10
        store.gate.set()
        got = b"".join([bytes(await cache.read(ref, i * BS, BS)) for i in range(12)])
        assert got == data
        assert store.max_in_progress == 2
        assert cache.loads.inflight.reserved_bytes == 0
        assert cache.ram.used_bytes() <= settings.ram_bytes
        await cache.close()
    asyncio.run(main())
