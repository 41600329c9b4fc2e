"""The uploader: applies pending operations to the object store, in order per key, with retries.

``Uploader`` is handed ``Entry`` objects (``push``) and two callables: ``perform(entry)`` does the
store operation (it is the only part that knows what a staged file is) and ``applied(entry, seq,
info)`` does the bookkeeping after a success. It knows nothing of staged data, only:

- **when**: a heap ordered by due time (the coalescing delay ``upload_delay_s`` after an
  acknowledgement, but never later than ``max_delay_s`` after the oldest acknowledged version not
  yet in the store, ``Entry.acked_at``, so a file that changes more often than the delay is still
  uploaded; or the backoff after a failure; both skipped when ``eager()``: the staging space is past
  its high watermark or a writer waits for space), oldest sequence first, at most ``max_uploads`` at
  once;
- **per-key order** (invariant I4): one operation per key in flight; ``frozen``/``quiesce`` hold a
  key's operations off while the engine decides something about it, or the filesystem copies into
  it; ``MarkerOrder`` (``tiering.writeback.markers``) says which operations wait for a directory;
- **retries**: capped exponential backoff with equal jitter per key; while the store is unreachable
  (``ObjectStoreUnavailableError``) nothing is sent but one probe per backoff step;
- **deadlines**: each operation runs under ``upload_deadline_s(size)`` (a floor plus a minimum
  rate) and through the mount's store-health circuit when one is given (``tiering.storehealth``):
  an upload stuck on a frozen store is cancelled and retried instead of holding its slot; while the
  circuit is open, the one operation tried per backoff step fails at once without a request (it
  counts as a failed attempt, as before), and when the circuit's probe finds the store back, every
  backoff is cut short and the backlog starts draining;
- **barriers**: ``Barriers`` waits until every key's operation up to a sequence number is in the
  store (``flush``, write-through).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import random
from dataclasses import dataclass, field
from collections import Counter
from typing import AsyncIterator, Awaitable, Callable, Iterator

from tiering.clock import Clock
from tiering.errors import ObjectStoreError, ObjectStoreUnavailableError
from tiering.protocols import ObjectInfo
from tiering.storehealth import StoreHealth, bounded
from tiering.writeback.events import describe, wait_event
from tiering.writeback.markers import MarkerOrder
from tiering.writeback.pending import Entry, PendingIndex
from tiering.writeback.settings import (
    STORE_PROBE_CAP_S,
    UPLOAD_BACKOFF_BASE_S,
    UPLOAD_BACKOFF_CAP_S,
    WriteBackSettings,
    upload_deadline_s,
)
from tiering.writeback.stats import WriteBackStats

log = logging.getLogger("tiering.writeback")


@dataclass(eq=False)
class Barrier:
    """Waits until every key's operation up to a seq is in the store (flush, write-through)."""

    remaining: dict[str, int]
    fail_fast: bool = False
    error: BaseException | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def settle(self, key: str) -> None:
        self.remaining.pop(key, None)
        if not self.remaining:
            self.done.set()


class Barriers:
    """The barriers being waited on, kept up to date as entries change, succeed and fail."""

    def __init__(self, index: PendingIndex) -> None:
        self._index = index
        self._active: set[Barrier] = set()

    @contextlib.contextmanager
    def open(self, remaining: dict[str, int], *, fail_fast: bool = False) -> Iterator[Barrier]:
        barrier = Barrier(dict(remaining), fail_fast=fail_fast)
        self._active.add(barrier)
        try:
            for key in list(remaining):
                self._check(barrier, key)
            if not barrier.remaining:
                barrier.done.set()
            yield barrier
        finally:
            self._active.discard(barrier)

    def changed(self, key: str) -> None:
        """``key``'s entry was replaced or dropped: settled if nothing journaled is pending any more."""
        for barrier in list(self._active):
            if key in barrier.remaining:
                self._check(barrier, key)

    def renamed(self, src: str, dst: str, seq: int) -> None:
        """A barrier waiting for ``src`` waits for its content under ``dst`` now."""
        for barrier in list(self._active):
            if src in barrier.remaining:
                barrier.remaining[dst] = seq

    def applied(self, key: str, seq: int) -> None:
        for barrier in list(self._active):
            if barrier.remaining.get(key, seq + 1) <= seq:
                barrier.settle(key)

    def failed(self, key: str, seq: int, error: BaseException) -> None:
        for barrier in list(self._active):
            if barrier.fail_fast and barrier.remaining.get(key, seq + 1) <= seq:
                barrier.error = error
                barrier.done.set()

    def _check(self, barrier: Barrier, key: str) -> None:
        entry = self._index.get(key)
        if entry is None or entry.seq is None:
            barrier.settle(key)  # applied, dropped, or superseded by writes not yet acknowledged


class Uploader:
    def __init__(
        self,
        index: PendingIndex,
        order: MarkerOrder,
        stats: WriteBackStats,
        *,
        settings: Callable[[], WriteBackSettings],
        clock: Clock,
        rng: random.Random,
        eager: Callable[[], bool],
        perform: Callable[[Entry], Awaitable[ObjectInfo | None]],
        applied: Callable[[Entry, int, ObjectInfo | None], Awaitable[None]],
        health: StoreHealth | None = None,
    ) -> None:
        self._index = index
        self._health = health
        if health is not None:
            health.on_reachable(self._store_back)
        self._order = order
        self._stats = stats
        self._settings = settings  # read at each use: settings may be replaced (tests)
        self.clock = clock
        self.rng = rng
        self._eager = eager
        self._perform = perform
        self._applied = applied
        self.barriers = Barriers(index)
        self.running: set[asyncio.Task[None]] = set()
        self.task: asyncio.Task[None] | None = None
        self.store_failures = 0
        self.store_error: str | None = None
        self._store_down_until = 0.0
        self._heap: list[tuple[float, int, int, str]] = []
        self._heap_eager = False
        self._tiebreak = itertools.count()
        self._busy: set[str] = set()  # keys with a store operation in flight
        self._blocked: Counter[str] = Counter()  # keys whose operations must not start (see quiesce)
        self._deferred: set[str] = set()  # keys held back by MarkerOrder, queued again when something ends
        self._idle = asyncio.Event()  # set whenever an operation finishes
        self._wake = asyncio.Event()
        self._stopping = False

    # -- life cycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._scheduler())

    async def stop(self) -> None:
        self._stopping = True
        tasks = [t for t in (self.task, *self.running) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- what the engine tells it -------------------------------------------------------------------
    def busy(self, key: str) -> bool:
        """Whether a store operation of ``key`` is in flight (so the store may hold it, whatever it decides)."""
        return key in self._busy

    def wake(self) -> None:
        """Re-evaluate what is due now (more eager, a clock jump in tests, a store known to be back)."""
        self._wake.set()

    def due(self, entry: Entry) -> float:
        if self._heap_eager:
            return entry.retry_at
        return max(entry.ready_at, entry.retry_at)

    def ready_at(self, acked_at: float | None = None) -> float:
        """When an operation acknowledged now becomes due: after the coalescing delay, but no later than
        the max delay after ``acked_at`` (the oldest acknowledged version of the key not yet uploaded)."""
        settings = self._settings()
        due = self.clock.monotonic() + settings.upload_delay_s
        if acked_at is not None:
            due = min(due, acked_at + settings.max_delay_s)
        return due

    def acknowledged(self, entry: Entry, *superseded: Entry | None) -> Entry:
        """``entry`` was just acknowledged (journaled): when its upload is due. The coalescing delay
        counts from now, but never past the max delay after the oldest acknowledged version not yet
        in the store (``acked_at``, the oldest of ``entry``'s and of the pending operations it
        supersedes: a rename's source, a save-by-rename's old destination), so a file that keeps
        changing is still uploaded. While an upload of the key runs, it carries the older versions:
        the new one counts from now."""
        now = self.clock.monotonic()
        earlier = [e.acked_at for e in (entry, *superseded) if e is not None and e.acked_at is not None]
        entry.acked_at = min(earlier, default=now)
        entry.ready_at = self.ready_at(now if entry.in_flight else entry.acked_at)
        return entry

    def push(self, entry: Entry | None) -> None:
        """Queue ``entry`` for its store operation (if it is journaled and not already running)."""
        if entry is None or entry.seq is None or entry.in_flight:
            return
        entry.due = self.due(entry)
        heapq.heappush(self._heap, (entry.due, entry.seq, next(self._tiebreak), entry.key))
        self._wake.set()

    def kick(self, keys: dict[str, int] | None = None) -> None:
        """Flush and write-through: no coalescing delay, no backoff, for ``keys`` (all if None)."""
        now = self.clock.monotonic()
        for key in (keys if keys is not None else self._index.keys()):
            entry = self._index.get(key)
            if entry is not None:
                entry.ready_at = min(entry.ready_at, now)
                entry.retry_at = min(entry.retry_at, now)
        self._store_down_until = 0.0
        self._rebuild()
        self._wake.set()

    @contextlib.asynccontextmanager
    async def frozen(self, *keys: str) -> AsyncIterator[None]:
        """No new store operation of ``keys`` starts inside (one already in flight shows in ``busy``),
        so a decision taken on "may the store have it" cannot be overtaken by an upload starting."""
        for key in keys:
            self._block(key)
        try:
            yield
        finally:
            for key in keys:
                self._unblock(key)
                self.push(self._index.get(key))

    @contextlib.asynccontextmanager
    async def quiesce(self, key: str) -> AsyncIterator[None]:
        """No store operation of ``key`` runs inside this block (one in flight is waited for), nor a
        marker put of a directory above it (see ``tiering.writeback.markers``)."""
        self._block(key)
        try:
            while key in self._busy or self._order.marker_put_above(key):
                self._idle.clear()
                await self._idle.wait()
            yield
        finally:
            self._unblock(key)
            self.push(self._index.get(key))
            self._wake.set()

    def _block(self, key: str) -> None:
        self._blocked[key] += 1
        self._order.claim(key)

    def _unblock(self, key: str) -> None:
        self._blocked[key] -= 1
        if self._blocked[key] <= 0:
            del self._blocked[key]
        self._order.unclaim(key)
        self._release_deferred()

    def _release_deferred(self) -> None:
        deferred, self._deferred = self._deferred, set()
        for key in deferred:
            self.push(self._index.get(key))

    # -- scheduling ---------------------------------------------------------------------------------
    def _rebuild(self) -> None:
        self._heap_eager = self._eager()
        self._heap = []
        for entry in self._index:
            if entry.seq is not None and not entry.in_flight:
                entry.due = self.due(entry)
                self._heap.append((entry.due, entry.seq, next(self._tiebreak), entry.key))
        heapq.heapify(self._heap)

    async def _scheduler(self) -> None:
        while not self._stopping:
            self._wake.clear()
            wait = self._start_ready()
            await wait_event(self._wake, wait)

    def _start_ready(self) -> float | None:
        """Start what is due, up to the concurrency limit; seconds until the next one is due."""
        if self._eager() != self._heap_eager:
            self._rebuild()
        now = self.clock.monotonic()
        if self._store_down_until > now:
            return self._store_down_until - now
        max_uploads = self._settings().max_uploads
        while self._heap and len(self.running) < max_uploads:
            due, seq, _, key = self._heap[0]
            if due > now:
                return due - now
            heapq.heappop(self._heap)
            entry = self._index.get(key)
            if entry is None or entry.seq != seq or entry.in_flight or entry.due != due:
                continue  # stale: replaced, re-queued or running
            if key in self._busy or key in self._blocked:
                continue  # re-queued when the key is free (see _finish, quiesce)
            if self._order.must_wait(entry):
                self._deferred.add(key)  # re-queued when an operation ends or a key is unblocked
                continue
            entry.in_flight = True
            self._busy.add(key)
            self._order.started(entry)
            task = asyncio.get_running_loop().create_task(self._run(entry, seq))
            self.running.add(task)
            task.add_done_callback(self.running.discard)
        return None

    async def _run(self, entry: Entry, seq: int) -> None:
        key = entry.key
        error: BaseException | None = None
        info: ObjectInfo | None = None
        sf = entry.sf
        size = sf.acked.size if sf is not None and sf.acked is not None else 0
        started = self.clock.monotonic()
        try:
            info = await bounded(self._health, lambda: self._perform(entry), upload_deadline_s(size),
                                 f"{entry.op} {key!r}")
        except asyncio.CancelledError:
            self._finish(entry)
            raise
        except Exception as exc:  # noqa: BLE001 - every failure is retried and reported
            error = exc
        try:
            if error is None:
                self._store_reachable()
                if entry.seq != seq:
                    # Acknowledged again while this upload ran: the version now pending is no older
                    # than the upload's start, which bounds its wait from there.
                    entry.acked_at = started
                await self._applied(entry, seq, info)
                self.barriers.applied(key, seq)
            else:
                self._failed(entry, seq, error)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - bookkeeping must not kill the uploader
            log.exception("write-back: bookkeeping after the store operation on %r failed", key)
        finally:
            self._finish(entry)
            self._idle.set()
            self.push(self._index.get(key))
            self._wake.set()

    def _finish(self, entry: Entry) -> None:
        entry.in_flight = False
        self._busy.discard(entry.key)
        self._order.finished(entry)
        self._release_deferred()

    # -- outcomes -----------------------------------------------------------------------------------
    def _store_reachable(self) -> None:
        if self.store_failures:
            log.info("write-back: the object store is reachable again; %d operations pending",
                     self._index.journaled())
        self.store_failures = 0
        self.store_error = None
        self._store_down_until = 0.0

    def _store_back(self) -> None:
        """The circuit closed: the store answered again, so no backoff step need run out."""
        now = self.clock.monotonic()
        for entry in self._index:
            entry.retry_at = min(entry.retry_at, now)
        self._store_down_until = 0.0
        self._rebuild()
        self._wake.set()

    def _failed(self, entry: Entry, seq: int, error: BaseException) -> None:
        key = entry.key
        now = self.clock.monotonic()
        self._stats.failed_attempts += 1
        text = describe(error)
        entry.attempts += 1
        entry.last_error = text
        if isinstance(error, ObjectStoreUnavailableError):
            self.store_failures += 1
            delay = self.backoff(self.store_failures, STORE_PROBE_CAP_S)
            self._store_down_until = now + delay
            entry.retry_at = self._store_down_until
            if self.store_failures == 1:
                log.warning("write-back: the object store is unreachable (%s); writes keep going to staging, "
                            "%d operations pending, retrying in %.1f s", text, self._index.journaled(), delay)
            self.store_error = text
        else:
            delay = self.backoff(entry.attempts)
            entry.retry_at = now + delay
            level = logging.WARNING if entry.attempts == 1 else logging.DEBUG
            if not isinstance(error, (ObjectStoreError, OSError)):
                log.error("write-back: %s %r failed unexpectedly", entry.op, key, exc_info=error)
            else:
                log.log(level, "write-back: %s %r failed (attempt %d): %s; retrying in %.1f s",
                        entry.op, key, entry.attempts, text, delay)
        self.barriers.failed(key, seq, error)

    def backoff(self, attempts: int, cap: float = UPLOAD_BACKOFF_CAP_S) -> float:
        step = min(cap, UPLOAD_BACKOFF_BASE_S * 2 ** min(attempts - 1, 30))
        return step * self.rng.uniform(0.5, 1.0)
