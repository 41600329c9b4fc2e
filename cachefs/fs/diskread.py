"""A READ served by the FUSE reader thread that read it, from the disk tier, off the loop.

``CacheFS.read_from_disk_now`` hands the adapter a ``DiskRead`` where the read is one whole block that
only the disk tier holds (``BlockCache.disk_hit``, ``tiering.engine.diskhit``): the reader thread runs
it without the loop's state lock (the block file is read into that thread's reply buffer) and
finishes it with the lock again, which counts the read as ``CacheFS.read`` does and moves the
handle's read-ahead on. Where it is not one (a handle reading staged data or a version changed
through the mount, a range across blocks or of part of one, a block in RAM or being loaded, one not
on the disk tier) it is None, and ``CacheFS.read`` serves the request as a task of the loop.
"""

from __future__ import annotations

from cachefs.fs.handles import FileHandleState
from cachefs.fs.stats import FsStats
from tiering.blocks import BlockData
from tiering.engine.blockcache import BlockCache
from tiering.engine.diskhit import DiskHit


class DiskRead:
    """One READ of ``[offset, offset+size)`` through ``handle``, served by the calling thread."""

    __slots__ = ("_hit", "_handle", "_cache", "_stats", "_offset", "_size")

    def __init__(self, hit: DiskHit, handle: FileHandleState, cache: BlockCache, stats: FsStats,
                 offset: int, size: int) -> None:
        self._hit = hit
        self._handle = handle
        self._cache = cache
        self._stats = stats
        self._offset = offset
        self._size = size

    def run(self) -> None:
        """Read the block (without the state lock); never raises."""
        self._hit.run()

    def stalled(self, seconds: float) -> None:
        """``run`` has not returned for ``seconds``: the disk tier is taken down (``DiskHit.stalled``)."""
        self._hit.stalled(seconds)

    def finish(self) -> BlockData | None:
        """With the state lock: the bytes (valid until this thread's next read, see
        ``tiering.engine.diskhit``), counted; None where ``CacheFS.read`` must serve the request."""
        data = self._hit.finish()
        if data is None:
            return None
        handle, cache = self._handle, self._cache
        end = self._offset + self._size
        window = handle.readahead_window(self._offset, self._size, cache.block_size, cache.readahead_limit)
        if window > 0 and handle.ref is not None:
            cache.read_ahead(handle.ref, end, window)
        self._stats.reads += 1
        self._stats.read_bytes += len(data)
        return data


def read_from_disk(handle: FileHandleState, offset: int, size: int, cache: BlockCache,
                   stats: FsStats) -> DiskRead | None:
    """The ``DiskRead`` of this READ of a handle whose reads are the store version it took, or None."""
    ref = handle.ref
    if ref is None or handle.local_gen != handle.node.local_gen or offset < 0 or size < 0:
        return None  # (staged or changed data, or a bad range: ``CacheFS.read`` answers)
    hit = cache.disk_hit(ref, offset, size)
    return None if hit is None else DiskRead(hit, handle, cache, stats, offset, size)
