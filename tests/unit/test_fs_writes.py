"""CacheFS write semantics without a mount: create, write, truncate, unlink, mkdir/rmdir, rename,
read-after-write, listings overlaid with pending changes, keep_cache, status; over the in-memory store
with a real disk tier as the staging budget and write-back engine."""

from __future__ import annotations

import asyncio
import errno
import os
import stat
from pathlib import Path

import pytest

from cachefs.daemon.stats import stats_document
from cachefs.daemon.writeback import path_status
from cachefs.fs.errors import FsError
from cachefs.fs.filesystem import CacheFS
from cachefs.fs.inodes import ROOT_INODE
from cachefs.fs.rename import RENAME_EXCHANGE, RENAME_NOREPLACE
from cachefs.settings import FsSettings
from tiering.blocks import MIN_BLOCK_SIZE
from tiering.clock import FakeClock
from tiering.tiers.disk import DiskTier
from tiering.engine.blockcache import BlockCache
from tiering.objectstore.memory import FailingObjectStore, InMemoryObjectStore
from tiering.tiers.ram import RamTier
from tiering.settings import CacheSettings
from tiering.writeback import WriteBack, WriteBackSettings

BS = MIN_BLOCK_SIZE
TTL = 10.0
MiB = 1024 * 1024
W = os.O_WRONLY
RW = os.O_RDWR


class Env:
    def __init__(self, tmp: Path, *, store: InMemoryObjectStore | None = None, rename_dir_limit: int = 100,
                 upload_delay_s: float = 0.0, read_only: bool = False) -> None:
        self.inner = store or InMemoryObjectStore()
        self.store = FailingObjectStore(self.inner)
        self.clock = FakeClock()
        settings = CacheSettings(block_size=BS, ram_bytes=32 * BS, readahead_max_bytes=4 * BS)
        self.disk = DiskTier(tmp / "cache", 64 * MiB)
        self.cache = BlockCache(settings, self.store, RamTier(32 * BS), self.disk)
        self.fs = CacheFS(self.store, self.cache, FsSettings(attr_ttl_s=TTL, dir_ttl_s=TTL, uid=1, gid=2,
                                                             read_only=read_only, rename_dir_limit=rename_dir_limit),
                          clock=self.clock)
        self.wb: WriteBack | None = None
        if not read_only:
            self.wb = WriteBack(WriteBackSettings(upload_delay_s=upload_delay_s, space_wait_s=0.5),
                                tmp / "cache" / "staging", self.store, self.cache, self.disk)
            self.fs.attach_writeback(self.wb)

    async def flush(self) -> None:
        assert self.wb is not None
        report = await self.wb.flush(5)
        assert report.ok, report.pending

    def obj(self, key: str) -> bytes:
        return self.inner._objects[key].data

    def keys(self) -> list[str]:
        return self.inner.keys()


@pytest.fixture
async def env(tmp_path: Path):
    e = Env(tmp_path)
    e.inner.put_object("a.txt", b"abc", mtime=1_700_000_000)
    e.inner.put_object("d/x.bin", bytes(range(256)) * 100, mtime=1_700_000_001)
    e.inner.put_object("d/sub/y", b"y", mtime=1_700_000_002)
    await e.wb.start()
    try:
        yield e
    finally:
        await e.wb.stop()


async def lookup(fs: CacheFS, path: str):
    attrs = await fs.getattr(ROOT_INODE)
    for part in path.split("/"):
        attrs = await fs.lookup(attrs.inode, part.encode())
    return attrs


async def names(fs: CacheFS, path: str = "") -> dict[str, object]:
    inode = ROOT_INODE if not path else (await lookup(fs, path)).inode
    fh = await fs.opendir(inode)
    try:
        return {e.name.decode(): e.attrs for e in fs.readdir(fh, 0)}
    finally:
        fs.releasedir(fh)


async def create(fs: CacheFS, path: str, data: bytes = b"", *, close: bool = True) -> int:
    parent, _, name = path.rpartition("/")
    inode = ROOT_INODE if not parent else (await lookup(fs, parent)).inode
    fh, keep, attrs = await fs.create(inode, name.encode(), 0o644, os.O_WRONLY | os.O_CREAT)
    assert not keep and stat.S_IMODE(attrs.mode) == 0o644
    if data:
        assert await fs.write(fh, 0, data) == len(data)
    if close:
        await fs.flush(fh)
        fs.release(fh)
    return fh


async def read_path(fs: CacheFS, path: str) -> bytes:
    attrs = await lookup(fs, path)
    fh, _ = await fs.open(attrs.inode, os.O_RDONLY)
    try:
        return await fs.read(fh, 0, attrs.size + 100)
    finally:
        fs.release(fh)


def errno_of(call_info: pytest.ExceptionInfo) -> int:
    return call_info.value.errno


# ------------------------------------------------------------------------------------------ files
async def test_create_write_read_back_and_upload(env: Env) -> None:
    fs = env.fs
    await create(fs, "new.bin", b"hello world")
    attrs = await lookup(fs, "new.bin")
    assert attrs.size == 11 and stat.S_IMODE(attrs.mode) == 0o644
    assert await read_path(fs, "new.bin") == b"hello world"
    assert "new.bin" in await names(fs)
    await env.flush()
    assert env.obj("new.bin") == b"hello world"
    assert await read_path(fs, "new.bin") == b"hello world"  # after upload: from the store version
    assert stats_document(fs)["writeback"]["files_uploaded"] == 1
    uploaded = stats_document(fs)["traffic"]["source"]  # what the source was sent (issue 26)
    assert uploaded["upload_requests"] == 1 and uploaded["uploaded_bytes"] == 11


async def test_random_writes_into_an_object_from_the_store(env: Env) -> None:
    fs = env.fs
    original = env.obj("d/x.bin")
    attrs = await lookup(fs, "d/x.bin")
    fh, _ = await fs.open(attrs.inode, RW)
    await fs.write(fh, 1000, b"XYZ")
    await fs.write(fh, len(original), b"tail")  # append
    expected = original[:1000] + b"XYZ" + original[1003:] + b"tail"
    assert await fs.read(fh, 0, 1 << 20) == expected
    assert (await fs.getattr(attrs.inode)).size == len(expected)
    await fs.flush(fh)
    fs.release(fh)
    await env.flush()
    assert env.obj("d/x.bin") == expected


async def test_open_with_o_trunc_needs_nothing_from_the_store(env: Env) -> None:
    env.store.fail_gets = True
    attrs = await lookup(env.fs, "a.txt")
    fh, _ = await env.fs.open(attrs.inode, W | os.O_TRUNC)
    assert (await env.fs.getattr(attrs.inode)).size == 0
    await env.fs.write(fh, 0, b"replaced")
    await env.fs.flush(fh)
    env.fs.release(fh)
    await env.flush()
    assert env.obj("a.txt") == b"replaced"


async def test_truncate_by_path_and_by_handle(env: Env) -> None:
    fs = env.fs
    attrs = await lookup(fs, "d/x.bin")
    size = attrs.size
    await fs.setattr(attrs.inode, size=100)  # truncate(2): acknowledged at once
    assert (await fs.getattr(attrs.inode)).size == 100
    await env.flush()
    assert env.obj("d/x.bin") == (bytes(range(256)) * 100)[:100]
    fh, _ = await fs.open(attrs.inode, RW)
    await fs.setattr(attrs.inode, size=200, fh=fh)  # ftruncate: zeros past the old end
    assert await fs.read(fh, 0, 1000) == (bytes(range(256)) * 100)[:100] + b"\0" * 100
    await fs.flush(fh)
    fs.release(fh)
    await env.flush()
    assert len(env.obj("d/x.bin")) == 200 and size != 200


async def test_a_reader_opened_before_a_write_sees_it(env: Env) -> None:
    fs = env.fs
    attrs = await lookup(fs, "a.txt")
    reader, _ = await fs.open(attrs.inode, os.O_RDONLY)
    assert await fs.read(reader, 0, 10) == b"abc"
    writer, _ = await fs.open(attrs.inode, W)
    await fs.write(writer, 0, b"XY")
    assert await fs.read(reader, 0, 10) == b"XYc"
    await fs.flush(writer)
    fs.release(writer)
    await env.flush()
    assert await fs.read(reader, 0, 10) == b"XYc"  # after the upload: the new version, never the old
    fs.release(reader)


async def test_keep_cache_is_never_given_for_staged_data(env: Env) -> None:
    fs = env.fs
    attrs = await lookup(fs, "a.txt")
    for expected in (False, True):
        fh, keep = await fs.open(attrs.inode, os.O_RDONLY)
        assert keep is expected
        fs.release(fh)
    fh, keep = await fs.open(attrs.inode, W)  # the kernel's pages are of this version: they may stay
    await fs.write(fh, 0, b"new")
    await fs.flush(fh)
    fs.release(fh)
    fh, keep = await fs.open(attrs.inode, os.O_RDONLY)
    assert keep is False  # staged
    fs.release(fh)
    await env.flush()
    await asyncio.sleep(0.05)
    fh, keep = await fs.open(attrs.inode, os.O_RDONLY)
    assert keep is False  # a new store version: the kernel's pages are dropped
    assert await fs.read(fh, 0, 10) == b"new"
    fs.release(fh)
    fh, keep = await fs.open(attrs.inode, os.O_RDONLY)
    assert keep is True
    fs.release(fh)


async def test_uploaded_file_is_cached_as_clean_blocks(env: Env) -> None:
    await create(env.fs, "cached.bin", os.urandom(3 * BS))
    await env.flush()
    await asyncio.sleep(0.1)
    gets = env.inner.stats.get_requests
    data = await read_path(env.fs, "cached.bin")
    assert data == env.obj("cached.bin")
    assert env.inner.stats.get_requests == gets  # served by the disk tier, under the new ETag
    assert env.wb.stats_snapshot()["cached_after_upload_bytes"] == 3 * BS


async def test_create_exclusive_and_over_a_directory(env: Env) -> None:
    fs = env.fs
    with pytest.raises(FsError) as info:
        await fs.create(ROOT_INODE, b"a.txt", 0o644, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    assert errno_of(info) == errno.EEXIST
    with pytest.raises(FsError) as info:
        await fs.create(ROOT_INODE, b"d", 0o644, os.O_WRONLY | os.O_CREAT)
    assert errno_of(info) == errno.EISDIR
    with pytest.raises(FsError) as info:
        await fs.create(ROOT_INODE, b"\xff\xfe", 0o644, os.O_WRONLY | os.O_CREAT)
    assert errno_of(info) == errno.EINVAL
    fh, _, attrs = await fs.create(ROOT_INODE, b"a.txt", 0o644, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    assert attrs.size == 0
    fs.release(fh)


async def test_writes_through_a_read_only_handle_are_refused(env: Env) -> None:
    attrs = await lookup(env.fs, "a.txt")
    fh, _ = await env.fs.open(attrs.inode, os.O_RDONLY)
    with pytest.raises(FsError) as info:
        await env.fs.write(fh, 0, b"x")
    assert errno_of(info) == errno.EBADF
    env.fs.release(fh)


# ------------------------------------------------------------------------------------------ namespace
async def test_unlink_hides_at_once_and_deletes_in_the_store(env: Env) -> None:
    fs = env.fs
    d = await lookup(fs, "d")
    await fs.unlink(d.inode, b"x.bin")
    with pytest.raises(FsError) as info:
        await lookup(fs, "d/x.bin")
    assert errno_of(info) == errno.ENOENT
    assert set(await names(fs, "d")) == {"sub"}
    with pytest.raises(FsError) as info:
        await fs.unlink(d.inode, b"sub")
    assert errno_of(info) == errno.EISDIR
    await env.flush()
    assert "d/x.bin" not in env.keys() and "d/" in env.keys()  # the directory stays (a marker)


async def test_unlink_of_a_new_file_sends_nothing(env: Env) -> None:
    env.wb.settings = WriteBackSettings(upload_delay_s=60, space_wait_s=0.5)
    await create(env.fs, "scratch", b"tmp")
    await env.fs.unlink(ROOT_INODE, b"scratch")
    await env.flush()
    assert "scratch" not in env.keys() and env.inner.stats.delete_requests == 0


async def test_an_unlinked_open_file_stays_usable(env: Env) -> None:
    fs = env.fs
    fh = await create(fs, "open.bin", b"contents", close=False)
    await fs.unlink(ROOT_INODE, b"open.bin")
    assert await fs.read(fh, 0, 100) == b"contents"
    await fs.write(fh, 8, b"+more")
    assert await fs.read(fh, 0, 100) == b"contents+more"
    await fs.flush(fh)
    fs.release(fh)
    await env.flush()
    assert "open.bin" not in env.keys()


async def test_mkdir_rmdir(env: Env) -> None:
    fs = env.fs
    made = await fs.mkdir(ROOT_INODE, b"newdir", 0o755)
    assert made.is_dir and stat.S_IMODE(made.mode) == 0o755
    assert (await lookup(fs, "newdir")).inode == made.inode
    assert await names(fs, "newdir") == {}
    with pytest.raises(FsError) as info:
        await fs.mkdir(ROOT_INODE, b"newdir", 0o755)
    assert errno_of(info) == errno.EEXIST
    await create(fs, "newdir/f", b"f")
    with pytest.raises(FsError) as info:
        await fs.rmdir(ROOT_INODE, b"newdir")
    assert errno_of(info) == errno.ENOTEMPTY
    with pytest.raises(FsError) as info:
        await fs.rmdir(ROOT_INODE, b"a.txt")
    assert errno_of(info) == errno.ENOTDIR
    await env.flush()
    assert {"newdir/", "newdir/f"} <= set(env.keys())
    await fs.unlink(made.inode, b"f")
    await fs.rmdir(ROOT_INODE, b"newdir")
    assert "newdir" not in await names(fs)
    await env.flush()
    assert not [k for k in env.keys() if k.startswith("newdir")]
    env.clock.advance(TTL + 1)
    assert "newdir" not in await names(fs)


async def test_files_in_a_new_directory_while_the_store_is_down(env: Env) -> None:
    fs = env.fs
    await names(fs)  # the root listing is cached
    env.store.fail_lists = env.store.fail_writes = True
    await fs.mkdir(ROOT_INODE, b"offline", 0o755)
    await create(fs, "offline/f", b"written offline")
    assert await read_path(fs, "offline/f") == b"written offline"
    assert not (await env.wb.flush(0.2)).ok
    env.store.fail_lists = env.store.fail_writes = False
    await env.flush()
    assert env.obj("offline/f") == b"written offline"


async def test_rename_of_a_staged_file_over_another(env: Env) -> None:
    fs = env.fs
    await create(fs, "ckpt.tmp", b"weights v2")
    before = await lookup(fs, "ckpt.tmp")
    await fs.rename(ROOT_INODE, b"ckpt.tmp", ROOT_INODE, b"a.txt", 0)
    after = await lookup(fs, "a.txt")
    assert after.inode == before.inode and after.size == 10
    assert await read_path(fs, "a.txt") == b"weights v2"
    with pytest.raises(FsError):
        await lookup(fs, "ckpt.tmp")
    await env.flush()
    assert env.obj("a.txt") == b"weights v2" and "ckpt.tmp" not in env.keys()


async def test_rename_of_a_file_in_the_store_is_a_server_side_copy(env: Env) -> None:
    fs = env.fs
    d = await lookup(fs, "d")
    original = env.obj("d/x.bin")
    await fs.rename(d.inode, b"x.bin", ROOT_INODE, b"moved.bin", 0)
    assert env.inner.stats.copy_requests == 1 and env.inner.stats.get_requests == 0  # no bytes through us
    assert await read_path(fs, "moved.bin") == original
    await env.flush()
    assert env.obj("moved.bin") == original and "d/x.bin" not in env.keys()
    with pytest.raises(FsError) as info:
        await fs.rename(ROOT_INODE, b"moved.bin", ROOT_INODE, b"a.txt", RENAME_NOREPLACE)
    assert errno_of(info) == errno.EEXIST
    with pytest.raises(FsError) as info:
        await fs.rename(ROOT_INODE, b"moved.bin", ROOT_INODE, b"a.txt", RENAME_EXCHANGE)
    assert errno_of(info) == errno.EINVAL
    with pytest.raises(FsError) as info:
        await fs.rename(ROOT_INODE, b"moved.bin", ROOT_INODE, b"d", 0)
    assert errno_of(info) == errno.EISDIR


async def test_rename_of_a_directory(env: Env) -> None:
    fs = env.fs
    await create(fs, "d/staged", b"s")
    await fs.mkdir((await lookup(fs, "d")).inode, b"empty", 0o755)
    sub = await lookup(fs, "d/sub")
    await fs.rename(ROOT_INODE, b"d", ROOT_INODE, b"e", 0)
    assert set(await names(fs, "e")) == {"x.bin", "sub", "staged", "empty"}
    assert (await lookup(fs, "e/sub")).inode == sub.inode
    assert await read_path(fs, "e/sub/y") == b"y" and await read_path(fs, "e/staged") == b"s"
    with pytest.raises(FsError):
        await lookup(fs, "d")
    await env.flush()
    keys = set(env.keys())
    assert {"e/x.bin", "e/sub/y", "e/staged", "e/empty/"} <= keys
    assert not [k for k in keys if k.startswith("d/")]


async def test_directory_rename_limits(tmp_path: Path) -> None:
    e = Env(tmp_path, rename_dir_limit=3)
    for i in range(4):
        e.inner.put_object(f"big/{i}", b"x")
    await e.wb.start()
    try:
        with pytest.raises(FsError) as info:
            await e.fs.rename(ROOT_INODE, b"big", ROOT_INODE, b"other", 0)
        assert errno_of(info) == errno.E2BIG
        big = await lookup(e.fs, "big")
        with pytest.raises(FsError) as info:
            await e.fs.rename(ROOT_INODE, b"big", big.inode, b"inside", 0)
        assert errno_of(info) == errno.EINVAL
    finally:
        await e.wb.stop()


async def test_setattr(env: Env) -> None:
    fs = env.fs
    attrs = await lookup(fs, "a.txt")
    assert (await fs.setattr(attrs.inode, mode=stat.S_IFREG | 0o644)).size == 3  # unchanged: accepted
    with pytest.raises(FsError) as info:
        await fs.setattr(attrs.inode, mode=stat.S_IFREG | 0o755)
    assert errno_of(info) == errno.EPERM
    with pytest.raises(FsError) as info:
        await fs.setattr(attrs.inode, uid=12345)
    assert errno_of(info) == errno.EPERM
    await fs.setattr(attrs.inode, mtime=1_600_000_000.0)  # a clean file: accepted, nothing to show it on
    fh, _ = await fs.open(attrs.inode, W)
    await fs.write(fh, 0, b"z")
    after = await fs.setattr(attrs.inode, mtime=1_600_000_000.0)
    assert after.mtime_ns == 1_600_000_000 * 10**9
    fs.release(fh)


async def test_unsupported_and_special_files(env: Env) -> None:
    fs = env.fs
    for what, code in (("link", errno.EPERM), ("symlink", errno.EPERM), ("setxattr", errno.ENOTSUP)):
        with pytest.raises(FsError) as info:
            fs.unsupported(what)
        assert errno_of(info) == code
    with pytest.raises(FsError) as info:
        await fs.mknod(ROOT_INODE, b"fifo", stat.S_IFIFO | 0o644)
    assert errno_of(info) == errno.EPERM
    attrs = await fs.mknod(ROOT_INODE, b"plain", stat.S_IFREG | 0o644)
    assert attrs.size == 0
    await env.flush()
    assert env.obj("plain") == b""


# ------------------------------------------------------------------------------------------ views
async def test_a_listing_fetched_while_an_upload_lands_is_not_stale(env: Env) -> None:
    fs = env.fs
    env.wb.settings = WriteBackSettings(upload_delay_s=0, space_wait_s=0.5)
    await create(fs, "racy", b"v1")
    env.clock.advance(TTL + 1)
    env.store.delay_s = 0.2  # the LIST starts before the upload lands and ends after it
    listing = asyncio.ensure_future(names(fs))
    await asyncio.sleep(0.05)
    env.store.delay_s = 0
    await env.flush()
    await listing
    attrs = await lookup(fs, "racy")
    assert attrs.size == 2
    assert await read_path(fs, "racy") == b"v1"


async def test_status_and_stats(env: Env) -> None:
    fs = env.fs
    env.wb.settings = WriteBackSettings(upload_delay_s=60, space_wait_s=0.5)
    await create(fs, "s.bin", b"12345")
    fh = await create(fs, "w.bin", b"xx", close=False)
    status = await path_status(fs, "s.bin")
    assert status["stage"] == "dirty" and status["size"] == 5
    assert (await path_status(fs, "w.bin"))["stage"] == "writing"
    assert (await path_status(fs, "a.txt"))["stage"] == "clean"
    assert (await path_status(fs, "nope"))["stage"] == "missing"
    root = await path_status(fs, "")
    assert root["kind"] == "directory" and root["stage"] == "dirty" and len(root["pending"]) == 2
    await fs.unlink(ROOT_INODE, b"a.txt")
    assert (await path_status(fs, "a.txt"))["stage"] == "deleting"
    snap = stats_document(fs)
    wb = snap["writeback"]
    assert wb["dirty_files"] == 2 and wb["dirty_bytes"] == 7 and wb["pending_deletes"] == 1
    assert snap["filesystem"]["writes"] == 2 and snap["filesystem"]["creates"] == 2
    assert {"put_requests", "delete_requests", "copy_requests", "bytes_written"} <= set(snap["object_store"])
    fs.release(fh)
    await env.flush()
    assert (await path_status(fs, "s.bin"))["stage"] == "clean"


async def test_read_only_refuses_every_change(tmp_path: Path) -> None:
    e = Env(tmp_path, read_only=True)
    e.inner.put_object("f", b"f")
    fs = e.fs
    f = await lookup(fs, "f")
    calls = [
        fs.create(ROOT_INODE, b"n", 0o644, os.O_CREAT | os.O_WRONLY),
        fs.open(f.inode, os.O_WRONLY),
        fs.mkdir(ROOT_INODE, b"d", 0o755),
        fs.unlink(ROOT_INODE, b"f"),
        fs.rmdir(ROOT_INODE, b"f"),
        fs.rename(ROOT_INODE, b"f", ROOT_INODE, b"g", 0),
        fs.setattr(f.inode, size=0),
        fs.mknod(ROOT_INODE, b"m", stat.S_IFREG | 0o644),
    ]
    for call in calls:
        with pytest.raises(FsError) as info:
            await call
        assert errno_of(info) == errno.EROFS
    for what in ("link", "symlink", "setxattr"):
        with pytest.raises(FsError) as info:
            fs.unsupported(what)
        assert errno_of(info) == errno.EROFS
    assert "writeback" not in stats_document(fs)
    assert stat.S_IMODE(f.mode) == 0o444


async def test_fallocate_in_the_modes_a_staged_copy_supports(env: Env) -> None:
    """fallocate answered EOPNOTSUPP in every mode (issue 38, finding 7): plain allocation grows the
    file with zeros, KEEP_SIZE changes nothing, PUNCH_HOLE|KEEP_SIZE and ZERO_RANGE read as zeros
    (ZERO_RANGE growing the file unless KEEP_SIZE); the rest is EOPNOTSUPP, and a read-only handle EBADF.
    Everything reaches the store as written."""
    fs = env.fs
    fh = await create(fs, "f.bin", b"x" * 10_000, close=False)
    await fs.fallocate(fh, 0, 0, 20_000)  # plain: grows to 20,000
    await fs.fallocate(fh, 0, 0, 100)  # inside the file: nothing changes
    await fs.fallocate(fh, 0x01, 0, 1 << 30)  # KEEP_SIZE: nothing changes, nothing written
    await fs.fallocate(fh, 0x02 | 0x01, 100, 200)  # punch a hole
    await fs.fallocate(fh, 0x10 | 0x01, 19_990, 100)  # zero range, kept size: stops at the end
    await fs.fallocate(fh, 0x10, 25_000, 5_000)  # zero range past the end: grows to 30,000
    expected = b"x" * 100 + bytes(200) + b"x" * 9_700 + bytes(20_000)
    assert await fs.read(fh, 0, 40_000) == expected
    for mode in (0x08, 0x20, 0x40):  # collapse, insert, unshare
        with pytest.raises(FsError) as refused:
            await fs.fallocate(fh, mode, 0, 10)
        assert errno_of(refused) == errno.EOPNOTSUPP
    with pytest.raises(FsError) as bad:
        await fs.fallocate(fh, 0x02, 0, 10)  # a hole punch must keep the size
    assert errno_of(bad) == errno.EINVAL
    await fs.flush(fh)
    fs.release(fh)
    await env.flush()
    assert env.obj("f.bin") == expected
    attrs = await lookup(fs, "a.txt")
    ro, _ = await fs.open(attrs.inode, os.O_RDONLY)
    with pytest.raises(FsError) as ebadf:
        await fs.fallocate(ro, 0, 0, 10)
    assert errno_of(ebadf) == errno.EBADF
    fs.release(ro)
