"""The seams of the engine: one small Protocol each, with in-memory implementations in the package.

``BlockTier``      a bounded cache of whole blocks (RAM, local disk). Synchronous: the RAM tier is
                   called on the event loop, the disk tier through a thread pool by the engine.
``DiskBlockTier``  the ``BlockTier`` below RAM, with what only that tier has: pins, health,
                   eviction watermarks, a recency refresh without I/O, and the ``SpaceBudget`` of
                   staged write-back data (why two Protocols: its docstring).
``ObjectStore``    the source of truth (S3, a local directory, an in-memory dict). Asynchronous, on
                   the same event loop as FUSE. Reads, and the writes of write-back: ``put`` (atomic
                   create or replace), ``delete``, ``copy`` (server side, for rename).
``ClusterBlockTier`` a tier of blocks shared by every node (objects in an in-cluster S3 store),
                   below the disk tier and above the source. Asynchronous (``get``/``put``); no pins,
                   no capacity, no recency: what it holds is bounded by ``cachefs cluster gc`` or a
                   lifecycle rule, and a failure is always a miss (``tiering.tiers.cluster``).
``VictimOrder``    the order in which a tier takes its eviction victims, when something knows better
                   than recency (an announced read order, ``tiering.policy.readorder``).
``SpaceBudget``    bytes of local disk that staged (dirty) data may take; the disk tier implements
                   it, so staged bytes and cached blocks share one capacity and only clean blocks
                   are evicted.

Every member a caller uses is stated in its Protocol, and the callers use no ``getattr``/``hasattr``
on these seams: mypy (``make test``) then turns a misspelt member into a failed build instead of a
feature that silently turns itself off.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Final, Iterable, Mapping, Protocol, runtime_checkable

from tiering.blocks import BlockData, BlockKey
from tiering.handoff import AfterReceive
from tiering.health import TierHealth


@runtime_checkable
class VictimOrder(Protocol):
    """How soon each block will be read again, for a tier choosing what to evict (``tiering.policy.victims``).

    ``next_use`` is a distance (blocks read before it; ``inf``: not known to be needed); a tier
    evicts the farthest first and keeps LRU order among equals. While ``active()`` is False the
    tier skips the ranking altogether and evicts in plain LRU order. The disk tier calls both from
    worker threads under its lock, so they must not block.
    """

    def active(self) -> bool: ...

    def next_use(self, key: BlockKey) -> float: ...


@dataclass
class TierStats:
    """Counters of one tier. Only ever incremented; read by the stats endpoint."""

    hits: int = 0
    misses: int = 0
    # Bytes of reads this tier answered: the part of each block the reader asked for, counted by the
    # engine (which knows the range), not the whole block per lookup; read-ahead loads add nothing
    # (the read that later uses the block counts it).
    hit_bytes: int = 0
    inserts: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    errors: int = 0
    corrupt_blocks: int = 0
    rejected: int = 0  # puts refused (block larger than the tier, or nothing evictable)
    # Evictions whose victims a VictimOrder ranked (farthest next use first) rather than plain LRU.
    ordered_evictions: int = 0


@runtime_checkable
class SpaceBudget(Protocol):
    """Bytes of local disk that staged write-back data may use, shared with the disk cache.

    ``reserve_space`` makes room by evicting clean cached blocks (never staged data, never pinned
    blocks) and returns False when even that cannot fit ``nbytes`` under the capacity; with
    ``force`` it always succeeds (staged data found at start-up must be kept even if the capacity
    was lowered). Thread-safe; may do file I/O (eviction), so call it from a worker thread.
    """

    capacity_bytes: int

    def reserve_space(self, nbytes: int, *, force: bool = False) -> bool: ...

    def release_space(self, nbytes: int) -> None: ...

    def reserved_space(self) -> int: ...


@runtime_checkable
class BlockTier(Protocol):
    """A byte-bounded cache of blocks. ``used_bytes() <= capacity_bytes`` holds after every call.

    Everything the engine and the features call on *any* tier is here, so a misspelt name is a type
    error, not a feature that silently turns off. What only the disk tier can answer is in
    ``DiskBlockTier`` below.
    """

    name: str
    capacity_bytes: int
    stats: TierStats

    def get(self, key: BlockKey) -> BlockData | None:
        """The block's bytes, or None on a miss. Counts a hit or a miss and refreshes recency."""

    def contains(self, key: BlockKey) -> bool:
        """Whether the block is held, without counting or refreshing anything."""

    def absent(self, key: BlockKey) -> bool:
        """True, counting a miss as ``get`` would, when the block is not held; False when it may be.

        No I/O: the engine asks on the event loop, so a miss costs no trip to a worker thread.
        """

    def put(self, key: BlockKey, data: BlockData) -> bool:
        """Store a block, evicting least-recently-used clean blocks to make room.

        Returns False (and stores nothing) when the block cannot fit even after eviction.
        """

    def discard(self, key: BlockKey) -> None:
        """Drop a block if held."""

    def keys(self) -> list[BlockKey]:
        """Held keys, least recently used first, as a new list (callers discard while iterating).

        A tier may list only the keys it has seen: the disk tier does not list blocks found at
        start-up until they are touched.
        """

    def used_bytes(self) -> int: ...

    def __len__(self) -> int: ...


@runtime_checkable
class DiskBlockTier(BlockTier, SpaceBudget, Protocol):
    """The tier below RAM: a ``BlockTier`` that can also pin blocks, fail, and hold staged data.

    Why a second Protocol rather than one with neutral answers on the RAM tier: these members
    describe state the RAM tier does not have. RAM holds the working set of reads on the event
    loop, cannot fail (so it has no health to report), loses everything at a restart (so a pin,
    which must survive one, has no meaning there) and never holds staged write-back data (so it is
    no ``SpaceBudget`` and has no watermarks to bound it). A RAM tier answering ``pin`` with a no-op
    would claim a guarantee it does not give. The engine takes ``ram: BlockTier`` and
    ``disk: DiskBlockTier | None``, and features reach the disk tier through the engine's typed
    ``disk`` attribute, so every member they use is stated here and checked by the type checker.

    ``reserve_space``/``release_space``/``reserved_space`` (``SpaceBudget``) count staged bytes in
    ``used_bytes()``; they are never evicted.
    """

    health: TierHealth
    high_watermark: float  # an insert that would take usage above this share of the capacity evicts ...
    low_watermark: float  # ... a batch, down to this share

    def pin(self, keys: Iterable[BlockKey]) -> None:
        """Keep these blocks from eviction, whether they are held yet or not (no I/O)."""

    def unpin(self, keys: Iterable[BlockKey]) -> None:
        """Let eviction take these blocks again."""

    def is_pinned(self, key: BlockKey) -> bool: ...

    def pinned_bytes(self) -> int:
        """Bytes of the pinned blocks held now."""

    def touch(self, key: BlockKey) -> bool:
        """Mark a held block most recently used, in memory only (no I/O); False if not held."""

    def get_for_reply(self, key: BlockKey) -> BlockData | None:
        """``get`` into a buffer of the calling thread's, valid until that thread's next call: for a
        reply written at once by the thread that read it, never for keeping (no RAM-tier copy)."""

    def peek(self, key: BlockKey) -> BlockData | None:
        """``get`` for another tier's copy, checked alike: not counted as a hit or a miss, and the
        block's recency unchanged (no reader asked for it)."""

    def evict_unpinned(self) -> tuple[int, int]:
        """Drop every block eviction may take (all but pinned ones): ``(blocks, bytes)``."""


@dataclass
class ClusterTierStats:
    """Counters of the cluster tier. Only ever incremented; read by ``/stats`` and ``/metrics``."""

    hits: int = 0
    misses: int = 0
    hit_bytes: int = 0  # bytes of the blocks it returned
    errors: int = 0  # requests that failed or timed out (each one a miss, or a write not made)
    corrupt_blocks: int = 0  # objects that failed a check (truncated, checksum, foreign): misses
    forged_blocks: int = 0  # of those, frames whose MAC failed (not written with the cluster key)
    stale_blocks: int = 0  # objects of the previous, unauthenticated format: misses, overwritten
    skipped: int = 0  # lookups not even tried: the store's circuit was open
    puts: int = 0  # blocks written
    put_bytes: int = 0


@runtime_checkable
class ClusterBlockTier(Protocol):
    """Blocks shared by every node of a cluster. Never raises to a caller: a failure is a miss.

    Why not a ``BlockTier``: the store is shared and remote, so this tier has no capacity it
    enforces per node, no recency to refresh, no pins and nothing to evict locally; it is reached
    over the network, so its calls are coroutines, each bounded by the tier's own timeout.
    """

    name: str
    stats: ClusterTierStats

    @property
    def store_stats(self) -> ObjectStoreStats:
        """The requests and bytes sent to and read from the cluster store (what the tier costs)."""

    async def get(self, key: BlockKey, length: int) -> BlockData | None:
        """The block's ``length`` bytes, or None (a miss: absent, corrupt, foreign, failing store)."""

    async def put(self, key: BlockKey, data: BlockData) -> bool:
        """Store the block (replacing whatever was there); False if the store failed."""

    async def contains(self, key: BlockKey) -> bool:
        """Whether the store holds an object for the block (no content check); False on failure."""

    def snapshot(self) -> dict[str, Any]:
        """What ``/stats`` shows beside the counters: ``state`` (healthy or down) and details."""


# ``get_range``'s ``etag`` for "whatever version is current": one request, no version check. For
# readers whose objects carry their own identity and checksum (the cluster tier's framed blocks),
# which would otherwise pay a HEAD to learn an ETag only to pass it back. ``*`` as in HTTP's
# ``If-Match: *``; the stores implement it by not sending or checking a version at all.
ANY_VERSION: Final = "*"


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What the store says about one object. ``key`` is relative to the store's root prefix."""

    key: str
    size: int
    etag: str
    mtime: float  # seconds since the epoch


@dataclass
class Listing:
    """One level of a ``/``-delimited listing.

    ``files`` are objects directly under the prefix, ``dirs`` are child names that have objects below
    them (common prefixes, including zero-byte directory markers ``name/``). Names are raw: the
    filesystem decides which are valid POSIX names. A marker object for the listed prefix itself is
    not reported as a file.
    """

    files: dict[str, ObjectInfo] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=set)


@dataclass
class ObjectStoreStats:
    requests: int = 0
    bytes_read: int = 0
    errors: int = 0
    get_requests: int = 0
    list_requests: int = 0
    head_requests: int = 0
    put_requests: int = 0  # PUTs, multipart parts and completions count one each
    delete_requests: int = 0
    copy_requests: int = 0
    bytes_written: int = 0
    presigned_gets: int = 0  # ranged GETs answered on a presigned URL (S3 store; counted in get_requests)
    presigned_fallbacks: int = 0  # ... that botocore had to repeat (403, 5xx, connection error, ...)


# ``read(start, end)`` returns bytes ``[start, end)`` of the content to upload. It is blocking (it
# reads a staged file) and is called from a worker thread, possibly from several at once for
# different ranges; it must return exactly ``end - start`` bytes.
ReadRange = Callable[[int, int], bytes]


@runtime_checkable
class ObjectStore(Protocol):
    """The source of truth. Keys are relative to the root the store was opened on (bucket/prefix)."""

    stats: ObjectStoreStats
    # The longest key (UTF-8 bytes, relative to the root) this store can hold: S3's limit less the
    # prefix (``tiering.objectstore.keys.MAX_KEY_BYTES``). The filesystem refuses longer names.
    max_key_bytes: int

    async def check(self) -> bool:
        """Verify the root is reachable and readable; raise a ``tiering.errors`` error otherwise.

        Returns whether the root holds anything (an object or a directory marker): an empty root at
        mount is likely a typo in the prefix, worth a warning. Answered by the same one request."""

    async def list_dir(self, prefix: str) -> Listing:
        """List one level under ``prefix`` (``""`` for the root, else ending in ``/``), all pages."""

    async def head(self, key: str) -> ObjectInfo:
        """Metadata of one object; ``ObjectNotFoundError`` if absent."""

    async def get_range(self, key: str, etag: str, start: int, end: int, *,
                        after: AfterReceive[Any] | None = None) -> BlockData:
        """Bytes ``[start, end)`` of the object, only if its ETag is still ``etag``.

        A read-only ``memoryview`` where the store received the range in place (S3): the caller
        may keep it. ``etag`` may be ``ANY_VERSION``: the bytes of the current version, unchecked.

        ``after``: work on the bytes that a store receiving in worker threads may claim (before
        this returns) and run in the receiving thread once the bytes are handed over
        (``tiering.handoff``); a store that does not leaves it unclaimed, for the caller to do.

        Raises ``ObjectChangedError`` if the object now has another ETag, ``ObjectNotFoundError`` if
        it is gone, ``ObjectStoreUnavailableError`` on timeouts and connection failures.
        """

    async def head_metadata(self, key: str) -> tuple[ObjectInfo, dict[str, str]]:
        """``head`` with the object's user metadata (S3's ``x-amz-meta-*``: names in lower case,
        without the prefix); ``ObjectNotFoundError`` if absent. A store without user metadata gives
        what it can (the local store: the file's mtime, ``tiering.objectstore.mtimes``)."""

    async def put(self, key: str, size: int, read: ReadRange, *,
                  metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        """Create or replace ``key`` with ``size`` bytes taken from ``read``; the new object's info.
        ``metadata``: user metadata stored with it (the writer's ``mtime``, ``tiering.objectstore.mtimes``).

        Atomic: a reader sees the old object or the whole new one, never a part or a mix (S3 PUT and
        CompleteMultipartUpload are atomic; the local store writes a temp file and renames it).
        Idempotent: putting the same bytes again leaves the same content. A key ending in ``/`` is a
        directory marker (``size`` 0). A failed put leaves the old object (or nothing) in place.
        """

    async def delete(self, key: str) -> None:
        """Remove ``key``; an absent key is not an error (as S3's DeleteObject)."""

    async def copy(self, src: str, etag: str, dst: str, *,
                   metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        """Server-side copy of ``src`` (only while its ETag is ``etag``) to ``dst``; ``dst``'s info.

        ``dst`` gets ``src``'s user metadata (whatever its size: CopyObject or UploadPartCopy), with
        the names in ``metadata`` set to its values (``src == dst``: a metadata change in place,
        as rclone and s3fs-fuse set an mtime).

        ``ObjectChangedError`` if ``src`` has another ETag now, ``ObjectNotFoundError`` if absent.
        """

    async def close(self) -> None: ...
