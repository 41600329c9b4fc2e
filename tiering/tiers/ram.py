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

Ranked eviction, paid for once per many evictions. Ranking asks the order for every held block's
next use. Once full, the tier evicts about one block per insert, so ranking at every eviction made
each insert cost O(blocks held): measured (``benchmarks.coldfiles``, announced, 100 KiB files, a 64 MiB
tier of ~640 blocks) it was half of the event loop's CPU, 0.61-0.70 ms per cold file against 0.225
with the tier never full; a 1 GiB tier holds ~10,000 such blocks. So a ranking is kept (``_ranked``,
farthest first) and used by the evictions that follow, each of which takes: the block read longest ago
since the ranking (``_read``) if it is not needed now (one ``next_use`` call, exact: nothing kept can
be needed later than never); else, of the ranking's head and the block put last since the ranking
(``_fresh``), one not needed now, or the one used farther while the ranking may still be used as it
stood (``len // RERANK_SHARE`` such takes per ranking); else the head of a new ranking. A tier of
fewer than ``RERANK_MIN_BLOCKS`` blocks never uses a ranking as it stood: exact Belady there, as
cheap as it ever was.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque

from tiering.blocks import BlockData, BlockKey
from tiering.protocols import TierStats, VictimOrder
from tiering.policy.victims import rank_victims

# A ranking serves at most len/RERANK_SHARE evictions of blocks still needed before the tier ranks
# again (module docstring); below RERANK_MIN_BLOCKS blocks it serves none (exact at every eviction).
RERANK_SHARE = 8
RERANK_MIN_BLOCKS = 64


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
        # The last ranking under the victim order, farthest next use first, and how many more of its
        # blocks may be taken without asking the order again (module docstring).
        self._ranked: deque[BlockKey] = deque()
        self._fresh: list[BlockKey] = []  # blocks put since that ranking, in the order put
        self._read: deque[BlockKey] = deque()  # blocks read (hits) since that ranking, in that order
        self._stale_takes = 0

    # -- BlockTier ------------------------------------------------------------------------------

    def get(self, key: BlockKey) -> BlockData | None:
        data = self._blocks.get(key)
        if data is None:
            self.stats.misses += 1
            return None
        self._blocks.move_to_end(key)
        self.stats.hits += 1
        if self._ranked and len(self._read) < len(self._blocks):
            self._read.append(key)
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
        if self._ranked:
            fresh = self._fresh
            fresh.append(key)
            if len(fresh) > 2 * len(self._blocks):  # bounded: the older half is what matters least
                del fresh[:len(fresh) // 2]
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
        if self.victim_order is not None and self.victim_order.active():
            while self._used > target_bytes:
                key = self._next_ranked()
                if key is None:
                    return  # nothing evictable left
                self._evict(key, ordered=True)
            return
        self._ranked.clear()  # rankings only hold while the order is active
        self._fresh.clear()
        self._read.clear()
        victims: list[BlockKey] = []
        remaining = self._used
        for key in self._blocks:
            if remaining <= target_bytes:
                break
            if self._evictable(key):
                victims.append(key)
                remaining -= len(self._blocks[key])
        for key in victims:
            self._evict(key, ordered=False)

    def _next_ranked(self) -> BlockKey | None:
        """The next victim under the active victim order (module docstring): the block read longest
        ago since the last ranking if not needed now; else, of that ranking's head and the block put
        last since, one not needed now, or the farther while the ranking may still be used as it
        stood; else the head of a new ranking."""
        order = self.victim_order
        assert order is not None
        ranked, fresh, read = self._ranked, self._fresh, self._read
        while read and not self._held_evictable(read[0]):
            read.popleft()
        # The block read longest ago since the ranking: once the reader is past it, most often not
        # needed again. One question per eviction; one still needed (the reader may be on it) waits.
        if read and order.next_use(read[0]) == math.inf:
            return read.popleft()
        while ranked and not self._held_evictable(ranked[0]):
            ranked.popleft()  # gone since (replaced, discarded, evicted)
        while fresh and not self._held_evictable(fresh[-1]):
            fresh.pop()
        if ranked:  # (blocks put since a ranking that is used up wait for the next one)
            head = order.next_use(ranked[0])
            last = order.next_use(fresh[-1]) if fresh else -1.0
            # Never needed: exact whatever the ranking's age. Else the farther, a bounded number of times.
            if math.inf in (head, last) or self._stale_takes > 0:
                if math.inf not in (head, last):
                    self._stale_takes -= 1
                return fresh.pop() if last > head else ranked.popleft()
        candidates, _ = rank_victims([k for k in self._blocks if self._evictable(k)], order, lambda k: k)
        self._ranked = ranked = deque(candidates)
        fresh.clear()
        read.clear()
        held = len(self._blocks)
        self._stale_takes = held // RERANK_SHARE if held >= RERANK_MIN_BLOCKS else 0
        return ranked.popleft() if ranked else None

    def _held_evictable(self, key: BlockKey) -> bool:
        return key in self._blocks and self._evictable(key)

    def _evict(self, key: BlockKey, *, ordered: bool) -> None:
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
