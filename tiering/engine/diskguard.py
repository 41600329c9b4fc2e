"""The disk tier as the engine calls it: in a worker thread, and a failure is a miss, never an error.

The tier guards itself (it turns ``OSError`` into a miss and tracks its health), but the engine does
not rely on that alone: whatever a disk-tier call raises is counted in ``EngineStats.disk_errors``,
logged (with its traceback the first time, at debug level after) and answered as a miss or a write
that did not happen, so a broken or buggy tier costs speed, never a read.

``GuardedDisk`` owns no state of its own beyond the tier it wraps and the counter it adds to. Its
``get``, ``put`` and ``run`` are called on the event loop and run the tier's call in asyncio's default
thread pool (blocking disk calls never run on the loop); ``absent`` is an index lookup in memory,
answered on the loop with no I/O. The loads, promotion and evict of the block cache share one.

``put_after_receive`` is the same put, offered to the store's worker thread that receives the block
(``tiering.handoff``): a small block is then written by the thread that has it, with no hop to the
pool and back; ``finish_put`` waits for it, guarded the same way, or makes the put itself where no
worker claimed it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, TypeVar

from tiering.blocks import BlockData, BlockKey
from tiering.engine.stats import EngineStats
from tiering.handoff import AfterReceive
from tiering.protocols import DiskBlockTier

log = logging.getLogger(__name__)

T = TypeVar("T")


class GuardedDisk:
    def __init__(self, tier: DiskBlockTier, stats: EngineStats) -> None:
        self.tier = tier
        self._stats = stats

    def absent(self, key: BlockKey) -> bool:
        """Whether the disk tier surely lacks the block; on any doubt (it raised) ask ``get``, which is guarded."""
        try:
            return self.tier.absent(key)
        except Exception:  # noqa: BLE001 - the guarded get path logs and counts the failure
            return False

    async def get(self, key: BlockKey) -> BlockData | None:
        return await self.run("get", self.tier.get, key)

    async def peek(self, key: BlockKey) -> BlockData | None:
        """``DiskBlockTier.peek`` in a thread (a read for the cluster write-behind, not a reader's)."""
        return await self.run("get", self.tier.peek, key)

    async def put(self, key: BlockKey, data: BlockData) -> bool | None:
        return await self.run("put", self.tier.put, key, data)

    def put_after_receive(self, key: BlockKey) -> AfterReceive[bool]:
        """The put of ``key``'s block, for the thread that receives it to make (``finish_put``)."""
        tier = self.tier
        return AfterReceive(lambda data: tier.put(key, data))

    async def finish_put(self, key: BlockKey, data: BlockData, put: AfterReceive[bool] | None) -> bool | None:
        """The outcome of ``put`` where a receiving thread claimed it, else the put made here."""
        if put is None or not put.claimed:
            return await self.put(key, data)
        try:
            return await put.result()
        except Exception:  # noqa: BLE001 - a cache tier must never fail a read
            self.failed("put")
            return None

    async def run(self, what: str, call: Callable[..., T], *args: object) -> T | None:
        """Run one disk-tier call in a worker thread; a tier that raises is a miss, never an error."""
        try:
            return await asyncio.to_thread(call, *args)
        except Exception:  # noqa: BLE001 - a cache tier must never fail a read
            self.failed(what)
            return None

    def failed(self, what: str, exc: BaseException | None = None) -> None:
        """Count and log a disk-tier call that raised (``exc``, or the one being handled: in an
        ``except`` block, logs its traceback)."""
        self._stats.disk_errors += 1
        info: BaseException | bool = exc if exc is not None else True
        if self._stats.disk_errors == 1:
            log.warning("disk tier %s failed; treating it as a miss", what, exc_info=info)
        else:
            log.debug("disk tier %s failed", what, exc_info=info)
