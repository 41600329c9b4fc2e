"""tiering.pagecache: whether the page cache holds a range, asked without reading it; and the disk
tier's hits of block files that use it: a block not in the page cache is read from the device once,
leaving the page cache as it was (a missed RWF_NOWAIT read used to start read-ahead of the same bytes
first)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

import tiering.pagecache as pagecache
from tiering.blocks import BlockKey
from tiering.tiers.disk import DiskTier
from tests.support.diskblocks import block_location, drop_pages


def test_cached_tells_a_read_range_from_a_dropped_one(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(random.Random(1).randbytes(64 * 1024))
    drop_pages(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        if pagecache.cached(fd, 0, 4096) is None:
            pytest.skip("this kernel has no cachestat (Linux < 6.5): the disk tier tries RWF_NOWAIT instead")
        assert pagecache.cached(fd, 0, 64 * 1024) is False
        os.pread(fd, 8192, 8192)  # pages 2 and 3 (and whatever read-ahead brings)
        assert pagecache.cached(fd, 8192, 8192) is True
        assert pagecache.cached(fd, 0, 0) is True  # nothing asked: nothing missing
    finally:
        os.close(fd)


def test_without_cachestat_the_answer_is_unknown(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(pagecache, "_usable", False)
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert pagecache.cached(fd, 0, 100) is None
    finally:
        os.close(fd)


def test_a_block_file_hit_whose_pages_were_dropped_leaves_the_page_cache_alone(tmp_path: Path) -> None:
    """A small block as a file of its own (an earlier version's, or ``pack_small=False``). A pack record
    keeps the missed RWF_NOWAIT read on purpose: its read-ahead brings the records written after it
    (tiering.tiers.packs, "Reads")."""
    pack_small = False
    tier = DiskTier(tmp_path, 10**7, pack_small=pack_small)
    data = random.Random(2).randbytes(100 * 1024)
    key = BlockKey("f", "e", 0)
    assert tier.put(key, data)
    path, offset, size = block_location(tier, key)
    drop_pages(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        if pagecache.cached(fd, offset, size) is None:
            pytest.skip("this kernel has no cachestat (Linux < 6.5)")
        assert bytes(tier.get_for_reply(key) or b"") == data
        if not tier.files.direct:
            pytest.skip("this filesystem refuses O_DIRECT: hits go through the page cache")
        assert pagecache.cached(fd, offset, size) is False  # read once, from the device, no read-ahead
        os.pread(fd, size, offset)  # now in the page cache: the next hit is a copy from it
        assert bytes(tier.get_for_reply(key) or b"") == data
    finally:
        os.close(fd)
