"""``DiskTier.get_for_reply``: a block file read whole into the calling thread's reply buffer, from the
page cache where it holds the file, else with O_DIRECT; checked as ``get`` checks (the corruption cases
of tests/unit/test_disk_tier.py run on both), and every way the device path can fall back."""

from __future__ import annotations

import errno
import fcntl
import functools
import os
import threading
from pathlib import Path

import pytest

from tiering.blocks import BlockKey
from tiering.buffers import BLOCK_BUFFERS
from tiering.tiers.disk import DiskTier as _DiskTier
from tests.support.diskblocks import drop_pages

# Tests of block files: small blocks as files of their own here (tests/unit/test_disk_packs.py has them
# as records of pack files, the default).
DiskTier = functools.partial(_DiskTier, pack_small=False)

MiB = 1024 * 1024
KEY = BlockKey("datasets/small/00042.jpg", '"0123456789abcdef0123456789abcdef"', 0)


def pattern(n: int, seed: int = 7) -> bytes:
    return (bytes(range(seed, 256)) + bytes(range(seed))) * (n // 256) + bytes(n % 256)


def block_path(directory: Path, k: BlockKey) -> Path:
    d = k.digest()
    return directory / "blocks" / d[:2] / f"{d}.blk"


@pytest.fixture
def direct_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The reads made with O_DIRECT on (their fds), by ``os.preadv``."""
    seen: list[int] = []
    real = os.preadv

    def spy(fd: int, buffers, offset: int, flags: int = 0) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            seen.append(fd)
        return real(fd, buffers, offset, flags)

    monkeypatch.setattr(os, "preadv", spy)
    return seen


@pytest.mark.parametrize("size", [1, 4095, 4096, 100 * 1024, MiB - 1, MiB, 3 * MiB + 5],
                         ids=lambda n: f"{n}B")
@pytest.mark.parametrize("cached", [True, False], ids=["page-cache", "dropped"])
def test_the_bytes_are_the_blocks_whichever_layout_and_wherever_its_pages_are(
        tmp_path: Path, size: int, cached: bool, direct_reads: list[int]) -> None:
    tier = DiskTier(tmp_path, 64 * MiB)
    data = pattern(size)
    block = BLOCK_BUFFERS.take(size)
    block[:] = data
    assert tier.put(KEY, block.toreadonly())
    if not cached:
        drop_pages(block_path(tmp_path, KEY))
    got = tier.get_for_reply(KEY)
    assert got is not None and bytes(got) == data and got.readonly
    assert tier.stats.hits == 1 and tier.stats.corrupt_blocks == 0
    if not cached:
        assert direct_reads, "pages not in the page cache are read from the device with O_DIRECT"


def test_a_file_in_the_page_cache_is_read_from_it_without_o_direct(tmp_path: Path, direct_reads: list[int]) -> None:
    tier = DiskTier(tmp_path, 64 * MiB)
    assert tier.put(KEY, pattern(100 * 1024))
    with open(block_path(tmp_path, KEY), "rb") as f:
        f.read()  # every page cached
    got = tier.get_for_reply(KEY)
    assert got is not None and bytes(got) == pattern(100 * 1024)
    assert direct_reads == []


def test_the_buffer_is_the_threads_own_and_the_next_call_reuses_it(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 64 * MiB)
    other = BlockKey(KEY.key, KEY.etag, 1)
    assert tier.put(KEY, pattern(5000, 1)) and tier.put(other, pattern(5000, 2))
    first = tier.get_for_reply(KEY)
    assert first is not None and bytes(first) == pattern(5000, 1)
    got: list[bytes] = []
    thread = threading.Thread(target=lambda: got.append(bytes(tier.get_for_reply(other) or b"")))
    thread.start()
    thread.join(10)
    assert got == [pattern(5000, 2)]
    assert bytes(first) == pattern(5000, 1), "another thread's read left this thread's buffer alone"
    second = tier.get_for_reply(other)
    assert second is not None and bytes(first) == pattern(5000, 2), "a view is valid until the thread's next call"


def test_a_filesystem_that_refuses_o_direct_is_read_through_the_page_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """F_SETFL refusing O_DIRECT (EINVAL) is not a failing disk: the block is a hit, read buffered,
    and the tier stops asking for O_DIRECT."""
    tier = DiskTier(tmp_path, 64 * MiB)
    assert tier.put(KEY, pattern(200 * 1024))
    drop_pages(block_path(tmp_path, KEY))
    real = fcntl.fcntl
    refused: list[int] = []

    def no_direct(fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, cmd, arg)

    monkeypatch.setattr(fcntl, "fcntl", no_direct)
    for _ in range(2):
        drop_pages(block_path(tmp_path, KEY))
        got = tier.get_for_reply(KEY)
        assert got is not None and bytes(got) == pattern(200 * 1024)
    assert len(refused) == 1 and not tier.files.direct
    assert tier.stats.hits == 2 and tier.stats.errors == 0


def test_a_symlink_for_a_block_file_is_a_corrupt_block(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 64 * MiB)
    assert tier.put(KEY, pattern(1000))
    path = block_path(tmp_path, KEY)
    target = tmp_path / "elsewhere"
    target.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(target)
    assert tier.get_for_reply(KEY) is None
    assert tier.stats.corrupt_blocks == 1 and target.exists()
