"""The disk tier's index counts its whole files as entries come and go, whatever the order of sets,
replacements, pops (with and without a default), deletions, popitems and clears: the counts are
always what a walk of the index finds (``/stats`` reads them instead of walking it)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tiering.tiers.wholefile import WHOLE_PREFIX, TierIndex

KEYS = [f"{WHOLE_PREFIX}{i:02d}" for i in range(6)] + [f"{i:064x}" for i in range(6)]
ops = st.lists(st.tuples(st.sampled_from(["set", "pop", "pop_default", "del", "popitem", "clear"]),
                         st.sampled_from(KEYS), st.integers(0, 10_000)), max_size=80)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_whole_file_counts_are_what_a_walk_finds(steps: list[tuple[str, str, int]]) -> None:
    index = TierIndex()
    for op, key, size in steps:
        if op == "set":
            index[key] = (size, 0)
        elif op == "pop" and key in index:
            index.pop(key)
        elif op == "pop_default":
            index.pop(key, None)
        elif op == "del" and key in index:
            del index[key]
        elif op == "popitem" and index:
            index.popitem(last=size % 2 == 0)
        elif op == "clear":
            index.clear()
        whole = [value[0] for k, value in index.items() if k.startswith(WHOLE_PREFIX)]
        assert (index.whole_files, index.whole_bytes) == (len(whole), sum(whole))
