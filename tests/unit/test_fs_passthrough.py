"""CacheFS.backing_file: which open files the kernel may read from a whole file (cachefs.fs.passthrough).

Without a mount: an in-memory store, a real disk tier in a temp directory.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

import cachefs.fs.passthrough as passthrough_module
from cachefs.fs.filesystem import CacheFS
from cachefs.fs.inodes import ROOT_INODE
from cachefs.settings import FsSettings
from tiering.blocks import MIN_BLOCK_SIZE
from tiering.clock import FakeClock
from tiering.engine.blockcache import BlockCache
from tiering.objectstore.memory import InMemoryObjectStore
from tiering.settings import CacheSettings
from tiering.tiers.disk import DiskTier
from tiering.tiers.ram import RamTier

BS = MIN_BLOCK_SIZE
TTL = 10.0
# Bound on waiting for blocks a read loaded to reach the disk tier (written by worker threads).
SETTLE_S = 10.0


def make_fs(store: InMemoryObjectStore, clock: FakeClock, disk: DiskTier) -> CacheFS:
    cache = BlockCache(CacheSettings(block_size=BS, ram_bytes=32 * BS, readahead_max_bytes=0), store,
                       RamTier(32 * BS), disk)
    return CacheFS(store, cache, FsSettings(attr_ttl_s=TTL, dir_ttl_s=TTL, read_only=True), clock=clock,
                   whole_files=disk)


async def open_file(fs: CacheFS, name: str) -> int:
    attrs = await fs.lookup(ROOT_INODE, name.encode())
    fh, _ = await fs.open(attrs.inode, os.O_RDONLY)
    return fh


async def read_whole(fs: CacheFS, fh: int, size: int) -> bytes:
    return bytes(await fs.read(fh, 0, size))


async def settled(fs: CacheFS, name: str) -> str:
    """The whole file of ``name`` once its blocks are all on disk (bounded wait)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_S
    while True:
        fh = await open_file(fs, name)
        try:
            path = await fs.backing_file(fh)
        finally:
            fs.release(fh)
        if path is not None:
            return path
        assert loop.time() < deadline, f"{name} never became whole on the disk tier"
        await asyncio.sleep(0.01)


async def test_a_version_whole_on_disk_has_a_whole_file_and_a_partial_one_has_none(tmp_path: Path) -> None:
    store = InMemoryObjectStore()
    data = os.urandom(3 * BS + 11)
    store.put_object("f.bin", data)
    clock = FakeClock()
    fs = make_fs(store, clock, DiskTier(tmp_path, 10**8))
    fh = await open_file(fs, "f.bin")
    assert await fs.backing_file(fh) is None  # nothing on disk yet
    assert bytes(await fs.read(fh, 0, BS)) == data[:BS]  # one block of four
    assert await fs.backing_file(fh) is None
    assert await read_whole(fs, fh, len(data)) == data
    fs.release(fh)
    path = await settled(fs, "f.bin")
    assert Path(path).read_bytes() == data
    # A changed ETag: the new version is not whole on disk, and never gets the old copy.
    store.put_object("f.bin", os.urandom(len(data)))
    clock.advance(TTL + 1)
    fh = await open_file(fs, "f.bin")
    assert await fs.backing_file(fh) is None
    assert await fs.backing_file(fh, assemble=False) != path  # another version, another name
    fs.release(fh)


async def test_a_large_version_is_assembled_in_the_background(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(passthrough_module, "WHOLE_AT_OPEN_MAX_BYTES", BS)
    store = InMemoryObjectStore()
    data = os.urandom(2 * BS)
    store.put_object("big", data)
    disk = DiskTier(tmp_path, 10**8)
    fs = make_fs(store, FakeClock(), disk)
    fh = await open_file(fs, "big")
    assert await read_whole(fs, fh, len(data)) == data
    fs.release(fh)
    path = await settled(fs, "big")  # the first opens are served by the daemon meanwhile
    assert Path(path).read_bytes() == data and disk.whole_stats.assembled == 1
    assert fs.whole is not None
    await fs.whole.close()


async def test_no_whole_file_without_a_disk_tier(tmp_path: Path) -> None:
    store = InMemoryObjectStore()
    store.put_object("f", b"abc")
    cache = BlockCache(CacheSettings(block_size=BS, ram_bytes=32 * BS), store, RamTier(32 * BS), None)
    fs = CacheFS(store, cache, FsSettings(attr_ttl_s=TTL, dir_ttl_s=TTL, read_only=True), clock=FakeClock())
    fh = await open_file(fs, "f")
    assert await read_whole(fs, fh, 3) == b"abc"
    assert fs.whole is None and await fs.backing_file(fh) is None
