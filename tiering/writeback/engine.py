"""Write-back: writes are staged durably on local disk, journaled, and uploaded asynchronously.

What it does
------------
``WriteBack`` keeps, per object key, the *pending operation*: put this staged file (or directory
marker), or delete this key. Each pending operation is a journal record on disk
(``tiering.writeback.journal``) and an ``Entry`` in memory. The filesystem (``cachefs.fs``) calls
``create``/``stage``/``write``/``truncate``/``commit`` for file data and ``remove``/``mkdir``/
``rmdir``/``move`` for the namespace, and overlays ``merge(dir)`` on the store's listings, so reads
and listings through the mount see every change at once. An uploader (asyncio tasks on the daemon
loop) applies pending operations to the store: a few objects at once, oldest first, each after a
short coalescing delay, retried with capped exponential backoff and jitter.

Durability stages of a file: *writing* (modified, not yet acknowledged: an unlink or crash loses
it), *dirty* (acknowledged: fsync'd and journaled; survives kill -9 and is uploaded by the next
mount), *uploading*, *clean* (in the store; the staged copy is dropped once no handle is open).

Invariants
----------
I1  close() and fsync() return only after the staged data file is fsync'd (with its directory
    entry) and a journal record naming it, its size and its CRC-32 is fsync'd (temp file, fsync,
    rename, directory fsync). That record is the acknowledgement.
I2  One record per key (its file name is a hash of the key), replaced atomically by rename: the
    journal on disk is always the latest acknowledged operation of each key.
I3  A record is written before any reference it supersedes is dropped: a data file named by a
    durable record is never unlinked or modified in its recorded prefix (see ``staged``: the
    acknowledged prefix is copy-on-write).
I4  At most one store operation per key is in flight, and a record is removed only if it is still
    the one whose operation just succeeded; so the store receives each key's operations in order,
    and a delete that supersedes an in-flight upload runs after it.
I5  Uploads send exactly an acknowledged version (a data file prefix of the recorded size) through
    an atomic store put; unacknowledged bytes are never uploaded.
I6  Staged data is never evicted: its bytes are reserved in the ``SpaceBudget`` (the disk tier)
    before they are written, and given back only when the data file is gone. When the budget is
    full, writers wait (uploads start at once) and then fail with ENOSPC.

Crash analysis (kill -9, at each step)
--------------------------------------
- While writing (before close/fsync returns): the data file has no record, or the record names an
  older acknowledged version whose prefix is intact (I3). Replay uploads the older version or
  nothing, and removes unreferenced data files. Never a partial or mixed object.
- Between the data fsync and the record rename: as above (the temp record is removed at start).
- After the rename, before the directory fsync: the record may or may not survive; either outcome
  is a whole, fsync'd version (close had not returned, so both are allowed).
- After the directory fsync: acknowledged; replay finds the record, verifies the data's CRC-32
  (quarantining, never uploading, data that fails) and queues the upload.
- During an upload: the store's put is atomic (PutObject, CompleteMultipartUpload, temp+rename for
  the local store), so the object is the old one or the new one. Replay uploads again; a cut
  multipart upload stays invisible on the server (see ``tiering.objectstore.s3``).
- After the upload, before the record removal: replay uploads the same bytes again (idempotent).
- Unlink: the delete record replaces the put record (or, for a file the store never had, the
  record removal is fsync'd), so a deleted file never comes back and a deleted object is deleted.
- Rename of a staged file: the destination's record (naming the same data file) is written before
  the source's record is replaced. A crash in between leaves both: replay gives the destination a
  copy of the data file and uploads both names (rename is not atomic, and documented as such).

Overlay and listings: entries for ``a/b`` and markers ``a/b/`` are indexed by parent directory,
with counts of pending entries below each directory, so ``merge`` is proportional to the changes in
that directory, and a marker delete (``rmdir``) is applied only after everything below it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import heapq
import itertools
import logging
import os
import random
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator

from tiering.blocks import BlockKey, ObjectRef
from tiering.checksum import crc32
from tiering.clock import Clock, SystemClock
from tiering.engine import BlockCache
from tiering.errors import AccessDeniedError, CacheError, ObjectStoreError, ObjectStoreUnavailableError
from tiering.protocols import ObjectInfo, ObjectStore, SpaceBudget
from tiering.writeback.journal import DELETE, PUT, Record, StagingDir, copy_range, crc_range, pread_exact, pwrite_all
from tiering.writeback.settings import (
    FS_BLOCK,
    MATERIALIZE_WINDOW,
    RECORD_BYTES,
    RESERVE_CHUNK,
    STORE_PROBE_CAP_S,
    UPLOAD_BACKOFF_BASE_S,
    UPLOAD_BACKOFF_CAP_S,
    WriteBackSettings,
)
from tiering.writeback.staged import Acked, DataFile, StagedFile

log = logging.getLogger("tiering.writeback")

# The ETag shown for a staged file in merged listings: it has no store version yet.
STAGED_ETAG = ""
# "No such name": what ``resolve`` answers for a name that does not exist once pending changes apply.
MISSING: object = object()
_MISSING = MISSING

WRITING, DIRTY, UPLOADING, DELETING = "writing", "dirty", "uploading", "deleting"
# An uploaded file up to this size is also copied into the disk tier as clean blocks under its new
# ETag (read-after-upload served locally, the staged copy goes). Larger ones (checkpoints, rarely read
# back at once) are not written a second time: their staged copy is just dropped.
PROMOTE_MAX_BYTES = 256 * 1024 * 1024
# Directories remembered as having a marker this mount (ensure_dir): one PUT per directory that loses
# an entry, not one per unlink; past this many, the oldest are forgotten (and may get a second PUT).
MAX_ENSURED_DIRS = 10_000


class UploadError(CacheError):
    """A write-through upload failed; close() or fsync() report it (the data stays staged)."""

    errno = errno.EIO


class UploadAccessDeniedError(UploadError):
    errno = errno.EACCES


def _round_up(n: int, unit: int = FS_BLOCK) -> int:
    return -(-n // unit) * unit


def _split(path: str) -> list[tuple[str, str]]:
    """``(directory, child)`` for every level of ``path``: ``a/b/c`` -> ("", a), (a, b), (a/b, c)."""
    out: list[tuple[str, str]] = []
    directory = ""
    for part in path.split("/"):
        out.append((directory, part))
        directory = f"{directory}/{part}" if directory else part
    return out


def _ancestors(key: str) -> list[str]:
    """The directories strictly above ``key`` (a marker ``a/b/`` is the directory ``a/b``): ``a``, ``a/b``
    for ``a/b/c``; the root is not one (it has no marker)."""
    parts = key.rstrip("/").split("/")[:-1]
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait until ``event`` is set or ``timeout`` passes; True if set. Unlike ``asyncio.wait_for`` on
    Python 3.11, a cancellation arriving as the event is set is never swallowed."""
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=timeout)
    finally:
        waiter.cancel()
    return event.is_set()


def describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if isinstance(exc, (CacheError, OSError)) else f"{type(exc).__name__}: {text}"


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


@dataclass(eq=False)
class Barrier:
    """Waits until every key's operation up to a seq is in the store (flush, write-through)."""

    remaining: dict[str, int]
    fail_fast: bool = False
    error: BaseException | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def settle(self, key: str) -> None:
        self.remaining.pop(key, None)
        if not self.remaining:
            self.done.set()


@dataclass
class WriteBackStats:
    commits: int = 0
    uploads: int = 0
    bytes_uploaded: int = 0
    deletes: int = 0
    markers: int = 0
    failed_attempts: int = 0
    space_waits: int = 0
    enospc: int = 0
    copy_on_write_bytes: int = 0  # bytes copied into staging from the store, or between versions
    promoted_bytes: int = 0  # uploaded bytes also put into the disk tier as clean blocks
    replayed: int = 0
    quarantined: int = 0


@dataclass
class FlushReport:
    ok: bool
    pending: list[dict[str, Any]]  # acknowledged changes not in the store yet (with stage and error)
    elapsed_s: float
    unsynced: list[dict[str, Any]] = field(default_factory=list)  # open files with unacknowledged writes


class KeyLocks:
    """One asyncio lock per key, created on demand and dropped when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, list[Any]] = {}  # key -> [lock, users]

    @contextlib.asynccontextmanager
    async def hold(self, *keys: str) -> AsyncIterator[None]:
        held: list[str] = []
        try:
            for key in sorted(set(keys)):  # one global order: no deadlock between two renames
                slot = self._locks.setdefault(key, [asyncio.Lock(), 0])
                slot[1] += 1
                try:
                    await slot[0].acquire()
                except BaseException:
                    self._drop(key)
                    raise
                held.append(key)
            yield
        finally:
            for key in reversed(held):
                self._locks[key][0].release()
                self._drop(key)

    def _drop(self, key: str) -> None:
        slot = self._locks[key]
        slot[1] -= 1
        if slot[1] == 0:
            del self._locks[key]


class WriteBack:
    def __init__(
        self,
        settings: WriteBackSettings,
        staging_root: Path,
        store: ObjectStore,
        cache: BlockCache,
        budget: SpaceBudget,
        *,
        eager_fraction: float = 0.95,
        clock: Clock | None = None,
        wall: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings
        self.staging = StagingDir(staging_root)
        self.store = store
        self.cache = cache
        self.budget = budget
        self.clock = clock or SystemClock()
        self.wall = wall
        self.rng = rng or random.Random()
        self.stats = WriteBackStats()
        # Called as on_applied(key, info) when an operation reached the store (info None: deleted).
        self.on_applied: Callable[[str, ObjectInfo | None], None] | None = None

        self._eager_bytes = int(budget.capacity_bytes * eager_fraction)
        self._reserve_chunk = min(RESERVE_CHUNK, max(FS_BLOCK, _round_up(budget.capacity_bytes // 64)))
        self._entries: dict[str, Entry] = {}
        self._files: dict[str, StagedFile] = {}  # live (attached, not disposed) staged files by key
        self._children: dict[str, set[str]] = {}  # directory -> keys of entries directly in it
        self._child_dirs: dict[str, Counter[str]] = {}  # directory -> child -> live entries below it
        self._pending_below: Counter[str] = Counter()  # directory -> entries anywhere below it
        self._recorded: set[str] = set()  # keys with a record on disk (RECORD_BYTES reserved each)
        self._ensured: OrderedDict[str, None] = OrderedDict()  # directories given a marker (ensure_dir)
        self._datafiles: set[DataFile] = set()
        self._seq = itertools.count(1)
        self._locks = KeyLocks()
        self._reserved = 0  # bytes this engine holds in the budget
        self._space_waiters = 0
        self._space_freed = asyncio.Event()
        self._barriers: set[Barrier] = set()
        self._heap: list[tuple[float, int, int, str]] = []
        self._heap_eager = False
        self._tiebreak = itertools.count()
        self._busy: set[str] = set()  # keys with a store operation in flight
        self._blocked: Counter[str] = Counter()  # keys whose operations must not start (see quiesce)
        self._claimed_below: Counter[str] = Counter()  # directory -> busy or blocked keys below it
        self._marker_puts: Counter[str] = Counter()  # directories whose marker put is in flight
        self._deferred: set[str] = set()  # keys held back by a marker put (see _overlaps_marker)
        self._idle = asyncio.Event()  # set whenever an operation finishes
        self._running: set[asyncio.Task[None]] = set()
        self._background: set[asyncio.Task[Any]] = set()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._store_failures = 0
        self._store_down_until = 0.0
        self._store_error: str | None = None
        self._stopping = False

    # ================================================================== life cycle
    async def start(self) -> None:
        """Replay the journal (before the mount: what it finds is visible and queued) and start uploading."""
        scan = await asyncio.to_thread(self.staging.scan)
        now = self.clock.monotonic()
        files = deletes = markers = 0
        staged_bytes = 0
        for record in scan.records:
            self._seq = itertools.count(max(record.seq + 1, next(self._seq)))
            entry = Entry(record.key, record.op, seq=record.seq, since=record.since or self.wall(),
                          may_exist=record.may_exist, ready_at=now)
            if record.op == PUT and not record.is_marker:
                assert record.data is not None
                fd = await asyncio.to_thread(self.staging.open_data, record.data)
                reserved = _round_up(record.size)
                await asyncio.to_thread(self.budget.reserve_space, reserved, force=True)
                self._reserved += reserved
                df = DataFile(record.data, fd, reserved, dir_synced=True)
                df.refs = 2  # current and acknowledged
                self._datafiles.add(df)
                sf = StagedFile(record.key, size=record.size, mtime=record.mtime, may_exist=record.may_exist,
                                current=df)
                sf.acked = Acked(df, record.size, record.crc32, record.seq)
                sf.crc_upto, sf.crc_value = record.size, record.crc32
                self._files[record.key] = sf
                entry.sf = sf
                files += 1
                staged_bytes += record.size
            elif record.op == PUT:
                markers += 1
            else:
                deletes += 1
            await asyncio.to_thread(self.budget.reserve_space, RECORD_BYTES, force=True)
            self._reserved += RECORD_BYTES
            self._recorded.add(record.key)
            self._put_entry(entry)
            self._push(entry)
        self.stats.replayed = len(scan.records)
        self.stats.quarantined = len(scan.quarantined)
        if scan.records or scan.quarantined or scan.removed_orphans:
            log.info("write-back: replayed the journal: %d staged files (%d bytes), %d deletes, %d directory "
                     "markers queued for upload; %d quarantined, %d unacknowledged data files removed",
                     files, staged_bytes, deletes, markers, len(scan.quarantined), scan.removed_orphans)
        self._loop_task = asyncio.get_running_loop().create_task(self._scheduler())

    async def stop(self) -> None:
        """Acknowledge what open files still hold, stop uploading; everything pending stays journaled."""
        self._stopping = True
        for sf in list(self._files.values()):
            if sf.unacked:
                try:
                    await self._commit_only(sf)
                except Exception as exc:  # noqa: BLE001 - keep stopping; the data of this file is lost
                    log.error("write-back: could not save %r at shutdown: %s", sf.key, describe(exc))
        tasks = [t for t in (self._loop_task, *self._running) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)
        for df in list(self._datafiles):
            self._close_fd(df)
        self._datafiles.clear()
        pending = sum(1 for e in self._entries.values() if e.seq is not None)
        if pending:
            log.warning("write-back: %d operations not yet in the store stay journaled in %s; the next mount "
                        "uploads them", pending, self.staging.root)

    # ================================================================== namespace view
    def file(self, key: str) -> StagedFile | None:
        """The live staged file of ``key``, if any."""
        return self._files.get(key)

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
            value = self.resolve(directory, name, entries.get(name, _MISSING))
            if value is not _MISSING:
                out[name] = value  # type: ignore[assignment]
        return out

    def resolve(self, directory: str, name: str, stored: object = _MISSING) -> object:
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
                return self.staged_info(entry.sf)
            return _MISSING
        return _MISSING if stored is None else stored

    @staticmethod
    def staged_info(sf: StagedFile) -> ObjectInfo:
        return ObjectInfo(key=sf.key or "", size=sf.size, etag=STAGED_ETAG, mtime=sf.mtime)

    def created_dir(self, path: str) -> bool:
        """Whether ``path`` is a directory made through the mount and not yet in the store."""
        entry = self._entries.get(path + "/")
        return entry is not None and entry.op == PUT

    def has_pending(self) -> bool:
        return bool(self._entries)

    # ================================================================== file data
    def stage(self, key: str, base: ObjectRef) -> StagedFile:
        """The staged file for modifying the store's ``base`` version of ``key`` (copied on first change)."""
        existing = self._files.get(key)
        if existing is not None:
            return existing
        sf = StagedFile(key, size=base.size, mtime=self.wall(), may_exist=True, base=base)
        self._files[key] = sf
        return sf

    async def create(self, key: str, *, may_exist: bool) -> StagedFile:
        """A new, empty staged file at ``key`` (creat, or O_TRUNC of a file in the store)."""
        old = self._files.get(key)
        if old is not None:
            # Truncate rather than replace: its acknowledged version must outlive the journal record
            # that names it, until the next acknowledgement replaces that record (I3). Held meanwhile,
            # so an upload finishing now cannot dispose of it.
            with self.held(old):
                await self.truncate(old, 0)
            return old
        async with self._locks.hold(key):
            entry = self._entries.get(key)
            may = (may_exist or key in self._busy
                   or (entry is not None and (entry.op == DELETE or entry.may_exist)))
            df = await self._new_data(0)
            sf = StagedFile(key, size=0, mtime=self.wall(), may_exist=may, current=df)
            self._files[key] = sf
            sf.unacked = True
            self._put_entry(Entry(key, PUT, sf=sf, since=self.wall(), may_exist=may))
        return sf

    async def write(self, sf: StagedFile, offset: int, data: bytes) -> int:
        """Write into a staged file. The caller holds it (``hold``), so it cannot be disposed of meanwhile."""
        async with sf.lock:
            _check_live(sf)
            try:
                if sf.current is None:
                    await self._materialize(sf, sf.size)
                if offset < sf.acked_region:
                    await self._fork(sf, sf.size)
                end = offset + len(data)
                assert sf.current is not None
                await self._grow(sf.current, max(sf.size, end))
                await asyncio.to_thread(sf.write_sync, offset, data)
            except BaseException:
                self._maybe_dispose(sf)
                raise
            sf.size = max(sf.size, end)
            self._modified(sf)
        return len(data)

    async def truncate(self, sf: StagedFile, size: int) -> None:
        async with sf.lock:
            _check_live(sf)
            try:
                if sf.current is None:
                    if size == 0:
                        sf.current = await self._new_data(0)
                        sf.base = None
                        sf.size = 0
                    else:
                        await self._materialize(sf, min(size, sf.size))
                if size < sf.acked_region:
                    await self._fork(sf, size)
                assert sf.current is not None
                if size > sf.size:
                    await self._grow(sf.current, size)
                if size != sf.size:
                    await asyncio.to_thread(sf.truncate_sync, size)
            except BaseException:
                self._maybe_dispose(sf)
                raise
            sf.size = size
            self._modified(sf)

    async def read(self, sf: StagedFile, offset: int, size: int) -> bytes | memoryview:
        df = sf.current
        if df is None:
            assert sf.base is not None
            return await self.cache.read(sf.base, offset, size)
        end = min(sf.size, offset + size)
        if offset >= end:
            return b""
        df.refs += 1  # an unlink or a new version must not close the descriptor under this read
        try:
            return await asyncio.to_thread(pread_exact, df.fd, end - offset, offset)
        finally:
            self._unref(df)

    def set_mtime(self, sf: StagedFile, mtime: float) -> None:
        """utimens on a staged file: shown until upload (the store sets its own LastModified)."""
        sf.mtime = mtime

    async def commit(self, sf: StagedFile) -> None:
        """Make the file's content durable (I1); with write-through, also wait for its upload."""
        seq = await self._commit_only(sf)
        if not self.settings.write_through or sf.detached:
            return
        entry = self._entries.get(sf.key or "")
        if seq is None and entry is not None and entry.sf is sf:
            seq = entry.seq  # acknowledged earlier (another handle, or fsync before close), not yet uploaded
        if seq is not None:
            await self._wait_uploaded(sf.key or "", seq)

    def commit_soon(self, sf: StagedFile) -> None:
        """Acknowledge in the background (the last handle went away without close() reaching us)."""
        if sf.unacked and not sf.detached:
            self._spawn(self._commit_quietly(sf))

    def hold(self, sf: StagedFile, count: int = 1) -> None:
        """Open handles hold a staged file: its data stays while they are open, and when the last one
        goes (``unhold``) anything not yet acknowledged is acknowledged in the background."""
        sf.holders += count

    @contextlib.contextmanager
    def held(self, sf: StagedFile) -> Iterator[None]:
        """Hold for the duration of one operation only: releasing it acknowledges nothing (an
        ``open(O_TRUNC)`` truncates before its handle exists, and must not acknowledge the empty file)."""
        sf.holders += 1
        try:
            yield
        finally:
            sf.holders -= 1
            if sf.holders == 0 and not sf.unacked:
                self._maybe_dispose(sf)

    def unhold(self, sf: StagedFile, count: int = 1) -> None:
        sf.holders = max(0, sf.holders - count)
        if sf.holders == 0:
            if sf.unacked and not sf.detached:
                self.commit_soon(sf)
            else:
                self._maybe_dispose(sf)

    # ================================================================== namespace operations
    async def remove(self, key: str, *, may_exist: bool) -> None:
        """unlink: the key is deleted in the store (if it may be there) and its staged data dropped."""
        async with self._locks.hold(key), self._frozen(key):
            sf = self._files.get(key)
            entry = self._entries.get(key)
            # Nothing staged or pending: the file is clean, so the store has it (whatever the caller saw
            # before an upload landed). Otherwise: whether an upload may have started, ever.
            may = (may_exist or key in self._busy or (sf is None and entry is None)
                   or (sf is not None and sf.may_exist)
                   or (entry is not None and (entry.op == DELETE or entry.may_exist)))
            if may:
                await self._journal(key, DELETE, since=entry.since if entry else None)
            else:
                await self._journal_drop(key)
            if sf is not None:
                self._detach(sf)
                self._maybe_dispose(sf)

    async def mkdir(self, path: str) -> None:
        key = path + "/"
        async with self._locks.hold(key):
            await self._journal(key, PUT)

    async def rmdir(self, path: str) -> None:
        key = path + "/"
        self._ensured.pop(path, None)
        async with self._locks.hold(key):
            await self._journal(key, DELETE)

    async def ensure_dir(self, path: str) -> None:
        """Keep directory ``path`` existing in the store once its last entry goes (a directory lives
        until rmdir): journal its marker, once per directory and mount, unless one is pending."""
        if not path or path in self._ensured:
            return
        entry = self._entries.get(path + "/")
        if entry is None or entry.op != PUT:
            await self.mkdir(path)
        self._ensured[path] = None
        if len(self._ensured) > MAX_ENSURED_DIRS:
            self._ensured.popitem(last=False)

    async def forget(self, key: str) -> None:
        """Drop any pending operation of ``key``: the store now holds what it should (a server-side copy)."""
        async with self._locks.hold(key), self._frozen(key):
            sf = self._files.get(key)
            await self._journal_drop(key)
            if sf is not None:
                self._detach(sf)
                self._maybe_dispose(sf)

    async def move(self, src: str, dst: str, *, dst_may_exist: bool) -> None:
        """rename of a staged file: its content is acknowledged and journaled under ``dst``, then ``src``
        is deleted (or forgotten, if the store never had it). A file with no staged content (opened
        for writing, never changed) is renamed in the store instead (``ValueError``)."""
        if src == dst:
            return
        sf = self._files.get(src)
        if sf is None:
            raise FileNotFoundError(errno.ENOENT, f"no staged file {src!r}")
        with self.held(sf):  # an upload landing meanwhile must not dispose of it
            await self._move(sf, src, dst, dst_may_exist)

    async def _move(self, sf: StagedFile, src: str, dst: str, dst_may_exist: bool) -> None:
        async with sf.lock:
            df, size = sf.current, sf.size
            if df is None:
                raise ValueError(f"{src!r} has no staged content: rename it in the store")
            # A rename acknowledges the file's content (as ext4 does for replace-by-rename): the
            # destination must never end up older than what the source held, or missing.
            crc = await asyncio.to_thread(self._sync_data, sf, df, size)
            async with self._locks.hold(src, dst), self._frozen(src, dst):
                if sf.key != src:
                    raise FileNotFoundError(errno.ENOENT, f"{src!r} was removed")
                dst_sf = self._files.get(dst)
                dst_entry = self._entries.get(dst)
                src_entry = self._entries.get(src)
                dst_may = (dst_may_exist or dst in self._busy or (dst_sf is None and dst_entry is None)
                           or (dst_sf is not None and dst_sf.may_exist)
                           or (dst_entry is not None and (dst_entry.op == DELETE or dst_entry.may_exist)))
                src_may = sf.may_exist or src in self._busy
                since = src_entry.since if src_entry is not None else self.wall()
                seq = next(self._seq)
                await self._write_record(Record(dst, PUT, seq, data=df.name, size=size, crc32=crc, mtime=sf.mtime,
                                                since=since, may_exist=dst_may))
                if src_may:
                    src_seq = next(self._seq)
                    await self._write_record(Record(src, DELETE, src_seq, since=since))
                    self._put_entry(Entry(src, DELETE, seq=src_seq, since=since, ready_at=self._ready_at()))
                else:
                    await self._remove_record(src, durable=True)
                    self._drop_entry(src)
                df.refs += 1
                old_acked, sf.acked = sf.acked, Acked(df, size, crc, seq)
                if old_acked is not None:
                    self._unref(old_acked.data)
                sf.unacked = False
                if dst_sf is not None and dst_sf is not sf:
                    self._detach(dst_sf)
                del self._files[src]
                sf.key = dst
                sf.may_exist = dst_may
                self._files[dst] = sf
                entry = Entry(dst, PUT, sf=sf, seq=seq, since=since, may_exist=dst_may, ready_at=self._ready_at())
                self._put_entry(entry)
                for barrier in list(self._barriers):
                    if src in barrier.remaining:
                        barrier.remaining[dst] = seq
                self._changed(src)
                self._changed(dst)
                self._push(self._entries.get(src))
                self._push(entry)
                if dst_sf is not None and dst_sf is not sf:
                    self._maybe_dispose(dst_sf)

    @contextlib.asynccontextmanager
    async def _frozen(self, *keys: str) -> AsyncIterator[None]:
        """No new store operation of ``keys`` starts inside (one already in flight shows in ``_busy``),
        so a decision taken on "may the store have it" cannot be overtaken by an upload starting."""
        for key in keys:
            self._block(key)
        try:
            yield
        finally:
            for key in keys:
                self._unblock(key)
                self._push(self._entries.get(key))

    @contextlib.asynccontextmanager
    async def quiesce(self, key: str) -> AsyncIterator[None]:
        """No store operation of ``key`` runs inside this block (one in flight is waited for)."""
        self._block(key)
        try:
            while key in self._busy or self._marker_put_above(key):
                self._idle.clear()
                await self._idle.wait()
            yield
        finally:
            self._unblock(key)
            self._push(self._entries.get(key))
            self._wake.set()

    def _block(self, key: str) -> None:
        self._blocked[key] += 1
        self._claim(key)

    def _unblock(self, key: str) -> None:
        self._blocked[key] -= 1
        if self._blocked[key] <= 0:
            del self._blocked[key]
        self._unclaim(key)
        self._release_deferred()

    # ================================================================== flush, status, stats
    async def flush(self, timeout_s: float, prefix: str = "") -> FlushReport:
        """Wait until every change acknowledged so far is in the store (or ``timeout_s`` passes).

        A barrier for acknowledged data only: bytes written to a file that has not been closed or
        fsync'd since are not acknowledged, and are neither uploaded nor waited for (uploading them
        would put a half-written file in the bucket); such files are reported in ``unsynced``.
        """
        started = time.monotonic()
        snapshot = {k: e.seq for k, e in self._entries.items() if e.seq is not None and k.startswith(prefix)}
        barrier = Barrier(dict(snapshot))
        self._barriers.add(barrier)
        try:
            for key in list(snapshot):
                self._check(barrier, key)
            if not barrier.remaining:
                barrier.done.set()
            self._kick(snapshot)
            await wait_event(barrier.done, max(0.0, timeout_s))
        finally:
            self._barriers.discard(barrier)
        pending = [status for key in sorted(barrier.remaining) if (status := self.status(key)) is not None]
        unsynced = [{"key": sf.key, "size": sf.size} for sf in self._files.values()
                    if sf.unacked and sf.key is not None and sf.key.startswith(prefix)]
        return FlushReport(ok=not pending, pending=pending, elapsed_s=time.monotonic() - started,
                           unsynced=sorted(unsynced, key=lambda u: u["key"]))

    def status(self, key: str) -> dict[str, Any] | None:
        """The durability stage of ``key``'s pending operation; None when there is none (clean)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.in_flight:
            stage = DELETING if entry.op == DELETE else UPLOADING
        elif entry.op == DELETE:
            stage = DELETING
        elif entry.seq is None:
            stage = WRITING
        else:
            stage = DIRTY
        out: dict[str, Any] = {
            "key": key,
            "stage": stage,
            "kind": "directory" if entry.is_marker else "file",
            "op": entry.op,
            "dirty_for_s": round(max(0.0, self.wall() - entry.since), 3),
            "attempts": entry.attempts,
            "last_error": entry.last_error,
        }
        if entry.last_error is None and self._store_failures and entry.seq is not None:
            out["last_error"] = f"waiting: the object store is unreachable ({self._store_error})"
        if entry.sf is not None:
            out["size"] = entry.sf.size
            out["unsynced"] = entry.sf.unacked
        if entry.seq is not None and not entry.in_flight:
            out["next_attempt_in_s"] = round(max(0.0, self._due(entry) - self.clock.monotonic()), 3)
        return out

    def pending(self, prefix: str = "") -> list[dict[str, Any]]:
        return [s for k in sorted(self._entries) if k.startswith(prefix) and (s := self.status(k)) is not None]

    def stats_snapshot(self) -> dict[str, Any]:
        files = [e for e in self._entries.values() if e.op == PUT and e.sf is not None]
        now = self.wall()
        oldest = min((e.since for e in self._entries.values()), default=None)
        last_error = next((e.last_error for e in sorted(self._entries.values(), key=lambda e: -e.attempts)
                           if e.last_error), None)
        s = self.stats
        return {
            "dirty_bytes": sum(e.sf.size for e in files if e.sf is not None),
            "dirty_files": len(files),
            "pending_deletes": sum(1 for e in self._entries.values() if e.op == DELETE),
            "pending_directories": sum(1 for e in self._entries.values() if e.is_marker and e.op == PUT),
            "pending_operations": len(self._entries),
            "unsynced_files": sum(1 for sf in self._files.values() if sf.unacked),
            "staged_bytes": self._reserved,
            "uploads_in_flight": len(self._running),
            "failed_attempts": s.failed_attempts,
            "files_uploaded": s.uploads,
            "bytes_uploaded": s.bytes_uploaded,
            "deletes_done": s.deletes,
            "directory_markers_done": s.markers,
            "commits": s.commits,
            "copy_on_write_bytes": s.copy_on_write_bytes,
            "cached_after_upload_bytes": s.promoted_bytes,
            "space_waits": s.space_waits,
            "space_waiters": self._space_waiters,
            "enospc_errors": s.enospc,
            "oldest_dirty_age_s": round(max(0.0, now - oldest), 3) if oldest is not None else 0.0,
            "store_state": "unreachable" if self._store_failures else "ok",
            "store_error": self._store_error,
            "last_error": last_error,
            "replayed": s.replayed,
            "quarantined": s.quarantined,
            "write_through": self.settings.write_through,
        }

    # ================================================================== entries and the overlay index
    def _put_entry(self, entry: Entry) -> None:
        old = self._entries.get(entry.key)
        if old is not None:
            self._index_remove(old)
            entry.since = min(entry.since, old.since) if old.since else entry.since
        self._entries[entry.key] = entry
        self._index_add(entry)
        self._changed(entry.key)

    def _drop_entry(self, key: str) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._index_remove(old)
        self._changed(key)

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
                    self._push(self._entries.get(directory + "/"))  # a waiting rmdir may go now
        if entry.op == PUT:
            for directory, child in levels[:-1]:
                counts = self._child_dirs.get(directory)
                if counts is not None:
                    counts[child] -= 1
                    if counts[child] <= 0:
                        del counts[child]
                    if not counts:
                        del self._child_dirs[directory]

    def _modified(self, sf: StagedFile) -> None:
        sf.unacked = True
        sf.clean_ref = None
        sf.mtime = self.wall()
        key = sf.key
        if key is None:
            return
        entry = self._entries.get(key)
        if entry is None or entry.sf is not sf:
            self._put_entry(Entry(key, PUT, sf=sf, since=self.wall(), may_exist=sf.may_exist))

    def _detach(self, sf: StagedFile) -> None:
        """The key no longer names this file (unlink, replaced): open handles keep its data alone."""
        if sf.key is not None and self._files.get(sf.key) is sf:
            del self._files[sf.key]
        sf.key = None
        if sf.acked is not None:
            data, sf.acked = sf.acked.data, None
            self._unref(data)

    def _promotable(self, acked: Acked, info: ObjectInfo) -> bool:
        disk = self.cache.disk
        return (disk is not None and 0 < acked.size <= PROMOTE_MAX_BYTES and info.size == acked.size
                and acked.size <= disk.capacity_bytes // 4 and not self._space_waiters)

    async def _promote(self, sf: StagedFile, acked: Acked, info: ObjectInfo) -> None:
        """Copy an uploaded version into the disk tier as clean blocks under its new ETag, so reading
        back what was just written needs no GET. Its acknowledged prefix stays copy-on-write meanwhile
        (``sf.acked`` is kept), so the blocks are exactly the uploaded bytes."""
        try:
            self.stats.promoted_bytes += await self.cache.promote(
                ObjectRef(info.key, info.etag, info.size), functools.partial(_read_range, acked.data.fd))
        except Exception as exc:  # noqa: BLE001 - a cache fill is an optimisation, never an error
            log.debug("write-back: could not cache the uploaded %r: %s", info.key, exc)
        finally:
            if sf.acked is acked:
                sf.acked = None
                self._unref(acked.data)
            self._unref(acked.data)
            self._maybe_dispose(sf)

    def _unload_clean(self) -> int:
        """Under space pressure: drop the staged copy of clean files still held open (their bytes are
        in the store; reads and a later write fetch them again). Files busy in a write are skipped."""
        freed = 0
        for sf in list(self._files.values()):
            ref = sf.clean_ref
            if ref is None or sf.unacked or sf.current is None or sf.lock.locked() or sf.key is None:
                continue
            entry = self._entries.get(sf.key)
            if entry is not None and entry.sf is sf:
                continue
            freed += sf.current.reserved
            self._unref(sf.current)
            sf.current, sf.base, sf.clean_ref = None, ref, None
            sf.crc_upto = sf.crc_value = 0
        return freed

    def _maybe_dispose(self, sf: StagedFile) -> None:
        """Drop a staged file's data once it is clean (or unlinked) and no handle is open."""
        if sf.disposed or sf.holders > 0:
            return
        if sf.key is not None:
            entry = self._entries.get(sf.key)
            if (entry is not None and entry.sf is sf) or sf.unacked:
                return
        sf.disposed = True
        if sf.key is not None and self._files.get(sf.key) is sf:
            del self._files[sf.key]
        for df in (sf.acked.data if sf.acked else None, sf.current):
            if df is not None:
                self._unref(df)
        sf.acked = None
        sf.current = None

    # ================================================================== journal
    def _ready_at(self) -> float:
        return self.clock.monotonic() + self.settings.upload_delay_s

    async def _journal(self, key: str, op: str, *, since: float | None = None) -> None:
        """Journal ``op`` (a delete, or a directory marker put) as ``key``'s pending operation."""
        old = self._entries.get(key)
        seq = next(self._seq)
        since = since if since is not None else (old.since if old is not None else self.wall())
        await self._write_record(Record(key, op, seq, since=since))
        entry = Entry(key, op, seq=seq, since=since, ready_at=self._ready_at())
        self._put_entry(entry)
        self._push(entry)

    async def _journal_drop(self, key: str) -> None:
        await self._remove_record(key, durable=True)
        self._drop_entry(key)

    async def _write_record(self, record: Record) -> None:
        new = record.key not in self._recorded
        if new:
            await self._reserve(RECORD_BYTES)
            self._recorded.add(record.key)
        try:
            await asyncio.to_thread(self.staging.write_record, record)
        except BaseException:
            if new:
                self._recorded.discard(record.key)
                self._release(RECORD_BYTES)
            raise

    async def _remove_record(self, key: str, *, durable: bool = False) -> None:
        if key not in self._recorded:
            return
        remove = self.staging.remove_record_durably if durable else self.staging.remove_record
        await asyncio.to_thread(remove, key)
        self._recorded.discard(key)
        self._release(RECORD_BYTES)

    async def _commit_only(self, sf: StagedFile) -> int | None:
        async with sf.lock:
            return await self._commit_locked(sf)

    async def _commit_quietly(self, sf: StagedFile) -> None:
        try:
            await self._commit_only(sf)
        except Exception as exc:  # noqa: BLE001 - no caller to report to: the log is the report
            log.error("write-back: could not save %r to local disk after its last close: %s", sf.key, describe(exc))
        self._maybe_dispose(sf)

    async def _commit_locked(self, sf: StagedFile) -> int | None:
        if not sf.unacked or sf.disposed:
            return None
        if sf.key is None or sf.current is None:
            sf.unacked = False
            return None
        df, size = sf.current, sf.size
        crc = await asyncio.to_thread(self._sync_data, sf, df, size)
        key = sf.key
        async with self._locks.hold(key):
            if sf.key != key:
                return None  # unlinked or renamed while syncing: that operation journaled the outcome
            entry = self._entries.get(key)
            since = entry.since if entry is not None else self.wall()
            seq = next(self._seq)
            await self._write_record(Record(key, PUT, seq, data=df.name, size=size, crc32=crc, mtime=sf.mtime,
                                            since=since, may_exist=sf.may_exist))
            df.refs += 1
            old, sf.acked = sf.acked, Acked(df, size, crc, seq)
            if old is not None:
                self._unref(old.data)
            sf.unacked = False
            if entry is None or entry.sf is not sf:
                entry = Entry(key, PUT, sf=sf, since=since, may_exist=sf.may_exist)
                self._put_entry(entry)
            entry.seq = seq
            entry.ready_at = self._ready_at()
            entry.retry_at = 0.0
            entry.attempts = 0
            self._changed(key)
            self._push(entry)
        self._trim(df, size)
        self.stats.commits += 1
        return seq

    def _sync_data(self, sf: StagedFile, df: DataFile, size: int) -> int:
        """fsync the data (and, once, its directory entry); the CRC-32 of its ``size`` bytes."""
        os.fsync(df.fd)
        if not df.dir_synced:
            self.staging.sync_data_dir()
            df.dir_synced = True
        if sf.crc_upto < size:
            sf.crc_value = crc_range(df.fd, sf.crc_upto, size, sf.crc_value)
            sf.crc_upto = size
        return sf.crc_value

    # ================================================================== data files and space
    async def _new_data(self, size: int) -> DataFile:
        reserved = _round_up(size)
        await self._reserve(reserved)
        try:
            name, fd = await asyncio.to_thread(self.staging.create_data)
        except BaseException:
            self._release(reserved)
            raise
        df = DataFile(name, fd, reserved)
        self._datafiles.add(df)
        return df

    async def _grow(self, df: DataFile, length: int) -> None:
        need = _round_up(length) - df.reserved
        if need <= 0:
            return
        chunk = max(need, self._reserve_chunk)
        if chunk > need and await self._try_reserve(chunk):
            df.reserved += chunk
            return
        await self._reserve(need)
        df.reserved += need

    def _trim(self, df: DataFile, size: int) -> None:
        keep = _round_up(size)
        if df.reserved > keep:
            self._release(df.reserved - keep)
            df.reserved = keep

    async def _try_reserve(self, nbytes: int) -> bool:
        if not await asyncio.to_thread(self.budget.reserve_space, nbytes):
            return False
        before = self._reserved
        self._reserved += nbytes
        if before < self._eager_bytes <= self._reserved:
            self._wake.set()  # past the high watermark: upload without the coalescing delay
        return True

    async def _reserve(self, nbytes: int) -> None:
        """Reserve ``nbytes`` of staging space, waiting for uploads to free some (I6); ENOSPC after the wait."""
        if nbytes <= 0:
            return
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        try:
            while True:
                freed = self._space_freed
                if await self._try_reserve(nbytes):
                    return
                if deadline is None:
                    deadline = loop.time() + self.settings.space_wait_s
                    self._space_waiters += 1
                    self.stats.space_waits += 1
                    self._wake.set()  # eager uploads
                    log.info("write-back: staging space is full (%d bytes staged); a writer waits for uploads",
                             self._reserved)
                    self._unload_clean()
                remaining = deadline - loop.time()
                if remaining <= 0:
                    self.stats.enospc += 1
                    pending = sum(1 for e in self._entries.values() if e.seq is not None)
                    message = (f"write-back staging is full: {self._reserved} of {self.budget.capacity_bytes} bytes "
                               f"of the disk cache are staged data waiting for upload ({pending} operations pending"
                               f"{', the store is unreachable' if self._store_failures else ''}); "
                               f"refusing {nbytes} more bytes after waiting {self.settings.space_wait_s:g} s")
                    log.error("%s (ENOSPC)", message)
                    raise OSError(errno.ENOSPC, message)
                # Poll too: space also comes back by routes that do not signal (cache evictions).
                await wait_event(freed, min(remaining, 1.0))
        finally:
            if deadline is not None:
                self._space_waiters -= 1

    def _release(self, nbytes: int) -> None:
        if nbytes <= 0:
            return
        self.budget.release_space(nbytes)
        self._reserved -= nbytes
        freed, self._space_freed = self._space_freed, asyncio.Event()
        freed.set()

    def _unref(self, df: DataFile) -> None:
        df.refs -= 1
        if df.refs == 0:
            self._datafiles.discard(df)
            self._spawn(self._destroy(df))

    async def _destroy(self, df: DataFile) -> None:
        def close_and_unlink() -> None:
            self._close_fd(df)
            self.staging.unlink_data(df.name)

        try:
            await asyncio.to_thread(close_and_unlink)
        except OSError as exc:
            log.warning("write-back: cannot remove staged data file %s: %s", df.name, exc)
        self._release(df.reserved)
        df.reserved = 0

    @staticmethod
    def _close_fd(df: DataFile) -> None:
        if df.fd >= 0:
            fd, df.fd = df.fd, -1
            with contextlib.suppress(OSError):
                os.close(fd)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _materialize(self, sf: StagedFile, upto: int) -> None:
        """Copy the first ``upto`` bytes of the store version into a new data file (first modification)."""
        base = sf.base
        assert base is not None
        df = await self._new_data(upto)
        block = self.cache.block_size
        count = -(-upto // block)
        crc = 0
        try:
            for first in range(0, count, MATERIALIZE_WINDOW):
                indexes = range(first, min(count, first + MATERIALIZE_WINDOW))
                blocks = await asyncio.gather(*(self.cache.get_block(base, i) for i in indexes))
                parts = []
                for index, data in zip(indexes, blocks):
                    want = min(block, upto - index * block)
                    if len(data) < want:
                        raise ObjectStoreError(f"short block {index} of {base.key!r} while copying it into staging")
                    parts.append(data[:want])
                chunk = b"".join(parts)
                crc = await asyncio.to_thread(_write_crc, df.fd, chunk, first * block, crc)
        except BaseException:
            self._unref(df)
            raise
        self.stats.copy_on_write_bytes += upto
        sf.current, sf.base, sf.size = df, None, upto
        sf.crc_upto, sf.crc_value = upto, crc

    async def _fork(self, sf: StagedFile, keep: int) -> None:
        """Copy-on-write: continue in a copy of the current data file's first ``keep`` bytes (I3)."""
        old = sf.current
        assert old is not None
        df = await self._new_data(keep)
        try:
            await asyncio.to_thread(copy_range, old.fd, df.fd, keep)
        except BaseException:
            self._unref(df)
            raise
        self.stats.copy_on_write_bytes += keep
        sf.reset_crc(keep)
        sf.current = df
        self._unref(old)

    # ================================================================== uploading
    def _eager(self) -> bool:
        return self._space_waiters > 0 or self._reserved >= self._eager_bytes

    def _due(self, entry: Entry) -> float:
        if self._heap_eager:
            return entry.retry_at
        return max(entry.ready_at, entry.retry_at)

    def _push(self, entry: Entry | None) -> None:
        """Queue ``entry`` for its store operation (if it is journaled and not already running)."""
        if entry is None or entry.seq is None or entry.in_flight:
            return
        entry.due = self._due(entry)
        heapq.heappush(self._heap, (entry.due, entry.seq, next(self._tiebreak), entry.key))
        self._wake.set()

    def _rebuild(self) -> None:
        self._heap_eager = self._eager()
        self._heap = []
        for entry in self._entries.values():
            if entry.seq is not None and not entry.in_flight:
                entry.due = self._due(entry)
                self._heap.append((entry.due, entry.seq, next(self._tiebreak), entry.key))
        heapq.heapify(self._heap)

    def _kick(self, keys: dict[str, int] | None = None) -> None:
        """Flush and write-through: no coalescing delay, no backoff, for ``keys`` (all if None)."""
        now = self.clock.monotonic()
        for key in (keys if keys is not None else list(self._entries)):
            entry = self._entries.get(key)
            if entry is not None:
                entry.ready_at = min(entry.ready_at, now)
                entry.retry_at = min(entry.retry_at, now)
        self._store_down_until = 0.0
        self._rebuild()
        self._wake.set()

    async def _scheduler(self) -> None:
        while not self._stopping:
            self._wake.clear()
            wait = self._start_ready()
            await wait_event(self._wake, wait)

    def _start_ready(self) -> float | None:
        """Start what is due, up to the concurrency limit; seconds until the next one is due."""
        if self._eager() != self._heap_eager:
            self._rebuild()
        now = self.clock.monotonic()
        if self._store_down_until > now:
            return self._store_down_until - now
        while self._heap and len(self._running) < self.settings.max_uploads:
            due, seq, _, key = self._heap[0]
            if due > now:
                return due - now
            heapq.heappop(self._heap)
            entry = self._entries.get(key)
            if entry is None or entry.seq != seq or entry.in_flight or entry.due != due:
                continue  # stale: replaced, re-queued or running
            if key in self._busy or key in self._blocked:
                continue  # re-queued when the key is free (see _finish, quiesce)
            if entry.is_marker and entry.op == DELETE and self._pending_below.get(entry.path, 0) > 0:
                continue  # rmdir waits for everything below (re-queued by _index_remove)
            if self._overlaps_marker(entry):
                self._deferred.add(key)  # re-queued when an operation ends (_finish_op)
                continue
            entry.in_flight = True
            self._busy.add(key)
            self._claim(key)
            if entry.is_marker and entry.op == PUT:
                self._marker_puts[entry.path] += 1
            task = asyncio.get_running_loop().create_task(self._run(entry, seq))
            self._running.add(task)
            task.add_done_callback(self._running.discard)
        return None

    async def _run(self, entry: Entry, seq: int) -> None:
        key = entry.key
        error: BaseException | None = None
        info: ObjectInfo | None = None
        try:
            info = await self._perform(entry)
        except asyncio.CancelledError:
            entry.in_flight = False
            self._finish_op(entry)
            raise
        except Exception as exc:  # noqa: BLE001 - every failure is retried and reported
            error = exc
        try:
            if error is None:
                await self._applied(entry, seq, info)
            else:
                self._failed(entry, seq, error)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - bookkeeping must not kill the uploader
            log.exception("write-back: bookkeeping after the store operation on %r failed", key)
        finally:
            entry.in_flight = False
            self._finish_op(entry)
            self._idle.set()
            self._push(self._entries.get(key))
            self._wake.set()

    def _finish_op(self, entry: Entry) -> None:
        self._busy.discard(entry.key)
        self._unclaim(entry.key)
        if entry.is_marker and entry.op == PUT:
            self._marker_puts[entry.path] -= 1
            if self._marker_puts[entry.path] <= 0:
                del self._marker_puts[entry.path]
        self._release_deferred()

    def _release_deferred(self) -> None:
        deferred, self._deferred = self._deferred, set()
        for key in deferred:
            self._push(self._entries.get(key))

    # A directory marker put never runs at the same time as a store operation on a key below that
    # directory. Stores that keep a real directory tree (SeaweedFS's filer) create a key's parent
    # directories as they write it, and a marker put racing with that creation can be lost (measured
    # on SeaweedFS: about 1 concurrent pair in 60): the directory then lives only as long as
    # something is below it. Markers are tiny, so serialising them with the writes below costs nothing.
    def _overlaps_marker(self, entry: Entry) -> bool:
        if entry.is_marker and entry.op == PUT and self._claimed_below.get(entry.path, 0) > 0:
            return True
        return self._marker_put_above(entry.key)

    def _marker_put_above(self, key: str) -> bool:
        return bool(self._marker_puts) and any(d in self._marker_puts for d in _ancestors(key))

    def _claim(self, key: str) -> None:
        for directory in _ancestors(key):
            self._claimed_below[directory] += 1

    def _unclaim(self, key: str) -> None:
        for directory in _ancestors(key):
            self._claimed_below[directory] -= 1
            if self._claimed_below[directory] <= 0:
                del self._claimed_below[directory]

    async def _perform(self, entry: Entry) -> ObjectInfo | None:
        if entry.op == DELETE:
            await self.store.delete(entry.key)
            return None
        sf = entry.sf
        if sf is None:  # a directory marker
            return await self.store.put(entry.key, 0, _empty)
        acked = sf.acked
        if acked is None:
            raise ObjectStoreError(f"internal: {entry.key!r} has no acknowledged version to upload")
        df = acked.data
        df.refs += 1
        sf.may_exist = True  # from now on the store may hold it, whatever happens
        try:
            return await self.store.put(entry.key, acked.size, functools.partial(_read_range, df.fd))
        finally:
            self._unref(df)

    async def _applied(self, entry: Entry, seq: int, info: ObjectInfo | None) -> None:
        key = entry.key
        async with self._locks.hold(key):
            if self._store_failures:
                log.info("write-back: the object store is reachable again; %d operations pending",
                         sum(1 for e in self._entries.values() if e.seq is not None))
            self._store_failures = 0
            self._store_error = None
            self._store_down_until = 0.0
            if entry.op == DELETE:
                self.stats.deletes += 1
            elif entry.sf is None:
                self.stats.markers += 1
            else:
                self.stats.uploads += 1
                self.stats.bytes_uploaded += info.size if info is not None else 0
            if entry.attempts:
                log.info("write-back: %s %r succeeded after %d failed attempts", entry.op, key, entry.attempts)
            if self._entries.get(key) is entry and entry.seq == seq:
                # Durably: the data file it names may be modified in place or removed from now on.
                await self._remove_record(key, durable=True)
                sf = entry.sf
                if sf is not None and sf.unacked:
                    # Written again since: the uploaded version is safe, the new bytes are not yet.
                    fresh = Entry(key, PUT, sf=sf, since=self.wall(), may_exist=True)
                    self._drop_entry(key)
                    self._put_entry(fresh)
                else:
                    self._drop_entry(key)
                if sf is not None and sf.acked is not None:
                    acked = sf.acked
                    if info is not None and self._promotable(acked, info):
                        acked.data.refs += 1
                        self._spawn(self._promote(sf, acked, info))  # drops the protection when done
                    else:
                        sf.acked = None  # in the store now: may be modified in place
                        self._unref(acked.data)
                if sf is not None and not sf.unacked and info is not None and info.size == sf.size:
                    sf.clean_ref = ObjectRef(key, info.etag, info.size)
                if sf is not None:
                    self._maybe_dispose(sf)
                    if self._space_waiters:
                        self._unload_clean()
            for barrier in list(self._barriers):
                if barrier.remaining.get(key, seq + 1) <= seq:
                    barrier.settle(key)
            if self.on_applied is not None:
                # In the same step as the overlay entry going away: no view ever shows the old version.
                try:
                    self.on_applied(key, info)
                except Exception:  # noqa: BLE001 - a view refresh must not undo an upload
                    log.exception("write-back: updating the view after %s %r failed", entry.op, key)

    def _failed(self, entry: Entry, seq: int, error: BaseException) -> None:
        key = entry.key
        now = self.clock.monotonic()
        self.stats.failed_attempts += 1
        text = describe(error)
        entry.attempts += 1
        entry.last_error = text
        if isinstance(error, ObjectStoreUnavailableError):
            self._store_failures += 1
            delay = self._backoff(self._store_failures, STORE_PROBE_CAP_S)
            self._store_down_until = now + delay
            entry.retry_at = self._store_down_until
            if self._store_failures == 1:
                log.warning("write-back: the object store is unreachable (%s); writes keep going to staging, "
                            "%d operations pending, retrying in %.1f s", text,
                            sum(1 for e in self._entries.values() if e.seq is not None), delay)
            self._store_error = text
        else:
            delay = self._backoff(entry.attempts)
            entry.retry_at = now + delay
            level = logging.WARNING if entry.attempts == 1 else logging.DEBUG
            if not isinstance(error, (ObjectStoreError, OSError)):
                log.error("write-back: %s %r failed unexpectedly", entry.op, key, exc_info=error)
            else:
                log.log(level, "write-back: %s %r failed (attempt %d): %s; retrying in %.1f s",
                        entry.op, key, entry.attempts, text, delay)
        for barrier in list(self._barriers):
            if barrier.fail_fast and barrier.remaining.get(key, seq + 1) <= seq:
                barrier.error = error
                barrier.done.set()

    def _backoff(self, attempts: int, cap: float = UPLOAD_BACKOFF_CAP_S) -> float:
        step = min(cap, UPLOAD_BACKOFF_BASE_S * 2 ** min(attempts - 1, 30))
        return step * self.rng.uniform(0.5, 1.0)

    # ================================================================== barriers
    def _changed(self, key: str) -> None:
        for barrier in list(self._barriers):
            if key in barrier.remaining:
                self._check(barrier, key)

    def _check(self, barrier: Barrier, key: str) -> None:
        entry = self._entries.get(key)
        if entry is None or entry.seq is None:
            barrier.settle(key)  # applied, dropped, or superseded by writes not yet acknowledged

    async def _wait_uploaded(self, key: str, seq: int) -> None:
        barrier = Barrier({key: seq}, fail_fast=True)
        self._barriers.add(barrier)
        try:
            self._check(barrier, key)
            self._kick({key: seq})
            await barrier.done.wait()
        finally:
            self._barriers.discard(barrier)
        if barrier.error is not None:
            kind = UploadAccessDeniedError if isinstance(barrier.error, AccessDeniedError) else UploadError
            raise kind(f"upload of {key!r} failed: {describe(barrier.error)} (the data stays staged and is "
                       "retried)") from barrier.error

    def poke(self) -> None:
        """Re-evaluate what is due now (after a clock jump in tests, or a store known to be back)."""
        self._wake.set()

    # ================================================================== introspection for tests
    def entries(self) -> Iterator[Entry]:
        return iter(list(self._entries.values()))


def _check_live(sf: StagedFile) -> None:
    if sf.disposed:
        raise OSError(errno.ESTALE, f"staged file {sf.key!r} was dropped (clean and not held)")


def _empty(start: int, end: int) -> bytes:
    return b""


def _read_range(fd: int, start: int, end: int) -> bytes:
    data = pread_exact(fd, end - start, start)
    if len(data) != end - start:
        raise OSError(errno.EIO, f"staged data file is shorter than its acknowledged size ({start + len(data)})")
    return data


def _write_crc(fd: int, data: bytes, offset: int, crc: int) -> int:
    pwrite_all(fd, data, offset)
    return crc32(data, crc)
