"""Which files a request names: paths inside a mount, resolved against the store by the mount's rules.

Prefetch, snapshot, evict and unpin name files and directories by their path in the mount. The
daemon resolves those paths by listing the object store directly, one ``/``-delimited level at a
time, and applying the same rules as the filesystem (``cachefs.fs``): a component that is not a
valid POSIX name is skipped (``cachefs.names``), and a file whose name is also a directory is hidden
(the directory wins). So a request sees exactly the files a walk of the mount would see, without
walking FUSE (which would cost a kernel round trip per entry and fill the inode table) and without
the listing cache's TTL (a snapshot must describe the store as it is now). ``tests/unit`` checks that
this view and ``CacheFS``'s agree on a store full of awkward keys.

A path is looked up in its parent's listing, as the kernel does: the last component must be an
entry of the parent directory. Directories are walked with ``LIST_CONCURRENCY`` workers over a
queue, so a deep tree costs one LIST per directory, several in flight, and memory proportional to
the files found rather than to the tree's shape.

Requests carry paths relative to the mount root, checked with ``cachefs.paths.check_path``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from cachefs.names import name_problem
from cachefs.paths import check_path, join
from tiering.protocols import ObjectInfo, ObjectStore

# LISTs in flight while walking a tree: each is a round trip of milliseconds that returns up to
# 1,000 keys; 8 hide the latency of a loopback or in-region store without looking like a scan
# storm to a shared one, and leave most fetch connections (32 in the S3 pool) to reads.
LIST_CONCURRENCY = 8


@dataclass
class Resolved:
    """The outcome of resolving a set of paths: files found, and what was wrong with the rest."""

    files: dict[str, ObjectInfo] = field(default_factory=dict)  # by path (== key), deduplicated
    missing: list[str] = field(default_factory=list)
    directories: list[str] = field(default_factory=list)  # directories named without recursion


class Resolver:
    """Resolves mount paths against ``store``. Listings are cached for the life of the resolver
    (one request), so many paths in one directory cost one LIST."""

    def __init__(self, store: ObjectStore, *, list_concurrency: int = LIST_CONCURRENCY) -> None:
        self.store = store
        self.list_concurrency = list_concurrency
        self.skipped_keys = 0  # keys hidden by the naming rules, in the listings made
        self.listings = 0
        self._cache: dict[str, dict[str, ObjectInfo | None]] = {}

    async def entries(self, directory: str) -> dict[str, ObjectInfo | None]:
        """The visible entries of one directory: name -> ObjectInfo for files, None for directories."""
        cached = self._cache.get(directory)
        if cached is not None:
            return cached
        listing = await self.store.list_dir(directory + "/" if directory else "")
        self.listings += 1
        entries: dict[str, ObjectInfo | None] = {}
        for name in listing.dirs:
            if name_problem(name) is not None:
                self.skipped_keys += 1
            else:
                entries[name] = None
        for name, info in listing.files.items():
            if name_problem(name) is not None or name in entries:
                self.skipped_keys += 1
            else:
                entries[name] = info
        self._cache[directory] = entries
        return entries

    async def lookup(self, path: str) -> ObjectInfo | None | bool:
        """ObjectInfo for a file, None for a directory, False if nothing is there."""
        path = check_path(path)
        if path == "":
            return None
        parent, _, name = path.rpartition("/")
        entries = await self.entries(parent)
        return entries.get(name, False)

    async def walk(self, directory: str, *, recursive: bool = True) -> list[ObjectInfo]:
        """Files under ``directory`` (only its own with ``recursive=False``), sorted by key."""
        files: list[ObjectInfo] = []
        queue: asyncio.Queue[str] = asyncio.Queue()
        queue.put_nowait(check_path(directory))
        errors: list[BaseException] = []

        async def worker() -> None:
            while True:
                current = await queue.get()
                try:
                    if not errors:
                        listing = await self._list_uncached(current)
                        for name, info in listing.items():
                            if info is not None:
                                files.append(info)
                            elif recursive:
                                queue.put_nowait(join(current, name))
                except Exception as exc:  # noqa: BLE001 - re-raised below, after the workers stop
                    errors.append(exc)
                finally:
                    queue.task_done()

        workers = [asyncio.create_task(worker()) for _ in range(self.list_concurrency)]
        try:
            await queue.join()
        finally:
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        if errors:
            raise errors[0]
        files.sort(key=lambda info: info.key)
        return files

    async def _list_uncached(self, directory: str) -> dict[str, ObjectInfo | None]:
        """``entries`` without keeping the listing: a walk visits each directory once."""
        cached = self._cache.get(directory)
        if cached is not None:
            return cached
        entries = await self.entries(directory)
        del self._cache[directory]
        return entries

    async def preload(self, paths: list[str]) -> None:
        """List the parents of many paths, ``list_concurrency`` at a time (for manifests)."""
        parents = sorted({check_path(p).rpartition("/")[0] for p in paths if check_path(p)} - set(self._cache))
        slots = asyncio.Semaphore(self.list_concurrency)

        async def one(parent: str) -> None:
            async with slots:
                await self.entries(parent)

        await asyncio.gather(*(one(p) for p in parents))

    async def resolve(self, paths: list[str], *, recursive: bool) -> Resolved:
        """Files named by ``paths``: files as they are, directories expanded if ``recursive``."""
        out = Resolved()
        await self.preload(paths)
        for path in paths:
            path = check_path(path)
            found = await self.lookup(path)
            if found is False:
                out.missing.append(path or "/")
            elif found is None:
                if not recursive:
                    out.directories.append(path or "/")
                    continue
                for info in await self.walk(path):
                    out.files.setdefault(info.key, info)
            else:
                assert isinstance(found, ObjectInfo)
                out.files.setdefault(found.key, found)
        return out
