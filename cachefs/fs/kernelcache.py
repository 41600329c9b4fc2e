"""What the kernel caches of the mount, and how the filesystem tells it that something changed.

The kernel keeps a directory entry for ``entry_timeout`` (``--dir-ttl``), an inode's attributes for
``attr_timeout`` (``--attr-ttl``) and its pages across opens (``keep_cache``) without asking. When
the daemon learns that the bucket changed behind the mount's back (a re-list finds a name gone, or
a new version under it), it tells the kernel to drop what it holds of that name or inode at once,
rather than let it show the old size or bytes until its timeouts run out. The FUSE session sends
these as notifications (``cachefs.fuse.notifier.Notifier``); the filesystem only says what changed.
Changes made through the mount need nothing: the kernel saw them.
"""

from __future__ import annotations

from typing import Protocol


class KernelCache(Protocol):
    """The kernel's caches of one mount. Both calls return at once (the message is sent later, from
    elsewhere than the request being answered) and neither fails: a name or inode the kernel does not
    hold is nothing to drop."""

    def forget_entry(self, parent: int, name: bytes) -> None:
        """Drop the entry ``name`` of directory inode ``parent``: its next use looks it up again."""
        ...

    def forget_inode(self, inode: int) -> None:
        """Drop ``inode``'s attributes and cached pages: its next stat or read asks the daemon."""
        ...


class NoKernelCache:
    """A ``KernelCache`` for a filesystem with no kernel connection (yet): nothing to tell."""

    def forget_entry(self, parent: int, name: bytes) -> None:
        pass

    def forget_inode(self, inode: int) -> None:
        pass


class KernelCacheLog:
    """A ``KernelCache`` that records what it was told (tests, and a mount with no kernel)."""

    def __init__(self) -> None:
        self.entries: list[tuple[int, bytes]] = []
        self.inodes: list[int] = []

    def forget_entry(self, parent: int, name: bytes) -> None:
        self.entries.append((parent, name))

    def forget_inode(self, inode: int) -> None:
        self.inodes.append(inode)
