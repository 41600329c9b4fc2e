"""Block files: how the disk tier writes and reads one block, with or without the page cache.

``tiering.tiers.disk`` owns the index, capacity and eviction of the tier; this module owns the bytes of
one file: ``BlockFiles.write`` writes a framed block (``tiering.tiers.blockformat``) to a new file,
``BlockFiles.read`` reads one back into a buffer of the block pool and checks it. Both are called
from worker threads and hold no lock of the tier; every system call releases the GIL.

O_DIRECT for large blocks
-------------------------
Blocks of 1 MiB and more (``ALIGNED_MIN_BYTES``) are framed with their data on a 4 KiB boundary and
written and read with ``O_DIRECT``: the device reads from and writes into the block's own
page-aligned buffer (``tiering.buffers``), and no byte is copied into the page cache. Why: on the
2-core VM of issue 25 a buffered write of new 8 MiB files cost 2.07-2.18 CPU-s/GiB, all of it the
kernel's copy into new page-cache pages (62% of the daemon's cycles during a cold read), against
0.08 CPU-s/GiB with ``O_DIRECT`` at 1.6 GB/s; a read of dropped pages cost 0.89 against 0.04
(``dd``, 1 GiB in 8 MiB requests, the same ext4). The page cache would only hold a second copy of
what the RAM tier already keeps.

A write sends the header page and the data in one ``pwritev``; a read takes the header page, checks
it, then reads the data in one ``preadv`` into a pool buffer rounded up to 4 KiB (the file ends
where the data does, so the read stops there), and the RAM tier keeps a read-only view of that
buffer: one transfer, by the device, per byte.

What goes through the page cache instead, from and into the same buffers: a tail shorter than
4 KiB (``F_SETFL`` turns ``O_DIRECT`` off on the open file for it); a block whose buffer is not
page-aligned (the kernel answers ``EINVAL``; counted in ``unaligned_writes``: a block that did not
come from the pool); a packed block (format version 1: small blocks, and large ones an earlier
version wrote); and everything on a filesystem that refuses ``O_DIRECT`` at open (tmpfs before
Linux 6.6, some FUSE filesystems: logged once, then never asked again).

A packed block (everything under 1 MiB: a small file's block) is read in one ``preadv`` into its
header, a block buffer and one byte more (``_read_packed``): the layout follows from the token and
the indexed size, a byte read past the data is a trailing byte, and the checks are the same.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from tiering.tiers.blockformat import (
    ALIGNED_MIN_BYTES,
    FIXED_HEADER_SIZE,
    CorruptBlockError,
    check_data,
    check_fixed_header,
    check_header_token,
    packed_offset,
)
from tiering.blocks import BlockData
from tiering.buffers import BLOCK_BUFFERS, DIRECT_ALIGN, align_up, aligned_page, reply_scratch
from tiering.pagecache import cached
from tiering.private import PRIVATE_DIR_MODE, UnsafePathError, open_private

log = logging.getLogger("tiering.tiers.disk")

# Linux; 0 where the platform has none (then every block goes through the page cache).
_O_DIRECT = getattr(os, "O_DIRECT", 0)
# preadv2's "only what the page cache holds" (Linux 4.14); 0 where there is none: then a read for a
# reply goes to the device with O_DIRECT at once (or through the page cache without it).
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


@dataclass
class BlockFd:
    fd: int
    direct: bool  # opened with O_DIRECT, and not cleared since


def set_direct(fd: int) -> None:
    """Turn ``O_DIRECT`` on for an open file (``EINVAL`` where its filesystem refuses it)."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | _O_DIRECT)


def clear_direct(fd: int) -> None:
    """Turn ``O_DIRECT`` off on an open file (Linux lets ``F_SETFL`` change it), for unaligned parts."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)


def _skip(parts: list[memoryview], count: int) -> list[memoryview]:
    """``parts`` without their first ``count`` bytes."""
    while parts and count >= len(parts[0]):
        count -= len(parts[0])
        parts = parts[1:]
    if parts and count:
        parts = [parts[0][count:], *parts[1:]]
    return parts


def pwrite_all(fd: int, parts: list[memoryview], offset: int) -> int:
    """Write every byte of ``parts`` at ``offset`` (``pwritev``, repeated after a short write); the
    offset reached. A short ``O_DIRECT`` write leaves an unaligned rest, which the caller then
    writes without it."""
    start = offset
    parts = [p for p in parts if len(p)]
    while parts:
        written = os.pwritev(fd, parts, offset)
        if written <= 0:
            raise OSError(errno.EIO, "short write to a block file")
        offset += written
        parts = _skip(parts, written)
        if parts and offset % DIRECT_ALIGN:
            clear_direct(fd)
    return offset - start


def pread_into(fd: BlockFd, buffer: memoryview, offset: int, want: int) -> int:
    """Read up to ``want`` bytes at ``offset`` into ``buffer`` (a direct read asks for the whole
    aligned buffer and gets what the file holds); the bytes read, fewer only at the end of the file."""
    got = 0
    while got < want:
        view = buffer[got:] if fd.direct else buffer[got:want]
        n = os.preadv(fd.fd, [view], offset + got)
        if n <= 0:
            break
        got += n
        if got < want and fd.direct and got % DIRECT_ALIGN:
            clear_direct(fd.fd)  # an unaligned short read: the rest through the page cache
            fd.direct = False
    return min(got, want)



def _read_packed(fd: int, token: bytes, indexed_size: int) -> BlockData | None:
    """A packed block (the data right after its header: every block under ``ALIGNED_MIN_BYTES``) read
    in one ``preadv`` into its header, a block buffer and one more byte, then checked as ``_read``
    checks it. None where the file is not laid out so (an aligned or an older block, a short read):
    the caller then reads it step by step.

    One system call where the step-by-step read makes three (header page, data, ``fstat`` for
    trailing bytes): a disk-tier hit of a 100 KiB file cost 67 us of worker CPU, two thirds of it
    system calls and the path (measured on a loaded 2-core VM)."""
    offset = packed_offset(len(token))
    data_len = indexed_size - offset
    if not 0 <= data_len < ALIGNED_MIN_BYTES:
        return None
    head = bytearray(offset)
    buffer = BLOCK_BUFFERS.take(data_len)
    extra = bytearray(1)  # filled only when the file holds bytes after the data
    got = os.preadv(fd, [head, buffer, extra], 0)
    if got < offset + data_len:
        return None
    if got > offset + data_len:
        raise CorruptBlockError("trailing bytes after the data")
    fixed = bytes(head[:FIXED_HEADER_SIZE])
    header = check_fixed_header(fixed, token)
    if header.data_offset != offset or header.data_len != data_len:
        raise CorruptBlockError(f"file is {indexed_size} bytes, header says {header.data_offset + header.data_len}")
    check_header_token(fixed, memoryview(head)[FIXED_HEADER_SIZE:], token)
    data = buffer.toreadonly()
    check_data(data, data_len, header.data_crc)
    return data

class BlockFiles:
    """Writes and reads the block files of one tier (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.direct = bool(_O_DIRECT)  # off for good once the filesystem refuses O_DIRECT
        self.unaligned_writes = 0  # aligned blocks whose buffer was not page-aligned (written buffered)
        self._lock = threading.Lock()

    def write(self, tmp: Path, final: Path, header: bytes, data: BlockData) -> None:
        """Write a new block file ``tmp`` (header with its padding, then the data) and rename it to
        ``final``. Created, never reused (``O_EXCL`` also refuses a symlink at the temp name), 0600,
        without following a link (``tiering.private``); O_DIRECT where the module docstring says."""
        total = len(header) + len(data)
        direct = self.direct and len(data) >= ALIGNED_MIN_BYTES and len(header) % DIRECT_ALIGN == 0
        fd = self._open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, direct)
        try:
            done = 0
            if fd.direct:
                body = len(data) - len(data) % DIRECT_ALIGN
                page = aligned_page(len(header))
                page[: len(header)] = header
                try:
                    done = pwrite_all(fd.fd, [page, memoryview(data)[:body]], 0)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    self._count_unaligned()
                if done < total:
                    clear_direct(fd.fd)  # the tail (or an unaligned buffer) goes through the page cache
            if done < total:
                parts = _skip([memoryview(header), memoryview(data)], done)
                pwrite_all(fd.fd, parts, done)
        finally:
            os.close(fd.fd)
        os.replace(tmp, final)

    def read(self, path: Path | str, token: bytes, indexed_size: int) -> BlockData:
        """Read and check the block file ``path`` of ``indexed_size`` bytes for ``token``: a read-only
        view of a pool buffer. Raises ``CorruptBlockError`` (any failed check, or a symlink) or
        ``OSError``.

        A filesystem that opens with ``O_DIRECT`` but refuses the read itself (``EINVAL``) is not a
        failing disk: the block is read again through the page cache and the tier stops asking."""
        direct = self.direct and indexed_size >= ALIGNED_MIN_BYTES
        try:
            return self._read(path, token, indexed_size, direct)
        except OSError as exc:
            if not direct or exc.errno != errno.EINVAL:
                raise
            self._refused(path)
            return self._read(path, token, indexed_size, False)

    def _read(self, path: Path | str, token: bytes, indexed_size: int, direct: bool) -> BlockData:
        try:
            fd = self._open(path, os.O_RDONLY, direct)
        except UnsafePathError as exc:  # a symlink where a block file should be: not ours
            raise CorruptBlockError(str(exc)) from exc
        try:
            if not fd.direct:
                packed = _read_packed(fd.fd, token, indexed_size)
                if packed is not None:
                    return packed
                # Not laid out as a packed block of this size: read it step by step.
            page = aligned_page(DIRECT_ALIGN)
            got = pread_into(fd, page, 0, DIRECT_ALIGN)
            fixed = bytes(page[:min(got, FIXED_HEADER_SIZE)])
            data_len, data_crc, offset = check_fixed_header(fixed, token)
            if offset + data_len != indexed_size:
                raise CorruptBlockError(f"file is {indexed_size} bytes, header says {offset + data_len}")
            if offset > got:  # a header longer than one page (a very long key): read it whole
                page = aligned_page(offset)
                got = pread_into(fd, page, 0, offset)
                if got < offset:
                    raise CorruptBlockError("truncated header")
            check_header_token(fixed, page[FIXED_HEADER_SIZE:offset], token)
            if fd.direct and offset % DIRECT_ALIGN:
                clear_direct(fd.fd)  # a packed block: its data is not aligned in the file
                fd.direct = False
            buffer = BLOCK_BUFFERS.take(align_up(data_len) if fd.direct else data_len)
            if pread_into(fd, buffer, offset, data_len) != data_len:
                raise CorruptBlockError("truncated data")
            if os.fstat(fd.fd).st_size != offset + data_len:
                raise CorruptBlockError("trailing bytes after the data")
        finally:
            os.close(fd.fd)
        data = buffer[:data_len].toreadonly()
        check_data(data, data_len, data_crc)
        return data

    def read_for_reply(self, path: str, token: bytes, indexed_size: int) -> memoryview:
        """Read and check the whole block file ``path`` into this thread's reply buffer
        (``tiering.buffers.reply_scratch``): a read-only view of its data, valid until the thread's
        next call, for a reply written at once. Raises as ``read``.

        One read of the whole file, header and data, whatever its layout: first from the page cache
        only (``RWF_NOWAIT``: a block written or read lately costs a copy and no I/O), and where that
        falls short, from the device with ``O_DIRECT`` into the same aligned buffer (turned on with
        ``F_SETFL`` on the open file): no page-cache pages to allocate, fill and copy from. Measured
        on the 2-core VM, 100 KiB block files whose pages were dropped: 35-38 us of CPU per block
        with ``O_DIRECT`` against 100 us through the page cache (and 45 us where the page cache held
        them). The buffer asks for one byte more than the indexed size: a longer file is corrupt."""
        want = indexed_size + 1
        buffer = reply_scratch(want)
        try:
            fd = open_private(path, os.O_RDONLY)
        except UnsafePathError as exc:  # a symlink where a block file should be: not ours
            raise CorruptBlockError(str(exc)) from exc
        try:
            got = self._read_whole(fd, buffer, want, path)
        finally:
            os.close(fd)
        if got < indexed_size:
            raise CorruptBlockError(f"file is {got} bytes, indexed {indexed_size}")
        if got > indexed_size:
            raise CorruptBlockError("trailing bytes after the data")
        data_len, data_crc, offset = check_fixed_header(bytes(buffer[:FIXED_HEADER_SIZE]), token)
        if offset + data_len != indexed_size:
            raise CorruptBlockError(f"file is {indexed_size} bytes, header says {offset + data_len}")
        check_header_token(buffer[:FIXED_HEADER_SIZE], buffer[FIXED_HEADER_SIZE:offset], token)
        data = buffer[offset:indexed_size].toreadonly()
        check_data(data, data_len, data_crc)
        return data

    def _read_whole(self, fd: int, buffer: memoryview, want: int, path: str) -> int:
        """Up to ``want`` bytes of the file from offset 0 into ``buffer`` (page-aligned, ``want``
        rounded up): the page cache's if it holds them all, else the device's (``read_for_reply``).
        The page cache is asked first (``tiering.pagecache``): a ``RWF_NOWAIT`` read that misses starts
        read-ahead I/O of the bytes the ``O_DIRECT`` read then reads again; it is tried only where the
        kernel cannot say."""
        in_cache = cached(fd, 0, want - 1)
        if in_cache:
            return pread_into(BlockFd(fd, False), buffer, 0, want)
        if in_cache is None and _RWF_NOWAIT:
            try:
                got = os.preadv(fd, [buffer[:want]], 0, _RWF_NOWAIT)
            except (BlockingIOError, InterruptedError):
                got = -1  # not all cached
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                got = -1  # a filesystem without non-blocking reads
            # A short read is either the end of the file or the end of what is cached: fstat tells.
            if got >= 0 and (got == want or got == os.fstat(fd).st_size):
                return got
        if self.direct:
            try:
                set_direct(fd)
                got = 0
                while got < want:  # whole pages, into the aligned buffer
                    n = os.preadv(fd, [buffer[got:]], got)
                    if n <= 0:
                        break
                    got += n
                    if got % DIRECT_ALIGN:
                        break  # the end of the file: a direct read stops short of a page only there
                return min(got, want)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._refused(path)
                clear_direct(fd)
        return pread_into(BlockFd(fd, False), buffer, 0, want)

    def _open(self, path: Path | str, flags: int, direct: bool) -> BlockFd:
        """Open a block file, with ``O_DIRECT`` when asked and the filesystem takes it: one that refuses
        it (``EINVAL`` at open: tmpfs before Linux 6.6, some FUSE filesystems) turns it off for the
        tier, with one log line. Prefix directories are made on first use."""
        if direct:
            try:
                return BlockFd(self._open_dirs(path, flags | _O_DIRECT), True)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._refused(path)
        return BlockFd(self._open_dirs(path, flags), False)

    def _refused(self, path: Path | str) -> None:
        """The filesystem refused O_DIRECT: every later block goes through the page cache (logged once)."""
        if self.direct:
            self.direct = False
            log.info("%s tier: the filesystem of %s does not take O_DIRECT; blocks go through the page cache",
                     self.name, Path(path).parent)

    @staticmethod
    def _open_dirs(path: Path | str, flags: int) -> int:
        try:
            return open_private(path, flags)
        except FileNotFoundError:
            if not flags & os.O_CREAT:
                raise
            # Prefix directories are made on first use (and again if someone removed them).
            os.makedirs(Path(path).parent, mode=PRIVATE_DIR_MODE, exist_ok=True)
            return open_private(path, flags)

    def _count_unaligned(self) -> None:
        with self._lock:
            self.unaligned_writes += 1
