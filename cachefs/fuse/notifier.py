"""The kernel told what it should forget: FUSE_NOTIFY_INVAL_ENTRY and _INODE, from a thread of their own.

The session (``cachefs.fuse.session``) makes one ``Notifier`` at INIT where the kernel takes
notifications; the filesystem reports changes through ``cachefs.fs.kernelcache``.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
from collections.abc import Callable

from cachefs.fuse import wire

log = logging.getLogger("cachefs.fuse.session")

# Invalidations waiting for the notifier thread: a re-list that finds a whole directory changed
# queues two per file (~100 bytes each, ~6 MiB at the bound). Past it they are dropped and counted:
# the kernel then keeps what it has until its timeouts run out, as without notifications.
MAX_QUEUED_NOTICES = 65_536
# How long close() waits for the notifier thread; it may be held in the kernel on a lock a request
# we no longer answer holds, and then ends with the process.
NOTIFIER_JOIN_S = 2.0


class Notifier:
    """Unsolicited messages to the kernel (unique 0): FUSE_NOTIFY_INVAL_ENTRY and _INODE, written by a
    thread of their own.

    Not from the loop: the kernel handles a notification inside the write, and it may wait there for
    what a request we have not answered yet holds (``fuse_reverse_inval_entry`` takes the parent
    directory's inode lock, which a LOOKUP or a CREATE in it holds; ``invalidate_inode_pages2`` waits
    for a page a READ holds locked). Written from the loop, the reply that would release it could
    never be sent. The thread owns a duplicate of the descriptor, closed when it ends, so it never
    writes to a number reused after the session closed its own.

    ``report(code, error)`` is called from the thread after each write (0, or the positive errno):
    ENOENT means the kernel did not hold that entry or inode (normal: it forgot it, or never had it).
    A notice past ``MAX_QUEUED_NOTICES`` waiting is dropped and reported at once with ENOBUFS.
    """

    def __init__(self, fd: int, report: Callable[[int, int], None] | None = None) -> None:
        self.report = report
        self._queue: queue.SimpleQueue[list[bytes] | None] = queue.SimpleQueue()
        self._fd = os.dup(fd)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="fuse-notify", daemon=True)
        self._thread.start()

    def forget_entry(self, parent: int, name: bytes) -> None:
        """The kernel drops its entry ``name`` in directory ``parent`` (its next use looks it up)."""
        self._put(wire.notify_inval_entry(parent, name))

    def forget_inode(self, inode: int) -> None:
        """The kernel drops ``inode``'s attributes and cached pages (its next stat or read asks)."""
        self._put(wire.notify_inval_inode(inode, 0, 0))

    def _put(self, message: list[bytes]) -> None:
        if self._closed:
            return
        if self._queue.qsize() >= MAX_QUEUED_NOTICES:
            if self.report is not None:
                self.report(wire.OUT_HEADER.unpack(message[0])[1], errno.ENOBUFS)
            return
        self._queue.put(message)

    def _run(self) -> None:
        try:
            while (message := self._queue.get()) is not None:
                code = wire.OUT_HEADER.unpack(message[0])[1]
                try:
                    os.writev(self._fd, message)
                    error = 0
                except OSError as exc:
                    error = exc.errno or errno.EIO
                    if error == errno.ENODEV:  # the connection is gone: nothing more to tell
                        self._closed = True
                        return
                    if error != errno.ENOENT:
                        log.debug("a FUSE notification (%d) failed: %s", code, exc)
                if self.report is not None:
                    self.report(code, error)
        finally:
            os.close(self._fd)

    def close(self) -> None:
        """Stop taking notices, let the thread write what is queued, and wait for it (bounded)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(NOTIFIER_JOIN_S)
        if self._thread.is_alive():
            log.warning("the FUSE notifier thread did not end in %g s (held in the kernel); it ends with the process",
                        NOTIFIER_JOIN_S)
