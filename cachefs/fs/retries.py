"""Opens the kernel retries after an ESTALE, and the file each retry looked up.

An OPEN of a file whose name went (a rename over it, an unlink) since the kernel resolved the path
answers ESTALE (``CacheFS.open``). The kernel retries such an open once, in the same thread
(``do_filp_open`` with LOOKUP_REVAL): it looks the name up again, which reaches the daemon as a
LOOKUP, and sends OPEN for the inode that lookup answered. If another rename or unlink of the name
lands between that LOOKUP and that OPEN, a second ESTALE would reach the application from open(2),
although the name always existed. So each ESTALE answered is remembered here as a retry to come,
and the file the retry's lookup answers is *awaited*: until its OPEN comes, an unlink of it or a
rename over it keeps its content as it does for an open handle (``Node.awaited_opens`` counts with
``Node.open_handles``, ``cachefs.fs.keep``), and the OPEN opens that version.

A retry is told apart by the thread that sends it: the FUSE header's pid, which is the thread's id.
The kernel writes 0 there for a thread its connection's pid namespace cannot see (an application
in another container than the daemon's, under Kubernetes): such retries are known by the name that
was answered ESTALE instead, and any lookup of that name by an unknown thread claims one (several
threads may retry the same name at once; a lookup that is no retry may claim one too, which only
keeps a file a while longer than needed). An OPEN of an awaited file by an unknown thread ends one
claim of that file.

A wait is released at the OPEN (of a known thread: whatever it opens), when the kernel forgets the
inode (it can open it no more: the path walk holds a reference until its OPEN is sent), or past
``window_s``. Only names answered ESTALE, and threads that were, are tracked, so a lookup alone never
makes a rename copy anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

from cachefs.fs.inodes import InodeTable, Node
from tiering.clock import Clock

# Retries of one name by unknown threads remembered at most: one per thread that may retry it at
# once (a reader pool); past this the oldest goes, which can only cost that retry a second ESTALE.
MAX_RETRIES_PER_NAME = 64

Key = Union[int, str]  # a known thread's id, or the name (path) an unknown thread was answered ESTALE for


@dataclass(slots=True, eq=False)
class _Retry:
    deadline: float  # monotonic: past it the retry is taken to be over
    node: Node | None = None  # the file the retry's last lookup answered (its OPEN is awaited)


class RetriedOpens:
    """Retries to come of opens answered ESTALE, and the file each one's lookup found. ``hold(node,
    True)`` is called when an open of ``node`` becomes awaited, ``hold(node, False)`` when it no longer
    is: the filesystem holds what it keeps for that open meanwhile."""

    def __init__(self, clock: Clock, window_s: float, hold: Callable[[Node, bool], None]) -> None:
        self._clock = clock
        self._window_s = window_s
        self._hold = hold
        self._retries: dict[Key, list[_Retry]] = {}

    def __len__(self) -> int:
        return len(self._retries)

    def stale(self, caller: int, path: str) -> None:
        """An open of ``path`` by ``caller`` (0: unknown) was answered ESTALE: its retry comes next."""
        self.expire()
        retry = _Retry(self._clock.monotonic() + self._window_s)
        if caller:
            for old in self._retries.pop(caller, ()):
                self._end(old)
            self._retries[caller] = [retry]
            return
        retries = self._retries.setdefault(path, [])
        retries.append(retry)
        if len(retries) > MAX_RETRIES_PER_NAME:
            self._end(retries.pop(0))

    def retrying(self, caller: int, path: str) -> bool:
        """Whether a lookup of ``path`` by ``caller`` may be a retry's (the file it answers is awaited)."""
        self.expire()
        return bool(self._retries) and (caller or path) in self._retries

    def looked_up(self, caller: int, path: str, node: Node) -> None:
        """The lookup of a retry answered ``node``: its OPEN is awaited (a known thread's, instead of the
        file its previous lookup found). An unknown thread's lookup claims a retry of ``path`` no lookup
        claimed yet; else it is taken for one that found ``node`` already, looking the name up again;
        else one more is awaited (most likely the same retry looking the name up again after another
        rename: the kernel forgets the file it found first soon, which ends that wait)."""
        retries = self._retries.get(caller or path)
        if not retries:
            return
        retry = retries[0] if caller else next((r for r in retries if r.node is None), None)
        if retry is None:
            retry = next((r for r in retries if r.node is node), None)
        if retry is None:
            if len(retries) >= MAX_RETRIES_PER_NAME:
                return
            retry = _Retry(0.0)
            retries.append(retry)
        retry.deadline = self._clock.monotonic() + self._window_s
        if retry.node is node:
            return
        self._end(retry)
        retry.node = node
        node.awaited_opens += 1
        self._hold(node, True)

    def take(self, caller: int, node: Node) -> _Retry | None:
        """``caller`` sent an OPEN of ``node``: the retry it was, if any, is over (a known thread's
        whatever file it opens). The caller of this method passes it to ``end`` once the open's handle
        holds what it needs."""
        if not self._retries:
            return None
        self.expire()
        if caller:
            retries = self._retries.pop(caller, None)
            return retries[0] if retries else None
        if not node.awaited_opens:
            return None
        for key, retries in list(self._retries.items()):
            if isinstance(key, str):
                for retry in retries:
                    if retry.node is node:
                        self._remove(key, retry)
                        return retry
        return None

    def end(self, retry: _Retry | None) -> None:
        if retry is not None:
            self._end(retry)

    def failed(self, caller: int, path: str) -> None:
        """A lookup of ``path`` by ``caller`` failed (ENOENT): a retried open(2) that made it failed."""
        if not self._retries:
            return
        if caller:
            for retry in self._retries.pop(caller, ()):
                self._end(retry)
            return
        for retry in list(self._retries.get(path, ())):
            if retry.node is None:
                self._remove(path, retry)

    def forgotten(self, inodes: InodeTable) -> None:
        """The kernel forgot some inodes: the retries awaiting an open of one of them are over."""
        for key, retries in list(self._retries.items()):
            for retry in list(retries):
                if retry.node is not None and not inodes.known(retry.node):
                    self._end(retry)
                    if isinstance(key, str):
                        self._remove(key, retry)

    def expire(self) -> None:
        """Retries past their window are over (their OPEN never came: the open(2) failed in the kernel)."""
        if not self._retries:
            return
        now = self._clock.monotonic()
        for key, retries in list(self._retries.items()):
            for retry in list(retries):
                if retry.deadline <= now:
                    self._end(retry)
                    self._remove(key, retry)

    def _remove(self, key: Key, retry: _Retry) -> None:
        retries = self._retries.get(key)
        if retries is not None:
            retries.remove(retry)
            if not retries:
                del self._retries[key]

    def _end(self, retry: _Retry) -> None:
        if retry.node is None:
            return
        node, retry.node = retry.node, None
        node.awaited_opens -= 1
        self._hold(node, False)
