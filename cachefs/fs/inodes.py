"""The inode table: every path the kernel has been told about, with a stable inode number.

Each such path has one ``Node`` with its inode number and the kernel's lookup count. ``forget``
drops a node once the kernel holds no reference and no handle is open, so the table stays bounded
by what the kernel caches, not by the size of the bucket. A name that is unlinked (or replaced by a
rename) leaves the path index at once, while its node lives on for the kernel's references and open
handles. A rename moves nodes to their new paths under the same inode numbers. A path that changes
kind (file to directory or back) gets a new inode, so nothing cached for the old kind is ever
attributed to the new one.

The table knows paths and counts; what a node's attributes are (store entry, staged data) is the
filesystem's business (``cachefs.fs.filesystem``).
"""

from __future__ import annotations

import asyncio

import errno
from dataclasses import dataclass
from typing import NewType

from cachefs.fs.errors import FsError
from tiering.blocks import ObjectRef
from tiering.protocols import ObjectInfo
from tiering.writeback.staged import StagedFile

InodeNo = NewType("InodeNo", int)
ROOT_INODE = InodeNo(1)


# slots: a node with its path and table entries is ~315 bytes instead of ~365 (measured, 3.11; three
# slots for opens added since, 24 bytes, their values shared until the node is opened); a walk
# of a million-object bucket leaves a node per entry the kernel caches, most of the RSS after one.
@dataclass(slots=True)
class Node:
    inode: InodeNo
    path: str  # relative to the mount root, no leading or trailing "/"; "" is the root
    is_dir: bool
    info: ObjectInfo | None = None  # files only
    mtime: float = 0.0
    lookups: int = 0
    open_handles: int = 0
    page_cache_etag: str | None = None  # ETag the kernel's page cache holds for this file
    staged: StagedFile | None = None  # write-back data of this file, while it has any
    writers: int = 0  # open handles that may write
    deleted: bool = False  # unlinked (or replaced by a rename) while the kernel still knows it
    local_gen: int = 0  # bumped by every change made through the mount (handles follow it)
    # Set while an unlink or a rename over this file runs (``cachefs.fs.keep``): an open arriving
    # meanwhile waits for it, so it either counts among the handles whose content is kept or sees
    # the file gone (ESTALE, and the kernel looks the name up again).
    losing_name: asyncio.Event | None = None
    # Retried opens awaited (``cachefs.fs.retries``): the content is kept for them as for open handles.
    awaited_opens: int = 0
    # ``info`` came from a listing that holds until this monotonic time, while the listing cache's
    # generation is ``fresh_gen``: an open or getattr then needs no lookup (``CacheFS._refresh_now``).
    fresh_until: float = 0.0
    fresh_gen: int = -1
    ref: ObjectRef | None = None  # ``info`` as the version its handles read (``CacheFS._ref``)


class InodeTable:
    """Nodes by inode number and by path. Directories show ``mount_time`` as their mtime (an object
    store has none for them)."""

    def __init__(self, mount_time: float) -> None:
        self.mount_time = mount_time
        self.root = Node(ROOT_INODE, "", True, mtime=mount_time, lookups=1)
        self._nodes: dict[InodeNo, Node] = {ROOT_INODE: self.root}
        self._by_path: dict[str, Node] = {"": self.root}
        self._next_inode = ROOT_INODE + 1

    def __len__(self) -> int:
        return len(self._nodes)

    def get(self, inode: int) -> Node:
        """The node of ``inode``; ENOENT if the kernel was never told about it or it was forgotten."""
        node = self._nodes.get(InodeNo(inode))
        if node is None:
            raise FsError(errno.ENOENT, f"unknown inode {inode}")
        return node

    def known(self, node: Node) -> bool:
        """Whether ``node`` is still in the table (the kernel has not forgotten it)."""
        return self._nodes.get(node.inode) is node

    def at(self, path: str) -> Node | None:
        """The node that has name ``path`` now, if the kernel knows one."""
        return self._by_path.get(path)

    def node_for(self, path: str, is_dir: bool) -> Node:
        """The node for ``path``, created if there is none (or if the path changed kind)."""
        node = self._by_path.get(path)
        if node is not None and node.is_dir != is_dir:
            # A file became a directory or back: a new inode, so nothing cached for the old kind
            # is ever attributed to the new one.
            self._by_path.pop(path)
            node = None
        if node is None:
            node = Node(InodeNo(self._next_inode), path, is_dir, mtime=self.mount_time)
            self._next_inode += 1
            self._nodes[node.inode] = node
            self._by_path[path] = node
        return node

    def forget(self, inode: int, nlookup: int) -> None:
        """The kernel dropped ``nlookup`` references (the root is never forgotten)."""
        node = self._nodes.get(InodeNo(inode))
        if node is None or node.inode == ROOT_INODE:
            return
        node.lookups = max(0, node.lookups - nlookup)
        self.drop_if_unused(node)

    def drop_if_unused(self, node: Node) -> None:
        """Drop ``node`` once the kernel holds no reference and no handle is open."""
        if node.lookups == 0 and node.open_handles == 0 and node.inode != ROOT_INODE:
            self._nodes.pop(node.inode, None)
            if self._by_path.get(node.path) is node:
                del self._by_path[node.path]

    def unlink(self, node: Node) -> None:
        """The name is gone; the node lives on for the kernel's references and open handles."""
        node.deleted = True
        if self._by_path.get(node.path) is node:
            del self._by_path[node.path]

    def move(self, src: str, dst: str) -> None:
        """The inode keeps its number under its new name (and so do the nodes below a directory)."""
        replaced = self._by_path.get(dst)
        if replaced is not None:
            self.unlink(replaced)
        node = self._by_path.get(src)
        if node is not None and not node.is_dir:
            moving = [node]
        else:
            prefix = src + "/"
            moving = [n for p, n in self._by_path.items() if p == src or p.startswith(prefix)]
        for node in moving:
            del self._by_path[node.path]
        for node in moving:
            node.path = dst + node.path[len(src):]
            self._by_path[node.path] = node
            if node.info is not None and not node.is_dir:
                node.info = ObjectInfo(node.path, node.info.size, node.info.etag, node.info.mtime)
            node.local_gen += 1
