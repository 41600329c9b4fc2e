"""The metadata index: directory listings (and so file attributes) on disk, surviving remounts.

The listing cache (``cachefs.fs.listings``) keeps a small hot set of listings in RAM; this index
holds every listing the mount has seen, in one SQLite file in the source's cache directory
(``metadata.db``), so a remount answers ``ls`` and ``stat`` from disk instead of listing the bucket
again, and a directory of millions of entries costs disk, not RAM. Each directory is stored with the
wall-clock time its LIST began; the listing cache serves a stored listing only while it is younger
than ``--dir-ttl`` (older ones are listed again, and served stale only while the store is
unreachable), except on a mount pinned to a manifest, whose listings never expire.

Why SQLite directly and not diskcache (which is SQLite underneath): the index is asked for one name
in one directory (a lookup: a point query on ``(dir, name)``), for all names of one directory in
order (readdir: a range scan), and to replace a whole directory at once (a LIST result: delete and
insert in one transaction). diskcache is a key-value store: a listing as one value would unpickle a
100,000-entry directory for every ``stat``, and an entry per key has no range scan and no atomic
replace of a directory. Its culling (``size_limit``) would also drop single entries of a listing,
leaving a directory that looks complete but is not; here a directory is evicted whole.

Layout: ``dirs(id, path, fetched_at, count)`` and ``entries(dir, name, size, etag, mtime, line)``
keyed ``(dir, name)`` without a rowid (the B-tree is the table: one seek per lookup, names in order
for readdir). ``size`` is NULL for a subdirectory. ``line`` is the manifest line an entry came from
(NULL for listed entries), so a problem found after an import can name its line.

Crash safety: every change (a whole listing, a patch, a forget, an eviction) is one transaction in
WAL mode, so a crash (kill -9, power loss) at any point leaves the listing before or after the
change, never a mix; ``synchronous=NORMAL`` may lose the last transactions on power loss, which
costs a LIST, never a wrong answer. A file that SQLite cannot open as an index (corrupt, foreign, an
older format) is deleted and started afresh: it is a cache, everything in it can be listed again.

RAM: SQLite's page cache is bounded (``CACHE_KIB``) and memory-mapping is off, so the daemon's RSS
does not grow with the index; the operating system's page cache does the rest.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from tiering.protocols import ObjectInfo
from tiering.writeback import MISSING

log = logging.getLogger(__name__)

INDEX_FILENAME = "metadata.db"
FORMAT_VERSION = "1"
# Entries the index holds across all directories before it evicts whole directories, oldest listing
# first. An entry takes about 100 bytes on disk with its B-tree overhead: 50 M entries is ~5 GB,
# room for several 10 M-object datasets, and still a small fraction of a disk tier.
DEFAULT_MAX_INDEX_ENTRIES = 50_000_000
# SQLite's page cache for this connection: 16 MiB keeps the B-tree's inner pages (about 1% of a
# 10 M-entry index) and the hot leaves in RAM; more only duplicates the kernel's page cache.
CACHE_KIB = 16 * 1024
# Rows written per executemany call in a bulk load (bounds the Python list held at once).
BULK_BATCH = 10_000
# How many oldest directories one eviction round looks at.
_EVICT_BATCH = 64

Entry = ObjectInfo | None  # a file, or None for a subdirectory

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS dirs (
    id INTEGER PRIMARY KEY, path TEXT NOT NULL UNIQUE, fetched_at REAL NOT NULL, count INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS dirs_age ON dirs (fetched_at);
CREATE TABLE IF NOT EXISTS entries (
    dir INTEGER NOT NULL, name TEXT NOT NULL, size INTEGER, etag TEXT, mtime REAL, line INTEGER,
    PRIMARY KEY (dir, name)) WITHOUT ROWID;
"""


# A name in a stored directory: no row when the directory is not stored, NULL ``e.name`` when the
# name is not in it (``size`` alone cannot tell: it is NULL for a subdirectory).
_LOOKUP = ("SELECT d.fetched_at, e.name, e.size, e.etag, e.mtime FROM dirs d "
           "LEFT JOIN entries e ON e.dir = d.id AND e.name = ? WHERE d.path = ?")


def _join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


def _entry(path: str, name: str, size: int | None, etag: str | None, mtime: float | None) -> Entry:
    if size is None:
        return None
    return ObjectInfo(_join(path, name), size, etag or "", mtime or 0.0)


def _row(dir_id: int, name: str, entry: Entry, line: int | None = None) -> tuple[object, ...]:
    if entry is None:
        return (dir_id, name, None, None, None, line)
    return (dir_id, name, entry.size, entry.etag, entry.mtime, line)


class MetadataIndex:
    """Listings by directory path on disk (``path`` is a file, or None for a private in-memory index).

    Thread-safe (one lock around the connection): the listing cache writes from a worker thread.
    ``wall`` is the wall clock listings are dated with (a fake one in tests). ``bulk`` opens a new
    file to be filled once and renamed into place by its caller (a manifest import): no journal and
    no syncs (SQLite's fastest writes; a crash leaves a file the caller never trusts, and a failed
    transaction is not rolled back: the caller deletes the file)."""

    def __init__(self, path: Path | None, *, max_entries: int = DEFAULT_MAX_INDEX_ENTRIES,
                 wall: Callable[[], float] = time.time, bulk: bool = False) -> None:
        self.path = path
        self.bulk = bulk
        self.max_entries = max_entries
        self.wall = wall
        self._lock = threading.Lock()
        self._conn = self._open()
        self.total_entries = int(self._conn.execute("SELECT coalesce(sum(count), 0) FROM dirs").fetchone()[0])

    def _open(self) -> sqlite3.Connection:
        target = ":memory:" if self.path is None else str(self.path)
        if self.path is not None:
            # SQLite follows symlinks and Python cannot ask it not to: a link where the index or its
            # journal should be is not the daemon's (tiering.private), so it goes, its target untouched.
            for suffix in ("", "-wal", "-shm"):
                if os.path.islink(f"{self.path}{suffix}"):
                    log.warning("metadata index %s%s is a symlink: removing it", self.path, suffix)
                    os.unlink(f"{self.path}{suffix}")
        try:
            return self._connect(target)
        except sqlite3.DatabaseError as exc:
            if self.path is None:
                raise
            log.warning("metadata index %s is not usable (%s): starting a new one", self.path, exc)
            for suffix in ("", "-wal", "-shm"):
                try:
                    os.unlink(f"{self.path}{suffix}")
                except FileNotFoundError:
                    pass
            return self._connect(target)

    def _connect(self, target: str) -> sqlite3.Connection:
        conn = sqlite3.connect(target, isolation_level=None, check_same_thread=False)
        try:
            if self.bulk:
                conn.execute("PRAGMA journal_mode=OFF")
                conn.execute("PRAGMA synchronous=OFF")
            else:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
            conn.execute("PRAGMA mmap_size=0")
            conn.executescript(_SCHEMA)
            row = conn.execute("SELECT value FROM meta WHERE key = 'format'").fetchone()
            if row is None:
                conn.execute("INSERT INTO meta VALUES ('format', ?)", (FORMAT_VERSION,))
            elif row[0] != FORMAT_VERSION:
                raise sqlite3.DatabaseError(f"format {row[0]}, expected {FORMAT_VERSION}")
        except BaseException:
            conn.close()
            raise
        return conn

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # ------------------------------------------------------------------ reading
    def fetched_at(self, path: str) -> float | None:
        """When the stored listing of ``path`` was fetched (wall clock), or None if none is stored."""
        with self._lock:
            row = self._conn.execute("SELECT fetched_at FROM dirs WHERE path = ?", (path,)).fetchone()
        return None if row is None else float(row[0])

    def load(self, path: str) -> tuple[float, dict[str, Entry]] | None:
        """The stored listing of ``path`` (when it was fetched, and name -> entry), or None."""
        with self._lock:
            row = self._conn.execute("SELECT id, fetched_at FROM dirs WHERE path = ?", (path,)).fetchone()
            if row is None:
                return None
            rows = self._conn.execute(
                "SELECT name, size, etag, mtime FROM entries WHERE dir = ? ORDER BY name", (row[0],)).fetchall()
        return float(row[1]), {name: _entry(path, name, size, etag, mtime) for name, size, etag, mtime in rows}

    def lookup(self, path: str, name: str) -> tuple[float, object] | None:
        """``name`` in the stored listing of ``path``: (fetched_at, entry or MISSING); None when the
        directory is not stored."""
        # One statement, so one read transaction (two took 10-12 us a lookup, this 5-6, measured alone
        # on 8,000 entries): a LOOKUP after a remount asks it for every file.
        with self._lock:
            row = self._conn.execute(_LOOKUP, (name, path)).fetchone()
        if row is None:
            return None
        fetched_at, found, size, etag, mtime = row
        if found is None:
            return float(fetched_at), MISSING
        return float(fetched_at), _entry(path, name, size, etag, mtime)

    def count(self, path: str) -> int | None:
        with self._lock:
            row = self._conn.execute("SELECT count FROM dirs WHERE path = ?", (path,)).fetchone()
        return None if row is None else int(row[0])

    def directories(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT count(*) FROM dirs").fetchone()[0])

    def meta(self, key: str) -> str | None:
        with self._lock:
            row = self._conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    # ------------------------------------------------------------------ writing
    def store(self, path: str, entries: Iterable[tuple[str, Entry]], fetched_at: float | None = None) -> bool:
        """Replace the listing of ``path`` with ``entries``, dated ``fetched_at`` (default: now), in
        one transaction. Older directories are evicted whole to stay within ``max_entries``; a
        listing larger than that is not stored (and the old one is dropped). False if not stored."""
        when = self.wall() if fetched_at is None else fetched_at
        with self._lock, self._transaction():
            old = self._drop(path)
            cur = self._conn.execute("INSERT INTO dirs (path, fetched_at, count) VALUES (?, ?, 0)", (path, when))
            dir_id = cur.lastrowid
            assert dir_id is not None
            count = 0
            batch: list[tuple[object, ...]] = []
            for name, entry in entries:
                batch.append(_row(dir_id, name, entry))
                if len(batch) >= BULK_BATCH:
                    count += self._insert(batch)
            count += self._insert(batch)
            if count > self.max_entries:
                self._drop(path)
                self.total_entries -= old
                return False
            self._conn.execute("UPDATE dirs SET count = ? WHERE id = ?", (count, dir_id))
            total = self.total_entries - old + count
            total -= self._evict(total, keep=path)
        self.total_entries = total
        return True

    def _insert(self, batch: list[tuple[object, ...]]) -> int:
        self._conn.executemany("INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?)", batch)
        n = len(batch)
        batch.clear()
        return n

    def _drop(self, path: str) -> int:
        """Delete the stored listing of ``path`` (inside a transaction); the entries it held."""
        row = self._conn.execute("SELECT id, count FROM dirs WHERE path = ?", (path,)).fetchone()
        if row is None:
            return 0
        self._conn.execute("DELETE FROM entries WHERE dir = ?", (row[0],))
        self._conn.execute("DELETE FROM dirs WHERE id = ?", (row[0],))
        return int(row[1])

    def _evict(self, total: int, keep: str) -> int:
        """Drop oldest directories until ``total`` fits; the entries dropped."""
        dropped = 0
        while total - dropped > self.max_entries:
            rows = self._conn.execute("SELECT path FROM dirs WHERE path != ? ORDER BY fetched_at LIMIT ?",
                                      (keep, _EVICT_BATCH)).fetchall()
            if not rows:
                break
            for (victim,) in rows:
                dropped += self._drop(victim)
                if total - dropped <= self.max_entries:
                    break
        return dropped

    def patch(self, path: str, name: str, info: ObjectInfo | None, marker: bool) -> None:
        """Apply one change that reached the store to the stored listing of ``path`` (if stored): a
        file put (``info``) or delete (None), or a directory marker put (``marker``)."""
        with self._lock, self._transaction():
            row = self._conn.execute("SELECT id FROM dirs WHERE path = ?", (path,)).fetchone()
            if row is None:
                return
            dir_id = row[0]
            current = self._conn.execute("SELECT size FROM entries WHERE dir = ? AND name = ?",
                                         (dir_id, name)).fetchone()
            delta = 0
            if marker:
                if info is not None and (current is None or current[0] is not None):
                    self._conn.execute("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?)",
                                       _row(dir_id, name, None))
                    delta = 1 if current is None else 0
            elif info is None:
                if current is not None and current[0] is not None:
                    self._conn.execute("DELETE FROM entries WHERE dir = ? AND name = ?", (dir_id, name))
                    delta = -1
            elif current is None or current[0] is not None:
                self._conn.execute("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?)",
                                   _row(dir_id, name, info))
                delta = 1 if current is None else 0
            if delta:
                self._conn.execute("UPDATE dirs SET count = count + ? WHERE id = ?", (delta, dir_id))
            total = self.total_entries + delta
            if delta > 0 and total > self.max_entries:
                # A grown listing makes room as a stored one does: oldest directories go whole, and
                # the listing itself if it alone is over the bound.
                total -= self._evict(total, keep=path)
                if total > self.max_entries:
                    total -= self._drop(path)
        self.total_entries = total

    def forget(self, path: str) -> None:
        with self._lock, self._transaction():
            dropped = self._drop(path)
        self.total_entries -= dropped

    def forget_under(self, path: str) -> None:
        """Drop the stored listings of ``path`` and of every directory below it."""
        with self._lock, self._transaction():
            if path == "":
                self._conn.execute("DELETE FROM entries")
                self._conn.execute("DELETE FROM dirs")
                dropped = self.total_entries
            else:
                # Paths below ``path`` sort between "path/" and "path0" ("0" follows "/").
                rows = self._conn.execute(
                    "SELECT path FROM dirs WHERE path = ? OR (path >= ? AND path < ?)",
                    (path, path + "/", path + "0")).fetchall()
                dropped = sum(self._drop(p) for (p,) in rows)
        self.total_entries -= dropped

    def set_meta(self, key: str, value: str) -> None:
        with self._lock, self._transaction():
            self._conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    # ------------------------------------------------------------------ bulk loading (manifests)
    def bulk_load(self, batches: Iterable[Sequence[tuple[object, ...]]], dirs: dict[str, int], fetched_at: float) -> None:
        """Load whole listings into this empty index, in one transaction: ``batches`` of entry rows
        ``(dir id, name, size, etag, mtime, line)`` (``size`` None for a subdirectory), and the
        directories ``dirs`` (path -> id), read once ``batches`` is exhausted (their producer fills
        it as it goes). A name given twice in one directory raises ``DuplicateEntryError`` with the
        line of the second. On an index opened with ``bulk=True`` a failed load leaves a file to
        delete, not the index as it was."""
        with self._lock, self._transaction():
            if self._conn.execute("SELECT 1 FROM dirs LIMIT 1").fetchone() is not None:
                raise ValueError("bulk_load needs an empty index")
            for batch in batches:
                self._insert_unique(batch)
            self._conn.executemany("INSERT INTO dirs (id, path, fetched_at, count) VALUES (?, ?, ?, 0)",
                                   ((i, path, fetched_at) for path, i in dirs.items()))
            self._conn.execute("UPDATE dirs SET count = (SELECT count(*) FROM entries WHERE entries.dir = dirs.id)")
            self.total_entries = int(self._conn.execute("SELECT coalesce(sum(count), 0) FROM dirs").fetchone()[0])

    def _insert_unique(self, batch: Sequence[tuple[object, ...]]) -> None:
        try:
            self._conn.executemany("INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?)", batch)
        except sqlite3.IntegrityError:
            # The rows before the refused one are in (no savepoint to undo them: a bulk index has no
            # journal), so the first duplicate of the batch is the first row whose (dir, name) is
            # stored from another line, or came earlier in this batch.
            seen: set[tuple[object, object]] = set()
            for row in batch:
                key = (row[0], row[1])
                stored = self._conn.execute("SELECT line FROM entries WHERE dir = ? AND name = ?", key).fetchone()
                if key in seen or (stored is not None and stored[0] != row[5]):
                    line = row[5]
                    assert isinstance(line, int)
                    raise DuplicateEntryError(line, str(row[1])) from None
                seen.add(key)
            raise

    def file_line(self, path: str) -> int | None:
        """The manifest line of the file entry ``path``, if it is a file entry with a line."""
        parent, _, name = path.rpartition("/")
        with self._lock:
            row = self._conn.execute(
                "SELECT e.line FROM entries e JOIN dirs d ON d.id = e.dir "
                "WHERE d.path = ? AND e.name = ? AND e.size IS NOT NULL", (parent, name)).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    # ------------------------------------------------------------------ transactions
    def _transaction(self) -> _Transaction:
        return _Transaction(self._conn)


class DuplicateEntryError(ValueError):
    def __init__(self, line: int, name: str) -> None:
        super().__init__(f"line {line}: {name!r} is listed twice")
        self.line = line
        self.name = name


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on any exception (the caller holds the lock)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.conn.execute("COMMIT")
        else:
            self.conn.execute("ROLLBACK")
