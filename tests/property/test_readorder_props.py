"""Eviction under an announced order: an evicted block is never needed sooner than any block kept.

Random orders (several streams, repeated files, files of several blocks), random opens (in order,
skipped, repeated, never announced) and random inserts into a RAM tier ranked by the order. After
every insert that evicted, each evicted block's next use (in the announced order, as it stood)
must be at least every kept block's. A plain model also checks ``next_use`` itself: the blocks a
reader following the order reads before the block.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from tiering.blocks import MIN_BLOCK_SIZE, BlockKey, ObjectRef, block_count
from tiering.tiers.ram import RamTier
from tiering.policy.readorder import ReadOrder

BS = MIN_BLOCK_SIZE
FILES = [ObjectRef(f"f{i}", "e", (i % 3) * BS + 100) for i in range(12)]  # 1 to 3 blocks each
BLOCKS = [BlockKey(r.key, r.etag, i) for r in FILES for i in range(block_count(r.size, BS))]

orders = st.lists(st.lists(st.integers(0, len(FILES) - 1), max_size=20), min_size=1, max_size=3)
steps = st.lists(st.one_of(
    st.tuples(st.just("put"), st.integers(0, len(BLOCKS) - 1)),
    st.tuples(st.just("open"), st.integers(0, len(FILES) - 1)),
), max_size=60)


@settings(max_examples=300, deadline=None)
@given(orders, steps, st.integers(2, 8))
def test_evicted_blocks_are_never_needed_sooner_than_kept_ones(streams: list[list[int]],
                                                               ops: list[tuple[str, int]], capacity: int) -> None:
    order = ReadOrder(BS)
    for n, entries in enumerate(streams):
        if entries:
            order.announce(f"s{n}", [FILES[i] for i in entries])
    ram = RamTier(capacity * BS, victim_order=order)
    for op, arg in ops:
        if op == "open":
            order.opened(FILES[arg], ram.contains)
            continue
        new = BLOCKS[arg]
        before = set(ram.keys()) - {new}
        distance = {k: order.next_use(k) for k in before}
        ram.put(new, b"x" * BS)
        after = set(ram.keys())
        evicted = before - after
        kept = before & after
        for e in evicted:
            assert all(distance[e] >= distance[k] for k in kept), (e, distance)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(FILES) - 1), min_size=1, max_size=30), st.integers(0, 10))
def test_next_use_counts_the_blocks_read_before(entries: list[int], opens: int) -> None:
    order = ReadOrder(BS)
    announced = [FILES[i] for i in entries]
    order.announce("s", announced)
    for ref in announced[:opens]:  # a reader that follows the order
        order.opened(ref, lambda _k: False)
    position = min(opens, len(announced)) - 1 if opens else 0
    for key in BLOCKS:
        # Model: walk the order from the reader's entry; blocks of entries before it were read.
        expected = math.inf
        read = 0
        for ref in announced[position:]:
            if ref.key == key.key:
                expected = read + key.index
                break
            read += block_count(ref.size, BS)
        assert order.next_use(key) == expected


MANY = [ObjectRef(f"m{i}", "e", 100) for i in range(300)]
big_steps = st.lists(st.one_of(
    st.tuples(st.just("put"), st.integers(0, len(MANY) - 1)),
    st.tuples(st.just("get"), st.integers(0, len(MANY) - 1)),
    st.tuples(st.just("open"), st.integers(0, len(MANY) - 1)),
    st.tuples(st.just("discard"), st.integers(0, len(MANY) - 1)),
    st.tuples(st.just("announce"), st.integers(0, len(MANY) - 1)),
), max_size=400)


@settings(max_examples=100, deadline=None)
@given(big_steps, st.integers(64, 120))
def test_a_tier_that_reuses_its_rankings_keeps_its_accounts(ops: list[tuple[str, int]], capacity: int) -> None:
    """A tier large enough to reuse rankings (``RERANK_MIN_BLOCKS``), under puts, reads, discards,
    opens and orders replaced or ended at random: it holds what it counts, within its capacity, and a
    block that is never needed goes before one still needed whenever the ranking can tell."""
    order = ReadOrder(100)
    order.announce("s", MANY[::2])
    ram = RamTier(capacity * 100, victim_order=order)
    for op, arg in ops:
        ref = MANY[arg]
        k = BlockKey(ref.key, ref.etag, 0)
        if op == "put":
            before = set(ram.keys()) - {k}
            ram.put(k, b"x" * 100)
            evicted = before - set(ram.keys())
            kept = set(ram.keys()) - {k}
            if evicted and order.active():
                # Never all of the kept blocks unneeded while an evicted one is needed.
                assert not (all(order.next_use(e) < math.inf for e in evicted)
                            and kept and all(order.next_use(x) == math.inf for x in kept))
        elif op == "get":
            ram.get(k)
        elif op == "open":
            order.opened(ref, ram.contains)
        elif op == "discard":
            ram.discard(k)
        elif arg % 3 == 0:
            order.end("s")
        else:
            order.announce("s", MANY[arg % 7::arg % 5 + 1])
        assert ram.used_bytes() == 100 * len(ram) <= capacity * 100
