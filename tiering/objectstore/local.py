"""An object store over a local directory (a local disk or an NFS mount): sources ``file:///path``.

Keys map to paths under ``root``; a directory is a directory (there are no marker objects: an empty
directory lists as an empty directory, as a marker does on S3). Regular files are objects; anything
else (sockets, FIFOs, devices) is invisible.

ETag. A local file has no content hash we could read for free, so the ETag is built from its stat:
``st_mtime_ns``, ``st_ctime_ns``, ``st_size`` and ``st_ino``. A writer that replaces a file (write a
temporary, rename) changes the inode; one that rewrites in place changes mtime and ctime. ctime is in
the tag because tools that copy timestamps (``rsync --inplace -t``, ``cp -p``) can put the old mtime
back on new bytes, but cannot set ctime. ``get_range`` opens the file, ``fstat``s the *open* file and
compares the tag before reading, so a reader never gets bytes of a version it did not ask for (short of
a writer modifying the file in place while it is being read, which no scheme based on stat can see).

Confinement. The store must never serve anything outside ``root``: keys with ``..``, ``.``, empty
components, a leading ``/`` or NUL are refused, and every path is resolved (symlinks included) and
refused unless it still lies under the resolved root. Refusals are ``ObjectNotFoundError``: from the
reader's side such a key simply does not exist. The final open uses ``O_NOFOLLOW`` on the resolved
path, so a symlink swapped in after the check is not followed either.

Writes (write-back). ``put`` writes the new content to a temp file in the key's own directory
(``.cachefs-tmp-<random>``), fsyncs it, renames it over the key and fsyncs the directory: a reader
sees the old file or the whole new one, and once ``put`` returns the bytes survive a power loss,
which write-back relies on before it drops its staged copy. Temp files are never listed. ``copy``
does the same with the source's bytes (after checking its ETag on the open file). A directory
marker ``a/b/`` is the directory itself: putting it creates the directory, deleting it removes the
directory if it is empty (a non-empty one stays, as a marker's directory stays on S3 while keys
remain under it). ``delete`` of an absent key succeeds, as on S3.

All blocking calls go through ``asyncio.to_thread``: an NFS server that stalls must not stall the
event loop that also serves FUSE requests from the RAM tier.
"""

from __future__ import annotations

import asyncio
import errno
import os
import secrets
import stat
import time
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

from tiering.errors import (
    AccessDeniedError,
    ObjectChangedError,
    ObjectNotFoundError,
    ObjectStoreError,
    ObjectStoreUnavailableError,
)
from tiering.fileio import fsync_dir
from tiering.handoff import AfterReceive
from tiering.objectstore.keys import (
    LOCAL_MAX_PATH_BYTES,
    check_list_prefix,
    check_range,
    check_write_key,
    clamp_range,
    key_room,
)
from tiering.objectstore.mtimes import metadata_mtime, mtime_metadata
from tiering.protocols import ANY_VERSION, Listing, ObjectInfo, ObjectStoreStats, ReadRange

T = TypeVar("T")

# errnos that mean "the storage behind the path is not answering" rather than "this key is bad".
_UNAVAILABLE_ERRNOS = frozenset({errno.ETIMEDOUT, errno.EHOSTDOWN, errno.EHOSTUNREACH, errno.ENETDOWN,
                                 errno.ENETUNREACH, errno.ECONNREFUSED, errno.ECONNRESET, errno.ESTALE})


# Temp files of puts and copies, in the key's directory so the final rename stays on one filesystem.
# Never listed, so a reader of the store does not see half-written content under a name.
TMP_PREFIX = ".cachefs-tmp-"
# Bytes read from the source (or a copied file) per call: large enough that the per-call overhead
# vanishes, small enough to keep the memory of one put flat.
WRITE_CHUNK = 8 * 1024 * 1024


def stat_etag(st: os.stat_result) -> str:
    """A version tag from a file's stat: any rewrite or replacement changes it."""
    return f'"{st.st_mtime_ns:x}-{st.st_ctime_ns:x}-{st.st_size:x}-{st.st_ino:x}"'


def _info(key: str, st: os.stat_result) -> ObjectInfo:
    return ObjectInfo(key=key, size=st.st_size, etag=stat_etag(st), mtime=st.st_mtime)


def _classify(exc: OSError, what: str) -> ObjectStoreError:
    """Map an OSError to the engine's error types, by errno."""
    if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EISDIR):
        return ObjectNotFoundError(f"no such object: {what}")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return AccessDeniedError(f"permission denied: {what}")
    if exc.errno in _UNAVAILABLE_ERRNOS:
        return ObjectStoreUnavailableError(f"local store not answering ({errno.errorcode.get(exc.errno, exc.errno)}): {what}")
    return ObjectStoreError(f"local store error ({errno.errorcode.get(exc.errno or 0, exc.errno)}): {what}")


class LocalObjectStore:
    """An ``ObjectStore`` over the directory tree at ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = Path(os.path.abspath(root))
        self.stats = ObjectStoreStats()
        # Keys become paths below the root: the path limit less the root's own path.
        self.max_key_bytes = key_room(str(self.root) + "/", LOCAL_MAX_PATH_BYTES)

    # -- path confinement ---------------------------------------------------------------------------

    def _real_root(self) -> str:
        return os.path.realpath(self.root)

    @staticmethod
    def _inside(real_root: str, real: str) -> bool:
        return real == real_root or real.startswith(real_root.rstrip(os.sep) + os.sep)

    def _resolve(self, key: str, *, directory: bool) -> str:
        """The real path of ``key`` under the root; ObjectNotFoundError for keys that cannot be ours."""
        if "\x00" in key or key.startswith("/"):
            raise ObjectNotFoundError(f"no such object: {key!r}")
        rel = key[:-1] if directory and key.endswith("/") else key
        parts = rel.split("/") if rel else []
        if not directory and not parts:
            raise ObjectNotFoundError("no such object: ''")
        if any(p in ("", ".", "..") for p in parts):
            raise ObjectNotFoundError(f"no such object: {key!r}")
        real_root = self._real_root()
        real = os.path.realpath(os.path.join(real_root, *parts))
        if not self._inside(real_root, real):
            raise ObjectNotFoundError(f"no such object: {key!r}")
        return real

    # -- blocking halves, run in a worker thread ----------------------------------------------------

    def _check_sync(self) -> bool:
        root = str(self.root)
        try:
            st = os.stat(root)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                raise ObjectNotFoundError(f"local store root {root} does not exist") from exc
            raise _classify(exc, root) from exc
        if not stat.S_ISDIR(st.st_mode):
            raise ObjectNotFoundError(f"local store root {root} is not a directory")
        try:
            with os.scandir(root) as it:
                first = next(it, None)
        except OSError as exc:
            raise _classify(exc, root) from exc
        if not os.access(root, os.R_OK | os.X_OK):
            raise AccessDeniedError(f"local store root {root} is not readable")
        return first is not None

    def _list_sync(self, prefix: str) -> Listing:
        listing = Listing()
        try:
            directory = self._resolve(prefix, directory=True)
        except ObjectNotFoundError:
            return listing  # like S3: listing a prefix that has nothing under it is empty
        real_root = self._real_root()
        try:
            it = os.scandir(directory)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                return listing
            raise _classify(exc, prefix or "/") from exc
        with it:
            for entry in it:
                try:
                    if entry.is_symlink():
                        real = os.path.realpath(entry.path)
                        if not self._inside(real_root, real):
                            continue  # a link pointing out of the root is not part of the store
                    st = entry.stat()  # follows a (confined) symlink
                except OSError:
                    continue  # vanished or dangling between readdir and stat: not listed
                if entry.name.startswith(TMP_PREFIX):
                    continue  # a put in progress (or one a crash left behind): not an object
                if stat.S_ISDIR(st.st_mode):
                    listing.dirs.add(entry.name)
                elif stat.S_ISREG(st.st_mode):
                    listing.files[entry.name] = _info(prefix + entry.name, st)
        return listing

    def _head_sync(self, key: str) -> ObjectInfo:
        path = self._resolve(key, directory=False)
        try:
            st = os.stat(path)
        except OSError as exc:
            raise _classify(exc, repr(key)) from exc
        if not stat.S_ISREG(st.st_mode):
            raise ObjectNotFoundError(f"no such object: {key!r}")
        return _info(key, st)

    def _get_sync(self, key: str, etag: str, start: int, end: int) -> bytes:
        path = self._resolve(key, directory=False)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise _classify(exc, repr(key)) from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ObjectNotFoundError(f"no such object: {key!r}")
            now = stat_etag(st)
            if etag != ANY_VERSION and now != etag:
                raise ObjectChangedError(f"object {key!r} changed: ETag is now {now}, not {etag}")
            start, end = clamp_range(start, end, st.st_size)
            chunks: list[bytes] = []
            pos = start
            while pos < end:  # pread may return short reads (NFS, signals): loop until done or EOF
                chunk = os.pread(fd, end - pos, pos)
                if not chunk:
                    break
                chunks.append(chunk)
                pos += len(chunk)
            return b"".join(chunks)
        except OSError as exc:
            raise _classify(exc, repr(key)) from exc
        finally:
            os.close(fd)

    def _write_target(self, key: str) -> str:
        """The path a write of ``key`` goes to; its directory is created (inside the root) if needed."""
        check_write_key(key)
        rel = key[:-1] if key.endswith("/") else key
        real_root = self._real_root()
        parent_rel, _, name = rel.rpartition("/")
        parent = os.path.realpath(os.path.join(real_root, *parent_rel.split("/"))) if parent_rel else real_root
        if not self._inside(real_root, parent):
            raise ObjectNotFoundError(f"cannot write {key!r}: outside the store root")
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as exc:
            raise _classify(exc, repr(key)) from exc
        return os.path.join(parent, name)

    def _replace_sync(self, key: str, target: str, fill: Callable[[int], None],
                      mtime: float | None = None) -> ObjectInfo:
        """Write a temp file with ``fill(fd)``, fsync it, rename it over ``target``, fsync the dir.
        ``mtime``: the writer's, given to the file (a directory tree keeps it as its own attribute)."""
        directory = os.path.dirname(target)
        tmp = os.path.join(directory, TMP_PREFIX + secrets.token_hex(8))
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                fill(fd)
                if mtime is not None:
                    os.utime(fd, ns=(time.time_ns(), round(mtime * 1e9)))
                os.fsync(fd)
            finally:
                os.close(fd)
            if os.path.isdir(target) and not os.path.islink(target):
                raise IsADirectoryError(errno.EISDIR, f"{key!r} is a directory")
            os.replace(tmp, target)
            fsync_dir(directory)
            st = os.stat(target, follow_symlinks=False)  # after the rename: it may change ctime
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise _classify(exc, repr(key)) from exc
        return _info(key, st)

    def _put_sync(self, key: str, size: int, read: ReadRange, mtime: float | None = None) -> ObjectInfo:
        target = self._write_target(key)
        if key.endswith("/"):
            try:
                os.makedirs(target, exist_ok=True)
                fsync_dir(os.path.dirname(target))
                st = os.stat(target)
            except OSError as exc:
                raise _classify(exc, repr(key)) from exc
            return ObjectInfo(key=key, size=0, etag=stat_etag(st), mtime=st.st_mtime)

        def fill(fd: int) -> None:
            pos = 0
            while pos < size:
                chunk = read(pos, min(size, pos + WRITE_CHUNK))
                if not chunk:
                    raise ObjectStoreError(f"put {key!r}: the source ended at {pos} of {size} bytes")
                _write_all(fd, chunk)
                pos += len(chunk)

        return self._replace_sync(key, target, fill, mtime)

    def _delete_sync(self, key: str) -> None:
        check_write_key(key)
        rel = key[:-1] if key.endswith("/") else key
        try:
            path = self._resolve(rel, directory=False)
        except ObjectNotFoundError:
            return
        try:
            if key.endswith("/"):
                os.rmdir(path)
            else:
                if os.path.isdir(path) and not os.path.islink(path):
                    return  # a file key that names a directory: no such object
                os.unlink(path)
            fsync_dir(os.path.dirname(path))
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ENOTEMPTY, errno.EEXIST):
                return  # absent, or a directory that still has entries (it stays, as on S3)
            raise _classify(exc, repr(key)) from exc

    def _copy_sync(self, src: str, etag: str, dst: str, mtime: float | None = None) -> ObjectInfo:
        path = self._resolve(src, directory=False)
        try:
            src_fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise _classify(exc, repr(src)) from exc
        try:
            st = os.fstat(src_fd)
            if not stat.S_ISREG(st.st_mode):
                raise ObjectNotFoundError(f"no such object: {src!r}")
            if stat_etag(st) != etag:
                raise ObjectChangedError(f"object {src!r} changed: ETag is now {stat_etag(st)}, not {etag}")
            target = self._write_target(dst)

            def fill(fd: int) -> None:
                pos = 0
                while pos < st.st_size:
                    chunk = os.pread(src_fd, min(WRITE_CHUNK, st.st_size - pos), pos)
                    if not chunk:
                        break
                    _write_all(fd, chunk)
                    pos += len(chunk)

            return self._replace_sync(dst, target, fill, st.st_mtime if mtime is None else mtime)
        finally:
            os.close(src_fd)

    # -- ObjectStore --------------------------------------------------------------------------------

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        self.stats.requests += 1
        try:
            return await asyncio.to_thread(fn, *args)
        except ObjectStoreError:
            self.stats.errors += 1
            raise

    async def check(self) -> bool:
        return await self._run(self._check_sync)

    async def list_dir(self, prefix: str) -> Listing:
        check_list_prefix(prefix)
        self.stats.list_requests += 1
        return await self._run(self._list_sync, prefix)

    async def head(self, key: str) -> ObjectInfo:
        self.stats.head_requests += 1
        return await self._run(self._head_sync, key)

    async def get_range(self, key: str, etag: str, start: int, end: int, *,
                        after: AfterReceive[Any] | None = None) -> bytes:
        # Reads in asyncio's pool and returns ``bytes``: ``after`` stays unclaimed, for the caller to do.
        check_range(start, end)
        if start == end:
            return b""
        self.stats.get_requests += 1
        data = await self._run(self._get_sync, key, etag, start, end)
        self.stats.bytes_read += len(data)
        return data

    async def head_metadata(self, key: str) -> tuple[ObjectInfo, dict[str, str]]:
        """No user metadata in a directory tree: the file's own mtime stands for it."""
        info = await self.head(key)
        return info, mtime_metadata(info.mtime)

    async def put(self, key: str, size: int, read: ReadRange, *,
                  metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        self.stats.put_requests += 1
        info = await self._run(self._put_sync, key, size, read, metadata_mtime(metadata or {}))
        self.stats.bytes_written += size
        return info

    async def delete(self, key: str) -> None:
        self.stats.delete_requests += 1
        await self._run(self._delete_sync, key)

    async def copy(self, src: str, etag: str, dst: str, *,
                   metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        self.stats.copy_requests += 1
        return await self._run(self._copy_sync, src, etag, dst, metadata_mtime(metadata or {}))

    async def close(self) -> None:
        pass


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
