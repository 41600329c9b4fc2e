"""Aligned blocks on the disk tier: format version 2, written and read with O_DIRECT from and into
page-aligned pool buffers, and every way that can fall back to the page cache without losing a byte.

These run on the test machine's real filesystem (ext4 in CI, which takes O_DIRECT); the refusal of
O_DIRECT by a filesystem is simulated by making the open fail as tmpfs before Linux 6.6 does.
"""

from __future__ import annotations

import errno
import functools
import os
import struct
import zlib
from pathlib import Path

import pytest

import tiering.tiers.blockfile as blockfile_module
from tiering.tiers.blockformat import ALIGNED_MIN_BYTES, ALIGNED_VERSION, FORMAT_VERSION, block_file_size, object_footprint
from tiering.blocks import BlockKey
from tiering.buffers import BLOCK_BUFFERS, DIRECT_ALIGN
from tiering.tiers.disk import DiskTier as _DiskTier

# Tests of block files: small blocks as files of their own here (tests/unit/test_disk_packs.py has them
# as records of pack files, the default).
DiskTier = functools.partial(_DiskTier, pack_small=False)

MiB = 1024 * 1024
KEY = BlockKey("datasets/train-00001.tar", '"0123456789abcdef0123456789abcdef"', 3)
CAPACITY = 64 * MiB


def pattern(n: int, seed: int = 7) -> bytes:
    return (bytes(range(seed, 256)) + bytes(range(seed))) * (n // 256) + bytes(n % 256)


def pooled(data: bytes) -> memoryview:
    """``data`` in a buffer of the block pool, as the ranged-GET workers hand blocks over."""
    buf = BLOCK_BUFFERS.take(len(data))
    buf[:] = data
    return buf.toreadonly()


def block_path(directory: Path, k: BlockKey) -> Path:
    d = k.digest()
    return directory / "blocks" / d[:2] / f"{d}.blk"


@pytest.fixture
def opened_flags(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The flags of every block file the tier opens (to see O_DIRECT used or not)."""
    seen: list[int] = []
    real = blockfile_module.open_private

    def spy(path: Path, flags: int) -> int:
        seen.append(flags)
        return real(path, flags)

    monkeypatch.setattr(blockfile_module, "open_private", spy)
    return seen


def test_a_large_block_is_framed_aligned_and_pinned_byte_for_byte(tmp_path: Path) -> None:
    data = pattern(ALIGNED_MIN_BYTES)
    tier = DiskTier(tmp_path, CAPACITY)
    assert tier.put(KEY, pooled(data))

    token = KEY.token().encode()
    fixed = b"CFSB" + struct.pack("<HIQI", ALIGNED_VERSION, len(token), len(data), zlib.crc32(data))
    header = fixed + token + struct.pack("<I", zlib.crc32(fixed + token))
    written = block_path(tmp_path, KEY).read_bytes()
    assert written[: len(header)] == header
    assert written[len(header) : DIRECT_ALIGN] == bytes(DIRECT_ALIGN - len(header))  # zero padding
    assert written[DIRECT_ALIGN:] == data  # the data starts on the first 4 KiB boundary
    assert tier.used_bytes() == len(written) == block_file_size(KEY, len(data)) == DIRECT_ALIGN + len(data)


def test_small_blocks_keep_the_packed_layout(tmp_path: Path) -> None:
    data = pattern(ALIGNED_MIN_BYTES - 1)
    tier = DiskTier(tmp_path, CAPACITY)
    assert tier.put(KEY, data)
    written = block_path(tmp_path, KEY).read_bytes()
    assert struct.unpack_from("<H", written, 4)[0] == FORMAT_VERSION
    assert len(written) == block_file_size(KEY, len(data)) < DIRECT_ALIGN + len(data)


@pytest.mark.parametrize("length", [ALIGNED_MIN_BYTES, 3 * MiB + 1, 2 * MiB + DIRECT_ALIGN - 1, 8 * MiB])
def test_aligned_blocks_go_both_ways_without_the_page_cache(tmp_path: Path, opened_flags: list[int],
                                                            length: int) -> None:
    data = pattern(length, seed=length % 251)
    tier = DiskTier(tmp_path, CAPACITY)
    assert tier.put(KEY, pooled(data))
    assert opened_flags[-1] & os.O_DIRECT, "the write did not ask for O_DIRECT"
    assert tier.files.unaligned_writes == 0

    again = DiskTier(tmp_path, CAPACITY)  # a remount: the index from the files, the data from the disk
    got = again.get(KEY)
    assert opened_flags[-1] & os.O_DIRECT, "the read did not ask for O_DIRECT"
    assert got is not None and bytes(got) == data
    assert isinstance(got, memoryview) and got.readonly
    assert block_path(tmp_path, KEY).stat().st_size == DIRECT_ALIGN + length


def test_a_buffer_that_is_not_page_aligned_is_written_through_the_page_cache(tmp_path: Path) -> None:
    data = pattern(2 * MiB + 100)
    unaligned = memoryview(b"x" + data)[1:]  # one byte off any page boundary
    tier = DiskTier(tmp_path, CAPACITY)
    assert tier.put(KEY, unaligned)
    assert tier.files.unaligned_writes == 1
    got = DiskTier(tmp_path, CAPACITY).get(KEY)
    assert got is not None and bytes(got) == data


def test_blocks_written_packed_by_an_earlier_version_are_still_served(tmp_path: Path) -> None:
    """Format version 1 files of 1 MiB and more (the only layout before aligned blocks) stay hits."""
    data = pattern(2 * MiB)
    token = KEY.token().encode()
    fixed = b"CFSB" + struct.pack("<HIQI", FORMAT_VERSION, len(token), len(data), zlib.crc32(data))
    path = block_path(tmp_path, KEY)
    path.parent.mkdir(parents=True, mode=0o700)
    path.write_bytes(fixed + token + struct.pack("<I", zlib.crc32(fixed + token)) + data)
    path.chmod(0o600)
    got = DiskTier(tmp_path, CAPACITY).get(KEY)
    assert got is not None and bytes(got) == data


@pytest.mark.parametrize("offset", [100, DIRECT_ALIGN - 1, DIRECT_ALIGN, DIRECT_ALIGN + MiB, -1],
                         ids=["padding", "last-padding-byte", "first-data-byte", "middle", "last-byte"])
def test_a_damaged_aligned_block_is_a_miss_and_is_dropped(tmp_path: Path, offset: int) -> None:
    data = pattern(2 * MiB)
    tier = DiskTier(tmp_path, CAPACITY)
    assert tier.put(KEY, pooled(data))
    path = block_path(tmp_path, KEY)
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x20
    path.write_bytes(bytes(raw))

    again = DiskTier(tmp_path, CAPACITY)
    assert again.get(KEY) is None
    assert again.stats.corrupt_blocks == 1
    assert not path.exists()


def test_a_filesystem_that_refuses_o_direct_gets_every_block_through_the_page_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = blockfile_module.open_private
    refused: list[int] = []

    def no_direct(path: Path, flags: int) -> int:
        if flags & os.O_DIRECT:
            refused.append(flags)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags)

    monkeypatch.setattr(blockfile_module, "open_private", no_direct)
    data = pattern(4 * MiB)
    tier = DiskTier(tmp_path, CAPACITY)
    assert tier.put(KEY, pooled(data))
    assert tier.put(BlockKey(KEY.key, KEY.etag, 4), pooled(data))
    assert len(refused) == 1, "O_DIRECT is asked for once, then the tier stops asking"
    got = tier.get(KEY)
    assert got is not None and bytes(got) == data


def test_the_pin_footprint_counts_the_padding_of_aligned_blocks() -> None:
    size, block = 10 * 8 * MiB + 5 * MiB + 3, 8 * MiB
    blocks = -(-size // block)
    expected = sum(block_file_size(BlockKey("a/b", "e", i), min(block, size - i * block)) for i in range(blocks))
    assert object_footprint("a/b", "e", size, block) == expected
    assert expected >= size + blocks * DIRECT_ALIGN


def test_a_filesystem_that_refuses_direct_reads_is_not_a_failing_disk(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Opened with O_DIRECT, then EINVAL on the read itself: the block is still a hit (read through
    the page cache), the tier stays healthy and keeps the block, and stops asking for O_DIRECT."""
    import fcntl

    data = pattern(3 * MiB)
    tier = DiskTier(tmp_path, CAPACITY)
    assert tier.put(KEY, pooled(data))
    real = os.preadv
    refused: list[int] = []

    def no_direct_reads(fd: int, buffers, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", no_direct_reads)
    for _ in range(2):
        got = tier.get(KEY)
        assert got is not None and bytes(got) == data
    assert len(refused) == 1 and not tier.files.direct
    assert tier.stats.errors == 0 and tier.stats.hits == 2 and tier.health.consecutive_failures == 0
