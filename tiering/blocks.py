"""Block identity and block arithmetic.

An object is read in fixed-size blocks. A block is named by ``BlockKey(key, etag, index)``: the
object's key *and* its ETag (or version id) are part of every cache key, so when an object is
overwritten, even with the same size, none of its old blocks can ever be returned for it. Stale
blocks simply stop being asked for and age out of the tiers.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterator, NamedTuple

MiB = 1024 * 1024

# Default block size: 8 MiB. Measured with benchmarks/blocksize.py (one 512 MiB object on a local
# SeaweedFS, 16 ranged GETs in flight, 2 cores): 0.25 MiB blocks 31 MiB/s, 1 MiB 71, 2 MiB 145,
# 4 MiB 187, 8 MiB 225, 16 MiB 234. Each GET carries milliseconds of fixed cost (client signing,
# gateway, filer and volume hops), so throughput grows with the block until 8 MiB and then
# flattens, while bigger blocks only add waste to random reads. Mountpoint's default GET part size
# is 8 MiB as well.
DEFAULT_BLOCK_SIZE = 8 * MiB
MIN_BLOCK_SIZE = 64 * 1024  # below this, per-request overhead dominates everything
MAX_BLOCK_SIZE = 256 * MiB  # a block is held whole in RAM while in flight

# The bytes of one block as the tiers and stores hand them around: ``bytes``, or the read-only
# ``memoryview`` of the buffer a ranged GET received the block into (``tiering.objectstore.rangedget``;
# a copy into ``bytes`` would cost a second copy of every byte fetched). Both compare equal to the
# same ``bytes``, slice, and go to ``crc32``, ``os.write`` and a FUSE reply as they are.
BlockData = bytes | memoryview


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """One version of one object: what a reader has open."""

    key: str
    etag: str
    size: int


class BlockKey(NamedTuple):
    """Identity of one cached block: object key, object ETag, block index."""

    key: str
    etag: str
    # The field shadows tuple.index(), which nothing calls on a key; renaming it would touch every
    # block computation for a method no one uses.
    index: int  # type: ignore[assignment]

    def token(self) -> str:
        """A stable text form, written into on-disk block headers."""
        return f"{self.index}\x00{self.etag}\x00{self.key}"

    def digest(self) -> str:
        """A fixed-length, filesystem-safe name for this block (hex SHA-256 of ``token()``)."""
        return hashlib.sha256(self.token().encode("utf-8", "surrogateescape")).hexdigest()


class BlockSpan(NamedTuple):
    """The part of block ``index`` that a read needs: ``[start, end)`` inside the block."""

    index: int  # type: ignore[assignment]  # shadows tuple.index(), as in BlockKey
    start: int
    end: int


def block_count(size: int, block_size: int) -> int:
    """Number of blocks of an object of ``size`` bytes."""
    return (size + block_size - 1) // block_size


def block_range(index: int, size: int, block_size: int) -> tuple[int, int]:
    """Byte range ``[start, end)`` of block ``index`` inside an object of ``size`` bytes."""
    start = index * block_size
    return start, min(start + block_size, size)


def spans(offset: int, length: int, size: int, block_size: int) -> Iterator[BlockSpan]:
    """The blocks a read of ``length`` bytes at ``offset`` touches, clipped to the object's end."""
    end = min(offset + length, size)
    pos = max(offset, 0)
    while pos < end:
        index = pos // block_size
        block_start = index * block_size
        stop = min(end, block_start + block_size)
        yield BlockSpan(index, pos - block_start, stop - block_start)
        pos = stop
