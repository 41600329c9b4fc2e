"""cachefs.daemon.heap: start-up's objects frozen out of the collector, start-up's garbage collected
first (issue 35: full collections on the loop cost a cold file up to 0.23 ms)."""

from __future__ import annotations

import gc
import weakref
from typing import Iterator

import pytest

from cachefs.daemon.heap import _timed, freeze_startup_heap, heap_stats, time_collections


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """This test process's heap goes back to the collector after each test."""
    gc.unfreeze()
    try:
        yield
    finally:
        gc.unfreeze()


def tracked(obj: object) -> bool:
    """Whether a collection of some generation would visit ``obj`` (frozen objects are in none)."""
    return any(o is obj for o in gc.get_objects())


def test_what_lives_at_start_up_is_frozen_and_what_comes_after_is_not(unfrozen: None) -> None:
    kept = {"model": [1, 2, 3]}
    assert tracked(kept)
    frozen = freeze_startup_heap()
    # Not ==: threads that earlier tests of this worker left running can free frozen objects (their
    # reference counts reach zero) between the two counts; nothing but another freeze adds to it.
    assert 0 < gc.get_freeze_count() <= frozen
    assert frozen > 1000  # the whole heap of this process, not just what the test made
    assert not tracked(kept)  # no later collection visits it
    later = {"task": [4]}
    assert tracked(later)
    assert heap_stats()["gc_frozen_objects"] == frozen


def test_start_up_garbage_is_collected_before_the_freeze(unfrozen: None) -> None:
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: only the collector frees it
    gone = weakref.ref(a)
    del a, b
    gc.disable()  # no collection but the one freeze_startup_heap makes
    try:
        freeze_startup_heap()
    finally:
        gc.enable()
    assert gone() is None  # freed, not frozen for the life of the process


def test_heap_stats_counts_collections_per_generation() -> None:
    before = heap_stats()["gc_collections"]
    gc.collect()
    after = heap_stats()["gc_collections"]
    assert len(before) == len(after) == 3
    assert after[2] == before[2] + 1


def test_the_cpu_time_of_collections_is_counted_by_generation() -> None:
    time_collections()
    time_collections()  # once only
    try:
        assert gc.callbacks.count(_timed) == 1
        junk = [[i] for i in range(200_000)]  # a full collection with something to visit
        gc.disable()  # no collection but the one asked for
        try:
            before = heap_stats()["gc_cpu_s"]
            gc.collect()
            after = heap_stats()["gc_cpu_s"]
        finally:
            gc.enable()
        del junk
        assert after[2] > before[2]
        assert after[0] == before[0] and after[1] == before[1]
    finally:
        gc.callbacks.remove(_timed)


def test_heap_stats_walks_no_generation(unfrozen: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """/stats (and each metrics scrape) reads counters: counting the frozen objects again would walk
    the whole permanent generation on the loop each time."""
    frozen = freeze_startup_heap()

    def walk() -> int:
        raise AssertionError("gc.get_freeze_count() walks every frozen object")

    monkeypatch.setattr(gc, "get_freeze_count", walk)
    assert heap_stats()["gc_frozen_objects"] == frozen
