"""The FUSE adapter: a translator between the kernel's requests and ``CacheFS``, nothing more.

Each handler unpacks its request's arguments (``cachefs.fuse.wire``), calls one ``CacheFS`` method
and packs the answer; the session (``cachefs.fuse.session``) reads the requests and sends the
replies. Handlers whose ``CacheFS`` method never waits are plain functions the session calls inline
(``inline``); the others are coroutines it runs as tasks (``handlers``). LOOKUP, GETATTR and OPEN
have both: the inline one (``*_now``, over ``CacheFS.*_now``) answers when the listing it needs is
fresh and returns ``LATER`` when a directory must be listed first, and the coroutine does the rest.

Errors become errno here and only here (``failure``, which the session calls for anything a handler
raises other than ``FuseError``): domain errors (``FsError``, the engine's ``CacheError``) carry
their errno, ``OSError`` keeps its own, and anything else is logged with its traceback and answered
with EIO. Nothing escapes: the session goes on.

Caching decisions stay where they were: ``CacheFS.open`` says whether the kernel keeps its pages
(FOPEN_KEEP_CACHE), ``--direct-io`` answers every open with FOPEN_DIRECT_IO, and a read's reply is
the memoryview the engine returns, sent as it is. An open only for reading also answers
FOPEN_NOFLUSH: its close() costs no request.

Passthrough (``Passthrough``): on a read-only mount whose connection agreed to it, a read-only open
of a file ``CacheFS.backing_file`` finds whole on the disk tier is answered FOPEN_PASSTHROUGH with a
backing id, and the kernel reads that file itself: no READ of that open reaches the daemon. The
kernel's rules (fs/fuse/iomode.c) shape the bookkeeping: every open of an inode held through
passthrough must name the same backing file, and no inode may be held both ways at once, or the
open fails with EIO. So one backing id per inode, shared by its passthrough opens and kept registered
between them (registered once, not at every open; closed when the inode is forgotten, its whole file
leaves the disk tier, or the next open reads another version: see ``Passthrough``); an inode with
opens answered the ordinary way is not passed through until they are released; and an open of another
version of an inode still open through passthrough (the object changed in the bucket meanwhile) is
answered ETXTBSY rather than with the old bytes.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import stat
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable

from cachefs.fs.errors import FsError
from cachefs.fs.filesystem import Attributes, CacheFS
from cachefs.fuse import wire
from cachefs.backing import BROKER_MAX_IDS, BrokerError
from cachefs.fuse.notifier import Notifier
from cachefs.fs.diskread import DiskRead
from cachefs.fuse.session import LATER, Backing, Later, OffLock, Reply
from cachefs.fuse.wire import FuseError, Request
from tiering.errors import CacheError

log = logging.getLogger(__name__)

# Backing ids kept registered with no open using them (``Passthrough``), for the next open of their
# inode: half the node plugin broker's bound on a mount's live ids (``BROKER_MAX_IDS``), so that the
# files open through passthrough at once still find room. Each holds one open file in the kernel (a
# struct file, and the whole file's inode and dentry pinned: roughly 1-2 KiB, an estimate, not
# measured), so a mount keeps at most ~16 MiB of them; an epoch over more files than this registers
# each file again, as every open did before.
IDLE_IDS = BROKER_MAX_IDS // 2


def errno_of(exc: BaseException) -> int:
    """The errno a failure is answered with (EIO for anything unexpected)."""
    if isinstance(exc, (FsError, CacheError)):
        return exc.errno
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    return errno.EIO


def attr_of(attrs: Attributes) -> wire.Attr:
    return wire.Attr(attrs.inode, attrs.size, attrs.mode, attrs.nlink, attrs.uid, attrs.gid, attrs.mtime_ns)


def entry(attrs: Attributes) -> bytes:
    return wire.entry_out(attr_of(attrs), attrs.entry_timeout, attrs.attr_timeout)


def attr(attrs: Attributes) -> bytes:
    return wire.attr_out(attr_of(attrs), attrs.attr_timeout)


def sized(value: bytes, size: int) -> bytes:
    """A GETXATTR/LISTXATTR answer: the size asked for with size 0, else the value if it fits."""
    if size == 0:
        return wire.getxattr_size(len(value))
    if len(value) > size:
        raise FuseError(errno.ERANGE)
    return value


class _Held:
    """One inode's backing file: its id, its path, and the passthrough opens using it now (0: kept
    registered for the next open, in ``Passthrough.idle``)."""

    __slots__ = ("backing_id", "path", "handles", "dropped")

    def __init__(self, backing_id: int, path: str) -> None:
        self.backing_id = backing_id
        self.path = path
        self.handles = 0
        self.dropped = False  # its whole file left the disk tier while open: closed at the last release


class Passthrough:
    """Which inodes the kernel reads through a backing file, and which it reads through the daemon
    (see the module docstring); counts in ``fs.stats``.

    A backing id outlives the opens that use it: registering it costs an ``open`` and an ioctl (a
    round trip to the node plugin's broker for an unprivileged daemon), so it is kept for the next
    open of the same inode while the whole file it names is the version that open reads. It is closed
    when the inode is forgotten (FORGET), when the next open reads another version (the object changed
    in the bucket) or cannot pass through, when its whole file leaves the disk tier (``dropped``, told
    by the tier from the thread that removed it: an id holds the file open, so its space would stay
    used), and beyond ``IDLE_IDS`` ids no open uses (the least recently used first). The kernel drops
    every id with the connection at unmount. A whole file's name is its version's (key, ETag, size),
    so an id can only ever name the bytes of the version its open reads."""

    def __init__(self, fs: CacheFS, backing: Backing, idle_ids: int = IDLE_IDS) -> None:
        self.fs = fs
        self.backing = backing
        self.enabled = True  # False once the kernel refused a registration: no new ones are asked for
        self.held: dict[int, _Held] = {}  # nodeid -> backing file
        self.idle: OrderedDict[int, None] = OrderedDict()  # nodeids whose id no open uses, oldest first
        self.idle_ids = idle_ids
        self.by_path: dict[str, set[int]] = {}  # whole file -> nodeids holding an id for it
        self.by_fh: dict[int, int] = {}  # fh -> nodeid, of passthrough opens
        self.ordinary: dict[int, int] = {}  # nodeid -> ordinary (non-passthrough) opens
        self.ordinary_fh: dict[int, int] = {}  # fh -> nodeid
        # Whole files removed from the disk tier, appended by whichever thread removed them and taken
        # on the loop (``_take_dropped``): at the next open or release, or by a callback scheduled then.
        self._dropped: deque[str] = deque()
        self._take_scheduled = False
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None

    async def open(self, nodeid: int, fh: int, flags: int) -> int | None:
        """The backing id this open passes through to, or None (then call ``ordinary_open``). Raises
        ``FuseError(ETXTBSY)`` (the handle released) for another version of an inode held now."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        self._take_dropped()
        read_only = flags & os.O_ACCMODE == os.O_RDONLY and not flags & os.O_TRUNC
        before = self.held.get(nodeid)
        in_use = before is not None and before.handles > 0
        if not read_only or self.ordinary.get(nodeid) or (not in_use and not self.enabled):
            self._check_free(nodeid, fh)
            return None
        try:
            path = await self.fs.backing_file(fh, assemble=not in_use)
        except Exception:  # noqa: BLE001 - a failing disk tier is a miss: this open is served by the daemon
            log.exception("passthrough: finding the whole file failed; the daemon serves this open")
            path = None
        self._take_dropped()  # again: other opens, releases and evictions may have come during the wait
        held = self.held.get(nodeid)
        if held is not None and held.handles > 0:
            if path != held.path:  # another version, or a handle that does not qualify
                self._check_free(nodeid, fh)
                return None
        else:
            if held is not None and (path != held.path or not self.enabled):
                self._close(nodeid)  # kept for another version, or passthrough is off now
                held = None
            if in_use and held is None:
                return None  # (released and closed during the wait: ``path`` was only named, not assembled)
            if path is None or self.ordinary.get(nodeid) or not self.enabled:
                return None
            if held is None:
                backing_id = self._register(path)
                if backing_id is None:
                    return None
                held = self.held[nodeid] = _Held(backing_id, path)
                self.by_path.setdefault(path, set()).add(nodeid)
                self.fs.stats.backing_registrations += 1
                self.fs.stats.backing_ids = len(self.held)
            else:
                del self.idle[nodeid]
        held.handles += 1
        self.by_fh[fh] = nodeid
        self.fs.stats.passthrough_opens += 1
        return held.backing_id

    def _check_free(self, nodeid: int, fh: int) -> None:
        """An open that will not pass through: refused while the inode is read through passthrough."""
        held = self.held.get(nodeid)
        if held is not None and held.handles > 0:
            self.fs.abandon_open(fh)
            self.fs.stats.passthrough_refused += 1
            raise FuseError(errno.ETXTBSY)

    def _register(self, path: str) -> int | None:
        try:
            return self.backing.open(path)
        except OSError as exc:
            self.fs.stats.passthrough_fallbacks += 1
            if isinstance(exc, BrokerError):  # the node plugin's broker: stuck, gone, or it refused
                log.warning("passthrough: %s; the daemon serves every read from now on", exc.strerror)
                self.enabled = self.fs.stats.passthrough_active = False
            elif exc.errno in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTTY):
                log.warning("passthrough: the kernel refused a backing file (%s); the daemon serves every read "
                            "from now on", os.strerror(exc.errno or errno.EPERM))
                self.enabled = self.fs.stats.passthrough_active = False
            elif exc.errno == errno.ELOOP:
                log.warning("passthrough: the cache directory is on a stacked filesystem (overlayfs?), which "
                            "the kernel refuses as a backing file; the daemon serves every read from now on")
                self.enabled = self.fs.stats.passthrough_active = False
            else:  # the whole file was evicted meanwhile, or the disk failed: this open is served by us
                log.debug("passthrough: cannot register %s: %s", path, exc)
            return None

    def ordinary_open(self, nodeid: int, fh: int) -> None:
        self.ordinary[nodeid] = self.ordinary.get(nodeid, 0) + 1
        self.ordinary_fh[fh] = nodeid

    def release(self, fh: int) -> None:
        nodeid = self.by_fh.pop(fh, None)
        if nodeid is not None:
            self._take_dropped()
            held = self.held[nodeid]
            held.handles -= 1
            if held.handles == 0:
                if held.dropped or not self.enabled:
                    self._close(nodeid)
                else:  # kept for the next open of this inode
                    self.idle[nodeid] = None
                    while len(self.idle) > self.idle_ids:
                        self._close(next(iter(self.idle)))
            return
        nodeid = self.ordinary_fh.pop(fh, None)
        if nodeid is not None:
            left = self.ordinary[nodeid] - 1
            if left:
                self.ordinary[nodeid] = left
            else:
                del self.ordinary[nodeid]

    def forgotten(self, nodeid: int) -> None:
        """The kernel forgot ``nodeid``: an id no open uses is closed (an inode with open files is not
        forgotten; one that is looked up again registers anew)."""
        held = self.held.get(nodeid)
        if held is not None and held.handles == 0:
            self._close(nodeid)

    def dropped(self, path: str) -> None:
        """The disk tier removed the whole file ``path`` (any thread): its ids are closed on the loop."""
        self._dropped.append(path)
        if not self._take_scheduled and self._loop is not None:
            self._take_scheduled = True
            try:
                self._loop.call_soon_threadsafe(self._take_dropped)
            except RuntimeError:  # the loop is closed: the session has ended, and the ids with it
                pass

    def _take_dropped(self) -> None:
        self._take_scheduled = False
        while self._dropped:
            path = self._dropped.popleft()
            for nodeid in list(self.by_path.get(path, ())):
                held = self.held[nodeid]
                if held.handles == 0:
                    self._close(nodeid)
                else:  # the kernel holds the file while it is open; the id goes at the last release
                    held.dropped = True

    def _close(self, nodeid: int) -> None:
        """Forget ``nodeid``'s id (no open uses it) and have it closed."""
        held = self.held.pop(nodeid)
        self.idle.pop(nodeid, None)
        nodeids = self.by_path.get(held.path)
        if nodeids is not None:
            nodeids.discard(nodeid)
            if not nodeids:
                del self.by_path[held.path]
        self.fs.stats.backing_ids = len(self.held)
        try:
            self.backing.close(held.backing_id)
        except BrokerError as exc:  # the id stays registered until the connection ends
            if self.enabled:  # said once, when the broker broke
                log.warning("passthrough: %s; the daemon serves every read from now on", exc.strerror)
            self.enabled = self.fs.stats.passthrough_active = False
        except OSError as exc:
            log.warning("passthrough: closing backing id %d failed: %s", held.backing_id, exc)


class _DiskReply(OffLock):
    """A READ a reader thread serves from the disk tier itself (``CacheFS.read_from_disk_now``)."""

    __slots__ = ("read",)

    def __init__(self, read: DiskRead) -> None:
        self.read = read

    def run(self) -> None:
        self.read.run()

    def stalled(self, seconds: float) -> None:
        self.read.stalled(seconds)

    def finish(self) -> Reply | Later:
        data = self.read.finish()
        return LATER if data is None else data


class FuseOperations:
    """The handlers of one mount, by opcode, over a ``CacheFS``."""

    def __init__(self, fs: CacheFS, *, direct_io: bool = False, immutable: bool = False,
                 read_only: bool = False, passthrough: bool = True) -> None:
        self.fs = fs
        # Passthrough is asked for on a read-only mount that answers OPEN (the kernel must not mix
        # passed-through and ordinary opens of one inode, so a writer could not open a file a reader
        # holds that way; see the module docstring), and not with --direct-io, whose reads must
        # all reach the daemon, nor with --no-passthrough. Set up by ``negotiated`` when the kernel agreed.
        self.wants_passthrough = (passthrough and read_only and not direct_io and not immutable
                                  and fs.whole is not None)
        self.passthrough: Passthrough | None = None
        # ``--direct-io``: every open of a regular file answers with FOPEN_DIRECT_IO, so the kernel
        # neither fills nor serves the mount's page cache for it (mmap aside, see docs).
        self.direct_io = direct_io
        # A mount whose files never change (pinned to a manifest: every file's ETag is fixed) answers
        # the first OPEN with ENOSYS where the kernel supports that (NO_OPEN_SUPPORT): the kernel then
        # opens and closes files itself, keeping their pages across opens, and a warm file costs no
        # request at all. Its READs carry no handle (fh 0): ``read`` opens one per inode
        # (``implicit``), released when the kernel forgets the inode. Not with --direct-io, whose
        # every read must reach the daemon through a handle's FOPEN_DIRECT_IO.
        self.no_open = immutable and not direct_io
        self.implicit: dict[int, int] = {}
        self.inline: dict[int, Callable[[Request], Reply | Later]] = {
            wire.LOOKUP: self.lookup_now, wire.GETATTR: self.getattr_now, wire.OPEN: self.open_now,
            wire.FORGET: self.forget, wire.BATCH_FORGET: self.batch_forget, wire.RELEASE: self.release,
            wire.RELEASEDIR: self.releasedir, wire.READDIR: self.readdir, wire.READDIRPLUS: self.readdir,
            wire.STATFS: self.statfs, wire.GETXATTR: self.getxattr, wire.LISTXATTR: self.listxattr,
            wire.SETXATTR: self.setxattr, wire.REMOVEXATTR: self.removexattr, wire.SYMLINK: self.symlink,
            wire.LINK: self.link,
        }
        self.handlers: dict[int, Callable[[Request], Awaitable[Reply]]] = {
            wire.LOOKUP: self.lookup, wire.GETATTR: self.getattr, wire.OPEN: self.open, wire.READ: self.read,
            wire.OPENDIR: self.opendir, wire.FLUSH: self.flush, wire.FSYNC: self.fsync, wire.SETATTR: self.setattr,
            wire.MKNOD: self.mknod, wire.MKDIR: self.mkdir, wire.UNLINK: self.unlink, wire.RMDIR: self.rmdir,
            wire.RENAME: self.rename, wire.RENAME2: self.rename2, wire.CREATE: self.create, wire.WRITE: self.write,
            wire.FALLOCATE: self.fallocate,
        }
        # A FUSE reader thread serves a READ of a block only the disk tier holds itself, off the loop
        # (``cachefs.fs.diskread``), and answers from its own buffer without a RAM-tier copy: the
        # kernel keeps the reply in its page cache. Not with --direct-io, whose re-reads all reach
        # the daemon and are served from the RAM tier.
        self.reader_inline: dict[int, Callable[[Request], Reply | Later | OffLock]] = (
            {} if direct_io else {wire.READ: self.read_from_disk_now})

    @property
    def wanted_flags(self) -> int:
        return wire.PASSTHROUGH if self.wants_passthrough else 0

    def negotiated(self, flags: int, backing: Backing | None, notifier: Notifier | None) -> None:
        """What the kernel agreed to at INIT (READDIR or READDIRPLUS is told by the opcode itself)."""
        self.no_open = self.no_open and bool(flags & wire.NO_OPEN_SUPPORT)
        if backing is not None and flags & wire.PASSTHROUGH and self.wants_passthrough:
            self.passthrough = Passthrough(self.fs, backing)
            self.fs.stats.passthrough_active = True
            assert self.fs.whole is not None  # (wants_passthrough)
            self.fs.whole.watch(self.passthrough.dropped)
        if notifier is not None:
            notifier.report = self.notified
            self.fs.attach_kernel_cache(notifier)

    def notified(self, code: int, error: int) -> None:
        """Count a notification's outcome (called from the notifier's thread; only it writes these)."""
        stats = self.fs.stats
        if error == errno.ENOBUFS:
            stats.inval_dropped += 1
            return
        if code == wire.NOTIFY_INVAL_ENTRY:
            stats.inval_entries += 1
        else:
            stats.inval_inodes += 1
        if error == errno.ENOENT:
            stats.inval_not_cached += 1
        elif error:
            stats.inval_errors += 1

    def failure(self, opcode: int, exc: BaseException) -> int:
        """The errno ``exc`` is answered with; bugs are logged with their traceback."""
        code = errno_of(exc)
        name = wire.OPCODE_NAMES.get(opcode, str(opcode))
        if not isinstance(exc, (FsError, CacheError, OSError)):
            log.error("unexpected error in %s", name, exc_info=exc)
        elif code in (errno.EIO, errno.ESTALE):
            log.warning("%s failed: %s", name, exc)
        return code

    def _open_flags(self, keep_cache: bool, flags: int = os.O_WRONLY) -> int:
        """FOPEN flags of an open: KEEP_CACHE as ``CacheFS`` decided, DIRECT_IO with ``--direct-io``,
        and NOFLUSH for a descriptor opened only to read: its close() has nothing to make durable
        (``CacheFS.flush`` acts on written handles only), so the kernel need not send FLUSH (Linux
        5.16 or later; older kernels ignore the bit and send it, answered as before)."""
        out = (wire.FOPEN_KEEP_CACHE if keep_cache else 0) | (wire.FOPEN_DIRECT_IO if self.direct_io else 0)
        if flags & os.O_ACCMODE == os.O_RDONLY and not flags & os.O_TRUNC:
            out |= wire.FOPEN_NOFLUSH
        return out

    # ------------------------------------------------------------------------------- reading
    def lookup_now(self, req: Request) -> Reply | Later:
        attrs = self.fs.lookup_now(req.nodeid, req.name(), req.pid)
        return LATER if attrs is None else entry(attrs)

    def getattr_now(self, req: Request) -> Reply | Later:
        attrs = self.fs.getattr_now(req.nodeid)
        return LATER if attrs is None else attr(attrs)

    async def lookup(self, req: Request) -> Reply:
        return entry(await self.fs.lookup(req.nodeid, req.name(), req.pid))

    async def getattr(self, req: Request) -> Reply:
        return attr(await self.fs.getattr(req.nodeid))

    def _forget(self, nodeid: int, nlookup: int) -> None:
        fh = self.implicit.pop(nodeid, None)
        if fh is not None:
            self.fs.release(fh)
        self.fs.forget(nodeid, nlookup)
        if self.passthrough is not None:
            self.passthrough.forgotten(nodeid)

    def forget(self, req: Request) -> Reply:
        self._forget(req.nodeid, wire.FORGET_IN.unpack_from(req.body)[0])
        return None

    def batch_forget(self, req: Request) -> Reply:
        count = wire.BATCH_FORGET_IN.unpack_from(req.body)[0]
        for nodeid, nlookup in wire.FORGET_ONE.iter_unpack(req.body[wire.BATCH_FORGET_IN.size:][:count * 16]):
            self._forget(nodeid, nlookup)
        return None

    def open_now(self, req: Request) -> Reply | Later:
        """An open answered at once where ``CacheFS.open_now`` can (a warm file: no task, no wait)."""
        if self.no_open or self.passthrough is not None:
            return LATER
        flags = wire.OPEN_IN.unpack_from(req.body)[0]
        opened = self.fs.open_now(req.nodeid, flags, req.pid)
        if opened is None:
            return LATER
        return wire.open_out(opened[0], self._open_flags(opened[1], flags))

    async def open(self, req: Request) -> Reply:
        if self.no_open:
            raise FuseError(errno.ENOSYS)  # from now on the kernel opens files itself (see __init__)
        flags = wire.OPEN_IN.unpack_from(req.body)[0]
        fh, keep_cache = await self.fs.open(req.nodeid, flags, req.pid)
        out = self._open_flags(keep_cache, flags)
        if self.passthrough is not None:
            backing_id = await self.passthrough.open(req.nodeid, fh, flags)
            if backing_id is not None:
                return wire.open_out(fh, wire.FOPEN_PASSTHROUGH | out & wire.FOPEN_PASSTHROUGH_ALLOWED, backing_id)
            self.passthrough.ordinary_open(req.nodeid, fh)
        return wire.open_out(fh, out)

    async def read(self, req: Request) -> Reply:
        fh, offset, size = wire.READ_IN.unpack_from(req.body)[:3]
        if fh == 0 and self.no_open:
            fh = await self._implicit(req.nodeid)
        return await self.fs.read(fh, offset, size)

    def read_from_disk_now(self, req: Request) -> Reply | Later | OffLock:
        fh, offset, size = wire.READ_IN.unpack_from(req.body)[:3]
        if fh == 0 and self.no_open:
            fh = self.implicit.get(req.nodeid, 0)
            if fh == 0:
                return LATER  # (``read`` opens the inode's handle first)
        read = self.fs.read_from_disk_now(fh, offset, size)
        return LATER if read is None else _DiskReply(read)

    async def _implicit(self, nodeid: int) -> int:
        """The handle READs of ``nodeid`` use on a mount the kernel opens files of itself."""
        fh = self.implicit.get(nodeid)
        if fh is None:
            opened, _ = await self.fs.open(nodeid, os.O_RDONLY)
            fh = self.implicit.setdefault(nodeid, opened)
            if fh != opened:  # another READ of the inode opened one meanwhile
                self.fs.release(opened)
        return fh

    def release(self, req: Request) -> Reply:
        fh = wire.RELEASE_IN.unpack_from(req.body)[0]
        if self.passthrough is not None:
            self.passthrough.release(fh)
        self.fs.release(fh)
        return None

    async def opendir(self, req: Request) -> Reply:
        return wire.open_out(await self.fs.opendir(req.nodeid), 0)

    def readdir(self, req: Request) -> Reply:
        fh, offset, size = wire.READ_IN.unpack_from(req.body)[:3]
        plus = req.opcode == wire.READDIRPLUS
        out = wire.DirentBuffer(size, plus)
        for item in self.fs.readdir(fh, offset):
            a = item.attrs
            if not out.add(item.name, attr_of(a), item.next_id, a.entry_timeout, a.attr_timeout):
                break
            if plus:
                self.fs.add_lookup(a.inode)  # the kernel holds a reference to each entry it was given
        return out.payload()

    def releasedir(self, req: Request) -> Reply:
        self.fs.releasedir(wire.RELEASE_IN.unpack_from(req.body)[0])
        return None

    def statfs(self, req: Request) -> Reply:
        st = self.fs.statfs()
        return wire.statfs_out(st.blocks, st.blocks_free, st.blocks_free, st.files, st.files_free, st.block_size,
                               st.name_max, st.block_size)

    def getxattr(self, req: Request) -> Reply:
        size = wire.GETXATTR_IN.unpack_from(req.body)[0]
        return sized(self.fs.getxattr(req.nodeid, req.name(wire.GETXATTR_IN.size)), size)

    def listxattr(self, req: Request) -> Reply:
        size = wire.GETXATTR_IN.unpack_from(req.body)[0]
        return sized(b"".join(name + b"\0" for name in self.fs.listxattr(req.nodeid)), size)

    async def flush(self, req: Request) -> Reply:
        fh = wire.FLUSH_IN.unpack_from(req.body)[0]
        if fh == 0 and self.no_open:
            raise FuseError(errno.ENOSYS)  # a file the kernel opened itself: nothing to flush, ever
        await self.fs.flush(fh)
        return None

    async def fsync(self, req: Request) -> Reply:
        fh, flags, _ = wire.FSYNC_IN.unpack_from(req.body)
        if fh == 0 and self.no_open:
            return None  # a file the kernel opened itself, on a mount that writes nothing
        await self.fs.fsync(fh, bool(flags & wire.FSYNC_FDATASYNC))
        return None

    # ------------------------------------------ modifying (EROFS on a read-only mount: the fs decides)
    async def setattr(self, req: Request) -> Reply:
        (valid, _, fh, size, _, _, mtime, _, _, mtime_ns, _, mode, _, uid, gid, _) = wire.SETATTR_IN.unpack_from(req.body)
        changes: dict[str, int | float] = {}
        if valid & wire.FATTR_SIZE:
            changes["size"] = size
        if valid & wire.FATTR_MTIME:
            changes["mtime"] = time.time() if valid & wire.FATTR_MTIME_NOW else mtime + mtime_ns / 1e9
        if valid & wire.FATTR_MODE:
            changes["mode"] = mode
        if valid & wire.FATTR_UID:
            changes["uid"] = uid
        if valid & wire.FATTR_GID:
            changes["gid"] = gid
        return attr(await self.fs.setattr(req.nodeid, fh=fh if valid & wire.FATTR_FH else None, **changes))  # type: ignore[arg-type]

    async def mknod(self, req: Request) -> Reply:
        mode = wire.MKNOD_IN.unpack_from(req.body)[0]
        return entry(await self.fs.mknod(req.nodeid, req.name(wire.MKNOD_IN.size), mode))

    async def mkdir(self, req: Request) -> Reply:
        mode = stat.S_IMODE(wire.MKDIR_IN.unpack_from(req.body)[0]) | stat.S_IFDIR
        return entry(await self.fs.mkdir(req.nodeid, req.name(wire.MKDIR_IN.size), mode))

    async def unlink(self, req: Request) -> Reply:
        await self.fs.unlink(req.nodeid, req.name())
        return None

    async def rmdir(self, req: Request) -> Reply:
        await self.fs.rmdir(req.nodeid, req.name())
        return None

    async def rename(self, req: Request) -> Reply:
        old, new = req.names(wire.RENAME_IN.size)
        await self.fs.rename(req.nodeid, old, wire.RENAME_IN.unpack_from(req.body)[0], new, 0)
        return None

    async def rename2(self, req: Request) -> Reply:
        new_parent, flags, _ = wire.RENAME2_IN.unpack_from(req.body)
        old, new = req.names(wire.RENAME2_IN.size)
        await self.fs.rename(req.nodeid, old, new_parent, new, flags)
        return None

    async def create(self, req: Request) -> Reply:
        flags, mode, _, _ = wire.CREATE_IN.unpack_from(req.body)
        fh, keep_cache, attrs = await self.fs.create(req.nodeid, req.name(wire.CREATE_IN.size), mode, flags)
        if self.passthrough is not None:
            self.passthrough.ordinary_open(attrs.inode, fh)
        return entry(attrs), wire.open_out(fh, self._open_flags(keep_cache))

    async def write(self, req: Request) -> Reply:
        fh, offset, size = wire.WRITE_IN.unpack_from(req.body)[:3]
        data = req.body[wire.WRITE_IN.size:wire.WRITE_IN.size + size]
        return wire.write_out(await self.fs.write(fh, offset, data))  # type: ignore[arg-type]

    async def fallocate(self, req: Request) -> Reply:
        fh, offset, length, mode, _ = wire.FALLOCATE_IN.unpack_from(req.body)
        await self.fs.fallocate(fh, mode, offset, length)
        return None

    def symlink(self, req: Request) -> Reply:
        self.fs.unsupported("symlink")
        return None

    def link(self, req: Request) -> Reply:
        self.fs.unsupported("link")
        return None

    def setxattr(self, req: Request) -> Reply:
        self.fs.unsupported("setxattr")
        return None

    def removexattr(self, req: Request) -> Reply:
        self.fs.unsupported("removexattr")
        return None
