"""Choosing eviction victims: least recently used, unless a ``VictimOrder`` knows the future.

Both tiers keep their blocks in LRU order and ask ``rank_victims`` for the order in which to take
them. Without an order, or while it is inactive (nothing announced), that is the LRU order itself,
at no cost. With an active order the candidates are sorted by next use, farthest first (a stable
sort: blocks with equal distance, those no one announced included, stay least recently used
first). Blocks no one will read come first, then announced blocks, the one needed last first:
Belady's policy over the announced future, LRU over the unknown one.

The ranking costs one ``next_use`` per candidate (~1.3 us each). The disk tier evicts in batches (to
its low watermark), so that is paid once per ~10% of the tier, not per insert; the RAM tier, which
evicts about one block per insert, reuses a ranking for many evictions (``tiering.tiers.ram``).
"""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

from tiering.blocks import BlockKey
from tiering.protocols import VictimOrder

T = TypeVar("T")


def rank_victims(candidates: Sequence[T], order: VictimOrder | None,
                 key_of: Callable[[T], BlockKey | None]) -> tuple[Sequence[T], bool]:
    """``candidates`` (least recently used first) in the order to evict them, and whether an order
    ranked them. ``key_of`` gives a candidate's block key, None when unknown (ranked as never needed)."""
    if order is None or not order.active():
        return candidates, False

    def distance(item: T) -> float:
        key = key_of(item)
        return float("inf") if key is None else order.next_use(key)

    return sorted(candidates, key=distance, reverse=True), True
