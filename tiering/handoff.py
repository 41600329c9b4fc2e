"""Work on a block's bytes done in the thread that received them: one thread handoff fewer per block.

Why. A cold small file used to wake four threads: the loop handed the GET to a store worker, the
worker handed the bytes back, the loop handed the disk-tier write to a thread of asyncio's pool and
that thread handed its outcome back. On 2 cores with 23 threads those handoffs were the largest single
cost ``perf`` found (docs/dataplane.md, "Small files, profiled"). The worker that received the bytes
is already awake, holds them, and is done with its request: it can write the disk-tier file itself,
right after it has handed the bytes to the loop, so the readers wait for nothing more than before.

How. The engine makes an ``AfterReceive`` around a blocking call (the guarded disk-tier put) and
passes it to the store's ``get_range``. A store that receives off the loop (S3's presigned path,
``tiering.objectstore.getengines``) *claims* it in the receiving thread, before the bytes are handed
over, for an answer it will return (the exact range, the ETag asked for), and runs it after the
handover: in the same worker (``RangedGetter``, large blocks), or in libcurl's one thread once the
answers of its turn are handed over (``CurlGetter``, small ones; a pool beside it measured dearer);
the outcome comes back to the loop with one ``call_soon_threadsafe``. Any other store,
or an answer it does not return (a fallback through botocore, an error), leaves it unclaimed, and the
engine does the work as before (``GuardedDisk.put``, asyncio's pool). So ``claimed`` is read by the
engine only after ``get_range`` returned: whoever claimed did so before that.

The work never raises into the worker: whatever it raises is the outcome (``result`` raises it on
the loop, where the engine counts it as a failed disk write, a miss, never a reader's error).
"""

from __future__ import annotations

import asyncio
from typing import Callable, Generic, TypeVar

from tiering.blocks import BlockData

T = TypeVar("T")


class AfterReceive(Generic[T]):
    """``work(data)``, run once by whoever claims it: a store's worker thread, or else the engine."""

    def __init__(self, work: Callable[[BlockData], T]) -> None:
        self.work = work
        self.claimed = False
        self._loop = asyncio.get_running_loop()
        self._outcome: asyncio.Future[T] = self._loop.create_future()
        # Nobody awaits the outcome of a load that was cancelled meanwhile: no "never retrieved" log.
        self._outcome.add_done_callback(lambda f: f.cancelled() or f.exception())

    def claim(self) -> None:
        """In the receiving thread, before it hands the bytes over: it will ``run`` the work."""
        self.claimed = True

    def run(self, data: BlockData) -> None:
        """In the receiving thread, after it handed the bytes over: the work, its outcome to the loop."""
        try:
            outcome: T = self.work(data)
        except BaseException as exc:  # noqa: BLE001 - the loop's to judge (result raises it there)
            self._settle(None, exc)
        else:
            self._settle(outcome, None)

    def _settle(self, outcome: T | None, error: BaseException | None) -> None:
        if self._loop.is_closed():
            return
        try:
            self._loop.call_soon_threadsafe(self._set, outcome, error)
        except RuntimeError:
            pass  # the loop closed in between: nobody waits any more

    def _set(self, outcome: T | None, error: BaseException | None) -> None:
        if self._outcome.done():
            return  # the waiting load was cancelled
        if error is not None:
            self._outcome.set_exception(error)
        else:
            self._outcome.set_result(outcome)  # type: ignore[arg-type]

    async def result(self) -> T:
        """The claimed work's outcome (raises what it raised); on the loop, once claimed."""
        assert self.claimed, "only claimed work has an outcome to wait for"
        return await asyncio.shield(self._outcome)
