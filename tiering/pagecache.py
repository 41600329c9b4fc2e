"""Whether the page cache holds a range of a file, asked without reading it (Linux ``cachestat``).

Why. A disk-tier hit is read from the page cache when every page of it is there (a block written or
read lately: a copy, no I/O) and from the device with ``O_DIRECT`` otherwise (no page-cache pages
to allocate, fill and copy). The disk tier used to find out by trying: a ``preadv2`` with
``RWF_NOWAIT`` first. But a ``RWF_NOWAIT`` read that misses still starts the kernel's read-ahead
into the page cache before it answers ``EAGAIN``, and the ``O_DIRECT`` read that follows reads the
same bytes again. Measured on the 2-core VM (2,000 records of 104 KiB read in a shuffled order,
pages dropped): 171 KiB read from the device per record and 59-68 us of CPU, against 104 KiB and
30-34 us when ``cachestat`` (Linux 6.5) tells first, and 15 us, no I/O, when the pages are cached.

``cached`` answers None where it cannot tell (an older kernel, another platform, a filesystem that
refuses it): the caller then tries the page cache the old way.
"""

from __future__ import annotations

import ctypes
import errno
import sys

_SYS_CACHESTAT = 451  # one number on every Linux architecture (the syscall came after the tables were unified)
_PAGE = 4096


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


def _syscall() -> "ctypes._NamedFuncPointer | None":
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn


_SYSCALL = _syscall()
_usable = _SYSCALL is not None


def cached(fd: int, offset: int, length: int) -> bool | None:
    """Whether every page of ``[offset, offset + length)`` of ``fd`` is in the page cache; None where
    the kernel cannot say (then never asked again in this process, unless the file was the reason)."""
    global _usable
    if not _usable:
        return None
    if length <= 0:
        return True  # nothing asked: nothing missing
    first = offset // _PAGE
    last = (offset + length - 1) // _PAGE
    span = _Range(first * _PAGE, (last - first + 1) * _PAGE)
    stat = _Stat()
    assert _SYSCALL is not None
    if _SYSCALL(_SYS_CACHESTAT, fd, ctypes.byref(span), ctypes.byref(stat), 0) != 0:
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EPERM):  # no such call here (or a seccomp filter refuses it)
            _usable = False
        return None
    return stat.cache >= last - first + 1
