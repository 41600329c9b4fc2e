"""The FUSE kernel protocol's wire format: opcodes, the kernel's structs, INIT flags. No I/O.

The layouts are those of the kernel's ``include/uapi/linux/fuse.h`` (little-endian on every
architecture Linux runs FUSE on that this project supports; the kernel writes host order, and a
big-endian kernel is refused at INIT by its byte-swapped opcode). Each struct is one ``struct.Struct``
named after the kernel's, its size pinned by ``tests/unit/test_fuse_wire.py``.

Decoding never copies a payload: ``Request`` keeps a ``memoryview`` of the buffer the session read
the request into, and each opcode's arguments are unpacked from it at their offset. Names are the
only bytes a handler keeps (``name``/``names`` copy them out, NUL stripped). Encoding packs a reply's
fixed part into a small ``bytes``; a reply's variable part (read data, directory entries) travels as
its own buffer beside it, joined by the session's ``os.writev``.

Protocol version. cachefs answers INIT with minor ``KERNEL_MINOR`` (the kernel then speaks the lower
of its own and this) and refuses kernels below ``MIN_KERNEL_MINOR``: 7.23 (Linux 3.15) is the
version whose structs every reply here has (the 64-byte ``fuse_init_out``, ``fuse_rename2_in``,
FUSE_NO_OPEN_SUPPORT, READDIRPLUS); everything newer (MAX_PAGES 7.28, FOPEN_NOFLUSH, PASSTHROUGH
7.40) is used only when the kernel's INIT offers it. PASSTHROUGH is a bit of ``flags2``, read by the
kernel only with INIT_EXT, and fills two words of the same 64-byte ``fuse_init_out`` (``flags2``,
``max_stack_depth``); its ``backing_id`` is the word of ``fuse_open_out`` that was padding before.
"""

from __future__ import annotations

import math
import stat
import struct
from typing import NamedTuple

from cachefs.backing import (  # noqa: F401 - part of the protocol's vocabulary
    BACKING_MAP,
    DEV_IOC_BACKING_CLOSE,
    DEV_IOC_BACKING_OPEN,
    DEV_IOC_MAGIC,
    backing_map,
)

KERNEL_MAJOR = 7
# The minor this side speaks: every struct below has its 7.31 size, and nothing newer than 7.31 is
# asked of the kernel through a version (FOPEN_NOFLUSH and the INIT flags are bits, not versions).
KERNEL_MINOR = 31
MIN_KERNEL_MINOR = 23

# The root directory's node id (FUSE_ROOT_ID).
ROOT_ID = 1


class FuseError(Exception):
    """A request answered with ``errno`` (the only exception a handler lets out on purpose)."""

    def __init__(self, errno: int) -> None:
        super().__init__(errno)
        self.errno = errno

    def __str__(self) -> str:
        return f"FUSE error {self.errno}"


# ----------------------------------------------------------------------------------------- opcodes
LOOKUP = 1
FORGET = 2
GETATTR = 3
SETATTR = 4
READLINK = 5
SYMLINK = 6
MKNOD = 8
MKDIR = 9
UNLINK = 10
RMDIR = 11
RENAME = 12
LINK = 13
OPEN = 14
READ = 15
WRITE = 16
STATFS = 17
RELEASE = 18
FSYNC = 20
SETXATTR = 21
GETXATTR = 22
LISTXATTR = 23
REMOVEXATTR = 24
FLUSH = 25
INIT = 26
OPENDIR = 27
READDIR = 28
RELEASEDIR = 29
FSYNCDIR = 30
GETLK = 31
SETLK = 32
SETLKW = 33
ACCESS = 34
CREATE = 35
INTERRUPT = 36
BMAP = 37
DESTROY = 38
IOCTL = 39
POLL = 40
NOTIFY_REPLY = 41
BATCH_FORGET = 42
FALLOCATE = 43
READDIRPLUS = 44
RENAME2 = 45
LSEEK = 46
COPY_FILE_RANGE = 47
SYNCFS = 50
TMPFILE = 51
STATX = 52

# Names for the log (an opcode's handler is the adapter's method of that name).
OPCODE_NAMES = {globals()[name]: name.lower() for name in (
    "LOOKUP FORGET GETATTR SETATTR READLINK SYMLINK MKNOD MKDIR UNLINK RMDIR RENAME LINK OPEN READ WRITE "
    "STATFS RELEASE FSYNC SETXATTR GETXATTR LISTXATTR REMOVEXATTR FLUSH INIT OPENDIR READDIR RELEASEDIR "
    "FSYNCDIR GETLK SETLK SETLKW ACCESS CREATE INTERRUPT BMAP DESTROY IOCTL POLL NOTIFY_REPLY BATCH_FORGET "
    "FALLOCATE READDIRPLUS RENAME2 LSEEK COPY_FILE_RANGE SYNCFS TMPFILE STATX").split()}

# Notifications (sent by the daemon with unique 0; the code in the header's error field).
NOTIFY_INVAL_INODE = 2
NOTIFY_INVAL_ENTRY = 3
NOTIFY_DELETE = 6
# The protocol minor that brought INVAL_INODE and INVAL_ENTRY (7.12, Linux 2.6.31): older than the
# oldest supported kernel, so every connection takes them; checked anyway, as the kernel's code is.
NOTIFY_INVAL_MIN_MINOR = 12

# ------------------------------------------------------------------------------------ INIT flags
ASYNC_READ = 1 << 0
POSIX_LOCKS = 1 << 1
ATOMIC_O_TRUNC = 1 << 3
EXPORT_SUPPORT = 1 << 4
BIG_WRITES = 1 << 5
DONT_MASK = 1 << 6
SPLICE_WRITE = 1 << 7
SPLICE_MOVE = 1 << 8
SPLICE_READ = 1 << 9
FLOCK_LOCKS = 1 << 10
HAS_IOCTL_DIR = 1 << 11
AUTO_INVAL_DATA = 1 << 12
DO_READDIRPLUS = 1 << 13
READDIRPLUS_AUTO = 1 << 14
ASYNC_DIO = 1 << 15
WRITEBACK_CACHE = 1 << 16
NO_OPEN_SUPPORT = 1 << 17
PARALLEL_DIROPS = 1 << 18
HANDLE_KILLPRIV = 1 << 19
POSIX_ACL = 1 << 20
ABORT_ERROR = 1 << 21
MAX_PAGES = 1 << 22
CACHE_SYMLINKS = 1 << 23
NO_OPENDIR_SUPPORT = 1 << 24
EXPLICIT_INVAL_DATA = 1 << 25
INIT_EXT = 1 << 30
# Bits 32 and up travel in fuse_init_in/out.flags2 (only when INIT_EXT is set in both directions).
PASSTHROUGH = 1 << 37  # reads and mmap of a file opened with FOPEN_PASSTHROUGH go to a backing file

# Flags of fuse_open_out.open_flags.
FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_NONSEEKABLE = 1 << 2
FOPEN_CACHE_DIR = 1 << 3
FOPEN_NOFLUSH = 1 << 5
FOPEN_PASSTHROUGH = 1 << 7
# The only flags the kernel accepts beside FOPEN_PASSTHROUGH (fs/fuse/iomode.c refuses the open with
# EIO otherwise): no KEEP_CACHE, since a passed-through file never uses the FUSE inode's page cache.
FOPEN_PASSTHROUGH_ALLOWED = FOPEN_PASSTHROUGH | FOPEN_DIRECT_IO | FOPEN_NOFLUSH

# ioctls on /dev/fuse for passthrough (and their argument): cachefs.backing, shared with the CSI
# node plugin's broker; named here too, beside the other structs of the kernel's protocol.
# Bind a fresh /dev/fuse descriptor to the connection of the one named in the argument (a u32):
# ``_IOR(229, 0, uint32_t)``: direction read 2 << 30, the argument's size << 16, the magic << 8, the
# number. Each clone has its own list of requests being answered.
_IOC_READ = 2 << 30
DEV_IOC_CLONE = _IOC_READ | 4 << 16 | 229 << 8 | 0

# fuse_setattr_in.valid
FATTR_MODE = 1 << 0
FATTR_UID = 1 << 1
FATTR_GID = 1 << 2
FATTR_SIZE = 1 << 3
FATTR_ATIME = 1 << 4
FATTR_MTIME = 1 << 5
FATTR_FH = 1 << 6
FATTR_ATIME_NOW = 1 << 7
FATTR_MTIME_NOW = 1 << 8

FSYNC_FDATASYNC = 1 << 0
GETATTR_FH = 1 << 0

# ------------------------------------------------------------------------------------------ structs
IN_HEADER = struct.Struct("<IIQQIIIHH")        # fuse_in_header: len opcode unique nodeid uid gid pid extlen pad
OUT_HEADER = struct.Struct("<IiQ")             # fuse_out_header: len error unique
_ATTR = "QQQQQQIIIIIIIIII"                     # fuse_attr: ino size blocks a/m/ctime, their nsec, mode nlink uid gid rdev blksize flags
ATTR = struct.Struct("<" + _ATTR)
ENTRY_OUT = struct.Struct("<QQQQII" + _ATTR)   # nodeid generation entry_valid attr_valid (nsec x2) attr
ATTR_OUT = struct.Struct("<QII" + _ATTR)       # attr_valid attr_valid_nsec dummy attr
INIT_IN = struct.Struct("<IIII")               # major minor max_readahead flags (flags2 follows from 7.36)
INIT_IN_FLAGS2 = struct.Struct("<I")
# ... max_write time_gran max_pages map_alignment flags2 max_stack_depth, unused to 64 bytes
INIT_OUT = struct.Struct("<IIIIHHIIHHII24x")
GETATTR_IN = struct.Struct("<IIQ")             # getattr_flags dummy fh
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")  # valid pad fh size lock_owner atime mtime ctime nsec x3 mode unused uid gid unused
OPEN_IN = struct.Struct("<II")                 # flags open_flags
CREATE_IN = struct.Struct("<IIII")             # flags mode umask open_flags
OPEN_OUT = struct.Struct("<QIi")               # fh open_flags backing_id
READ_IN = struct.Struct("<QQIIQII")            # fh offset size read_flags lock_owner flags pad
WRITE_IN = struct.Struct("<QQIIQII")           # fh offset size write_flags lock_owner flags pad
WRITE_OUT = struct.Struct("<II")               # size pad
RELEASE_IN = struct.Struct("<QIIQ")            # fh flags release_flags lock_owner
FLUSH_IN = struct.Struct("<QIIQ")              # fh unused pad lock_owner
FSYNC_IN = struct.Struct("<QII")               # fh fsync_flags pad
FORGET_IN = struct.Struct("<Q")                # nlookup
BATCH_FORGET_IN = struct.Struct("<II")         # count dummy
FORGET_ONE = struct.Struct("<QQ")              # nodeid nlookup
INTERRUPT_IN = struct.Struct("<Q")             # unique
MKNOD_IN = struct.Struct("<IIII")              # mode rdev umask pad
MKDIR_IN = struct.Struct("<II")                # mode umask
RENAME_IN = struct.Struct("<Q")                # newdir
RENAME2_IN = struct.Struct("<QII")             # newdir flags pad
LINK_IN = struct.Struct("<Q")                  # oldnodeid
GETXATTR_IN = struct.Struct("<II")             # size pad
GETXATTR_OUT = struct.Struct("<II")            # size pad
SETXATTR_IN = struct.Struct("<II")             # size flags (without FUSE_SETXATTR_EXT, never asked for)
ACCESS_IN = struct.Struct("<II")               # mask pad
STATFS_OUT = struct.Struct("<QQQQQIIII24x")    # fuse_kstatfs: blocks bfree bavail files ffree bsize namelen frsize pad spare[6]
DIRENT = struct.Struct("<QQII")                # ino off namelen type, then the name, padded to 8
LSEEK_IN = struct.Struct("<QQII")              # fh offset whence pad
FALLOCATE_IN = struct.Struct("<QQQII")         # fh offset length mode pad
LSEEK_OUT = struct.Struct("<Q")
NOTIFY_INVAL_INODE_OUT = struct.Struct("<Qqq")  # ino off len
NOTIFY_INVAL_ENTRY_OUT = struct.Struct("<QII")  # parent namelen flags, then the name and a NUL
NOTIFY_DELETE_OUT = struct.Struct("<QQII")      # parent child namelen pad, then the name and a NUL

# The smallest buffer the kernel accepts for a read of /dev/fuse is this much over max_write.
REQUEST_OVERHEAD = IN_HEADER.size + WRITE_IN.size
# A dirent's name is padded so the next record starts 8-aligned.
_ALIGN = 8


def _pad(length: int) -> int:
    return (length + _ALIGN - 1) & ~(_ALIGN - 1)


class Request(NamedTuple):
    """One request: its header fields and a view of its arguments (valid until the buffer is reused)."""

    opcode: int
    unique: int
    nodeid: int
    uid: int
    gid: int
    pid: int
    body: memoryview

    def name(self, offset: int = 0) -> bytes:
        """The NUL-terminated name starting ``offset`` bytes into the arguments, copied out."""
        return bytes(self.body[offset:]).partition(b"\0")[0]

    def names(self, offset: int = 0) -> tuple[bytes, bytes]:
        """Two NUL-terminated names one after the other (rename, symlink), copied out."""
        raw = bytes(self.body[offset:])
        first, _, rest = raw.partition(b"\0")
        return first, rest.partition(b"\0")[0]


def parse_request(buffer: memoryview) -> Request:
    """The request at the start of ``buffer`` (exactly the bytes one read of /dev/fuse returned).

    ``ValueError`` if it is shorter than its header says (the kernel never sends that)."""
    length, opcode, unique, nodeid, uid, gid, pid, extlen, _ = _unpack_in_header(buffer)
    if length > len(buffer) or length < _IN_HEADER_SIZE:
        raise ValueError(f"request of {len(buffer)} bytes says it has {length}")
    # Extensions (security contexts, supplementary groups) come after the arguments; none is asked for.
    # (tuple.__new__ directly: the named tuple's own __new__ is a Python call, once per request.)
    return _new_tuple(Request, (opcode, unique, nodeid, uid, gid, pid, buffer[_IN_HEADER_SIZE:length - extlen * 8]))


# Bound once (parse_request runs for every request).
_new_tuple = tuple.__new__
_unpack_in_header = IN_HEADER.unpack_from
_IN_HEADER_SIZE = IN_HEADER.size


# ----------------------------------------------------------------------------------------- replies
def out_header(unique: int, error: int, payload_length: int) -> bytes:
    """The reply header: ``error`` is a positive errno (0 for success), sent negated as the kernel wants."""
    return OUT_HEADER.pack(OUT_HEADER.size + payload_length, -error, unique)


def split_timeout(seconds: float) -> tuple[int, int]:
    """A cache timeout as the kernel's (seconds, nanoseconds); negative means 0, huge means forever."""
    if seconds <= 0 or math.isnan(seconds):
        return 0, 0
    if seconds >= 2 ** 63:
        return 2 ** 64 - 1, 0
    whole = int(seconds)
    return whole, min(int((seconds - whole) * 1e9), 999_999_999)


class Attr(NamedTuple):
    """What ``fuse_attr`` carries, in the filesystem's terms."""

    ino: int
    size: int
    mode: int
    nlink: int
    uid: int
    gid: int
    mtime_ns: int
    blksize: int = 128 * 1024


def _attr_fields(a: Attr) -> tuple[int, ...]:
    sec, nsec = divmod(a.mtime_ns, 1_000_000_000)
    # atime and ctime are shown as the mtime: the store keeps one time per object.
    return (a.ino, a.size, (a.size + 511) // 512, sec, sec, sec, nsec, nsec, nsec,
            a.mode, a.nlink, a.uid, a.gid, 0, a.blksize, 0)


def entry_out(a: Attr, entry_timeout: float, attr_timeout: float, generation: int = 0) -> bytes:
    entry_s, entry_ns = split_timeout(entry_timeout)
    attr_s, attr_ns = split_timeout(attr_timeout)
    return ENTRY_OUT.pack(a.ino, generation, entry_s, attr_s, entry_ns, attr_ns, *_attr_fields(a))


def attr_out(a: Attr, attr_timeout: float) -> bytes:
    attr_s, attr_ns = split_timeout(attr_timeout)
    return ATTR_OUT.pack(attr_s, attr_ns, 0, *_attr_fields(a))


def open_out(fh: int, flags: int, backing_id: int = 0) -> bytes:
    """An OPEN/CREATE answer; ``backing_id`` (from DEV_IOC_BACKING_OPEN) only with FOPEN_PASSTHROUGH."""
    return OPEN_OUT.pack(fh, flags, backing_id)


def write_out(size: int) -> bytes:
    return WRITE_OUT.pack(size, 0)


def statfs_out(blocks: int, bfree: int, bavail: int, files: int, ffree: int, bsize: int, namelen: int,
               frsize: int) -> bytes:
    return STATFS_OUT.pack(blocks, bfree, bavail, files, ffree, bsize, namelen, frsize, 0)


def getxattr_size(size: int) -> bytes:
    """The answer to a GETXATTR/LISTXATTR of size 0: how many bytes the value would take."""
    return GETXATTR_OUT.pack(size, 0)


def init_out(*, minor: int, max_readahead: int, flags: int, max_background: int, congestion_threshold: int,
             max_write: int, max_pages: int, time_gran: int = 1, max_stack_depth: int = 0) -> bytes:
    """The INIT answer. Flags above bit 31 go into ``flags2``, and INIT_EXT is set with them (the
    kernel reads ``flags2`` only then); ``max_stack_depth`` matters only with PASSTHROUGH."""
    if flags >> 32:
        flags |= INIT_EXT
    return INIT_OUT.pack(KERNEL_MAJOR, minor, max_readahead, flags & 0xFFFFFFFF, max_background,
                         congestion_threshold, max_write, time_gran, max_pages, 0, flags >> 32, max_stack_depth)


class InitIn(NamedTuple):
    major: int
    minor: int
    max_readahead: int
    flags: int


def parse_init(body: memoryview) -> InitIn:
    major, minor, max_readahead, flags = INIT_IN.unpack_from(body)
    if flags & INIT_EXT and len(body) >= INIT_IN.size + INIT_IN_FLAGS2.size:
        flags |= INIT_IN_FLAGS2.unpack_from(body, INIT_IN.size)[0] << 32
    return InitIn(major, minor, max_readahead, flags)


def dirent_type(mode: int) -> int:
    """The DT_* value of a mode (the kernel's dirent type is the file type's bits shifted down)."""
    return stat.S_IFMT(mode) >> 12


class DirentBuffer:
    """Directory entries packed into one reply of at most ``size`` bytes (READDIR or READDIRPLUS).

    Grown as entries come (the kernel offers up to 128 KiB and a directory may hold three names)."""

    def __init__(self, size: int, plus: bool) -> None:
        self.buffer = bytearray()
        self.size = size
        self.plus = plus

    def add(self, name: bytes, a: Attr, next_offset: int, entry_timeout: float, attr_timeout: float) -> bool:
        """Append one entry; False (and nothing added) when it does not fit."""
        fixed = ENTRY_OUT.size + DIRENT.size if self.plus else DIRENT.size
        record = _pad(fixed + len(name))
        if len(self.buffer) + record > self.size:
            return False
        if self.plus:
            self.buffer += entry_out(a, entry_timeout, attr_timeout)
        self.buffer += DIRENT.pack(a.ino, next_offset, len(name), dirent_type(a.mode))
        self.buffer += name
        self.buffer += bytes(record - fixed - len(name))
        return True

    def payload(self) -> bytearray:
        return self.buffer


def notify_inval_entry(parent: int, name: bytes) -> list[bytes]:
    """The buffers of a FUSE_NOTIFY_INVAL_ENTRY message: the kernel forgets ``name`` in ``parent``."""
    body = NOTIFY_INVAL_ENTRY_OUT.pack(parent, len(name), 0)
    return [OUT_HEADER.pack(OUT_HEADER.size + len(body) + len(name) + 1, NOTIFY_INVAL_ENTRY, 0), body, name, b"\0"]


def notify_inval_inode(ino: int, offset: int = 0, length: int = 0) -> list[bytes]:
    """The buffers of a FUSE_NOTIFY_INVAL_INODE message: the kernel drops the inode's cached attributes
    and the pages from ``offset`` (``length`` 0: to the end; offset -1: attributes only)."""
    body = NOTIFY_INVAL_INODE_OUT.pack(ino, offset, length)
    return [OUT_HEADER.pack(OUT_HEADER.size + len(body), NOTIFY_INVAL_INODE, 0), body]
