"""The handle table: what each open file or directory handle holds.

An open file pins one version of its object (key, ETag, size): reads through that handle never mix
bytes of two versions. It follows changes made through the mount (``local_gen``), not changes made
elsewhere. Each file handle has its own read-ahead state. A directory handle holds a snapshot of the
merged listing taken at ``opendir``, so readdir offsets stay meaningful while the listing is
refreshed. A handle of the wrong kind, or one that is not open, is EBADF.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import NewType

from cachefs.fs.errors import FsError
from cachefs.fs.inodes import Node
from tiering.blocks import ObjectRef
from tiering.protocols import ObjectInfo
from tiering.policy.readahead import ReadAhead

FileHandle = NewType("FileHandle", int)


@dataclass
class FileHandleState:
    node: Node
    ref: ObjectRef | None  # the store version read through this handle (None: staged data)
    # Made at the first read (``CacheFS.read``): a warm open answered from the page cache never reads.
    readahead: ReadAhead | None = None
    writable: bool = False
    local_gen: int = 0  # node.local_gen when ref was taken

    def readahead_window(self, offset: int, size: int, block_size: int, limit: int) -> int:
        """The bytes to read ahead past this read (``ReadAhead.on_read``), its state made at the first read."""
        if self.readahead is None:
            self.readahead = ReadAhead(block_size, limit)
        return self.readahead.on_read(offset, size)


@dataclass
class DirHandleState:
    node: Node
    entries: list[tuple[str, ObjectInfo | None]]


class HandleTable:
    def __init__(self) -> None:
        self._handles: dict[int, FileHandleState | DirHandleState] = {}
        self._next_fh = 1

    def __len__(self) -> int:
        return len(self._handles)

    def add(self, state: FileHandleState | DirHandleState) -> FileHandle:
        fh = FileHandle(self._next_fh)
        self._next_fh += 1
        self._handles[fh] = state
        return fh

    def file(self, fh: int) -> FileHandleState:
        handle = self._handles.get(fh)
        if not isinstance(handle, FileHandleState):
            raise FsError(errno.EBADF)
        return handle

    def directory(self, fh: int) -> DirHandleState:
        handle = self._handles.get(fh)
        if not isinstance(handle, DirHandleState):
            raise FsError(errno.EBADF)
        return handle

    def pop(self, fh: int) -> FileHandleState | DirHandleState | None:
        return self._handles.pop(fh, None)
