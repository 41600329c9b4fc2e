"""The metadata index against plain-dict models (hypothesis state machines).

``IndexMachine``: the index itself (store, patch, forget, forget_under, capacity eviction, reopen,
and a crash in the middle of replacing a listing) against a dict of directory -> (time, entries).
``ListingTtlMachine``: the listing cache over the index and an in-memory bucket, with a fake clock
and remounts: a directory shows the listing fetched last while it is younger than the TTL, and the
bucket as it is now once older (counted in LISTs), whether or not the mount was remounted between.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from cachefs.fs.inodes import InodeTable
from cachefs.fs.listings import ListingCache, _patch_entries
from cachefs.fs.metaindex import MetadataIndex
from cachefs.fs.stats import FsStats
from cachefs.settings import FsSettings
from tiering.clock import FakeClock
from tiering.objectstore.memory import InMemoryObjectStore
from tiering.protocols import ObjectInfo

DIRS = ["", "a", "a/b", "ab", "c"]
NAMES = ["x", "y", "z", "w"]
CAPACITY = 8
TTL = 10


class Crash(Exception):
    pass


class Wall:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _info(path: str, name: str, size: int) -> ObjectInfo:
    key = f"{path}/{name}" if path else name
    return ObjectInfo(key, size, f"etag{size}", 0.0)


entry_lists = st.dictionaries(st.sampled_from(NAMES), st.one_of(st.none(), st.integers(0, 3)), max_size=4)


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="metaindex-"))
        self.wall = Wall()
        self.index = MetadataIndex(self.tmp / "i.db", max_entries=CAPACITY, wall=self.wall)
        self.model: dict[str, tuple[float, dict[str, ObjectInfo | None]]] = {}

    def teardown(self) -> None:
        self.index.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _entries(self, path: str, spec: dict[str, int | None]) -> dict[str, ObjectInfo | None]:
        return {n: None if s is None else _info(path, n, s) for n, s in spec.items()}

    @rule(path=st.sampled_from(DIRS), spec=entry_lists)
    def store(self, path: str, spec: dict[str, int | None]) -> None:
        self.wall.now += 1  # listings are dated apart, so "oldest first" is one order
        entries = self._entries(path, spec)
        stored = self.index.store(path, list(entries.items()))
        self.model.pop(path, None)
        if len(entries) > CAPACITY:
            assert not stored
            return
        assert stored
        self.model[path] = (self.wall.now, entries)
        total = sum(len(e) for _, e in self.model.values())
        for victim, _ in sorted(((p, t) for p, (t, _) in self.model.items() if p != path), key=lambda pt: pt[1]):
            if total <= CAPACITY:
                break
            total -= len(self.model.pop(victim)[1])

    @rule(path=st.sampled_from(DIRS), spec=entry_lists, at=st.integers(0, 4))
    def crash_mid_store(self, path: str, spec: dict[str, int | None], at: int) -> None:
        """The update dies half-way (the iterator raises); the process is gone without closing: a new
        index is opened on the same file and must hold what it held before."""
        items = list(self._entries(path, spec).items())

        def rows():
            for i, item in enumerate(items):
                if i == at:
                    raise Crash()
                yield item
            raise Crash()

        try:
            self.index.store(path, rows())
        except Crash:
            pass
        self.index = MetadataIndex(self.tmp / "i.db", max_entries=CAPACITY, wall=self.wall)  # the old one is abandoned

    @rule(path=st.sampled_from(DIRS), name=st.sampled_from(NAMES), size=st.one_of(st.none(), st.integers(0, 3)),
          marker=st.booleans())
    def patch(self, path: str, name: str, size: int | None, marker: bool) -> None:
        info = None if size is None else _info(path, name, size)
        self.index.patch(path, name, info, marker)
        if path in self.model:
            _patch_entries(self.model[path][1], name, info, marker)
            # A listing that grew past the capacity makes room as a store does (oldest first), and
            # is dropped itself if it alone is over it.
            total = sum(len(e) for _, e in self.model.values())
            for victim, _ in sorted(((p, t) for p, (t, _) in self.model.items() if p != path), key=lambda pt: pt[1]):
                if total <= CAPACITY:
                    break
                total -= len(self.model.pop(victim)[1])
            if total > CAPACITY:
                del self.model[path]

    @rule(path=st.sampled_from(DIRS))
    def forget(self, path: str) -> None:
        self.index.forget(path)
        self.model.pop(path, None)

    @rule(path=st.sampled_from(DIRS))
    def forget_under(self, path: str) -> None:
        self.index.forget_under(path)
        for p in list(self.model):
            if path == "" or p == path or p.startswith(path + "/"):
                del self.model[p]

    @rule()
    def reopen(self) -> None:
        self.index.close()
        self.index = MetadataIndex(self.tmp / "i.db", max_entries=CAPACITY, wall=self.wall)

    @invariant()
    def matches_the_model(self) -> None:
        for path in DIRS:
            loaded = self.index.load(path)
            expected = self.model.get(path)
            assert loaded == expected, (path, loaded, expected)
            for name in NAMES:
                hit = self.index.lookup(path, name)
                if expected is None:
                    assert hit is None
                else:
                    assert hit is not None and hit[0] == expected[0]
                    assert (hit[1] if name in expected[1] else None) == expected[1].get(name)
        assert self.index.total_entries == sum(len(e) for _, e in self.model.values())
        assert self.index.total_entries <= CAPACITY


class ListingTtlMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="metattl-"))
        self.loop = asyncio.new_event_loop()
        self.store = InMemoryObjectStore()
        self.wall = Wall()
        self.clock = FakeClock()
        self.fetched: dict[str, tuple[float, set[str]]] = {}  # dir -> (wall time listed, names seen)
        self._mount()

    def _mount(self) -> None:
        self.index = MetadataIndex(self.tmp / "i.db", wall=self.wall)
        self.cache = ListingCache(self.store, self.clock, FsSettings(dir_ttl_s=TTL, attr_ttl_s=TTL),
                                  InodeTable(0.0), FsStats(), index=self.index)

    def teardown(self) -> None:
        self.index.close()
        self.loop.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _bucket(self, path: str) -> set[str]:
        prefix = path + "/" if path else ""
        return {k[len(prefix):].split("/")[0] for k in self.keys if k.startswith(prefix)}

    @initialize()
    def seed(self) -> None:
        self.store.put_object("a/x", b"1")
        self.keys = {"a/x"}

    @rule(path=st.sampled_from(["", "a"]), name=st.sampled_from(NAMES))
    def put(self, path: str, name: str) -> None:
        key = f"{path}/{name}" if path else name
        if key == "a":
            return  # "a" is a directory
        self.store.put_object(key, b"data")
        self.keys.add(key)

    @rule(seconds=st.integers(1, 7))
    def advance(self, seconds: int) -> None:
        self.wall.now += seconds
        self.clock.advance(seconds)

    @rule()
    def remount(self) -> None:
        self.index.close()
        self._mount()

    @rule(path=st.sampled_from(["", "a"]))
    def list_dir(self, path: str) -> None:
        lists = self.store.stats.list_requests
        names = set(self.loop.run_until_complete(self.cache.entries(path)))
        seen = self.fetched.get(path)
        if seen is not None and self.wall.now - seen[0] < TTL:
            assert names == seen[1], "a listing younger than the TTL is served as fetched"
            assert self.store.stats.list_requests == lists, "... without a LIST, also after a remount"
        else:
            assert names == self._bucket(path), "an older one is listed again"
            assert self.store.stats.list_requests == lists + 1
            self.fetched[path] = (self.wall.now, names)


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestListingTtlMachine = ListingTtlMachine.TestCase
TestListingTtlMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
