"""Choosing eviction victims: least recently used, unless a ``VictimOrder`` knows the future.

Both tiers keep their blocks in LRU order and ask ``rank_victims`` for the order in which to take
them. Without an order, or while it is inactive (nothing announced), that is the LRU order itself,
at no cost. With an active order the candidates are sorted by next use, farthest first (a stable
sort: blocks with equal distance, those no one announced included, stay least recently used
first). Blocks no one will read come first, then announced blocks, the one needed last first:
Belady's policy over the announced future, LRU over the unknown one.

The ranking costs one ``next_use`` per candidate (~1.3 us each). The disk tier evicts in batches (to
its low watermark, ~10% of the tier) and walks the candidates with ``victims_in_order``, which stops
asking once the batch is taken from blocks no one needs (exact: those come first in any ranking), so
a tier of a million blocks is not ranked whole for every batch; the RAM tier, which evicts about one
block per insert, reuses a ranking for many evictions (``tiering.tiers.ram``).
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

from tiering.blocks import BlockKey
from tiering.protocols import VictimOrder

T = TypeVar("T")


def rank_victims(candidates: Sequence[T], order: VictimOrder | None,
                 key_of: Callable[[T], BlockKey | None]) -> tuple[Sequence[T], bool]:
    """``candidates`` (least recently used first) in the order to evict them, and whether an order
    ranked them. ``key_of`` gives a candidate's block key, None when unknown (ranked as never needed)."""
    if order is None or not order.active():
        return candidates, False
    return list(_ranked(candidates, order, key_of)), True


def victims_in_order(candidates: Iterable[T], order: VictimOrder | None,
                     key_of: Callable[[T], BlockKey | None]) -> tuple[Iterator[T], bool]:
    """``rank_victims``'s order, yielded as it is found: a caller that stops once it has taken enough
    asks ``next_use`` only of the candidates it walked past, as long as the blocks not needed (which
    come first, least recently used first) suffice. The candidates must not change meanwhile."""
    if order is None or not order.active():
        return iter(candidates), False
    return _ranked(candidates, order, key_of), True


def _ranked(candidates: Iterable[T], order: VictimOrder,
            key_of: Callable[[T], BlockKey | None]) -> Iterator[T]:
    """Blocks never needed in their order, then the others by next use, farthest first (ties in
    their order): what a stable sort by distance, farthest first, gives."""
    needed: list[tuple[float, int, T]] = []
    for n, item in enumerate(candidates):
        key = key_of(item)
        distance = math.inf if key is None else order.next_use(key)
        if distance == math.inf:
            yield item
        else:
            needed.append((-distance, n, item))
    needed.sort(key=lambda entry: (entry[0], entry[1]))
    for _, _, item in needed:
        yield item
