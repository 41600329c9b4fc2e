"""A disk-tier hit served by the thread that asked, off the loop, and answered from that thread's buffer.

Why. A READ of a small file whose block is on the disk tier only used to take the whole load path: a
task for the read, a load task, a hop to asyncio's thread pool for the file read, a hop back to the
loop (``call_soon_threadsafe``), a fresh buffer for the block (a new 100 KiB of memory: page faults
and zero-fill, ~50 us here), the block put in the RAM tier, and the reply written by the loop. On the
2-core VM that was 1.0-2.0 ms of daemon CPU per 100 KiB file (docs/dataplane.md, "A disk-tier hit,
profiled"), most of it thread switches and the memory of a copy nobody reads again: the kernel keeps
what the reply gives it in the mount's page cache, and the block file's pages stay in its own.

How. ``BlockCache.disk_hit`` answers, on the loop's state (the event loop, or a FUSE reader thread
holding the loop's state lock), whether a read can be served this way: it asks for exactly one whole
block, at most ``MAX_REPLY_BLOCK_BYTES``, which the RAM tier does not hold, no load is loading, and
the disk tier's index has. Then ``run`` (the caller's thread, *without* the state lock: the file read
may wait for the device) reads the block file into that thread's reply buffer
(``DiskBlockTier.get_for_reply``: one read, checked as every disk-tier read is), and ``finish`` (with
the state lock again) counts it as a disk-tier hit and returns a view of that buffer, which the caller
writes as its reply before it reads its next request. A miss (evicted meanwhile, corrupt, a failing
disk) returns None from ``finish``: the caller then reads the ordinary way, which loads the block
from below.

What it does not do: put the block in the RAM tier (the reader that asked has it, in the kernel's
page cache; a read of part of a block, which more reads of the same block follow, is not served here
and goes through RAM as before), or join a load of the same block (a read that finds one in flight
is not served here either; two readers of one block at the same moment may both read its file, which
costs a read, never a wrong answer). A disk tier that raises is a miss, counted in
``EngineStats.disk_errors`` as ``GuardedDisk`` counts it.
"""

from __future__ import annotations

from tiering.blocks import BlockData, BlockKey
from tiering.engine.diskguard import GuardedDisk
from tiering.engine.stats import EngineStats
from tiering.traffic import DISK, ReadTraffic

# The largest block served from a thread's reply buffer: a FUSE READ asks for at most 1 MiB
# (``cachefs.fuse.session.MAX_WRITE``), so a whole block a READ covers is no larger; each reader
# thread's buffer grows to this at most (``tiering.buffers.reply_scratch``).
MAX_REPLY_BLOCK_BYTES = 1024 * 1024


class DiskHit:
    """One block read for a reply by the calling thread (see the module docstring)."""

    __slots__ = ("_disk", "_stats", "_traffic", "key", "_data", "_error")

    def __init__(self, disk: GuardedDisk, stats: EngineStats, traffic: ReadTraffic, key: BlockKey) -> None:
        self._disk = disk
        self._stats = stats
        self._traffic = traffic
        self.key = key
        self._data: BlockData | None = None
        self._error: Exception | None = None

    def run(self) -> None:
        """Read the block into this thread's reply buffer: without the state lock (it may wait for the
        device); never raises (what the tier raises is kept for ``finish`` to count)."""
        try:
            self._data = self._disk.tier.get_for_reply(self.key)
        except Exception as exc:  # noqa: BLE001 - a cache tier must never fail a read
            self._error = exc

    def stalled(self, seconds: float) -> None:
        """``run`` has not returned for ``seconds`` (called from another thread): the disk tier is taken
        down at once, so that no other read waits on the device (``DiskTier.contains`` then says no)."""
        self._disk.tier.health.record_stall(f"a block read has not returned for {seconds:.0f} s")

    def finish(self) -> BlockData | None:
        """With the state lock again: the block (a view of this thread's reply buffer, for a reply
        written before the thread's next read), counted as a disk-tier hit; None on a miss."""
        if self._error is not None:
            self._disk.failed("get", self._error)
            self._error = None
            return None
        data = self._data
        if data is None:
            return None
        stats, n = self._stats, len(data)
        stats.block_requests += 1
        stats.disk_served += 1
        stats.ram_miss_bytes += n
        self._disk.tier.stats.hit_bytes += n
        self._traffic.hit(self.key, DISK, n)
        return data
