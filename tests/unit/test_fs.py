"""CacheFS semantics without a mount: inodes, listings with TTLs, handles, versions, stats."""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import os
import stat
from pathlib import Path

import pytest

from cachefs.daemon.stats import stats_document
from cachefs.fs.errors import FsError
from cachefs.fs.filesystem import STATFS_BLOCK_SIZE, Attributes, CacheFS
from cachefs.fs.inodes import ROOT_INODE
from cachefs.mounts import CONTROL_XATTR
from cachefs.settings import FsSettings
from tiering.blocks import MIN_BLOCK_SIZE, BlockKey
from tiering.clock import FakeClock
from tiering.tiers.disk import DiskTier
from tiering.engine.blockcache import BlockCache
from tiering.errors import ObjectChangedError, ObjectStoreUnavailableError
from tiering.objectstore.memory import FailingObjectStore, InMemoryObjectStore, md5_etag
from tiering.tiers.ram import RamTier
from tiering.settings import CacheSettings

BS = MIN_BLOCK_SIZE
TTL = 10.0
MTIME = 1_700_000_000.0
RAM_BYTES = 32 * BS


def make_fs(store, clock: FakeClock, *, disk: DiskTier | None = None, control_path: str | None = None) -> CacheFS:
    """A read-only CacheFS (the read path; writes are in test_fs_writes.py)."""
    settings = CacheSettings(block_size=BS, ram_bytes=RAM_BYTES, readahead_max_bytes=4 * BS)
    cache = BlockCache(settings, store, RamTier(RAM_BYTES), disk)
    fs_settings = FsSettings(attr_ttl_s=TTL, dir_ttl_s=TTL, uid=1234, gid=5678, read_only=True)
    return CacheFS(store, cache, fs_settings, clock=clock, control_path=control_path)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store() -> InMemoryObjectStore:
    s = InMemoryObjectStore()
    s.put_object("a.txt", b"abc", mtime=MTIME)
    s.put_object("b/c.bin", bytes(range(200)), mtime=MTIME + 1)
    s.put_object("b/d/e.bin", b"e" * (2 * BS + 5), mtime=MTIME + 2)
    s.put_object("Zed", b"z", mtime=MTIME + 3)
    return s


@pytest.fixture
def fs(store: InMemoryObjectStore, clock: FakeClock) -> CacheFS:
    return make_fs(store, clock)


async def listdir(fs: CacheFS, inode: int) -> dict[str, Attributes]:
    fh = await fs.opendir(inode)
    try:
        entries = list(fs.readdir(fh, 0))
    finally:
        fs.releasedir(fh)
    names = [e.name.decode("utf-8", "surrogateescape") for e in entries]
    assert names == sorted(names)
    return {name: e.attrs for name, e in zip(names, entries)}


async def lookup_path(fs: CacheFS, path: str) -> Attributes:
    attrs = await fs.getattr(ROOT_INODE)
    for part in path.split("/"):
        attrs = await fs.lookup(attrs.inode, part.encode())
    return attrs


async def walk(fs: CacheFS, inode: int = ROOT_INODE, prefix: str = "") -> list[str]:
    """Every path below ``inode``, depth first."""
    out = []
    for name, attrs in (await listdir(fs, inode)).items():
        out.append(prefix + name)
        if attrs.is_dir:
            out.extend(await walk(fs, attrs.inode, prefix + name + "/"))
    return out


async def read_all(fs: CacheFS, inode: int) -> bytes:
    fh, _ = await fs.open(inode, os.O_RDONLY)
    try:
        return await fs.read(fh, 0, 10 * BS)
    finally:
        fs.release(fh)


def errno_of(info: pytest.ExceptionInfo) -> int:
    return info.value.errno


# ------------------------------------------------------------------------------------------ listings
async def test_readdir_of_root_and_nested_directories(fs: CacheFS) -> None:
    root = await listdir(fs, ROOT_INODE)
    assert list(root) == ["Zed", "a.txt", "b"]  # byte order, as sorted() gives
    a, b, zed = root["a.txt"], root["b"], root["Zed"]
    assert stat.S_ISREG(a.mode) and stat.S_IMODE(a.mode) == 0o444
    assert a.size == 3 and a.mtime_ns == int(MTIME * 1e9) and a.nlink == 1
    assert (a.uid, a.gid) == (1234, 5678)
    assert zed.size == 1 and zed.mtime_ns == int((MTIME + 3) * 1e9)
    assert stat.S_ISDIR(b.mode) and stat.S_IMODE(b.mode) == 0o555 and b.size == 0 and b.nlink == 1  # not counted (see _nlink)
    assert a.attr_timeout == TTL and a.entry_timeout == TTL

    nested = await listdir(fs, b.inode)
    assert list(nested) == ["c.bin", "d"]
    assert nested["c.bin"].size == 200 and nested["c.bin"].mtime_ns == int((MTIME + 1) * 1e9)
    assert nested["d"].is_dir
    deeper = await listdir(fs, nested["d"].inode)
    assert list(deeper) == ["e.bin"] and deeper["e.bin"].size == 2 * BS + 5


async def test_inode_numbers_are_stable_and_shared_by_lookup_and_readdir(fs: CacheFS) -> None:
    root = await listdir(fs, ROOT_INODE)
    again = await listdir(fs, ROOT_INODE)
    assert {n: a.inode for n, a in root.items()} == {n: a.inode for n, a in again.items()}
    assert len({a.inode for a in root.values()} | {ROOT_INODE}) == 4
    assert (await fs.lookup(ROOT_INODE, b"a.txt")).inode == root["a.txt"].inode
    assert (await lookup_path(fs, "b/d/e.bin")).inode == (await lookup_path(fs, "b/d/e.bin")).inode


async def test_root_attributes(fs: CacheFS) -> None:
    attrs = await fs.getattr(ROOT_INODE)
    assert attrs.inode == ROOT_INODE and attrs.is_dir


async def test_directory_markers(clock: FakeClock) -> None:
    store = InMemoryObjectStore()
    store.put_object("empty/", b"")
    store.put_object("marked/", b"")
    store.put_object("marked/f", b"12345")
    fs = make_fs(store, clock)
    root = await listdir(fs, ROOT_INODE)
    assert list(root) == ["empty", "marked"]
    assert root["empty"].is_dir and root["marked"].is_dir
    assert await listdir(fs, root["empty"].inode) == {}
    marked = await listdir(fs, root["marked"].inode)
    assert list(marked) == ["f"] and marked["f"].size == 5
    with pytest.raises(FsError) as info:
        await fs.lookup(root["empty"].inode, b"")
    assert info.value.errno == errno.ENOENT


BAD_KEYS = [
    "x//b",  # empty component
    "y/./b",  # '.'
    "w/../b",  # '..': would escape the directory
    "c" * 256,  # 256-byte name
    "\u00e9" * 128 + "/f",  # 256-byte (UTF-8) directory name
    "nu\x00l",  # NUL
]


async def test_invalid_posix_names_are_skipped_counted_and_warned_once(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="cachefs.names")
    store = InMemoryObjectStore()
    store.put_object("ok", b"fine")
    store.put_object("c" * 255, b"255 bytes is allowed")
    for key in BAD_KEYS:
        store.put_object(key, b"bad")
    fs = make_fs(store, clock)

    paths = await walk(fs)
    # Only valid names are visible; the directories that hold nothing valid are empty.
    assert sorted(paths) == sorted(["ok", "c" * 255, "x", "y", "w"])
    assert all("b" not in p.split("/") and "f" not in p.split("/") for p in paths)
    for parent in ("x", "y", "w"):
        inode = (await fs.lookup(ROOT_INODE, parent.encode())).inode
        for name in (b"", b".", b"b"):
            if name == b".":
                continue  # '.' is the directory itself
            with pytest.raises(FsError) as info:
                await fs.lookup(inode, name)
            assert info.value.errno == errno.ENOENT
    for name in ("c" * 256, "\u00e9" * 128, "nu\x00l"):
        with pytest.raises(FsError):
            await fs.lookup(ROOT_INODE, name.encode())
    assert fs.stats.skipped_keys == 6
    assert stats_document(fs)["filesystem"]["skipped_keys"] == 6
    messages = [r.getMessage() for r in caplog.records if r.name == "cachefs.names"]
    assert len(messages) == 6

    # Listed again after the TTL: still skipped, not warned about or counted again.
    clock.advance(TTL + 1)
    assert sorted(await walk(fs)) == sorted(paths)
    assert fs.stats.skipped_keys == 6
    assert len([r for r in caplog.records if r.name == "cachefs.names"]) == 6


async def test_a_name_that_is_a_file_and_a_directory_prefix_is_a_directory(clock: FakeClock) -> None:
    store = InMemoryObjectStore()
    store.put_object("dup", b"file bytes")
    store.put_object("dup/inner", b"inner")
    fs = make_fs(store, clock)
    root = await listdir(fs, ROOT_INODE)
    assert list(root) == ["dup"] and root["dup"].is_dir
    attrs = await fs.lookup(ROOT_INODE, b"dup")
    assert attrs.is_dir
    assert list(await listdir(fs, attrs.inode)) == ["inner"]
    assert fs.stats.skipped_keys == 1


async def test_concurrent_lookups_in_a_cold_directory_share_one_list(fs: CacheFS, store: InMemoryObjectStore) -> None:
    before = store.stats.list_requests
    results = await asyncio.gather(*(fs.lookup(ROOT_INODE, b"a.txt") for _ in range(10)))
    assert len({r.inode for r in results}) == 1
    assert store.stats.list_requests == before + 1


# ------------------------------------------------------------------------------------------ lookups
async def test_negative_lookup_is_answered_from_the_cached_listing_until_the_ttl(
    fs: CacheFS, store: InMemoryObjectStore, clock: FakeClock
) -> None:
    with pytest.raises(FsError) as info:
        await fs.lookup(ROOT_INODE, b"new.txt")
    assert info.value.errno == errno.ENOENT
    lists = store.stats.list_requests
    store.put_object("new.txt", b"fresh")
    clock.advance(TTL - 1)
    with pytest.raises(FsError) as info:
        await fs.lookup(ROOT_INODE, b"new.txt")
    assert info.value.errno == errno.ENOENT
    assert store.stats.list_requests == lists  # no LIST: the cached listing answered
    clock.advance(2)
    attrs = await fs.lookup(ROOT_INODE, b"new.txt")
    assert attrs.size == 5
    assert store.stats.list_requests == lists + 1


async def test_lookup_in_a_file_is_enotdir(fs: CacheFS) -> None:
    a = await fs.lookup(ROOT_INODE, b"a.txt")
    with pytest.raises(FsError) as info:
        await fs.lookup(a.inode, b"x")
    assert info.value.errno == errno.ENOTDIR
    with pytest.raises(FsError) as info:
        await fs.opendir(a.inode)
    assert info.value.errno == errno.ENOTDIR


async def test_lookup_of_dot_and_dotdot(fs: CacheFS) -> None:
    b = await fs.lookup(ROOT_INODE, b"b")
    d = await fs.lookup(b.inode, b"d")
    assert (await fs.lookup(b.inode, b".")).inode == b.inode
    assert (await fs.lookup(d.inode, b"..")).inode == b.inode
    assert (await fs.lookup(b.inode, b"..")).inode == ROOT_INODE
    assert (await fs.lookup(ROOT_INODE, b"..")).inode == ROOT_INODE
    assert (await fs.lookup(ROOT_INODE, b".")).inode == ROOT_INODE


async def test_lookup_of_unknown_inode_and_undecodable_name(fs: CacheFS) -> None:
    with pytest.raises(FsError) as info:
        await fs.lookup(999_999, b"a.txt")
    assert info.value.errno == errno.ENOENT
    with pytest.raises(FsError) as info:
        await fs.lookup(ROOT_INODE, b"\xff\xfe")
    assert info.value.errno == errno.ENOENT


async def test_getattr_sees_a_new_size_after_the_ttl(fs: CacheFS, store: InMemoryObjectStore, clock: FakeClock) -> None:
    a = await fs.lookup(ROOT_INODE, b"a.txt")
    assert a.size == 3
    store.put_object("a.txt", b"now ten by", mtime=MTIME + 100)
    assert (await fs.getattr(a.inode)).size == 3  # still within the TTL
    clock.advance(TTL + 0.5)
    attrs = await fs.getattr(a.inode)
    assert attrs.inode == a.inode
    assert attrs.size == 10
    assert attrs.mtime_ns == int((MTIME + 100) * 1e9)


async def test_a_file_that_became_a_directory_gets_a_new_inode(
    fs: CacheFS, store: InMemoryObjectStore, clock: FakeClock
) -> None:
    old = await fs.lookup(ROOT_INODE, b"Zed")
    store.delete_object("Zed")
    store.put_object("Zed/inside", b"1")
    clock.advance(TTL + 1)
    new = await fs.lookup(ROOT_INODE, b"Zed")
    assert new.is_dir and new.inode != old.inode


# ------------------------------------------------------------------------------------------ open/read
@pytest.mark.parametrize(
    "flags",
    [os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC, os.O_WRONLY | os.O_APPEND, os.O_RDWR | os.O_CREAT],
)
async def test_open_for_writing_is_erofs(fs: CacheFS, flags: int) -> None:
    a = await fs.lookup(ROOT_INODE, b"a.txt")
    with pytest.raises(FsError) as info:
        await fs.open(a.inode, flags)
    assert info.value.errno == errno.EROFS
    assert stats_document(fs)["filesystem"]["open_handles"] == 0


async def test_open_of_a_directory_is_eisdir(fs: CacheFS) -> None:
    b = await fs.lookup(ROOT_INODE, b"b")
    with pytest.raises(FsError) as info:
        await fs.open(b.inode, os.O_RDONLY)
    assert info.value.errno == errno.EISDIR


async def test_read_returns_the_object_bytes(fs: CacheFS) -> None:
    e = await lookup_path(fs, "b/d/e.bin")
    fh, _ = await fs.open(e.inode, os.O_RDONLY)
    assert await fs.read(fh, 0, 10 * BS) == b"e" * (2 * BS + 5)
    assert await fs.read(fh, 2 * BS, 100) == b"eeeee"
    assert await fs.read(fh, 2 * BS + 5, 100) == b""
    with pytest.raises(FsError) as info:
        await fs.read(fh, -1, 10)
    assert info.value.errno == errno.EINVAL
    fs.release(fh)
    with pytest.raises(FsError) as info:
        await fs.read(fh, 0, 10)
    assert info.value.errno == errno.EBADF


async def test_keep_cache_only_while_the_object_is_unchanged(
    fs: CacheFS, store: InMemoryObjectStore, clock: FakeClock
) -> None:
    a = await fs.lookup(ROOT_INODE, b"a.txt")
    fh1, keep1 = await fs.open(a.inode, os.O_RDONLY)
    assert keep1 is False  # the kernel has nothing cached yet
    assert await fs.read(fh1, 0, 100) == b"abc"
    fs.release(fh1)
    fh2, keep2 = await fs.open(a.inode, os.O_RDONLY)
    assert keep2 is True
    fs.release(fh2)

    store.put_object("a.txt", b"xyz", mtime=MTIME)  # same size, new ETag
    clock.advance(TTL + 1)
    fh3, keep3 = await fs.open(a.inode, os.O_RDONLY)
    assert keep3 is False  # the kernel must drop its pages of the old version
    assert await fs.read(fh3, 0, 100) == b"xyz"
    fs.release(fh3)
    fh4, keep4 = await fs.open(a.inode, os.O_RDONLY)
    assert keep4 is True
    fs.release(fh4)


async def test_a_warm_open_costs_no_lookup_while_its_listing_holds(
    fs: CacheFS, store: InMemoryObjectStore, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node remembers until when the listing that gave its version holds: opens meanwhile ask
    nothing; after that listing expires, or a change that reached the store, they ask again."""
    asked: list[str] = []
    lookup_now = fs.listings.lookup_now

    def counted(path: str, name: str) -> tuple[object, float]:
        asked.append(name)
        return lookup_now(path, name)

    monkeypatch.setattr(fs.listings, "lookup_now", counted)
    a = await fs.lookup(ROOT_INODE, b"a.txt")
    asked.clear()  # (the lookup asked too)
    for _ in range(3):
        opened = fs.open_now(a.inode, os.O_RDONLY)
        assert opened is not None
        fs.release(opened[0])
    assert asked == ["a.txt"]
    clock.advance(TTL / 2)
    fs.listings.forget("")  # a listing dropped early (a rename, an rmdir): the memo goes with it
    assert fs.open_now(a.inode, os.O_RDONLY) is None  # the root must be listed again: wait for it
    fh, _ = await fs.open(a.inode, os.O_RDONLY)
    fs.release(fh)
    store.put_object("a.txt", b"longer now", mtime=MTIME)
    clock.advance(TTL + 1)
    assert fs.open_now(a.inode, os.O_RDONLY) is None  # expired
    fh, keep = await fs.open(a.inode, os.O_RDONLY)
    assert not keep and await fs.read(fh, 0, 100) == b"longer now"
    fs.release(fh)
    with pytest.raises(FsError) as caught:
        fs.open_now(a.inode, os.O_RDONLY | os.O_TRUNC)  # refused at once, as ``open`` does
    assert caught.value.errno == errno.EROFS


async def test_a_handle_keeps_the_version_it_opened(fs: CacheFS, store: InMemoryObjectStore, clock: FakeClock) -> None:
    old = b"o" * (3 * BS)
    new = b"n" * (3 * BS)
    store.put_object("v.bin", old)
    v = await fs.lookup(ROOT_INODE, b"v.bin")
    fh_old, _ = await fs.open(v.inode, os.O_RDONLY)
    assert await fs.read(fh_old, 0, 10) == b"o" * 10  # block 0 cached for the old version

    store.put_object("v.bin", new)
    clock.advance(TTL + 1)
    fh_new, _ = await fs.open(v.inode, os.O_RDONLY)
    assert await fs.read(fh_new, 0, 3 * BS) == new

    # The old handle never sees new bytes: cached old blocks, or ESTALE, never a mix.
    assert await fs.read(fh_old, 5, 10) == b"o" * 10
    with pytest.raises(ObjectChangedError) as info:
        await fs.read(fh_old, 2 * BS, 10)
    assert info.value.errno == errno.ESTALE
    # Block 1 of the old version is cached (read-ahead took it), block 2 is not: a read across
    # both fails as a whole rather than returning old bytes followed by new ones.
    assert fs.cache.is_cached(BlockKey("v.bin", md5_etag(old), 1))
    assert not fs.cache.is_cached(BlockKey("v.bin", md5_etag(old), 2))
    with pytest.raises(ObjectChangedError):
        await fs.read(fh_old, 2 * BS - 5, 10)
    fs.release(fh_old)
    fs.release(fh_new)


async def test_reading_a_deleted_object_is_enoent(fs: CacheFS, store: InMemoryObjectStore) -> None:
    c = await lookup_path(fs, "b/c.bin")
    fh, _ = await fs.open(c.inode, os.O_RDONLY)
    store.delete_object("b/c.bin")
    with pytest.raises(Exception) as info:
        await fs.read(fh, 0, 10)
    assert info.value.errno == errno.ENOENT


# ------------------------------------------------------------------------------------------ forget
async def test_forget_drops_nodes_without_lookups_or_handles(fs: CacheFS) -> None:
    a = await fs.lookup(ROOT_INODE, b"a.txt")
    await fs.lookup(ROOT_INODE, b"a.txt")  # two references
    fs.forget(a.inode, 1)
    assert (await fs.getattr(a.inode)).size == 3
    fs.forget(a.inode, 1)
    with pytest.raises(FsError) as info:
        await fs.getattr(a.inode)
    assert info.value.errno == errno.ENOENT
    # A later lookup brings the name back.
    assert (await fs.lookup(ROOT_INODE, b"a.txt")).size == 3


async def test_forget_keeps_a_node_with_an_open_handle_until_release(fs: CacheFS) -> None:
    a = await fs.lookup(ROOT_INODE, b"a.txt")
    fh, _ = await fs.open(a.inode, os.O_RDONLY)
    inodes = stats_document(fs)["filesystem"]["inodes"]
    fs.forget(a.inode, 1)
    assert (await fs.getattr(a.inode)).size == 3
    assert await fs.read(fh, 0, 3) == b"abc"
    fs.release(fh)
    assert stats_document(fs)["filesystem"]["inodes"] == inodes - 1
    with pytest.raises(FsError):
        await fs.getattr(a.inode)


async def test_forget_never_drops_the_root(fs: CacheFS) -> None:
    fs.forget(ROOT_INODE, 1000)
    fs.forget(424242, 1)  # unknown inodes are ignored
    assert (await fs.getattr(ROOT_INODE)).is_dir
    assert "a.txt" in await listdir(fs, ROOT_INODE)


async def test_readdir_references_are_counted_with_add_lookup(fs: CacheFS) -> None:
    fh = await fs.opendir(ROOT_INODE)
    entries = list(fs.readdir(fh, 0))
    fs.releasedir(fh)
    a = next(e for e in entries if e.name == b"a.txt")
    fs.add_lookup(a.attrs.inode)  # what the adapter does for each entry the kernel took
    fs.forget(a.attrs.inode, 1)
    with pytest.raises(FsError):
        await fs.getattr(a.attrs.inode)


# ------------------------------------------------------------------------------------------ readdir
async def test_readdir_offsets_resume(clock: FakeClock) -> None:
    store = InMemoryObjectStore()
    names = [f"f{i:02d}" for i in range(25)]
    for name in names:
        store.put_object(name, b"x")
    fs = make_fs(store, clock)
    fh = await fs.opendir(ROOT_INODE)
    full = list(fs.readdir(fh, 0))
    assert [e.name.decode() for e in full] == names
    assert [e.next_id for e in full] == list(range(1, 26))
    # Resuming from any entry's next_id gives the rest, as the kernel does between calls.
    for cut in (1, 7, 24):
        assert [e.name for e in fs.readdir(fh, full[cut - 1].next_id)] == [e.name for e in full[cut:]]
    assert list(fs.readdir(fh, 25)) == []
    # A listing change while the handle is open does not shift its offsets.
    store.put_object("a-first", b"x")
    clock.advance(TTL + 1)
    await fs.lookup(ROOT_INODE, b"a-first")  # refreshes the listing
    assert [e.name for e in fs.readdir(fh, 10)] == [e.name for e in full[10:]]
    fs.releasedir(fh)


async def test_readdir_of_a_released_or_wrong_handle_is_ebadf(fs: CacheFS) -> None:
    fh = await fs.opendir(ROOT_INODE)
    fs.releasedir(fh)
    with pytest.raises(FsError) as info:
        fs.readdir(fh, 0)
    assert info.value.errno == errno.EBADF
    with pytest.raises(FsError) as info:
        fs.readdir(987654, 0)
    assert info.value.errno == errno.EBADF
    a = await fs.lookup(ROOT_INODE, b"a.txt")
    file_fh, _ = await fs.open(a.inode, os.O_RDONLY)
    with pytest.raises(FsError) as info:
        fs.readdir(file_fh, 0)
    assert info.value.errno == errno.EBADF
    dir_fh = await fs.opendir(ROOT_INODE)
    with pytest.raises(FsError) as info:
        await fs.read(dir_fh, 0, 10)
    assert info.value.errno == errno.EBADF


async def test_a_100000_entry_directory(clock: FakeClock) -> None:
    store = InMemoryObjectStore()
    n = 100_000
    for i in range(n):
        store.put_object(f"big/img{i:06d}.jpg", b"")
    fs = make_fs(store, clock)
    big = await fs.lookup(ROOT_INODE, b"big")
    fh = await fs.opendir(big.inode)
    inodes_before = stats_document(fs)["filesystem"]["inodes"]

    # The kernel reads a directory a buffer at a time; the adapter stops at a full buffer.
    first_page = list(itertools.islice(fs.readdir(fh, 0), 100))
    assert [e.name for e in first_page[:2]] == [b"img000000.jpg", b"img000001.jpg"]
    # Only what was handed out became inodes: the table follows the kernel, not the bucket.
    assert stats_document(fs)["filesystem"]["inodes"] <= inodes_before + 101

    names: list[bytes] = []
    position = 0
    while True:
        page = list(itertools.islice(fs.readdir(fh, position), 4096))
        if not page:
            break
        names.extend(e.name for e in page)
        position = page[-1].next_id
    fs.releasedir(fh)
    assert len(names) == n
    assert names[0] == b"img000000.jpg" and names[54321] == b"img054321.jpg" and names[-1] == b"img099999.jpg"
    assert len(set(names)) == n
    assert store.stats.list_requests == 2  # root, then big/ once
    assert (await fs.lookup(big.inode, b"img077777.jpg")).size == 0
    with pytest.raises(FsError):
        await fs.lookup(big.inode, b"img100000.jpg")


# ------------------------------------------------------------------------------------------ outages
async def test_an_expired_listing_is_served_while_the_store_is_unreachable(clock: FakeClock) -> None:
    inner = InMemoryObjectStore()
    inner.put_object("a.txt", b"abc")
    inner.put_object("sub/x", b"x")
    store = FailingObjectStore(inner)
    fs = make_fs(store, clock)
    assert list(await listdir(fs, ROOT_INODE)) == ["a.txt", "sub"]
    a = await fs.lookup(ROOT_INODE, b"a.txt")
    assert await read_all(fs, a.inode) == b"abc"

    store.fail_lists = True
    store.fail_gets = True
    clock.advance(TTL + 1)
    assert list(await listdir(fs, ROOT_INODE)) == ["a.txt", "sub"]
    assert (await fs.lookup(ROOT_INODE, b"a.txt")).size == 3
    assert (await fs.getattr(a.inode)).size == 3
    assert await read_all(fs, a.inode) == b"abc"  # cached data keeps flowing
    assert fs.stats.stale_listings_served >= 1
    assert fs.stats.listing_errors >= 1

    # Nothing cached for sub/: the outage shows.
    sub = await fs.lookup(ROOT_INODE, b"sub")
    with pytest.raises(ObjectStoreUnavailableError):
        await fs.opendir(sub.inode)
    with pytest.raises(ObjectStoreUnavailableError):
        await fs.lookup(sub.inode, b"x")

    store.fail_lists = False
    assert list(await listdir(fs, sub.inode)) == ["x"]


async def test_nothing_cached_and_the_store_unreachable_raises(clock: FakeClock) -> None:
    inner = InMemoryObjectStore()
    inner.put_object("a.txt", b"abc")
    fs = make_fs(FailingObjectStore(inner, fail_lists=True), clock)
    with pytest.raises(ObjectStoreUnavailableError) as info:
        await fs.opendir(ROOT_INODE)
    assert info.value.errno == errno.EIO
    with pytest.raises(ObjectStoreUnavailableError):
        await fs.lookup(ROOT_INODE, b"a.txt")


# ------------------------------------------------------------------------------------------ statfs, xattrs, stats
async def test_statfs_without_a_disk_tier_reports_the_ram_tier(fs: CacheFS) -> None:
    st = fs.statfs()
    assert st.block_size == STATFS_BLOCK_SIZE
    assert st.blocks == RAM_BYTES // STATFS_BLOCK_SIZE
    assert st.blocks_free == st.blocks
    assert st.name_max == 255
    await read_all(fs, (await lookup_path(fs, "b/d/e.bin")).inode)
    used = fs.cache.ram.used_bytes()
    assert used == 2 * BS + 5
    st = fs.statfs()
    assert st.blocks_free == (RAM_BYTES - used) // STATFS_BLOCK_SIZE
    assert 0 <= st.blocks_free < st.blocks
    assert st.files == stats_document(fs)["filesystem"]["inodes"]


async def test_statfs_with_a_disk_tier_reports_the_disk(store: InMemoryObjectStore, clock: FakeClock, tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 64 * BS)
    fs = make_fs(store, clock, disk=disk)
    assert fs.statfs().blocks == 64 * BS // STATFS_BLOCK_SIZE
    await read_all(fs, (await lookup_path(fs, "b/d/e.bin")).inode)
    await fs.cache.close()
    assert disk.used_bytes() > 2 * BS
    st = fs.statfs()
    assert st.blocks_free == (64 * BS - disk.used_bytes()) // STATFS_BLOCK_SIZE


async def test_control_xattr_only_on_the_root(store: InMemoryObjectStore, clock: FakeClock) -> None:
    fs = make_fs(store, clock, control_path="/run/cachefs/ctl.sock")
    name = CONTROL_XATTR.encode()
    assert fs.getxattr(ROOT_INODE, name) == b"/run/cachefs/ctl.sock"
    assert fs.listxattr(ROOT_INODE) == [name]
    a = await fs.lookup(ROOT_INODE, b"a.txt")
    for inode, attr in [(a.inode, name), (ROOT_INODE, b"user.other")]:
        with pytest.raises(FsError) as info:
            fs.getxattr(inode, attr)
        assert info.value.errno == errno.ENODATA
    assert fs.listxattr(a.inode) == []
    plain = make_fs(store, clock)
    with pytest.raises(FsError) as info:
        plain.getxattr(ROOT_INODE, name)
    assert info.value.errno == errno.ENODATA


async def test_writes_are_refused(fs: CacheFS) -> None:
    with pytest.raises(FsError) as info:
        fs.refuse_write()
    assert info.value.errno == errno.EROFS


async def test_stats_document_keys_and_counts(store: InMemoryObjectStore, clock: FakeClock, tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 64 * BS)
    fs = make_fs(store, clock, disk=disk)
    snap = stats_document(fs)
    for tier in ("ram", "disk"):
        assert set(snap["tiers"][tier]) >= {"used_bytes", "capacity_bytes", "hits", "misses"}
        assert snap["tiers"][tier]["used_bytes"] == snap["tiers"][tier]["hits"] == snap["tiers"][tier]["misses"] == 0
    assert snap["tiers"]["ram"]["capacity_bytes"] == RAM_BYTES
    assert snap["tiers"]["disk"]["capacity_bytes"] == 64 * BS
    assert snap["object_store"]["requests"] == 0 and snap["object_store"]["bytes_read"] == 0
    assert snap["hit_ratio"] == 0

    e = await lookup_path(fs, "b/d/e.bin")  # three LISTs
    assert await read_all(fs, e.inode) == b"e" * (2 * BS + 5)  # three blocks: RAM and disk miss, GET
    await fs.cache.close()
    snap = stats_document(fs)
    assert snap["tiers"]["ram"]["misses"] == 3 and snap["tiers"]["ram"]["hits"] == 0
    assert snap["tiers"]["disk"]["misses"] == 3
    assert snap["tiers"]["ram"]["used_bytes"] == 2 * BS + 5
    assert snap["tiers"]["disk"]["used_bytes"] > 2 * BS + 5  # plus headers
    assert snap["object_store"]["requests"] == 3 + 3
    assert snap["object_store"]["bytes_read"] == 2 * BS + 5
    assert snap["hit_ratio"] == 0

    assert await read_all(fs, e.inode) == b"e" * (2 * BS + 5)
    snap = stats_document(fs)
    assert snap["tiers"]["ram"]["hits"] == 3
    assert snap["object_store"]["requests"] == 6
    assert snap["hit_ratio"] == 0.5
    assert snap["filesystem"]["opens"] == 2 and snap["filesystem"]["reads"] == 2
    assert snap["filesystem"]["read_bytes"] == 2 * (2 * BS + 5)
    assert snap["blocks"]["fetched"] == 3 and snap["blocks"]["ram_served"] == 3


async def test_a_cancelled_lookup_does_not_cancel_the_shared_listing(store: InMemoryObjectStore, clock: FakeClock) -> None:
    slow = FailingObjectStore(store, delay_s=0.05)
    fs = make_fs(slow, clock)
    first = asyncio.ensure_future(fs.lookup(ROOT_INODE, b"a.txt"))
    await asyncio.sleep(0.01)  # the first lookup has started the LIST
    second = asyncio.ensure_future(fs.lookup(ROOT_INODE, b"Zed"))
    await asyncio.sleep(0.01)  # the second one waits on the same LIST
    first.cancel()
    attrs = await second
    assert attrs.size == 1
    assert store.stats.list_requests == 1
