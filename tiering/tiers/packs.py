"""Pack files: the disk tier's small blocks as records of a few large files, not one file each.

Why. A small file's block (under ``ALIGNED_MIN_BYTES``: a 100 KiB image) used to be a file of its
own: ``open(O_CREAT)`` of a temp name, the write, ``close``, ``rename``, a stamp with ``utime``, and
``mkdir`` of its prefix directory on first use. Creating the inode was most of it. Measured on the
2-core VM of issue 35 (ext4 without a journal, where every inode allocation scans the inode table
for inodes freed lately, ``recently_deleted``): 150-260 us of CPU per new 100 KiB block file, written
alone from one thread, against 33 us to append the same bytes to one open file; in a cold epoch of
2,000 such files, ``openat`` with ``O_CREAT`` was a third of the GET workers' cycles (``perf``), and
every one of those six system calls is a release and a re-take of the GIL among 16 workers. A
journaled filesystem allocates inodes more cheaply, but each block is still a new inode, a directory
entry and a rename. Here a small block is one ``pwritev`` into a file that is already open.

Layout. ``<cache>/packs/<N>.pack``, ``N`` the wall-clock time the pack was started, in ns (made
to grow strictly from one pack to the next, past those a start-up found). A
record is a framed block (``tiering.tiers.blockformat``, the packed layout: header, then data), at
an offset that is a multiple of ``DIRECT_ALIGN`` (4 KiB), so that a reply can be read with
``O_DIRECT`` and an evicted record's pages can be given back to the filesystem whole. One pack takes
appends until it reaches ``PACK_BYTES``; then a new one is opened. Appends never overwrite: a slot is
handed out once (under a lock, the only shared state of a write) and written outside the lock, so
concurrent writers never touch the same bytes, and a reader never sees a record being rewritten.

Eviction punches a hole over the record's slot (``fallocate(PUNCH_HOLE | KEEP_SIZE)``): its blocks
go back to the filesystem at once, and what is read there afterwards is zeros, which no header
check accepts. A pack whose every record is gone, and that takes no more appends, is unlinked. A
filesystem that cannot punch holes gets the record's header page zeroed instead (so that no start-up
finds it again), and gets its space back when the whole pack goes.

Start-up. Each pack is walked record by record: ``SEEK_DATA`` jumps over punched holes, one
``pread`` of the header page gives the token (the block's identity: its digest names it in the
index), the lengths and the header's CRC; a page that holds no valid header is skipped. The data
is checked on each read, as a block file's is: a record torn by a crash fails its data CRC on its
first read and is dropped there. Records have no mtime of their own: after a restart they rank by
when their pack was started (its name: an mtime moves with every punched hole), then by their place
in it (the order they were written), among the block files ranked by mtime; so hits before a
restart do not move them, where a block file keeps them with one ``utime`` per hit.

Reads open the pack (an existing inode: a path lookup, no allocation) and read the record into a
pool buffer (``read``) or the thread's reply buffer (``read_for_reply``, the page cache first, then
``O_DIRECT``), with the checks of a block file, except the one for trailing bytes: the record's
length is the header's, and what follows it in the pack is the next record.

The page cache is tried with a ``RWF_NOWAIT`` read, which, when it misses, starts the kernel's
read-ahead from the record on before it answers ``EAGAIN``: in a pack that brings the records written
after it, which is what an epoch read in the order it was fetched reads next. Measured on the 2-core
VM (``benchmarks.passthrough``, a writable mount's epoch of 2,000 files of 100 KiB, in that order):
289-317 us of daemon CPU per file this way, against 357-408 us when ``tiering.pagecache`` was asked
first and a record not cached was read with ``O_DIRECT`` (through the page cache when it followed the
previous one), and 341-367 with read descriptors kept open per pack; why those cost more in the
daemon was not found (a loop over one pack alone gave the opposite). In a shuffled order the
read-ahead is waste: a loop over one pack read 171 KiB from the device per 104 KiB record and spent
59-68 us of CPU on it, against 104 KiB and 30-34 us with ``cachestat`` first. Block files, one per
block, have no neighbour to read ahead for, and ask ``tiering.pagecache`` first (``BlockFiles``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import logging
import os
import re
import threading
import time
import weakref
from pathlib import Path
from typing import NamedTuple

from tiering.blocks import BlockData
from tiering.buffers import BLOCK_BUFFERS, DIRECT_ALIGN, align_up, reply_scratch
from tiering.private import PRIVATE_DIR_MODE, UnsafePathError, open_private
from tiering.fileio import libc_function
from tiering.tiers.blockfile import BlockFd, clear_direct, pread_into, pwrite_all, set_direct
from tiering.tiers.blockformat import (
    FIXED_HEADER_SIZE,
    HEADER_CRC_SIZE,
    CorruptBlockError,
    check_data,
    check_fixed_header,
    check_header_token,
    decode_block,
    header_fields,
)

log = logging.getLogger("tiering.tiers.disk")

PACKS_DIRNAME = "packs"
PACK_SUFFIX = ".pack"
# A pack takes appends up to this size, then the next is opened: one file (and one inode) per ~640
# blocks of 100 KiB. Large enough that creating packs costs nothing per block, small enough that a
# pack whose records are all evicted comes back whole soon (holes give most of it back before that).
PACK_BYTES = 64 * 1024 * 1024
_PACK_NAME = re.compile(r"^([0-9]{1,20})\.pack$")
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
_SEEK_DATA = getattr(os, "SEEK_DATA", None)
# <linux/falloc.h>
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02


# os.posix_fallocate takes no mode; fallocate(2) with PUNCH_HOLE is glibc's since 2.10.
_FALLOCATE = libc_function("fallocate", [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64], ctypes.c_int)


class PackSlot(NamedTuple):
    """Where one record is: its pack's number and its offset there."""

    pack: int
    offset: int


class _Pack:
    __slots__ = ("seq", "path", "end", "live", "writers", "fd", "sealed")

    def __init__(self, seq: int, path: str, end: int, live: int, fd: int = -1) -> None:
        self.seq = seq
        self.path = path
        self.end = end  # the next free offset (appends only)
        self.live = live  # slot bytes of the records not freed
        self.writers = 0  # appends in flight into this pack
        self.fd = fd  # open for appends while it takes them; -1 once sealed and idle
        self.sealed = fd < 0  # takes no more appends


class FoundRecord(NamedTuple):
    """A record a start-up scan found: the block's digest, its size (header and data), where it is."""

    digest: str
    size: int
    slot: PackSlot


def _punch(fd: int, offset: int, length: int) -> bool:
    """Give ``length`` bytes at ``offset`` back to the filesystem (reading zeros after); False where
    the filesystem or platform cannot."""
    if _FALLOCATE is None:
        return False
    if _FALLOCATE(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err))


class PackFiles:
    """The pack files of one tier: append, read, free and find again records (module docstring)."""

    def __init__(self, directory: Path, name: str, *, pack_bytes: int = PACK_BYTES) -> None:
        self.name = name
        self.directory = Path(directory)
        self._dir = str(self.directory)
        self.pack_bytes = pack_bytes
        self.direct = bool(_O_DIRECT)
        self.punched = 0  # records whose slot went back to the filesystem (tests, stats)
        self._lock = threading.Lock()
        self._packs: dict[int, _Pack] = {}
        # A tier dropped without close() (tests make hundreds) closes its pack when collected.
        weakref.finalize(self, _close_appends, self._packs)
        self._active: _Pack | None = None
        self._next_seq = 1
        try:
            self.directory.mkdir(mode=PRIVATE_DIR_MODE, exist_ok=True)
        except OSError as exc:
            raise OSError(exc.errno, f"cache directory {self.directory} cannot be created: {exc.strerror}") from exc

    def path(self, pack: int) -> str:
        return f"{self._dir}/{pack}{PACK_SUFFIX}"

    # -- writing ---------------------------------------------------------------------------------

    def append(self, header: bytes, data: BlockData) -> PackSlot:
        """Write one record (``header`` then ``data``) and say where it is; ``OSError`` if the disk
        fails (the slot is then freed, and nothing indexes it)."""
        size = len(header) + len(data)
        span = align_up(size)
        with self._lock:
            pack = self._active
            if pack is None or pack.sealed or (pack.end + span > self.pack_bytes and pack.end > 0):
                pack = self._open_next()
            offset = pack.end
            pack.end += span
            pack.live += span
            pack.writers += 1
        try:
            pwrite_all(pack.fd, [memoryview(header), memoryview(data)], offset)
        except BaseException:
            with self._lock:
                pack.writers -= 1
                self._close_if_idle(pack)
            self.free(PackSlot(pack.seq, offset), size)
            raise
        with self._lock:
            pack.writers -= 1
            self._close_if_idle(pack)
        return PackSlot(pack.seq, offset)

    def _open_next(self) -> _Pack:
        """Seal the active pack and open a new one (lock held: one system call, once per pack)."""
        old = self._active
        if old is not None:
            old.sealed = True
            self._close_if_idle(old)
        seq = max(self._next_seq, time.time_ns())
        self._next_seq = seq + 1
        path = self.path(seq)
        fd = open_private(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        pack = _Pack(seq, path, 0, 0, fd)
        self._packs[seq] = pack
        self._active = pack
        return pack

    def _close_if_idle(self, pack: _Pack) -> None:
        """Close a sealed pack's append descriptor once no append uses it; unlink it if it holds
        nothing any more (lock held)."""
        if pack.sealed and pack.writers == 0:
            if pack.fd >= 0:
                os.close(pack.fd)
                pack.fd = -1
            if pack.live <= 0:
                self._packs.pop(pack.seq, None)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(pack.path)

    def free(self, slot: PackSlot, size: int) -> None:
        """Give a record's slot back: punch it out (or zero its header page where the filesystem
        cannot), and unlink its pack once nothing in it is left. ``OSError`` if the disk fails."""
        span = align_up(size)
        with self._lock:
            pack = self._packs.get(slot.pack)
            if pack is None:
                return
            pack.live -= span
            if pack.live <= 0 and pack.sealed and pack.writers == 0:
                self._close_if_idle(pack)  # unlinks it: no need to punch
                return
        try:
            fd = open_private(pack.path, os.O_WRONLY)
        except FileNotFoundError:
            return  # its last other record was freed meanwhile, and the pack with it
        try:
            if _punch(fd, slot.offset, span):
                self.punched += 1
            else:
                pwrite_all(fd, [memoryview(bytes(DIRECT_ALIGN))], slot.offset)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Close the append descriptor (the daemon's exit; tests)."""
        with self._lock:
            if self._active is not None:
                self._active.sealed = True
                if self._active.fd >= 0 and self._active.writers == 0:
                    os.close(self._active.fd)
                    self._active.fd = -1
                self._active = None

    # -- reading ---------------------------------------------------------------------------------

    def read(self, slot: PackSlot, token: bytes, size: int) -> BlockData:
        """The record at ``slot``, checked for ``token`` and ``size``: a read-only view of a pool
        buffer. ``CorruptBlockError`` for any failed check, ``FileNotFoundError`` if its pack is gone."""
        fd = self._open_read(slot.pack)
        try:
            return _read_record(fd, slot.offset, token, size)
        finally:
            os.close(fd)

    def read_for_reply(self, slot: PackSlot, token: bytes, size: int) -> BlockData:
        """The record at ``slot`` into this thread's reply buffer (``reply_scratch``), checked as
        ``read`` checks it: the page cache's copy if it holds every page, else the device's with
        ``O_DIRECT`` (the record starts on a page; its last page may run into the next record)."""
        buffer = reply_scratch(size)
        fd = self._open_read(slot.pack)
        try:
            got = -1
            if _RWF_NOWAIT:
                try:
                    got = os.preadv(fd, [buffer[:size]], slot.offset, _RWF_NOWAIT)
                except (BlockingIOError, InterruptedError):
                    got = -1
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
            if got < size:
                got = self._read_device(fd, buffer, slot.offset, size)
        finally:
            os.close(fd)
        if got < size:
            raise CorruptBlockError(f"record is {got} bytes, indexed {size}")
        return decode_block(buffer[:size], token)

    def _read_device(self, fd: int, buffer: memoryview, offset: int, size: int) -> int:
        """The record from the device: ``O_DIRECT`` (set on the open file) into the aligned buffer,
        whole pages; through the page cache where the filesystem refuses it (then for good)."""
        if self.direct:
            try:
                set_direct(fd)
                return pread_into(BlockFd(fd, True), buffer[:align_up(size)], offset, size)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False
                log.info("%s tier: the filesystem of %s does not take O_DIRECT; records go through the page cache",
                         self.name, self._dir)
                clear_direct(fd)
        return pread_into(BlockFd(fd, False), buffer, offset, size)

    def _open_read(self, pack: int) -> int:
        try:
            return open_private(self.path(pack), os.O_RDONLY)
        except UnsafePathError as exc:  # a symlink where a pack should be: not ours
            raise CorruptBlockError(str(exc)) from exc

    # -- start-up --------------------------------------------------------------------------------

    def scan(self) -> list[tuple[int, int, FoundRecord]]:
        """Every record of every pack, as ``(pack start ns, order, record)`` (``order``: its place
        among all records found, oldest first). Packs with no record left are removed; later appends
        go to a new pack. Called once, by the tier's constructor, before any other use."""
        found: list[tuple[int, int, FoundRecord]] = []
        seen: dict[str, int] = {}  # digest -> index in found: a later copy replaces an earlier one
        names = []
        with os.scandir(self._dir) as entries:
            for entry in entries:
                match = _PACK_NAME.match(entry.name)
                if match and entry.is_file(follow_symlinks=False):
                    names.append((int(match.group(1)), entry))
                elif not entry.name.startswith("."):
                    log.debug("%s tier: ignoring unexpected file %s", self.name, entry.path)
        for seq, entry in sorted(names, key=lambda item: item[0]):
            self._next_seq = max(self._next_seq, seq + 1)
            try:
                records, end = _walk(self.path(seq))
            except (OSError, UnsafePathError) as exc:
                log.warning("%s tier: cannot read pack %s, dropping it: %s", self.name, entry.path, exc)
                records, end = [], 0
            pack = _Pack(seq, self.path(seq), align_up(end), 0)
            self._packs[seq] = pack
            for offset, digest, size in records:
                earlier = seen.get(digest)
                if earlier is not None:  # a second copy (a crash between a put and its old copy's free)
                    stamp, _order, old = found[earlier]
                    self._packs[old.slot.pack].live -= align_up(old.size)
                    found[earlier] = (stamp, -1, old)  # dead space now, given back with its pack
                seen[digest] = len(found)
                pack.live += align_up(size)
                found.append((seq, len(found), FoundRecord(digest, size, PackSlot(seq, offset))))
        for pack in list(self._packs.values()):
            if pack.live <= 0:
                self._packs.pop(pack.seq)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(pack.path)
        return [item for item in found if item[1] >= 0]


def _close_appends(packs: dict[int, _Pack]) -> None:
    for pack in packs.values():
        if pack.fd >= 0:
            os.close(pack.fd)
            pack.fd = -1


def _walk(path: str) -> tuple[list[tuple[int, str, int]], int]:
    """The records of one pack as ``(offset, digest, size)``, and its length."""
    records: list[tuple[int, str, int]] = []
    fd = open_private(path, os.O_RDONLY)
    try:
        end = os.fstat(fd).st_size
        offset = 0
        page = bytearray(DIRECT_ALIGN)
        while offset < end:
            if _SEEK_DATA is not None:
                try:
                    offset = os.lseek(fd, offset, _SEEK_DATA)
                except OSError as exc:
                    if exc.errno == errno.ENXIO:
                        break  # nothing but a hole up to the end
                    raise
                offset -= offset % DIRECT_ALIGN
            got = os.preadv(fd, [page], offset)
            found = _parse_header(fd, memoryview(page)[:got], offset, end)
            if found is None:
                offset += DIRECT_ALIGN
                continue
            digest, size = found
            records.append((offset, digest, size))
            offset += align_up(size)
    finally:
        os.close(fd)
    return records, end


def _parse_header(fd: int, page: memoryview, offset: int, end: int) -> tuple[str, int] | None:
    """The digest and record size of the header at the start of ``page``, or None if none is there."""
    fields = header_fields(page[:FIXED_HEADER_SIZE])
    if fields is None:
        return None
    token_len, data_len, head = fields
    if offset + head + data_len > end:
        return None  # torn at the end of the pack
    if head > len(page):  # a header longer than a page: a very long key
        rest = bytearray(head - FIXED_HEADER_SIZE)
        if os.preadv(fd, [rest], offset + FIXED_HEADER_SIZE) != len(rest):
            return None
        tail = memoryview(rest)
    else:
        tail = page[FIXED_HEADER_SIZE:head]
    token = bytes(tail[:token_len])
    try:
        check_header_token(page[:FIXED_HEADER_SIZE], tail, token)
    except CorruptBlockError:
        return None
    return hashlib.sha256(token).hexdigest(), head + data_len


def _read_record(fd: int, offset: int, token: bytes, size: int) -> BlockData:
    """One record read with one ``preadv`` into its header and a pool buffer, then checked."""
    head_len = FIXED_HEADER_SIZE + len(token) + HEADER_CRC_SIZE
    data_len = size - head_len
    if data_len < 0:
        raise CorruptBlockError(f"indexed size {size} is shorter than the header")
    head = bytearray(head_len)
    buffer = BLOCK_BUFFERS.take(data_len)
    got = os.preadv(fd, [head, buffer], offset)
    if got < size:
        raise CorruptBlockError(f"record is {got} bytes, indexed {size}")
    header = check_fixed_header(bytes(head[:FIXED_HEADER_SIZE]), token)
    if header.data_offset != head_len or header.data_len != data_len:
        raise CorruptBlockError(f"record is {size} bytes, header says {header.data_offset + header.data_len}")
    check_header_token(memoryview(head)[:FIXED_HEADER_SIZE], memoryview(head)[FIXED_HEADER_SIZE:], token)
    data = buffer.toreadonly()
    check_data(data, data_len, header.data_crc)
    return data


