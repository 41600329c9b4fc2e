"""The live staged files by key, and when their data goes: detach, dispose, unload, promote.

``StagedFiles`` owns the map of attached staged files (the file a key names now; open handles may
still hold detached ones) and decides when a staged file's data files are released: a file is
*disposed* once it is clean (no pending operation names it, nothing unacknowledged) and no handle
holds it; under space pressure the staged copy of a clean file still held open is *unloaded* (reads
fetch it from the store again); an uploaded version small enough is first *promoted* into the disk
tier through ``BlockCache.promote``, so reading back what was just written needs no GET.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
from typing import Callable, Iterator

from tiering.blocks import ObjectRef
from tiering.engine.blockcache import BlockCache
from tiering.protocols import ObjectInfo
from tiering.writeback.datafiles import DataFiles
from tiering.writeback.journal import pread_exact
from tiering.writeback.pending import PendingIndex
from tiering.writeback.staged import Acked, StagedFile
from tiering.writeback.stats import WriteBackStats

log = logging.getLogger("tiering.writeback")

# An uploaded file up to this size is also copied into the disk tier as clean blocks under its new
# ETag (read-after-upload served locally, the staged copy goes). Larger ones (checkpoints, rarely read
# back at once) are not written a second time: their staged copy is just dropped.
PROMOTE_MAX_BYTES = 256 * 1024 * 1024


class StagedFiles:
    def __init__(self, index: PendingIndex, datafiles: DataFiles, cache: BlockCache, stats: WriteBackStats,
                 space_waiters: Callable[[], int]) -> None:
        self._index = index
        self._datafiles = datafiles
        self._cache = cache
        self._stats = stats
        self._space_waiters = space_waiters
        self._by_key: dict[str, StagedFile] = {}  # live (attached, not disposed) staged files by key

    def get(self, key: str) -> StagedFile | None:
        return self._by_key.get(key)

    def add(self, sf: StagedFile) -> None:
        assert sf.key is not None
        self._by_key[sf.key] = sf

    def rename(self, sf: StagedFile, src: str, dst: str) -> None:
        del self._by_key[src]
        sf.key = dst
        self._by_key[dst] = sf

    def __iter__(self) -> Iterator[StagedFile]:
        return iter(list(self._by_key.values()))

    def detach(self, sf: StagedFile) -> None:
        """The key no longer names this file (unlink, replaced): open handles keep its data alone."""
        if sf.key is not None and self._by_key.get(sf.key) is sf:
            del self._by_key[sf.key]
        sf.key = None
        if sf.acked is not None:
            data, sf.acked = sf.acked.data, None
            self._datafiles.unref(data)

    async def keep_for_handles(self, key: str) -> None:
        """``key``'s object is about to be deleted or replaced (unlink, rename): the open handles of
        its staged file keep its content (``DataFiles.copy_in``)."""
        sf = self._by_key.get(key)
        if sf is not None:
            await self._datafiles.copy_in(sf)

    @contextlib.contextmanager
    def held(self, sf: StagedFile) -> Iterator[None]:
        """Hold for the duration of one operation only: releasing it acknowledges nothing (an
        ``open(O_TRUNC)`` truncates before its handle exists, and must not acknowledge the empty file)."""
        sf.holders += 1
        try:
            yield
        finally:
            sf.holders -= 1
            if sf.holders == 0 and not sf.unacked:
                self.maybe_dispose(sf)

    def maybe_dispose(self, sf: StagedFile) -> None:
        """Drop a staged file's data once it is clean (or unlinked) and no handle is open."""
        if sf.disposed or sf.holders > 0:
            return
        if sf.key is not None:
            entry = self._index.get(sf.key)
            if (entry is not None and entry.sf is sf) or sf.unacked:
                return
        sf.disposed = True
        if sf.key is not None and self._by_key.get(sf.key) is sf:
            del self._by_key[sf.key]
        for df in (sf.acked.data if sf.acked else None, sf.current):
            if df is not None:
                self._datafiles.unref(df)
        sf.acked = None
        sf.current = None

    def unload_clean(self) -> int:
        """Under space pressure: drop the staged copy of clean files still held open (their bytes are
        in the store; reads and a later write fetch them again). Files busy in a write are skipped."""
        freed = 0
        for sf in list(self._by_key.values()):
            ref = sf.clean_ref
            if ref is None or sf.unacked or sf.current is None or sf.lock.locked() or sf.key is None:
                continue
            entry = self._index.get(sf.key)
            if entry is not None and entry.sf is sf:
                continue
            freed += sf.current.reserved
            self._datafiles.unref(sf.current)
            sf.current, sf.base, sf.clean_ref = None, ref, None
            sf.crc_upto = sf.crc_value = 0
        return freed

    def promotable(self, acked: Acked, info: ObjectInfo) -> bool:
        disk = self._cache.disk
        return (disk is not None and 0 < acked.size <= PROMOTE_MAX_BYTES and info.size == acked.size
                and acked.size <= disk.capacity_bytes // 4 and not self._space_waiters())

    async def promote(self, sf: StagedFile, acked: Acked, info: ObjectInfo) -> None:
        """Copy an uploaded version into the disk tier as clean blocks under its new ETag. Its
        acknowledged prefix stays copy-on-write meanwhile (``sf.acked`` is kept, and the caller took
        one more reference, dropped here), so the blocks are exactly the uploaded bytes."""
        try:
            self._stats.promoted_bytes += await self._cache.promote(
                ObjectRef(info.key, info.etag, info.size), functools.partial(read_range, acked.data.fd))
        except Exception as exc:  # noqa: BLE001 - a cache fill is an optimisation, never an error
            log.debug("write-back: could not cache the uploaded %r: %s", info.key, exc)
        finally:
            if sf.acked is acked:
                sf.acked = None
                self._datafiles.unref(acked.data)
            self._datafiles.unref(acked.data)
            self.maybe_dispose(sf)


def read_range(fd: int, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of an acknowledged data file (the source of an upload or a promotion)."""
    data = pread_exact(fd, end - start, start)
    if len(data) != end - start:
        raise OSError(errno.EIO, f"staged data file is shorter than its acknowledged size ({start + len(data)})")
    return data
