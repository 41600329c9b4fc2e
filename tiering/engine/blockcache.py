"""The tiered block cache: RAM, then local disk, then the shared cluster tier, then the object store.

``BlockCache.read(ref, offset, length)`` splits a read into blocks and gets them concurrently. Each
block is looked up in the RAM tier (on the loop: a dict access), then in the disk tier (in a worker
thread), then fetched from the store with one ranged GET. A fetched block goes to both tiers; a disk
hit is promoted to RAM, but for a read of one whole small block that a FUSE reader thread serves
itself (``disk_hit``, ``tiering.engine.diskhit``).

Single flight: concurrent misses on one block cause one GET; the first starts a *load*, the others
join it. Memory bound: a load holds one of ``max_concurrent_fetches`` fetch slots from before its
GET until its block is written to disk, and reserves its block's bytes in the RAM tier before it
receives it (``tiering.engine.inflight``), so the RAM tier's capacity bounds held blocks and blocks
in flight together; read-ahead loads take the same slots. Both are kept by ``Loads`` (below).

A failing disk tier is a miss, never an error: the tier itself turns ``OSError`` into a miss and
tracks its health, and the engine calls it through ``GuardedDisk``, which takes whatever it raises
as a miss or a skipped write, so a broken or buggy tier costs speed, never a read. A failing store
is an error for the reader: ``ObjectStoreError`` with its errno, after at most ``fetch_timeout_s``,
counted from the ``read`` call (a reader waiting for a fetch slot or joining another reader's load
included). With a store-health circuit (``tiering.storehealth``), every GET runs through it: while the store is
unreachable, blocks on a tier are served as ever and a block that would need a GET fails at once.

Warming (fetching into the disk tier)
-------------------------------------
``warm_block(ref, index)`` makes one block present on the *disk* tier without putting it in RAM:
a dataset warmed before a job starts must not push the job's working set out of RAM, and RAM does
not outlive the daemon anyway. A block already on disk is skipped with an index lookup (no I/O),
but its recency is refreshed in memory, so blocks a warm skips are not the next ones its own
inserts evict. A block in RAM only is written from RAM, without a GET. Otherwise the block is
fetched with the same single-flight table and fetch slots as reads: a reader arriving while a warm
load is in flight joins it, a warm arriving while a read load is in flight waits for that load
(including its disk write) instead of fetching again. A warm load holds its slot until the block is
on disk, like any load. Cancelling a warm (a cancelled prefetch job) never cancels the load itself:
the block still lands on disk and a second run skips it.

Pins and evict
--------------
``pin(refs)`` records pinned object versions in a ``PinTable`` (``PinnedBlocks``) and marks their blocks in the disk
tier, which then never evicts them. The table's footprint is bounded by ``pin_limit_bytes``
(``PinLimitError`` beyond, nothing changed). ``evict(ref, ...)`` drops the cached blocks of one
object version from RAM and/or disk, keeping pinned ones; ``evict_all`` does it for every block.
The block cache holds clean data only (write-back stages dirty data outside it), so anything it
drops can be fetched again.

Cluster tier (``tiering.tiers.cluster``)
----------------------------------------
With a cluster tier, a load that misses RAM and disk asks it (in the load's fetch slot, under the
tier's own shorter timeout) before the source: a hit goes to RAM and disk like a fetched block, and
needs no source data (the source's circuit is only consulted after a cluster miss, so blocks in
the cluster tier are served while the source is unreachable), but it is served only once this
volume's source credentials have shown they may read that object version (``SourceAuthorization``,
``tiering.engine.authorize``: one HEAD per version, remembered). A block fetched from the source is
offered to the write-behind queue (``WriteBehind``), which uploads it in the background and never
delays the reader. The tier never raises: a failing or slow cluster store is a miss. Warm loads ask
it too.

Composition: each piece owns its state, BlockCache holds them
-------------------------------------------------------------
``BlockCache`` is the facade the filesystem, write-back and the daemon use. It decides (RAM lookup,
join or start a load, what a warm, a promotion or an evict does) and owns no table of its own; the
state lives in the pieces it composes, each in its module with a small interface:

``Loads``         (``loads``)     the single-flight table, the load tasks until their disk writes are
                                  done, the fetch slots; runs the loads down the tiers
``PinnedBlocks``  (``pinning``)   the pin table and its limit, mirrored on the disk tier's marks
``SourceFetch``   (``source``)    one GET under the timeout and the circuit; the GET latency histogram
``GuardedDisk``   (``diskguard``) disk-tier calls in a worker thread, a failure taken as a miss
``EngineStats``   (``stats``)     the counters, shared by the pieces, read by /stats and /metrics
``ReadTraffic``   (``tiering.traffic``) the bytes of reads by the place that answered them

All of it is touched on the event loop thread only; worker threads run disk-tier calls and receive
GETs, and hand their result back to the loop.

Threads and copies (docs/dataplane.md has the measurements)
-----------------------------------------------------------
Everything above runs on the event loop that answers FUSE, and it only decides: lookups, the
single-flight table, fetch slots, futures. Bytes travel elsewhere. A GET is received by a worker
thread of the S3 store straight into one buffer per block (``tiering.objectstore.rangedget``); that
buffer, as a read-only view, is what the RAM tier holds, what a FUSE reply slices (no copy, no
join for a read inside one block) and what the disk tier writes, from a worker thread of asyncio's
default pool, in one ``writev`` with its CRC-32 computed in C. A byte is copied three times on the
way: socket to buffer, buffer to the reader's page (the reply), buffer to the disk tier's page
cache. Blocks are ``bytes`` or read-only ``memoryview``s (``tiering.blocks.BlockData``): futures
are told apart from blocks by type, never by ``isinstance(x, bytes)``.

Latency: every GET the engine issues is timed with the injected clock into ``latency["get"]``, a
fixed-bucket ``LatencyHistogram`` that the metrics endpoint exports.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Iterable

from tiering.blocks import BlockData, BlockKey, ObjectRef, block_count, block_range, spans
from tiering.clock import Clock, SystemClock
from tiering.engine.diskguard import GuardedDisk
from tiering.engine.diskhit import MAX_REPLY_BLOCK_BYTES, DiskHit
from tiering.engine.loads import Loads, WarmOutcome, hand_over
from tiering.engine.pinning import PinnedBlocks
from tiering.engine.source import SourceFetch
from tiering.engine.stats import EngineStats
from tiering.errors import ObjectStoreUnavailableError
from tiering.latency import LatencyHistogram
from tiering.policy.pins import block_keys
from tiering.protocols import BlockTier, ClusterBlockTier, DiskBlockTier, ObjectStore
from tiering.settings import CacheSettings
from tiering.storehealth import StoreHealth
from tiering.engine.authorize import SourceAuthorization
from tiering.tiers.cluster import WriteBehind
from tiering.traffic import DISK, RAM, ReadTraffic

log = logging.getLogger(__name__)

# A read-ahead window may use at most this fraction of the RAM tier: read-ahead blocks land in RAM,
# and a window larger than the tier evicts its own blocks before they are read (measured: a 64 MiB
# RAM tier with a 128 MiB window read the disk tier at 80 MiB/s instead of hundreds). A quarter
# leaves room for a few concurrent streams and the blocks they are reading now.
READAHEAD_RAM_FRACTION = 4

# A reader waits for the blocks it needs at most the fetch timeout plus this: the loads it waits for
# fail by themselves at the fetch timeout (counted from when they started, no later than the read),
# so this only bounds what has no deadline of its own, and lets the load's own error reach the reader.
READ_WAIT_GRACE_S = 1.0


class BlockCache:
    def __init__(
        self,
        settings: CacheSettings,
        store: ObjectStore,
        ram: BlockTier,
        disk: DiskBlockTier | None = None,
        *,
        clock: Clock | None = None,
        health: StoreHealth | None = None,
        cluster: ClusterBlockTier | None = None,
        write_behind: WriteBehind | None = None,
    ) -> None:
        self.settings = settings
        self.block_size = settings.block_size
        self.health = health  # the store-health circuit shared with metadata and write-back, if any
        self.store = store
        self.ram = ram
        self.disk = disk
        self.cluster = cluster
        self.write_behind = write_behind if write_behind is not None or cluster is None else WriteBehind(cluster)
        self.clock = clock or SystemClock()
        self.stats = EngineStats()
        self.traffic = ReadTraffic()  # bytes of reads by the place that answered them
        self.source = SourceFetch(store, block_size=self.block_size, timeout_s=settings.fetch_timeout_s,
                                  clock=self.clock, health=health, stats=self.stats)
        self.latency: dict[str, LatencyHistogram] = {"get": self.source.latency}
        self._guarded_disk = GuardedDisk(disk, self.stats) if disk is not None else None
        # A cluster hit is served only once this volume's source credentials may read the object.
        self.authorization = (SourceAuthorization(store, self.stats, timeout_s=settings.fetch_timeout_s,
                                                  health=health) if cluster is not None else None)
        self.loads = Loads(settings, ram, self._guarded_disk, self.source, cluster=cluster,
                           authorize=self.authorization,
                           write_behind=self.write_behind, health=health, stats=self.stats, traffic=self.traffic)
        self._pinned = PinnedBlocks(disk, block_size=self.block_size, limit_bytes=settings.pin_limit_bytes)
        self.pins = self._pinned.table
        if self.write_behind is not None and self._guarded_disk is not None:
            # A block offered to a full write-behind queue is uploaded later, read back from the disk tier.
            self.write_behind.read_back_from(self._read_back_for_cluster)

    async def _read_back_for_cluster(self, key: BlockKey) -> BlockData | None:
        """A block the cluster write-behind deferred, read from the disk tier once the load that
        fetched it has written it there (its outcome is the load's business, not this read's)."""
        task = self.loads.task(key)
        if task is not None:
            await asyncio.wait([task])
        assert self._guarded_disk is not None
        return await self._guarded_disk.peek(key)

    @property
    def readahead_limit(self) -> int:
        """The largest read-ahead window: the configured one, bounded by a share of the RAM tier."""
        limit = self.settings.readahead_max_bytes
        if self.ram.capacity_bytes > 0:
            limit = min(limit, self.ram.capacity_bytes // READAHEAD_RAM_FRACTION)
        return limit

    # ------------------------------------------------------------------ reads
    async def read(self, ref: ObjectRef, offset: int, length: int, readahead_bytes: int = 0) -> bytes | memoryview:
        """Bytes ``[offset, offset+length)`` of ``ref``, clipped to its size, as a read-only buffer.

        A range inside one block is a read-only view of the cached block, not a copy: a FUSE read
        of 1 MiB is handed to the kernel straight from the buffer the block was received into
        (the FUSE session writes any buffer). A range across blocks is joined into new bytes.

        ``readahead_bytes`` past the end of the read are read ahead (``read_ahead``); the loads this read needs are
        started first, so they get fetch slots before read-ahead does.
        """
        parts = list(spans(offset, length, ref.size, self.block_size))
        pending = [self._block(ref, span.index, span.end - span.start) for span in parts]
        if readahead_bytes > 0:
            self.read_ahead(ref, offset + length, readahead_bytes)
        if not parts:
            return b""
        blocks = await self._gather(ref, pending)
        if len(parts) == 1:
            span = parts[0]
            block = blocks[0]
            if isinstance(block, bytes) and span.start == 0 and span.end == len(block):
                return block
            return memoryview(block).toreadonly()[span.start : span.end]
        return b"".join(memoryview(b)[s.start : s.end] for b, s in zip(blocks, parts))

    def disk_hit(self, ref: ObjectRef, offset: int, length: int) -> DiskHit | None:
        """A read of ``[offset, offset+length)`` that the calling thread may serve from the disk tier
        itself, off the loop and without a RAM-tier copy (``tiering.engine.diskhit``), or None: the
        range is not exactly one whole block of at most ``MAX_REPLY_BLOCK_BYTES``, or the block is in
        RAM, being loaded, or not on the disk tier (then ``read`` serves it). No I/O, nothing counted
        until ``DiskHit.finish``."""
        disk = self._guarded_disk
        if disk is None or offset < 0 or offset % self.block_size or offset >= ref.size:
            return None
        index = offset // self.block_size
        start, end = block_range(index, ref.size, self.block_size)
        if end - start > MAX_REPLY_BLOCK_BYTES or offset + length < end or (offset + length > end and end < ref.size):
            return None  # (part of the block, or more than it: not the last block, so the next one too)
        key = BlockKey(ref.key, ref.etag, index)
        if key in self.loads or self.ram.contains(key):
            return None
        try:
            if not disk.tier.contains(key):
                return None
        except Exception:  # noqa: BLE001 - ``read`` asks the guarded tier, which counts and logs it
            return None
        return DiskHit(disk, self.stats, self.traffic, key)

    async def get_block(self, ref: ObjectRef, index: int) -> BlockData:
        """One whole block, from the fastest tier that has it."""
        return (await self._gather(ref, [self._block(ref, index, None)]))[0]

    async def _gather(self, ref: ObjectRef, pending: list[BlockData | asyncio.Future[BlockData]]) -> list[BlockData]:
        """The blocks, waiting at most ``fetch_timeout_s`` in all for those being loaded (the loads
        go on for other readers: they are shielded)."""
        if not any(isinstance(b, asyncio.Future) for b in pending):
            return pending  # type: ignore[return-value]
        timeout = self.settings.fetch_timeout_s
        try:
            # Each load fails by itself at its deadline (started no later than this read); this
            # bound is the backstop for what has none (a disk-tier read that hangs).
            async with asyncio.timeout(timeout + READ_WAIT_GRACE_S):
                return [await asyncio.shield(b) if isinstance(b, asyncio.Future) else b for b in pending]
        except TimeoutError as exc:
            raise ObjectStoreUnavailableError(
                f"object store did not answer within {timeout:g} s reading {ref.key!r}") from exc

    def _block(self, ref: ObjectRef, index: int, wanted: int | None) -> BlockData | asyncio.Future[BlockData]:
        """The block's bytes if in RAM, else the future of its (possibly already running) load.

        ``wanted``: the bytes of the block the reader uses (None: all of it), which a tier that
        answers the lookup counts as its hit bytes (``TierStats.hit_bytes``).
        """
        key = BlockKey(ref.key, ref.etag, index)
        asked = wanted if wanted is not None else len(range(*block_range(index, ref.size, self.block_size)))
        self.stats.block_requests += 1
        data = self.ram.get(key)
        if data is not None:
            self.stats.ram_served += 1
            self.ram.stats.hit_bytes += asked
            self.traffic.hit(key, RAM, asked)
            return data
        fut = self.loads.future(key)
        if fut is None:
            fut = self.loads.start(ref, key, wanted=wanted)
        else:
            self.stats.singleflight_joins += 1
        self.traffic.waiting(key, asked, ready=fut.done())  # credited when the load settles
        return fut

    def read_ahead(self, ref: ObjectRef, offset: int, length: int) -> int:
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
            if key in self.loads or self.ram.contains(key):
                continue
            self.loads.start(ref, key, readahead=True)
            started += 1
        return started

    def start_ahead(self, ref: ObjectRef, index: int) -> asyncio.Future[BlockData] | None:
        """Start loading one block into RAM (and the disk tier) as read-ahead does, or join its load,
        without counting a read: for announced read orders (``tiering.engine.orderprefetch``). The
        load's future (shared: never cancel it), or None where the block is in RAM already."""
        key = BlockKey(ref.key, ref.etag, index)
        if self.ram.contains(key):
            return None
        fut = self.loads.future(key)
        return fut if fut is not None else self.loads.start(ref, key, readahead=True)

    async def load_ahead(self, ref: ObjectRef, index: int) -> bool:
        """``start_ahead``, waited for: whether a load was needed (False: already in RAM). Raises the
        load's error."""
        fut = self.start_ahead(ref, index)
        if fut is None:
            return False
        await asyncio.shield(fut)
        return True

    def is_cached(self, key: BlockKey) -> bool:
        return self.ram.contains(key) or (self.disk is not None and self.disk.contains(key))

    # ------------------------------------------------------------------ warming (into the disk tier)
    async def warm_block(self, ref: ObjectRef, index: int) -> tuple[WarmOutcome, int]:
        """Make block ``index`` of ``ref`` present on the disk tier, not in RAM (module docstring).

        Returns what was done and the block's length. Raises the store's error if the block had to
        be fetched and the fetch failed (``ObjectChangedError`` if the object changed meanwhile).
        """
        start, end = block_range(index, ref.size, self.block_size)
        length = end - start
        disk = self.disk
        if disk is None:
            self.stats.warm_not_stored += 1
            return WarmOutcome.NOT_STORED, length
        key = BlockKey(ref.key, ref.etag, index)
        joined = False
        for _ in range(2):  # a joined load that left nothing on disk gets one load of our own
            if disk.contains(key):
                disk.touch(key)
                if joined:
                    return WarmOutcome.JOINED, length
                self.stats.warm_skipped_blocks += 1
                self.stats.warm_skipped_bytes += length
                return WarmOutcome.SKIPPED, length
            fut = self.loads.future(key)
            task = self.loads.task(key)
            if fut is None and task is None:
                own = self.loads.start_warm(ref, key)
                outcome = await asyncio.shield(own)
                assert outcome is not None
                return outcome, length
            if fut is not None:
                await asyncio.shield(fut)  # a failed load raises its error here
            if task is not None:
                await asyncio.shield(task)  # until its disk write is done
            joined = True
        self.stats.warm_not_stored += 1
        return WarmOutcome.NOT_STORED, length

    async def warm(self, ref: ObjectRef, *, parallel: int | None = None) -> dict[WarmOutcome, int]:
        """Warm every block of ``ref``, at most ``parallel`` at once; counts blocks per outcome."""
        limit = asyncio.Semaphore(parallel or self.settings.max_concurrent_fetches)
        counts: dict[WarmOutcome, int] = {}

        async def one(index: int) -> None:
            async with limit:
                outcome, _ = await self.warm_block(ref, index)
            counts[outcome] = counts.get(outcome, 0) + 1

        await asyncio.gather(*(one(i) for i in range(block_count(ref.size, self.block_size))))
        return counts

    async def warm_cluster_block(self, ref: ObjectRef, index: int) -> tuple[WarmOutcome, int]:
        """Make block ``index`` of ``ref`` present on the cluster tier only (no RAM, no disk).

        One HEAD tells whether it is there already (SKIPPED); otherwise it is fetched from the source
        in a fetch slot and uploaded at once, not through the write-behind queue (a warm waits for
        its upload, so a finished prefetch means the blocks are in the cluster). Raises the store's
        error if the fetch failed; NOT_STORED when there is no cluster tier or the upload failed.
        """
        start, end = block_range(index, ref.size, self.block_size)
        length = end - start
        cluster = self.cluster
        if cluster is None:
            self.stats.warm_not_stored += 1
            return WarmOutcome.NOT_STORED, length
        key = BlockKey(ref.key, ref.etag, index)
        if await cluster.contains(key):
            self.stats.warm_skipped_blocks += 1
            self.stats.warm_skipped_bytes += length
            return WarmOutcome.SKIPPED, length
        async with self.loads.fetch_slot(length):
            data = await self.source.get(ref, key, asyncio.get_running_loop().time())
            self.stats.warm_blocks += 1
            self.stats.warm_bytes += len(data)
            stored = await cluster.put(key, data)
        if not stored:
            self.stats.warm_not_stored += 1
            return WarmOutcome.NOT_STORED, length
        return WarmOutcome.FETCHED, length

    async def cluster_cached_blocks(self, ref: ObjectRef) -> int:
        """How many blocks of ``ref`` the cluster tier holds (one HEAD each, a few at a time)."""
        cluster = self.cluster
        if cluster is None:
            return 0
        limit = asyncio.Semaphore(self.settings.max_concurrent_fetches)

        async def one(key: BlockKey) -> bool:
            async with limit:
                return await cluster.contains(key)

        return sum(await asyncio.gather(*(one(k) for k in block_keys(ref, self.block_size))))

    def cached_blocks(self, ref: ObjectRef) -> int:
        """How many blocks of ``ref`` are on the disk tier (index lookups only, no I/O)."""
        if self.disk is None:
            return 0
        return sum(1 for key in block_keys(ref, self.block_size) if self.disk.contains(key))

    # ------------------------------------------------------------------ promotion (after an upload)
    async def promote(self, ref: ObjectRef, read: Callable[[int, int], bytes]) -> int:
        """Put a version the caller holds locally (an upload just made) into the disk tier as clean
        blocks, so reading it back needs no GET; returns the bytes stored. Not into RAM, as warming.

        ``read(start, end)`` runs in a worker thread and gives those bytes of the version. Each block
        goes through the single-flight table: one with a load in flight is left to that load (it
        writes it to disk); otherwise the block is registered while it is read, so a reader arriving
        then joins it instead of fetching, and written with the same guarded disk call as loads (a
        failing tier stores nothing and raises nothing). Stops at the first block not stored.
        """
        disk = self._guarded_disk
        if disk is None:
            return 0

        stored = 0
        for index in range(block_count(ref.size, self.block_size)):
            key = BlockKey(ref.key, ref.etag, index)
            if self.loads.busy(key):
                continue
            start, end = block_range(index, ref.size, self.block_size)
            fut = self.loads.register(key)
            try:
                data = await asyncio.to_thread(read, start, end)
                if len(data) != end - start:
                    raise OSError(f"promoting {ref.key!r}: {len(data)} of {end - start} bytes of block {index}")
                self.traffic.settle(key, DISK)  # written here, read back locally: no GET
                fut.set_result(data)
            except BaseException as exc:
                self.loads.release(key, fut)
                if not fut.done():  # whoever joined gets a load of their own
                    self.loads.start(ref, key).add_done_callback(hand_over(fut))
                if not isinstance(exc, Exception):
                    raise
                log.debug("promoting %r into the disk tier stopped at block %d: %s", ref.key, index, exc)
                break
            finally:
                self.loads.release(key, fut)
            if not await disk.put(key, data):
                break
            stored += len(data)
        return stored

    # ------------------------------------------------------------------ pins and evict
    @property
    def pin_limit_bytes(self) -> int:
        return self._pinned.limit_bytes

    def pin(self, refs: Iterable[ObjectRef], *, enforce_limit: bool = True) -> None:
        """Pin these object versions (``PinnedBlocks.pin``: ``PinLimitError`` and nothing changed
        above the limit; ``enforce_limit=False`` restores pins saved under an older, larger limit)."""
        self._pinned.pin(refs, enforce_limit=enforce_limit)

    def unpin(self, keys: Iterable[str]) -> list[ObjectRef]:
        """Unpin the objects with these keys; returns the refs that were pinned."""
        return self._pinned.unpin(keys)

    def is_pinned(self, key: BlockKey) -> bool:
        return self._pinned.is_pinned(key)

    async def evict(self, ref: ObjectRef, *, ram: bool = True, disk: bool = True) -> tuple[int, int, int]:
        """Drop the cached blocks of one object version, except pinned ones on disk.

        Returns ``(blocks dropped, data bytes dropped, pinned blocks kept)``; a block dropped from
        both tiers counts once.
        """
        dropped = dropped_bytes = kept = 0
        on_disk: list[BlockKey] = []
        for key in block_keys(ref, self.block_size):
            start, end = block_range(key.index, ref.size, self.block_size)
            hit = False
            if ram and self.ram.contains(key):
                self.ram.discard(key)
                hit = True
            if disk and self.disk is not None and self.disk.contains(key):
                if self.is_pinned(key):
                    kept += 1
                else:
                    on_disk.append(key)
                    hit = True
            if hit:
                dropped += 1
                dropped_bytes += end - start
        if on_disk:
            assert self._guarded_disk is not None
            tier = self._guarded_disk.tier

            def discard_all() -> None:
                for k in on_disk:
                    tier.discard(k)

            await self._guarded_disk.run("discard", discard_all)
        self.stats.dropped_blocks += dropped
        self.stats.dropped_bytes += dropped_bytes
        return dropped, dropped_bytes, kept

    async def evict_all(self, *, ram: bool = True, disk: bool = True) -> tuple[int, int]:
        """Drop every cached block but pinned ones on disk: ``(blocks, bytes)`` per tier, summed.

        Bytes are RAM payload plus disk file sizes; a block held by both tiers counts twice.
        """
        blocks = freed = 0
        if ram:
            for key in self.ram.keys():
                before = self.ram.used_bytes()
                self.ram.discard(key)
                blocks += 1
                freed += before - self.ram.used_bytes()
        if disk and self._guarded_disk is not None:
            result = await self._guarded_disk.run("evict", self._guarded_disk.tier.evict_unpinned)
            if result is not None:
                blocks += result[0]
                freed += result[1]
        self.stats.dropped_blocks += blocks
        self.stats.dropped_bytes += freed
        return blocks, freed

    def pin_stats(self) -> dict[str, int]:
        return self._pinned.stats()

    async def close(self) -> None:
        """Wait for loads in progress (so their disk writes complete), bounded by the fetch timeout."""
        await self.loads.close(self.settings.fetch_timeout_s)
        if self.write_behind is not None:
            await self.write_behind.close(self.settings.fetch_timeout_s)
