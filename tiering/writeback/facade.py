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

Collaborators
-------------
``WriteBack`` is a facade over objects that each own one piece of state, with a small interface:
``PendingIndex`` (``index``: every key's pending operation and the namespace overlay ``merge``/
``resolve`` built on them), ``Records`` (``records``: the journal's acknowledgements on disk),
``DataFiles`` (``datafiles``: staged data files, their descriptors and copies), ``StagingSpace``
(``space``: reservations in the budget and writers' back-pressure), ``Uploader`` (``uploader``:
scheduling, retries and barriers; it knows nothing of staged files, it is handed entries and calls
``_perform``/``_applied`` back) and ``Directories``/``MarkerOrder`` (``markers``: every rule about
directory markers). What stays here is the staged file's life cycle (create, write, commit, move,
unlink, dispose) and what joins the pieces: a pending operation's record, entry and queueing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Coroutine

from tiering.blocks import ObjectRef
from tiering.clock import Clock, SystemClock
from tiering.engine.blockcache import BlockCache
from tiering.errors import AccessDeniedError, CacheError, ObjectStoreError
from tiering.objectstore.mtimes import mtime_metadata
from tiering.protocols import ObjectInfo, ObjectStore, SpaceBudget
from tiering.storehealth import StoreHealth
from tiering.writeback.datafiles import DataFiles
from tiering.writeback.durable import DurabilityError, DurableJournal, conditional
from tiering.writeback.files import StagedFiles, read_range
from tiering.writeback.events import KeyLocks, describe, wait_event
from tiering.writeback.journal import DELETE, PUT, Record, StagingDir, pread_exact
from tiering.writeback.markers import Directories, MarkerOrder
from tiering.writeback.pending import MISSING, STAGED_ETAG, Entry, PendingIndex
from tiering.writeback.records import Records
from tiering.writeback.report import backlog_text, entry_status, stats_document
from tiering.writeback.settings import WriteBackSettings
from tiering.writeback.space import StagingSpace
from tiering.writeback.staged import Acked, StagedFile
from tiering.writeback.stats import WriteBackStats
from tiering.writeback.uploader import Uploader

__all__ = ["MISSING", "STAGED_ETAG", "FlushReport", "UploadError", "UploadAccessDeniedError", "WriteBack",
           "WriteBackStats"]

log = logging.getLogger("tiering.writeback")



class UploadError(CacheError):
    """A write-through upload failed; close() or fsync() report it (the data stays staged)."""

    errno = errno.EIO


class UploadAccessDeniedError(UploadError):
    errno = errno.EACCES


@dataclass
class FlushReport:
    ok: bool
    pending: list[dict[str, Any]]  # acknowledged changes not in the store yet (with stage and error)
    elapsed_s: float
    unsynced: list[dict[str, Any]] = field(default_factory=list)  # open files with unacknowledged writes


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
        health: StoreHealth | None = None,
        durable: DurableJournal | None = None,  # --write-durability cluster (``records``, ``durable``)
    ) -> None:
        self.settings = settings
        self.staging = StagingDir(staging_root)
        self.store, self.cache, self.budget = store, cache, budget
        self.clock, self.wall = clock or SystemClock(), wall
        self.stats = WriteBackStats()
        # Called as on_applied(key, info) when an operation reached the store (info None: deleted).
        self.on_applied: Callable[[str, ObjectInfo | None], None] | None = None

        self._locks = KeyLocks()
        self._background: set[asyncio.Task[Any]] = set()
        self.index = PendingIndex(on_dir_clear=lambda path: self.uploader.push(self.index.get(path + "/")))
        self.order = MarkerOrder(self.index)
        self.space = StagingSpace(
            budget, self.stats, eager_fraction=eager_fraction, space_wait_s=lambda: self.settings.space_wait_s,
            wake=lambda: self.uploader.wake(), on_full=lambda: self.files.unload_clean(),
            backlog=lambda: backlog_text(self.index, self.uploader))
        self.records = Records(self.staging, self.space, durable)
        self.datafiles = DataFiles(self.staging, self.space, cache, self.stats, self._spawn)
        self.files = StagedFiles(self.index, self.datafiles, cache, self.stats, lambda: self.space.waiters)
        self.uploader = Uploader(
            self.index, self.order, self.stats, settings=lambda: self.settings, clock=self.clock,
            rng=rng or random.Random(), eager=self.space.eager, perform=self._perform, applied=self._applied,
            health=health)
        self.markers = Directories(self.index, self._journal_locked)

    # ================================================================== life cycle
    async def start(self) -> None:
        """Replay the journal (before the mount: what it finds is visible and queued) and start uploading."""
        scan = await self.records.replay()  # the scan (and the journal's copy in the cluster store, if any)
        now = self.clock.monotonic()
        files = deletes = markers = 0
        staged_bytes = 0
        for record in scan.records:
            entry = Entry(record.key, record.op, seq=record.seq, since=record.since or self.wall(),
                          may_exist=record.may_exist, ready_at=now, acked_at=now)
            if record.op == PUT and not record.is_marker:
                assert record.data is not None
                df = await self.datafiles.adopt(record.data, record.size)
                df.refs = 2  # current and acknowledged
                sf = StagedFile(record.key, size=record.size, mtime=record.mtime, may_exist=record.may_exist,
                                current=df)
                sf.acked = Acked(df, record.size, record.crc32, record.seq, record.mtime)
                sf.crc_upto, sf.crc_value = record.size, record.crc32
                self.files.add(sf)
                entry.sf = sf
                files += 1
                staged_bytes += record.size
            elif record.op == PUT:
                markers += 1
            else:
                deletes += 1
            await self.records.adopt(record)
            self._put_entry(entry)
            self.uploader.push(entry)
        self.stats.replayed = len(scan.records)
        self.stats.quarantined = len(scan.quarantined)
        if scan.records or scan.quarantined or scan.removed_orphans:
            log.info("write-back: replayed the journal: %d staged files (%d bytes), %d deletes, %d directory "
                     "markers queued for upload; %d quarantined, %d unacknowledged data files removed",
                     files, staged_bytes, deletes, markers, len(scan.quarantined), scan.removed_orphans)
        self.uploader.start()

    async def acknowledge_open(self) -> None:
        """Acknowledge what open files still hold (the session is gone: no writer can close them now)."""
        for sf in list(self.files):
            if sf.unacked:
                try:
                    await self._commit_only(sf)
                except Exception as exc:  # noqa: BLE001 - keep stopping; the data of this file is lost
                    log.error("write-back: could not save %r at shutdown: %s", sf.key, describe(exc))

    async def stop(self) -> None:
        """Acknowledge what open files hold, stop uploading; what is pending stays journaled."""
        await self.acknowledge_open()
        await self.uploader.stop()
        if self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)
        await self.records.close_durable(drained=not self.index.journaled())
        self.datafiles.close_all()
        pending = self.index.journaled()
        if pending:
            log.info("write-back: %d operations not yet in the store stay journaled in %s; the next mount "
                     "uploads them", pending, self.staging.root)

    # ================================================================== namespace view
    def file(self, key: str) -> StagedFile | None:
        """The live staged file of ``key``, if any."""
        return self.files.get(key)

    def merge(self, directory: str, entries: dict[str, ObjectInfo | None]) -> dict[str, ObjectInfo | None]:
        """``entries`` (a store listing of ``directory``) with the pending operations overlaid."""
        return self.index.merge(directory, entries)

    def resolve(self, directory: str, name: str, stored: object = MISSING) -> object:
        """``name`` in ``directory`` once the pending operations apply (see ``PendingIndex.resolve``)."""
        return self.index.resolve(directory, name, stored)

    def created_dir(self, path: str) -> bool:
        """Whether ``path`` is a directory made through the mount and not yet in the store."""
        return self.index.created_dir(path)

    def has_pending(self) -> bool:
        return bool(len(self.index))
    # ================================================================== file data
    def stage(self, key: str, base: ObjectRef) -> StagedFile:
        """The staged file for modifying the store's ``base`` version of ``key`` (copied on first change)."""
        existing = self.files.get(key)
        if existing is not None:
            return existing
        sf = StagedFile(key, size=base.size, mtime=self.wall(), may_exist=True, base=base)
        self.files.add(sf)
        self.records.note_base(key, base.etag)
        return sf

    async def create(self, key: str, *, may_exist: bool, base_etag: str | None = None) -> StagedFile:
        """A new, empty staged file at ``key`` (creat, or O_TRUNC of a file in the store)."""
        old = self.files.get(key)
        if old is not None:
            # Truncate rather than replace: its acknowledged version must outlive the journal record
            # that names it, until the next acknowledgement replaces that record (I3). Held meanwhile,
            # so an upload finishing now cannot dispose of it.
            with self.held(old):
                await self.truncate(old, 0)
            return old
        async with self._locks.hold(key):
            entry = self.index.get(key)
            self.records.note_base(key, base_etag if entry is None else None)
            may = (may_exist or self.uploader.busy(key)
                   or (entry is not None and (entry.op == DELETE or entry.may_exist)))
            df = await self.datafiles.new(0)
            sf = StagedFile(key, size=0, mtime=self.wall(), may_exist=may, current=df)
            self.files.add(sf)
            sf.unacked = True
            self._put_entry(Entry(key, PUT, sf=sf, since=self.wall(), may_exist=may))
        return sf

    async def write(self, sf: StagedFile, offset: int, data: bytes) -> int:
        """Write into a staged file. The caller holds it (``hold``), so it cannot be disposed of meanwhile."""
        async with sf.lock:
            _check_live(sf)
            try:
                if sf.current is None:
                    await self.datafiles.materialize(sf, sf.size)
                if offset < sf.acked_region:
                    await self.datafiles.fork(sf, sf.size)
                end = offset + len(data)
                assert sf.current is not None
                await self.datafiles.wrote(sf.current, offset, end, max(sf.size, end))
                await asyncio.to_thread(sf.write_sync, offset, data)
            except BaseException as exc:
                self.files.maybe_dispose(sf)
                if isinstance(exc, OSError):
                    self.datafiles.note_write_error(sf.key, exc)
                raise
            sf.size = max(sf.size, end)
            self._modified(sf)
        self.datafiles.disk_full_logged = False
        return len(data)

    async def truncate(self, sf: StagedFile, size: int) -> None:
        async with sf.lock:
            _check_live(sf)
            try:
                if sf.current is None:
                    if size == 0:
                        sf.current = await self.datafiles.new(0)
                        sf.base = None
                        sf.size = 0
                    else:
                        await self.datafiles.materialize(sf, min(size, sf.size))
                if size < sf.acked_region:
                    await self.datafiles.fork(sf, size)
                assert sf.current is not None
                if size != sf.size:  # an extension is a hole: nothing to reserve (see ``datafiles``)
                    await asyncio.to_thread(sf.truncate_sync, size)
                    self.datafiles.truncated(sf.current, size)
            except BaseException:
                self.files.maybe_dispose(sf)
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
            self.datafiles.unref(df)

    async def set_mtime(self, sf: StagedFile, mtime: float) -> None:
        """utimens on a file with staged changes: its mtime goes to the store with its bytes (``send``),
        so it is acknowledged like a write: by the next close or fsync of a file being written, else now."""
        async with sf.lock:
            _check_live(sf)
            sf.mtime = mtime
            if sf.current is not None and (sf.holders == 0 or not sf.unacked):
                sf.unacked = True
                await self._commit_locked(sf)

    async def commit(self, sf: StagedFile) -> None:
        """Make the file's content durable (I1); with write-through, also wait for its upload. Fails
        at once while a cluster store that timed out on this unchanged file stays silent (``Records``)."""
        self.records.check_not_stalled(sf)
        try:
            seq = await self._commit_only(sf)
        except Exception as exc:
            sf.commit_failed = True  # the writer was told: when it is gone, the file reverts (``_revert``)
            self.records.note_failure(sf, exc)
            raise
        sf.commit_failed = False
        sf.timed_out = None
        if not self.settings.write_through or sf.detached:
            return
        entry = self.index.get(sf.key or "")
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

    def held(self, sf: StagedFile) -> contextlib.AbstractContextManager[None]:
        return self.files.held(sf)

    def unhold(self, sf: StagedFile, count: int = 1) -> None:
        sf.holders = max(0, sf.holders - count)
        if sf.holders == 0:
            if sf.unacked and not sf.detached:
                self.commit_soon(sf)
            else:
                self.files.maybe_dispose(sf)

    # ================================================================== namespace operations
    async def remove(self, key: str, *, may_exist: bool, base_etag: str | None = None) -> None:
        """unlink: the key is deleted in the store (if it may be there) and its staged data dropped."""
        await self.files.keep_for_handles(key)  # before the delete lands (and not under the key's lock)
        async with self._locks.hold(key), self.uploader.frozen(key):
            sf = self.files.get(key)
            entry = self.index.get(key)
            self.records.note_base(key, base_etag if sf is None and entry is None else None)
            # Nothing staged or pending: the file is clean, so the store has it (whatever the caller saw
            # before an upload landed). Otherwise: whether an upload may have started, ever.
            may = (may_exist or self.uploader.busy(key) or (sf is None and entry is None)
                   or (sf is not None and sf.may_exist)
                   or (entry is not None and (entry.op == DELETE or entry.may_exist)))
            if may:
                await self._journal(key, DELETE, since=entry.since if entry else None)
            else:
                await self._journal_drop(key)
            if sf is not None:
                self.files.detach(sf)
                self.files.maybe_dispose(sf)

    async def keep_for_handles(self, key: str) -> None:
        """Before ``key`` is replaced in the store (a rename): its open handles keep its content."""
        await self.files.keep_for_handles(key)

    async def mkdir(self, path: str) -> None:
        await self.markers.mkdir(path)

    async def rmdir(self, path: str) -> None:
        await self.markers.rmdir(path)

    async def ensure_dir(self, path: str) -> None:
        """Keep directory ``path`` existing in the store once its last entry goes (see ``markers``)."""
        await self.markers.ensure_dir(path)

    async def forget(self, key: str, etag: str | None = None) -> None:
        """Drop any pending operation of ``key``: the store now holds what it should (a server-side copy,
        at ``etag``, the base of the key's next write: a recovery must not take it for someone else's)."""
        async with self._locks.hold(key), self.uploader.frozen(key):
            sf = self.files.get(key)
            self.records.note_base(key, etag)
            await self._journal_drop(key)
            if sf is not None:
                self.files.detach(sf)
                self.files.maybe_dispose(sf)

    async def move(self, src: str, dst: str, *, dst_may_exist: bool) -> None:
        """rename of a staged file: its content is acknowledged and journaled under ``dst``, then ``src``
        is deleted (or forgotten, if the store never had it). A file with no staged content (opened
        for writing, never changed) is renamed in the store instead (``ValueError``)."""
        if src == dst:
            return
        sf = self.files.get(src)
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
            crc = await asyncio.to_thread(self.datafiles.sync, sf, df, size)
            async with self._locks.hold(src, dst), self.uploader.frozen(src, dst):
                if sf.key != src:
                    raise FileNotFoundError(errno.ENOENT, f"{src!r} was removed")
                dst_sf = self.files.get(dst)
                dst_entry = self.index.get(dst)
                src_entry = self.index.get(src)
                dst_may = (dst_may_exist or self.uploader.busy(dst) or (dst_sf is None and dst_entry is None)
                           or (dst_sf is not None and dst_sf.may_exist)
                           or (dst_entry is not None and (dst_entry.op == DELETE or dst_entry.may_exist)))
                src_may = sf.may_exist or self.uploader.busy(src)
                since = src_entry.since if src_entry is not None else self.wall()
                seq = self.records.next_seq()
                await self.records.write(Record(dst, PUT, seq, data=df.name, size=size, crc32=crc, mtime=sf.mtime,
                                                since=since, may_exist=dst_may))
                if src_may:
                    src_seq = self.records.next_seq()
                    await self.records.write(Record(src, DELETE, src_seq, since=since))
                    self._put_entry(self.uploader.acknowledged(Entry(src, DELETE, seq=src_seq, since=since), src_entry))
                else:
                    await self.records.remove(src, durable=True)
                    self._drop_entry(src)
                df.refs += 1
                old_acked, sf.acked = sf.acked, Acked(df, size, crc, seq, sf.mtime)
                if old_acked is not None:
                    self.datafiles.unref(old_acked.data)
                sf.unacked = False
                if dst_sf is not None and dst_sf is not sf:
                    self.files.detach(dst_sf)
                self.files.rename(sf, src, dst)
                sf.may_exist = dst_may
                entry = self.uploader.acknowledged(Entry(dst, PUT, sf=sf, seq=seq, since=since, may_exist=dst_may),
                                                   src_entry, dst_entry)
                self._put_entry(entry)
                self.uploader.barriers.renamed(src, dst, seq)
                self.uploader.barriers.changed(src)
                self.uploader.barriers.changed(dst)
                self.uploader.push(self.index.get(src))
                self.uploader.push(entry)
                if dst_sf is not None and dst_sf is not sf:
                    self.files.maybe_dispose(dst_sf)

    def quiesce(self, key: str) -> contextlib.AbstractAsyncContextManager[None]:
        """No store operation of ``key`` runs inside this block (one in flight is waited for), nor the
        marker put of a directory above it: the filesystem copies into ``key`` in the store meanwhile."""
        return self.uploader.quiesce(key)

    # ================================================================== flush, status, stats
    async def flush(self, timeout_s: float, prefix: str = "") -> FlushReport:
        """Wait until every change acknowledged so far is in the store (or ``timeout_s`` passes).

        A barrier for acknowledged data only: bytes written to a file that has not been closed or
        fsync'd since are not acknowledged, and are neither uploaded nor waited for (uploading them
        would put a half-written file in the bucket); such files are reported in ``unsynced``.
        """
        started = time.monotonic()
        snapshot = {e.key: e.seq for e in self.index if e.seq is not None and e.key.startswith(prefix)}
        with self.uploader.barriers.open(snapshot) as barrier:
            self.uploader.kick(snapshot)
            await wait_event(barrier.done, max(0.0, timeout_s))
        pending = [status for key in sorted(barrier.remaining) if (status := self.status(key)) is not None]
        unsynced = [{"key": sf.key, "size": sf.size} for sf in self.files
                    if sf.unacked and sf.key is not None and sf.key.startswith(prefix)]
        return FlushReport(ok=not pending, pending=pending, elapsed_s=time.monotonic() - started,
                           unsynced=sorted(unsynced, key=lambda u: u["key"]))

    def status(self, key: str) -> dict[str, Any] | None:
        """The durability stage of ``key``'s pending operation; None when there is none (clean)."""
        entry = self.index.get(key)
        if entry is None:
            return None
        return entry_status(entry, self.uploader, wall_now=self.wall(), now=self.clock.monotonic(),
                            durable_in=self.records.durable_in(key))

    def pending(self, prefix: str = "") -> list[dict[str, Any]]:
        return [s for k in sorted(self.index.keys()) if k.startswith(prefix) and (s := self.status(k)) is not None]

    def stats_snapshot(self) -> dict[str, Any]:
        return stats_document(self.stats, self.index.values(), self.files, self.space, self.uploader, wall_now=self.wall(),
                              now=self.clock.monotonic(), write_through=self.settings.write_through,
                              durable=self.records.durable_snapshot())

    def poke(self) -> None:
        """Re-evaluate what is due now (after a clock jump in tests, or a store known to be back)."""
        self.uploader.wake()

    # ================================================================== entries of staged files
    def _put_entry(self, entry: Entry) -> None:
        self.index.put(entry)
        self.uploader.barriers.changed(entry.key)

    def _drop_entry(self, key: str) -> None:
        self.index.drop(key)
        self.uploader.barriers.changed(key)

    def _modified(self, sf: StagedFile) -> None:
        sf.unacked = True
        sf.timed_out = None  # new bytes: their acknowledgement gets a deadline of its own
        sf.clean_ref = None
        sf.mtime = self.wall()
        key = sf.key
        if key is None:
            return
        entry = self.index.get(key)
        if entry is None or entry.sf is not sf:
            self._put_entry(Entry(key, PUT, sf=sf, since=self.wall(), may_exist=sf.may_exist))

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ================================================================== journal
    async def _journal(self, key: str, op: str, *, since: float | None = None) -> None:
        """Journal ``op`` (a delete, or a directory marker put) as ``key``'s pending operation (the
        caller holds the key's lock)."""
        old = self.index.get(key)
        seq = self.records.next_seq()
        since = since if since is not None else (old.since if old is not None else self.wall())
        await self.records.write(Record(key, op, seq, since=since))
        entry = self.uploader.acknowledged(Entry(key, op, seq=seq, since=since), old)
        self._put_entry(entry)
        self.uploader.push(entry)

    async def _journal_locked(self, key: str, op: str) -> None:
        async with self._locks.hold(key):
            await self._journal(key, op)

    async def _journal_drop(self, key: str) -> None:
        await self.records.remove(key, durable=True)
        self._drop_entry(key)

    async def _commit_only(self, sf: StagedFile) -> int | None:
        async with sf.lock:
            return await self._commit_locked(sf)

    async def _commit_quietly(self, sf: StagedFile) -> None:
        """The last handle went with changes not acknowledged: acknowledge them, unless the writer was
        already told that failed (close or fsync); then, or if it fails now, revert the file."""
        if not sf.commit_failed:
            try:
                await self._commit_only(sf)
            except Exception as exc:  # noqa: BLE001 - no caller to report to: the log is the report
                log.error("write-back: could not save %r to local disk after its last close: %s", sf.key,
                          describe(exc))
        if sf.unacked and not sf.detached:
            await self._revert(sf)
        self.files.maybe_dispose(sf)

    async def _revert(self, sf: StagedFile) -> None:
        """A file whose writer is gone and whose acknowledgement failed goes back to its last
        acknowledged state, giving back the space of what was never acknowledged: otherwise it would
        hold that space (and block every writer of a full cache) until it is deleted. Nothing of the
        lost bytes was acknowledged: close() or fsync() reported the failure. The acknowledged version
        if there is one; else the store's version it was staged from; else (created through the mount,
        never acknowledged) an empty file, acknowledged now."""
        async with sf.lock:
            if sf.disposed or not sf.unacked or sf.holders > 0 or sf.detached:
                return  # acknowledged or unlinked meanwhile, or opened again: its new writer decides
            lost, acked = sf.size, sf.acked
            self.stats.reverted += 1
            if acked is not None:
                await self.datafiles.restore_acked(sf, acked)
                what = f"its last acknowledged version ({acked.size} bytes)"
            elif sf.origin is not None:
                entry = self.index.get(sf.key or "")
                if entry is not None and entry.sf is sf and entry.seq is None:
                    self._drop_entry(entry.key)
                sf.unacked = sf.commit_failed = False
                sf.size = sf.origin.size
                what = "the version in the object store"
            else:
                await self.datafiles.empty(sf)  # still unacknowledged: committed below
                what = "an empty file"
            log.error("write-back: %r was not saved (its writer was told, and is gone): it reverts to %s; "
                      "%d bytes never acknowledged are dropped", sf.key, what, lost)
            if sf.unacked:
                try:
                    await self._commit_locked(sf)  # the empty file: its space is back, a record fits
                except Exception as exc:  # noqa: BLE001 - it holds no data space now; the log is the report
                    log.error("write-back: could not save the empty %r either: %s", sf.key, describe(exc))

    async def _commit_locked(self, sf: StagedFile) -> int | None:
        if not sf.unacked or sf.disposed:
            return None
        if sf.key is None or sf.current is None:
            sf.unacked = False
            return None
        df, size, key = sf.current, sf.size, sf.key
        crc = await asyncio.to_thread(self.datafiles.sync, sf, df, size)
        async with self._locks.hold(key):
            if sf.key != key:
                return None  # unlinked or renamed while syncing: that operation journaled the outcome
            entry = self.index.get(key)
            since = entry.since if entry is not None else self.wall()
            seq = self.records.next_seq()
            await self.records.write(Record(key, PUT, seq, data=df.name, size=size, crc32=crc, mtime=sf.mtime,
                                            since=since, may_exist=sf.may_exist))
            df.refs += 1
            old, sf.acked = sf.acked, Acked(df, size, crc, seq, sf.mtime)
            if old is not None:
                self.datafiles.unref(old.data)
            sf.unacked = False
            if entry is None or entry.sf is not sf:
                entry = Entry(key, PUT, sf=sf, since=since, may_exist=sf.may_exist)
                self._put_entry(entry)
            entry.seq = seq
            self.uploader.acknowledged(entry)
            entry.retry_at = 0.0
            entry.attempts = 0
            self.uploader.barriers.changed(key)
            self.uploader.push(entry)
        self.datafiles.trim(df, size)
        self.stats.commits += 1
        return seq

    async def _wait_uploaded(self, key: str, seq: int) -> None:
        with self.uploader.barriers.open({key: seq}, fail_fast=True) as barrier:
            self.uploader.kick({key: seq})
            await barrier.done.wait()
        if barrier.error is not None:
            kind = UploadAccessDeniedError if isinstance(barrier.error, AccessDeniedError) else UploadError
            raise kind(f"upload of {key!r} failed: {describe(barrier.error)} (the data stays staged and is "
                       "retried)") from barrier.error

    # ================================================================== what the uploader calls back
    async def _perform(self, entry: Entry) -> ObjectInfo | None:
        self.records.check_may_upload()  # a writer whose cluster journal was taken over uploads nothing
        with self.records.sending(entry.key):  # records acknowledged meanwhile race with it (``durable``)
            return await send(entry, self.store, self.records, self.datafiles)

    async def _applied(self, entry: Entry, seq: int, info: ObjectInfo | None) -> None:
        key = entry.key
        async with self._locks.hold(key):
            self.stats.count_applied(deleted=entry.op == DELETE, marker=entry.sf is None,
                                     uploaded_bytes=info.size if info is not None else 0)
            if entry.attempts:
                log.info("write-back: %s %r succeeded after %d failed attempts", entry.op, key, entry.attempts)
            await self.records.uploaded(key, seq, info)
            if self.index.get(key) is entry and entry.seq == seq:
                # Durably: the data file it names may be modified in place or removed from now on.
                await self.records.remove(key, durable=True)
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
                    if info is not None and self.files.promotable(acked, info):
                        acked.data.refs += 1
                        self._spawn(self.files.promote(sf, acked, info))  # drops the protection when done
                    else:
                        sf.acked = None  # in the store now: may be modified in place
                        self.datafiles.unref(acked.data)
                if sf is not None and not sf.unacked and info is not None and info.size == sf.size:
                    sf.clean_ref = ObjectRef(key, info.etag, info.size)
                if sf is not None:
                    self.files.maybe_dispose(sf)
                    if self.space.waiters:
                        self.files.unload_clean()
            self.uploader.barriers.applied(key, seq)
            if self.on_applied is not None:
                # In the same step as the overlay entry going away: no view ever shows the old version.
                try:
                    self.on_applied(key, info)
                except Exception:  # noqa: BLE001 - a view refresh must not undo an upload
                    log.exception("write-back: updating the view after %s %r failed", entry.op, key)


async def send(entry: Entry, store: ObjectStore, records: Records, datafiles: DataFiles) -> ObjectInfo | None:
    """Send one pending operation to the store: a delete, a directory marker, or the acknowledged
    version of a staged file. With a cluster copy an upload carries the writer's tag, so that a
    recovery after this node died with it in flight tells it from someone else's (``durable.upload_tag``)."""
    if entry.op == DELETE:
        await store.delete(entry.key)
        return None
    sf = entry.sf
    if sf is None:  # a directory marker
        return await store.put(entry.key, 0, _empty)
    acked = sf.acked
    if acked is None:
        raise ObjectStoreError(f"internal: {entry.key!r} has no acknowledged version to upload")
    # The writer's mtime goes with the bytes (rclone's ``mtime`` convention), and the view shows it.
    metadata = mtime_metadata(acked.mtime) if acked.mtime > 0 else {}
    df = acked.data
    df.refs += 1
    sf.may_exist = True  # from now on the store may hold it, whatever happens
    read = functools.partial(read_range, df.fd)
    try:
        tag = records.upload_tag(acked.seq)
        tagging = conditional(store) if tag is not None else None
        if tagging is not None:
            info = await tagging.put_if(entry.key, acked.size, read, metadata={**metadata, **(tag or {})})
        else:
            info = await store.put(entry.key, acked.size, read, metadata=metadata)
        return dataclasses.replace(info, mtime=acked.mtime) if metadata else info
    finally:
        datafiles.unref(df)


def _check_live(sf: StagedFile) -> None:
    if sf.disposed:
        raise OSError(errno.ESTALE, f"staged file {sf.key!r} was dropped (clean and not held)")


def _empty(start: int, end: int) -> bytes:
    return b""
