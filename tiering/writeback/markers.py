"""Directory semantics of write-back: markers, rmdir after children, markers never racing writes below.

An object store has no directories: a directory is a *marker* object ``a/b/`` (kept so that an
empty directory exists) or is implied by keys below it. Everything write-back does about that lives
here:

- ``Directories``: ``mkdir`` and ``rmdir`` journal a marker put or delete; ``ensure_dir`` keeps a
  directory that loses an entry alive in the store (a directory lives until rmdir, even once its
  last object goes): it journals the marker once per directory and mount (remembered in a bounded
  memo), unless a marker put is pending anyway.
- ``MarkerOrder``: the two ordering rules the uploader asks before starting an operation.
  *rmdir after children*: a marker delete waits until nothing is pending below its directory (the
  pending index re-queues it when that count drops to zero). *No marker put beside a write below
  it*: stores that keep a real directory tree (SeaweedFS's filer) create a key's parent directories
  as they write the key, and a marker put racing with that creation can be lost (measured on
  SeaweedFS: about 1 concurrent pair in 60); the directory then lives only as long as something is
  below it. So a marker put waits while a key below it is in flight or blocked (``quiesce``, under
  which the filesystem runs server-side copies), and nothing below starts while it is in flight.
  Markers are tiny: serialising them with the writes below costs nothing.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Awaitable, Callable

from tiering.writeback.journal import DELETE, PUT
from tiering.writeback.pending import Entry, PendingIndex

# Directories remembered as having a marker this mount (ensure_dir): one PUT per directory that loses
# an entry, not one per unlink; past this many, the oldest are forgotten (and may get a second PUT).
MAX_ENSURED_DIRS = 10_000


def ancestors(key: str) -> list[str]:
    """The directories strictly above ``key`` (a marker ``a/b/`` is the directory ``a/b``): ``a``, ``a/b``
    for ``a/b/c``; the root is not one (it has no marker)."""
    parts = key.rstrip("/").split("/")[:-1]
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]


class Directories:
    """mkdir, rmdir and ensure_dir: the marker operations, journaled through ``journal(key, op)``."""

    def __init__(self, index: PendingIndex, journal: Callable[[str, str], Awaitable[None]]) -> None:
        self._index = index
        self._journal = journal  # takes the key's lock, writes the record, queues the entry
        self._ensured: OrderedDict[str, None] = OrderedDict()  # directories given a marker (ensure_dir)

    async def mkdir(self, path: str) -> None:
        await self._journal(path + "/", PUT)

    async def rmdir(self, path: str) -> None:
        self._ensured.pop(path, None)
        await self._journal(path + "/", DELETE)

    async def ensure_dir(self, path: str) -> None:
        """Keep directory ``path`` existing in the store once its last entry goes (a directory lives
        until rmdir): journal its marker, once per directory and mount, unless one is pending."""
        if not path or path in self._ensured:
            return
        if not self._index.created_dir(path):
            await self.mkdir(path)
        self._ensured[path] = None
        if len(self._ensured) > MAX_ENSURED_DIRS:
            self._ensured.popitem(last=False)


class MarkerOrder:
    """Which operations must not start now because of a directory (see the module docstring)."""

    def __init__(self, index: PendingIndex) -> None:
        self._index = index
        self._claimed_below: Counter[str] = Counter()  # directory -> busy or blocked keys below it
        self._marker_puts: Counter[str] = Counter()  # directories whose marker put is in flight

    def must_wait(self, entry: Entry) -> bool:
        if entry.is_marker and entry.op == DELETE and self._index.pending_below(entry.path) > 0:
            return True  # rmdir after everything below
        if entry.is_marker and entry.op == PUT and self._claimed_below.get(entry.path, 0) > 0:
            return True
        return self.marker_put_above(entry.key)

    def marker_put_above(self, key: str) -> bool:
        return bool(self._marker_puts) and any(d in self._marker_puts for d in ancestors(key))

    def claim(self, key: str) -> None:
        """``key`` is in flight or blocked: no marker put above it may start."""
        for directory in ancestors(key):
            self._claimed_below[directory] += 1

    def unclaim(self, key: str) -> None:
        for directory in ancestors(key):
            self._claimed_below[directory] -= 1
            if self._claimed_below[directory] <= 0:
                del self._claimed_below[directory]

    def started(self, entry: Entry) -> None:
        self.claim(entry.key)
        if entry.is_marker and entry.op == PUT:
            self._marker_puts[entry.path] += 1

    def finished(self, entry: Entry) -> None:
        self.unclaim(entry.key)
        if entry.is_marker and entry.op == PUT:
            self._marker_puts[entry.path] -= 1
            if self._marker_puts[entry.path] <= 0:
                del self._marker_puts[entry.path]
