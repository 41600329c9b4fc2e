"""What a file keeps for its open handles when its name goes: an unlink, or a rename over it.

POSIX: a descriptor keeps referring to the file it opened, whatever happens to its name. Over an
object store the name is the object, so before the object is deleted or replaced, a file that open
handles still use is staged (``KeptFiles.keep``) and write-back copies its stored version in
(``WriteBack.keep_for_handles``). A file is kept likewise for an open that is on its way: the retry
of an open answered ESTALE, whose lookup found this file (``cachefs.fs.retries``).

For the length of the unlink or rename (``KeptFiles.losing_name``) the file's node carries an event:
an open arriving meanwhile waits for it (``KeptFiles.settled``), so that it either came first and
counts among the handles whose content is kept, or finds the file gone (ESTALE: the kernel looks the
name up again). Without it, an open arriving between the count of the handles and the delete or
replacement in the store got the store's version and read ESTALE once it was replaced (issue 38,
finding 4). The lookup of a retried open waits the same way, so the file it answers is one whose
loss of name, if any, is still to come and counts its awaited open.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Awaitable, Callable

from cachefs.fs.inodes import InodeTable, Node
from cachefs.fs.retries import RetriedOpens
from tiering.writeback.staged import StagedFile

# A file unlinked, or replaced by a rename, while handles opened only for reading hold it is first
# copied into staging (through the block cache), so they go on reading the parts never cached, up to
# this size: the unlink waits for the copy, which at the 300-700 MiB/s a cold read reaches (see
# docs/dataplane.md) takes a fraction of a second, and at a slow 50 MB/s link still little more than
# one. Larger files are not fetched: what was cached still reads, the rest answers ENOENT (ESTALE
# after a rename over it). Writers are always kept: their next write needs the content.
KEEP_FOR_READERS_MAX_BYTES = 64 * 1024 * 1024

# How long an open waits for an unlink or a rename over its file that is under way (``losing_name``).
# Those are bounded themselves (a copy-in of at most KEEP_FOR_READERS_MAX_BYTES, a server-side copy, a
# durable record's deadline); past this the open goes on as if it had come first.
LOSING_NAME_WAIT_S = 60.0


class KeptFiles:
    """Keeps the content of files losing their name for the opens that use them. ``staged(node)`` is the
    node's staged file if any, ``stage(node)`` stages it (its stored version copied in on demand)."""

    def __init__(self, inodes: InodeTable, retries: RetriedOpens, staged: Callable[[Node], StagedFile | None],
                 stage: Callable[[Node], Awaitable[StagedFile]]) -> None:
        self._inodes = inodes
        self._retries = retries
        self._staged = staged
        self._stage = stage

    @contextlib.asynccontextmanager
    async def losing_name(self, path: str) -> AsyncIterator[None]:
        """The file at ``path`` (if the kernel knows one) is about to lose its name: opens of it wait
        until this block ends."""
        node = self._inodes.at(path)
        if node is None or node.is_dir or node.losing_name is not None:
            yield  # nothing known at that name, or an unlink/rename of it already holds the opens
            return
        done = node.losing_name = asyncio.Event()
        try:
            yield
        finally:
            node.losing_name = None
            done.set()

    async def settled(self, node: Node, timeout_s: float = LOSING_NAME_WAIT_S) -> bool:
        """Wait (at most ``timeout_s``) until no unlink or rename over ``node`` is under way; False if
        none was."""
        event = node.losing_name
        if event is None or timeout_s <= 0:
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)
        return True

    async def keep(self, path: str) -> None:
        """Before the file at ``path`` loses its name: a file that open handles still use is staged, so
        that write-back copies its stored version in before the object is deleted or replaced: writers
        always, handles opened only for reading up to ``KEEP_FOR_READERS_MAX_BYTES``, and so are awaited
        opens (``cachefs.fs.retries``: not known yet to be writers, they are kept as readers)."""
        self._retries.expire()
        node = self._inodes.at(path)
        if (node is None or node.is_dir or not (node.open_handles or node.awaited_opens)
                or self._staged(node) is not None):
            return
        info = node.info
        if node.writers or (info is not None and info.size <= KEEP_FOR_READERS_MAX_BYTES):
            sf = await self._stage(node)
            if info is not None:
                sf.mtime = info.mtime  # staged, not changed: fstat on its handles shows the same file
