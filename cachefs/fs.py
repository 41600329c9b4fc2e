"""POSIX semantics over the object store and the block cache, with no FUSE in sight.

``CacheFS`` is what the pyfuse3 adapter calls, one method per FUSE operation; it is tested without a
mount. It owns three tables:

* **Inodes.** Every path the kernel has been told about has one ``Node`` with a stable inode number
  and a lookup count. ``forget`` drops a node once the kernel holds no reference and no handle is
  open, so the table stays bounded by what the kernel caches, not by the size of the bucket.
* **Listings.** Directories are listed lazily, one ``/``-delimited level at a time, and cached for
  ``dir_ttl_s``. Lookups and negative lookups are answered from the parent's listing, so walking a
  directory costs one paginated LIST, not one request per name. Concurrent refreshes of one
  directory share one LIST. If the store cannot be reached, an expired listing is still served
  (with a warning): cached data keeps flowing during an outage.
* **Handles.** An open file pins one version of its object (key, ETag, size): reads through that
  handle never mix bytes of two versions. Each handle has its own read-ahead state.

The kernel's page cache is used across opens (``keep_cache``) as long as the object's ETag is the
one seen at the previous open; when it changed, the open answers without ``keep_cache`` and the
kernel drops its cached pages of the file.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import stat
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator, NewType

from cachefs.errors import FsError
from cachefs.names import WarnOnce, encode_name, invalid_name_reason
from cachefs.settings import FsSettings
from tiering.blocks import ObjectRef
from tiering.clock import Clock, SystemClock
from tiering.engine import BlockCache
from tiering.errors import ObjectStoreError, ObjectStoreUnavailableError
from tiering.protocols import ObjectInfo, ObjectStore
from tiering.readahead import ReadAhead

log = logging.getLogger(__name__)

InodeNo = NewType("InodeNo", int)
FileHandle = NewType("FileHandle", int)
ROOT_INODE = InodeNo(1)

# The listing cache is bounded by the number of entries it holds across all directories (about
# 200 bytes each): 500,000 entries is ~100 MiB, enough for several 100,000-entry directories.
MAX_CACHED_LISTING_ENTRIES = 500_000
# Blocks reported to statfs are in units of this size (the usual 4 KiB page).
STATFS_BLOCK_SIZE = 4096
CONTROL_XATTR = "user.cachefs.control"

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT


@dataclass(frozen=True)
class Attributes:
    """What ``stat`` shows for one inode, plus how long the kernel may cache it."""

    inode: InodeNo
    mode: int
    size: int
    mtime_ns: int
    uid: int
    gid: int
    nlink: int
    attr_timeout: float
    entry_timeout: float

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)


@dataclass
class Node:
    inode: InodeNo
    path: str  # relative to the mount root, no leading or trailing "/"; "" is the root
    is_dir: bool
    info: ObjectInfo | None = None  # files only
    mtime: float = 0.0
    lookups: int = 0
    open_handles: int = 0
    page_cache_etag: str | None = None  # ETag the kernel's page cache holds for this file


@dataclass
class Listing:
    """A cached directory level: name -> ObjectInfo for files, None for directories."""

    entries: dict[str, ObjectInfo | None]
    expires_at: float


@dataclass
class FileHandleState:
    node: Node
    ref: ObjectRef
    readahead: ReadAhead


@dataclass
class DirHandleState:
    node: Node
    entries: list[tuple[str, ObjectInfo | None]]


@dataclass(frozen=True)
class DirEntry:
    name: bytes
    attrs: Attributes
    next_id: int


@dataclass(frozen=True)
class StatFs:
    block_size: int
    blocks: int
    blocks_free: int
    files: int
    files_free: int
    name_max: int = 255


@dataclass
class FsStats:
    lookups: int = 0
    listings: int = 0
    listing_errors: int = 0
    stale_listings_served: int = 0
    opens: int = 0
    reads: int = 0
    read_bytes: int = 0
    skipped_keys: int = 0


def join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


class CacheFS:
    def __init__(
        self,
        store: ObjectStore,
        cache: BlockCache,
        settings: FsSettings,
        *,
        clock: Clock | None = None,
        control_path: str | None = None,
    ) -> None:
        self.store = store
        self.cache = cache
        self.settings = settings
        self.clock = clock or SystemClock()
        self.control_path = control_path
        self.stats = FsStats()
        # Directories have no mtime in an object store; they show the time of the mount.
        self._mount_time = time.time()
        root = Node(ROOT_INODE, "", True, mtime=self._mount_time, lookups=1)
        self._nodes: dict[InodeNo, Node] = {ROOT_INODE: root}
        self._by_path: dict[str, Node] = {"": root}
        self._next_inode = ROOT_INODE + 1
        self._listings: OrderedDict[str, Listing] = OrderedDict()
        self._listing_entries = 0
        self._listing_flights: dict[str, asyncio.Task[Listing]] = {}
        self._handles: dict[int, FileHandleState | DirHandleState] = {}
        self._next_fh = 1
        self._bad_keys = WarnOnce()

    # ------------------------------------------------------------------ attributes
    def _attributes(self, node: Node) -> Attributes:
        s = self.settings
        if node.is_dir:
            mode, size, mtime = stat.S_IFDIR | s.dir_mode, 0, node.mtime
        else:
            assert node.info is not None
            mode, size, mtime = stat.S_IFREG | s.file_mode, node.info.size, node.info.mtime
        return Attributes(
            inode=node.inode,
            mode=mode,
            size=size,
            mtime_ns=int(mtime * 1e9),
            uid=s.uid,
            gid=s.gid,
            nlink=2 if node.is_dir else 1,
            attr_timeout=s.attr_ttl_s,
            entry_timeout=s.dir_ttl_s,
        )

    def _node(self, inode: int) -> Node:
        node = self._nodes.get(InodeNo(inode))
        if node is None:
            raise FsError(errno.ENOENT, f"unknown inode {inode}")
        return node

    def _node_for(self, path: str, info: ObjectInfo | None) -> Node:
        """The node for ``path``, created or updated from the latest listing entry."""
        is_dir = info is None
        node = self._by_path.get(path)
        if node is not None and node.is_dir != is_dir:
            # A file became a directory or back: a new inode, so nothing cached for the old kind
            # is ever attributed to the new one.
            self._by_path.pop(path)
            node = None
        if node is None:
            node = Node(InodeNo(self._next_inode), path, is_dir, mtime=self._mount_time)
            self._next_inode += 1
            self._nodes[node.inode] = node
            self._by_path[path] = node
        if info is not None:
            node.info = info
        return node

    # ------------------------------------------------------------------ listings
    async def _listing(self, path: str) -> Listing:
        cached = self._listings.get(path)
        now = self.clock.monotonic()
        if cached is not None and cached.expires_at > now:
            self._listings.move_to_end(path)
            return cached
        flight = self._listing_flights.get(path)
        if flight is None:
            # The LIST runs as its own task, so a caller that is cancelled does not cancel the
            # listing other lookups of the same directory are waiting for.
            flight = asyncio.get_running_loop().create_task(self._fetch_listing(path, cached))
            flight.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._listing_flights[path] = flight
            flight.add_done_callback(lambda f: self._listing_flights.pop(path, None) if self._listing_flights.get(path) is f else None)
        return await asyncio.shield(flight)

    async def _fetch_listing(self, path: str, stale: Listing | None) -> Listing:
        self.stats.listings += 1
        try:
            raw = await self.store.list_dir(path + "/" if path else "")
        except ObjectStoreUnavailableError as exc:
            self.stats.listing_errors += 1
            if stale is not None:
                self.stats.stale_listings_served += 1
                log.warning("serving cached listing of /%s: %s", path, exc)
                return stale
            raise
        except ObjectStoreError:
            self.stats.listing_errors += 1
            raise
        entries: dict[str, ObjectInfo | None] = {}
        for name in raw.dirs:
            reason = invalid_name_reason(name)
            if reason:
                self._skip(join(path, name) + "/", reason)
                continue
            entries[name] = None
        for name, info in raw.files.items():
            reason = invalid_name_reason(name)
            if reason:
                self._skip(join(path, name), reason)
            elif name in entries:
                self._skip(join(path, name), "a directory of the same name exists")
            else:
                entries[name] = info
        listing = Listing(entries, self.clock.monotonic() + self.settings.dir_ttl_s)
        self._remember_listing(path, listing)
        # Refresh nodes the kernel already knows, so getattr after the TTL sees new sizes/ETags.
        for name, info in entries.items():
            node = self._by_path.get(join(path, name))
            if node is not None and info is not None and not node.is_dir:
                node.info = info
        return listing

    def _remember_listing(self, path: str, listing: Listing) -> None:
        old = self._listings.pop(path, None)
        if old is not None:
            self._listing_entries -= len(old.entries)
        if len(listing.entries) > MAX_CACHED_LISTING_ENTRIES:
            return
        self._listings[path] = listing
        self._listing_entries += len(listing.entries)
        while self._listing_entries > MAX_CACHED_LISTING_ENTRIES and self._listings:
            _, evicted = self._listings.popitem(last=False)
            self._listing_entries -= len(evicted.entries)

    def _skip(self, key: str, reason: str) -> None:
        before = self._bad_keys.count
        self._bad_keys.warn(key, reason)
        self.stats.skipped_keys += self._bad_keys.count - before

    async def _refresh(self, node: Node) -> None:
        """Bring a file node's ObjectInfo up to date if its attributes expired."""
        if node.is_dir or node.inode == ROOT_INODE:
            return
        parent, _, name = node.path.rpartition("/")
        listing = await self._listing(parent)
        info = listing.entries.get(name, False)
        if info is False or info is None:
            # Gone from the store (or became a directory): keep serving what the kernel knows
            # until it looks the name up again; reads of a deleted object fail with ENOENT.
            return
        node.info = info

    # ------------------------------------------------------------------ FUSE operations
    async def lookup(self, parent_inode: int, name: bytes) -> Attributes:
        self.stats.lookups += 1
        parent = self._node(parent_inode)
        if not parent.is_dir:
            raise FsError(errno.ENOTDIR)
        try:
            text = name.decode("utf-8")
        except UnicodeDecodeError:
            raise FsError(errno.ENOENT) from None
        if text == ".":
            node = parent
        elif text == "..":
            node = self._by_path.get(parent.path.rpartition("/")[0], self._nodes[ROOT_INODE])
        else:
            listing = await self._listing(parent.path)
            if text not in listing.entries:
                raise FsError(errno.ENOENT)
            node = self._node_for(join(parent.path, text), listing.entries[text])
        node.lookups += 1
        return self._attributes(node)

    def forget(self, inode: int, nlookup: int) -> None:
        node = self._nodes.get(InodeNo(inode))
        if node is None or node.inode == ROOT_INODE:
            return
        node.lookups = max(0, node.lookups - nlookup)
        self._maybe_drop(node)

    def _maybe_drop(self, node: Node) -> None:
        if node.lookups == 0 and node.open_handles == 0 and node.inode != ROOT_INODE:
            self._nodes.pop(node.inode, None)
            if self._by_path.get(node.path) is node:
                del self._by_path[node.path]

    def add_lookup(self, inode: int) -> None:
        """The kernel took a reference through readdirplus."""
        self._node(inode).lookups += 1

    async def getattr(self, inode: int) -> Attributes:
        node = self._node(inode)
        await self._refresh(node)
        return self._attributes(node)

    async def open(self, inode: int, flags: int) -> tuple[FileHandle, bool]:
        """Open a file; returns the handle and whether the kernel may keep its cached pages."""
        node = self._node(inode)
        if node.is_dir:
            raise FsError(errno.EISDIR)
        if flags & _WRITE_FLAGS and self.settings.read_only:
            raise FsError(errno.EROFS)
        await self._refresh(node)
        assert node.info is not None
        info = node.info
        keep_cache = node.page_cache_etag == info.etag
        node.page_cache_etag = info.etag
        self.stats.opens += 1
        fh = self._new_handle(
            FileHandleState(
                node,
                ObjectRef(info.key, info.etag, info.size),
                ReadAhead(self.cache.block_size, self.cache.readahead_limit),
            )
        )
        node.open_handles += 1
        return fh, keep_cache

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        handle = self._handles.get(fh)
        if not isinstance(handle, FileHandleState):
            raise FsError(errno.EBADF)
        if offset < 0 or size < 0:
            raise FsError(errno.EINVAL)
        window = handle.readahead.on_read(offset, size)
        data = await self.cache.read(handle.ref, offset, size, readahead_bytes=window)
        self.stats.reads += 1
        self.stats.read_bytes += len(data)
        return data

    def release(self, fh: int) -> None:
        handle = self._handles.pop(fh, None)
        if handle is not None:
            handle.node.open_handles -= 1
            self._maybe_drop(handle.node)

    async def opendir(self, inode: int) -> FileHandle:
        node = self._node(inode)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        listing = await self._listing(node.path)
        # A snapshot per handle: offsets stay meaningful while the listing is refreshed.
        entries = sorted(listing.entries.items())
        node.open_handles += 1
        return self._new_handle(DirHandleState(node, entries))

    def readdir(self, fh: int, start_id: int) -> Iterator[DirEntry]:
        """Entries from position ``start_id`` on, made one at a time as the caller takes them.

        The caller reports each one it passed on with ``add_lookup`` (readdirplus hands the kernel
        a reference). Lazy because the kernel takes a buffer's worth per call and comes back with
        the next offset: building every remaining entry on each call would cost O(n^2) for a large
        directory and leave an inode the kernel never heard of (so never forgets) for each of them.
        The handle is checked now, not on first iteration.
        """
        handle = self._handles.get(fh)
        if not isinstance(handle, DirHandleState):
            raise FsError(errno.EBADF)
        return self._dir_entries(handle, start_id)

    def _dir_entries(self, handle: DirHandleState, start_id: int) -> Iterator[DirEntry]:
        for position in range(start_id, len(handle.entries)):
            name, info = handle.entries[position]
            node = self._node_for(join(handle.node.path, name), info)
            yield DirEntry(encode_name(name), self._attributes(node), position + 1)

    def releasedir(self, fh: int) -> None:
        self.release(fh)

    def statfs(self) -> StatFs:
        disk = self.cache.disk
        capacity = disk.capacity_bytes if disk is not None else self.cache.ram.capacity_bytes
        used = disk.used_bytes() if disk is not None else self.cache.ram.used_bytes()
        return StatFs(
            block_size=STATFS_BLOCK_SIZE,
            blocks=capacity // STATFS_BLOCK_SIZE,
            blocks_free=max(0, capacity - used) // STATFS_BLOCK_SIZE,
            files=len(self._nodes),
            files_free=0,
        )

    def getxattr(self, inode: int, name: bytes) -> bytes:
        node = self._node(inode)
        if node.inode == ROOT_INODE and name == CONTROL_XATTR.encode() and self.control_path:
            return self.control_path.encode()
        raise FsError(errno.ENODATA)

    def listxattr(self, inode: int) -> list[bytes]:
        node = self._node(inode)
        if node.inode == ROOT_INODE and self.control_path:
            return [CONTROL_XATTR.encode()]
        return []

    def refuse_write(self) -> None:
        """Every modifying operation on a read-only mount."""
        raise FsError(errno.EROFS)

    def _new_handle(self, state: FileHandleState | DirHandleState) -> FileHandle:
        fh = FileHandle(self._next_fh)
        self._next_fh += 1
        self._handles[fh] = state
        return fh

    # ------------------------------------------------------------------ stats
    def stats_snapshot(self) -> dict[str, Any]:
        """The document ``cachefs stats --json`` prints."""
        tiers: dict[str, Any] = {}
        for tier in (self.cache.ram, self.cache.disk):
            if tier is None:
                continue
            st = tier.stats
            entry = {
                "used_bytes": tier.used_bytes(),
                "capacity_bytes": tier.capacity_bytes,
                "entries": len(tier),
                "hits": st.hits,
                "misses": st.misses,
                "hit_bytes": st.hit_bytes,
                "inserts": st.inserts,
                "evictions": st.evictions,
                "evicted_bytes": st.evicted_bytes,
                "errors": st.errors,
                "corrupt_blocks": st.corrupt_blocks,
            }
            # Bytes reads had to load from below this tier because it missed (see EngineStats).
            entry["miss_bytes"] = (self.cache.stats.ram_miss_bytes if tier is self.cache.ram
                                   else self.cache.stats.disk_miss_bytes)
            pinned_bytes = getattr(tier, "pinned_bytes", None)
            if pinned_bytes is not None:
                entry["pinned_bytes"] = pinned_bytes()
            health = getattr(tier, "health", None)
            if health is not None:
                entry["state"] = health.state
            tiers[tier.name] = entry
        store = self.store.stats
        engine = self.cache.stats
        return {
            "tiers": tiers,
            "object_store": {
                "requests": store.requests,
                "bytes_read": store.bytes_read,
                "errors": store.errors,
                "get_requests": store.get_requests,
                "list_requests": store.list_requests,
                "head_requests": store.head_requests,
            },
            "hit_ratio": round(self.cache.hit_ratio(), 6),
            "blocks": {
                "block_size": self.cache.block_size,
                "requests": engine.block_requests,
                "ram_served": engine.ram_served,
                "disk_served": engine.disk_served,
                "fetched": engine.store_fetches,
                "fetched_bytes": engine.store_fetch_bytes,
                "fetch_errors": engine.fetch_errors,
                "readahead_blocks": engine.readahead_blocks,
                "readahead_bytes": engine.readahead_bytes,
                "singleflight_joins": engine.singleflight_joins,
                "dropped_blocks": engine.dropped_blocks,
                "dropped_bytes": engine.dropped_bytes,
            },
            # Warming the disk tier (cachefs prefetch), pinned objects, request latency.
            "prefetch": {
                "blocks": engine.prefetch_blocks,
                "bytes": engine.prefetch_bytes,
                "from_ram_blocks": engine.prefetch_from_ram_blocks,
                "skipped_blocks": engine.prefetch_skipped_blocks,
                "skipped_bytes": engine.prefetch_skipped_bytes,
                "not_stored_blocks": engine.prefetch_not_stored,
            },
            "pins": self.cache.pin_stats(),
            "latency": {op: hist.snapshot() for op, hist in self.cache.latency.items()},
            "filesystem": {
                "inodes": len(self._nodes),
                "open_handles": len(self._handles),
                "cached_listings": len(self._listings),
                "cached_listing_entries": self._listing_entries,
                "lookups": self.stats.lookups,
                "listings": self.stats.listings,
                "listing_errors": self.stats.listing_errors,
                "stale_listings_served": self.stats.stale_listings_served,
                "opens": self.stats.opens,
                "reads": self.stats.reads,
                "read_bytes": self.stats.read_bytes,
                "skipped_keys": self.stats.skipped_keys,
            },
        }
