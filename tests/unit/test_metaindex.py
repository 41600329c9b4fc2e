"""The on-disk metadata index (cachefs.fs.metaindex) and the listing cache in front of it."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from cachefs.fs.metaindex import INDEX_FILENAME, MetadataIndex
from tests.unit.test_fs import BS, RAM_BYTES, listdir, lookup_path
from cachefs.fs.filesystem import CacheFS
from cachefs.settings import FsSettings
from tiering.engine.blockcache import BlockCache
from tiering.clock import FakeClock
from tiering.errors import ObjectStoreUnavailableError
from tiering.objectstore.memory import FailingObjectStore, InMemoryObjectStore
from tiering.protocols import ObjectInfo
from tiering.tiers.ram import RamTier
from tiering.settings import CacheSettings
from tiering.writeback import MISSING

TTL = 10.0


class Wall:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def info(key: str, size: int = 1, etag: str = "e") -> ObjectInfo:
    return ObjectInfo(key, size, etag, 5.0)


def test_store_load_lookup_and_reopen(tmp_path: Path) -> None:
    wall = Wall()
    index = MetadataIndex(tmp_path / INDEX_FILENAME, wall=wall)
    assert index.store("d", [("a", info("d/a", 3, "x")), ("sub", None)])
    assert index.load("d") == (wall.now, {"a": info("d/a", 3, "x"), "sub": None})
    assert index.lookup("d", "a") == (wall.now, info("d/a", 3, "x"))
    assert index.lookup("d", "nope") == (wall.now, MISSING)
    assert index.lookup("d", "sub") == (wall.now, None)  # a subdirectory: stored, no size
    assert index.lookup("other", "a") is None
    index.store("empty", [])
    assert index.lookup("empty", "a") == (wall.now, MISSING)  # a stored directory with no entries
    index.close()
    again = MetadataIndex(tmp_path / INDEX_FILENAME, wall=wall)
    assert again.total_entries == 2
    assert again.load("d") == (wall.now, {"a": info("d/a", 3, "x"), "sub": None})


def test_capacity_evicts_oldest_directories_whole(tmp_path: Path) -> None:
    wall = Wall()
    index = MetadataIndex(tmp_path / "i.db", max_entries=5, wall=wall)
    index.store("old", [(n, info(f"old/{n}")) for n in "abc"])
    wall.now += 1
    index.store("new", [(n, info(f"new/{n}")) for n in "xyz"])
    assert index.load("old") is None
    assert index.load("new") is not None and index.total_entries == 3
    assert not index.store("huge", [(str(n), None) for n in range(6)])  # larger than the whole index
    assert index.load("huge") is None


def test_patch_forget_and_forget_under(tmp_path: Path) -> None:
    index = MetadataIndex(tmp_path / "i.db", wall=Wall())
    index.store("", [("a", None), ("f", info("f"))])
    index.store("a", [("b", None)])
    index.store("a/b", [("c", info("a/b/c"))])
    index.store("ab", [("x", info("ab/x"))])
    index.patch("", "g", info("g", 9), marker=False)
    index.patch("", "f", None, marker=False)
    assert index.load("")[1] == {"a": None, "g": info("g", 9)}  # type: ignore[index]
    index.forget_under("a")
    assert index.load("a") is None and index.load("a/b") is None
    assert index.load("ab") is not None  # a sibling with a common prefix stays
    assert index.total_entries == 3


def test_a_corrupt_file_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "i.db"
    path.write_bytes(b"this is not an sqlite database" * 100)
    index = MetadataIndex(path, wall=Wall())
    assert index.load("") is None and index.store("", [("a", None)])


def test_crash_in_the_middle_of_an_update_keeps_the_old_listing(tmp_path: Path) -> None:
    """A child process is killed (os._exit) in the middle of replacing a listing: the parent reopens
    the file and finds the old listing, whole."""
    path = tmp_path / "i.db"
    index = MetadataIndex(path, wall=Wall())
    index.store("d", [(f"old{i}", info(f"d/old{i}")) for i in range(100)])
    index.close()
    pid = os.fork()
    if pid == 0:  # the child: die half-way through a 30,000-entry replacement
        try:
            child = MetadataIndex(path, wall=Wall())

            def rows():
                for i in range(30_000):
                    if i == 25_000:
                        os._exit(0)
                    yield f"new{i}", None
            child.store("d", rows())
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    reopened = MetadataIndex(path, wall=Wall())
    loaded = reopened.load("d")
    assert loaded is not None and sorted(loaded[1]) == sorted(f"old{i}" for i in range(100))
    assert reopened.total_entries == 100
    assert sqlite3.connect(path).execute("PRAGMA integrity_check").fetchone()[0] == "ok"


# ---------------------------------------------------------------------- the listing cache over it
def make_fs(store, clock: FakeClock, index: MetadataIndex) -> CacheFS:
    settings = CacheSettings(block_size=BS, ram_bytes=RAM_BYTES)
    cache = BlockCache(settings, store, RamTier(RAM_BYTES), None)
    fs_settings = FsSettings(attr_ttl_s=TTL, dir_ttl_s=TTL, read_only=True)
    return CacheFS(store, cache, fs_settings, clock=clock, index=index)


@pytest.fixture
def store() -> InMemoryObjectStore:
    s = InMemoryObjectStore()
    s.put_object("a.txt", b"abc", mtime=1.0)
    s.put_object("b/c.bin", b"cc", mtime=2.0)
    return s


async def test_a_remount_within_the_ttl_lists_nothing(tmp_path: Path, store: InMemoryObjectStore) -> None:
    wall = Wall()
    first = make_fs(store, FakeClock(), MetadataIndex(tmp_path / "i.db", wall=wall))
    assert set(await listdir(first, 1)) == {"a.txt", "b"}
    await lookup_path(first, "b/c.bin")
    first.listings.index.close()  # type: ignore[union-attr]
    lists = store.stats.list_requests
    wall.now += TTL / 2
    second = make_fs(store, FakeClock(), MetadataIndex(tmp_path / "i.db", wall=wall))
    assert set(await listdir(second, 1)) == {"a.txt", "b"}
    assert (await lookup_path(second, "b/c.bin")).size == 2
    assert store.stats.list_requests == lists
    assert second.stats.index_listings >= 1


async def test_a_warm_open_of_a_file_whose_listing_is_only_in_the_index_queries_it_once(
        tmp_path: Path, store: InMemoryObjectStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a remount the listings are in the index, not in RAM: the first open of a file asks the
    index (a point query) and remembers until when that listing holds; later opens ask nothing."""
    wall = Wall()
    first = make_fs(store, FakeClock(), MetadataIndex(tmp_path / "i.db", wall=wall))
    await lookup_path(first, "b/c.bin")
    first.listings.index.close()  # type: ignore[union-attr]
    wall.now += TTL / 2
    clock = FakeClock()
    second = make_fs(store, clock, MetadataIndex(tmp_path / "i.db", wall=wall))
    c = await lookup_path(second, "b/c.bin")
    second.listings._forget_hot("b")  # the hot set let it go (as it does past its bound): only the index has it
    second.inodes.get(c.inode).fresh_until = 0.0  # what the LOOKUP remembered ran out: the open asks itself
    index = second.listings.index
    assert index is not None
    queries: list[tuple[str, str]] = []
    lookup = index.lookup

    def counted(path: str, name: str) -> object:
        queries.append((path, name))
        return lookup(path, name)

    monkeypatch.setattr(index, "lookup", counted)
    for _ in range(3):
        opened = second.open_now(c.inode, os.O_RDONLY)
        assert opened is not None
        second.release(opened[0])
    assert queries == [("b", "c.bin")]
    wall.now += TTL / 2 + 1  # the stored listing expired (its age is wall time)...
    clock.advance(TTL / 2 + 1)  # ...and so did what the node remembered of it
    assert second.open_now(c.inode, os.O_RDONLY) is None
    assert len(queries) == 2


async def test_a_lookup_answered_from_the_index_serves_the_open_that_follows(
        tmp_path: Path, store: InMemoryObjectStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a remount a file's LOOKUP asks the index and its node remembers until when that listing
    holds, as an open's query does: the OPEN that follows asks nothing (two SQLite queries fewer per
    file of an epoch after a remount)."""
    wall = Wall()
    first = make_fs(store, FakeClock(), MetadataIndex(tmp_path / "i.db", wall=wall))
    await lookup_path(first, "b/c.bin")
    first.listings.index.close()  # type: ignore[union-attr]
    wall.now += TTL / 2
    second = make_fs(store, FakeClock(), MetadataIndex(tmp_path / "i.db", wall=wall))
    b = await lookup_path(second, "b")
    second.listings._forget_hot("b")  # only the index has the listing of b
    index = second.listings.index
    assert index is not None
    queries: list[tuple[str, str]] = []
    lookup = index.lookup

    def counted(path: str, name: str) -> object:
        queries.append((path, name))
        return lookup(path, name)

    monkeypatch.setattr(index, "lookup", counted)
    attrs = second.lookup_now(b.inode, b"c.bin")
    assert attrs is not None and attrs.size == 2
    opened = second.open_now(attrs.inode, os.O_RDONLY)
    assert opened is not None
    assert queries == [("b", "c.bin")]


async def test_after_the_ttl_a_remount_lists_again(tmp_path: Path, store: InMemoryObjectStore) -> None:
    wall = Wall()
    first = make_fs(store, FakeClock(), MetadataIndex(tmp_path / "i.db", wall=wall))
    await listdir(first, 1)
    store.put_object("new.txt", b"n")
    wall.now += TTL + 1
    second = make_fs(store, FakeClock(), MetadataIndex(tmp_path / "i.db", wall=wall))
    lists = store.stats.list_requests
    assert "new.txt" in await listdir(second, 1)
    assert store.stats.list_requests == lists + 1


async def test_an_expired_listing_is_served_stale_when_the_store_is_down(tmp_path: Path, store: InMemoryObjectStore) -> None:
    wall = Wall()
    first = make_fs(store, FakeClock(), MetadataIndex(tmp_path / "i.db", wall=wall))
    await listdir(first, 1)
    wall.now += TTL + 1
    failing = FailingObjectStore(store, fail_lists=True)
    second = make_fs(failing, FakeClock(), MetadataIndex(tmp_path / "i.db", wall=wall))
    assert set(await listdir(second, 1)) == {"a.txt", "b"}
    assert second.stats.stale_listings_served == 1
    with pytest.raises(ObjectStoreUnavailableError):
        await lookup_path(second, "b/c.bin")  # never listed: EIO at the FUSE edge


async def test_a_failing_index_is_a_miss(tmp_path: Path, store: InMemoryObjectStore) -> None:
    index = MetadataIndex(tmp_path / "i.db", wall=Wall())
    index.close()  # every call now raises sqlite3.ProgrammingError
    fs = make_fs(store, FakeClock(), index)
    assert set(await listdir(fs, 1)) == {"a.txt", "b"}
    assert fs.stats.index_errors >= 1


async def test_listings_outlive_only_a_clean_stop_with_nothing_left_to_upload(tmp_path: Path) -> None:
    """A daemon killed mid-write-back leaves listings that may miss what it (or the next daemon,
    replaying its journal before the filesystem is up) uploaded: the next mount lists again."""
    from cachefs.daemon.metadata import _trust_only_a_clean_exit, mark_clean_exit

    path = tmp_path / INDEX_FILENAME
    index = MetadataIndex(path)
    _trust_only_a_clean_exit(index)  # a first mount: nothing stored, nothing to drop
    index.store("d", [("a", info("d/a"))])
    mark_clean_exit(index)  # unmounted cleanly
    index.close()

    index = MetadataIndex(path)
    _trust_only_a_clean_exit(index)
    assert index.load("d") is not None  # trusted after a clean stop
    index.store("d", [("a", info("d/a")), ("b", info("d/b"))])
    index.close()  # ... and this daemon is killed: no clean mark

    index = MetadataIndex(path)
    _trust_only_a_clean_exit(index)
    assert index.load("d") is None and index.total_entries == 0
    index.close()


def test_a_symlink_where_the_index_should_be_is_removed_never_followed(tmp_path: Path) -> None:
    """Issue 28: the daemon's own files are never opened through a symlink; SQLite would follow one."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"")  # SQLite takes an empty file for a new database and writes into it
    (tmp_path / INDEX_FILENAME).symlink_to(victim)
    index = MetadataIndex(tmp_path / INDEX_FILENAME)
    index.close()
    assert victim.read_bytes() == b"" and not (tmp_path / "victim-wal").exists()
    assert not (tmp_path / INDEX_FILENAME).is_symlink() and (tmp_path / INDEX_FILENAME).is_file()
