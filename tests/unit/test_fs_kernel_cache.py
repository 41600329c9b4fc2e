"""What a re-list tells the kernel (``cachefs.fs.kernelcache``): the names and inodes it holds that
changed in the bucket behind the mount's back, and nothing else. No mount: the kernel is a
``KernelCacheLog``; the bytes the FUSE session sends for each are in test_fuse_adapter.py."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from cachefs.fs.errors import FsError
from cachefs.fs.filesystem import CacheFS
from cachefs.fs.inodes import ROOT_INODE
from cachefs.fs.kernelcache import KernelCacheLog
from cachefs.settings import FsSettings
from tiering.blocks import MIN_BLOCK_SIZE
from tiering.clock import FakeClock
from tiering.engine.blockcache import BlockCache
from tiering.errors import ObjectNotFoundError
from tiering.objectstore.memory import InMemoryObjectStore
from tiering.settings import CacheSettings
from tiering.tiers.disk import DiskTier
from tiering.tiers.ram import RamTier
from tiering.writeback import WriteBack, WriteBackSettings

BS = MIN_BLOCK_SIZE
TTL = 10.0


def make(store: InMemoryObjectStore, clock: FakeClock, tmp: Path | None = None) -> tuple[CacheFS, KernelCacheLog]:
    settings = CacheSettings(block_size=BS, ram_bytes=16 * BS)
    disk = DiskTier(tmp / "cache", 64 * 1024 * 1024) if tmp is not None else None
    cache = BlockCache(settings, store, RamTier(16 * BS), disk)
    fs = CacheFS(store, cache, FsSettings(attr_ttl_s=3600, dir_ttl_s=TTL, read_only=tmp is None), clock=clock)
    kernel = KernelCacheLog()
    fs.attach_kernel_cache(kernel)
    return fs, kernel


async def absent(fs: CacheFS, parent: int, name: bytes) -> None:
    """A lookup of a name nobody has: the kernel's way of making the daemon consult a listing."""
    with pytest.raises(FsError) as caught:
        await fs.lookup(parent, name)
    assert caught.value.errno == errno.ENOENT


@pytest.fixture
def store() -> InMemoryObjectStore:
    s = InMemoryObjectStore()
    for name in ("same", "changed", "gone", "becomes-dir", "unknown-to-kernel"):
        s.put_object(f"d/{name}", name.encode())
    s.put_object("d/sub/x", b"x")
    return s


async def test_a_relist_tells_the_kernel_what_changed_of_what_it_holds(store: InMemoryObjectStore) -> None:
    clock = FakeClock()
    fs, kernel = make(store, clock)
    d = await fs.lookup(ROOT_INODE, b"d")
    known = {name: await fs.lookup(d.inode, name.encode()) for name in ("same", "changed", "gone", "becomes-dir", "sub")}
    store.put_object("d/changed", b"a new version, longer")
    store.delete_object("d/gone")
    store.delete_object("d/becomes-dir")
    store.put_object("d/becomes-dir/inner", b"i")
    store.put_object("d/unknown-to-kernel", b"changed too, but the kernel never looked it up")
    store.put_object("d/added", b"new")
    clock.advance(TTL / 2)
    await absent(fs, d.inode, b"nothing")  # answered from the listing still fresh: nothing re-listed
    assert (kernel.entries, kernel.inodes) == ([], [])

    clock.advance(TTL)
    assert (await fs.lookup(d.inode, b"added")).size == 3  # the listing expired: re-listed now
    assert kernel.inodes == [known["changed"].inode]
    assert sorted(kernel.entries) == [(d.inode, b"becomes-dir"), (d.inode, b"changed"), (d.inode, b"gone")]
    # The node follows the new version: the kernel's next getattr (it dropped the old one) sees it.
    assert (await fs.getattr(known["changed"].inode)).size == len(b"a new version, longer")

    clock.advance(TTL + 1)
    await absent(fs, d.inode, b"nothing")  # re-listed again, nothing new: nothing told
    assert len(kernel.inodes) == 1 and len(kernel.entries) == 3


async def test_a_directory_the_kernel_does_not_hold_tells_nothing(store: InMemoryObjectStore) -> None:
    clock = FakeClock()
    fs, kernel = make(store, clock)
    d = await fs.lookup(ROOT_INODE, b"d")
    await fs.lookup(d.inode, b"gone")
    fs.forget(d.inode, 1)  # the kernel forgot the directory (and so every entry in it)
    fs.forget(fs.inodes.at("d/gone").inode, 1)  # type: ignore[union-attr]
    store.delete_object("d/gone")
    clock.advance(TTL + 1)
    d = await fs.lookup(ROOT_INODE, b"d")
    await absent(fs, d.inode, b"nothing")
    assert (kernel.entries, kernel.inodes) == ([], [])


async def test_changes_made_through_the_mount_tell_nothing(store: InMemoryObjectStore, tmp_path: Path) -> None:
    """The kernel saw them: an upload that landed, and a change still pending in write-back."""
    clock = FakeClock()
    fs, kernel = make(store, clock, tmp_path)
    wb = WriteBack(WriteBackSettings(upload_delay_s=3600), tmp_path / "cache" / "staging", store, fs.cache,
                   fs.cache.disk)  # type: ignore[arg-type]
    fs.attach_writeback(wb)
    await wb.start()
    try:
        d = await fs.lookup(ROOT_INODE, b"d")
        changed = await fs.lookup(d.inode, b"changed")
        await fs.lookup(d.inode, b"gone")
        fh, _ = await fs.open(changed.inode, os.O_WRONLY)
        await fs.write(fh, 0, b"written through the mount")
        await fs.flush(fh)
        fs.release(fh)
        await fs.unlink(d.inode, b"gone")  # pending: the store still lists it
        clock.advance(TTL + 1)
        await absent(fs, d.inode, b"nothing")
        assert (kernel.entries, kernel.inodes) == ([], [])
        report = await wb.flush(5)
        assert report.ok
        with pytest.raises(ObjectNotFoundError):
            await store.head("d/gone")
        clock.advance(TTL + 1)
        await absent(fs, d.inode, b"nothing")  # the uploaded version and the delete are what the node knows
        assert (kernel.entries, kernel.inodes) == ([], [])
    finally:
        await wb.stop()
