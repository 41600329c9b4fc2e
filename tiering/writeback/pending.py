"""The pending index: every key's pending store operation, and the namespace overlay built on them.

An ``Entry`` is the pending operation of one key: put this staged file (or directory marker ``a/b/``),
or delete the key. ``PendingIndex`` owns them, indexed by parent directory, with counts of pending
entries below each directory and of live entries below each child directory, so that:

- ``merge(dir, listing)`` (a store listing with the pending operations overlaid) costs in proportion
  to the changes in that directory, not to all pending changes;
- ``resolve(dir, name, stored)`` answers one name in constant time (lookups);
- ``pending_below(path)`` tells the uploader whether a marker delete (rmdir) must still wait for
  operations below it; when that count drops to zero, ``on_dir_clear(path)`` is called so the
  waiting rmdir is queued again.

It knows nothing of staged data beyond what a listing shows of a file (``staged_info``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator

from tiering.protocols import ObjectInfo
from tiering.writeback.journal import DELETE, PUT
from tiering.writeback.staged import StagedFile

# The ETag shown for a staged file in merged listings: it has no store version yet.
STAGED_ETAG = ""
# "No such name": what ``resolve`` answers for a name that does not exist once pending changes apply.
MISSING: object = object()


@dataclass(eq=False)
class Entry:
    """The pending operation on one key. ``seq`` is its record's; None: not journaled (being written)."""

    key: str
    op: str
    sf: StagedFile | None = None
    seq: int | None = None
    since: float = 0.0  # wall clock: when this key became dirty
    may_exist: bool = True
    ready_at: float = 0.0  # monotonic: the coalescing delay ends
    # Monotonic: when the oldest acknowledged version not yet in the store was acknowledged (None: no
    # version acknowledged yet). The coalescing delay never pushes the upload past it plus the max delay.
    acked_at: float | None = None
    retry_at: float = 0.0  # monotonic: the backoff after a failure ends
    due: float = 0.0  # what it was last queued with
    in_flight: bool = False
    attempts: int = 0
    last_error: str | None = None

    @property
    def is_marker(self) -> bool:
        return self.key.endswith("/")

    @property
    def path(self) -> str:
        return self.key[:-1] if self.is_marker else self.key


def staged_info(sf: StagedFile) -> ObjectInfo:
    """What a listing shows of a staged file."""
    return ObjectInfo(key=sf.key or "", size=sf.size, etag=STAGED_ETAG, mtime=sf.mtime)


def _split(path: str) -> list[tuple[str, str]]:
    """``(directory, child)`` for every level of ``path``: ``a/b/c`` -> ("", a), (a, b), (a/b, c)."""
    out: list[tuple[str, str]] = []
    directory = ""
    for part in path.split("/"):
        out.append((directory, part))
        directory = f"{directory}/{part}" if directory else part
    return out


class PendingIndex:
    """Key -> ``Entry``, with the per-directory indexes of the overlay (see the module docstring)."""

    def __init__(self, on_dir_clear: Callable[[str], None] = lambda path: None) -> None:
        self.on_dir_clear = on_dir_clear
        self._entries: dict[str, Entry] = {}
        self._children: dict[str, set[str]] = {}  # directory -> keys of entries directly in it
        self._child_dirs: dict[str, Counter[str]] = {}  # directory -> child -> live entries below it
        self._pending_below: Counter[str] = Counter()  # directory -> entries anywhere below it

    # -- entries ------------------------------------------------------------------------------------
    def get(self, key: str) -> Entry | None:
        return self._entries.get(key)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[str]:
        return list(self._entries)

    def values(self) -> list[Entry]:
        return list(self._entries.values())

    def __iter__(self) -> Iterator[Entry]:
        return iter(list(self._entries.values()))

    def journaled(self) -> int:
        """Operations acknowledged and not yet in the store."""
        return sum(1 for e in self._entries.values() if e.seq is not None)

    def put(self, entry: Entry) -> None:
        """Make ``entry`` its key's pending operation (it keeps the earliest ``since`` of the two)."""
        old = self._entries.get(entry.key)
        if old is not None:
            self._index_remove(old)
            entry.since = min(entry.since, old.since) if old.since else entry.since
        self._entries[entry.key] = entry
        self._index_add(entry)

    def drop(self, key: str) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._index_remove(old)

    def pending_below(self, path: str) -> int:
        return self._pending_below.get(path, 0)

    # -- the overlay --------------------------------------------------------------------------------
    def merge(self, directory: str, entries: dict[str, ObjectInfo | None]) -> dict[str, ObjectInfo | None]:
        """``entries`` (a store listing of ``directory``: name -> info, None for directories) with the
        pending operations overlaid. Returns ``entries`` itself when nothing is pending there."""
        direct = self._children.get(directory)
        implied = self._child_dirs.get(directory)
        if not direct and not implied:
            return entries
        names = set(entries)
        names.update(self._entries[key].path.rpartition("/")[2] for key in direct or ())
        names.update(implied or ())
        out: dict[str, ObjectInfo | None] = {}
        for name in names:
            value = self.resolve(directory, name, entries.get(name, MISSING))
            if value is not MISSING:
                out[name] = value  # type: ignore[assignment]
        return out

    def resolve(self, directory: str, name: str, stored: object = MISSING) -> object:
        """What ``name`` in ``directory`` is once the pending operations are applied to ``stored`` (its
        store listing value: info, None for a directory, ``MISSING``). Constant time, for lookups.

        Rules: a directory made here, or implied by something pending below it, is a directory; a
        directory in the store stays one unless it was removed here (then a file put of the same name
        shows); otherwise a pending file put shows the staged file and a pending delete hides it.
        """
        path = f"{directory}/{name}" if directory else name
        marker = self._entries.get(path + "/")
        implied = self._child_dirs.get(directory)
        if (marker is not None and marker.op == PUT) or (implied is not None and implied.get(name, 0) > 0):
            return None
        removed_dir = marker is not None and marker.op == DELETE
        if stored is None and not removed_dir:
            return None
        entry = self._entries.get(path)
        if entry is not None:
            if entry.op == PUT and entry.sf is not None:
                return staged_info(entry.sf)
            return MISSING
        return MISSING if stored is None else stored

    def created_dir(self, path: str) -> bool:
        """Whether ``path`` is a directory made through the mount and not yet in the store."""
        entry = self._entries.get(path + "/")
        return entry is not None and entry.op == PUT

    # -- the indexes --------------------------------------------------------------------------------
    def _index_add(self, entry: Entry) -> None:
        levels = _split(entry.path)
        parent, _ = levels[-1]
        self._children.setdefault(parent, set()).add(entry.key)
        for directory, _child in levels:
            self._pending_below[directory] += 1
        if entry.op == PUT:
            for directory, child in levels[:-1]:
                self._child_dirs.setdefault(directory, Counter())[child] += 1

    def _index_remove(self, entry: Entry) -> None:
        levels = _split(entry.path)
        parent, _ = levels[-1]
        keys = self._children.get(parent)
        if keys is not None:
            keys.discard(entry.key)
            if not keys:
                del self._children[parent]
        for directory, _child in levels:
            self._pending_below[directory] -= 1
            if self._pending_below[directory] <= 0:
                del self._pending_below[directory]
                if directory:
                    self.on_dir_clear(directory)  # a waiting rmdir may go now
        if entry.op == PUT:
            for directory, child in levels[:-1]:
                counts = self._child_dirs.get(directory)
                if counts is not None:
                    counts[child] -= 1
                    if counts[child] <= 0:
                        del counts[child]
                    if not counts:
                        del self._child_dirs[directory]
