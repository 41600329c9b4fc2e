"""The FUSE wire format (cachefs.fuse.wire) against the kernel's structs, with no mount.

The requests are bytes this kernel (6.18, FUSE 7.45) sent to a cachefs session, recorded from
/dev/fuse; the replies are checked byte for byte at the offsets of include/uapi/linux/fuse.h.
"""

from __future__ import annotations

import struct

import pytest

from cachefs.fuse import wire

# Recorded requests (hex): the header is 40 bytes (len, opcode, unique, nodeid, uid, gid, pid, extlen, pad).
INIT = ("680000001a0000000200000000000000000000000000000000000000000000000000000000000000"
        "070000002d00000000000200fbffff73fd050000" + "00" * 44)
LOOKUP = "2a00000001000000160000000000000001000000000000000000000000000000883d0000000000006600"
READ = ("500000000f0000002e0000000000000002000000000000000000000000000000893d000000000000"
        "07000000000000000000000000000000001000000000000000000000000000000080000000000000")
READDIRPLUS = ("500000002c000000120000000000000001000000000000000000000000000000883d000000000000"
               "07000000000000000000000000000000000002000000000000000000000000000088010000000000")
RELEASE = ("40000000120000003400000000000000020000000000000000000000000000000000000000000000"
           "070000000000000000800000000000000000000000000000")
FLUSH = ("4000000019000000320000000000000002000000000000000000000000000000893d000000000000"
         "07000000000000000000000000000000cfbc48997d816e9d")


def request(hex_text: str) -> wire.Request:
    return wire.parse_request(memoryview(bytes.fromhex(hex_text)))


@pytest.mark.parametrize(("struct_", "size"), [
    (wire.IN_HEADER, 40), (wire.OUT_HEADER, 16), (wire.ATTR, 88), (wire.ENTRY_OUT, 128), (wire.ATTR_OUT, 104),
    (wire.INIT_OUT, 64), (wire.INIT_IN, 16), (wire.GETATTR_IN, 16), (wire.SETATTR_IN, 88), (wire.OPEN_IN, 8),
    (wire.CREATE_IN, 16), (wire.OPEN_OUT, 16), (wire.READ_IN, 40), (wire.WRITE_IN, 40), (wire.WRITE_OUT, 8),
    (wire.RELEASE_IN, 24), (wire.FLUSH_IN, 24), (wire.FSYNC_IN, 16), (wire.FORGET_IN, 8),
    (wire.BATCH_FORGET_IN, 8), (wire.FORGET_ONE, 16), (wire.INTERRUPT_IN, 8), (wire.MKNOD_IN, 16),
    (wire.MKDIR_IN, 8), (wire.RENAME_IN, 8), (wire.RENAME2_IN, 16), (wire.LINK_IN, 8), (wire.GETXATTR_IN, 8),
    (wire.GETXATTR_OUT, 8), (wire.STATFS_OUT, 80), (wire.DIRENT, 24), (wire.LSEEK_IN, 24), (wire.FALLOCATE_IN, 32),
    (wire.NOTIFY_INVAL_INODE_OUT, 24), (wire.NOTIFY_INVAL_ENTRY_OUT, 16), (wire.NOTIFY_DELETE_OUT, 24),
])
def test_struct_sizes_are_the_kernels(struct_: struct.Struct, size: int) -> None:
    assert struct_.size == size


def test_opcodes_are_the_kernels() -> None:
    assert (wire.LOOKUP, wire.FORGET, wire.GETATTR, wire.OPEN, wire.READ, wire.WRITE, wire.RELEASE) == (1, 2, 3, 14, 15, 16, 18)
    assert (wire.FLUSH, wire.INIT, wire.CREATE, wire.INTERRUPT, wire.BATCH_FORGET, wire.READDIRPLUS, wire.RENAME2) == (
        25, 26, 35, 36, 42, 44, 45)
    assert wire.OPCODE_NAMES[wire.READDIRPLUS] == "readdirplus" and wire.OPCODE_NAMES[wire.STATX] == "statx"


def test_a_recorded_init_request() -> None:
    req = request(INIT)
    assert (req.opcode, req.unique, req.nodeid) == (wire.INIT, 2, 0)
    init = wire.parse_init(req.body)
    assert (init.major, init.minor, init.max_readahead) == (7, 45, 128 * 1024)
    assert init.flags & wire.INIT_EXT and init.flags >> 32 == 0x5FD  # flags2 read only with INIT_EXT
    for flag in (wire.ASYNC_READ, wire.MAX_PAGES, wire.DO_READDIRPLUS, wire.NO_OPEN_SUPPORT, wire.PARALLEL_DIROPS):
        assert init.flags & flag


def test_init_reply_bytes() -> None:
    out = wire.init_out(minor=31, max_readahead=0x20000, flags=wire.ASYNC_READ | wire.MAX_PAGES, max_background=64,
                        congestion_threshold=48, max_write=1 << 20, max_pages=256)
    assert len(out) == 64
    assert out[0:16] == struct.pack("<IIII", 7, 31, 0x20000, 1 | 1 << 22)
    assert out[16:20] == struct.pack("<HH", 64, 48)
    assert out[20:28] == struct.pack("<II", 1 << 20, 1)  # max_write, time_gran
    assert out[28:32] == struct.pack("<HH", 256, 0)       # max_pages, map_alignment
    assert out[32:] == bytes(32)


def test_the_recorded_kernel_offers_passthrough_in_flags2() -> None:
    init = wire.parse_init(request(INIT).body)
    assert wire.PASSTHROUGH == 1 << 37 and init.flags & wire.PASSTHROUGH  # bit 5 of flags2 (0x5FD)


def test_init_reply_with_passthrough_bytes() -> None:
    """fuse_init_out from offset 32: flags2 (u32), max_stack_depth (u32), request_timeout (u16), unused."""
    out = wire.init_out(minor=31, max_readahead=0x20000, flags=wire.ASYNC_READ | wire.PASSTHROUGH, max_background=64,
                        congestion_threshold=48, max_write=1 << 20, max_pages=256, max_stack_depth=1)
    assert len(out) == 64
    # The kernel reads flags2 only when INIT_EXT (bit 30) is set in flags: init_out sets it.
    assert out[12:16] == struct.pack("<I", 1 | 1 << 30)
    assert out[32:36] == struct.pack("<I", 1 << 5)
    assert out[36:40] == struct.pack("<I", 1)
    assert out[40:] == bytes(24)


def test_open_reply_with_a_backing_id_bytes() -> None:
    """fuse_open_out: fh (u64), open_flags (u32), backing_id (s32)."""
    out = wire.open_out(0x1122334455667788, wire.FOPEN_PASSTHROUGH | wire.FOPEN_NOFLUSH, 3)
    assert out == struct.pack("<QIi", 0x1122334455667788, 1 << 7 | 1 << 5, 3)
    assert wire.open_out(9, wire.FOPEN_KEEP_CACHE) == struct.pack("<QIi", 9, 2, 0)
    # What the kernel accepts beside FOPEN_PASSTHROUGH (fs/fuse/iomode.c): no KEEP_CACHE.
    assert wire.FOPEN_PASSTHROUGH_ALLOWED == (1 << 7) | (1 << 0) | (1 << 5)


def test_backing_map_and_its_ioctls() -> None:
    """struct fuse_backing_map {int32 fd; uint32 flags; uint64 padding}, and the ioctl numbers
    _IOW(229, 1, struct fuse_backing_map) and _IOW(229, 2, uint32_t) as the kernel's headers give them."""
    arg = wire.backing_map(7)
    assert isinstance(arg, bytearray) and bytes(arg) == struct.pack("<iIQ", 7, 0, 0) and len(arg) == 16
    assert wire.DEV_IOC_BACKING_OPEN == 0x4010E501
    assert wire.DEV_IOC_BACKING_CLOSE == 0x4004E502


def test_recorded_lookup_read_readdirplus_release_flush() -> None:
    lookup = request(LOOKUP)
    assert (lookup.opcode, lookup.nodeid, lookup.name(), lookup.pid) == (wire.LOOKUP, 1, b"f", 0x3D88)
    read = request(READ)
    assert wire.READ_IN.unpack_from(read.body)[:3] == (7, 0, 4096)
    listing = request(READDIRPLUS)
    # Since Linux 6.x the kernel offers readdir a buffer of 128 KiB, not a page.
    assert listing.opcode == wire.READDIRPLUS and wire.READ_IN.unpack_from(listing.body)[:3] == (7, 0, 128 * 1024)
    release = request(RELEASE)
    assert wire.RELEASE_IN.unpack_from(release.body)[:2] == (7, 0x8000)  # fh, O_LARGEFILE
    flush = request(FLUSH)
    assert wire.FLUSH_IN.unpack_from(flush.body)[0] == 7


def test_a_request_shorter_than_its_header_says_is_refused() -> None:
    with pytest.raises(ValueError):
        wire.parse_request(memoryview(bytes.fromhex(LOOKUP)[:-1]))


def test_names_are_copied_out_without_their_nul() -> None:
    body = wire.RENAME_IN.pack(9) + b"old\0new name\0"
    req = wire.Request(wire.RENAME, 1, 2, 0, 0, 0, memoryview(body))
    assert req.names(wire.RENAME_IN.size) == (b"old", b"new name")
    assert req.name(wire.RENAME_IN.size) == b"old"


ATTR = wire.Attr(ino=5, size=1000, mode=0o100444, nlink=1, uid=7, gid=8, mtime_ns=1_700_000_000_123_456_789)


def _expected_attr() -> bytes:
    return struct.pack("<QQQQQQIIIIIIIIII", 5, 1000, 2, 1_700_000_000, 1_700_000_000, 1_700_000_000,
                       123_456_789, 123_456_789, 123_456_789, 0o100444, 1, 7, 8, 0, 128 * 1024, 0)


def test_entry_and_attr_replies_byte_for_byte() -> None:
    out = wire.entry_out(ATTR, entry_timeout=1.5, attr_timeout=3600)
    assert out[:40] == struct.pack("<QQQQII", 5, 0, 1, 3600, 500_000_000, 0)
    assert out[40:] == _expected_attr()
    out = wire.attr_out(ATTR, attr_timeout=0.25)
    assert out == struct.pack("<QII", 0, 250_000_000, 0) + _expected_attr()


def test_timeouts() -> None:
    assert wire.split_timeout(-1) == (0, 0)
    assert wire.split_timeout(float("nan")) == (0, 0)
    assert wire.split_timeout(2.000000001)[0] == 2
    assert wire.split_timeout(1e30) == (2 ** 64 - 1, 0)


def test_headers_and_small_replies() -> None:
    assert wire.out_header(77, 2, 0) == struct.pack("<IiQ", 16, -2, 77)
    assert wire.out_header(78, 0, 100) == struct.pack("<IiQ", 116, 0, 78)
    assert wire.open_out(3, wire.FOPEN_KEEP_CACHE | wire.FOPEN_DIRECT_IO) == struct.pack("<QIi", 3, 3, 0)
    assert wire.write_out(4096) == struct.pack("<II", 4096, 0)
    assert wire.getxattr_size(12) == struct.pack("<II", 12, 0)
    assert wire.statfs_out(10, 4, 3, 100, 0, 4096, 255, 4096) == struct.pack("<QQQQQIIII", 10, 4, 3, 100, 0, 4096, 255,
                                                                             4096, 0) + bytes(24)


def test_directory_entries_are_8_aligned_and_stop_when_full() -> None:
    plain = wire.DirentBuffer(80, plus=False)
    assert plain.add(b"abc", ATTR, 1, 0, 0)
    assert plain.add(b"0123456789", ATTR, 2, 0, 0)   # 24 + 10 -> 40
    assert not plain.add(b"x", ATTR, 3, 0, 0)        # 72 + 32 > 80
    payload = bytes(plain.payload())
    assert len(payload) == 32 + 40
    assert payload[:32] == struct.pack("<QQII", 5, 1, 3, 8) + b"abc" + bytes(5)  # DT_REG is 8
    assert payload[32:56] == struct.pack("<QQII", 5, 2, 10, 8)
    plus = wire.DirentBuffer(4096, plus=True)
    directory = ATTR._replace(ino=9, mode=0o040555)
    assert plus.add(b"d", directory, 1, 1.0, 2.0)
    payload = bytes(plus.payload())
    assert len(payload) == 160  # 128 + 24 + 1, padded to 8
    assert payload[:128] == wire.entry_out(directory, 1.0, 2.0)
    assert payload[128:160] == struct.pack("<QQII", 9, 1, 1, 4) + b"d" + bytes(7)  # DT_DIR is 4


def test_notifications() -> None:
    buffers = wire.notify_inval_entry(1, b"name")
    data = b"".join(buffers)
    assert data == struct.pack("<IiQ", 16 + 16 + 5, wire.NOTIFY_INVAL_ENTRY, 0) + struct.pack("<QII", 1, 4, 0) + b"name\0"
    data = b"".join(wire.notify_inval_inode(5, 0, 0))
    assert data == struct.pack("<IiQ", 40, wire.NOTIFY_INVAL_INODE, 0) + struct.pack("<Qqq", 5, 0, 0)
