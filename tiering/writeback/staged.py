"""In-memory state of staged files: what the engine knows about each dirty file and its data files.

A ``StagedFile`` is one file being written (or written and not yet uploaded). Its bytes live in a
``DataFile`` under ``staging/data``; the version last acknowledged (by close or fsync) is ``acked``:
a data file, a size and a CRC-32, named by the key's journal record. The rule that keeps every
acknowledged version intact until it is uploaded or replaced by a newer acknowledged one:

    **The acknowledged prefix of a data file is never modified.** A write or truncate that would
    touch bytes ``[0, acked.size)`` of the data file the record names first copies the file to a
    new data file (copy-on-write: ``copy_file_range``, a reflink on filesystems that have them) and
    modifies the copy. Writes at or past ``acked.size`` (appends) go to the same file.

So appending and fsyncing (logs, checkpoints written front to back) never copies, and random writes
after an fsync copy once per acknowledged version. After a crash the journal's data file, cut back to
the recorded size, holds exactly the acknowledged bytes, whatever happened to the file afterwards.

The CRC-32 of the content is kept incrementally: writes that extend a checksummed prefix extend the
checksum; anything else falls back to the last valid prefix, and acknowledging reads back only the
bytes past it. Writing a file front to back is therefore checksummed once, in the write path.

A ``DataFile`` is reference-counted: the staged file's current data, its acknowledged data (often the
same file), in-flight uploads and reads each hold a reference; the last one closes and unlinks it
and gives its space back to the budget.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
from dataclasses import dataclass

from tiering.blocks import ObjectRef
from tiering.checksum import crc32
from tiering.fileio import libc_function
from tiering.writeback.journal import pwrite_all
from tiering.writeback.settings import WRITE_BEHIND_BYTES


# Python's os module has no sync_file_range(2); glibc has had it since 2.6.
_SYNC_FILE_RANGE = libc_function("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint],
                                 ctypes.c_int)
SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start write-out of dirty pages not already under write-out


def start_write_out(fd: int) -> bool:
    """Ask the kernel to start writing ``fd``'s dirty pages to disk, without waiting; False if it cannot."""
    if _SYNC_FILE_RANGE is None:
        return False
    return _SYNC_FILE_RANGE(fd, 0, 0, SYNC_FILE_RANGE_WRITE) == 0


class DataFile:
    """One staged data file: an open descriptor, the space reserved for it, its references.

    What it may occupy on disk is charged as bytes written, not as its length: a hole (``truncate``
    past the end, a write past the end) is not staged data. ``dense`` is the end of a prefix charged
    whole; ``scattered`` the bytes charged for writes beyond it (blocks they touch, an upper bound).
    ``DataFiles.charge`` is what the file needs reserved (see ``tiering.writeback.datafiles``).
    """

    __slots__ = ("name", "fd", "reserved", "refs", "dir_synced", "unflushed", "dense", "scattered")

    def __init__(self, name: str, fd: int, reserved: int, *, dir_synced: bool = False,
                 dense: int | None = None) -> None:
        self.name = name
        self.fd = fd
        self.reserved = reserved
        self.dense = reserved if dense is None else dense
        self.scattered = 0
        self.refs = 1
        self.dir_synced = dir_synced  # its directory entry has been fsync'd
        self.unflushed = 0  # bytes written since write-behind last started writing them out

    def wrote(self, nbytes: int) -> None:
        """Count ``nbytes`` written; past ``WRITE_BEHIND_BYTES``, start their write-out (no waiting).

        Only a head start for the fsync that acknowledges the file: durability still comes from that
        fsync, so a kernel or filesystem without ``sync_file_range`` just skips it.
        """
        self.unflushed += nbytes
        if self.unflushed < WRITE_BEHIND_BYTES:
            return
        self.unflushed = 0
        start_write_out(self.fd)

    def __repr__(self) -> str:
        return f"DataFile({self.name}, reserved={self.reserved}, refs={self.refs})"


@dataclass(frozen=True)
class Acked:
    """The acknowledged version: what the key's journal record names."""

    data: DataFile
    size: int
    crc32: int
    seq: int
    mtime: float = 0.0  # the file's mtime when acknowledged: uploaded with it (0: unknown, none sent)


class StagedFile:
    """A file with staged data. Mutated only by the engine, under ``lock`` for data changes."""

    def __init__(
        self,
        key: str,
        *,
        size: int,
        mtime: float,
        may_exist: bool,
        current: DataFile | None = None,
        base: ObjectRef | None = None,
    ) -> None:
        self.key: str | None = key  # None once unlinked (detached): open handles still use it
        self.base = base  # the store version not yet copied in (current is None until then)
        self.origin = base  # the store version it was staged from (None: created through the mount)
        self.commit_failed = False  # the last acknowledgement asked for failed (close or fsync saw it)
        # That failure: the cluster store did not answer in time (write durability cluster), at this
        # monotonic time, with no change to the file since: (time, message), else None.
        self.timed_out: tuple[float, str] | None = None
        self.current = current
        self.acked: Acked | None = None
        self.size = size
        self.mtime = mtime
        self.may_exist = may_exist  # the store may hold this key (then an unlink must delete it)
        self.unacked = False  # modified since the last acknowledgement
        self.holders = 0  # open handles (dispose only when none is left)
        self.clean_ref: ObjectRef | None = None  # the store version equal to our bytes, once uploaded
        self.disposed = False
        self.lock = asyncio.Lock()
        # CRC-32 of bytes [0, crc_upto) of the current data file.
        self.crc_upto = 0
        self.crc_value = 0

    def __repr__(self) -> str:
        return (f"StagedFile({self.key!r}, size={self.size}, unacked={self.unacked}, "
                f"acked={self.acked.size if self.acked else None}, disposed={self.disposed})")

    @property
    def detached(self) -> bool:
        return self.key is None

    @property
    def materialized(self) -> bool:
        return self.current is not None

    @property
    def acked_region(self) -> int:
        """Bytes at the start of the current data file that must not change (see the module docstring)."""
        if self.acked is not None and self.acked.data is self.current:
            return self.acked.size
        return 0

    def reset_crc(self, keep_upto: int) -> None:
        """The checksum is valid for at most ``[0, keep_upto)`` now: fall back to a prefix we still know."""
        if self.crc_upto <= keep_upto:
            return
        acked = self.acked
        if acked is not None and acked.data is self.current and acked.size <= keep_upto:
            self.crc_upto, self.crc_value = acked.size, acked.crc32
        else:
            self.crc_upto, self.crc_value = 0, 0

    # -- blocking halves, run in a worker thread under the engine's lock ---------------------------

    def write_sync(self, offset: int, data: bytes) -> None:
        assert self.current is not None
        if offset < self.crc_upto:
            self.reset_crc(offset)
        pwrite_all(self.current.fd, data, offset)
        self.current.wrote(len(data))
        if offset == self.crc_upto:
            self.crc_value = crc32(data, self.crc_value)
            self.crc_upto += len(data)

    def truncate_sync(self, size: int) -> None:
        assert self.current is not None
        os.ftruncate(self.current.fd, size)
        if size < self.crc_upto:
            self.reset_crc(size)
