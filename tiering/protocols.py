"""The seams of the engine: one small Protocol each, with in-memory implementations in the package.

``BlockTier``   a bounded cache of whole blocks (RAM, local disk). Synchronous: the RAM tier is
                called on the event loop, the disk tier through a thread pool by the engine.
``ObjectStore`` the source of truth (S3, a local directory, an in-memory dict). Asynchronous, on the
                same event loop as FUSE.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from tiering.blocks import BlockKey


@dataclass
class TierStats:
    """Counters of one tier. Only ever incremented; read by the stats endpoint."""

    hits: int = 0
    misses: int = 0
    hit_bytes: int = 0
    inserts: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    errors: int = 0
    corrupt_blocks: int = 0
    rejected: int = 0  # puts refused (block larger than the tier, or nothing evictable)


@runtime_checkable
class BlockTier(Protocol):
    """A byte-bounded cache of blocks. ``used_bytes() <= capacity_bytes`` holds after every call."""

    name: str
    capacity_bytes: int
    stats: TierStats

    def get(self, key: BlockKey) -> bytes | None:
        """The block's bytes, or None on a miss. Counts a hit or a miss and refreshes recency."""

    def contains(self, key: BlockKey) -> bool:
        """Whether the block is held, without counting or refreshing anything."""

    def put(self, key: BlockKey, data: bytes) -> bool:
        """Store a block, evicting least-recently-used clean blocks to make room.

        Returns False (and stores nothing) when the block cannot fit even after eviction.
        """

    def discard(self, key: BlockKey) -> None:
        """Drop a block if held."""

    def used_bytes(self) -> int: ...

    def __len__(self) -> int: ...


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


@runtime_checkable
class ObjectStore(Protocol):
    """The source of truth. Keys are relative to the root the store was opened on (bucket/prefix)."""

    stats: ObjectStoreStats

    async def check(self) -> None:
        """Verify the root is reachable and readable; raise a ``tiering.errors`` error otherwise."""

    async def list_dir(self, prefix: str) -> Listing:
        """List one level under ``prefix`` (``""`` for the root, else ending in ``/``), all pages."""

    async def head(self, key: str) -> ObjectInfo:
        """Metadata of one object; ``ObjectNotFoundError`` if absent."""

    async def get_range(self, key: str, etag: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object, only if its ETag is still ``etag``.

        Raises ``ObjectChangedError`` if the object now has another ETag, ``ObjectNotFoundError`` if
        it is gone, ``ObjectStoreUnavailableError`` on timeouts and connection failures.
        """

    async def close(self) -> None: ...
