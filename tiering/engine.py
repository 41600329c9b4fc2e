"""The tiered block cache: RAM, then local disk, then the object store.

``BlockCache.read(ref, offset, length)`` splits a read into blocks and gets them concurrently. Each
block is looked up in the RAM tier (on the loop: a dict access), then in the disk tier (in a worker
thread), then fetched from the store with one ranged GET. A fetched block goes to both tiers; a disk
hit is promoted to RAM.

Single flight: the first miss on a block starts one *load task* and records its future; every other
reader of the same block awaits that future, so concurrent misses cause one GET. The load runs as
its own task, so a reader that is interrupted does not cancel the fetch others wait on.

Memory bound: a load holds one of ``max_concurrent_fetches`` slots from before its GET until its
block is written to disk, so at most that many blocks are in flight beyond the RAM tier. Read-ahead
loads take the same slots.

A failing disk tier is a miss, never an error: the tier itself turns ``OSError`` into a miss and
tracks its health. The engine does not rely on that alone: whatever a disk-tier call raises is
counted in ``disk_errors``, logged (with its traceback the first time) and taken as a miss or a
skipped write, so a broken or buggy tier costs speed, never a read. A failing store is an error for
the reader: ``ObjectStoreError`` with its errno, after at most ``fetch_timeout_s``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable, TypeVar

from tiering.blocks import BlockKey, ObjectRef, block_count, block_range, spans
from tiering.errors import ObjectStoreError, ObjectStoreUnavailableError
from tiering.protocols import BlockTier, ObjectStore
from tiering.settings import CacheSettings

log = logging.getLogger(__name__)

# A read-ahead window may use at most this fraction of the RAM tier: prefetched blocks land in RAM,
# and a window larger than the tier evicts its own blocks before they are read (measured: a 64 MiB
# RAM tier with a 128 MiB window read the disk tier at 80 MiB/s instead of hundreds). A quarter
# leaves room for a few concurrent streams and the blocks they are reading now.
READAHEAD_RAM_FRACTION = 4

T = TypeVar("T")


@dataclass
class EngineStats:
    """Block requests and where they were served from (one count per block a read touched)."""

    block_requests: int = 0
    ram_served: int = 0
    disk_served: int = 0
    store_fetches: int = 0
    store_fetch_bytes: int = 0
    fetch_errors: int = 0
    readahead_blocks: int = 0
    readahead_bytes: int = 0
    singleflight_joins: int = 0
    disk_errors: int = 0  # disk-tier calls that raised instead of answering (each one a miss)


class BlockCache:
    def __init__(
        self,
        settings: CacheSettings,
        store: ObjectStore,
        ram: BlockTier,
        disk: BlockTier | None = None,
    ) -> None:
        self.settings = settings
        self.block_size = settings.block_size
        self.store = store
        self.ram = ram
        self.disk = disk
        self.stats = EngineStats()
        self._inflight: dict[BlockKey, asyncio.Future[bytes]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(settings.max_concurrent_fetches)

    @property
    def readahead_limit(self) -> int:
        """The largest read-ahead window: the configured one, bounded by a share of the RAM tier."""
        limit = self.settings.readahead_max_bytes
        if self.ram.capacity_bytes > 0:
            limit = min(limit, self.ram.capacity_bytes // READAHEAD_RAM_FRACTION)
        return limit

    # ------------------------------------------------------------------ reads
    async def read(self, ref: ObjectRef, offset: int, length: int, readahead_bytes: int = 0) -> bytes:
        """Bytes ``[offset, offset+length)`` of ``ref``, clipped to its size.

        ``readahead_bytes`` past the end of the read are prefetched; the loads this read needs are
        started first, so they get fetch slots before read-ahead does.
        """
        parts = list(spans(offset, length, ref.size, self.block_size))
        pending = [self._block(ref, span.index) for span in parts]
        if readahead_bytes > 0:
            self.prefetch(ref, offset + length, readahead_bytes)
        if not parts:
            return b""
        blocks = [b if isinstance(b, bytes) else await asyncio.shield(b) for b in pending]
        if len(parts) == 1:
            return blocks[0][parts[0].start : parts[0].end]
        return b"".join(memoryview(b)[s.start : s.end] for b, s in zip(blocks, parts))

    async def get_block(self, ref: ObjectRef, index: int) -> bytes:
        """One whole block, from the fastest tier that has it."""
        block = self._block(ref, index)
        return block if isinstance(block, bytes) else await asyncio.shield(block)

    def _block(self, ref: ObjectRef, index: int) -> bytes | asyncio.Future[bytes]:
        """The block's bytes if in RAM, else the future of its (possibly already running) load."""
        key = BlockKey(ref.key, ref.etag, index)
        self.stats.block_requests += 1
        data = self.ram.get(key)
        if data is not None:
            self.stats.ram_served += 1
            return data
        fut = self._inflight.get(key)
        if fut is None:
            return self._start_load(ref, key)
        self.stats.singleflight_joins += 1
        return fut

    def prefetch(self, ref: ObjectRef, offset: int, length: int) -> int:
        """Start loads (without waiting) for the blocks of a byte range not yet cached or in flight.

        Returns the number of loads started.
        """
        if length <= 0 or offset >= ref.size:
            return 0
        first = offset // self.block_size
        last = min(block_count(ref.size, self.block_size), (offset + length + self.block_size - 1) // self.block_size)
        started = 0
        for index in range(first, last):
            key = BlockKey(ref.key, ref.etag, index)
            if key in self._inflight or self.ram.contains(key):
                continue
            self._start_load(ref, key, readahead=True)
            started += 1
        return started

    def is_cached(self, key: BlockKey) -> bool:
        return self.ram.contains(key) or (self.disk is not None and self.disk.contains(key))

    # ------------------------------------------------------------------ loading
    def _start_load(self, ref: ObjectRef, key: BlockKey, readahead: bool = False) -> asyncio.Future[bytes]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bytes] = loop.create_future()
        # A future nobody awaits (read-ahead) must not log "exception was never retrieved".
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._inflight[key] = fut
        task = loop.create_task(self._load(ref, key, fut, readahead))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return fut

    async def _load(self, ref: ObjectRef, key: BlockKey, fut: asyncio.Future[bytes], readahead: bool) -> None:
        try:
            if self.disk is not None:
                data = await self._disk_call("get", self.disk.get, key)
                if data is not None:
                    self.stats.disk_served += 1
                    self.ram.put(key, data)
                    fut.set_result(data)
                    return
            async with self._slots:
                data = await self._fetch(ref, key)
                if readahead:
                    self.stats.readahead_blocks += 1
                    self.stats.readahead_bytes += len(data)
                self.ram.put(key, data)
                fut.set_result(data)
                # Readers are served; the block stays in a fetch slot until it is on disk, which is
                # what bounds memory in flight.
                self._inflight.pop(key, None)
                if self.disk is not None:
                    await self._disk_call("put", self.disk.put, key, data)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting readers
            if not fut.done():
                if isinstance(exc, asyncio.CancelledError):
                    fut.cancel()
                else:
                    fut.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            if self._inflight.get(key) is fut:
                del self._inflight[key]

    async def _disk_call(self, what: str, call: Callable[..., T], *args: object) -> T | None:
        """Run one disk-tier call in a worker thread; a tier that raises is a miss, never an error."""
        try:
            return await asyncio.to_thread(call, *args)
        except Exception:  # noqa: BLE001 - a cache tier must never fail a read
            self.stats.disk_errors += 1
            if self.stats.disk_errors == 1:
                log.warning("disk tier %s failed; treating it as a miss", what, exc_info=True)
            else:
                log.debug("disk tier %s failed", what, exc_info=True)
            return None

    async def _fetch(self, ref: ObjectRef, key: BlockKey) -> bytes:
        start, end = block_range(key.index, ref.size, self.block_size)
        timeout = self.settings.fetch_timeout_s
        try:
            data = await asyncio.wait_for(self.store.get_range(ref.key, ref.etag, start, end), timeout)
        except TimeoutError as exc:
            self.stats.fetch_errors += 1
            raise ObjectStoreUnavailableError(
                f"object store did not answer within {timeout:g} s reading {ref.key!r}"
            ) from exc
        except ObjectStoreError:
            self.stats.fetch_errors += 1
            raise
        if len(data) != end - start:
            self.stats.fetch_errors += 1
            raise ObjectStoreError(f"short read of {ref.key!r}: got {len(data)} of {end - start} bytes")
        self.stats.store_fetches += 1
        self.stats.store_fetch_bytes += len(data)
        return data

    async def close(self) -> None:
        """Wait for loads in progress (so their disk writes complete), bounded by the fetch timeout."""
        tasks = list(self._tasks)
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=self.settings.fetch_timeout_s)
            for task in pending:
                task.cancel()

    # ------------------------------------------------------------------ stats
    def hit_ratio(self) -> float:
        served = self.stats.ram_served + self.stats.disk_served
        total = served + self.stats.store_fetches
        return served / total if total else 0.0
