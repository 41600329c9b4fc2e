"""rename(2) over an object store, with write-back.

An object store has no rename. Rename of a staged file is journaled (its content is acknowledged
first); of a file only in the store, a server-side copy then a journaled delete (the destination's
own pending upload is held off meanwhile, so it cannot land after the copy); of a directory, the same
for every entry of the merged view, directories re-made under the new name and removed under the old
one deepest first, refused beyond ``rename_dir_limit`` entries (E2BIG). None of these renames is
atomic: a crash can leave both names, never neither. A directory that loses an entry to another
directory keeps a marker, because a directory lives until rmdir. Inodes keep their numbers under the
new names (``InodeTable.move``).

A file renamed or replaced while handles hold it open stays theirs (POSIX): before its object is
deleted or replaced, the filesystem stages it if its handles need that (``keep``) and write-back
copies in the stored version of a file staged only to be copied on its first change
(``WriteBack.keep_for_handles``). So a moved file's handles follow it to the new name as staged data,
and a replaced file's handles keep reading and writing its content, which nothing uploads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
from typing import Awaitable, Callable

from cachefs.fs.errors import FsError
from cachefs.fs.inodes import InodeTable
from cachefs.fs.listings import ListingCache
from cachefs.names import key_length_problem
from cachefs.paths import join
from tiering.protocols import ObjectInfo, ObjectStore
from tiering.writeback import MISSING, STAGED_ETAG, WriteBack

log = logging.getLogger(__name__)

# Server-side copies in flight while a directory is renamed.
RENAME_CONCURRENCY = 16
# rename(2) flags (linux/fs.h).
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


class Renamer:
    """Renames paths of the merged view through write-back; the filesystem checks names and inodes."""

    def __init__(self, store: ObjectStore, listings: ListingCache, inodes: InodeTable, rename_dir_limit: int,
                 keep: Callable[[str], Awaitable[None]]) -> None:
        self.store = store
        self.listings = listings
        self.inodes = inodes
        self.rename_dir_limit = rename_dir_limit
        self.keep = keep  # keep(path): the file there is about to be replaced; its open handles keep it

    async def rename(self, wb: WriteBack, src_parent: str, src_name: str, dst_parent: str, dst_name: str,
                     flags: int) -> bool:
        """Rename ``src_parent/src_name`` to ``dst_parent/dst_name``; False if they are the same path."""
        src = join(src_parent, src_name)
        dst = join(dst_parent, dst_name)
        src_value = await self.listings.lookup(src_parent, src_name)
        if src_value is MISSING:
            raise FsError(errno.ENOENT)
        dst_value = await self.listings.lookup(dst_parent, dst_name)
        if dst_value is not MISSING and flags & RENAME_NOREPLACE:
            raise FsError(errno.EEXIST)
        if src == dst:
            return False
        self._check_key(dst, directory=src_value is None)
        if src_value is None:
            if dst_value is not None and dst_value is not MISSING:
                raise FsError(errno.ENOTDIR)
            if dst.startswith(src + "/"):
                raise FsError(errno.EINVAL, "cannot move a directory into itself")
            if dst_value is None and await self.listings.entries(dst):
                raise FsError(errno.ENOTEMPTY)
            await self._rename_dir(wb, src, dst)
        else:
            if dst_value is None:
                raise FsError(errno.EISDIR)
            if src_parent != dst_parent:
                await wb.ensure_dir(src_parent)  # it loses an entry, and lives on until rmdir
            if dst_value is not MISSING:
                await self.keep(dst)
            await self._rename_file(wb, src, dst, src_value, dst_value)  # type: ignore[arg-type]
            self.inodes.move(src, dst)
        return True

    def _check_key(self, path: str, *, directory: bool) -> None:
        problem = key_length_problem(path, self.store.max_key_bytes, directory=directory)
        if problem:
            raise FsError(errno.ENAMETOOLONG, problem)

    async def _rename_file(self, wb: WriteBack, src: str, dst: str, info: ObjectInfo, dst_value: object) -> None:
        dst_may_exist = dst_value is not MISSING and getattr(dst_value, "etag", STAGED_ETAG) != STAGED_ETAG
        # Held open and staged to be copied in on its first change: copied in now, the file moves as
        # staged data and its handles follow it (renamed in the store, they would be left with a copy
        # that no name reaches). And the file replaced at ``dst`` is kept for its own handles.
        await wb.keep_for_handles(src)
        await wb.keep_for_handles(dst)
        sf = wb.file(src)
        if sf is not None and sf.materialized:
            await wb.move(src, dst, dst_may_exist=dst_may_exist)
            return
        if info.etag == STAGED_ETAG:
            # Its upload landed (and the staged copy went) since the caller looked: take the store's.
            value = await self.listings.resolve_path(src)
            sf = wb.file(src)
            if sf is not None and sf.materialized:
                await wb.move(src, dst, dst_may_exist=dst_may_exist)
                return
            if not isinstance(value, ObjectInfo) or value.etag == STAGED_ETAG:
                raise FsError(errno.ENOENT, f"/{src} changed while it was renamed")
            info = value
        # Only in the store: a server-side copy, then the source is deleted (journaled). The
        # destination's own pending upload must not land after the copy: it is held off meanwhile.
        async with wb.quiesce(dst):
            copied = await self.store.copy(src, info.etag, dst)
            await wb.forget(dst, copied.etag)
        # The copy keeps the object's metadata, its ``mtime`` with it: the view shows the same.
        copied = dataclasses.replace(copied, mtime=info.mtime)
        await wb.remove(src, may_exist=True, base_etag=info.etag)
        replaced = self.inodes.at(dst)
        if replaced is not None:
            # Not a new version of the file it replaced: that file's handles keep their own version.
            self.inodes.unlink(replaced)
        self.listings.applied(dst, copied)
        node = self.inodes.at(src)
        if node is not None:
            node.info = copied  # its key is rewritten to dst when the node moves

    async def _rename_dir(self, wb: WriteBack, src: str, dst: str) -> None:
        """Every entry below ``src`` (merged view) is renamed; refused beyond ``rename_dir_limit``."""
        files: list[tuple[str, ObjectInfo]] = []
        dirs: list[str] = [""]
        limit = self.rename_dir_limit
        pending = [""]
        while pending:
            rel = pending.pop()
            here = join(src, rel) if rel else src
            for name, value in sorted((await self.listings.entries(here)).items()):
                child = f"{rel}/{name}" if rel else name
                if value is None:
                    dirs.append(child)
                    pending.append(child)
                else:
                    files.append((child, value))
                if len(files) + len(dirs) - 1 > limit:
                    log.warning("rename of directory /%s refused: it has more than %d entries (--rename-dir-limit)",
                                src, limit)
                    raise FsError(errno.E2BIG, f"/{src} has more than {limit} entries to rename")
        # Every key below the new name must fit too: refused before anything is moved.
        for rel in dirs[1:]:
            self._check_key(f"{dst}/{rel}", directory=True)
        for rel, _ in files:
            self._check_key(f"{dst}/{rel}", directory=False)
        src_parent = src.rpartition("/")[0]
        await wb.ensure_dir(src_parent)
        for rel in dirs:
            await wb.mkdir(join(dst, rel) if rel else dst)
        slots = asyncio.Semaphore(RENAME_CONCURRENCY)

        async def move_one(rel: str, info: ObjectInfo) -> None:
            async with slots:
                await self._rename_file(wb, f"{src}/{rel}", f"{dst}/{rel}", info, MISSING)

        await asyncio.gather(*(move_one(rel, info) for rel, info in files))
        for rel in sorted(dirs, key=lambda d: -d.count("/") - (d != "")):
            await wb.rmdir(join(src, rel) if rel else src)
        self.listings.forget_under(src)
        self.listings.forget_under(dst)
        self.inodes.move(src, dst)
