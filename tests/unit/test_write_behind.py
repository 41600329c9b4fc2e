"""The cluster write-behind queue alone: what a full queue defers, reads back, drops, and holds."""

from __future__ import annotations

import asyncio

import pytest

from tiering.blocks import BlockData, BlockKey
from tiering.tiers.cluster import InMemoryClusterTier, WriteBehind

BS = 1024


def key(i: int) -> BlockKey:
    return BlockKey("data/f.bin", '"e1"', i)


def block(i: int) -> bytes:
    return bytes([i % 251]) * BS


class SlowTier(InMemoryClusterTier):
    """Every put waits for ``go``; the write-behind's bytes held are sampled at each put."""

    def __init__(self, queue_of: list[WriteBehind]) -> None:
        super().__init__()
        self.go = asyncio.Event()
        self.queue_of = queue_of
        self.held: list[int] = []

    async def put(self, key: BlockKey, data: BlockData) -> bool:
        self.held.append(self.queue_of[0].queued_bytes())
        await self.go.wait()
        return await super().put(key, data)


class Disk:
    """What the engine's read-back does, from a dict: None for a block gone from the disk tier."""

    def __init__(self, blocks: dict[BlockKey, bytes]) -> None:
        self.blocks = blocks
        self.reads: list[BlockKey] = []

    async def read_back(self, k: BlockKey) -> BlockData | None:
        await asyncio.sleep(0)
        self.reads.append(k)
        return self.blocks.get(k)


async def test_deferred_blocks_are_read_back_oldest_first_and_memory_stays_bounded() -> None:
    queues: list[WriteBehind] = []
    tier = SlowTier(queues)
    queue = WriteBehind(tier, max_blocks=2, max_bytes=2 * BS, workers=2)
    queues.append(queue)
    disk = Disk({key(i): block(i) for i in range(10)})
    queue.read_back_from(disk.read_back)
    accepted = [queue.offer(key(i), block(i)) for i in range(10)]
    assert accepted == [True, True] + [False] * 8  # the reader never waits
    snap = queue.snapshot()
    assert snap["deferred"] == snap["deferred_now"] == 8 and snap["dropped"] == 0 and snap["depth"] == 10
    tier.go.set()
    assert await queue.drain(10)
    assert set(tier.blocks) == {key(i) for i in range(10)}
    assert all(tier.blocks[key(i)] == block(i) for i in range(10))
    assert disk.reads == [key(i) for i in range(2, 10)]  # oldest first, each once
    assert queue.stats.caught_up == 8 and queue.stats.written == 10 and queue.stats.gone == 0
    assert max(tier.held) <= 2 * BS and queue.queued_bytes() == 0 and queue.depth() == 0


async def test_a_deferred_block_gone_from_disk_is_counted_and_the_rest_still_go_up() -> None:
    tier = InMemoryClusterTier()
    queue = WriteBehind(tier, max_blocks=1, max_bytes=BS, workers=1)
    disk = Disk({key(i): block(i) for i in (0, 1, 3)})  # block 2 evicted before its turn
    queue.read_back_from(disk.read_back)
    for i in range(4):
        queue.offer(key(i), block(i))
    assert await queue.drain(10)
    assert set(tier.blocks) == {key(0), key(1), key(3)}
    assert (queue.stats.deferred, queue.stats.caught_up, queue.stats.gone) == (3, 2, 1)
    assert queue.depth() == 0 and queue.queued_bytes() == 0


async def test_a_deferred_block_another_node_stored_meanwhile_is_not_read_back_or_uploaded() -> None:
    tier = InMemoryClusterTier()
    queue = WriteBehind(tier, max_blocks=1, max_bytes=BS, workers=1)
    disk = Disk({key(i): block(i) for i in range(3)})
    queue.read_back_from(disk.read_back)
    for i in range(3):
        queue.offer(key(i), block(i))
    tier.blocks[key(2)] = b"another node's copy"  # stored before block 2's turn
    assert await queue.drain(10)
    assert disk.reads == [key(1)] and tier.blocks[key(2)] == b"another node's copy"
    assert (queue.stats.caught_up, queue.stats.present, queue.stats.gone, queue.stats.written) == (1, 1, 0, 2)
    assert tier.store_stats.put_requests == 2


async def test_the_deferred_list_is_bounded_and_without_a_read_back_a_full_queue_drops() -> None:
    tier = InMemoryClusterTier()
    bounded = WriteBehind(tier, max_blocks=1, max_bytes=BS, workers=1, max_deferred=2)
    bounded.read_back_from(Disk({key(i): block(i) for i in range(5)}).read_back)
    for i in range(5):
        bounded.offer(key(i), block(i))
    assert (bounded.stats.queued, bounded.stats.deferred, bounded.stats.dropped) == (1, 2, 2)
    assert bounded.stats.dropped_bytes == 2 * BS
    assert await bounded.drain(10) and len(tier.blocks) == 3

    plain = WriteBehind(InMemoryClusterTier(), max_blocks=1, max_bytes=BS, workers=1)
    for i in range(3):
        plain.offer(key(i), block(i))
    assert (plain.stats.queued, plain.stats.deferred, plain.stats.dropped) == (1, 0, 2)
    assert await plain.drain(10)


async def test_a_block_larger_than_the_queue_is_deferred_and_uploaded_alone() -> None:
    """No worker runs when it is offered: deferring it must start one, or drain would never end."""
    tier = InMemoryClusterTier()
    queue = WriteBehind(tier, max_blocks=4, max_bytes=BS // 2, workers=1)
    queue.read_back_from(Disk({key(0): block(0)}).read_back)
    assert not queue.offer(key(0), block(0))
    assert await queue.drain(10)
    assert tier.blocks == {key(0): block(0)} and queue.stats.caught_up == 1


async def test_close_drops_what_is_deferred() -> None:
    queues: list[WriteBehind] = []
    tier = SlowTier(queues)
    queue = WriteBehind(tier, max_blocks=1, max_bytes=BS, workers=1)
    queues.append(queue)
    queue.read_back_from(Disk({key(i): block(i) for i in range(3)}).read_back)
    for i in range(3):
        queue.offer(key(i), block(i))
    await queue.close(0.05)
    assert queue.snapshot()["deferred_now"] == 0 and tier.blocks == {}


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        WriteBehind(InMemoryClusterTier(), max_deferred=-1)
