"""The listing cache: what each directory holds, as the store lists it and with pending changes.

Directories are listed lazily, one ``/``-delimited level at a time, and cached for ``dir_ttl_s``.
Lookups and negative lookups are answered from the parent's listing, so walking a directory costs
one paginated LIST, not one request per name. Concurrent refreshes of one directory share one LIST.
Each request of a LIST runs under the metadata deadline (``metadata_timeout_s``, see
``tiering.storehealth``) and through the store-health circuit. If the store cannot be reached, does
not answer in time, or is known to be unreachable (the circuit is open: no request is even sent), an
expired listing is still served (one warning per outage, counted in ``stale_listings_served``):
cached data keeps flowing during an outage; a directory never listed fails with EIO. Keys that are not valid POSIX names are skipped (``cachefs.names``),
and a file whose name is also a directory is hidden (the directory wins).

On a writable mount the pending changes of write-back are overlaid on the store's listing
(``WriteBack.resolve``/``merge``): ``lookup``, ``entries`` and ``resolve_path`` answer the merged
view. When a pending change reaches the store, write-back calls ``applied``: the cached listing of
its directory is patched (the overlay stops covering it now), and so is the node of the file. A
listing being fetched at that moment is patched when it arrives, from a bounded log of applied
changes; one that cannot be made exact is answered to its waiters but not cached.

Behind the hot set in RAM (LRU, bounded by entries) sits the on-disk metadata index
(``cachefs.fs.metaindex``) when the mount has one: every listing fetched is stored there (from a
worker thread), dated by the wall clock. A directory not in the hot set is answered from the index
while its stored listing is younger than ``dir_ttl_s`` (a lookup is one point query; a readdir loads
the listing into the hot set if it fits); an older one is listed again, and served stale from the
index if the store is unreachable, also right after a remount. Changes that reach the store patch
the index as they patch the hot set. On a mount pinned to a manifest (``pinned``) the index is the
whole namespace: nothing expires and the store is never listed; a directory the index does not hold
is empty.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable

from cachefs.fs.inodes import InodeTable
from cachefs.fs.kernelcache import KernelCache, NoKernelCache
from cachefs.fs.metaindex import MetadataIndex
from cachefs.fs.stats import FsStats
from cachefs.names import WarnOnce, name_problem
from cachefs.paths import join
from cachefs.settings import FsSettings
from tiering.clock import Clock
from tiering.errors import ObjectNotFoundError, ObjectStoreError, ObjectStoreUnavailableError
from tiering.objectstore.mtimes import metadata_mtime
from tiering.protocols import ObjectInfo, ObjectStore
from tiering.storehealth import StoreHealth, bounded, request_deadline
from tiering.writeback import MISSING, WriteBack

log = logging.getLogger(__name__)

UNKNOWN = object()  # no fresh listing holds the answer: list the directory

# The hot set in RAM is bounded by the number of entries it holds across all directories (about
# 200 bytes each): 250,000 entries is ~50 MiB, room for two 100,000-entry directories being walked.
# Without a metadata index it is the whole cache; with one, everything else is on disk.
MAX_CACHED_LISTING_ENTRIES = 250_000
# Store changes remembered for patching listings that were being fetched when the change landed; a
# LIST outlived by more changes than this is answered but not cached.
MAX_APPLIED_LOG = 10_000
# HEADs in flight while a listing's mtimes are read from metadata (``--mtime-from-metadata``): one
# per file never listed before. 32 keeps a loopback or in-region store busy (a HEAD is ~1-20 ms of
# waiting, no bytes) without queueing behind the mount's reads in the store's connection pool.
MTIME_HEADS_IN_FLIGHT = 32


@dataclass
class CachedDir:
    """One directory level as cached (a store ``Listing`` with its names checked): name -> ObjectInfo
    for files, None for directories."""

    entries: dict[str, ObjectInfo | None]
    expires_at: float


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


class ListingCache:
    """Listings by directory path (LRU, bounded by entries), merged with write-back's pending view.

    It refreshes the file nodes of ``inodes`` from what it lists, so getattr after the TTL sees new
    sizes and ETags; ``writeback`` is set by ``attach_writeback`` on a writable mount.
    """

    def __init__(self, store: ObjectStore, clock: Clock, settings: FsSettings, inodes: InodeTable,
                 stats: FsStats, health: StoreHealth | None = None, *, index: MetadataIndex | None = None,
                 pinned: bool = False) -> None:
        if pinned and index is None:
            raise ValueError("a pinned listing cache needs a metadata index (the manifest's)")
        self.store = store
        self.index = index
        self.pinned = pinned
        self._index_warned = False
        self.health = health
        self._stale_warned_outage = -1  # the outage (health.outages) the stale-listing warning was logged for
        self.clock = clock
        self.settings = settings
        self.inodes = inodes
        self.stats = stats
        self.writeback: WriteBack | None = None
        self.kernel: KernelCache = NoKernelCache()  # told what a new listing changed (``_follow``)
        self.entry_count = 0  # entries held across all cached listings
        # Bumped whenever an answer may change before its listing expires (a change reached the
        # store, a listing was dropped): what a caller remembered of an answer (``lookup_now``'s
        # expiry) holds only while this is unchanged.
        self.generation = 0
        self._listings: OrderedDict[str, CachedDir] = OrderedDict()
        self._flights: dict[str, asyncio.Task[CachedDir]] = {}
        self._bad_keys = WarnOnce()
        self._applied_log: deque[tuple[str, str, ObjectInfo | None, bool]] = deque()
        self._applied_total = 0
        # The mtime of each version (key -> ETag, mtime) this mount put in the store lately: a LIST
        # that comes after reports only LastModified (``_mtimes``). Bounded like the applied log.
        self._own_mtimes: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._listings)

    def attach_writeback(self, writeback: WriteBack) -> None:
        """Overlay ``writeback``'s pending changes, and follow them as they reach the store."""
        self.writeback = writeback
        writeback.on_applied = self.applied

    # ------------------------------------------------------------------ the merged view
    async def lookup(self, path: str, name: str) -> object:
        """``name`` in directory ``path`` with pending changes applied: info, None (a directory), MISSING."""
        stored, _ = self._indexed_lookup(path, name)
        if stored is UNKNOWN:
            listing = await self.get(path)
            stored = listing.entries.get(name, MISSING)
        if self.writeback is None:
            return stored
        return self.writeback.resolve(path, name, stored)

    def lookup_now(self, path: str, name: str) -> tuple[object, float]:
        """``lookup`` without waiting, and the monotonic time until which the store's part of the answer
        holds (while ``generation`` is unchanged); ``(UNKNOWN, 0)`` where the directory must be listed."""
        stored, until = self._indexed_lookup(path, name)
        if stored is UNKNOWN or self.writeback is None:
            return stored, until
        return self.writeback.resolve(path, name, stored), until

    async def entries(self, path: str) -> dict[str, ObjectInfo | None]:
        """Everything directory ``path`` holds now, pending changes applied."""
        listing = await self.get(path)
        if self.writeback is None:
            return listing.entries
        return self.writeback.merge(path, listing.entries)

    async def resolve_path(self, path: str) -> object:
        """What ``path`` (relative to the root) is in the merged view: info, None (a directory), MISSING."""
        if path == "":
            return None
        parent, _, name = path.rpartition("/")
        if await self.resolve_path(parent) is not None:
            return MISSING
        return await self.lookup(parent, name)

    # ------------------------------------------------------------------ the metadata index
    def _fresh_until(self, fetched_at: float) -> float | None:
        """The monotonic expiry of a listing stored at wall time ``fetched_at``; None if expired."""
        if self.pinned:
            return float("inf")
        age = self._wall() - fetched_at
        if 0 <= age < self.settings.dir_ttl_s:
            return self.clock.monotonic() + (self.settings.dir_ttl_s - age)
        return None

    def _wall(self) -> float:
        assert self.index is not None
        return self.index.wall()

    def _indexed_lookup(self, path: str, name: str) -> tuple[object, float]:
        """``name`` from a fresh listing of ``path`` in RAM or in the index, and when that listing
        expires; ``(UNKNOWN, 0)`` if neither holds one (the caller lists the directory)."""
        cached = self._listings.get(path)
        if cached is not None and cached.expires_at > self.clock.monotonic():
            self._listings.move_to_end(path)
            return cached.entries.get(name, MISSING), cached.expires_at
        if self.index is None or path in self._flights:
            return UNKNOWN, 0.0
        try:
            hit = self.index.lookup(path, name)
        except Exception as exc:  # noqa: BLE001 - a failing index is a miss, never an error
            self._index_failed(exc)
            return UNKNOWN, 0.0
        if hit is None:
            return (MISSING, float("inf")) if self.pinned else (UNKNOWN, 0.0)
        fetched_at, entry = hit
        until = self._fresh_until(fetched_at)
        return (entry, until) if until is not None else (UNKNOWN, 0.0)

    def _index_failed(self, exc: BaseException) -> None:
        self.stats.index_errors += 1
        if not self._index_warned:
            self._index_warned = True
            log.warning("metadata index failed (listing the store instead): %s", exc)

    async def _from_index(self, path: str) -> tuple[CachedDir | None, CachedDir | None]:
        """The stored listing of ``path``: (fresh, None), or (None, expired), or (None, None)."""
        if self.index is None:
            return None, None
        try:
            loaded = await asyncio.to_thread(self.index.load, path)
        except Exception as exc:  # noqa: BLE001 - a failing index is a miss, never an error
            self._index_failed(exc)
            return None, None
        if loaded is None:
            return None, None
        fetched_at, entries = loaded
        until = self._fresh_until(fetched_at)
        if until is None:
            return None, CachedDir(entries, self.clock.monotonic())
        self.stats.index_listings += 1
        return CachedDir(entries, until), None

    async def _to_index(self, path: str, listing: CachedDir, fetched_at: float) -> None:
        index = self.index
        if index is None:
            return
        mark = self._applied_total
        try:
            await asyncio.to_thread(index.store, path, list(listing.entries.items()), fetched_at)
        except Exception as exc:  # noqa: BLE001 - a failing index is a miss, never an error
            self._index_failed(exc)
            return
        # Changes that reached the store while the thread wrote may have patched the index before
        # the listing landed there: apply them again (a patch is idempotent).
        first = self._applied_total - len(self._applied_log)
        if mark < first:
            self._index_call(lambda ix: ix.forget(path))
            return
        for parent, name, info, marker in itertools.islice(self._applied_log, mark - first, None):
            if parent == path:
                if marker and info is None:
                    self._index_call(lambda ix: ix.forget(path))
                    return
                self._index_call(lambda ix: ix.patch(parent, name, info, marker))  # noqa: B023 - called at once

    # ------------------------------------------------------------------ store listings
    async def get(self, path: str) -> CachedDir:
        """The store's listing of directory ``path``, from the cache while it is fresh."""
        cached = self._listings.get(path)
        now = self.clock.monotonic()
        if cached is not None and cached.expires_at > now:
            self._listings.move_to_end(path)
            return cached
        flight = self._flights.get(path)
        if flight is None:
            # The LIST runs as its own task, so a caller that is cancelled does not cancel the
            # listing other lookups of the same directory are waiting for.
            flight = asyncio.get_running_loop().create_task(self._load(path, cached))
            flight.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._flights[path] = flight
            flight.add_done_callback(lambda f: self._flights.pop(path, None) if self._flights.get(path) is f else None)
        return await asyncio.shield(flight)

    async def _load(self, path: str, stale: CachedDir | None) -> CachedDir:
        """From the index while its listing is fresh, else from the store. An expired listing still
        in RAM was stored in the index at the same time: the index has nothing fresher."""
        if stale is not None and not self.pinned:
            return await self._fetch(path, stale)
        fresh, expired = await self._from_index(path)
        if fresh is not None:
            self._remember(path, fresh)
            return fresh
        if self.pinned:
            return CachedDir({}, float("inf"))  # not in the manifest: an empty directory, never listed
        return await self._fetch(path, stale or expired)

    async def _fetch(self, path: str, stale: CachedDir | None) -> CachedDir:
        self.stats.listings += 1
        fetched_at = self.index.wall() if self.index is not None else 0.0
        mark = self._applied_total
        prefix = path + "/" if path else ""
        try:
            with request_deadline(self.settings.metadata_timeout_s):
                raw = await bounded(self.health, lambda: self.store.list_dir(prefix), None, f"listing /{path}")
        except ObjectStoreUnavailableError as exc:
            self.stats.listing_errors += 1
            if stale is not None:
                self.stats.stale_listings_served += 1
                self._warn_stale(path, exc)
                return stale
            if self.writeback is not None and self.writeback.created_dir(path):
                # Made through this mount and not yet in the store: the store has nothing below it.
                return CachedDir({}, self.clock.monotonic() + self.settings.dir_ttl_s)
            raise
        except ObjectStoreError:
            self.stats.listing_errors += 1
            raise
        entries: dict[str, ObjectInfo | None] = {}
        for name in raw.dirs:
            problem = name_problem(name)
            if problem is not None:
                self._skip(join(path, name) + "/", problem.reason)
                continue
            entries[name] = None
        for name, info in raw.files.items():
            problem = name_problem(name)
            if problem is not None:
                self._skip(join(path, name), problem.reason)
            elif name in entries:
                self._skip(join(path, name), "a directory of the same name exists")
            else:
                entries[name] = info
        cacheable = await self._mtimes(path, entries, stale)
        listing = CachedDir(entries, self.clock.monotonic() + self.settings.dir_ttl_s)
        if cacheable and self._replay_applied(path, listing, mark):
            self._remember(path, listing)
            await self._to_index(path, listing, fetched_at)
        self._follow(path, entries, stale)
        return listing

    def _follow(self, path: str, entries: dict[str, ObjectInfo | None], previous: CachedDir | None) -> None:
        """Bring the nodes the kernel knows up to date with a new store listing of ``path``, so getattr
        and open see new sizes and ETags, and tell the kernel (``kernel``) what it holds that changed:
        an inode whose version changed loses its attributes and pages, and its entry; an entry whose
        name is gone from the listing (or became a directory, or a file) is dropped.

        Only nodes matter: the kernel holds an entry or an inode only while its node lives. Names
        added need nothing (a lookup answered ENOENT leaves no entry the kernel trusts: FUSE
        revalidates such negative entries every time), nor do names with a change pending in
        write-back (the kernel sees the staged view, which the store's does not change). Names gone
        are found against the previous listing of ``path`` (in RAM or in the index); without one,
        the kernel's own timeouts drop them."""
        kernel = self.kernel
        directory = self.inodes.at(path)
        for name, entry in entries.items():
            node = self.inodes.at(join(path, name))
            if node is None:
                continue
            if node.is_dir != (entry is None):
                # A file became a directory or back (told once: the previous listing had the old kind).
                was = previous.entries.get(name, MISSING) if previous is not None else MISSING
                if directory is not None and (was is None) == node.is_dir and not self._pending(path, name):
                    kernel.forget_entry(directory.inode, name.encode())
                continue
            if entry is None:
                continue
            before = node.info
            node.info = entry
            if (directory is not None and before is not None and (before.etag, before.size) != (entry.etag, entry.size)
                    and node.staged is None and not self._pending(path, name)):
                kernel.forget_inode(node.inode)
                kernel.forget_entry(directory.inode, name.encode())
        if directory is None or previous is None:
            return
        for name in previous.entries.keys() - entries.keys():
            if self.inodes.at(join(path, name)) is not None and not self._pending(path, name):
                kernel.forget_entry(directory.inode, name.encode())

    def _pending(self, path: str, name: str) -> bool:
        """Whether write-back has a change of ``name`` in ``path`` that the store does not show yet."""
        if self.writeback is None:
            return False
        marker = object()
        return self.writeback.resolve(path, name, marker) is not marker

    async def _mtimes(self, path: str, entries: dict[str, ObjectInfo | None], previous: CachedDir | None) -> bool:
        """Give each file of a new listing the mtime its writer set, where it can be known: a version
        (ETag) this mount put lately, or one already listed, keeps the mtime shown for it (set through
        this mount, or read from its metadata), and with ``mtime_from_metadata`` every other version's ``mtime`` metadata is read
        by a HEAD (at most ``MTIME_HEADS_IN_FLIGHT`` at once); the rest show LastModified. False when
        a HEAD failed: the listing is answered but not kept, so the next lookup tries again."""
        unknown: list[str] = []
        old = previous.entries if previous is not None else {}
        if not old and not self._own_mtimes and not self.settings.mtime_from_metadata:
            return True  # nothing to know more than LastModified (the first listing of a read-only mount)
        for name, info in entries.items():
            if info is None:
                continue
            before = old.get(name)
            own = self._own_mtimes.get(join(path, name)) if self._own_mtimes else None
            if own is not None and own[0] == info.etag:
                entries[name] = dataclasses.replace(info, mtime=own[1])
            elif before is not None and before.etag == info.etag:
                if before.mtime != info.mtime:
                    entries[name] = dataclasses.replace(info, mtime=before.mtime)
            elif self.settings.mtime_from_metadata:
                unknown.append(name)
        if not unknown:
            return True
        slots = asyncio.Semaphore(MTIME_HEADS_IN_FLIGHT)
        failed = 0

        async def head(name: str) -> None:
            nonlocal failed
            info = entries[name]
            assert info is not None
            key = join(path, name)
            try:
                async with slots:
                    with request_deadline(self.settings.metadata_timeout_s):
                        stored, metadata = await bounded(self.health, lambda: self.store.head_metadata(key), None,
                                                         f"HEAD /{key}")
            except ObjectNotFoundError:
                return  # gone since the LIST: the next listing drops it
            except ObjectStoreError as exc:
                failed += 1
                log.debug("reading the mtime metadata of /%s failed: %s", key, exc)
                return
            self.stats.mtime_heads += 1
            mtime = metadata_mtime(metadata)
            if mtime is not None and stored.etag == info.etag:
                entries[name] = dataclasses.replace(info, mtime=mtime)

        await asyncio.gather(*(head(name) for name in unknown))
        if failed:
            self.stats.listing_errors += 1
            log.warning("mtime metadata of %d files in /%s could not be read: they show LastModified for now",
                        failed, path)
        return not failed

    def _warn_stale(self, path: str, exc: BaseException) -> None:
        """One warning per outage of the store (every stale listing is counted in the stats)."""
        outage = self.health.outages if self.health is not None else 0
        if self.health is None or outage != self._stale_warned_outage:
            self._stale_warned_outage = outage
            log.warning("serving cached listings while the object store is unreachable (first: /%s): %s", path, exc)
        else:
            log.debug("serving cached listing of /%s: %s", path, exc)

    def _remember(self, path: str, listing: CachedDir) -> None:
        self._forget_hot(path)
        if len(listing.entries) > MAX_CACHED_LISTING_ENTRIES:
            return
        self._listings[path] = listing
        self.entry_count += len(listing.entries)
        while self.entry_count > MAX_CACHED_LISTING_ENTRIES and self._listings:
            _, evicted = self._listings.popitem(last=False)
            self.entry_count -= len(evicted.entries)

    def _skip(self, key: str, reason: str) -> None:
        before = self._bad_keys.count
        self._bad_keys.warn(key, reason)
        self.stats.skipped_keys += self._bad_keys.count - before

    def forget(self, path: str) -> None:
        """Drop the cached listing of ``path`` (the next lookup lists it again)."""
        self.generation += 1
        self._forget_hot(path)
        self._index_call(lambda index: index.forget(path))

    def _forget_hot(self, path: str) -> None:
        old = self._listings.pop(path, None)
        if old is not None:
            self.entry_count -= len(old.entries)

    def forget_under(self, path: str) -> None:
        """Drop the cached listings of ``path`` and of every directory below it."""
        self.generation += 1
        prefix = path + "/"
        for cached in [p for p in self._listings if p == path or p.startswith(prefix)]:
            self._forget_hot(cached)
        self._index_call(lambda index: index.forget_under(path))

    def _index_call(self, change: Callable[[MetadataIndex], None]) -> None:
        """A small change to the index (one directory, on the loop: a few rows). On a pinned mount
        the index is the manifest and is never changed."""
        if self.index is None or self.pinned:
            return
        try:
            change(self.index)
        except Exception as exc:  # noqa: BLE001 - a failing index is a miss, never an error
            self._index_failed(exc)

    # ------------------------------------------------------------------ changes reaching the store
    def applied(self, key: str, info: ObjectInfo | None) -> None:
        """A pending change reached the store: bring the cached store listing and the node up to date
        (the overlay stops covering it now). Listings being fetched right now are patched when they
        land (``_replay_applied``)."""
        self.generation += 1
        marker = key.endswith("/")
        path = key[:-1] if marker else key
        parent, _, name = path.rpartition("/")
        self._applied_log.append((parent, name, info, marker))
        self._applied_total += 1
        if not marker:
            self._own_mtimes.pop(path, None)
            if info is not None:
                self._own_mtimes[path] = (info.etag, info.mtime)
                if len(self._own_mtimes) > MAX_APPLIED_LOG:
                    self._own_mtimes.popitem(last=False)
        if len(self._applied_log) > MAX_APPLIED_LOG:
            self._applied_log.popleft()
        listing = self._listings.get(parent)
        if marker and info is None:
            self.forget(parent)  # other keys may still imply the directory: list again
        else:
            if listing is not None:
                before = len(listing.entries)
                _patch_entries(listing.entries, name, info, marker)
                self.entry_count += len(listing.entries) - before
            self._index_call(lambda index: index.patch(parent, name, info, marker))
        node = self.inodes.at(path)
        if not marker and node is not None and not node.is_dir and info is not None:
            node.info = info
            node.local_gen += 1

    def _replay_applied(self, path: str, listing: CachedDir, mark: int) -> bool:
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
