"""Loads of blocks into the tiers: the single-flight table, the load tasks and the fetch slots.

A *load* gets one block from below the RAM tier (the disk tier, then the cluster tier, then the
object store) and puts it in the tiers above the one that had it. ``Loads`` owns everything that is
in flight:

- the single-flight table (``future``): one future per block being loaded. The first miss on a
  block starts one load task and records its future; every other reader of the same block awaits
  that future (``BlockCache`` counts the join), so concurrent misses cause one GET. The load runs as
  its own task, so a reader that is interrupted does not cancel the fetch others wait on.
- the load tasks (``task``): every load until it is completely done, its disk write included, by
  block, so a warm can wait for the disk write of a read's load, and ``close`` for all of them.
- the fetch slots (``slots``, taken with ``fetch_slot``): a load holds one of
  ``max_concurrent_fetches`` from before its GET until its block is written to disk. Read-ahead,
  warm loads and cluster-only warms take the same slots.
- the bytes in flight (``inflight``, ``tiering.engine.inflight``): a load reserves its block's bytes
  in the RAM tier before it makes a buffer for it (after its fetch slot, and for a disk-tier read
  too), and hands them to the tier when it puts the block there, or gives them back once a block
  that never goes to RAM (a warm) is on disk. So the RAM tier's capacity bounds the blocks it holds
  and those in flight together.

A read load answers its readers as soon as the block is in RAM and leaves the table then; it keeps
its slot until the disk write is done. A warm load (``start_warm``, for ``BlockCache.warm_block``)
puts the block on the disk tier and not in RAM, so its future stays in the table until the block is
on disk: a reader arriving in between must join it, not refetch. Cancelling the warm that started
it never cancels the load. A promotion (``BlockCache.promote``) registers a future of its own
(``register``/``release``) while it copies a block it holds locally.

With a cluster tier a load that misses RAM and disk asks it, in the load's slot, before the source:
the source's circuit is only consulted after a cluster miss, so blocks in the cluster tier are
served while the source is unreachable, once the volume has proven it may read the object
(``tiering.engine.authorize``: a source HEAD per object version, before the first hit is served).
A block fetched from the source is offered to the
write-behind queue, which never delays the reader.

Everything here runs on the event loop: the table, the tasks and the slots are touched by no other
thread. The bytes travel elsewhere: the store's worker threads receive a GET (``SourceFetch``), and
disk-tier calls run in asyncio's default pool (``GuardedDisk``), but for a small block fetched from the
source, which the worker that received it writes to the disk tier itself, after handing it over
(``RECEIVER_PUT_BELOW_BYTES``, ``tiering.handoff``): one thread handoff and wake-up fewer per block.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from typing import AsyncIterator, Callable

from tiering.blocks import BlockData, BlockKey, ObjectRef, block_range
from tiering.engine.authorize import SourceAuthorization
from tiering.engine.diskguard import GuardedDisk
from tiering.engine.inflight import InFlight, Reservation, ReservingTier
from tiering.engine.source import SourceFetch
from tiering.engine.stats import EngineStats
from tiering.handoff import AfterReceive
from tiering.protocols import BlockTier, ClusterBlockTier
from tiering.settings import CacheSettings
from tiering.storehealth import StoreHealth
from tiering.tiers.cluster import WriteBehind
from tiering.traffic import CLUSTER, DISK, RAM, SOURCE, ReadTraffic


# Blocks below this are written to the disk tier by the store's thread that received them, right
# after it handed them to the loop (``tiering.handoff``): for a small file's block the two thread
# handoffs of a write in asyncio's pool were a visible share of its cost (docs/dataplane.md, "Small
# files, profiled"). Larger blocks (``O_DIRECT``, milliseconds each) keep the pool: a handoff is noise
# beside their write, and a GET worker busy writing one would not be receiving the next.
RECEIVER_PUT_BELOW_BYTES = 1024 * 1024


class WarmOutcome(enum.Enum):
    """What ``BlockCache.warm_block`` did for one block."""

    SKIPPED = "skipped"  # already on disk
    FETCHED = "fetched"  # fetched from the store and written to disk
    FROM_RAM = "from_ram"  # written to disk from the RAM tier
    JOINED = "joined"  # another load (a read or another warm) put it on disk
    NOT_STORED = "not_stored"  # the disk tier did not store it (full of pinned data, failing, absent)

    @property
    def cached(self) -> bool:
        return self is not WarmOutcome.NOT_STORED


def hand_over(joined: asyncio.Future[BlockData]) -> Callable[[asyncio.Future[BlockData]], None]:
    """A done-callback that gives ``joined`` the outcome of the load it is attached to."""
    def done(load: asyncio.Future[BlockData]) -> None:
        if joined.done():
            return
        if load.cancelled():
            joined.cancel()
        elif (error := load.exception()) is not None:
            joined.set_exception(error)
        else:
            joined.set_result(load.result())
    return done


class Loads:
    def __init__(
        self,
        settings: CacheSettings,
        ram: BlockTier,
        disk: GuardedDisk | None,
        source: SourceFetch,
        *,
        cluster: ClusterBlockTier | None,
        authorize: SourceAuthorization | None = None,
        write_behind: WriteBehind | None,
        health: StoreHealth | None,
        stats: EngineStats,
        traffic: ReadTraffic,
    ) -> None:
        self._block_size = settings.block_size
        self._ram = ram
        self._disk = disk
        self._source = source
        self._cluster = cluster
        self._authorize = authorize
        self._write_behind = write_behind
        self._health = health
        self._stats = stats
        self._traffic = traffic
        self._inflight: dict[BlockKey, asyncio.Future[BlockData]] = {}
        # Every load task until it is completely done (its disk write included), by block.
        self._load_tasks: dict[BlockKey, asyncio.Task[WarmOutcome | None]] = {}
        self._tasks: set[asyncio.Task[WarmOutcome | None]] = set()
        self.slots = asyncio.Semaphore(settings.max_concurrent_fetches)
        self.inflight = InFlight(ram if isinstance(ram, ReservingTier) else None)

    # ------------------------------------------------------------------ the table
    def __contains__(self, key: BlockKey) -> bool:
        """Whether readers of ``key`` would join a load now (its future is in the table)."""
        return key in self._inflight

    def __len__(self) -> int:
        """Blocks whose future is in the table."""
        return len(self._inflight)

    def future(self, key: BlockKey) -> asyncio.Future[BlockData] | None:
        """The future readers of ``key`` join, if a load (or a promotion) of it is in flight."""
        return self._inflight.get(key)

    def task(self, key: BlockKey) -> asyncio.Task[WarmOutcome | None] | None:
        """The load task of ``key`` until it is completely done (its disk write included)."""
        return self._load_tasks.get(key)

    def busy(self, key: BlockKey) -> bool:
        """Whether anything is loading ``key``: a future in the table, or a load still writing it to disk."""
        return key in self._inflight or key in self._load_tasks

    def register(self, key: BlockKey) -> asyncio.Future[BlockData]:
        """Put a future of the caller's own in the table (a promotion); ``release`` takes it out."""
        fut: asyncio.Future[BlockData] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._inflight[key] = fut
        return fut

    def release(self, key: BlockKey, fut: asyncio.Future[BlockData]) -> None:
        """Take ``fut`` out of the table, if it is still the one there."""
        if self._inflight.get(key) is fut:
            del self._inflight[key]

    # ------------------------------------------------------------------ starting loads
    def start(self, ref: ObjectRef, key: BlockKey, readahead: bool = False,
              wanted: int | None = 0) -> asyncio.Future[BlockData]:
        """Start a read load of ``key`` (the caller checked none is in flight); its future.

        ``wanted``: the bytes of the block the reader uses (None: all of it), counted as the disk
        tier's hit bytes if it has the block.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[BlockData] = loop.create_future()
        # A future nobody awaits (read-ahead) must not log "exception was never retrieved"; a failed
        # load served its readers nothing.
        fut.add_done_callback(self._traffic.dropper(key))
        self._inflight[key] = fut
        task = loop.create_task(self._load(ref, key, fut, readahead, loop.time(), wanted))
        self._track(key, task)
        return fut

    def start_warm(self, ref: ObjectRef, key: BlockKey) -> asyncio.Task[WarmOutcome | None]:
        """Start a warm load of ``key`` into the disk tier (the caller checked nothing is loading it)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[BlockData] = loop.create_future()
        fut.add_done_callback(self._traffic.dropper(key))
        self._inflight[key] = fut
        task = loop.create_task(self._warm_load(ref, key, fut, loop.time()))
        # The warm that started it may be cancelled and never look at the outcome.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        self._track(key, task)
        return task

    def _track(self, key: BlockKey, task: asyncio.Task[WarmOutcome | None]) -> None:
        self._tasks.add(task)
        self._load_tasks[key] = task

        def done(t: asyncio.Task[WarmOutcome | None]) -> None:
            self._tasks.discard(t)
            if self._load_tasks.get(key) is t:
                del self._load_tasks[key]

        task.add_done_callback(done)

    async def close(self, timeout_s: float) -> None:
        """Wait for loads in progress (so their disk writes complete), cancelling those left after ``timeout_s``."""
        tasks = list(self._tasks)
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=timeout_s)
            for task in pending:
                task.cancel()

    @contextlib.asynccontextmanager
    async def fetch_slot(self, nbytes: int) -> AsyncIterator[Reservation]:
        """A fetch slot, then ``nbytes`` reserved in the RAM tier (in that order: a load waiting for a
        slot holds no memory); both are given back on exit, the reservation earlier where the holder
        hands its block to the RAM tier (``Reservation.release`` is idempotent)."""
        async with self.slots:
            reservation = await self.inflight.reserve(nbytes)
            try:
                yield reservation
            finally:
                reservation.release()

    # ------------------------------------------------------------------ the loads themselves
    async def _load(self, ref: ObjectRef, key: BlockKey, fut: asyncio.Future[BlockData], readahead: bool,
                    started_at: float, wanted: int | None = 0) -> None:
        stats = self._stats
        start, end = block_range(key.index, ref.size, self._block_size)
        try:
            # The index lookup needs no I/O: a block the disk tier does not hold costs no thread hop
            # (measured: a cold read of a 100 KiB file, 8.4 -> 5.9 ms).
            if self._disk is not None and not self._disk.absent(key):
                reservation = await self.inflight.reserve(end - start)
                try:
                    data = await self._disk.get(key)
                    if data is not None:
                        stats.disk_served += 1
                        self._disk.tier.stats.hit_bytes += len(data) if wanted is None else wanted
                        stats.ram_miss_bytes += len(data)
                        reservation.release()  # the RAM tier counts the block itself from here
                        self._ram.put(key, data)
                        self._traffic.settle(key, DISK)
                        fut.set_result(data)
                        return
                finally:
                    reservation.release()
            if self._health is not None and self._cluster is None:
                self._health.check_reachable(f"reading {ref.key!r}")  # not even a wait for a fetch slot
            async with self.fetch_slot(end - start) as reservation:
                data = await self._from_cluster(ref, key)
                place = CLUSTER if data is not None else SOURCE
                put = None
                if data is None:
                    if self._health is not None:
                        self._health.check_reachable(f"reading {ref.key!r}")
                    put = self._put_after_receive(key, end - start)
                    data = await self._source.get(ref, key, started_at, after=put)
                    self._offer_cluster(key, data)
                stats.ram_miss_bytes += len(data)
                if self._disk is not None:
                    stats.disk_miss_bytes += len(data)
                if readahead:
                    stats.readahead_blocks += 1
                    stats.readahead_bytes += len(data)
                reservation.release()  # the RAM tier counts the block itself from here
                self._ram.put(key, data)
                self._traffic.settle(key, place, len(data))
                fut.set_result(data)
                # Readers are served; the block stays in a fetch slot until it is on disk, which is
                # what bounds the blocks alive beyond the RAM tier (those it evicted meanwhile).
                self._inflight.pop(key, None)
                if self._disk is not None:
                    await self._disk.finish_put(key, data, put)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting readers
            if not fut.done():
                if isinstance(exc, asyncio.CancelledError):
                    fut.cancel()
                else:
                    fut.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            self.release(key, fut)

    async def _warm_load(self, ref: ObjectRef, key: BlockKey, fut: asyncio.Future[BlockData],
                         started_at: float) -> WarmOutcome:
        disk = self._disk
        assert disk is not None
        stats = self._stats
        # Unlike a read load, the future stays in the single-flight table until the block is on
        # disk: the block is not in RAM, so a reader arriving in between must join, not refetch.
        try:
            data = self._ram.get(key) if self._ram.contains(key) else None
            if data is not None:
                self._traffic.settle(key, RAM)
                fut.set_result(data)
                stored = await disk.put(key, data)
                outcome = WarmOutcome.FROM_RAM if stored else WarmOutcome.NOT_STORED
                if stored:
                    stats.warm_from_ram_blocks += 1
            else:
                start, end = block_range(key.index, ref.size, self._block_size)
                async with self.fetch_slot(end - start):  # the block's bytes until it is on disk (not in RAM)
                    data = await self._from_cluster(ref, key, warm=True)
                    place = CLUSTER if data is not None else SOURCE
                    put = None
                    if data is None:
                        put = self._put_after_receive(key, end - start)
                        data = await self._source.get(ref, key, started_at, after=put)
                        self._offer_cluster(key, data)
                        stats.warm_blocks += 1
                        stats.warm_bytes += len(data)
                    self._traffic.settle(key, place, len(data))
                    fut.set_result(data)
                    stored = await disk.finish_put(key, data, put)
                outcome = WarmOutcome.FETCHED if stored else WarmOutcome.NOT_STORED
            if not stored:
                stats.warm_not_stored += 1
            return outcome
        except BaseException as exc:
            if not fut.done():
                if isinstance(exc, asyncio.CancelledError):
                    fut.cancel()
                else:
                    fut.set_exception(exc)
            raise
        finally:
            self.release(key, fut)

    def _put_after_receive(self, key: BlockKey, length: int) -> AfterReceive[bool] | None:
        """The disk-tier put of a small block, offered to the store's thread that receives it
        (``tiering.handoff``); None where there is no disk tier or the block is large."""
        if self._disk is None or length >= RECEIVER_PUT_BELOW_BYTES:
            return None
        return self._disk.put_after_receive(key)

    async def _from_cluster(self, ref: ObjectRef, key: BlockKey, *, warm: bool = False) -> BlockData | None:
        """The block from the cluster tier, or None (no tier, a miss, or a failure: never raises).

        A warm's hit is counted in ``warm_from_cluster_blocks``, not as a block served to a read."""
        if self._cluster is None:
            return None
        start, end = block_range(key.index, ref.size, self._block_size)
        data = await self._cluster.get(key, end - start)
        # Another volume may have put it there: served (or copied to disk) only once this volume's
        # own source credentials have shown they may read this version (``tiering.engine.authorize``;
        # a refusal raises, as the source's GET would).
        if data is not None and self._authorize is not None and not await self._authorize.check(ref):
            return None
        if data is not None:
            if warm:
                self._stats.warm_from_cluster_blocks += 1
            else:
                self._stats.cluster_served += 1
                self._stats.cluster_served_bytes += len(data)
        return data

    def _offer_cluster(self, key: BlockKey, data: BlockData) -> None:
        """Hand a block fetched from the source to the write-behind queue (never waits)."""
        if self._write_behind is not None:
            self._write_behind.offer(key, data)
