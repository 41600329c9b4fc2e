"""Announced read orders: what a loader said it will read next, and how far each block's next use is.

A training loader reads a shuffled permutation of files. Read-ahead inside a file cannot help small
files, and LRU evicts exactly the files the next epoch needs first. So a loader may *announce* its
order: a ``stream`` (one per DataLoader sampler, one per rank) hands an ordered list of object
versions (``ObjectRef``), in one call or in pages (``append``). This module holds that state and
answers two questions, with no I/O and no knowledge of FUSE:

- **What to fetch next** (``ReadOrder.ahead``): the entries from the stream's *position* onwards
  that fit in the stream's share of a bounded window of bytes. ``tiering.engine.orderprefetch`` fetches
  them with the engine's fetch slots.
- **How soon a block is needed** (``ReadOrder.next_use``): the number of blocks the nearest stream
  reads before it, if it reads in its announced order; infinity for a block no stream announced
  ahead. The tiers order their eviction victims by it (``tiering.policy.victims``): farthest next use
  first, which is Belady's optimal policy for a known future, and blocks nobody will read first,
  in LRU order among themselves. So announced-but-unread blocks are never evicted before blocks
  that nobody announced, and when the announced data exceeds the cache the blocks needed last go.

Positions follow the opens
--------------------------
The reader's position advances as the announced files are opened (``opened``, called by the
filesystem on every open): an open of an entry found in ``[position - SLACK, position +
MATCH_AHEAD)`` moves the position to it (never backwards). DataLoader workers open files a few
entries out of order, so entries within ``SLACK`` behind the position that were not opened yet
still count as needed (their distance is negative: sooner than anything ahead). A reader that
diverges costs no correctness: a skip beyond ``MATCH_AHEAD`` or a repeat simply does not move the
position (the blocks fetched ahead are waste bounded by the window), a reader that stops leaves at
most one window fetched for nothing, and every read is served by the ordinary read path whatever
the order says. Entries behind ``position - SLACK`` are dropped (the list is compacted), so a long
epoch announced in pages holds only what is ahead.

Bounds: a page (one call) holds at most ``max_page_entries``, a stream ``max_stream_entries`` held
entries and the daemon ``max_total_entries``; beyond, ``ReadOrderLimitError`` (one line, nothing
changed). Streams idle (no announce, no matched open) for ``stale_after_s`` are dropped to make
room before refusing, so a job killed without ending its stream does not hold the budget forever.

Threads: everything runs on the event loop, except ``next_use``, which the disk tier calls from a
worker thread while it evicts; it only reads dicts and lists (single operations under the GIL) and
tolerates an answer that is one update stale: eviction order is a preference, not a correctness
matter.
"""

from __future__ import annotations

import asyncio
import math
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Callable, Iterable

from tiering.blocks import BlockKey, ObjectRef, block_count
from tiering.clock import Clock, SystemClock

MiB = 1024 * 1024

# Bytes fetched ahead of the readers, over all streams: 256 MiB is ~2,600 files of 100 KiB, enough
# to keep 16 parallel GETs busy for seconds of reading, and small next to a disk tier. The daemon
# bounds it further by a share of the cache (a window larger than the cache evicts itself).
DEFAULT_WINDOW_BYTES = 256 * MiB
# One announce call: 100,000 paths is a ~6 MB JSON body, parsed in well under a second; longer
# orders come in pages (the sampler wrapper pages by itself).
DEFAULT_MAX_PAGE_ENTRIES = 100_000
# Held entries: an entry costs ~300 bytes (its ref, its slot in the position index and the prefix
# sums), so a stream holds at most ~300 MB and the daemon ~600 MB; ImageNet's 1.28 M files per
# epoch fit one stream when announced in pages, since entries behind the reader are dropped.
DEFAULT_MAX_STREAM_ENTRIES = 1_000_000
DEFAULT_MAX_TOTAL_ENTRIES = 2_000_000
DEFAULT_MAX_STREAMS = 256  # ranks x workers on one node stay far below this
# An open matches an entry up to this far ahead of the position (a reader that skips a few files, or
# DataLoader workers running ahead) ...
MATCH_AHEAD = 4096
# ... or this far behind it (workers that lag the others): such entries are still needed.
SLACK = 256
# A stream with no announce and no matched open for this long is dropped when room is needed.
DEFAULT_STALE_AFTER_S = 600.0
MAX_STREAM_ID_CHARS = 200


class ReadOrderLimitError(ValueError):
    """An announcement over a bound (one line; nothing was changed)."""


@dataclass(frozen=True)
class ReadOrderSettings:
    window_bytes: int = DEFAULT_WINDOW_BYTES
    max_page_entries: int = DEFAULT_MAX_PAGE_ENTRIES
    max_stream_entries: int = DEFAULT_MAX_STREAM_ENTRIES
    max_total_entries: int = DEFAULT_MAX_TOTAL_ENTRIES
    max_streams: int = DEFAULT_MAX_STREAMS
    stale_after_s: float = DEFAULT_STALE_AFTER_S

    def __post_init__(self) -> None:
        if self.window_bytes < 0:
            raise ValueError("announce window must not be negative")
        for name in ("max_page_entries", "max_stream_entries", "max_total_entries", "max_streams"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")


@dataclass
class ReadOrderStats:
    announced_files: int = 0
    announced_bytes: int = 0
    order_hits: int = 0  # opens of an announced file whose first blocks were already cached
    stalls: int = 0  # opens of an announced file that had to wait for a block
    unmatched_opens: int = 0  # opens that matched no stream (not announced, skipped far, repeated)
    streams_dropped: int = 0  # idle streams dropped to make room
    prefetched_blocks: int = 0  # blocks the order prefetcher loaded (not already in RAM)
    prefetch_errors: int = 0  # announced loads that failed (the reader's read fetches again)


@dataclass
class Stream:
    """One announced order. Indices are relative to ``base`` entries already dropped."""

    id: str
    block_size: int
    refs: list[ObjectRef] = field(default_factory=list)
    cum_bytes: list[int] = field(default_factory=lambda: [0])  # bytes of refs[:i]
    cum_blocks: list[int] = field(default_factory=lambda: [0])  # blocks of refs[:i]
    where: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # (key, etag) -> indices
    position: int = 0  # the entry the reader is at
    cursor: int = 0  # entries before it have been handed out for fetching
    opened: set[int] = field(default_factory=set)  # opened entries within SLACK of the position
    last_active: float = 0.0

    def __len__(self) -> int:
        return len(self.refs)

    def extend(self, refs: Iterable[ObjectRef]) -> None:
        for ref in refs:
            i = len(self.refs)
            self.refs.append(ref)
            self.cum_bytes.append(self.cum_bytes[-1] + ref.size)
            self.cum_blocks.append(self.cum_blocks[-1] + block_count(ref.size, self.block_size))
            self.where.setdefault((ref.key, ref.etag), []).append(i)

    def ahead_bytes(self) -> int:
        """Bytes handed out for fetching ahead of the reader (the stream's part of the window)."""
        return self.cum_bytes[self.cursor] - self.cum_bytes[self.position] if self.cursor > self.position else 0

    def distance(self, key: BlockKey) -> float:
        """Blocks read before ``key`` if the reader follows the order; inf if not announced ahead."""
        indices = self.where.get((key.key, key.etag))
        if not indices:
            return math.inf
        low = max(0, self.position - SLACK)
        for j in range(bisect_left(indices, low), len(indices)):
            i = indices[j]
            if i < self.position and i in self.opened:
                continue  # read already (the entry at the position is being read: it counts)
            return float(self.cum_blocks[i] + key.index - self.cum_blocks[self.position])
        return math.inf

    def match(self, ref: ObjectRef) -> int | None:
        """The entry an open of ``ref`` is: the nearest not yet opened in the match range."""
        indices = self.where.get((ref.key, ref.etag))
        if not indices:
            return None
        low = max(0, self.position - SLACK)
        high = self.position + MATCH_AHEAD
        for j in range(bisect_left(indices, low), len(indices)):
            i = indices[j]
            if i >= high:
                return None
            if i not in self.opened:
                return i
        return None

    def advance(self, index: int) -> None:
        self.opened.add(index)
        if index > self.position:
            self.position = index
            self.cursor = max(self.cursor, index)
            low = self.position - SLACK
            self.opened = {i for i in self.opened if i >= low}
            if low > max(1024, len(self.refs) // 2):
                self.compact(low)

    def compact(self, drop: int) -> None:
        """Forget the first ``drop`` entries (behind the reader by more than SLACK)."""
        refs = self.refs[drop:]
        position, cursor = self.position - drop, self.cursor - drop
        opened = {i - drop for i in self.opened if i >= drop}
        self.refs, self.cum_bytes, self.cum_blocks, self.where = [], [0], [0], {}
        self.extend(refs)
        self.position, self.cursor, self.opened = position, cursor, opened


class ReadOrder:
    """The announced orders of every stream of one mount (module docstring)."""

    def __init__(self, block_size: int, settings: ReadOrderSettings | None = None, *,
                 clock: Clock | None = None) -> None:
        self.block_size = block_size
        self.settings = settings or ReadOrderSettings()
        self.clock = clock or SystemClock()
        self.stats = ReadOrderStats()
        self._streams: dict[str, Stream] = {}
        # The window actually used: the fetcher (OrderPrefetcher) bounds the configured one by the cache.
        self.window_limit_bytes = self.settings.window_bytes
        self.changed = asyncio.Event()  # set when a stream is added, extended, advanced or ended

    # ------------------------------------------------------------------ announcing
    def announce(self, stream_id: str, refs: list[ObjectRef], *, append: bool = False) -> Stream:
        """Set (or with ``append`` extend) the order of ``stream_id``; an empty list without
        ``append`` ends the stream. ``ReadOrderLimitError`` over a bound, nothing changed."""
        s = self.settings
        if not isinstance(stream_id, str) or not 0 < len(stream_id) <= MAX_STREAM_ID_CHARS:
            raise ReadOrderLimitError(f"stream id must be a string of 1 to {MAX_STREAM_ID_CHARS} characters")
        if len(refs) > s.max_page_entries:
            raise ReadOrderLimitError(f"announcement of {len(refs)} files is over the limit of {s.max_page_entries} "
                                      f"per request: announce long orders in pages (append)")
        old = self._streams.get(stream_id)
        if not refs and not append:
            self.end(stream_id)
            return Stream(stream_id, self.block_size)
        if old is not None and append and old.position > SLACK:
            old.compact(old.position - SLACK)  # what the reader passed need not be held
        stream_total = (len(old) if old is not None and append else 0) + len(refs)
        if stream_total > s.max_stream_entries:
            raise ReadOrderLimitError(f"stream {stream_id!r} would hold {stream_total} files, over the limit of "
                                      f"{s.max_stream_entries} per stream: announce the next page later")
        others = self.held_entries() - (len(old) if old is not None else 0)
        if others + stream_total > s.max_total_entries or (old is None and len(self._streams) >= s.max_streams):
            self._drop_stale(keep=stream_id)
            others = self.held_entries() - (len(old) if old is not None else 0)
            if others + stream_total > s.max_total_entries:
                raise ReadOrderLimitError(f"the mount would hold {others + stream_total} announced files, over its "
                                          f"limit of {s.max_total_entries}: end streams no longer read")
            if old is None and len(self._streams) >= s.max_streams:
                raise ReadOrderLimitError(f"the mount has {len(self._streams)} announced streams, its limit: "
                                          f"end streams no longer read")
        if old is None or not append:
            stream = Stream(stream_id, self.block_size)
            self._streams[stream_id] = stream
        else:
            stream = old
        stream.extend(refs)
        stream.last_active = self.clock.monotonic()
        self.stats.announced_files += len(refs)
        self.stats.announced_bytes += sum(r.size for r in refs)
        self._notify()
        return stream

    def end(self, stream_id: str) -> bool:
        stream = self._streams.pop(stream_id, None)
        if stream is None:
            return False
        self._notify()
        return True

    def _drop_stale(self, keep: str) -> None:
        now = self.clock.monotonic()
        for sid, stream in list(self._streams.items()):
            if sid != keep and now - stream.last_active >= self.settings.stale_after_s:
                self.end(sid)
                self.stats.streams_dropped += 1

    def _notify(self) -> None:
        self.changed.set()

    # ------------------------------------------------------------------ reading
    def opened(self, ref: ObjectRef, is_cached: Callable[[BlockKey], bool]) -> bool:
        """An open of ``ref``: advance the stream that announced it nearest; count a hit or a stall
        (``is_cached`` of its first block). Returns whether a stream matched."""
        best: tuple[int, Stream, int] | None = None
        for stream in self._streams.values():
            i = stream.match(ref)
            if i is not None:
                distance = i - stream.position
                if best is None or distance < best[0]:
                    best = (distance, stream, i)
        if best is None:
            self.stats.unmatched_opens += 1
            return False
        _, stream, index = best
        if ref.size == 0 or is_cached(BlockKey(ref.key, ref.etag, 0)):
            self.stats.order_hits += 1
        else:
            self.stats.stalls += 1
        stream.advance(index)
        stream.last_active = self.clock.monotonic()
        self._notify()
        return True

    def ahead(self, stream: Stream, share_bytes: int, *, limit: int | None = None) -> list[ObjectRef]:
        """Hand out the next entries of ``stream`` to fetch (at most ``limit``), keeping its bytes
        ahead of the reader within ``share_bytes`` (the entry at the position always, however large)."""
        if stream.cursor < stream.position:
            stream.cursor = stream.position
        out: list[ObjectRef] = []
        while stream.cursor < len(stream.refs) and (limit is None or len(out) < limit):
            ref = stream.refs[stream.cursor]
            if stream.cursor > stream.position and stream.ahead_bytes() + ref.size > share_bytes:
                break
            out.append(ref)
            stream.cursor += 1
        return out

    # ------------------------------------------------------------------ eviction order (VictimOrder)
    def active(self) -> bool:
        return bool(self._streams)

    def next_use(self, key: BlockKey) -> float:
        best = math.inf
        for stream in list(self._streams.values()):
            try:
                d = stream.distance(key)
            except (IndexError, KeyError):
                # The disk tier asks from a worker thread: a compaction on the loop may be half
                # done. That stream's answer is unknown this once (see the module docstring).
                continue
            if d < best:
                best = d
        return best

    # ------------------------------------------------------------------ stats
    def holds(self, stream: Stream) -> bool:
        """Whether ``stream`` is still announced (not ended, not replaced by a new order)."""
        return self._streams.get(stream.id) is stream

    def streams(self) -> list[Stream]:
        return list(self._streams.values())

    def held_entries(self) -> int:
        return sum(len(s) for s in self._streams.values())

    def window_bytes(self) -> int:
        return sum(s.ahead_bytes() for s in self._streams.values())

    def snapshot(self) -> dict[str, object]:
        st = self.stats
        return {
            "streams": len(self._streams),
            "held_entries": self.held_entries(),
            "announced_files": st.announced_files,
            "announced_bytes": st.announced_bytes,
            "order_hits": st.order_hits,
            "stalls": st.stalls,
            "unmatched_opens": st.unmatched_opens,
            "streams_dropped": st.streams_dropped,
            "prefetched_blocks": st.prefetched_blocks,
            "prefetch_errors": st.prefetch_errors,
            "window_bytes": self.window_bytes(),
            "window_limit_bytes": self.window_limit_bytes,
        }
