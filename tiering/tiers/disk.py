"""The local-disk tier: whole blocks as checksummed files, LRU-evicted under watermarks.

Layout
------
``<directory>/blocks/<digest[:2]>/<digest>.blk`` where ``digest = BlockKey.digest()`` (hex SHA-256
of the key token). 256 prefix directories keep every directory small enough for fast lookups even
with millions of blocks; they are created on first use. A block under ``ALIGNED_MIN_BYTES`` (a small
file's) is not a file of its own but a record of a pack file, ``<directory>/packs/<N>.pack``
(``tiering.tiers.packs`` says why: creating an inode per block was most of what a cold small file
cost the disk tier); ``tiering.tiers.diskplaces`` knows which block is where. What this docstring
says of a block file below (the temp name, the rename, the mtime stamps, the start-up scan by name)
is for block files; a record is appended in place, punched out when evicted, and found again by
walking its pack's headers. ``pack_small=False`` keeps every block a file (the tests of that layout).

File format: ``tiering.tiers.blockformat`` (a header with the block's identity and checksums, then the
data), shared with the cluster tier. A block failing any check is deleted, counted in
``stats.corrupt_blocks`` and answered as a miss; the engine re-fetches it. Block files are 0600 in
0700 directories and are opened without following symlinks; the daemon refuses a cache directory
another user owns or may write (``tiering.private``), which is what keeps blocks from being planted.

Writes
------
A block is written to a temp file in its final directory (``.<digest>.<pid>.<n>.tmp``), closed, and
renamed over the final name with ``os.replace``, so a reader sees either no file or a whole one.
There is no fsync: cached blocks are clean copies of store data, so after a crash a torn or
zero-filled block simply fails its checksum on the next read and is fetched again, while an fsync per
4 MiB block would cost a flush of the device queue on every miss. Temp files left by a crash are
removed by the start-up scan.

Blocks of 1 MiB and more are written and read with ``O_DIRECT``, from and into the block's own
page-aligned buffer, without a copy into the page cache: ``tiering.tiers.blockfile`` does the file I/O of
one block and gives the figures (buffered writes of new files cost this VM 2.1 CPU-s/GiB, direct
ones 0.08).

Capacity and eviction
---------------------
``used_bytes()`` counts whole file sizes (header included) of indexed blocks plus the bytes reserved
by writes in flight, and a write reserves its room *before* it starts, so the configured capacity is
never exceeded, even with many writer threads. When an insert would take usage above
``high_watermark * capacity``, least-recently-used blocks are evicted until usage plus the new block
fits under ``low_watermark * capacity``: eviction runs in batches (one pass frees ~10% of the tier
with the defaults) instead of one unlink per insert.

A ``VictimOrder`` passed in (an announced read order) reorders the eviction candidates while it is
active: farthest next use first, LRU among equals (``tiering.policy.victims``); blocks found at start-up and
not touched since have no known key and rank as never needed.

Recency is an in-memory ``OrderedDict`` keyed by digest, in LRU order. To survive a restart, recency
is also written to the files' mtimes: every insert and every hit stamps the file with ``os.utime``
(one cheap metadata call) using strictly increasing nanosecond stamps, and the start-up scan orders
the blocks by mtime. We use mtime rather than atime because atime is commonly disabled or coarsened
(``noatime``/``relatime`` mounts) and mtime is under our control. Equal mtimes (a filesystem with
coarse timestamps) are ordered by digest, which is arbitrary but harmless.

Restart
-------
The constructor scans ``blocks/`` with ``os.scandir`` and one ``stat`` per file: names, sizes and
mtimes only, no file content is read (headers are checked lazily, on ``get``). If the blocks found
exceed the (lowered) capacity, the least recently used are evicted at once, down to the low
watermark. Usage between the high watermark and the capacity is left alone: the next insert
evicts the usual batch.

The index is keyed by digest because that is all a file name tells. ``keys()`` lists only the
``BlockKey``s seen in this process (put, or hit by get); blocks found at start-up are counted by
``len()`` and ``used_bytes()`` and are served normally, they are just not listed until touched.

Threads and failures
--------------------
The engine calls ``get``/``put``/``contains``/``discard`` from a thread pool. One ``threading.Lock``
guards the index, the byte counts and the stats; every open, read, write, rename and unlink happens
outside it. A digest being written or deleted is marked busy, so two threads never race on one file:
a second put of a block already being written is simply declined, and a get of it is a miss.

A failing disk is a miss, never an error for a reader: any ``OSError`` in ``get``/``put`` is counted
in ``stats.errors`` and reported to ``self.health`` (a ``TierHealth``), which logs once per state
change. While the tier is down it is skipped without any I/O, until a probe after the cool-down
succeeds. A failed write leaves neither a temp file nor an index entry behind.

Pinning
-------
``pin(keys)`` marks blocks that eviction must never take (``_evictable`` skips them), present or not:
a block pinned before it is written is protected from the moment it lands. ``pinned_bytes()`` counts
the pinned blocks on disk; the engine bounds the total pinned (``tiering.policy.pins``), so eviction always
has unpinned blocks to work with. Pins are in memory: the daemon restores them at start-up (the
``pinned`` argument, applied before the start-up scan may evict) from the pin file it keeps. The one
case that overrides a pin is a capacity lowered below the pinned bytes: the capacity is a hard limit,
so the start-up scan then evicts pinned blocks too, least recently used first, with a warning.
``discard`` and corrupt-block drops also remove pinned blocks (the pin stays; the block is fetched
again on the next read or warm). ``touch(key)`` refreshes a block's recency in memory only (no
I/O), for warming, which must keep blocks it skips from being the next eviction victims.
``evict_unpinned()`` drops every block that eviction may take, for ``cachefs evict``.

Staged write-back data
----------------------
The tier is also the ``SpaceBudget`` of write-back (``tiering.writeback``): ``reserve_space(n)``
adds ``n`` staged bytes to ``used_bytes()`` and evicts clean, unpinned blocks exactly as a put does
(a batch down to the low watermark when the high one is crossed), so dirty data and cached blocks
share one capacity and the capacity is never exceeded. Staged bytes are never evicted: they are
not blocks of this tier, only counted here, and go when write-back releases them after upload.
When no clean block is left to evict the reservation is refused and the writer waits or gets
ENOSPC. ``force`` (start-up replay of staged data) reserves even beyond the capacity, since
acknowledged data must not be dropped when the capacity was lowered; block puts are then refused
until uploads bring usage back under it.

Minimum free space
------------------
``min_free_bytes`` (``--min-free-space``, as rclone's ``--vfs-cache-min-free-space``) keeps the
filesystem of the cache from filling up because of other writers on it: before a put or a staged
reservation, the tier asks ``free_space()`` (a callable passed in, ``os.statvfs`` in the daemon, a
fake in tests) and, when writing ``n`` bytes would leave less than the minimum, evicts clean,
unpinned blocks for the shortfall as well, in the same pass as the watermark eviction. A block put
that still cannot keep the minimum is declined (counted in ``stats.rejected``: the block is clean and
stays in the store); a staged reservation is not refused for it (acknowledged writes are bounded by
the capacity and ``--dirty-wait``, not by a figure other programs move). One ``statvfs`` per put is
a few microseconds against the milliseconds of writing a block. A probe that fails counts as
"enough room": a broken probe must not turn into misses.

Whole files (passthrough)
-------------------------
``assemble_whole(ref, block_size)`` writes the plain copy of one object version whose every block is
on this tier, each block checked on the way (``tiering.tiers.wholefile``), and ``whole_file(ref)``
finds it again; the FUSE layer hands it to the kernel, which then reads it without the daemon. A
whole file is an entry of the same LRU index under its own name (``w`` + digest, in ``whole/``): it
counts in ``used_bytes()``, makes room by evicting as a put does, is evicted like a block (never
pinned: it is rebuilt from the blocks), and goes with ``evict_unpinned`` and ``discard_whole``. The
start-up scan removes every whole file it finds: only what this process checked is handed to the
kernel. Whoever keeps a whole file open past its use (the FUSE layer keeps it registered with the
kernel between opens) asks ``on_whole_dropped`` to be told of each one this tier removes: called with
its path right after the unlink, in the thread that removed it, so that it can let go of the file
and the space is really freed.

One cache directory belongs to one process at a time; two daemons sharing one would evict each
other's files without knowing it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

from tiering.tiers.diskplaces import BlockPlaces, Record
from tiering.tiers.diskdir import check_cache_dir, filesystem_free_bytes, remove_whole_files
from tiering.tiers.blockformat import (
    CorruptBlockError,
    block_file_size,
    encode_header,
    encode_token,
    object_footprint,
)
from tiering.blocks import BlockData, BlockKey, ObjectRef, block_count, block_range
from tiering.tiers.wholefile import (
    WHOLE_DIRNAME,
    WHOLE_PREFIX,
    TierIndex,
    WholeFileStats,
    whole_digest,
    write_whole,
)
from tiering.private import open_private
from tiering.clock import Clock, SystemClock
from tiering.health import TierHealth, TierState
from tiering.private import PRIVATE_DIR_MODE
from tiering.protocols import TierStats, VictimOrder
from tiering.policy.victims import victims_in_order
from tiering.settings import DEFAULT_HIGH_WATERMARK, DEFAULT_LOW_WATERMARK

log = logging.getLogger("tiering.tiers.disk")

# Re-exported: what the disk tier's callers (the engine, tests) used to import from here.
__all__ = ["DiskTier", "CorruptBlockError", "block_file_size", "check_cache_dir", "encode_header",
           "filesystem_free_bytes", "object_footprint"]

BLOCKS_DIRNAME = "blocks"


def _uncounted() -> None:
    """A miss of a read no reader made (``DiskTier.peek``): not counted."""


def _check_limits(name: str, capacity_bytes: int, min_free_bytes: int, low: float, high: float) -> None:
    """A ``ValueError`` naming the tier and the limit for a size or watermark that cannot be."""
    if capacity_bytes < 0:
        raise ValueError(f"{name} tier capacity must not be negative, got {capacity_bytes}")
    if min_free_bytes < 0:
        raise ValueError(f"{name} tier minimum free space must not be negative, got {min_free_bytes}")
    if not 0 < low < high <= 1:
        raise ValueError(f"{name} tier watermarks must satisfy 0 < low < high <= 1, got low={low} high={high}")


class DiskTier:
    """Blocks as checksummed files under ``directory``, at most ``capacity_bytes`` of them on disk."""

    def __init__(
        self,
        directory: Path,
        capacity_bytes: int,
        *,
        high_watermark: float = DEFAULT_HIGH_WATERMARK,
        low_watermark: float = DEFAULT_LOW_WATERMARK,
        clock: Clock = SystemClock(),
        name: str = "disk",
        pinned: Iterable[BlockKey] = (),
        min_free_bytes: int = 0,
        free_space: Callable[[], int] | None = None,
        victim_order: VictimOrder | None = None,
        pack_small: bool = True,
    ) -> None:
        _check_limits(name, capacity_bytes, min_free_bytes, low_watermark, high_watermark)
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.stats = TierStats()
        self.health = TierHealth(clock, name=name)
        self.directory = Path(directory)
        self._blocks_dir = self.directory / BLOCKS_DIRNAME
        self._blocks_str = str(self._blocks_dir)
        self._whole_dir = self.directory / WHOLE_DIRNAME
        self._whole_str = str(self._whole_dir)
        self.whole_stats = WholeFileStats()
        self._high_bytes = int(capacity_bytes * high_watermark)
        self._low_bytes = int(capacity_bytes * low_watermark)
        self.min_free_bytes = min_free_bytes
        self._free_space = free_space
        self.victim_order = victim_order

        self._lock = threading.Lock()
        # digest -> (file size, generation), least recently used first. The generation tells a
        # reader whether the entry it looked up is still the one in the index when it comes back.
        self._index = TierIndex()
        self._known: dict[str, BlockKey] = {}  # digest -> key, for keys seen in this process
        self._busy: set[str] = set()  # digests being written or deleted right now
        self._used = 0  # indexed file sizes + room reserved by writes in flight
        self._generations = itertools.count(1)
        self._last_stamp_ns = 0
        self._pinned: set[str] = {key.digest() for key in pinned}  # digests eviction must skip
        self._pinned_used = 0  # file sizes of indexed pinned blocks
        self._staged = 0  # bytes reserved by write-back staging (SpaceBudget), part of _used
        self._whole_listeners: list[Callable[[Path], None]] = []  # told of each whole file removed

        check_cache_dir(self.directory)
        for sub in (self._blocks_dir, self._whole_dir):
            try:
                sub.mkdir(mode=PRIVATE_DIR_MODE, exist_ok=True)
            except OSError as exc:
                raise OSError(exc.errno, f"cache directory {sub} cannot be created: {exc.strerror}") from exc
        # Where each block's bytes are: a file, or a record of a pack file (small blocks, pack_small).
        self.places = BlockPlaces(self.directory, self._blocks_dir, self._whole_dir, name, pack_small=pack_small)
        self.files = self.places.files
        self.packs = self.places.packs
        self._load()

    # -- BlockTier ------------------------------------------------------------------------------

    def get(self, key: BlockKey) -> BlockData | None:
        return self._get(key, reply=False)

    def get_for_reply(self, key: BlockKey) -> BlockData | None:
        """``get`` into this thread's reply buffer (``BlockFiles.read_for_reply``), counted and checked alike."""
        return self._get(key, reply=True)

    def peek(self, key: BlockKey) -> BlockData | None:
        """``get`` for another tier's copy, checked alike: no hit or miss counted, no recency changed."""
        return self._get(key, reply=False, counted=False)

    def _get(self, key: BlockKey, *, reply: bool, counted: bool = True) -> BlockData | None:
        digest, miss = key.digest(), (self._count_miss if counted else _uncounted)
        with self._lock:
            entry = self._index.get(digest)
            if entry is None or digest in self._busy:
                self.stats.misses += counted
                return None
            packed = self.places.record(digest)
        if not self.health.usable():
            miss()
            return None
        size, gen = entry
        try:
            data = self.places.read(digest, packed, encode_token(key), size, reply=reply)
        except FileNotFoundError:
            # Removed behind our back (or evicted by another thread in between): a plain miss.
            self._drop(digest, gen)
            miss()
            return None
        except CorruptBlockError as exc:
            self._corrupt(key, digest, gen, packed, exc)
            miss()
            return None
        except OSError as exc:
            # The device failed. Forget the block too: an unreadable file would fail every hit.
            self._count_error()
            self.health.record_failure(exc)
            self._drop(digest, gen)
            miss()
            return None
        self.health.record_success()
        if not counted:
            return data
        stamp = None
        with self._lock:
            self.stats.hits += 1
            if self._index.get(digest, (0, -1))[1] == gen:
                self._index.move_to_end(digest)
                self._known[digest] = key
                if packed is None:
                    stamp = self._next_stamp()
        if stamp is not None:  # a record's recency is not on disk (tiering.tiers.packs)
            self.places.stamp(digest, stamp)
        return data

    def _corrupt(self, key: BlockKey, digest: str, gen: int, packed: Record | None, exc: CorruptBlockError) -> None:
        """A read of a block failed a check: drop and count it, unless it is a record evicted while it
        was read (its slot punched out, read as zeros: no damage, the index holds it no more)."""
        with self._lock:
            if packed is not None and self._index.get(digest, (0, -1))[1] != gen:
                return
            self.stats.corrupt_blocks += 1
        log.warning("%s tier: dropping corrupt block %s (%s): %s", self.name, self.places.where(digest, packed), key, exc)
        self._drop(digest, gen)

    def contains(self, key: BlockKey) -> bool:
        """Index lookup only, no I/O. False while the tier is down, as ``get`` would miss."""
        if self.health.state is TierState.DOWN:
            return False
        digest = key.digest()
        with self._lock:
            return digest in self._index

    def absent(self, key: BlockKey) -> bool:
        """Index lookup only, no I/O; a block not indexed (or being written) is counted as a miss."""
        digest = key.digest()
        with self._lock:
            if digest in self._index and digest not in self._busy:
                return False
            self.stats.misses += 1
            return True

    def put(self, key: BlockKey, data: BlockData) -> bool:
        digest = key.digest()
        header = encode_header(key, data)
        size = len(header) + len(data)
        if self.capacity_bytes == 0 or size > self.capacity_bytes:
            with self._lock:
                self.stats.rejected += 1
            if self.health.state is not TierState.DOWN:
                self._drop(digest)  # never keep an older version of a block we were just offered
            return False
        if not self.health.usable():
            return False
        shortfall = self._free_shortfall(size)
        with self._lock:
            if digest in self._busy:
                return False  # another thread is writing or deleting this block: let it finish
            old = self._index.pop(digest, None)
            old_slot = self.places.take(digest)
            if old is not None:
                self._used -= old[0]
                if digest in self._pinned:
                    self._pinned_used -= old[0]
                self._known.pop(digest, None)
            before = self._used
            victims = self._make_room(size, shortfall)
            fits = self._used + size <= self.capacity_bytes and before - self._used >= shortfall
            if fits:
                self._used += size  # reserved now, so concurrent writers can never overshoot
            else:
                self.stats.rejected += 1  # the room is held by writes in flight
            self._busy.add(digest)
        self._unlink_all(victims)
        if not fits:
            if old is not None:
                self._remove_copy(digest, old_slot)
            self._release(digest)
            return False
        try:
            packed = self.places.write(digest, header, data)
        except OSError as exc:
            if old is not None:
                self._remove_copy(digest, old_slot)  # its index entry is gone: leave no orphan behind
            with self._lock:
                self._used -= size
                self._busy.discard(digest)
                self.stats.errors += 1
            self.health.record_failure(exc)
            return False
        self.health.record_success()
        if old is not None and (old_slot is not None or packed):
            self._remove_copy(digest, old_slot)  # the old copy is elsewhere than the new one
        with self._lock:
            self._index[digest] = (size, next(self._generations))
            if digest in self._pinned:
                self._pinned_used += size
            self._known[digest] = key
            self._busy.discard(digest)
            self.stats.inserts += 1
            stamp = None if packed else self._next_stamp()  # a record's recency is not on disk
        if stamp is not None:
            self.places.stamp(digest, stamp)
        return True

    def _remove_copy(self, digest: str, record: Record | None) -> None:
        """Remove a copy of a busy block that is out of the index (its record, or its file); a
        failing disk is counted, and the file stays as an orphan until the next start-up scan."""
        try:
            self.places.remove(digest, record)
        except OSError as exc:
            self._count_error()
            self.health.record_failure(exc)

    def discard(self, key: BlockKey) -> None:
        self._drop(key.digest())

    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._index)

    # -- staged write-back data (tiering.protocols.SpaceBudget) -----------------------------------

    def reserve_space(self, nbytes: int, *, force: bool = False) -> bool:
        """Reserve room for staged (dirty) bytes, evicting clean blocks as a put does; see the docstring."""
        if nbytes < 0:
            raise ValueError("cannot reserve a negative number of bytes")
        shortfall = self._free_shortfall(nbytes)
        with self._lock:
            victims = self._make_room(nbytes, shortfall)
            fits = self._used + nbytes <= self.capacity_bytes
            if fits or force:
                self._used += nbytes
                self._staged += nbytes
        self._unlink_all(victims)
        return fits or force

    def release_space(self, nbytes: int) -> None:
        with self._lock:
            nbytes = min(nbytes, self._staged)
            self._used -= nbytes
            self._staged -= nbytes

    def reserved_space(self) -> int:
        """Bytes held by staged write-back data (included in ``used_bytes()``)."""
        return self._staged

    # -- whole files (see "Whole files" above) ----------------------------------------------------

    def whole_file(self, ref: ObjectRef) -> str | None:
        """The whole file of ``ref`` if this process assembled it and holds it still; marks it used.
        Index lookup only, no I/O: its recency is not stamped on the file, as a block's is, since
        no whole file outlives the process. A string made without pathlib: every passthrough open
        asks (a ``Path`` was a quarter of the daemon's loop time per open of a passthrough epoch)."""
        if self.health.state is TierState.DOWN:
            return None
        wkey = WHOLE_PREFIX + whole_digest(ref)
        with self._lock:
            if wkey not in self._index or wkey in self._busy:
                return None
            self._index.move_to_end(wkey)
        return self.places.hit_path(wkey)

    def whole_name(self, ref: ObjectRef) -> Path:
        """Where the whole file of ``ref`` is (or would be); no I/O."""
        return self.places.path(WHOLE_PREFIX + whole_digest(ref))

    def whole_snapshot(self) -> dict[str, int]:
        """Whole files held now and their bytes (part of ``len()`` and ``used_bytes()``), and counters."""
        with self._lock:
            return self.whole_stats.snapshot(self._index.whole_files, self._index.whole_bytes)

    def discard_whole(self, ref: ObjectRef) -> None:
        self._drop(WHOLE_PREFIX + whole_digest(ref))

    def on_whole_dropped(self, callback: Callable[[Path], None]) -> None:
        """Call ``callback(path)`` after each whole file this tier removes (evicted, discarded, replaced),
        from the removing thread, without the lock; it must not block. An exception is logged, never
        raised into the eviction."""
        self._whole_listeners.append(callback)

    def assemble_whole(self, ref: ObjectRef, block_size: int) -> Path | None:
        """Write the whole file of ``ref`` from its blocks on this tier, each checked as ``get`` checks
        it; its path, or None when a block is not here (or fails its check), the file does not fit,
        or the disk fails (a failure is counted, never raised). Blocking: call it from a worker thread."""
        wkey = WHOLE_PREFIX + whole_digest(ref)
        size = ref.size
        keys = [BlockKey(ref.key, ref.etag, index) for index in range(block_count(size, block_size))]
        if self.capacity_bytes == 0 or size > self.capacity_bytes or self.health.state is TierState.DOWN:
            return None
        shortfall = self._free_shortfall(size)
        with self._lock:
            if wkey in self._index and wkey not in self._busy:
                return self.places.path(wkey)
            digests = {key.digest() for key in keys}
            if wkey in self._busy or any(d not in self._index or d in self._busy for d in digests):
                return None  # being assembled by another thread, or not whole on this tier
            # The blocks to copy must not be the room made for their copy.
            self._busy.update(digests)
            try:
                before = self._used
                victims = self._make_room(size, shortfall)
            finally:
                self._busy.difference_update(digests)
            fits = self._used + size <= self.capacity_bytes and before - self._used >= shortfall
            if fits:
                self._used += size
                self._busy.add(wkey)
        self._unlink_all(victims)
        if not fits:
            return None
        path = self.places.path(wkey)
        tmp = self.places.temp_path(wkey)
        parts = [(block_range(key.index, size, block_size)[0], functools.partial(self._read_checked, key))
                 for key in keys]
        try:
            path.parent.mkdir(mode=PRIVATE_DIR_MODE, exist_ok=True)
            write_whole(tmp, path, size, parts, open_private)
        except (OSError, CorruptBlockError) as exc:
            with self._lock:
                self._used -= size
                self._busy.discard(wkey)
                self.whole_stats.failed += 1
            if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError):
                self._count_error()
                self.health.record_failure(exc)
            log.debug("%s tier: no whole file of %r: %s", self.name, ref.key, exc)
            return None
        with self._lock:
            self._index[wkey] = (size, next(self._generations))
            self._busy.discard(wkey)
            self.whole_stats.assembled += 1
            self.whole_stats.assembled_bytes += size
        return path

    def _read_checked(self, key: BlockKey) -> BlockData | None:
        """One block, checked as ``get`` checks it, without counting a hit or a miss (assembly is
        not a read); None if it is not here any more. A corrupt block is dropped and counted."""
        digest = key.digest()
        with self._lock:
            entry = self._index.get(digest)
            if entry is None or digest in self._busy:
                return None
            packed = self.places.record(digest)
        try:
            return self.places.read(digest, packed, encode_token(key), entry[0], reply=False)
        except FileNotFoundError:
            return None
        except CorruptBlockError as exc:
            self._corrupt(key, digest, entry[1], packed, exc)
            return None

    # -- extras ---------------------------------------------------------------------------------

    def keys(self) -> list[BlockKey]:
        """Held keys seen in this process, least recently used first (see the module docstring)."""
        with self._lock:
            return [self._known[d] for d in self._index if d in self._known]

    def pin(self, keys: Iterable[BlockKey]) -> None:
        """Keep these blocks from eviction, whether they are on disk yet or not (no I/O)."""
        digests = [key.digest() for key in keys]
        with self._lock:
            for digest in digests:
                if digest not in self._pinned:
                    self._pinned.add(digest)
                    entry = self._index.get(digest)
                    if entry is not None:
                        self._pinned_used += entry[0]

    def unpin(self, keys: Iterable[BlockKey]) -> None:
        """Let eviction take these blocks again; they keep their place in the LRU order."""
        digests = [key.digest() for key in keys]
        with self._lock:
            for digest in digests:
                if digest in self._pinned:
                    self._pinned.discard(digest)
                    entry = self._index.get(digest)
                    if entry is not None:
                        self._pinned_used -= entry[0]

    def is_pinned(self, key: BlockKey) -> bool:
        return key.digest() in self._pinned

    def pinned_bytes(self) -> int:
        """File sizes of the pinned blocks that are on disk now."""
        return self._pinned_used

    def touch(self, key: BlockKey) -> bool:
        """Mark a held block most recently used, in memory only (no I/O); False if not held."""
        digest = key.digest()
        with self._lock:
            if digest not in self._index or digest in self._busy:
                return False
            self._index.move_to_end(digest)
            self._known[digest] = key
            return True

    def evict_unpinned(self) -> tuple[int, int]:
        """Drop every block eviction may take (all but pinned and busy ones), and every whole file:
        ``(blocks, bytes)``, the bytes counting the whole files too."""
        with self._lock:
            victims = [d for d in self._index if self._evictable(d)]
            freed = 0
            for digest in victims:
                size, _gen = self._index.pop(digest)
                self._used -= size
                freed += size
                self._known.pop(digest, None)
                self._busy.add(digest)
        self._unlink_all(victims)
        return sum(1 for d in victims if not d.startswith(WHOLE_PREFIX)), freed

    def __repr__(self) -> str:
        return (
            f"DiskTier(name={self.name!r}, directory={str(self.directory)!r}, used={self._used}, "
            f"capacity={self.capacity_bytes}, blocks={len(self)}, health={self.health.state.value})"
        )

    # -- eviction (call with the lock held) -----------------------------------------------------

    def _make_room(self, nbytes: int, shortfall: int) -> list[str]:
        """Evict for an insert of ``nbytes``: a batch down to the low watermark past the high one, and
        at least ``shortfall`` bytes for the minimum free space. Returns the victims to unlink."""
        targets = []
        if self._used + nbytes > self._high_bytes:
            targets.append(self._low_bytes - nbytes)
        if shortfall > 0:
            targets.append(self._used - shortfall)
        return self._evict_until(min(targets)) if targets else []

    def _free_shortfall(self, nbytes: int) -> int:
        """Bytes to free so that writing ``nbytes`` leaves ``min_free_bytes`` free (0: enough room).

        Called without the lock: the probe is a system call."""
        if self.min_free_bytes <= 0 or self._free_space is None:
            return 0
        try:
            free = self._free_space()
        except OSError:
            return 0  # see "Minimum free space": a failing probe is not a reason to miss
        return max(0, self.min_free_bytes - (free - nbytes))

    def _evictable(self, digest: str) -> bool:
        """Whether eviction may take ``digest``: not being written or deleted, and not pinned."""
        return digest not in self._busy and digest not in self._pinned

    def _evict_until(self, target_bytes: int) -> list[str]:
        """Take LRU evictable blocks out of the index until ``used <= target_bytes``.

        Returns the digests whose files the caller must unlink (outside the lock); they stay busy
        until ``_unlink_all`` has removed them. Stops early when nothing evictable is left (room
        reserved by writes in flight cannot be evicted)."""
        if self._used <= target_bytes:
            return []
        victims: list[str] = []
        remaining = self._used
        candidates: Iterable[str] = self._index
        ordered = False
        if self.victim_order is not None and self.victim_order.active():
            # Walked lazily: the index does not change until the loop below is done.
            candidates, ordered = victims_in_order((d for d in self._index if self._evictable(d)), self.victim_order,
                                                   self._known.get)
        for digest in candidates:
            if remaining <= target_bytes:
                break
            if self._evictable(digest):
                victims.append(digest)
                remaining -= self._index[digest][0]
        for digest in victims:
            size, _gen = self._index.pop(digest)
            self._used -= size
            self._known.pop(digest, None)
            self._busy.add(digest)
            self.stats.evictions += 1
            self.stats.evicted_bytes += size
            if ordered:
                self.stats.ordered_evictions += 1
        return victims

    def _evict_pinned_until(self, target_bytes: int) -> list[str]:
        """Start-up only, capacity below the pinned bytes: evict pinned blocks too (see Pinning)."""
        victims: list[str] = []
        for digest, (size, _gen) in self._index.items():
            if self._used <= target_bytes:
                break
            victims.append(digest)
            self._used -= size
            if digest in self._pinned:
                self._pinned_used -= size
            self.stats.evictions += 1
            self.stats.evicted_bytes += size
        for digest in victims:
            del self._index[digest]
            self._known.pop(digest, None)
            self._busy.add(digest)
        if victims:
            log.warning("%s tier: capacity %d bytes is below the pinned data: evicted %d blocks, pinned ones included",
                        self.name, self.capacity_bytes, len(victims))
        return victims

    # -- helpers --------------------------------------------------------------------------------

    def _next_stamp(self) -> int:
        """A strictly increasing wall-clock stamp in ns for mtimes (lock held)."""
        self._last_stamp_ns = max(time.time_ns(), self._last_stamp_ns + 1)
        return self._last_stamp_ns

    def _count_miss(self) -> None:
        with self._lock:
            self.stats.misses += 1

    def _count_error(self) -> None:
        with self._lock:
            self.stats.errors += 1

    def _release(self, digest: str) -> None:
        with self._lock:
            self._busy.discard(digest)

    def _drop(self, digest: str, gen: int | None = None) -> None:
        """Remove a block from the index and its file from disk.

        With ``gen``, only if the index still holds that generation (a reader dropping what it read
        must not drop a newer copy written meanwhile). Busy digests belong to another thread."""
        with self._lock:
            entry = self._index.get(digest)
            if entry is None or digest in self._busy or (gen is not None and entry[1] != gen):
                return
            del self._index[digest]
            self._used -= entry[0]
            if digest in self._pinned:
                self._pinned_used -= entry[0]
            self._known.pop(digest, None)
            self._busy.add(digest)
        self._unlink_all([digest])

    def _unlink_all(self, digests: list[str]) -> None:
        """Unlink the files of busy ``digests`` (no lock held), then release them."""
        if not digests:
            return
        for digest in digests:
            self._remove_copy(digest, self.places.take(digest))
            if self._whole_listeners and digest.startswith(WHOLE_PREFIX):
                self._whole_dropped(self.places.path(digest))
        with self._lock:
            self._busy.difference_update(digests)

    def _whole_dropped(self, path: Path) -> None:
        for callback in self._whole_listeners:
            try:
                callback(path)
            except Exception:  # noqa: BLE001 - a listener's bug must not stop an eviction half way
                log.exception("%s tier: a listener of removed whole files failed", self.name)

    # -- start-up -------------------------------------------------------------------------------

    def _load(self) -> None:
        """Index the blocks already on disk (names and stat only) and remove leftover temp files."""
        found, removed_tmp = self.places.scan()
        self.whole_stats.removed_at_start = remove_whole_files(self._whole_dir)
        for mtime_ns, _order, digest, size, record in found:
            if digest in self._index:  # a block both as a file and as a record: keep the later one
                old_size, _gen = self._index.pop(digest)
                self._used -= old_size
                if digest in self._pinned:
                    self._pinned_used -= old_size
                self._remove_copy(digest, self.places.take(digest))
            if record is not None:
                self.places.keep(digest, record)
            self._index[digest] = (size, 0)
            self._used += size
            if digest in self._pinned:
                self._pinned_used += size
            self._last_stamp_ns = max(self._last_stamp_ns, mtime_ns)
        evicted = 0
        if self._used > self.capacity_bytes:  # capacity was lowered since the blocks were written
            victims = self._evict_until(self._low_bytes)
            if self._used > self.capacity_bytes:
                victims += self._evict_pinned_until(self.capacity_bytes)
            evicted = len(victims)
            self._unlink_all(victims)
        log.info(
            "%s tier: %d blocks (%d bytes) in %s, capacity %d bytes; removed %d temp files, evicted %d blocks",
            self.name,
            len(self._index),
            self._used,
            self.directory,
            self.capacity_bytes,
            removed_tmp,
            evicted,
        )
