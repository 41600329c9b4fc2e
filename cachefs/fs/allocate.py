"""fallocate(2) over a staged copy: the modes write-back can honour, and how.

Staged data is sparse (see docs/semantics.md, "Sparse files"), so allocation reserves nothing ahead:

- 0 (allocate): the file grows to ``offset + length`` if shorter; the new bytes read as zeros;
- ``FALLOC_FL_KEEP_SIZE`` alone: nothing to do;
- ``FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE`` and ``FALLOC_FL_ZERO_RANGE`` (growing the file unless
  ``FALLOC_FL_KEEP_SIZE``): the range reads as zeros, written as zeros into the staged copy in
  FALLOCATE_ZERO_CHUNK pieces;
- the others (collapse, insert, unshare ranges): EOPNOTSUPP.
"""

from __future__ import annotations

import errno

from cachefs.fs.errors import FsError
from tiering.writeback import WriteBack
from tiering.writeback.staged import StagedFile

# fallocate(2) modes (linux/falloc.h).
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10
# A zeroed range is written into the staged copy in pieces of this size: one piece's zeros in memory.
FALLOCATE_ZERO_CHUNK = 1024 * 1024


def check_fallocate(mode: int, offset: int, length: int) -> None:
    """FsError for what the kernel or a staged copy refuses (EINVAL, EOPNOTSUPP)."""
    if offset < 0 or length <= 0:
        raise FsError(errno.EINVAL)
    if mode & ~(FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE):
        raise FsError(errno.EOPNOTSUPP, f"fallocate mode {mode:#x} is not supported (see docs/semantics.md)")
    if mode & FALLOC_FL_PUNCH_HOLE and (not mode & FALLOC_FL_KEEP_SIZE or mode & FALLOC_FL_ZERO_RANGE):
        raise FsError(errno.EINVAL)  # as the kernel requires: a hole punch keeps the size


async def fallocate(wb: WriteBack, sf: StagedFile, mode: int, offset: int, length: int) -> None:
    """Apply a checked ``mode`` to the staged file ``sf`` (the module docstring)."""
    keep = bool(mode & FALLOC_FL_KEEP_SIZE)
    end = offset + length
    if mode & (FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE):
        stop = min(end, sf.size) if keep else end
        chunk = bytes(FALLOCATE_ZERO_CHUNK)
        for start in range(offset, stop, FALLOCATE_ZERO_CHUNK):
            await wb.write(sf, start, chunk[:min(FALLOCATE_ZERO_CHUNK, stop - start)])
    if not keep and end > sf.size:
        with wb.held(sf):
            await wb.truncate(sf, end)
