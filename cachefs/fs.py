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

Writes (write-back, see ``tiering.writeback``). A writable mount stages every change durably on
local disk and uploads it later; this class keeps the POSIX view consistent meanwhile. Lookups and
listings overlay the pending changes on the store's listings (``WriteBack.resolve``/``merge``), a
file with staged data is read from staging, and its attributes are its staged size and mtime. A
file with staged data is never opened with ``keep_cache``, and its ETag changes when its upload
lands, so the kernel never keeps pages of an older version; an open handle follows the changes made
through the mount (it pins a version only against changes made elsewhere). When an upload lands,
the cached listing of its directory is patched (and a listing being fetched at that moment is
patched when it arrives), so no view goes back to the old version.

Directories are marker objects (``dir/``): ``mkdir`` writes one, ``rmdir`` deletes it (after the
deletes below it), and a directory that loses an entry through the mount gets one too, because a
directory lives until rmdir even where the store would drop an empty prefix. Keys below a directory
still imply it, as on the read path. Rename of a staged file is journaled (its content is
acknowledged first); of a file only in the store, a server-side copy then a journaled delete; of a
directory, the same for every entry, refused beyond ``rename_dir_limit`` entries (E2BIG). None of
these renames is atomic: a crash can leave both names, never neither.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import os
import stat
import time
from collections import OrderedDict, deque
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
from tiering.writeback import MISSING, STAGED_ETAG, WriteBack
from tiering.writeback.staged import StagedFile

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
# Store changes remembered for patching listings that were being fetched when the change landed; a
# LIST outlived by more changes than this is answered but not cached.
MAX_APPLIED_LOG = 10_000
# Server-side copies in flight while a directory is renamed.
RENAME_CONCURRENCY = 16
# rename(2) flags (linux/fs.h).
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2

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
    staged: StagedFile | None = None  # write-back data of this file, while it has any
    writers: int = 0  # open handles that may write
    deleted: bool = False  # unlinked (or replaced by a rename) while the kernel still knows it
    local_gen: int = 0  # bumped by every change made through the mount (handles follow it)


@dataclass
class Listing:
    """A cached directory level: name -> ObjectInfo for files, None for directories."""

    entries: dict[str, ObjectInfo | None]
    expires_at: float


@dataclass
class FileHandleState:
    node: Node
    ref: ObjectRef | None  # the store version read through this handle (None: staged data)
    readahead: ReadAhead
    writable: bool = False
    local_gen: int = 0  # node.local_gen when ref was taken


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
    writes: int = 0
    write_bytes: int = 0
    creates: int = 0
    unlinks: int = 0
    mkdirs: int = 0
    rmdirs: int = 0
    renames: int = 0
    truncates: int = 0
    fsyncs: int = 0


def _patch_entries(entries: dict[str, ObjectInfo | None], name: str, info: ObjectInfo | None, marker: bool) -> None:
    """Apply one store change to a listing: a file put or delete, or a directory marker put."""
    if marker:
        if info is not None:
            entries[name] = None
    elif info is None:
        if entries.get(name) is not None:
            del entries[name]
    elif entries.get(name, MISSING) is not None:
        entries[name] = info


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
        self.writeback: WriteBack | None = None  # set by attach_writeback on a writable mount
        self._applied_log: deque[tuple[str, str, ObjectInfo | None, bool]] = deque()
        self._applied_total = 0

    # ------------------------------------------------------------------ attributes
    def _attributes(self, node: Node) -> Attributes:
        s = self.settings
        sf = node.staged
        if node.is_dir:
            mode, size, mtime = stat.S_IFDIR | s.dir_mode, 0, node.mtime
        elif sf is not None and not sf.disposed:
            mode, size, mtime = stat.S_IFREG | s.file_mode, sf.size, sf.mtime
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
            if info.etag == STAGED_ETAG and self.writeback is not None:
                # A staged file: its attributes come from staging; node.info stays the store's.
                self._staged(node)
                if node.info is None:
                    node.info = info
            else:
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
        mark = self._applied_total
        try:
            raw = await self.store.list_dir(path + "/" if path else "")
        except ObjectStoreUnavailableError as exc:
            self.stats.listing_errors += 1
            if stale is not None:
                self.stats.stale_listings_served += 1
                log.warning("serving cached listing of /%s: %s", path, exc)
                return stale
            if self.writeback is not None and self.writeback.created_dir(path):
                # Made through this mount and not yet in the store: the store has nothing below it.
                return Listing({}, self.clock.monotonic() + self.settings.dir_ttl_s)
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
        if self._replay_applied(path, listing, mark):
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
        if node.is_dir or node.inode == ROOT_INODE or node.deleted or self._staged(node) is not None:
            return
        parent, _, name = node.path.rpartition("/")
        info = await self._lookup_entry(parent, name)
        if not isinstance(info, ObjectInfo) or info.etag == STAGED_ETAG:
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
            value = await self._lookup_entry(parent.path, text)
            if value is MISSING:
                raise FsError(errno.ENOENT)
            node = self._node_for(join(parent.path, text), value)  # type: ignore[arg-type]
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
        writable = (flags & os.O_ACCMODE) in (os.O_WRONLY, os.O_RDWR)
        if writable or flags & os.O_TRUNC:
            self._writer()
        if self._staged(node) is None:
            await self._refresh(node)
        if flags & os.O_TRUNC:
            await self._truncate_node(node, 0)  # nothing to copy in: the new content starts empty
        return self._open_handle(node, writable=writable)

    async def read(self, fh: int, offset: int, size: int) -> bytes | memoryview:
        handle = self._handles.get(fh)
        if not isinstance(handle, FileHandleState):
            raise FsError(errno.EBADF)
        if offset < 0 or size < 0:
            raise FsError(errno.EINVAL)
        node = handle.node
        window = handle.readahead.on_read(offset, size)
        sf = self._staged(node) if self.writeback is not None else None
        if sf is not None:
            data = await self.writeback.read(sf, offset, size)  # type: ignore[union-attr]
        else:
            ref = handle.ref
            if ref is None or handle.local_gen != node.local_gen:
                # Changed through the mount since this handle took its version: follow the change.
                if node.info is not None and node.info.etag == STAGED_ETAG:
                    await self._refresh(node)
                ref = handle.ref = self._ref(node)
                handle.local_gen = node.local_gen
            data = await self.cache.read(ref, offset, size, readahead_bytes=window)
        self.stats.reads += 1
        self.stats.read_bytes += len(data)
        return data

    def release(self, fh: int) -> None:
        handle = self._handles.pop(fh, None)
        if handle is None:
            return
        node = handle.node
        node.open_handles -= 1
        if isinstance(handle, FileHandleState):
            if handle.writable:
                node.writers -= 1
            if node.staged is not None and self.writeback is not None:
                # The last handle going commits what close() did not (mmap writeback after close).
                self.writeback.unhold(node.staged)
        self._maybe_drop(node)

    async def opendir(self, inode: int) -> FileHandle:
        node = self._node(inode)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        listing = await self._listing(node.path)
        # A snapshot per handle: offsets stay meaningful while the listing is refreshed.
        entries = sorted(self._merged(node.path, listing).items())
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
        """Modifying operations cachefs never supports on any mount (links, symlinks, xattrs) go
        through here on a read-only mount, so they answer EROFS there as everything else does."""
        raise FsError(errno.EROFS)

    def unsupported(self, what: str) -> None:
        """Hard links, symlinks and extended attributes: no object-store equivalent."""
        if self.settings.read_only or self.writeback is None:
            raise FsError(errno.EROFS)
        raise FsError(errno.EPERM if what in ("link", "symlink") else errno.ENOTSUP, f"{what} is not supported")

    # ------------------------------------------------------------------ write-back: wiring and views
    def attach_writeback(self, writeback: WriteBack) -> None:
        """Make the mount writable through ``writeback`` (the daemon's write-back feature calls this)."""
        self.writeback = writeback
        writeback.on_applied = self._on_applied

    def _writer(self) -> WriteBack:
        """The write-back engine, or EROFS: a read-only mount (or one without staging) changes nothing."""
        if self.settings.read_only or self.writeback is None:
            raise FsError(errno.EROFS)
        return self.writeback

    def _resolve(self, path: str, name: str, listing: Listing) -> object:
        """``name`` in directory ``path`` with pending changes applied: info, None (a directory), MISSING."""
        stored = listing.entries.get(name, MISSING)
        if self.writeback is None:
            return stored
        return self.writeback.resolve(path, name, stored)

    async def _lookup_entry(self, path: str, name: str) -> object:
        """``_resolve`` against directory ``path``'s listing (fetched or from the listing cache)."""
        return self._resolve(path, name, await self._listing(path))

    def _merged(self, path: str, listing: Listing) -> dict[str, ObjectInfo | None]:
        if self.writeback is None:
            return listing.entries
        return self.writeback.merge(path, listing.entries)

    async def _resolve_path(self, path: str) -> object:
        """What ``path`` (relative to the root) is in the merged view: info, None (a directory), MISSING."""
        if path == "":
            return None
        parent, _, name = path.rpartition("/")
        if await self._resolve_path(parent) is not None:
            return MISSING
        return await self._lookup_entry(parent, name)

    def _staged(self, node: Node) -> StagedFile | None:
        """The staged file behind a file node, if any (attached lazily: the kernel may have looked the
        name up before it was written, or after an earlier node for it was forgotten)."""
        sf = node.staged
        if sf is not None and sf.disposed:
            self._set_staged(node, None)
            sf = None
        if sf is None and self.writeback is not None and not node.is_dir and not node.deleted:
            sf = self.writeback.file(node.path)
            if sf is not None:
                self._set_staged(node, sf)
        return sf

    def _set_staged(self, node: Node, sf: StagedFile | None) -> None:
        """Attach a staged file to a node; the node's open handles hold it (it is kept while they are open)."""
        old = node.staged
        if old is sf:
            return
        wb = self.writeback
        if old is not None and wb is not None and node.open_handles:
            wb.unhold(old, node.open_handles)
        node.staged = sf
        if sf is not None and wb is not None and node.open_handles:
            wb.hold(sf, node.open_handles)
        node.local_gen += 1

    def _ref(self, node: Node) -> ObjectRef:
        info = node.info
        if info is None:
            raise FsError(errno.ENOENT)
        return ObjectRef(info.key, info.etag, info.size)

    def _on_applied(self, key: str, info: ObjectInfo | None) -> None:
        """A pending change reached the store: bring the cached store listing and the node up to date
        (the overlay stops covering it now). Listings being fetched right now are patched when they
        land (``_replay_applied``)."""
        marker = key.endswith("/")
        path = key[:-1] if marker else key
        parent, _, name = path.rpartition("/")
        self._applied_log.append((parent, name, info, marker))
        self._applied_total += 1
        if len(self._applied_log) > MAX_APPLIED_LOG:
            self._applied_log.popleft()
        listing = self._listings.get(parent)
        if listing is not None:
            if marker and info is None:
                self._forget_listing(parent)  # other keys may still imply the directory: list again
            else:
                before = len(listing.entries)
                _patch_entries(listing.entries, name, info, marker)
                self._listing_entries += len(listing.entries) - before
        node = self._by_path.get(path)
        if not marker and node is not None and not node.is_dir and info is not None:
            node.info = info
            node.local_gen += 1

    def _replay_applied(self, path: str, listing: Listing, mark: int) -> bool:
        """Apply to a listing fetched since ``mark`` the changes that reached the store meanwhile.

        False when it cannot be made exact (too many changes, or a removed directory marker): then
        the listing is answered to its waiters but not cached.
        """
        first = self._applied_total - len(self._applied_log)
        if mark < first:
            return False
        for parent, name, info, marker in itertools.islice(self._applied_log, mark - first, None):
            if parent != path:
                continue
            if marker and info is None:
                return False
            _patch_entries(listing.entries, name, info, marker)
        return True

    def _forget_listing(self, path: str) -> None:
        old = self._listings.pop(path, None)
        if old is not None:
            self._listing_entries -= len(old.entries)

    def _forget_listings_under(self, path: str) -> None:
        prefix = path + "/"
        for cached in [p for p in self._listings if p == path or p.startswith(prefix)]:
            self._forget_listing(cached)

    def _text(self, name: bytes) -> str:
        """A new name as text: valid UTF-8 (object keys are), and a valid POSIX name."""
        try:
            text = name.decode("utf-8")
        except UnicodeDecodeError:
            raise FsError(errno.EINVAL, "file names must be valid UTF-8 to become object keys") from None
        reason = invalid_name_reason(text)
        if reason:
            raise FsError(errno.ENAMETOOLONG if "longer" in reason else errno.EINVAL, reason)
        return text

    def _dir(self, inode: int) -> Node:
        node = self._node(inode)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        return node

    def _open_handle(self, node: Node, *, writable: bool) -> tuple[FileHandle, bool]:
        """A new handle; the kernel may keep its cached pages only of an unchanged store version."""
        sf = self._staged(node)
        ref: ObjectRef | None = None
        if sf is not None:
            keep_cache = False
            node.page_cache_etag = None  # the kernel's pages are of no store version: never kept
        else:
            ref = self._ref(node)
            keep_cache = node.page_cache_etag == ref.etag
            node.page_cache_etag = ref.etag
        self.stats.opens += 1
        fh = self._new_handle(FileHandleState(
            node, ref, ReadAhead(self.cache.block_size, self.cache.readahead_limit),
            writable=writable, local_gen=node.local_gen,
        ))
        node.open_handles += 1
        if writable:
            node.writers += 1
        if sf is not None and self.writeback is not None:
            self.writeback.hold(sf)
        return fh, keep_cache

    async def _stage_for_write(self, node: Node) -> StagedFile:
        """The node's staged file, staging the store version (copied in on the first change) if needed."""
        wb = self._writer()
        sf = self._staged(node)
        if sf is not None:
            return sf
        if node.deleted:
            raise FsError(errno.ESTALE, f"/{node.path} was removed")
        if node.info is not None and node.info.etag == STAGED_ETAG:
            await self._refresh(node)
        sf = wb.stage(node.path, self._ref(node))
        self._set_staged(node, sf)
        return sf

    async def _truncate_node(self, node: Node, size: int) -> StagedFile:
        wb = self._writer()
        sf = self._staged(node)
        if sf is None and size == 0 and not node.deleted:
            sf = await wb.create(node.path, may_exist=True)  # nothing to copy in
            self._set_staged(node, sf)
            return sf
        sf = await self._stage_for_write(node)
        with wb.held(sf):
            await wb.truncate(sf, size)
        return sf

    # ------------------------------------------------------------------ write operations
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int) -> tuple[FileHandle, bool, Attributes]:
        """creat/open(O_CREAT): a new empty file (staged), or the existing one opened with ``flags``."""
        wb = self._writer()
        parent = self._dir(parent_inode)
        text = self._text(name)
        path = join(parent.path, text)
        value = await self._lookup_entry(parent.path, text)
        if value is None:
            raise FsError(errno.EISDIR)
        if value is not MISSING:
            if flags & os.O_EXCL:
                raise FsError(errno.EEXIST)
            node = self._node_for(path, value)  # type: ignore[arg-type]
            node.lookups += 1
            fh, keep = await self.open(node.inode, flags)
            return fh, keep, self._attributes(node)
        sf = await wb.create(path, may_exist=False)
        node = self._node_for(path, wb.staged_info(sf))
        self._set_staged(node, sf)
        node.lookups += 1
        self.stats.creates += 1
        fh, keep = self._open_handle(node, writable=True)
        return fh, keep, self._attributes(node)

    async def write(self, fh: int, offset: int, data: bytes) -> int:
        wb = self._writer()
        handle = self._handles.get(fh)
        if not isinstance(handle, FileHandleState) or not handle.writable:
            raise FsError(errno.EBADF)
        if offset < 0:
            raise FsError(errno.EINVAL)
        sf = await self._stage_for_write(handle.node)
        written = await wb.write(sf, offset, data)
        self.stats.writes += 1
        self.stats.write_bytes += written
        return written

    async def flush(self, fh: int) -> None:
        """close(2) of a descriptor: a file written through it is made durable (and, with
        write-through, uploaded) before close returns."""
        handle = self._handles.get(fh)
        if not isinstance(handle, FileHandleState):
            raise FsError(errno.EBADF)
        if handle.writable and self.writeback is not None:
            sf = self._staged(handle.node)
            if sf is not None:
                await self.writeback.commit(sf)

    async def fsync(self, fh: int, datasync: bool) -> None:
        handle = self._handles.get(fh)
        if not isinstance(handle, FileHandleState):
            raise FsError(errno.EBADF)
        self.stats.fsyncs += 1
        if self.writeback is not None:
            sf = self._staged(handle.node)
            if sf is not None:
                await self.writeback.commit(sf)

    async def setattr(
        self,
        inode: int,
        *,
        size: int | None = None,
        mtime: float | None = None,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        fh: int | None = None,
    ) -> Attributes:
        """truncate/ftruncate, utimens (shown on staged files; the store sets its own LastModified),
        and chmod/chown only to what is already shown (anything else: EPERM)."""
        node = self._node(inode)
        self._writer()
        current = self._attributes(node)
        if (mode is not None and stat.S_IMODE(mode) != stat.S_IMODE(current.mode)) or (
            uid is not None and uid != current.uid) or (gid is not None and gid != current.gid):
            raise FsError(errno.EPERM, "cachefs shows fixed owners and modes")
        if size is not None:
            if node.is_dir:
                raise FsError(errno.EISDIR)
            if size < 0:
                raise FsError(errno.EINVAL)
            sf = await self._truncate_node(node, size)
            self.stats.truncates += 1
            if fh is None and node.writers == 0 and self.writeback is not None:
                await self.writeback.commit(sf)  # truncate(2) by path: nothing else will acknowledge it
        if mtime is not None and not node.is_dir:
            sf = self._staged(node)
            if sf is not None and self.writeback is not None:
                self.writeback.set_mtime(sf, mtime)
        return self._attributes(node)

    async def mknod(self, parent_inode: int, name: bytes, mode: int) -> Attributes:
        if not stat.S_ISREG(mode):
            self._writer()
            raise FsError(errno.EPERM, "only regular files and directories can be objects")
        fh, _, attrs = await self.create(parent_inode, name, mode, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        await self.flush(fh)
        self.release(fh)
        return attrs

    async def mkdir(self, parent_inode: int, name: bytes, mode: int) -> Attributes:
        wb = self._writer()
        parent = self._dir(parent_inode)
        text = self._text(name)
        if await self._lookup_entry(parent.path, text) is not MISSING:
            raise FsError(errno.EEXIST)
        path = join(parent.path, text)
        await wb.mkdir(path)
        self.stats.mkdirs += 1
        node = self._node_for(path, None)
        node.lookups += 1
        return self._attributes(node)

    async def unlink(self, parent_inode: int, name: bytes) -> None:
        wb = self._writer()
        parent = self._dir(parent_inode)
        text = self._text(name)
        value = await self._lookup_entry(parent.path, text)
        if value is MISSING:
            raise FsError(errno.ENOENT)
        if value is None:
            raise FsError(errno.EISDIR)
        path = join(parent.path, text)
        node = self._by_path.get(path)
        if node is not None and node.writers and self._staged(node) is None:
            await self._stage_for_write(node)  # an open writer keeps writing to it (not copied in yet)
        staged = value.etag == STAGED_ETAG  # type: ignore[union-attr]
        await wb.ensure_dir(parent.path)  # the directory stays, even once its last entry goes
        await wb.remove(path, may_exist=not staged)
        self.stats.unlinks += 1
        if node is not None:
            self._unlink_node(node)

    def _unlink_node(self, node: Node) -> None:
        """The name is gone; the node lives on for the kernel's references and open handles."""
        node.deleted = True
        if self._by_path.get(node.path) is node:
            del self._by_path[node.path]

    async def rmdir(self, parent_inode: int, name: bytes) -> None:
        wb = self._writer()
        parent = self._dir(parent_inode)
        text = self._text(name)
        value = await self._lookup_entry(parent.path, text)
        if value is MISSING:
            raise FsError(errno.ENOENT)
        if value is not None:
            raise FsError(errno.ENOTDIR)
        path = join(parent.path, text)
        if self._merged(path, await self._listing(path)):
            raise FsError(errno.ENOTEMPTY)
        await wb.ensure_dir(parent.path)
        await wb.rmdir(path)
        self.stats.rmdirs += 1
        self._forget_listings_under(path)
        node = self._by_path.get(path)
        if node is not None:
            self._unlink_node(node)

    async def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes, flags: int) -> None:
        """rename(2). Not atomic on an object store (see the module docstring and the README)."""
        wb = self._writer()
        if flags & RENAME_EXCHANGE:
            raise FsError(errno.EINVAL, "RENAME_EXCHANGE is not supported")
        src_dir, dst_dir = self._dir(old_parent), self._dir(new_parent)
        src_name, dst_name = self._text(old_name), self._text(new_name)
        src = join(src_dir.path, src_name)
        dst = join(dst_dir.path, dst_name)
        src_value = await self._lookup_entry(src_dir.path, src_name)
        if src_value is MISSING:
            raise FsError(errno.ENOENT)
        dst_value = await self._lookup_entry(dst_dir.path, dst_name)
        if dst_value is not MISSING and flags & RENAME_NOREPLACE:
            raise FsError(errno.EEXIST)
        if src == dst:
            return
        if src_value is None:
            if dst_value is not None and dst_value is not MISSING:
                raise FsError(errno.ENOTDIR)
            if dst.startswith(src + "/"):
                raise FsError(errno.EINVAL, "cannot move a directory into itself")
            if dst_value is None and self._merged(dst, await self._listing(dst)):
                raise FsError(errno.ENOTEMPTY)
            await self._rename_dir(src, dst)
        else:
            if dst_value is None:
                raise FsError(errno.EISDIR)
            if src_dir.path != dst_dir.path:
                await wb.ensure_dir(src_dir.path)  # it loses an entry, and lives on until rmdir
            await self._rename_file(src, dst, src_value, dst_value)  # type: ignore[arg-type]
            self._move_node(src, dst)
        self.stats.renames += 1

    async def _rename_file(self, src: str, dst: str, info: ObjectInfo, dst_value: object) -> None:
        wb = self._writer()
        dst_may_exist = dst_value is not MISSING and getattr(dst_value, "etag", STAGED_ETAG) != STAGED_ETAG
        sf = wb.file(src)
        if sf is not None and sf.materialized:
            await wb.move(src, dst, dst_may_exist=dst_may_exist)
            return
        if info.etag == STAGED_ETAG:
            # Its upload landed (and the staged copy went) since the caller looked: take the store's.
            value = await self._resolve_path(src)
            sf = wb.file(src)
            if sf is not None and sf.materialized:
                await wb.move(src, dst, dst_may_exist=dst_may_exist)
                return
            if not isinstance(value, ObjectInfo) or value.etag == STAGED_ETAG:
                raise FsError(errno.ENOENT, f"/{src} changed while it was renamed")
            info = value
        # Only in the store: a server-side copy, then the source is deleted (journaled). The
        # destination's own pending upload must not land after the copy: it is held off meanwhile.
        async with wb.quiesce(dst):
            copied = await self.store.copy(src, info.etag, dst)
            await wb.forget(dst)
        await wb.remove(src, may_exist=True)
        self._on_applied(dst, copied)
        node = self._by_path.get(src)
        if node is not None:
            node.info = copied  # its key is rewritten to dst when the node moves

    def _move_node(self, src: str, dst: str) -> None:
        """The inode keeps its number under its new name (and so do the nodes below a directory)."""
        replaced = self._by_path.get(dst)
        if replaced is not None:
            self._unlink_node(replaced)
        node = self._by_path.get(src)
        if node is not None and not node.is_dir:
            moving = [node]
        else:
            prefix = src + "/"
            moving = [n for p, n in self._by_path.items() if p == src or p.startswith(prefix)]
        for node in moving:
            del self._by_path[node.path]
        for node in moving:
            node.path = dst + node.path[len(src):]
            self._by_path[node.path] = node
            if node.info is not None and not node.is_dir:
                node.info = ObjectInfo(node.path, node.info.size, node.info.etag, node.info.mtime)
            node.local_gen += 1

    async def _rename_dir(self, src: str, dst: str) -> None:
        """Every entry below ``src`` (merged view) is renamed; refused beyond ``rename_dir_limit``."""
        wb = self._writer()
        files: list[tuple[str, ObjectInfo]] = []
        dirs: list[str] = [""]
        limit = self.settings.rename_dir_limit
        pending = [""]
        while pending:
            rel = pending.pop()
            here = join(src, rel) if rel else src
            for name, value in sorted(self._merged(here, await self._listing(here)).items()):
                child = f"{rel}/{name}" if rel else name
                if value is None:
                    dirs.append(child)
                    pending.append(child)
                else:
                    files.append((child, value))
                if len(files) + len(dirs) - 1 > limit:
                    log.warning("rename of directory /%s refused: it has more than %d entries (--rename-dir-limit)",
                                src, limit)
                    raise FsError(errno.E2BIG, f"/{src} has more than {limit} entries to rename")
        src_parent = src.rpartition("/")[0]
        await wb.ensure_dir(src_parent)
        for rel in dirs:
            await wb.mkdir(join(dst, rel) if rel else dst)
        slots = asyncio.Semaphore(RENAME_CONCURRENCY)

        async def move_one(rel: str, info: ObjectInfo) -> None:
            async with slots:
                await self._rename_file(f"{src}/{rel}", f"{dst}/{rel}", info, MISSING)

        await asyncio.gather(*(move_one(rel, info) for rel, info in files))
        for rel in sorted(dirs, key=lambda d: -d.count("/") - (d != "")):
            await wb.rmdir(join(src, rel) if rel else src)
        self._forget_listings_under(src)
        self._forget_listings_under(dst)
        self._move_node(src, dst)

    # ------------------------------------------------------------------ durability status
    async def path_status(self, path: str) -> dict[str, Any]:
        """``cachefs status``: the durability stage of one path (a directory: of what is pending below it)."""
        path = path.strip("/")
        value = await self._resolve_path(path)
        out: dict[str, Any] = {"path": path}
        wb = self.writeback
        if value is MISSING:
            pending = wb.status(path) if wb is not None else None
            out.update(pending or {"stage": "missing"})
            out["path"] = path
            return out
        if value is None:
            below = wb.pending(path + "/" if path else "") if wb is not None else []
            own = wb.status(path + "/") if wb is not None and path else None
            out.update({"kind": "directory", "stage": "dirty" if below or own else "clean",
                        "pending": below + ([own] if own else [])})
            return out
        status = wb.status(path) if wb is not None else None
        if status is None:
            info = value
            out.update({"kind": "file", "stage": "clean", "size": info.size, "etag": info.etag})  # type: ignore[union-attr]
        else:
            out.update(status)
            out["path"] = path
        return out


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
                "put_requests": store.put_requests,
                "delete_requests": store.delete_requests,
                "copy_requests": store.copy_requests,
                "bytes_written": store.bytes_written,
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
                "writes": self.stats.writes,
                "write_bytes": self.stats.write_bytes,
                "creates": self.stats.creates,
                "unlinks": self.stats.unlinks,
                "mkdirs": self.stats.mkdirs,
                "rmdirs": self.stats.rmdirs,
                "renames": self.stats.renames,
                "truncates": self.stats.truncates,
                "fsyncs": self.stats.fsyncs,
            },
            # Staged writes and their uploads (tiering.writeback); absent on a read-only mount.
            **({"writeback": self.writeback.stats_snapshot()} if self.writeback is not None else {}),
        }
