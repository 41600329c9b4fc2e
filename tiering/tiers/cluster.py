"""The shared cluster tier: blocks as objects in an in-cluster S3 store, below the local disk.

Why. Every node reading a dataset from a remote bucket pays for every byte itself: N nodes cost N
times the dataset in remote GETs. With a cluster tier, a block comes from the source once for the
whole cluster; every other node (and every new pod on a fresh node) reads it from an S3-compatible
store inside the cluster (SeaweedFS, Ceph RGW, ...), which brings its own replication and scale-out.
We build no distributed store: the tier is a second ``ObjectStore`` opened on its own bucket/prefix.

Keys. A block of the source is named by the source's identity (its URL and endpoint), the block
size (block ``i`` of one size is not block ``i`` of another), and the ``BlockKey`` (object key, ETag,
index): a changed object has another ETag, so its old blocks are never asked for. That identity, the
*token*, is hashed (SHA-256) into ``blocks/<digest[:2]>/<digest>`` under the cluster prefix: fixed
length whatever the source key, and spread over 256 prefixes (S3 partitions by key prefix).

Format. Each object is a cluster frame (``tiering.tiers.clusterframe``): magic, layout, token, data
length, a keyed BLAKE3 MAC under the blocks key derived from the cluster key (``tiering.clusterkey``),
then the data. The store is shared by every volume and anyone holding its credentials can write
to it, so a checksum would prove nothing: the MAC does, and only the driver holds the key. A read
checks the full token and the MAC, so a hash collision, a foreign or forged object, a truncated or
bit-flipped one is a *miss* (counted in ``stats.corrupt_blocks``, a MAC failure also in
``stats.forged_blocks``, logged once per object, the object deleted before the miss is answered),
never data: never served, never copied into the disk tier. The block is then fetched from the
source and the write-behind replaces the object. An object of the previous, unauthenticated format
is a plain miss (``stats.stale_blocks``), overwritten the same way.

A read is one request: a GET of the framed block's exact length (the header's size is known from
the token, the data's from the block's range) on whatever version of the object is current
(``ANY_VERSION``: the object carries its own identity and MAC, so there is no ETag to learn
first, and one GET sees one version, never a mix). A 404 is the cheap miss; an object shorter than
the frame is a corrupt one. Bytes past the frame, if a foreign writer left any, are not read: the
frame's token and checksums decide. It runs under the cluster timeout, which is shorter than the
source's fetch timeout: a slow cluster store must leave the reader time to go to the source. It
was a HEAD then a GET under ``If-Match``: two round trips per hit.

Health. The tier has its own ``StoreHealth`` circuit (the one the source uses, a second instance,
probing with the cluster store's ``check()``): a timeout or connection failure opens it, and while
it is open every lookup is a miss without a request (counted in ``stats.skipped``) and every write
is dropped, until a probe finds the store again. A failing cluster store therefore costs one
timeout, then reads go straight to the source at source speed. Nothing here ever raises to a
caller: every failure is a miss or a write not made, counted in ``stats.errors``.
A store that cannot be reached when the mount starts does not stop the mount either: the daemon
opens the tier with its circuit open (``cachefs.daemon.main.open_cluster_tier``), and the first
probe that finds the store brings it into use.

Write-behind. ``WriteBehind`` queues blocks fetched from the source for upload to this tier. The
reader never waits for it: ``offer`` appends or refuses at once. The queue is bounded in blocks and
in bytes (the blocks are held in memory until uploaded); a block offered to a full queue is
remembered by its key and uploaded later from the node's disk tier, once the queue is empty (or,
without a disk tier or past ``max_deferred`` keys, dropped and counted: another node, or the next
read of it, will write it). A few workers upload in parallel.

Capacity. The tier is shared and enforces no size itself: ``collect_garbage`` (``cachefs cluster
gc``) deletes the least recently *written* blocks (S3 LastModified) until the total is under a size;
an S3 lifecycle expiration rule on the prefix is the simple alternative.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from tiering.blocks import BlockData, BlockKey
from tiering.clock import Clock, SystemClock
from tiering.clusterkey import ClusterKey
from tiering.tiers.blockformat import CorruptBlockError, encode_token
from tiering.tiers.clusterframe import (
    ForgedFrameError,
    FrameKeys,
    StaleFrameError,
    decode_frame,
    encode_frame,
    frame_size,
)
from tiering.errors import ObjectChangedError, ObjectNotFoundError, ObjectStoreError
from tiering.protocols import ANY_VERSION, ClusterBlockTier, ClusterTierStats, ObjectStore, ObjectStoreStats
from tiering.settings import (
    DEFAULT_CLUSTER_TIMEOUT_S,
    DEFAULT_WRITE_BEHIND_BLOCKS,
    DEFAULT_WRITE_BEHIND_BYTES,
    DEFAULT_WRITE_BEHIND_DEFERRED,
    DEFAULT_WRITE_BEHIND_WORKERS,
)
from tiering.storehealth import StoreHealth

log = logging.getLogger("tiering.tiers.cluster")

BLOCKS_PREFIX = "blocks/"
# A frame this large is checked in a worker thread (its keyed BLAKE3 costs ~0.2 ms per MiB, with the
# GIL released); a smaller one on the loop, where a thread hop (~50 us) would cost more than the MAC.
THREAD_MIN_BYTES = 64 * 1024
# Objects whose failed check is logged (once each); more are counted, not logged, so a store full
# of forgeries cannot fill the log, and a set of names cannot grow without bound.
LOGGED_FAILURES_MAX = 1024

def cluster_token(source_id: str, block_size: int, key: BlockKey) -> bytes:
    """The identity of a block in the shared store: source, block size, key, ETag, index."""
    return f"{source_id}\x00{block_size}\x00".encode("utf-8", "surrogateescape") + encode_token(key)


def cluster_object_key(token: bytes) -> str:
    """Where the block of ``token`` lives, relative to the cluster prefix."""
    digest = hashlib.sha256(token).hexdigest()
    return f"{BLOCKS_PREFIX}{digest[:2]}/{digest}"




class ClusterTier:
    """A ``ClusterBlockTier`` over an ``ObjectStore`` (the module docstring)."""

    name = "cluster"

    def __init__(
        self,
        store: ObjectStore,
        *,
        source_id: str,
        block_size: int,
        key: ClusterKey,
        timeout_s: float = DEFAULT_CLUSTER_TIMEOUT_S,
        clock: Clock | None = None,
        health: StoreHealth | None = None,
        where: str = "",
    ) -> None:
        if timeout_s <= 0:
            raise ValueError("the cluster timeout must be positive")
        self.store = store
        self.source_id = source_id
        self.block_size = block_size
        self.timeout_s = timeout_s
        self.key = key  # also the write-back journal's (``tiering.writeback.durable``)
        self._mac = FrameKeys.of(key)
        self.key_fingerprint = key.fingerprint()
        self._logged: set[str] = set()
        self.where = where  # the cluster URL, for /stats (no credentials in it)
        self.stats = ClusterTierStats()
        self.health = health or StoreHealth(clock or SystemClock(), probe=store.check, name="cluster store")

    @property
    def store_stats(self) -> ObjectStoreStats:
        return self.store.stats

    def _locate(self, key: BlockKey) -> tuple[bytes, str]:
        token = cluster_token(self.source_id, self.block_size, key)
        return token, cluster_object_key(token)

    async def _call(self, make: Callable[[], Awaitable[Any]], what: str) -> Any:
        return await self.health.call(make, self.timeout_s, f"cluster tier: {what}")

    async def get(self, key: BlockKey, length: int) -> BlockData | None:
        token, name = self._locate(key)
        if not self.health.reachable:
            self.stats.skipped += 1
            self.health.maybe_probe()
            return None
        try:
            framed = frame_size(token, length)
            blob = await self._call(lambda: self.store.get_range(name, ANY_VERSION, 0, framed), f"reading {name}")
            # The MAC hashes the whole block: in a worker thread (blake3 and hashlib release the GIL).
            if len(blob) >= THREAD_MIN_BYTES:
                data = await asyncio.to_thread(decode_frame, self._mac, blob, token)
            else:
                data = decode_frame(self._mac, blob, token)
            if len(data) != length:
                raise CorruptBlockError(f"the block is {len(data)} bytes, expected {length}")
        except (ObjectNotFoundError, ObjectChangedError):
            self.stats.misses += 1  # absent
            return None
        except StaleFrameError:
            self.stats.stale_blocks += 1  # the previous format: the write-behind overwrites it
            self.stats.misses += 1
            return None
        except CorruptBlockError as exc:
            self.stats.corrupt_blocks += 1
            if isinstance(exc, ForgedFrameError):
                self.stats.forged_blocks += 1
            self.stats.misses += 1
            if name not in self._logged and len(self._logged) < LOGGED_FAILURES_MAX:
                self._logged.add(name)
                log.warning("cluster tier: block %s of %r failed its check (%s); not served, deleting it",
                            name, key.key, exc)
            # Awaited, not left to run in the background: the caller fetches the block from the
            # source next and the write-behind puts it back, which a late delete would undo.
            await self._delete(name)
            return None
        except Exception as exc:  # noqa: BLE001 - a cache tier must never fail a read
            self._count_error("get", exc)
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self.stats.hit_bytes += len(data)
        return data

    async def put(self, key: BlockKey, data: BlockData) -> bool:
        if not self.health.reachable:
            self.health.maybe_probe()
            return False
        token, name = self._locate(key)
        # The MAC and the one copy into the framed object (8 MiB per block) run in a worker thread:
        # this is the write-behind of every block a node fetches from the source, and the loop
        # answers FUSE.
        blob = await asyncio.to_thread(encode_frame, self._mac, token, data)
        try:
            await self._call(lambda: self.store.put(name, len(blob), lambda s, e: blob[s:e]), f"writing {name}")
        except Exception as exc:  # noqa: BLE001 - a write not made is only a later miss
            self._count_error("put", exc)
            return False
        self.stats.puts += 1
        self.stats.put_bytes += len(data)
        return True

    async def contains(self, key: BlockKey) -> bool:
        if not self.health.reachable:
            return False
        _, name = self._locate(key)
        try:
            await self._call(lambda: self.store.head(name), f"looking up {name}")
        except ObjectNotFoundError:
            return False
        except Exception as exc:  # noqa: BLE001
            self._count_error("head", exc)
            return False
        return True

    def _count_error(self, what: str, exc: BaseException) -> None:
        self.stats.errors += 1
        if isinstance(exc, ObjectStoreError):
            log.debug("cluster tier %s failed: %s", what, exc)
        else:
            log.warning("cluster tier %s failed unexpectedly", what, exc_info=True)

    async def _delete(self, name: str) -> None:
        try:
            await self._call(lambda: self.store.delete(name), f"deleting {name}")
        except Exception as exc:  # noqa: BLE001 - the write-behind overwrites it anyway
            self._count_error("delete", exc)

    async def close(self) -> None:
        await self.health.close()
        await self.store.close()

    def snapshot(self) -> dict[str, Any]:
        return {"state": "healthy" if self.health.reachable else "down", "url": self.where,
                "timeout_s": self.timeout_s, "key_fingerprint": self.key_fingerprint, "health": self.health.snapshot()}


class InMemoryClusterTier:
    """A ``ClusterBlockTier`` in a dict: the double for engine tests. ``failing`` makes every call a
    failure (counted, a miss), as a dead cluster store would."""

    name = "cluster"

    def __init__(self) -> None:
        self.stats = ClusterTierStats()
        # What a store behind it would count: one GET per lookup, one PUT per block written.
        self.store_stats = ObjectStoreStats()
        self.blocks: dict[BlockKey, bytes] = {}
        self.failing = False

    async def get(self, key: BlockKey, length: int) -> BlockData | None:
        await asyncio.sleep(0)
        if self.failing:
            self.stats.errors += 1
            self.stats.misses += 1
            return None
        data = self.blocks.get(key)
        self.store_stats.requests += 1
        self.store_stats.get_requests += 1
        if data is None or len(data) != length:
            self.stats.misses += 1
            return None
        self.store_stats.bytes_read += len(data)
        self.stats.hits += 1
        self.stats.hit_bytes += len(data)
        return data

    async def put(self, key: BlockKey, data: BlockData) -> bool:
        await asyncio.sleep(0)
        if self.failing:
            self.stats.errors += 1
            return False
        self.blocks[key] = bytes(data)
        self.store_stats.requests += 1
        self.store_stats.put_requests += 1
        self.store_stats.bytes_written += len(data)
        self.stats.puts += 1
        self.stats.put_bytes += len(data)
        return True

    async def contains(self, key: BlockKey) -> bool:
        await asyncio.sleep(0)
        return not self.failing and key in self.blocks

    def snapshot(self) -> dict[str, Any]:
        return {"state": "down" if self.failing else "healthy", "url": "memory://"}


@dataclass
class WriteBehindStats:
    queued: int = 0  # blocks accepted into the queue (in memory)
    written: int = 0  # uploaded: from the queue, or caught up from the disk tier
    failed: int = 0  # accepted, then the tier did not store them
    dropped: int = 0  # neither queued nor deferred (the queue full, and no catch-up or its list full)
    dropped_bytes: int = 0
    deferred: int = 0  # offered to a full queue, remembered to be uploaded from the disk tier later
    caught_up: int = 0  # deferred blocks read back from the disk tier and handed to the tier
    gone: int = 0  # deferred blocks no longer on the node's disk tier when their turn came
    present: int = 0  # deferred blocks the tier held already when their turn came (another node's)


ReadBack = Callable[[BlockKey], Awaitable[BlockData | None]]


class WriteBehind:
    """A bounded queue of blocks to upload to the cluster tier; ``offer`` never waits.

    A block offered to a full queue is not lost to the cluster where the node keeps it on its disk
    tier: with ``read_back`` (the disk tier's ``peek``, given by the engine) its key is remembered, up
    to ``max_deferred`` keys, and once the queue is empty the workers read such blocks back from the
    disk tier, oldest first, and upload them, unless the tier holds them by then (one HEAD each: another
    node read the same file meanwhile; ``present``). A node reading faster than it can upload (a 1 GiB file
    read cold at ~1 GB/s, PUTs at a few hundred MB/s) so fills the cluster store with the whole file
    at the pace of its uploads, instead of with the part that fitted in the queue (a third of it on
    this project's bench machine, the rest dropped). Memory stays bounded by ``max_bytes``: a
    deferred block is held only while it is uploaded. A block gone from the disk tier by then
    (evicted, or the tier down) is counted in ``gone``: another node, or the next miss, writes it."""

    def __init__(
        self,
        tier: ClusterBlockTier,
        *,
        max_blocks: int = DEFAULT_WRITE_BEHIND_BLOCKS,
        max_bytes: int = DEFAULT_WRITE_BEHIND_BYTES,
        workers: int = DEFAULT_WRITE_BEHIND_WORKERS,
        max_deferred: int = DEFAULT_WRITE_BEHIND_DEFERRED,
    ) -> None:
        if max_blocks < 1 or max_bytes < 1 or workers < 1 or max_deferred < 0:
            raise ValueError("the write-behind queue needs room for a block and a worker")
        self.tier = tier
        self.max_blocks = max_blocks
        self.max_bytes = max_bytes
        self.workers = workers
        self.max_deferred = max_deferred
        self.stats = WriteBehindStats()
        self._queue: collections.deque[tuple[BlockKey, BlockData]] = collections.deque()
        self._pending = set[BlockKey]()  # queued or uploading (from the queue or read back)
        self._deferred: dict[BlockKey, int] = {}  # their lengths, oldest first; none of them pending
        self._read_back: ReadBack | None = None
        self._bytes = 0  # queued and uploading
        self._uploading = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    def read_back_from(self, read_back: ReadBack) -> None:
        """Where deferred blocks are read back from (the node's disk tier); without it a block
        offered to a full queue is dropped."""
        self._read_back = read_back

    def depth(self) -> int:
        """Blocks waiting (queued or deferred) or being uploaded."""
        return len(self._queue) + self._uploading + len(self._deferred)

    def queued_bytes(self) -> int:
        return self._bytes

    def offer(self, key: BlockKey, data: BlockData) -> bool:
        """Queue ``data`` for upload; False when the queue is full (then deferred, or counted as dropped)."""
        if key in self._pending:
            return True
        if len(self._queue) + self._uploading >= self.max_blocks or self._bytes + len(data) > self.max_bytes:
            if key in self._deferred:
                return False
            if self._read_back is not None and len(self._deferred) < self.max_deferred:
                self._deferred[key] = len(data)
                self.stats.deferred += 1
                self._wake()  # (a block larger than the queue's bytes finds no worker running)
                return False
            self.stats.dropped += 1
            self.stats.dropped_bytes += len(data)
            return False
        self._deferred.pop(key, None)  # (offered again with room: queued, not read back)
        self._queue.append((key, data))
        self._pending.add(key)
        self._bytes += len(data)
        self.stats.queued += 1
        self._wake()
        return True

    def _wake(self) -> None:
        self._idle.clear()
        if len(self._tasks) < self.workers:
            task = asyncio.get_running_loop().create_task(self._work())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _next(self) -> tuple[BlockKey, BlockData] | None:
        """The next block to upload, counted as uploading: the queue's first, else a deferred block
        read back from the disk tier (skipping those gone from it) where its bytes fit in
        ``max_bytes`` beside the uploads under way (or none is under way); None when there is none
        this worker may take (a worker still uploading takes the rest)."""
        if self._queue:
            self._uploading += 1
            return self._queue.popleft()
        while self._deferred and self._read_back is not None:
            key, length = next(iter(self._deferred.items()))
            if self._uploading and self._bytes + length > self.max_bytes:
                return None
            del self._deferred[key]  # (never pending too: offer queues a deferred key only after taking it out)
            self._pending.add(key)
            self._uploading += 1
            self._bytes += length  # (held from here: the read back's buffer)
            data: BlockData | None = None
            present = await self.tier.contains(key)  # (another node may have stored it meanwhile)
            if not present:
                try:
                    data = await self._read_back(key)
                except Exception:  # noqa: BLE001 - a read back that fails is a block gone, not a crash
                    log.warning("cluster write-behind: reading a deferred block back failed", exc_info=True)
            if data is not None and len(data) == length:
                self.stats.caught_up += 1
                return key, data
            self._uploading -= 1
            self._bytes -= length
            self._pending.discard(key)
            if present:
                self.stats.present += 1
            else:
                self.stats.gone += 1
        return None

    async def _work(self) -> None:
        while (item := await self._next()) is not None:
            key, data = item
            try:
                stored = await self.tier.put(key, data)
            except Exception:  # noqa: BLE001 - the tier never raises; this guards a broken one
                log.warning("cluster write-behind failed", exc_info=True)
                stored = False
            finally:
                self._uploading -= 1
                self._bytes -= len(data)  # (a block read back was counted at its deferred length: the same)
                self._pending.discard(key)
            if stored:
                self.stats.written += 1
            else:
                self.stats.failed += 1
        if self.depth() == 0:
            self._idle.set()

    async def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until the queue is empty, deferred blocks included (at most ``timeout_s``); whether it is."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    async def close(self, timeout_s: float) -> None:
        """Finish the uploads in ``timeout_s`` if possible, then drop what is left."""
        if not await self.drain(timeout_s):
            self._queue.clear()
            self._deferred.clear()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def snapshot(self) -> dict[str, int]:
        return {
            "depth": self.depth(),
            "queued_bytes": self._bytes,
            "max_blocks": self.max_blocks,
            "max_bytes": self.max_bytes,
            "queued": self.stats.queued,
            "written": self.stats.written,
            "failed": self.stats.failed,
            "dropped": self.stats.dropped,
            "dropped_bytes": self.stats.dropped_bytes,
            "deferred_now": len(self._deferred),
            "deferred": self.stats.deferred,
            "caught_up": self.stats.caught_up,
            "gone": self.stats.gone,
            "present": self.stats.present,
        }


@dataclass
class GarbageReport:
    blocks: int = 0  # blocks found
    bytes: int = 0  # their total size
    deleted: int = 0
    deleted_bytes: int = 0


async def collect_garbage(store: ObjectStore, max_bytes: int, *, dry_run: bool = False) -> GarbageReport:
    """Delete the least recently written blocks under ``blocks/`` until they total at most ``max_bytes``.

    One LIST per prefix directory (256 of them) and one DELETE per block removed. Recency is the
    object's LastModified, i.e. LRU by write time: a block read every day but written a month ago
    goes first. A reader of a deleted block misses, fetches it from the source and writes it again.
    """
    found: list[tuple[float, str, int]] = []
    top = await store.list_dir(BLOCKS_PREFIX)
    for sub in sorted(top.dirs):
        listing = await store.list_dir(f"{BLOCKS_PREFIX}{sub}/")
        for name, info in listing.files.items():
            found.append((info.mtime, f"{BLOCKS_PREFIX}{sub}/{name}", info.size))
    report = GarbageReport(blocks=len(found), bytes=sum(size for _, _, size in found))
    total = report.bytes
    for _, name, size in sorted(found):
        if total <= max_bytes:
            break
        if not dry_run:
            try:
                await store.delete(name)
            except ObjectNotFoundError:
                pass
        total -= size
        report.deleted += 1
        report.deleted_bytes += size
    return report


__all__ = [
    "ClusterTier",
    "InMemoryClusterTier",
    "WriteBehind",
    "collect_garbage",
    "cluster_object_key",
    "cluster_token",
]
