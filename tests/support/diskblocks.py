"""Where a block of a ``DiskTier`` lies on disk, for tests that damage it as bit rot or a crash would:
a file of its own (``blocks/<d[:2]>/<d>.blk``) or a record of a pack file (``packs/<N>.pack`` at an
offset; ``tiering.tiers.packs``)."""

from __future__ import annotations

import os
from pathlib import Path

from tiering.blocks import BlockKey
from tiering.tiers.disk import DiskTier


def block_location(tier: DiskTier, key: BlockKey) -> tuple[Path, int, int]:
    """``(file, offset, size)`` of ``key``'s framed block (header and data) on ``tier``."""
    digest = key.digest()
    packed = tier.places.record(digest)
    if packed is not None:
        assert tier.packs is not None
        slot, size = packed
        return Path(tier.packs.path(slot.pack)), slot.offset, size
    path = tier.directory / "blocks" / digest[:2] / f"{digest}.blk"
    return path, 0, path.stat().st_size


def drop_pages(path: Path) -> None:
    """Drop ``path``'s pages from the page cache, written back first (DONTNEED leaves dirty pages)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def flip_byte(tier: DiskTier, key: BlockKey, at: int) -> None:
    """Flip one byte of ``key``'s framed block (``at`` from its start; negative: from its end),
    leaving the file's times as they were (bit rot does not touch them)."""
    path, offset, size = block_location(tier, key)
    position = offset + (at % size)
    before = path.stat()
    with open(path, "r+b") as f:
        f.seek(position)
        byte = f.read(1)
        f.seek(position)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
