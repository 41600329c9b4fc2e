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

# Default block size. 4 MiB, measured (benchmarks/blocksize.py) against SeaweedFS on loopback: one
# ranged GET costs ~1-2 ms of fixed overhead in aiobotocore, so 1 MiB blocks cap a single stream at
# a few hundred MiB/s of request handling, while 4 MiB blocks with 8 in flight reach the server's
# limit; 8 MiB and above gain nothing and make small random reads of big files fetch more waste.
# It is also JuiceFS's block size; Mountpoint uses 1 MiB with a larger request size.
DEFAULT_BLOCK_SIZE = 4 * MiB
MIN_BLOCK_SIZE = 64 * 1024  # below this, per-request overhead dominates everything
MAX_BLOCK_SIZE = 256 * MiB  # a block is held whole in RAM while in flight


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
    index: int

    def token(self) -> str:
        """A stable text form, written into on-disk block headers."""
        return f"{self.index}\x00{self.etag}\x00{self.key}"

    def digest(self) -> str:
        """A fixed-length, filesystem-safe name for this block (hex SHA-256 of ``token()``)."""
        return hashlib.sha256(self.token().encode("utf-8", "surrogateescape")).hexdigest()


class BlockSpan(NamedTuple):
    """The part of block ``index`` that a read needs: ``[start, end)`` inside the block."""

    index: int
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
