"""Where the bytes of reads came from: the counters behind "what the cache saved".

A read is answered block by block, and each block by one place: the RAM tier, the disk tier, the
shared cluster tier, or the source (a GET). ``ReadTraffic`` counts, per place, the bytes of reads it
answered (the range each reader asked for, not the whole block) and the block requests it answered.
Every block request answered by RAM, disk or the cluster tier is one ranged GET the source did not
get, and its bytes are bytes not pulled from the source: that is what ``avoided_*`` sums, and what
the operator adds up per Dataset (``csi_driver.operator.usage``).

**A fetch is not a saving.** A block is fetched whole, and read in pieces (the kernel asks for
128 KiB at a time): the bytes of a block that a load brought from the source (or the cluster tier)
are that place's until a read has had them, whether a reader waited on the load, read-ahead started
it, or a warm did. Each block is remembered with its origin and the bytes no read has had since
(``settle``); a read that then finds it in RAM or on disk is credited to the origin for as many of
those bytes as it reads (and its request with them), and to the tier for the rest (``hit``). A cold
pass the source served whole shows no saving, however it was read; a second pass is all hits. The
memory is bounded (``MAX_UNREAD_BLOCKS``, oldest forgotten first) and lasts as long as the daemon:
a block warmed by an earlier daemon counts as a hit when first read. A byte read twice before the
rest of its block is read once counts as the source's both times (a conservative error).

**The hit ratio** (``hit_ratio``, docs/statistics.md) is the share of the bytes read that did not come
from the source: (RAM + disk + cluster) / all. The same definition is behind ``cachefs stats``,
``/metrics`` (``cachefs_hit_ratio``, ``cachefs_volume_hit_ratio{scope="all"}``), the Dataset's
``HIT`` column and the dashboard; ``hit_ratios`` breaks it down (local = RAM + disk, cluster) with
the source's share beside them.

The seam is deliberately narrow, so the engine can change around it: the block cache calls
``hit`` for a block found in RAM, ``waiting`` for a reader that starts or joins a load, then
``settle`` when that load's bytes are in (naming the place they came from: every reader that
waited on it is credited to that place) or ``drop`` when it failed (nothing was served; the block
cache drops from its load futures' done-callback). A load
nobody reads (read-ahead, a warm) credits nothing; a reader that later finds its block in RAM is a
RAM hit. Everything runs on the event loop: plain integers, no lock.

The page cache of the kernel answers some re-reads before they reach the daemon; those are
invisible here (and cost the source nothing either).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

RAM, DISK, CLUSTER, SOURCE = "ram", "disk", "cluster", "source"
PLACES = (RAM, DISK, CLUSTER, SOURCE)
LOCAL_PLACES = (RAM, DISK)
# Blocks fetched and not wholly read yet, remembered with the place they came from and the bytes not
# read since. Each entry is a block key, a place and a count (~200 bytes): 131,072 of them (~25 MiB
# at most) cover 1 TiB of 8 MiB blocks fetched and not read through; beyond it the oldest are
# forgotten, and the rest of their first reads count as hits (an overstatement bounded by them).
MAX_UNREAD_BLOCKS = 131_072


@dataclass
class ReadTraffic:
    """Bytes and block requests of reads, by the place that answered them."""

    served_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PLACES, 0))
    served_blocks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PLACES, 0))
    # Readers waiting on a load, per block: (bytes they asked for, how many readers).
    _pending: dict[Hashable, tuple[int, int]] = field(default_factory=dict, repr=False)
    # Blocks a load brought from the source or the cluster tier, with the bytes of each no read has
    # had since: their first reads are credited to that place (the module docstring).
    _unread: OrderedDict[Hashable, tuple[str, int]] = field(default_factory=OrderedDict, repr=False)
    unread_limit: int = MAX_UNREAD_BLOCKS

    def served(self, place: str, nbytes: int, blocks: int = 1) -> None:
        self.served_bytes[place] += nbytes
        self.served_blocks[place] += blocks

    def hit(self, key: Hashable, place: str, nbytes: int) -> None:
        """A read found ``key`` in ``place`` (RAM): a hit, except for bytes of the block no read has
        had since a load brought it from the source or the cluster tier (credited there)."""
        self._credit(key, place, nbytes, 1)

    def waiting(self, key: Hashable, nbytes: int, *, ready: bool = False) -> None:
        """A reader started or joined the load of ``key``, for ``nbytes`` of the block. ``ready``: the
        load has its bytes already (a warm load holds them until they are on disk): served from memory."""
        if ready:
            self.hit(key, RAM, nbytes)
            return
        wanted, readers = self._pending.get(key, (0, 0))
        self._pending[key] = (wanted + nbytes, readers + 1)

    def settle(self, key: Hashable, place: str, size: int = 0) -> None:
        """The load of ``key`` got its ``size`` bytes from ``place``: credit every reader that waited
        on it. From the source or the cluster tier, the rest of the block (what no waiting reader
        asked for) is remembered: its first reads are that place's, not hits. From a local tier, a
        block still remembered keeps being credited to where it first came from."""
        wanted, readers = self._pending.pop(key, (0, 0))
        if place in LOCAL_PLACES:
            if readers:
                self._credit(key, place, wanted, readers)
            return
        self._unread.pop(key, None)
        if readers:
            self.served(place, wanted, readers)
        if size > wanted:
            self._unread[key] = (place, size - wanted)
            if len(self._unread) > self.unread_limit:
                self._unread.popitem(last=False)

    def _credit(self, key: Hashable, place: str, nbytes: int, requests: int) -> None:
        """Credit a read of ``nbytes`` of ``key`` found in ``place``: to the place the block came from
        for as many of its bytes as no read has had yet (and the request with them), the rest to
        ``place``."""
        entry = self._unread.get(key)
        if entry is None:
            self.served(place, nbytes, requests)
            return
        origin, left = entry
        first = min(nbytes, left)
        self.served(origin, first, requests)
        self.served_bytes[place] += nbytes - first
        if left > first:
            self._unread[key] = (origin, left - first)
            self._unread.move_to_end(key)
        else:
            del self._unread[key]

    def drop(self, key: Hashable) -> None:
        """The load of ``key`` failed: its readers got an error, nothing was served."""
        self._pending.pop(key, None)

    def dropper(self, key: Hashable) -> Callable[[asyncio.Future[Any]], None]:
        """A done-callback for the future of the load of ``key``: a failed or cancelled load drops
        its readers (and its exception counts as retrieved: a load nobody awaited logs nothing)."""
        def done(fut: asyncio.Future[Any]) -> None:
            if fut.cancelled() or fut.exception() is not None:
                self.drop(key)
        return done

    @property
    def waiting_loads(self) -> int:
        return len(self._pending)

    def snapshot(self) -> dict[str, Any]:
        """Served bytes and blocks per place, what did not reach the source, and hit ratios by bytes."""
        total = sum(self.served_bytes.values())

        def ratio(places: tuple[str, ...]) -> float:
            return round(sum(self.served_bytes[p] for p in places) / total, 6) if total else 0.0

        return {
            "served_bytes": dict(self.served_bytes),
            "served_blocks": dict(self.served_blocks),
            "avoided_source_bytes": total - self.served_bytes[SOURCE],
            "avoided_source_requests": sum(self.served_blocks.values()) - self.served_blocks[SOURCE],
            "hit_ratio": ratio((RAM, DISK, CLUSTER)),
            "hit_ratios": {"local": ratio(LOCAL_PLACES), "cluster": ratio((CLUSTER,)), "source": ratio((SOURCE,))},
        }
