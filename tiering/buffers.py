"""Block buffers: page-aligned anonymous mappings, used again once nothing holds a view of them.

Every block the engine holds in RAM is one buffer from here, whoever filled it: the ranged-GET
workers receive a fetched block straight into one (``tiering.objectstore.rangedget``), the disk
tier reads a block file into one with ``O_DIRECT`` (``tiering.tiers.disk``). One pool for the process
(``BLOCK_BUFFERS``), so a block evicted from RAM frees its buffer for the next block whichever
path fills it, and the memory of the daemon stays the RAM tier's plus the blocks in flight plus
``IDLE_BUFFERS`` idle ones.

Why an anonymous mapping per block (``mmap`` with ``MAP_POPULATE``), used again, and not
``bytearray``: a cold read keeps every block it fetches (the RAM tier), so until the RAM tier is
full each one is new memory, and new memory costs page faults whatever allocates it.
``bytearray(n)`` takes those faults and zero-fills under the GIL: measured on a 2-core VM, 3.4 ms
per 8 MiB block that is kept (0.43 CPU-s/GiB, the heaviest line of the GIL profile of a cold read,
23% of its samples). ``MAP_POPULATE`` makes the kernel fault the whole mapping in one ``mmap``
call, which CPython makes with the GIL released: 2.6 ms per block, in a worker thread, off the
GIL. A mapping goes back to the system the moment its last view is dropped, so the daemon's RSS
follows the RAM tier, with none of the heap fragmentation that freed 8 MiB ``bytearray``s leave
behind. Once the RAM tier is full, every block fetched evicts one: ``BufferPool`` hands the evicted
block's mapping out again as soon as no view of it is alive, so a long cold read pays no page
faults at all (measured, 256 MiB through a 64 MiB RAM tier, engine only: 0.72 CPU-s/GiB with a new
mapping per block, 0.36-0.44 with the pool, which is what threaded boto3 spends).

A mapping starts on a page boundary, which is what ``O_DIRECT`` needs of the memory it transfers
to or from: the disk tier writes and reads blocks of ``MAP_MIN_BYTES`` and more without the page
cache, straight from and into these buffers (``DIRECT_ALIGN``; ``tiering.tiers.blockfile`` has the figures).
``aligned_page`` gives each thread one small aligned scratch buffer for the block header that
travels with such a transfer.
"""

from __future__ import annotations

import collections
import mmap
import threading

# Ranges below this get a bytearray: an mmap call costs ~14 us, a 100 KiB bytearray ~3 us (measured
# on this VM), and a small file's block is too small for its page faults to matter.
MAP_MIN_BYTES = 1024 * 1024
# Idle block buffers the pool keeps for the next fetches (BufferPool): a cold read past a full RAM
# tier frees one block per block it fetches, so two cover the reuse (the engine measured the same
# reuse with 2 as with 4), and 2 x 8 MiB is all the memory idle buffers add to the RAM tier's.
IDLE_BUFFERS = 2
# A private anonymous mapping, populated by the mmap call itself (Linux); elsewhere faulted on use.
_MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


def allocate_block(length: int) -> memoryview:
    """A new writable buffer of ``length`` bytes, faulted in at once, off the GIL (module docstring)."""
    if length < MAP_MIN_BYTES:
        return memoryview(bytearray(length))
    return memoryview(mmap.mmap(-1, length, flags=_MAP_FLAGS))


def _unused(mapping: mmap.mmap) -> bool:
    """Whether no view of ``mapping`` is alive anywhere (a RAM-tier entry, a reply, a disk write).

    CPython refuses to resize a mapping while any buffer is exported from it, and every view or
    slice of a block keeps that export; resizing to its own size changes nothing else (0.3 us).
    """
    try:
        mapping.resize(len(mapping))
    except BufferError:
        return False
    return True


def _can_probe() -> bool:
    """Whether this platform resizes anonymous mappings (Linux's ``mremap``): without it no buffer
    can be proven free, so the pool would only grow; it then maps a new buffer every time."""
    try:
        _unused(mmap.mmap(-1, mmap.PAGESIZE))
    except (OSError, ValueError, SystemError):
        return False
    return True


class BufferPool:
    """Block buffers allocated once and used again once nothing holds a view of them.

    Why: a new mapping per block costs its page faults (2.6 ms per 8 MiB, 0.33 CPU-s/GiB) every
    time, while a cold read that evicts from a full RAM tier frees a block for every one it
    fetches. Each mapping of ``MAP_MIN_BYTES`` or more that this pool hands out is remembered by
    the pool; ``take`` first looks, oldest first, for one of the length asked that no view is alive of
    any more (``_unused``), and only maps a new one when none is. So the pool holds the blocks that
    are alive anyway (the RAM tier's, those in flight) plus at most ``keep_free`` idle ones of any
    size: memory stays bounded by the RAM tier and the fetch slots, and an idle mapping beyond that
    is dropped (unmapped). A scan probes every mapping held (~0.3 us each, ~40 us for a 1 GiB RAM
    tier of 8 MiB blocks), against 2.6 ms for a new mapping.
    """

    def __init__(self, keep_free: int) -> None:
        self.keep_free = keep_free
        self._lock = threading.Lock()
        self._mappings: collections.deque[mmap.mmap] = collections.deque()  # oldest handed out first
        self.enabled = _can_probe()
        self.reused = 0  # buffers handed out again (tests, benchmarks)
        self.mapped = 0  # new mappings made

    def take(self, length: int) -> memoryview:
        if length < MAP_MIN_BYTES or not self.enabled:
            return allocate_block(length)
        with self._lock:
            found: mmap.mmap | None = None
            kept: collections.deque[mmap.mmap] = collections.deque()
            idle = 0
            for mapping in self._mappings:  # the oldest first: the most likely to be evicted by now
                if not _unused(mapping):
                    kept.append(mapping)
                elif found is None and len(mapping) == length:
                    found = mapping
                elif idle < self.keep_free:
                    idle += 1
                    kept.append(mapping)
                # else: one idle mapping too many (any size), dropped: unmapped when this reference goes
            self._mappings = kept
            if found is not None:
                kept.append(found)  # now the most recently handed out
                self.reused += 1
                return memoryview(found)  # the view exists before the lock is let go
        mapping = mmap.mmap(-1, length, flags=_MAP_FLAGS)  # outside the lock: the slow part
        view = memoryview(mapping)  # before the pool knows it, so no other thread can take it
        with self._lock:
            self._mappings.append(mapping)
            self.mapped += 1
        return view



# The one pool of the process: the ranged-GET workers and the disk tier take block buffers from it.
BLOCK_BUFFERS = BufferPool(keep_free=IDLE_BUFFERS)

# The alignment of O_DIRECT transfers, in memory and on disk: 4 KiB covers devices with 512-byte and
# 4 KiB logical blocks (the kernel refuses an O_DIRECT transfer that is not aligned to the device's).
DIRECT_ALIGN = 4096

_scratch = threading.local()


def align_up(length: int) -> int:
    """``length`` rounded up to a multiple of ``DIRECT_ALIGN``."""
    return -(-length // DIRECT_ALIGN) * DIRECT_ALIGN


def aligned_page(length: int) -> memoryview:
    """This thread's page-aligned scratch buffer of ``align_up(length)`` bytes (at least one page).
    It holds whatever the thread's last call left: the caller uses only what it wrote or read into
    it, and must not keep it (the thread's next call hands it out again)."""
    return _thread_buffer(_scratch, length)


_reply_scratch = threading.local()


def reply_scratch(length: int) -> memoryview:
    """This thread's page-aligned buffer of at least ``length`` bytes (rounded up to ``DIRECT_ALIGN``)
    for a block read to be answered at once and not kept (``DiskTier.get_for_reply``): a FUSE reader
    thread reads a small block file into it, checks it and writes the reply from it before it reads
    its next request. Apart from ``aligned_page``'s, so a header read cannot overwrite it. It grows
    to the largest block asked for and stays (1 MiB at most per reader: a READ is no larger)."""
    return _thread_buffer(_reply_scratch, length)


def _thread_buffer(holder: threading.local, length: int) -> memoryview:
    """``holder``'s page-aligned mapping for this thread, grown to ``align_up(length)`` (at least a
    page) where smaller, as a view of that many bytes."""
    size = align_up(max(length, 1))
    buffer: mmap.mmap | None = getattr(holder, "buffer", None)
    if buffer is None or len(buffer) < size:
        buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        holder.buffer = buffer
    return memoryview(buffer)[:size]
