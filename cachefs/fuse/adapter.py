"""The pyfuse3 adapter: a translator between FUSE requests and ``CacheFS``, nothing more.

Each handler unpacks its arguments, calls one ``CacheFS`` method and packs the answer. Errors become
errno here and only here: pyfuse3 ends the whole session if a handler raises anything other than
``FUSEError``, so every handler goes through ``_translate``: domain errors (``FsError``, the engine's
``CacheError``) carry their errno, ``OSError`` keeps its own, and anything else is logged with its
traceback and answered with EIO. Nothing escapes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, ParamSpec, TypeVar

import pyfuse3

from cachefs.fs.errors import FsError
from cachefs.fs.filesystem import Attributes, CacheFS
from tiering.errors import CacheError

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")


def errno_of(exc: BaseException) -> int:
    """The errno a failure is answered with (EIO for anything unexpected)."""
    if isinstance(exc, (FsError, CacheError)):
        return exc.errno
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    return errno.EIO


def _translate(handler: Callable[P, Coroutine[Any, Any, T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    @functools.wraps(handler)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await handler(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except (FsError, CacheError, OSError) as exc:
            code = errno_of(exc)
            if code in (errno.EIO, errno.ESTALE):
                log.warning("%s failed: %s", handler.__name__, exc)
            raise pyfuse3.FUSEError(code) from exc
        except Exception as exc:  # noqa: BLE001 - the FUSE session must survive any bug
            log.exception("unexpected error in %s", handler.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from exc

    return wrapper


def entry_attributes(attrs: Attributes) -> pyfuse3.EntryAttributes:
    entry = pyfuse3.EntryAttributes()
    entry.st_ino = attrs.inode
    entry.generation = 0
    entry.entry_timeout = attrs.entry_timeout
    entry.attr_timeout = attrs.attr_timeout
    entry.st_mode = attrs.mode
    entry.st_nlink = attrs.nlink
    entry.st_uid = attrs.uid
    entry.st_gid = attrs.gid
    entry.st_rdev = 0
    entry.st_size = attrs.size
    entry.st_blksize = 128 * 1024
    entry.st_blocks = (attrs.size + 511) // 512
    entry.st_atime_ns = attrs.mtime_ns
    entry.st_mtime_ns = attrs.mtime_ns
    entry.st_ctime_ns = attrs.mtime_ns
    return entry


class FuseOperations(pyfuse3.Operations):
    """pyfuse3 ``Operations`` delegating to a ``CacheFS``."""

    enable_writeback_cache = False

    def __init__(self, fs: CacheFS, *, direct_io: bool = False) -> None:
        super().__init__()
        self.fs = fs
        # ``--direct-io``: every open of a regular file answers with FOPEN_DIRECT_IO, so the kernel
        # neither fills nor serves the mount's page cache for it (mmap aside, see docs).
        self.direct_io = direct_io

    @_translate
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> pyfuse3.EntryAttributes:
        return entry_attributes(await self.fs.lookup(parent_inode, name))

    @_translate
    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        return entry_attributes(await self.fs.getattr(inode))

    @_translate
    async def forget(self, inode_list: Any) -> None:
        for inode, nlookup in inode_list:
            self.fs.forget(inode, nlookup)

    @_translate
    async def open(self, inode: int, flags: int, ctx: Any = None) -> pyfuse3.FileInfo:
        fh, keep_cache = await self.fs.open(inode, flags)
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep_cache, direct_io=self.direct_io)

    # pyfuse3 declares ``bytes`` but accepts any buffer (it copies from the buffer protocol), and a
    # memoryview of a cached block saves that copy here.
    @_translate
    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:  # type: ignore[override]
        return await self.fs.read(fh, off, size)

    @_translate
    async def release(self, fh: int) -> None:
        self.fs.release(fh)

    @_translate
    async def opendir(self, inode: int, ctx: Any = None) -> int:
        return await self.fs.opendir(inode)

    @_translate
    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        for entry in self.fs.readdir(fh, start_id):
            if not pyfuse3.readdir_reply(token, entry.name, entry_attributes(entry.attrs), entry.next_id):
                break
            self.fs.add_lookup(entry.attrs.inode)

    @_translate
    async def releasedir(self, fh: int) -> None:
        self.fs.releasedir(fh)

    @_translate
    async def statfs(self, ctx: Any = None) -> pyfuse3.StatvfsData:
        st = self.fs.statfs()
        out = pyfuse3.StatvfsData()
        out.f_bsize = st.block_size
        out.f_frsize = st.block_size
        out.f_blocks = st.blocks
        out.f_bfree = st.blocks_free
        out.f_bavail = st.blocks_free
        out.f_files = st.files
        out.f_ffree = st.files_free
        out.f_favail = st.files_free
        out.f_namemax = st.name_max
        return out

    @_translate
    async def getxattr(self, inode: int, name: bytes, ctx: Any = None) -> bytes:
        return self.fs.getxattr(inode, name)

    @_translate
    async def listxattr(self, inode: int, ctx: Any = None) -> list[bytes]:
        return self.fs.listxattr(inode)

    @_translate
    async def flush(self, fh: int) -> None:
        await self.fs.flush(fh)

    @_translate
    async def fsync(self, fh: int, datasync: bool) -> None:
        await self.fs.fsync(fh, datasync)

    # Modifying operations (EROFS on a read-only mount: the filesystem decides).
    @_translate
    async def setattr(self, inode: int, attr: Any, fields: Any, fh: Any, ctx: Any = None) -> Any:
        changes: dict[str, Any] = {}
        if fields is not None:
            if fields.update_size:
                changes["size"] = attr.st_size
            if fields.update_mtime:
                changes["mtime"] = attr.st_mtime_ns / 1e9
            if fields.update_mode:
                changes["mode"] = attr.st_mode
            if fields.update_uid:
                changes["uid"] = attr.st_uid
            if fields.update_gid:
                changes["gid"] = attr.st_gid
        return entry_attributes(await self.fs.setattr(inode, fh=fh, **changes))

    @_translate
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: Any = None) -> Any:
        return entry_attributes(await self.fs.mknod(parent_inode, name, mode))

    @_translate
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any = None) -> Any:
        return entry_attributes(await self.fs.mkdir(parent_inode, name, mode))

    @_translate
    async def unlink(self, parent_inode: int, name: bytes, ctx: Any = None) -> None:
        await self.fs.unlink(parent_inode, name)

    @_translate
    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any = None) -> None:
        await self.fs.rmdir(parent_inode, name)

    @_translate
    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: Any = None) -> Any:
        self.fs.unsupported("symlink")

    @_translate
    async def rename(self, p_old: int, n_old: bytes, p_new: int, n_new: bytes, flags: int, ctx: Any = None) -> None:
        await self.fs.rename(p_old, n_old, p_new, n_new, flags)

    @_translate
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: Any = None) -> Any:
        self.fs.unsupported("link")

    @_translate
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: Any = None) -> Any:
        fh, keep_cache, attrs = await self.fs.create(parent_inode, name, mode, flags)
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep_cache, direct_io=self.direct_io), entry_attributes(attrs)

    @_translate
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        return await self.fs.write(fh, off, buf)

    @_translate
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: Any = None) -> None:
        self.fs.unsupported("setxattr")

    @_translate
    async def removexattr(self, inode: int, name: bytes, ctx: Any = None) -> None:
        self.fs.unsupported("removexattr")


# What a user can do about the failures libfuse and fusermount3 report, by words of their message
# (theirs are fixed strings of those two programs: there is no code to match).
FUSE_FAILURE_HINTS = (
    ("/dev/fuse: Permission denied", "the mounting user needs read and write access to /dev/fuse "
                                     "(through a group that owns it), or mount as root"),
    ("user_allow_other", "drop --allow-other, or have root add user_allow_other to /etc/fuse.conf"),
    ("device not found", "load the fuse kernel module (modprobe fuse), or give the container /dev/fuse"),
)
# The captured text is the programs' own lines; more than this is noise for one line on a terminal.
MAX_REASON_CHARS = 300


@dataclasses.dataclass
class CapturedText:
    text: str = ""


@contextlib.contextmanager
def captured_stderr() -> Iterator[CapturedText]:
    """Send file descriptor 2 (this process's and its children's, fusermount3's) to a temporary
    file for the duration of the block; ``.text`` holds what was written. A file, not a pipe: a
    writer can never block on it."""
    captured = CapturedText()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            captured.text = sink.read().decode(errors="replace")


def fuse_failure_reason(text: str) -> str | None:
    """The last line libfuse or fusermount3 wrote, with what to do about it; None if they wrote none."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return None
    reason = lines[-1].removeprefix("fuse: ")[:MAX_REASON_CHARS]
    hint = next((hint for words, hint in FUSE_FAILURE_HINTS if words in reason), None)
    return f"{reason}; {hint}" if hint else reason


class FuseSession:
    """The FUSE session of one mount: the only place that calls pyfuse3's module-level functions."""

    def __init__(self, fs: CacheFS, mountpoint: str, *, read_only: bool, allow_other: bool,
                 direct_io: bool = False) -> None:
        self.fs = fs
        self.mountpoint = mountpoint
        self.direct_io = direct_io
        self.options = set(pyfuse3.default_options) | {"fsname=cachefs", "subtype=cachefs"}
        if read_only:
            self.options.add("ro")
        if allow_other:
            self.options.add("allow_other")

    @staticmethod
    def enable_asyncio() -> None:
        """Make pyfuse3 run on asyncio (it defaults to trio); call before the loop starts."""
        import pyfuse3.asyncio

        pyfuse3.asyncio.enable()

    def mount(self) -> None:
        """Mount; ``OSError`` with a one-line reason if the kernel refuses.

        libfuse and fusermount3 say why a mount failed only on file descriptor 2 (``failed to open
        /dev/fuse: Permission denied``), while pyfuse3 raises a bare ``fuse_session_mount failed``.
        Their words are captured around the call (``captured_stderr``), written back to stderr (the
        daemon's log keeps them) and put in the one-line reason the user sees."""
        failure: RuntimeError | None = None
        with captured_stderr() as captured:
            try:
                pyfuse3.init(FuseOperations(self.fs, direct_io=self.direct_io), self.mountpoint, self.options)
            except RuntimeError as exc:
                failure = exc
        if captured.text:
            sys.stderr.write(captured.text)
            sys.stderr.flush()
        if failure is not None:
            reason = fuse_failure_reason(captured.text) or str(failure)
            raise OSError(errno.EIO, f"cannot mount on {self.mountpoint}: {reason}") from failure

    async def serve(self, max_tasks: int) -> None:
        """Serve requests until the filesystem is unmounted or ``terminate`` is called."""
        await pyfuse3.main(max_tasks=max_tasks)

    @staticmethod
    def terminate() -> None:
        pyfuse3.terminate()

    @staticmethod
    def close() -> None:
        """End the session and make sure the mount is gone."""
        pyfuse3.close(unmount=True)
