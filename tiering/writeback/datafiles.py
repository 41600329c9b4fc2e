"""Staged data files: their descriptors, the space reserved for them, and the copies between them.

``DataFiles`` owns every open ``DataFile`` (``staged``) under ``staging/data``: it creates them with
their space reserved, grows the reservation in chunks as a file grows and trims it back when the
file is acknowledged, and closes and unlinks a file (giving its space back) when its last reference
goes. It also does the copying a staged file needs: ``materialize`` (the store's version, through
the block cache, into a new data file on the first change), ``fork`` (copy-on-write of the
acknowledged prefix, I3) and ``sync`` (fsync and the CRC-32 of what is acknowledged, I1).

Space is charged for bytes written, not for a file's length: ``truncate -s 11G`` makes a hole,
which takes no disk, so it reserves nothing and a sparse file far larger than the disk cache can be
made, read (zeros) and written at its end. A data file is charged ``round_up(dense)`` for its prefix
written front to back plus, for writes past that prefix, every block they touch (an upper bound:
rewriting those blocks charges them again), never more than its length rounded up. A copy
(``materialize``, ``fork``) is charged whole: ``copy_file_range`` may fill holes.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
from typing import Any, Callable

from tiering.checksum import crc32
from tiering.engine.blockcache import BlockCache
from tiering.errors import CacheError, ObjectStoreError
from tiering.writeback.journal import StagingDir, copy_range, crc_range, pwrite_all
from tiering.writeback.settings import FS_BLOCK, MATERIALIZE_WINDOW
from tiering.writeback.space import StagingSpace, round_up
from tiering.writeback.staged import Acked, DataFile, StagedFile
from tiering.writeback.stats import WriteBackStats

log = logging.getLogger("tiering.writeback")

# st_blocks counts 512-byte units whatever the filesystem's block size (stat(2)).
STAT_BLOCK_BYTES = 512


class DataFiles:
    def __init__(self, staging: StagingDir, space: StagingSpace, cache: BlockCache, stats: WriteBackStats,
                 spawn: Callable[[Any], None]) -> None:
        self.staging = staging
        self._space = space
        self._cache = cache
        self._spawn = spawn  # runs a coroutine in the background (waited for by stop)
        self._stats = stats
        self._open: set[DataFile] = set()
        # The staging filesystem answered ENOSPC to a write (another program filled it): logged once,
        # then again only after a write has succeeded (the writer sees every ENOSPC; the log one line).
        self.disk_full_logged = False

    def note_write_error(self, key: str | None, exc: OSError) -> None:
        """A write into staged data failed: a full filesystem is logged once per episode."""
        if exc.errno in (errno.ENOSPC, errno.EDQUOT) and not self.disk_full_logged:
            self.disk_full_logged = True
            log.error("write-back: the staging filesystem is full (%s): writes of %r and others fail with "
                      "ENOSPC until space is freed; acknowledged changes are kept and still uploaded",
                      exc.strerror or exc, key)

    async def restore_acked(self, sf: StagedFile, acked: Acked) -> None:
        """Put ``sf`` back to its acknowledged version ``acked``, giving back the space of what came
        after it (the write-back's revert of a file whose writer is gone and whose close failed)."""
        if acked.data is not sf.current:
            acked.data.refs += 1
            if sf.current is not None:
                self.unref(sf.current)
            sf.current = acked.data
        else:
            await asyncio.to_thread(os.ftruncate, acked.data.fd, acked.size)
            self.truncated(acked.data, acked.size)
        sf.size = acked.size
        sf.crc_upto, sf.crc_value = acked.size, acked.crc32
        sf.unacked = sf.commit_failed = False
        self.trim(acked.data, acked.size)

    async def empty(self, sf: StagedFile) -> None:
        """Make ``sf`` an empty file, giving back all of its data space (the revert of a file created
        through the mount and never acknowledged); it stays unacknowledged for its caller to commit."""
        df = sf.current
        if df is not None:
            await asyncio.to_thread(os.ftruncate, df.fd, 0)
            self.truncated(df, 0)
            self.trim(df, 0)
        sf.size = 0
        sf.crc_upto = sf.crc_value = 0
        sf.commit_failed = False

    async def new(self, size: int, *, wait: bool = True) -> DataFile:
        """An empty data file with ``size`` bytes reserved; ``wait=False``: ENOSPC at once if the
        space is not there now, instead of waiting for uploads to free it (``copy_in``)."""
        reserved = round_up(size)
        if wait:
            await self._space.reserve(reserved)
        elif not await self._space.try_reserve(reserved):
            raise OSError(errno.ENOSPC, f"no room in staging for {reserved} bytes now")
        try:
            name, fd = await asyncio.to_thread(self.staging.create_data)
        except BaseException:
            self._space.release(reserved)
            raise
        df = DataFile(name, fd, reserved, dense=size)
        self._open.add(df)
        return df

    async def adopt(self, name: str, size: int) -> DataFile:
        """A data file a journal record names (replay): reopened, the space it occupies reserved even
        past capacity (a sparse file is charged its allocated blocks, not its length)."""
        fd = await asyncio.to_thread(self.staging.open_data, name)
        allocated = (await asyncio.to_thread(os.fstat, fd)).st_blocks * STAT_BLOCK_BYTES
        reserved = min(round_up(size), round_up(allocated))
        await self._space.force(reserved)
        df = DataFile(name, fd, reserved, dir_synced=True, dense=0)
        df.scattered = reserved
        self._open.add(df)
        return df

    @staticmethod
    def charge(df: DataFile, size: int) -> int:
        """What a data file of length ``size`` may occupy: its dense prefix and scattered writes."""
        return min(round_up(size), round_up(df.dense) + df.scattered)

    async def wrote(self, df: DataFile, offset: int, end: int, size: int) -> None:
        """Reserve what a write of ``[offset, end)`` may take, the file's length becoming ``size``.
        Called before the write: if the space is not there, nothing was written."""
        dense, scattered = df.dense, df.scattered
        if end <= dense:
            return
        if offset <= dense:
            dense = end
        else:
            scattered += round_up(end) - (offset // FS_BLOCK) * FS_BLOCK
        need = min(round_up(size), round_up(dense) + scattered) - df.reserved
        if need > 0:
            chunk = max(need, self._space.chunk)
            if chunk > need and await self._space.try_reserve(chunk):
                df.reserved += chunk
            else:
                await self._space.reserve(need)
                df.reserved += need
        df.dense, df.scattered = dense, scattered

    @staticmethod
    def truncated(df: DataFile, size: int) -> None:
        """The file was cut or extended to ``size``: an extension is a hole (nothing to reserve)."""
        if size < df.dense:
            df.dense, df.scattered = size, 0
        elif size == 0:
            df.scattered = 0

    def trim(self, df: DataFile, size: int) -> None:
        keep = self.charge(df, size)
        if df.reserved > keep:
            self._space.release(df.reserved - keep)
            df.reserved = keep

    def unref(self, df: DataFile) -> None:
        df.refs -= 1
        if df.refs == 0:
            self._open.discard(df)
            self._spawn(self._destroy(df))

    async def _destroy(self, df: DataFile) -> None:
        def close_and_unlink() -> None:
            close_fd(df)
            self.staging.unlink_data(df.name)

        try:
            await asyncio.to_thread(close_and_unlink)
        except OSError as exc:
            log.warning("write-back: cannot remove staged data file %s: %s", df.name, exc)
        self._space.release(df.reserved)
        df.reserved = 0

    def close_all(self) -> None:
        """At stop (or a simulated crash): close every descriptor; the files stay for the next mount."""
        for df in list(self._open):
            close_fd(df)
        self._open.clear()

    def sync(self, sf: StagedFile, df: DataFile, size: int) -> int:
        """fsync the data (and, once, its directory entry); the CRC-32 of its ``size`` bytes. Blocking."""
        os.fsync(df.fd)
        if not df.dir_synced:
            self.staging.sync_data_dir()
            df.dir_synced = True
        if sf.crc_upto < size:
            sf.crc_value = crc_range(df.fd, sf.crc_upto, size, sf.crc_value)
            sf.crc_upto = size
        return sf.crc_value

    async def copy_in(self, sf: StagedFile) -> None:
        """The store's version into staging now, if open handles hold ``sf`` and it was only staged to
        be copied on its first change: its object is about to be deleted or replaced (unlink, or a
        rename of or over it), and the handles keep its content (with an upload delay of 0 the delete
        or put can land before their next request would have copied it). Best effort, and never a
        wait: a store that cannot be read now, or staging with no room now, leaves the copy to the
        first write, as before (which then fails if the object went). The caller must not hold the
        key's lock: a commit holds ``sf.lock`` and then takes it."""
        if sf.holders == 0 or sf.current is not None or sf.base is None:
            return
        async with sf.lock:
            if sf.current is None and sf.base is not None:
                try:
                    await self.materialize(sf, sf.size, wait=False)
                except (CacheError, OSError) as exc:
                    log.warning("write-back: could not keep the content of %r for its open handles before its "
                                "object goes: %s", sf.key, exc)

    async def materialize(self, sf: StagedFile, upto: int, *, wait: bool = True) -> None:
        """Copy the first ``upto`` bytes of the store version into a new data file (first modification)."""
        base = sf.base
        assert base is not None
        df = await self.new(upto, wait=wait)
        block = self._cache.block_size
        count = -(-upto // block)
        crc = 0
        try:
            for first in range(0, count, MATERIALIZE_WINDOW):
                indexes = range(first, min(count, first + MATERIALIZE_WINDOW))
                blocks = await asyncio.gather(*(self._cache.get_block(base, i) for i in indexes))
                parts = []
                for index, data in zip(indexes, blocks):
                    want = min(block, upto - index * block)
                    if len(data) < want:
                        raise ObjectStoreError(f"short block {index} of {base.key!r} while copying it into staging")
                    parts.append(data[:want])
                chunk = b"".join(parts)
                crc = await asyncio.to_thread(_write_crc, df.fd, chunk, first * block, crc)
        except BaseException:
            self.unref(df)
            raise
        self._stats.copy_on_write_bytes += upto
        sf.current, sf.base, sf.size = df, None, upto
        sf.crc_upto, sf.crc_value = upto, crc

    async def fork(self, sf: StagedFile, keep: int) -> None:
        """Copy-on-write: continue in a copy of the current data file's first ``keep`` bytes (I3)."""
        old = sf.current
        assert old is not None
        df = await self.new(keep)
        try:
            await asyncio.to_thread(copy_range, old.fd, df.fd, keep)
        except BaseException:
            self.unref(df)
            raise
        self._stats.copy_on_write_bytes += keep
        sf.reset_crc(keep)
        sf.current = df
        self.unref(old)


def close_fd(df: DataFile) -> None:
    if df.fd >= 0:
        fd, df.fd = df.fd, -1
        with contextlib.suppress(OSError):
            os.close(fd)


def _write_crc(fd: int, data: bytes, offset: int, crc: int) -> int:
    pwrite_all(fd, data, offset)
    return crc32(data, crc)
