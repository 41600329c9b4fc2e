"""Reply writers: threads that send the large replies, so the kernel's copy of their bytes is not the loop's.

A READ reply is one ``writev`` to ``/dev/fuse``, and in that call the kernel copies the data into the
pages of the reader's request (``fuse_copy_pages``): on the 2-core VM of issue 39 that copy was
0.26-0.36 of the loop thread's 0.46-0.52 CPU-s per GiB of a cold read (``benchmarks.dataplane``,
the loop's system time), the largest part of what caps one mount at one core. The loop is the thread
that schedules; the bytes travel elsewhere (STYLE point 14). So a reply of ``OFFLOAD_MIN_BYTES`` or
more is handed to one of a few writer threads, which make the same ``writev`` with the GIL released.
The reply's buffers are the handler's own (a view of the RAM tier's block): nothing is copied to hand
it over, and a block buffer is used again only once no view of it is alive (``tiering.buffers``).

Replies of one connection may arrive in any order (the kernel matches them by ``unique``), and one
``writev`` is one whole reply, so writers need no lock between them. There are ``WRITERS`` of them,
each taking the next reply from one queue, so that none carries more than a share of the copy.
Smaller replies are written on the loop as before: handing a 100 KiB reply to a thread costs about
what its copy does (two thread wake-ups). When every writer is busy and ``MAX_QUEUED`` replies
wait, the loop writes the next one itself: the queue stays short and a slow reader of large
replies slows the loop no more than before.

The end: ``close`` lets the writers finish what is queued (bounded by ``CLOSE_WAIT_S``) before the
session closes the descriptor, so no reply is ever written to a descriptor number the process has
reused. ``ENODEV`` (unmounted) on a writer ends the session through the loop, as it does on the loop.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Union

log = logging.getLogger(__name__)

Buffer = Union[bytes, bytearray, memoryview]

# Replies this large and larger are written by a writer thread: a 1 MiB READ reply's copy costs the
# writing thread ~0.3 ms here, a hand-over ~20 us of CPU between the two threads.
OFFLOAD_MIN_BYTES = 256 * 1024
# Writer threads. The copy of a cold read's replies into the mount's page cache is the largest work
# of one thread in the daemon (docs/dataplane.md, "The reply copy on four writers"), and whatever one
# thread does caps the mount on any number of cores: each writer takes an equal share of the replies,
# so four keep each one's share at a quarter. On 2 cores four cost what two do (one wake-up per reply
# either way, and the same bytes copied): measured, the busiest thread of a cold 1 GiB read fell from
# a writer's 0.27-0.61 CPU-s/GiB to 0.18-0.41 in the same loaded rounds. More than four: the loop
# thread and the readers are then as busy as a writer, and each thread reserves 8 MiB of stack.
WRITERS = 4
# Replies waiting for a writer beyond which the loop writes the next one itself.
MAX_QUEUED = 8
# How long close waits for the queued replies (each one writev of at most 1 MiB and a page).
CLOSE_WAIT_S = 5.0


class ReplyWriters:
    """A few threads that each ``writev`` whole replies to one descriptor (module docstring)."""

    def __init__(self, fd: int, on_gone: Callable[[], None], threads: int = WRITERS,
                 max_queued: int = MAX_QUEUED) -> None:
        self._fd = fd
        self._on_gone = on_gone  # called in a writer thread when the connection is gone (ENODEV)
        self._max_queued = max_queued
        self._queue: queue.SimpleQueue[tuple[int, Sequence[Buffer]] | None] = queue.SimpleQueue()
        self._pending = 0  # queued or being written
        self._lock = threading.Lock()
        self._closed = False
        self.offloaded = 0  # replies written by a writer thread
        self._threads = [threading.Thread(target=self._run, name=f"fuse-reply-{i}", daemon=True)
                         for i in range(max(1, threads))]
        for thread in self._threads:
            thread.start()

    def submit(self, buffers: Sequence[Buffer], fd: int | None = None) -> bool:
        """Queue one whole reply, to be written on ``fd`` (the descriptor its request was read from:
        each clone of the connection answers its own requests; default the session's); False (nothing
        queued) when the writers are closed or ``max_queued`` replies already wait: the caller then
        writes it itself."""
        with self._lock:
            if self._closed or self._pending >= self._max_queued:
                return False
            self._pending += 1
            self.offloaded += 1
        self._queue.put((self._fd if fd is None else fd, buffers))
        return True

    def close(self, timeout_s: float = CLOSE_WAIT_S) -> bool:
        """Stop taking replies, let the writers write what is queued, and join them (at most
        ``timeout_s`` in all); whether every writer ended."""
        with self._lock:
            if self._closed:
                return all(not thread.is_alive() for thread in self._threads)
            self._closed = True
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        ended = all(not thread.is_alive() for thread in self._threads)
        if not ended:
            log.error("FUSE reply writers did not end within %.0f s", timeout_s)
        return ended

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fd, buffers = item
            try:
                write_reply(fd, buffers, self._on_gone)
            finally:
                with self._lock:
                    self._pending -= 1


def write_reply(fd: int, buffers: Sequence[Buffer], on_gone: Callable[[], None]) -> None:
    """One whole reply in one ``writev``; what its failures mean is the kernel's (session module)."""
    try:
        os.writev(fd, buffers)
    except OSError as exc:
        reply_failed(exc, on_gone)


def reply_failed(exc: OSError, on_gone: Callable[[], None]) -> None:
    """What a reply's failed ``writev`` means (the session writes its small replies itself)."""
    if exc.errno == errno.ENOENT:  # the kernel gave up on the request (interrupted, or aborted)
        return
    if exc.errno == errno.ENODEV:
        on_gone()
        return
    log.error("a FUSE reply failed: %s", exc)
