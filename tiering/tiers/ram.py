"""The RAM tier: a byte-bounded LRU of whole blocks in process memory.

Design
------
Blocks live in an ``OrderedDict`` from ``BlockKey`` to ``bytes``, ordered from least to most
recently used: a hit moves the block to the end, an insert appends it, eviction takes from the
front. That gives O(1) hits, inserts and evictions, and an exact LRU, which is what a read cache in
front of a disk tier wants: the RAM tier holds the working set of the current epoch's read-ahead
windows, and its misses are cheap (the disk tier or a fetch answers them).

The tier is called only from the asyncio event loop, so it takes no lock. A block is ``bytes`` or
the read-only view of the buffer a ranged GET received it into (``tiering.blocks.BlockData``); nothing writes to
one once it is handed out, so a block handed out by ``get`` never changes under a reader, and
nothing is copied.

Capacity is counted in payload bytes (``len(data)``); the Python object overhead (~33 bytes per
``bytes`` plus the dict slot) is negligible next to blocks of 64 KiB and more. Bytes *reserved* for
blocks in flight (``reserve``/``unreserve``, called by ``tiering.engine.inflight.InFlight``) count
as used too: a reservation evicts held blocks to make room at once, so the tier's capacity bounds
the blocks it holds and those being received together.

Eviction goes through one method, ``_evict_until``, which walks the LRU order and takes only blocks
that ``_evictable`` allows. A ``VictimOrder`` passed in (an announced read order) reorders the
candidates while it is active: farthest next use first (``tiering.policy.victims``). Today every held block is evictable (the tier holds clean, re-fetchable
data only); pinning and dirty blocks will plug in there without touching ``put``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from tiering.blocks import BlockData, BlockKey
from tiering.protocols import TierStats, VictimOrder
from tiering.policy.victims import rank_victims


class RamTier:
    """An in-memory LRU of blocks, bounded by ``capacity_bytes`` of payload.

    ``capacity_bytes == 0`` means the tier is disabled: every put is refused.
    """

    def __init__(self, capacity_bytes: int, name: str = "ram", *, victim_order: VictimOrder | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"{name} tier capacity must not be negative, got {capacity_bytes}")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats()
        self.victim_order = victim_order
        self._blocks: OrderedDict[BlockKey, BlockData] = OrderedDict()
        self._used = 0
        self._reserved = 0  # bytes of blocks in flight (reserve), counted against the capacity

    # -- BlockTier ------------------------------------------------------------------------------

    def get(self, key: BlockKey) -> BlockData | None:
        data = self._blocks.get(key)
        if data is None:
            self.stats.misses += 1
            return None
        self._blocks.move_to_end(key)
        self.stats.hits += 1
        return data

    def contains(self, key: BlockKey) -> bool:
        return key in self._blocks

    def absent(self, key: BlockKey) -> bool:
        if key in self._blocks:
            return False
        self.stats.misses += 1
        return True

    def put(self, key: BlockKey, data: BlockData) -> bool:
        # The old version (if any) goes first, even when the new one is refused: a tier never keeps
        # bytes that differ from the last ones offered for a key.
        self._remove(key)
        size = len(data)
        room = self.capacity_bytes - self._reserved
        if self.capacity_bytes == 0 or size > room:
            self.stats.rejected += 1
            return False
        if self._used + size > room:
            self._evict_until(room - size)
            if self._used + size > room:  # not enough evictable blocks
                self.stats.rejected += 1
                return False
        self._blocks[key] = data
        self._used += size
        self.stats.inserts += 1
        return True

    def discard(self, key: BlockKey) -> None:
        self._remove(key)

    def used_bytes(self) -> int:
        return self._used

    def reserve(self, nbytes: int) -> None:
        """Count ``nbytes`` of a block in flight against the capacity, evicting held blocks to make
        room now (as far as they are evictable: a reservation is never refused)."""
        self._reserved += nbytes
        self._evict_until(max(0, self.capacity_bytes - self._reserved))

    def unreserve(self, nbytes: int) -> None:
        """Stop counting ``nbytes`` reserved earlier (the block is now held, or was dropped)."""
        self._reserved = max(0, self._reserved - nbytes)

    def reserved_bytes(self) -> int:
        return self._reserved

    def __len__(self) -> int:
        return len(self._blocks)

    # -- extras ---------------------------------------------------------------------------------

    def keys(self) -> list[BlockKey]:
        """Held keys, least recently used first."""
        return list(self._blocks)

    def __repr__(self) -> str:
        return (f"RamTier(name={self.name!r}, used={self._used}, reserved={self._reserved}, "
                f"capacity={self.capacity_bytes}, blocks={len(self)})")

    # -- eviction -------------------------------------------------------------------------------

    def _evictable(self, key: BlockKey) -> bool:
        """Whether eviction may take ``key``. The hook for pinned and dirty blocks."""
        return True

    def _evict_until(self, target_bytes: int) -> None:
        """Evict least-recently-used evictable blocks until ``used_bytes() <= target_bytes``.

        Stops early, above the target, when nothing evictable is left.
        """
        if self._used <= target_bytes:
            return
        victims: list[BlockKey] = []
        remaining = self._used
        candidates: Sequence[BlockKey] | OrderedDict[BlockKey, BlockData] = self._blocks
        ordered = False
        if self.victim_order is not None and self.victim_order.active():
            candidates, ordered = rank_victims(list(self._blocks), self.victim_order, lambda k: k)
        for key in candidates:
            if remaining <= target_bytes:
                break
            if self._evictable(key):
                victims.append(key)
                remaining -= len(self._blocks[key])
        for key in victims:
            data = self._blocks.pop(key)
            self._used -= len(data)
            self.stats.evictions += 1
            self.stats.evicted_bytes += len(data)
            if ordered:
                self.stats.ordered_evictions += 1

    def _remove(self, key: BlockKey) -> None:
        data = self._blocks.pop(key, None)
        if data is not None:
            self._used -= len(data)
