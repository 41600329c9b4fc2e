"""Fetching ahead of announced read orders (``tiering.policy.readorder``) with the engine's fetch slots.

One task for the mount. Each round it asks every stream for the entries that fit in its share of
the window (``ReadOrder.ahead``: the window is split evenly between the streams, so several
DataLoader workers or ranks share one bound), taking one entry per stream in turn so no stream
starves the others, and starts a load for each of their blocks (``BlockCache.start_ahead``: the
same single-flight table and fetch slots as reads, so a reader arriving while its block is being
fetched joins that fetch). Then it sleeps until the order changes: an announce, or an open that
moves a stream's position and so frees room in its window.

Priority: announced loads take at most ``SLOT_SHARE`` of the engine's fetch slots (their own
semaphore, acquired before the engine's), so a read that misses always finds a slot soon instead
of queueing behind a whole window of announced loads.

Window: the configured bytes, bounded by a quarter of what the cache can hold (the disk tier up to
its low watermark, else RAM): blocks fetched ahead must still be there when the reader arrives, and
a window larger than the cache would evict its own blocks (farthest first, so the waste stays
bounded, but it is waste). What the window does not take keeps data the order needs again later.

A failed announced load is counted and forgotten: the reader's own read fetches the block again and
gets the error, if any, itself.
"""

from __future__ import annotations

import asyncio
import logging

from tiering.engine.blockcache import BlockCache
from tiering.blocks import BlockData, ObjectRef, block_count
from tiering.policy.readorder import ReadOrder

log = logging.getLogger(__name__)

# Announced loads may hold at most this share of the fetch slots: three quarters keeps the store
# busy for the order while a quarter stays free for reads that miss (a reader that diverged).
SLOT_SHARE = 0.75
# The window may take at most 1/WINDOW_CACHE_SHARE of the cache. Measured (benchmarks/announce.py,
# 2,000 x 100 KiB, disk tier half the dataset, 3 shuffled epochs announced): with half the cache the
# later epochs saved 31% of their GETs, with a quarter 40%, where 42% of the dataset fits (LRU: 13%);
# the window's blocks push out data the order needs again. Both kept every open a hit (0 stalls).
WINDOW_CACHE_SHARE = 4


def window_limit(cache: BlockCache, configured: int) -> int:
    """The window actually used: ``configured``, at most a share of what the cache holds."""
    disk = cache.disk
    room = int(disk.capacity_bytes * disk.low_watermark) if disk is not None else cache.ram.capacity_bytes
    return max(0, min(configured, room // WINDOW_CACHE_SHARE))


class OrderPrefetcher:
    def __init__(self, order: ReadOrder, cache: BlockCache, *, window_bytes: int | None = None) -> None:
        self.order = order
        self.cache = cache
        self.window_bytes = window_limit(cache, order.settings.window_bytes if window_bytes is None else window_bytes)
        order.window_limit_bytes = self.window_bytes
        self.slot_count = max(1, int(cache.settings.max_concurrent_fetches * SLOT_SHARE))
        self._slots = asyncio.Semaphore(self.slot_count)
        # The loads started and not yet settled (their futures are the engine's, shared with readers).
        self._loads: set[asyncio.Future[BlockData]] = set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None and self.window_bytes > 0:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop starting loads; those started go on (the engine's, shared with readers, ended by its close)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            self.order.changed.clear()
            await self.round()
            await self.order.changed.wait()

    async def round(self) -> int:
        """Start the loads every stream's window has room for; returns the entries handed out."""
        streams = self.order.streams()
        if not streams:
            return 0
        share = max(1, self.window_bytes // len(streams))
        handed = 0
        busy = True
        while busy:
            busy = False
            for stream in streams:
                if not self.order.holds(stream):
                    continue  # ended or replaced meanwhile
                for ref in self.order.ahead(stream, share, limit=1):
                    busy = True
                    handed += 1
                    # A file larger than the share is fetched up to the share: its read-ahead does the rest.
                    blocks = min(block_count(ref.size, self.cache.block_size), max(1, share // self.cache.block_size))
                    for index in range(blocks):
                        await self._slots.acquire()
                        self._start(ref, index)
        return handed

    def _start(self, ref: ObjectRef, index: int) -> None:
        """One block's load, holding one of the slots until it settles. A callback on the engine's
        future, not a task awaiting it: a task and a shield per block were a quarter of the loop's
        bookkeeping per announced block (measured alone: 35-38 -> 27 us)."""
        try:
            fut = self.cache.start_ahead(ref, index)
        except Exception as exc:  # noqa: BLE001 - the reader's own read fetches it again
            self._slots.release()
            self._failed(ref, index, exc)
            return
        if fut is None:  # in RAM already
            self._slots.release()
            return
        self._loads.add(fut)
        fut.add_done_callback(lambda done: self._settled(done, ref, index))

    def _settled(self, fut: asyncio.Future[BlockData], ref: ObjectRef, index: int) -> None:
        self._loads.discard(fut)
        self._slots.release()
        if fut.cancelled():
            return  # (the engine closing, or the load abandoned: nothing to count)
        exc = fut.exception()
        if exc is None:
            self.order.stats.prefetched_blocks += 1
        else:
            self._failed(ref, index, exc)

    def _failed(self, ref: ObjectRef, index: int, exc: BaseException) -> None:
        self.order.stats.prefetch_errors += 1
        log.debug("announced load of %r block %d failed: %s", ref.key, index, exc)

    async def drain(self) -> None:
        """Wait for the loads started so far (tests)."""
        while self._loads:
            await asyncio.wait(list(self._loads))  # (never cancels them: they are the engine's)
