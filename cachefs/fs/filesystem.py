"""POSIX semantics over the object store and the block cache, with no FUSE in sight.

``CacheFS`` is what the FUSE adapter (``cachefs.fuse.adapter``) calls, one method per FUSE operation; it is tested without a
mount. It is a facade over the state objects it holds, each with its own module:

* **Inodes** (``cachefs.fs.inodes``): every path the kernel has been told about has one ``Node`` with
  a stable inode number and a lookup count, dropped once the kernel forgets it.
* **Listings** (``cachefs.fs.listings``): directory levels listed lazily and cached for
  ``dir_ttl_s``, lookups and negative lookups answered from them, pending write-back changes
  overlaid.
* **Handles** (``cachefs.fs.handles``): an open file pins one version of its object (key, ETag,
  size): reads through that handle never mix bytes of two versions.
* **Rename** (``cachefs.fs.rename``): copies and journaled deletes, not atomic.
* **Kept files** (``cachefs.fs.keep``): the content of a file losing its name (unlink, rename over
  it) kept for the handles that still use it; opens racing with it wait for it.
* **Retried opens** (``cachefs.fs.retries``): the threads whose open was answered ESTALE, and the
  file each one's retry looked up, kept for that open as for an open handle.
* **Name changes** (``cachefs.fs.names``): create, mkdir, unlink, rmdir and rename, each new name
  checked, made through write-back.

The kernel's page cache is used across opens (``keep_cache``) as long as the object's ETag is the
one seen at the previous open; when it changed, the open answers without ``keep_cache`` and the
kernel drops its cached pages of the file.

Writes (write-back, see ``tiering.writeback``). A writable mount stages every change durably on
local disk and uploads it later; this class keeps the POSIX view consistent meanwhile. Lookups and
listings overlay the pending changes on the store's listings, a file with staged data is read from
staging, and its attributes are its staged size and mtime. A file with staged data is never opened
with ``keep_cache``, and its ETag changes when its upload lands, so the kernel never keeps pages of
an older version; an open handle follows the changes made through the mount (it pins a version only
against changes made elsewhere). When an upload lands, the listing cache patches its view, so no
view goes back to the old version.

Directories are marker objects (``dir/``): ``mkdir`` writes one, ``rmdir`` deletes it (after the
deletes below it), and a directory that loses an entry through the mount gets one too, because a
directory lives until rmdir even where the store would drop an empty prefix. Keys below a directory
still imply it, as on the read path.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from dataclasses import dataclass
from typing import Iterator

from cachefs.fs.allocate import FALLOC_FL_KEEP_SIZE, check_fallocate, fallocate
from cachefs.fs.diskread import DiskRead, read_from_disk
from cachefs.fs.errors import FsError
from cachefs.fs.handles import DirHandleState, FileHandle, FileHandleState, HandleTable
from cachefs.fs.inodes import ROOT_INODE, InodeNo, InodeTable, Node
from cachefs.fs.keep import LOSING_NAME_WAIT_S, KeptFiles
from cachefs.fs.kernelcache import KernelCache
from cachefs.fs.listings import UNKNOWN, ListingCache
from cachefs.fs.metaindex import MetadataIndex
from cachefs.fs.passthrough import WholeFiles, WholeFileStore
from cachefs.fs.names import NameChanges
from cachefs.fs.rename import Renamer
from cachefs.fs.retries import RetriedOpens
from cachefs.fs.stats import FsStats
from cachefs.fs.times import set_mtime
from cachefs.mounts import CONTROL_XATTR
from cachefs.names import NAME_MAX, encode_name
from cachefs.paths import join
from cachefs.settings import FsSettings
from tiering.blocks import ObjectRef
from tiering.clock import Clock, SystemClock
from tiering.engine.blockcache import BlockCache
from tiering.errors import ObjectStoreUnavailableError
from tiering.protocols import ObjectInfo, ObjectStore
from tiering.policy.readorder import ReadOrder
from tiering.writeback import MISSING, STAGED_ETAG, WriteBack
from tiering.writeback.staged import StagedFile

# Blocks reported to statfs are in units of this size (the usual 4 KiB page).
STATFS_BLOCK_SIZE = 4096

# How long the retry of an open answered ESTALE (``cachefs.fs.retries``) may take between its lookup and
# its OPEN, for the file that lookup answered to be kept for it. Both are steps of one open(2) in one
# thread, microseconds apart; the bound covers a thread descheduled on a loaded machine many times over.
# The kernel forgetting the inode ends the wait sooner, so what is kept rarely lives this long.
RETRY_OPEN_WINDOW_S = 30.0

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT


def _nlink(node: Node) -> int:
    """A file has one link (no hard links), none once unlinked (an open handle keeps it, as fstat
    shows on a local filesystem). A directory shows 1, the convention for "not counted" that find and
    fts understand (btrfs does the same): counting its subdirectories (2 + n) would take a LIST per
    stat, and a wrong count makes find's leaf optimisation skip subdirectories."""
    if node.is_dir:
        return 1
    return 0 if node.deleted else 1


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
    name_max: int = NAME_MAX


def node_attributes(node: Node, s: FsSettings, file_mode: int, dir_mode: int) -> Attributes:
    """What the kernel is told about ``node``: a staged file's size and mtime, else the store's."""
    sf = node.staged
    if node.is_dir:
        mode, size, mtime = stat.S_IFDIR | dir_mode, 0, node.mtime
    elif sf is not None and not sf.disposed:
        mode, size, mtime = stat.S_IFREG | file_mode, sf.size, sf.mtime
    else:
        assert node.info is not None
        mode, size, mtime = stat.S_IFREG | file_mode, node.info.size, node.info.mtime
    return Attributes(inode=node.inode, mode=mode, size=size, mtime_ns=int(mtime * 1e9), uid=s.uid, gid=s.gid,
                      nlink=_nlink(node), attr_timeout=s.attr_ttl_s, entry_timeout=s.dir_ttl_s)


class CacheFS:
    def __init__(
        self,
        store: ObjectStore,
        cache: BlockCache,
        settings: FsSettings,
        *,
        clock: Clock | None = None,
        control_path: str | None = None,
        read_order: ReadOrder | None = None,
        index: MetadataIndex | None = None,
        pinned: bool = False,
        whole_files: WholeFileStore | None = None,
    ) -> None:
        self.store = store
        self.cache = cache
        self.settings = settings
        # FsSettings resolves None (the default for the mount's access) when it is built.
        assert settings.file_mode is not None and settings.dir_mode is not None
        self.file_mode: int = settings.file_mode
        self.dir_mode: int = settings.dir_mode
        self.clock = clock or SystemClock()
        self.control_path = control_path
        self.read_order = read_order  # announced read orders: every open of a store version is reported
        self.stats = FsStats()
        # Directories have no mtime in an object store; they show the time of the mount.
        self.inodes = InodeTable(mount_time=time.time())
        # ``index``: listings on disk (cachefs.fs.metaindex); ``pinned``: that index is a manifest's,
        # the whole namespace, never listed again (cachefs.fs.pinned).
        self.listings = ListingCache(store, self.clock, settings, self.inodes, self.stats, health=cache.health,
                                     index=index, pinned=pinned)
        self.handles = HandleTable()
        self.retries = RetriedOpens(self.clock, RETRY_OPEN_WINDOW_S, self._hold_for_awaited)
        self.kept = KeptFiles(self.inodes, self.retries, self._staged, self._stage_for_write)
        self.renamer = Renamer(store, self.listings, self.inodes, settings.rename_dir_limit, self.kept.keep)
        self.names = NameChanges(self)
        self.writeback: WriteBack | None = None  # set by attach_writeback on a writable mount
        # Whole files on the disk tier, for the kernel to read opens of them itself (passthrough).
        self.whole = (WholeFiles(whole_files, cache.block_size, cache.cached_blocks)
                      if whole_files is not None else None)

    # ------------------------------------------------------------------ attributes
    def _attributes(self, node: Node) -> Attributes:
        return node_attributes(node, self.settings, self.file_mode, self.dir_mode)

    def _node_for(self, path: str, info: ObjectInfo | None) -> Node:
        """The node for ``path``, created or updated from the latest listing entry."""
        node = self.inodes.node_for(path, is_dir=info is None)
        if info is not None:
            if info.etag == STAGED_ETAG and self.writeback is not None:
                # A staged file: its attributes come from staging; node.info stays the store's.
                self._staged(node)
                if node.info is None:
                    node.info = info
            else:
                node.info = info
        return node

    def _refresh_now(self, node: Node) -> bool:
        """``_refresh`` where it needs no waiting; False where the directory must be listed (then
        call ``_refresh``). The answer of a listing is remembered on the node for as long as that
        listing holds (``Node.fresh_until``): a warm file's open costs no lookup at all."""
        if node.is_dir or node.inode == ROOT_INODE or node.deleted or self._staged(node) is not None:
            return True
        return self._store_info_now(node)

    def _store_info_now(self, node: Node) -> bool:
        """``_refresh_now`` of a file node known to have no staged data."""
        listings = self.listings
        if node.fresh_gen == listings.generation and node.fresh_until > self.clock.monotonic():
            return True
        parent, _, name = node.path.rpartition("/")
        info, until = listings.lookup_now(parent, name)
        if info is UNKNOWN:
            return False
        if isinstance(info, ObjectInfo) and info.etag != STAGED_ETAG:
            node.info = info
            node.fresh_until, node.fresh_gen = until, listings.generation
        return True

    async def _refresh(self, node: Node) -> None:
        """Bring a file node's ObjectInfo up to date if its attributes expired."""
        if self._refresh_now(node):
            return
        parent, _, name = node.path.rpartition("/")
        try:
            info = await self.listings.lookup(parent, name)
        except ObjectStoreUnavailableError:
            # The store is unreachable and the parent's listing is not cached any more: the
            # attributes the node has are the freshest there are (stale, counted).
            if node.info is None:
                raise
            self.stats.stale_attributes_served += 1
            return
        if not isinstance(info, ObjectInfo) or info.etag == STAGED_ETAG:
            # Gone from the store (or became a directory): keep serving what the kernel knows
            # until it looks the name up again; reads of a deleted object fail with ENOENT.
            return
        node.info = info

    # ------------------------------------------------------------------ FUSE operations
    def lookup_now(self, parent_inode: int, name: bytes, caller: int = 0) -> Attributes | None:
        """``lookup`` where the parent's listing is fresh (in RAM or the index) and the lookup is no
        retry's (``cachefs.fs.retries``), or None: then call ``lookup``. Raises as ``lookup`` does."""
        parent = self.inodes.get(parent_inode)
        if not parent.is_dir:
            self.stats.lookups += 1
            raise FsError(errno.ENOTDIR)
        if len(name) > NAME_MAX:
            self.stats.lookups += 1
            raise FsError(errno.ENAMETOOLONG, f"name longer than {NAME_MAX} bytes")
        try:
            text = name.decode("utf-8")
        except UnicodeDecodeError:
            self.stats.lookups += 1
            raise FsError(errno.ENOENT) from None
        if text == "." or text == "..":
            self.stats.lookups += 1
            node = parent if text == "." else self.inodes.at(parent.path.rpartition("/")[0]) or self.inodes.root
            node.lookups += 1
            return self._attributes(node)
        if len(self.retries) and self.retries.retrying(caller, join(parent.path, text)):
            return None
        value, until = self.listings.lookup_now(parent.path, text)
        if value is UNKNOWN:
            return None
        self.stats.lookups += 1
        if value is MISSING:
            raise FsError(errno.ENOENT)
        node = self._node_for(join(parent.path, text), value)  # type: ignore[arg-type]
        node.lookups += 1
        if isinstance(value, ObjectInfo) and value.etag != STAGED_ETAG:  # the OPEN that follows looks up nothing
            node.fresh_until, node.fresh_gen = until, self.listings.generation
        return self._attributes(node)

    async def lookup(self, parent_inode: int, name: bytes, caller: int = 0) -> Attributes:
        """``caller``: the thread that asks (the FUSE header's pid), 0 if unknown. The lookup of a
        thread retrying an open answered ESTALE answers once an unlink or a rename of the name under way
        is done, and the file it answers is kept for that thread's OPEN (``cachefs.fs.retries``)."""
        attrs = self.lookup_now(parent_inode, name, caller)
        if attrs is not None:
            return attrs
        self.stats.lookups += 1
        parent = self.inodes.get(parent_inode)
        node = await self._resolve(parent, name.decode("utf-8"), caller)  # (checked by lookup_now)
        node.lookups += 1
        return self._attributes(node)

    async def _resolve(self, parent: Node, text: str, caller: int) -> Node:
        """The node ``text`` names in ``parent``. For a retry's lookup (``cachefs.fs.retries``): not while
        an unlink or a rename over it is under way (it may have decided what to keep already), but once
        it is done, and its OPEN is awaited."""
        path = join(parent.path, text)
        retrying = self.retries.retrying(caller, path)
        deadline = self.clock.monotonic() + LOSING_NAME_WAIT_S
        while True:
            value = await self.listings.lookup(parent.path, text)
            if value is MISSING:
                if retrying:
                    self.retries.failed(caller, path)  # a retried open(2) fails here: it is over
                raise FsError(errno.ENOENT)
            node = self._node_for(path, value)  # type: ignore[arg-type]
            if not retrying or not await self.kept.settled(node, deadline - self.clock.monotonic()):
                if retrying and not node.is_dir:
                    self.retries.looked_up(caller, path, node)
                return node

    def forget(self, inode: int, nlookup: int) -> None:
        self.inodes.forget(inode, nlookup)
        if len(self.retries):
            self.retries.forgotten(self.inodes)

    def add_lookup(self, inode: int) -> None:
        """The kernel took a reference through readdirplus."""
        self.inodes.get(inode).lookups += 1

    def getattr_now(self, inode: int) -> Attributes | None:
        """``getattr`` where its listing is fresh, or None: then call ``getattr``."""
        node = self.inodes.get(inode)
        return self._attributes(node) if self._refresh_now(node) else None

    async def getattr(self, inode: int) -> Attributes:
        node = self.inodes.get(inode)
        await self._refresh(node)
        return self._attributes(node)

    def open_now(self, inode: int, flags: int, caller: int = 0) -> tuple[FileHandle, bool] | None:
        """``open`` where nothing needs waiting for, or None (then call ``open``): an unlink or a
        rename of the file under way or done (ESTALE, and its retry, are ``open``'s), a retried open,
        O_TRUNC, or a listing to fetch. Raises as ``open`` does."""
        node = self.inodes.get(inode)
        if node.is_dir:
            raise FsError(errno.EISDIR)
        if flags & _WRITE_FLAGS and self.settings.read_only:
            raise FsError(errno.EROFS)
        if node.losing_name is not None or node.deleted or flags & os.O_TRUNC or len(self.retries):
            return None
        writable = (flags & os.O_ACCMODE) in (os.O_WRONLY, os.O_RDWR)
        if writable:
            self._writer()
        staged = self._staged(node)
        if staged is None and not self._store_info_now(node):
            return None
        return self._open_handle(node, writable=writable, staged=staged)

    async def open(self, inode: int, flags: int, caller: int = 0) -> tuple[FileHandle, bool]:
        """Open a file; returns the handle and whether the kernel may keep its cached pages. ``caller``:
        the thread that opens (the FUSE header's pid), 0 if unknown (see ``cachefs.fs.retries``)."""
        opened = self.open_now(inode, flags, caller)
        if opened is not None:
            return opened
        node = self.inodes.get(inode)
        retry = self.retries.take(caller, node)
        try:
            return await self._open(node, flags, caller, retried=retry is not None)
        finally:
            self.retries.end(retry)  # the handle holds what was kept for it by now

    async def _open(self, node: Node, flags: int, caller: int, *, retried: bool) -> tuple[FileHandle, bool]:
        if node.is_dir:
            raise FsError(errno.EISDIR)
        if flags & _WRITE_FLAGS and self.settings.read_only:
            raise FsError(errno.EROFS)
        writable = (flags & os.O_ACCMODE) in (os.O_WRONLY, os.O_RDWR)
        if writable or flags & os.O_TRUNC:
            self._writer()
        if await self.kept.settled(node):
            # An unlink or a rename over this file was under way: its open handles were counted before
            # it started (their content is kept). This waited for it rather than take the store's
            # version about to go, which a later read would find replaced (ESTALE) or deleted.
            self.stats.opens_waited += 1
        if node.deleted and self._staged(node) is None:
            # Its name went (and with it the stored version) before this open arrived: the kernel
            # resolved the path just before. ESTALE makes it look the name up again (the open is
            # retried once with LOOKUP_REVAL), and it opens what the name holds now; that file is kept
            # for the retry if its name goes too before the retry's OPEN (``cachefs.fs.retries``),
            # unless it is a file over ``KEEP_FOR_READERS_MAX_BYTES`` only in the store.
            if retried:
                self.stats.retried_opens_stale += 1
            else:
                self.stats.stale_opens += 1
            self.retries.stale(caller, node.path)  # (taken for a retry, it may have been a first try all the same)
            raise FsError(errno.ESTALE, f"/{node.path} was replaced or removed while it was opened")
        if retried and node.deleted:
            self.stats.retried_opens_kept += 1  # the version its retry looked up, kept for it
        if self._staged(node) is None:
            await self._refresh(node)
        if flags & os.O_TRUNC:
            await self._truncate_node(node, 0)  # nothing to copy in: the new content starts empty
        return self._open_handle(node, writable=writable)

    async def read(self, fh: int, offset: int, size: int) -> bytes | memoryview:
        handle = self.handles.file(fh)
        if offset < 0 or size < 0:
            raise FsError(errno.EINVAL)
        node = handle.node
        window = handle.readahead_window(offset, size, self.cache.block_size, self.cache.readahead_limit)
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

    def read_from_disk_now(self, fh: int, offset: int, size: int) -> DiskRead | None:
        """``read`` by the calling thread, off the loop, or None (``cachefs.fs.diskread``)."""
        handle = self.handles.file(fh)
        return None if self._staged(handle.node) is not None else read_from_disk(handle, offset, size, self.cache, self.stats)

    async def backing_file(self, fh: int, *, assemble: bool = True) -> str | None:
        """The plain file holding every byte this handle reads, for the kernel to read by itself
        (passthrough, ``cachefs.fs.passthrough``), or None where the daemon serves the reads: no
        disk tier, a writable handle, a file with staged data or a writer, one being removed, or a
        version not whole on the disk tier. ``assemble=False``: the name of that file, whether it
        exists or not (to tell whether an open reads the version another open holds)."""
        handle = self.handles.file(fh)
        node = handle.node
        ref = handle.ref
        if (self.whole is None or handle.writable or ref is None or ref.etag == STAGED_ETAG or node.writers
                or node.deleted or node.losing_name is not None or self._staged(node) is not None):
            return None
        return await self.whole.for_version(ref, assemble=assemble)

    def abandon_open(self, fh: int) -> None:
        """Release a handle whose open the kernel is answered with an error: it never learnt of this
        version, so its cached pages (of whatever version it read before) must not be kept next time."""
        handle = self.handles.file(fh)
        handle.node.page_cache_etag = None
        self.release(fh)

    def release(self, fh: int) -> None:
        handle = self.handles.pop(fh)
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
        self.inodes.drop_if_unused(node)

    async def opendir(self, inode: int) -> FileHandle:
        node = self.inodes.get(inode)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        # A snapshot per handle: offsets stay meaningful while the listing is refreshed.
        entries = sorted((await self.listings.entries(node.path)).items())
        node.open_handles += 1
        return self.handles.add(DirHandleState(node, entries))

    def readdir(self, fh: int, start_id: int) -> Iterator[DirEntry]:
        """Entries from position ``start_id`` on, made one at a time as the caller takes them.

        The caller reports each one it passed on with ``add_lookup`` (readdirplus hands the kernel
        a reference). Lazy because the kernel takes a buffer's worth per call and comes back with
        the next offset: building every remaining entry on each call would cost O(n^2) for a large
        directory and leave an inode the kernel never heard of (so never forgets) for each of them.
        The handle is checked now, not on first iteration."""
        handle = self.handles.directory(fh)
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
        return StatFs(block_size=STATFS_BLOCK_SIZE, blocks=capacity // STATFS_BLOCK_SIZE,
                      blocks_free=max(0, capacity - used) // STATFS_BLOCK_SIZE, files=len(self.inodes), files_free=0)

    def getxattr(self, inode: int, name: bytes) -> bytes:
        node = self.inodes.get(inode)
        if node.inode == ROOT_INODE and name == CONTROL_XATTR.encode() and self.control_path:
            return self.control_path.encode()
        raise FsError(errno.ENODATA)

    def listxattr(self, inode: int) -> list[bytes]:
        node = self.inodes.get(inode)
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
    def attach_kernel_cache(self, kernel: KernelCache) -> None:
        """Tell ``kernel`` what re-listing finds changed in the bucket (``cachefs.fs.kernelcache``)."""
        self.listings.kernel = kernel

    def attach_writeback(self, writeback: WriteBack) -> None:
        """Make the mount writable through ``writeback`` (the daemon's write-back feature calls this)."""
        self.writeback = writeback
        self.listings.attach_writeback(writeback)

    def _writer(self) -> WriteBack:
        """The write-back engine, or EROFS: a read-only mount (or one without staging) changes nothing."""
        if self.settings.read_only or self.writeback is None:
            raise FsError(errno.EROFS)
        return self.writeback

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
        holders = node.open_handles + node.awaited_opens
        if old is not None and wb is not None and holders:
            wb.unhold(old, holders)
        node.staged = sf
        if sf is not None and wb is not None and holders:
            wb.hold(sf, holders)
        node.local_gen += 1

    def _hold_for_awaited(self, node: Node, held: bool) -> None:
        """An open of ``node`` is awaited now (``held``), or no longer (``cachefs.fs.retries``): its staged
        file is held for it as for an open handle (``_set_staged``), and what was kept for it goes after."""
        if node.staged is not None and self.writeback is not None:
            (self.writeback.hold if held else self.writeback.unhold)(node.staged)

    def _ref(self, node: Node) -> ObjectRef:
        info = node.info
        if info is None:
            raise FsError(errno.ENOENT)
        ref = node.ref
        if ref is None or ref.etag != info.etag or ref.key != info.key or ref.size != info.size:
            ref = node.ref = ObjectRef(info.key, info.etag, info.size)  # once per version, not per open
        return ref

    def _dir(self, inode: int) -> Node:
        node = self.inodes.get(inode)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        return node

    def _open_handle(self, node: Node, *, writable: bool, staged: StagedFile | None | object = MISSING
                     ) -> tuple[FileHandle, bool]:
        """A new handle; the kernel may keep its cached pages only of an unchanged store version.
        ``staged``: what ``_staged(node)`` just answered, where the caller asked it."""
        sf = self._staged(node) if staged is MISSING else staged
        assert sf is None or isinstance(sf, StagedFile)
        ref: ObjectRef | None = None
        if sf is not None:
            keep_cache = False
            node.page_cache_etag = None  # the kernel's pages are of no store version: never kept
        else:
            ref = self._ref(node)
            keep_cache = node.page_cache_etag == ref.etag
            node.page_cache_etag = ref.etag
            if self.read_order is not None:
                self.read_order.opened(ref, self.cache.is_cached)
        self.stats.opens += 1
        fh = self.handles.add(FileHandleState(node, ref, writable=writable, local_gen=node.local_gen))
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
            base = node.info.etag if node.info is not None and node.info.etag != STAGED_ETAG else None
            sf = await wb.create(node.path, may_exist=True, base_etag=base)  # nothing to copy in
            self._set_staged(node, sf)
            return sf
        sf = await self._stage_for_write(node)
        with wb.held(sf):
            await wb.truncate(sf, size)
        return sf

    # ------------------------------------------------------------------ write operations
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int) -> tuple[FileHandle, bool, Attributes]:
        """creat/open(O_CREAT): a new empty file (staged), or the existing one opened with ``flags``."""
        return await self.names.create(parent_inode, name, mode, flags)

    async def write(self, fh: int, offset: int, data: bytes) -> int:
        wb = self._writer()
        handle = self.handles.file(fh)
        if not handle.writable:
            raise FsError(errno.EBADF)
        if offset < 0:
            raise FsError(errno.EINVAL)
        sf = await self._stage_for_write(handle.node)
        written = await wb.write(sf, offset, data)
        self.stats.writes += 1
        self.stats.write_bytes += written
        return written

    async def fallocate(self, fh: int, mode: int, offset: int, length: int) -> None:
        """fallocate(2) on a writable handle, in the modes a staged copy can honour (``fallocate``)."""
        wb = self._writer()
        handle = self.handles.file(fh)
        if not handle.writable:
            raise FsError(errno.EBADF)
        check_fallocate(mode, offset, length)
        if mode == FALLOC_FL_KEEP_SIZE:
            return  # space is not reserved ahead: nothing to do
        await fallocate(wb, await self._stage_for_write(handle.node), mode, offset, length)
        self.stats.fallocates += 1

    async def flush(self, fh: int) -> None:
        """close(2) of a descriptor: a file written through it is made durable (and, with
        write-through, uploaded) before close returns.

        A read-only mount has nothing to make durable, and answers ENOSYS: the kernel then stops
        sending FLUSH on this connection and answers close() itself, one FUSE request fewer for
        every file a training job opens (``flushes`` stays at 1)."""
        handle = self.handles.file(fh)
        self.stats.flushes += 1
        if self.settings.read_only:
            raise FsError(errno.ENOSYS)
        if handle.writable and self.writeback is not None:
            sf = self._staged(handle.node)
            if sf is not None:
                await self.writeback.commit(sf)

    async def fsync(self, fh: int, datasync: bool) -> None:
        handle = self.handles.file(fh)
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
        node = self.inodes.get(inode)
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
            if mtime is not None:
                sf.mtime, mtime = mtime, None  # acknowledged with the truncation (one journal record)
            if fh is None and node.writers == 0 and self.writeback is not None:
                await self.writeback.commit(sf)  # truncate(2) by path: nothing else will acknowledge it
        if mtime is not None and not node.is_dir:
            await set_mtime(self._writer(), self.listings, node, self._staged(node), mtime)
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
        return await self.names.mkdir(parent_inode, name, mode)

    async def unlink(self, parent_inode: int, name: bytes) -> None:
        await self.names.unlink(parent_inode, name)

    async def rmdir(self, parent_inode: int, name: bytes) -> None:
        await self.names.rmdir(parent_inode, name)

    async def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes, flags: int) -> None:
        """rename(2). Not atomic on an object store (see ``cachefs.fs.rename`` and the README)."""
        await self.names.rename(old_parent, old_name, new_parent, new_name, flags)
