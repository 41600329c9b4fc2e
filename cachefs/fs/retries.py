"""Opens the kernel retries after an ESTALE, and the file each retry looked up.

An OPEN of a file whose name went (a rename over it, an unlink) since the kernel resolved the path
answers ESTALE (``CacheFS.open``). The kernel retries such an open once, in the same thread
(``do_filp_open`` with LOOKUP_REVAL): it looks the name up again, which reaches the daemon as a
LOOKUP, and sends OPEN for the inode that lookup answered. If another rename or unlink of the name
lands between that LOOKUP and that OPEN, a second ESTALE would reach the application from open(2),
although the name always existed. So the thread that got the ESTALE is remembered here (by the
FUSE header's pid, which is the thread's id), and the file its next lookup answers is *awaited*:
until its OPEN comes, an unlink of it or a rename over it keeps its content as it does for an open
handle (``Node.awaited_opens`` counts with ``Node.open_handles``), and the OPEN opens that version.

A wait is released at the thread's next OPEN (whatever it opens), when the kernel forgets the inode
(it can open it no more: the path walk holds a reference until its OPEN is sent), or past
``window_s``. Only threads that were answered ESTALE are tracked, so a lookup alone never makes a
rename copy anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from cachefs.fs.inodes import InodeTable, Node
from tiering.clock import Clock


@dataclass(slots=True)
class _Retry:
    deadline: float  # monotonic: past it the retry is taken to be over
    node: Node | None = None  # the file the retry's last lookup answered (its OPEN is awaited)


class RetriedOpens:
    """Threads whose open was answered ESTALE, and the file each one's retry looked up. ``hold(node,
    True)`` is called when an open of ``node`` becomes awaited, ``hold(node, False)`` when it no longer
    is: the filesystem holds what it keeps for that open meanwhile."""

    def __init__(self, clock: Clock, window_s: float, hold: Callable[[Node, bool], None]) -> None:
        self._clock = clock
        self._window_s = window_s
        self._hold = hold
        self._retries: dict[int, _Retry] = {}

    def __len__(self) -> int:
        return len(self._retries)

    def stale(self, caller: int) -> None:
        """``caller``'s open was answered ESTALE: its retry comes next. Caller 0 (the kernel itself) is
        not tracked."""
        if not caller:
            return
        self.expire()
        self._end(self._retries.pop(caller, None))
        self._retries[caller] = _Retry(self._clock.monotonic() + self._window_s)

    def retrying(self, caller: int) -> bool:
        """Whether ``caller`` is retrying an open answered ESTALE (its lookups are awaited)."""
        self.expire()
        retry = self._retries.get(caller) if caller else None
        return retry is not None and retry.deadline > self._clock.monotonic()

    def looked_up(self, caller: int, node: Node) -> None:
        """``caller``'s retry looked up ``node``: its OPEN of it is awaited (instead of the one before)."""
        retry = self._retries.get(caller)
        if retry is None:
            return
        retry.deadline = self._clock.monotonic() + self._window_s
        if retry.node is node:
            return
        self._end(retry)
        retry.node = node
        node.awaited_opens += 1
        self._hold(node, True)

    def take(self, caller: int) -> _Retry | None:
        """``caller`` sent an OPEN: its retry (if it had one) is over. The caller of this method calls
        ``end`` with it once the open's handle holds what it needs."""
        if not self._retries:
            return None
        self.expire()
        return self._retries.pop(caller, None) if caller else None

    def end(self, retry: _Retry | None) -> None:
        self._end(retry)

    def failed(self, caller: int) -> None:
        """A lookup of ``caller`` failed: if it was retrying an open, that open(2) failed with it."""
        self._end(self._retries.pop(caller, None) if caller else None)

    def forgotten(self, inodes: InodeTable) -> None:
        """The kernel forgot some inodes: the retries awaiting an open of one of them are over."""
        for retry in list(self._retries.values()):
            if retry.node is not None and not inodes.known(retry.node):
                self._end(retry)

    def expire(self) -> None:
        """Retries past their window are over (the thread's OPEN never came: it failed in the kernel)."""
        if not self._retries:
            return
        now = self._clock.monotonic()
        for caller, retry in list(self._retries.items()):
            if retry.deadline <= now:
                del self._retries[caller]
                self._end(retry)

    def _end(self, retry: _Retry | None) -> None:
        if retry is None or retry.node is None:
            return
        node, retry.node = retry.node, None
        node.awaited_opens -= 1
        self._hold(node, False)
