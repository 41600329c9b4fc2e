"""Staging space: the bytes write-back holds in the ``SpaceBudget`` (the disk tier), and writers'
back-pressure when it is full.

Staged data is never evicted (invariant I6 of ``tiering.writeback.facade``): its bytes are reserved
before they are written and given back only when the data file (or journal record) is gone. When
the budget is full, a writer waits for uploads to free space (``on_full`` makes uploads start at
once and drops the staged copies of clean files), polling as well, since space also comes back by
routes that do not signal (cache evictions); after ``space_wait_s`` it fails with ENOSPC. Past the
high watermark (``eager_fraction`` of the capacity) ``eager()`` is true: uploads skip their
coalescing delay.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from typing import Callable

from tiering.protocols import SpaceBudget
from tiering.writeback.events import wait_event
from tiering.writeback.settings import FS_BLOCK, RESERVE_CHUNK
from tiering.writeback.stats import WriteBackStats

log = logging.getLogger("tiering.writeback")


def round_up(n: int, unit: int = FS_BLOCK) -> int:
    return -(-n // unit) * unit


class StagingSpace:
    def __init__(
        self,
        budget: SpaceBudget,
        stats: WriteBackStats,
        *,
        eager_fraction: float,
        space_wait_s: Callable[[], float],
        wake: Callable[[], None],
        on_full: Callable[[], object],
        backlog: Callable[[], str],
    ) -> None:
        self.budget = budget
        self.reserved = 0  # bytes this engine holds in the budget
        self.waiters = 0  # writers waiting for space now
        self._stats = stats
        self.eager_bytes = int(budget.capacity_bytes * eager_fraction)
        self.chunk = min(RESERVE_CHUNK, max(FS_BLOCK, round_up(budget.capacity_bytes // 64)))
        self._space_wait_s = space_wait_s  # read at each wait: settings may be replaced (tests)
        self._wake = wake  # uploads without the coalescing delay
        self._on_full = on_full
        self._backlog = backlog  # what the ENOSPC message says is pending
        self._freed = asyncio.Event()

    def eager(self) -> bool:
        return self.waiters > 0 or self.reserved >= self.eager_bytes

    async def force(self, nbytes: int) -> None:
        """Reserve even past the capacity (replay: the bytes are on disk already)."""
        await asyncio.to_thread(self.budget.reserve_space, nbytes, force=True)
        self.reserved += nbytes

    async def try_reserve(self, nbytes: int) -> bool:
        if not await asyncio.to_thread(self.budget.reserve_space, nbytes):
            return False
        before = self.reserved
        self.reserved += nbytes
        if before < self.eager_bytes <= self.reserved:
            self._wake()  # past the high watermark: upload without the coalescing delay
        return True

    async def reserve(self, nbytes: int) -> None:
        """Reserve ``nbytes``, waiting for uploads to free some (I6); ENOSPC after the wait."""
        if nbytes <= 0:
            return
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        try:
            while True:
                freed = self._freed
                if await self.try_reserve(nbytes):
                    return
                wait_s = self._space_wait_s()
                if deadline is None:
                    deadline = loop.time() + wait_s
                    self.waiters += 1
                    self._stats.space_waits += 1
                    self._wake()  # eager uploads
                    log.info("write-back: staging space is full (%d bytes staged); a writer waits for uploads",
                             self.reserved)
                    self._on_full()
                remaining = deadline - loop.time()
                if remaining <= 0:
                    self._stats.enospc += 1
                    message = (f"write-back staging is full: {self.reserved} of {self.budget.capacity_bytes} bytes "
                               f"of the disk cache are staged data waiting for upload ({self._backlog()}); "
                               f"refusing {nbytes} more bytes after waiting {wait_s:g} s")
                    log.error("%s (ENOSPC)", message)
                    raise OSError(errno.ENOSPC, message)
                # Poll too: space also comes back by routes that do not signal (cache evictions).
                await wait_event(freed, min(remaining, 1.0))
        finally:
            if deadline is not None:
                self.waiters -= 1

    def release(self, nbytes: int) -> None:
        if nbytes <= 0:
            return
        self.budget.release_space(nbytes)
        self.reserved -= nbytes
        freed, self._freed = self._freed, asyncio.Event()
        freed.set()
