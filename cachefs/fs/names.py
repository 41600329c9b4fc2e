"""Name changes of a ``CacheFS``: create, mkdir, unlink, rmdir and rename, made through write-back.

A room of the facade (``cachefs.fs.filesystem``), which answers these FUSE operations by calling
``NameChanges``: each new name is checked (valid UTF-8, a POSIX name, an object key the store can
hold), the listing decides what the name holds now, and an unlink or a rename over a file runs under
its kept-files rule (``cachefs.fs.keep``: the content stays for the handles, and retried opens, that
still use it). The state stays the facade's; this class holds none of its own.
"""

from __future__ import annotations

import errno
import os
from typing import TYPE_CHECKING

from cachefs.fs.errors import FsError
from cachefs.fs.handles import FileHandle
from cachefs.fs.rename import RENAME_EXCHANGE
from cachefs.names import key_length_problem, name_problem
from cachefs.paths import join
from tiering.protocols import ObjectInfo
from tiering.writeback import MISSING, STAGED_ETAG
from tiering.writeback.pending import staged_info

if TYPE_CHECKING:
    from cachefs.fs.filesystem import Attributes, CacheFS
    from cachefs.fs.inodes import Node
    from tiering.writeback import WriteBack


def _new_name(name: bytes) -> str:
    """A new name as text: valid UTF-8 (object keys are), and a valid POSIX name."""
    try:
        text = name.decode("utf-8")
    except UnicodeDecodeError:
        raise FsError(errno.EINVAL, "file names must be valid UTF-8 to become object keys") from None
    problem = name_problem(text)
    if problem is not None:
        raise FsError(problem.errno, problem.reason)
    return text


class NameChanges:
    """The name-changing operations of one ``CacheFS`` (module docstring)."""

    def __init__(self, fs: CacheFS) -> None:
        self.fs = fs

    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int) -> tuple[FileHandle, bool, Attributes]:
        """creat/open(O_CREAT): a new empty file (staged), or the existing one opened with ``flags``."""
        fs = self.fs
        wb = fs._writer()
        parent = fs._dir(parent_inode)
        text = _new_name(name)
        path = join(parent.path, text)
        value = await fs.listings.lookup(parent.path, text)
        if value is None:
            raise FsError(errno.EISDIR)
        if value is not MISSING:
            if flags & os.O_EXCL:
                raise FsError(errno.EEXIST)
            node = fs._node_for(path, value)  # type: ignore[arg-type]
            node.lookups += 1
            fh, keep = await fs.open(node.inode, flags)
            return fh, keep, fs._attributes(node)
        self.check_key(path, directory=False)
        sf = await wb.create(path, may_exist=False)
        node = fs._node_for(path, staged_info(sf))
        fs._set_staged(node, sf)
        node.lookups += 1
        fs.stats.creates += 1
        fh, keep = fs._open_handle(node, writable=True)
        return fh, keep, fs._attributes(node)

    async def mkdir(self, parent_inode: int, name: bytes, mode: int) -> Attributes:
        fs = self.fs
        wb = fs._writer()
        parent = fs._dir(parent_inode)
        text = _new_name(name)
        if await fs.listings.lookup(parent.path, text) is not MISSING:
            raise FsError(errno.EEXIST)
        path = join(parent.path, text)
        self.check_key(path, directory=True)
        await wb.mkdir(path)
        fs.stats.mkdirs += 1
        node = fs._node_for(path, None)
        node.lookups += 1
        return fs._attributes(node)

    async def _existing(self, parent_inode: int, name: bytes) -> tuple[WriteBack, Node, str, object]:
        """For unlink and rmdir: the write-back, the parent, the path, and what the listing says the name
        holds now (a file's ObjectInfo, or None for a directory); ENOENT where it holds nothing."""
        fs = self.fs
        wb = fs._writer()
        parent = fs._dir(parent_inode)
        text = _new_name(name)
        value = await fs.listings.lookup(parent.path, text)
        if value is MISSING:
            raise FsError(errno.ENOENT)
        return wb, parent, join(parent.path, text), value

    async def unlink(self, parent_inode: int, name: bytes) -> None:
        fs = self.fs
        wb, parent, path, value = await self._existing(parent_inode, name)
        if value is None:
            raise FsError(errno.EISDIR)
        async with fs.kept.losing_name(path):
            await fs.kept.keep(path)
            node = fs.inodes.at(path)
            assert isinstance(value, ObjectInfo)  # neither MISSING nor None (a directory): a file
            staged = value.etag == STAGED_ETAG
            await wb.ensure_dir(parent.path)  # the directory stays, even once its last entry goes
            await wb.remove(path, may_exist=not staged, base_etag=None if staged else value.etag)
            fs.stats.unlinks += 1
            if node is not None:
                fs.inodes.unlink(node)

    async def rmdir(self, parent_inode: int, name: bytes) -> None:
        fs = self.fs
        wb, parent, path, value = await self._existing(parent_inode, name)
        if value is not None:
            raise FsError(errno.ENOTDIR)
        if await fs.listings.entries(path):
            raise FsError(errno.ENOTEMPTY)
        await wb.ensure_dir(parent.path)
        await wb.rmdir(path)
        fs.stats.rmdirs += 1
        fs.listings.forget_under(path)
        node = fs.inodes.at(path)
        if node is not None:
            fs.inodes.unlink(node)

    async def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes, flags: int) -> None:
        """rename(2). Not atomic on an object store (see ``cachefs.fs.rename`` and the README)."""
        fs = self.fs
        wb = fs._writer()
        if flags & RENAME_EXCHANGE:
            raise FsError(errno.EINVAL, "RENAME_EXCHANGE is not supported")
        src_dir, dst_dir = fs._dir(old_parent), fs._dir(new_parent)
        src_name, dst_name = _new_name(old_name), _new_name(new_name)
        async with fs.kept.losing_name(join(dst_dir.path, dst_name)):
            renamed = await fs.renamer.rename(wb, src_dir.path, src_name, dst_dir.path, dst_name, flags)
        if renamed:
            fs.stats.renames += 1

    def check_key(self, path: str, *, directory: bool) -> None:
        """ENAMETOOLONG for a new name whose object key the store could never hold (S3: 1,024 bytes
        with the prefix): refused when made, never acknowledged and then failing every upload."""
        problem = key_length_problem(path, self.fs.store.max_key_bytes, directory=directory)
        if problem:
            raise FsError(errno.ENAMETOOLONG, problem)
