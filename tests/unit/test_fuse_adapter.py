"""The FUSE adapter and session with no mount: requests as the kernel encodes them go in through a
socket standing in for /dev/fuse, and the replies come back byte for byte.

Every failure leaves as a reply with the right errno (never an exception out of the session), bugs
are logged with their traceback, the protocol's rules hold (INIT negotiation, no reply to FORGET,
ENOSYS for what nobody handles, INTERRUPT, the bound on requests in flight), and the handlers
translate to and from ``CacheFS`` (read and write paths over the in-memory store).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import stat
import struct
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cachefs.fs.errors import FsError
from cachefs.fs.filesystem import CacheFS
from cachefs.fs.inodes import ROOT_INODE
from cachefs.fuse import wire
from cachefs.fuse.adapter import FuseOperations, errno_of
from cachefs.fuse.mounting import fuse_failure_reason
from cachefs.fuse.session import WANTED_FLAGS, FuseSession
from cachefs.mounts import CONTROL_XATTR, mount_source
from cachefs.settings import FsSettings
from tiering.blocks import MIN_BLOCK_SIZE
from tiering.clock import FakeClock
from tiering.engine.blockcache import BlockCache
from tiering.errors import ObjectChangedError, ObjectStoreUnavailableError
from tiering.objectstore.memory import InMemoryObjectStore
from tiering.settings import CacheSettings
from tiering.tiers.ram import RamTier

BS = MIN_BLOCK_SIZE
REPLY_WAIT_S = 10


def encode(opcode: int, body: bytes = b"", *, unique: int = 1, nodeid: int = ROOT_INODE) -> bytes:
    """A request as the kernel writes it: fuse_in_header, then the opcode's arguments."""
    return wire.IN_HEADER.pack(wire.IN_HEADER.size + len(body), opcode, unique, nodeid, 0, 0, 4242, 0, 0) + body


def read_in(fh: int, offset: int, size: int) -> bytes:
    return wire.READ_IN.pack(fh, offset, size, 0, 0, 0, 0)


class Kernel:
    """The kernel's end of a connection: a SOCK_SEQPACKET socket keeps each request and reply whole."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send(self, data: bytes) -> None:
        self.sock.send(data)

    async def reply(self) -> tuple[int, int, bytes]:
        """The next reply: (unique, errno, payload)."""
        loop = asyncio.get_running_loop()
        data = await asyncio.wait_for(loop.sock_recv(self.sock, 2 * 1024 * 1024), REPLY_WAIT_S)
        length, error, unique = wire.OUT_HEADER.unpack_from(data)
        assert length == len(data)
        return unique, -error, data[wire.OUT_HEADER.size:]

    async def call(self, opcode: int, body: bytes = b"", *, unique: int = 1, nodeid: int = ROOT_INODE) -> tuple[int, bytes]:
        self.send(encode(opcode, body, unique=unique, nodeid=nodeid))
        got, error, payload = await self.reply()
        assert got == unique
        return error, payload

    async def nothing(self, within_s: float = 0.2) -> bool:
        """True when no reply comes within ``within_s``."""
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.sock_recv(self.sock, 65536), within_s)
        except TimeoutError:
            return True
        return False


async def serving(ops: Any, max_tasks: int = 8) -> AsyncIterator[tuple[Kernel, FuseSession]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    theirs.setblocking(False)
    session = FuseSession(ops, "/nowhere", fd=ours.detach())  # handed over: nothing is mounted
    task = asyncio.create_task(session.serve(max_tasks))
    try:
        yield Kernel(theirs), session
    finally:
        session.terminate()
        await asyncio.wait_for(task, REPLY_WAIT_S)
        session.close()
        theirs.close()


class RaisingFs:
    """Stands in for CacheFS; every operation raises ``exc``."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def _raise(self, *args: object, **kwargs: object) -> None:
        raise self.exc

    async def _araise(self, *args: object, **kwargs: object) -> None:
        raise self.exc

    lookup = getattr = open = read = opendir = flush = fsync = _araise
    forget = release = releasedir = readdir = statfs = getxattr = listxattr = add_lookup = open_now = lookup_now = getattr_now = _raise

    def attach_kernel_cache(self, kernel: object) -> None:
        pass  # told at INIT, before any operation


# Each read-side request, with arguments that reach the fs method.
REQUESTS = [
    ("lookup", wire.LOOKUP, b"x\0"),
    ("getattr", wire.GETATTR, wire.GETATTR_IN.pack(0, 0, 0)),
    ("open", wire.OPEN, wire.OPEN_IN.pack(os.O_RDONLY, 0)),
    ("read", wire.READ, read_in(3, 0, 4096)),
    ("release", wire.RELEASE, wire.RELEASE_IN.pack(3, 0, 0, 0)),
    ("opendir", wire.OPENDIR, wire.OPEN_IN.pack(0, 0)),
    ("readdirplus", wire.READDIRPLUS, read_in(3, 0, 4096)),
    ("releasedir", wire.RELEASEDIR, wire.RELEASE_IN.pack(3, 0, 0, 0)),
    ("statfs", wire.STATFS, b""),
    ("getxattr", wire.GETXATTR, wire.GETXATTR_IN.pack(100, 0) + b"user.x\0"),
    ("listxattr", wire.LISTXATTR, wire.GETXATTR_IN.pack(100, 0)),
    ("flush", wire.FLUSH, wire.FLUSH_IN.pack(3, 0, 0, 0)),
    ("fsync", wire.FSYNC, wire.FSYNC_IN.pack(3, 0, 0)),
]

FAILURES = [
    (FsError(errno.ENOENT), errno.ENOENT),
    (ObjectChangedError("overwritten"), errno.ESTALE),
    (OSError(errno.ENOSPC, "No space left on device"), errno.ENOSPC),
    (ValueError("bug"), errno.EIO),
    (ObjectStoreUnavailableError("store down"), errno.EIO),
    (OSError("no errno at all"), errno.EIO),
    (KeyError("missing"), errno.EIO),
    (wire.FuseError(errno.EPERM), errno.EPERM),
]


@pytest.mark.parametrize(("exc", "code"), FAILURES, ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v))
@pytest.mark.parametrize(("name", "opcode", "body"), REQUESTS, ids=[r[0] for r in REQUESTS])
async def test_every_failure_is_answered_with_its_errno_and_the_session_goes_on(
    name: str, opcode: int, body: bytes, exc: BaseException, code: int
) -> None:
    async for kernel, _ in serving(FuseOperations(RaisingFs(exc))):  # type: ignore[arg-type]
        for unique in (10, 11):  # the second request shows the session survived the first
            assert await kernel.call(opcode, body, unique=unique) == (code, b"")


class CallerFs:
    """Stands in for CacheFS: records which thread each LOOKUP and OPEN names."""

    def __init__(self) -> None:
        self.callers: list[tuple[str, int]] = []

    def lookup_now(self, parent: int, name: bytes, caller: int = 0) -> None:
        self.callers.append(("lookup_now", caller))
        return None  # not answered at once: the task's lookup follows

    def open_now(self, inode: int, flags: int, caller: int = 0) -> None:
        self.callers.append(("open_now", caller))
        return None

    async def lookup(self, parent: int, name: bytes, caller: int = 0) -> None:
        self.callers.append(("lookup", caller))
        raise FsError(errno.ENOENT)

    async def open(self, inode: int, flags: int, caller: int = 0) -> None:
        self.callers.append(("open", caller))
        raise FsError(errno.ESTALE)


async def test_lookups_and_opens_name_the_thread_that_sent_them() -> None:
    """The header's pid (the calling thread) reaches CacheFS: the kernel's retry of an open answered
    ESTALE is told apart by it (``cachefs.fs.retries``)."""
    fs = CallerFs()
    async for kernel, _ in serving(FuseOperations(fs)):  # type: ignore[arg-type]
        assert (await kernel.call(wire.OPEN, wire.OPEN_IN.pack(os.O_RDONLY, 0), unique=10))[0] == errno.ESTALE
        assert (await kernel.call(wire.LOOKUP, b"x\0", unique=11))[0] == errno.ENOENT
    assert fs.callers == [("open_now", 4242), ("open", 4242), ("lookup_now", 4242), ("lookup", 4242)]


async def test_unexpected_errors_are_logged_with_their_traceback(caplog: pytest.LogCaptureFixture) -> None:
    bug = ValueError("bug")
    async for kernel, _ in serving(FuseOperations(RaisingFs(bug))):  # type: ignore[arg-type]
        with caplog.at_level(logging.WARNING, logger="cachefs.fuse.adapter"):
            assert (await kernel.call(wire.LOOKUP, b"x\0"))[0] == errno.EIO
    records = [r for r in caplog.records if r.name == "cachefs.fuse.adapter"]
    assert len(records) == 1
    assert records[0].levelno == logging.ERROR
    assert "lookup" in records[0].getMessage()
    assert records[0].exc_info is not None and records[0].exc_info[1] is bug
    assert "ValueError: bug" in caplog.text


async def test_expected_errors_are_not_logged_as_bugs(caplog: pytest.LogCaptureFixture) -> None:
    async for kernel, _ in serving(FuseOperations(RaisingFs(FsError(errno.ENOENT)))):  # type: ignore[arg-type]
        with caplog.at_level(logging.DEBUG, logger="cachefs.fuse.adapter"):
            assert (await kernel.call(wire.LOOKUP, b"x\0"))[0] == errno.ENOENT
    assert not [r for r in caplog.records if r.name == "cachefs.fuse.adapter" and r.exc_info]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_errno_of() -> None:
    assert errno_of(FsError(errno.ENOTDIR)) == errno.ENOTDIR
    assert errno_of(ObjectChangedError("x")) == errno.ESTALE
    assert errno_of(FileNotFoundError(errno.ENOENT, "gone")) == errno.ENOENT
    assert errno_of(RuntimeError("x")) == errno.EIO


# ------------------------------------------------------------------------------------- protocol
def init_in(minor: int, flags: int, max_readahead: int = 128 * 1024) -> bytes:
    return wire.INIT_IN.pack(7, minor, max_readahead, flags) + bytes(48)


async def test_init_takes_only_what_the_kernel_offers() -> None:
    async for kernel, session in serving(FuseOperations(RaisingFs(ValueError()))):  # type: ignore[arg-type]
        offered = wire.ASYNC_READ | wire.DO_READDIRPLUS | wire.READDIRPLUS_AUTO | wire.WRITEBACK_CACHE | wire.POSIX_LOCKS
        error, payload = await kernel.call(wire.INIT, init_in(45, offered), nodeid=0)
        assert error == 0 and len(payload) == 64
        major, minor, readahead, flags, background, congestion, max_write, gran, max_pages = struct.unpack_from(
            "<IIIIHHIIH", payload)
        assert (major, minor, readahead) == (7, wire.KERNEL_MINOR, 128 * 1024)
        # Asked for only where offered; never write-back caching, locks or adaptive readdirplus.
        assert flags == wire.ASYNC_READ | wire.DO_READDIRPLUS
        assert max_pages == 0 and max_write == 1024 * 1024 and gran == 1  # MAX_PAGES was not offered
        assert (background, congestion) == (64, 48)
        assert session.flags == flags and session.proto_minor == wire.KERNEL_MINOR
    async for kernel, session in serving(FuseOperations(RaisingFs(ValueError()))):  # type: ignore[arg-type]
        error, payload = await kernel.call(wire.INIT, init_in(28, 0xFFFFFFFF), nodeid=0)
        flags, = struct.unpack_from("<I", payload, 12)
        assert flags == WANTED_FLAGS and struct.unpack_from("<H", payload, 28)[0] == 256
        assert session.proto_minor == 28


async def test_a_kernel_older_than_the_oldest_supported_protocol_is_refused() -> None:
    async for kernel, session in serving(FuseOperations(RaisingFs(ValueError()))):  # type: ignore[arg-type]
        assert await kernel.call(wire.INIT, init_in(wire.MIN_KERNEL_MINOR - 1, 0xFFFF), nodeid=0) == (errno.EPROTO, b"")
        assert session._ended is not None and session._ended.done()  # serve() returns


async def test_unknown_opcodes_are_enosys_and_forgets_get_no_reply() -> None:
    forgotten: list[tuple[int, int]] = []
    fs = RaisingFs(ValueError())
    fs.forget = lambda inode, n: forgotten.append((inode, n))  # type: ignore[method-assign]
    async for kernel, _ in serving(FuseOperations(fs)):  # type: ignore[arg-type]
        assert await kernel.call(wire.STATX, bytes(24), unique=5) == (errno.ENOSYS, b"")
        assert await kernel.call(999, unique=6) == (errno.ENOSYS, b"")
        kernel.send(encode(wire.FORGET, wire.FORGET_IN.pack(3), nodeid=7, unique=7))
        batch = wire.BATCH_FORGET_IN.pack(2, 0) + wire.FORGET_ONE.pack(8, 1) + wire.FORGET_ONE.pack(9, 4)
        kernel.send(encode(wire.BATCH_FORGET, batch, nodeid=0, unique=8))
        assert await kernel.nothing()
        assert forgotten == [(7, 3), (8, 1), (9, 4)]


class BlockingFs:
    """Reads and writes wait on ``gate``; ``writes`` keeps what each write was given."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.started = 0
        self.writes: list[bytes] = []
        self.cancelled = 0

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        self.started += 1
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return b"r" * size

    async def write(self, fh: int, offset: int, data: memoryview) -> int:
        self.started += 1
        await self.gate.wait()
        self.writes.append(bytes(data))
        return len(data)

    async def lookup(self, parent: int, name: bytes, caller: int = 0) -> None:
        raise FsError(errno.ENOENT)


async def test_interrupt_cancels_a_read_with_eintr_but_never_a_write() -> None:
    fs = BlockingFs()
    async for kernel, _ in serving(FuseOperations(fs)):  # type: ignore[arg-type]
        kernel.send(encode(wire.READ, read_in(1, 0, 10), unique=20))
        kernel.send(encode(wire.WRITE, wire.WRITE_IN.pack(1, 0, 3, 0, 0, 0, 0) + b"abc", unique=22))
        while fs.started < 2:
            await asyncio.sleep(0.01)
        kernel.send(encode(wire.INTERRUPT, wire.INTERRUPT_IN.pack(20), unique=24, nodeid=0))
        kernel.send(encode(wire.INTERRUPT, wire.INTERRUPT_IN.pack(22), unique=26, nodeid=0))
        assert await kernel.reply() == (20, errno.EINTR, b"")
        assert fs.cancelled == 1
        fs.gate.set()
        assert await kernel.reply() == (22, 0, wire.write_out(3))  # the write ran to its end


async def test_a_write_payload_survives_the_requests_read_after_it_and_requests_in_flight_are_bounded() -> None:
    fs = BlockingFs()
    async for kernel, session in serving(FuseOperations(fs), max_tasks=2):  # type: ignore[arg-type]
        payloads = [bytes([65 + i]) * (1000 + i) for i in range(3)]
        for i, payload in enumerate(payloads):
            kernel.send(encode(wire.WRITE, wire.WRITE_IN.pack(1, 0, len(payload), 0, 0, 0, 0) + payload, unique=30 + i))
        while fs.started < 2:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert fs.started == 2 and len(session._tasks) == 2  # the third waits in the kernel's queue
        fs.gate.set()
        replies = sorted([await kernel.reply() for _ in payloads])
        assert replies == [(30 + i, 0, wire.write_out(len(p))) for i, p in enumerate(payloads)]
        assert sorted(fs.writes) == payloads  # each write saw its own bytes, not a later request's


async def test_end_of_connection_ends_serve() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    session = FuseSession(FuseOperations(RaisingFs(ValueError())), "/nowhere", fd=ours.detach())  # type: ignore[arg-type]
    task = asyncio.create_task(session.serve(4))
    theirs.close()
    await asyncio.wait_for(task, REPLY_WAIT_S)
    session.close()


# ------------------------------------------------------------------------------------ with CacheFS
@pytest.fixture
def store() -> InMemoryObjectStore:
    s = InMemoryObjectStore()
    s.put_object("dir/file.bin", b"0123456789" * 10, mtime=1_700_000_000)
    return s


@pytest.fixture
def fs(store: InMemoryObjectStore) -> CacheFS:
    settings = CacheSettings(block_size=BS, ram_bytes=16 * BS)
    cache = BlockCache(settings, store, RamTier(16 * BS))
    return CacheFS(store, cache, FsSettings(attr_ttl_s=5, dir_ttl_s=5, read_only=True), clock=FakeClock(),
                   control_path="/run/c.sock")


def entry_of(payload: bytes) -> tuple[int, int, int, int]:
    """(nodeid, mode, size, mtime seconds) of a fuse_entry_out."""
    nodeid = struct.unpack_from("<Q", payload)[0]
    ino, size, _, _, mtime = struct.unpack_from("<QQQQQ", payload, 40)[:5]
    mode = struct.unpack_from("<I", payload, 40 + 60)[0]
    assert ino == nodeid
    return nodeid, mode, size, mtime


def open_of(payload: bytes) -> tuple[int, int]:
    fh, flags, _ = wire.OPEN_OUT.unpack(payload)
    return fh, flags


async def test_read_path_through_the_adapter(fs: CacheFS) -> None:
    async for kernel, _ in serving(FuseOperations(fs)):
        error, payload = await kernel.call(wire.LOOKUP, b"dir\0")
        d, mode, _, _ = entry_of(payload)
        assert error == 0 and stat.S_ISDIR(mode)
        error, payload = await kernel.call(wire.LOOKUP, b"file.bin\0", nodeid=d)
        f, mode, size, mtime = entry_of(payload)
        assert stat.S_ISREG(mode) and size == 100 and mtime == 1_700_000_000
        error, payload = await kernel.call(wire.GETATTR, wire.GETATTR_IN.pack(0, 0, 0), nodeid=f)
        assert error == 0 and len(payload) == 104 and struct.unpack_from("<Q", payload, 16 + 8)[0] == 100
        error, payload = await kernel.call(wire.OPEN, wire.OPEN_IN.pack(os.O_RDONLY, 0), nodeid=f)
        fh, flags = open_of(payload)
        assert flags == wire.FOPEN_NOFLUSH  # first open: no keep_cache; opened to read: no FLUSH at close
        assert await kernel.call(wire.READ, read_in(fh, 10, 15), nodeid=f) == (0, b"012345678901234")
        assert await kernel.call(wire.RELEASE, wire.RELEASE_IN.pack(fh, 0, 0, 0), nodeid=f) == (0, b"")
        fh, flags = open_of((await kernel.call(wire.OPEN, wire.OPEN_IN.pack(os.O_RDONLY, 0), nodeid=f))[1])
        assert flags == wire.FOPEN_KEEP_CACHE | wire.FOPEN_NOFLUSH
        # A read-only mount answers FLUSH with ENOSYS: the kernel then stops sending it.
        assert await kernel.call(wire.FLUSH, wire.FLUSH_IN.pack(fh, 0, 0, 0), nodeid=f) == (errno.ENOSYS, b"")
        assert await kernel.call(wire.FSYNC, wire.FSYNC_IN.pack(fh, 1, 0), nodeid=f) == (0, b"")
        await kernel.call(wire.RELEASE, wire.RELEASE_IN.pack(fh, 0, 0, 0), nodeid=f)
        error, payload = await kernel.call(wire.STATFS)
        blocks, _, _, _, _, bsize, namelen = struct.unpack_from("<QQQQQII", payload)
        assert blocks == 16 * BS // bsize and namelen == 255
        xattr = CONTROL_XATTR.encode()
        assert await kernel.call(wire.GETXATTR, wire.GETXATTR_IN.pack(0, 0) + xattr + b"\0") == (0, wire.getxattr_size(11))
        assert await kernel.call(wire.GETXATTR, wire.GETXATTR_IN.pack(100, 0) + xattr + b"\0") == (0, b"/run/c.sock")
        assert await kernel.call(wire.GETXATTR, wire.GETXATTR_IN.pack(3, 0) + xattr + b"\0") == (errno.ERANGE, b"")
        assert await kernel.call(wire.LISTXATTR, wire.GETXATTR_IN.pack(100, 0)) == (0, xattr + b"\0")


async def test_readdirplus_hands_over_a_lookup_for_each_entry_it_sends(fs: CacheFS, store: InMemoryObjectStore) -> None:
    for i in range(40):
        store.put_object(f"many/{i:03d}", b"x")
    async for kernel, _ in serving(FuseOperations(fs)):
        d = entry_of((await kernel.call(wire.LOOKUP, b"many\0"))[1])[0]
        fh = open_of((await kernel.call(wire.OPENDIR, wire.OPEN_IN.pack(0, 0), nodeid=d))[1])[0]
        names, offset = [], 0
        for _ in range(40):
            error, payload = await kernel.call(wire.READDIRPLUS, read_in(fh, offset, 1024), nodeid=d)
            assert error == 0 and len(payload) <= 1024
            if not payload:
                break
            at = 0
            while at < len(payload):
                ino, offset, namelen, kind = wire.DIRENT.unpack_from(payload, at + 128)
                assert kind == 8 and struct.unpack_from("<Q", payload, at)[0] == ino
                names.append(bytes(payload[at + 152:at + 152 + namelen]))
                at += (152 + namelen + 7) & ~7
        assert names == [f"{i:03d}".encode() for i in range(40)]
        node = fs.inodes.get(fs.inodes.at("many/000").inode)  # type: ignore[union-attr]
        assert node.lookups == 1


async def test_an_immutable_mount_lets_the_kernel_open_files_itself(fs: CacheFS) -> None:
    """OPEN answers ENOSYS (once the kernel offered NO_OPEN_SUPPORT); READs then come with fh 0 and
    are served through one handle per inode, released when the kernel forgets the inode."""
    ops = FuseOperations(fs, immutable=True)
    async for kernel, _ in serving(ops):
        await kernel.call(wire.INIT, init_in(45, wire.NO_OPEN_SUPPORT | wire.DO_READDIRPLUS), nodeid=0)
        d = entry_of((await kernel.call(wire.LOOKUP, b"dir\0"))[1])[0]
        f = entry_of((await kernel.call(wire.LOOKUP, b"file.bin\0", nodeid=d))[1])[0]
        assert await kernel.call(wire.OPEN, wire.OPEN_IN.pack(os.O_RDONLY, 0), nodeid=f) == (errno.ENOSYS, b"")
        assert await kernel.call(wire.READ, read_in(0, 10, 5), nodeid=f) == (0, b"01234")
        assert await kernel.call(wire.READ, read_in(0, 0, 3), nodeid=f) == (0, b"012")
        assert len(fs.handles) == 1 and fs.stats.opens == 1
        assert await kernel.call(wire.FLUSH, wire.FLUSH_IN.pack(0, 0, 0, 0), nodeid=f) == (errno.ENOSYS, b"")
        kernel.send(encode(wire.FORGET, wire.FORGET_IN.pack(1), nodeid=f, unique=99))
        assert await kernel.nothing()
        assert len(fs.handles) == 0 and fs.inodes.at("dir/file.bin") is None
    # Where the kernel cannot (no NO_OPEN_SUPPORT offered), opens are answered as on any mount.
    ops = FuseOperations(fs, immutable=True)
    async for kernel, _ in serving(ops):
        await kernel.call(wire.INIT, init_in(45, wire.DO_READDIRPLUS), nodeid=0)
        d = entry_of((await kernel.call(wire.LOOKUP, b"dir\0"))[1])[0]
        f = entry_of((await kernel.call(wire.LOOKUP, b"file.bin\0", nodeid=d))[1])[0]
        assert (await kernel.call(wire.OPEN, wire.OPEN_IN.pack(os.O_RDONLY, 0), nodeid=f))[0] == 0
    assert FuseOperations(fs, immutable=True, direct_io=True).no_open is False


async def test_requests_whose_listing_is_fresh_are_answered_inline_and_the_rest_as_tasks(
        fs: CacheFS, store: InMemoryObjectStore) -> None:
    """LOOKUP, GETATTR and OPEN run as a task only when a directory must be listed first."""
    ops = FuseOperations(fs)
    tasks: list[tuple[str, int]] = []

    def counting(opcode: int) -> Any:
        slow = ops.handlers[opcode]

        async def counted(req: wire.Request) -> Any:
            tasks.append((wire.OPCODE_NAMES[opcode], req.unique))
            return await slow(req)
        return counted

    for opcode in (wire.LOOKUP, wire.GETATTR, wire.OPEN):
        ops.handlers[opcode] = counting(opcode)
    async for kernel, _ in serving(ops):
        d = entry_of((await kernel.call(wire.LOOKUP, b"dir\0", unique=1))[1])[0]
        f = entry_of((await kernel.call(wire.LOOKUP, b"file.bin\0", nodeid=d, unique=2))[1])[0]
        assert tasks == [("lookup", 1), ("lookup", 2)]  # each listed a directory
        assert (await kernel.call(wire.LOOKUP, b"nothing\0", nodeid=d, unique=3))[0] == errno.ENOENT
        assert entry_of((await kernel.call(wire.LOOKUP, b"file.bin\0", nodeid=d, unique=4))[1])[0] == f
        error, payload = await kernel.call(wire.GETATTR, wire.GETATTR_IN.pack(0, 0, 0), nodeid=f, unique=5)
        assert error == 0 and struct.unpack_from("<Q", payload, 16 + 8)[0] == 100
        for unique in (10, 11):
            error, payload = await kernel.call(wire.OPEN, wire.OPEN_IN.pack(os.O_RDONLY, 0), nodeid=f, unique=unique)
            assert error == 0 and open_of(payload)[1] & wire.FOPEN_NOFLUSH
        assert len(tasks) == 2  # the listings made answer all of these: no task, no wait
        store.put_object("dir/file.bin", b"new" * 10)
        fs.clock.advance(6)  # type: ignore[attr-defined]  # the listing expired: this open must list again
        error, payload = await kernel.call(wire.OPEN, wire.OPEN_IN.pack(os.O_RDONLY, 0), nodeid=f, unique=12)
        fh, flags = open_of(payload)
        assert error == 0 and tasks[2:] == [("open", 12)] and not flags & wire.FOPEN_KEEP_CACHE  # new version
        assert await kernel.call(wire.READ, read_in(fh, 0, 6), nodeid=f) == (0, b"newnew")
        assert (await kernel.call(wire.OPEN, wire.OPEN_IN.pack(os.O_RDONLY, 0), nodeid=d, unique=13))[0] == errno.EISDIR
        assert len(tasks) == 3
    assert fs.stats.lookups == 4


async def test_posix_errors_through_the_adapter(fs: CacheFS) -> None:
    async for kernel, _ in serving(FuseOperations(fs)):
        assert (await kernel.call(wire.LOOKUP, b"nope\0"))[0] == errno.ENOENT
        assert (await kernel.call(wire.GETATTR, bytes(16), nodeid=424242))[0] == errno.ENOENT
        assert (await kernel.call(wire.READ, read_in(999, 0, 10)))[0] == errno.EBADF
        d = entry_of((await kernel.call(wire.LOOKUP, b"dir\0"))[1])[0]
        assert (await kernel.call(wire.OPEN, wire.OPEN_IN.pack(os.O_RDONLY, 0), nodeid=d))[0] == errno.EISDIR
        f = entry_of((await kernel.call(wire.LOOKUP, b"file.bin\0", nodeid=d))[1])[0]
        assert (await kernel.call(wire.OPEN, wire.OPEN_IN.pack(os.O_WRONLY, 0), nodeid=f))[0] == errno.EROFS


async def test_a_changed_object_is_estale_through_the_adapter(fs: CacheFS, store: InMemoryObjectStore) -> None:
    async for kernel, _ in serving(FuseOperations(fs)):
        d = entry_of((await kernel.call(wire.LOOKUP, b"dir\0"))[1])[0]
        f = entry_of((await kernel.call(wire.LOOKUP, b"file.bin\0", nodeid=d))[1])[0]
        fh = open_of((await kernel.call(wire.OPEN, wire.OPEN_IN.pack(os.O_RDONLY, 0), nodeid=f))[1])[0]
        store.put_object("dir/file.bin", b"x" * 100)
        assert (await kernel.call(wire.READ, read_in(fh, 0, 10), nodeid=f))[0] == errno.ESTALE


async def test_a_relist_that_finds_a_change_notifies_the_kernel_from_another_thread(
        fs: CacheFS, store: InMemoryObjectStore) -> None:
    """FUSE_NOTIFY_INVAL_INODE for a file with a new version and _ENTRY for its name and for a name
    gone: unsolicited messages (unique 0, the code in the error field), counted in the stats."""
    store.put_object("dir/gone.bin", b"g")
    async for kernel, session in serving(FuseOperations(fs)):
        await kernel.call(wire.INIT, init_in(45, wire.DO_READDIRPLUS), nodeid=0)
        assert session.notifier is not None
        d = entry_of((await kernel.call(wire.LOOKUP, b"dir\0"))[1])[0]
        f = entry_of((await kernel.call(wire.LOOKUP, b"file.bin\0", nodeid=d))[1])[0]
        await kernel.call(wire.LOOKUP, b"gone.bin\0", nodeid=d)
        store.put_object("dir/file.bin", b"x" * 300)
        store.delete_object("dir/gone.bin")
        fs.clock.advance(6)  # type: ignore[attr-defined]  # past dir_ttl_s: the next lookup lists again
        kernel.send(encode(wire.LOOKUP, b"other\0", nodeid=d, unique=77))
        replies, notices = [], []
        while len(replies) < 1 or len(notices) < 3:
            unique, error, payload = await kernel.reply()
            if unique == 0:
                notices.append((-error, payload))  # (reply() negates the header's error field)
            else:
                replies.append((error, payload))
        assert replies == [(errno.ENOENT, b"")]
        assert sorted(notices) == sorted([
            (wire.NOTIFY_INVAL_INODE, struct.pack("<Qqq", f, 0, 0)),
            (wire.NOTIFY_INVAL_ENTRY, struct.pack("<QII", d, 8, 0) + b"file.bin\0"),
            (wire.NOTIFY_INVAL_ENTRY, struct.pack("<QII", d, 8, 0) + b"gone.bin\0"),
        ])
        deadline = asyncio.get_running_loop().time() + REPLY_WAIT_S  # counted after each write, by its thread
        while (fs.stats.inval_entries, fs.stats.inval_inodes) != (2, 1):
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
        assert await kernel.nothing()


def test_notification_outcomes_are_counted(fs: CacheFS) -> None:
    ops = FuseOperations(fs)
    ops.notified(wire.NOTIFY_INVAL_ENTRY, 0)
    ops.notified(wire.NOTIFY_INVAL_ENTRY, errno.ENOENT)  # the kernel did not hold it: normal
    ops.notified(wire.NOTIFY_INVAL_INODE, errno.ENOENT)
    ops.notified(wire.NOTIFY_INVAL_INODE, errno.EINVAL)
    ops.notified(wire.NOTIFY_INVAL_INODE, errno.ENOBUFS)  # never sent: too many queued
    s = fs.stats
    assert (s.inval_entries, s.inval_inodes, s.inval_not_cached, s.inval_errors, s.inval_dropped) == (2, 2, 2, 1, 1)


async def test_a_notifier_past_its_bound_drops_and_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    from cachefs.fuse import notifier as notifier_module
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    outcomes: list[tuple[int, int]] = []
    threads: list[str] = []

    def report(code: int, error: int) -> None:
        outcomes.append((code, error))
        threads.append(threading.current_thread().name)

    monkeypatch.setattr(notifier_module, "MAX_QUEUED_NOTICES", 0)
    notifier = notifier_module.Notifier(ours.fileno(), report)
    try:
        notifier.forget_inode(5)
        assert outcomes == [(wire.NOTIFY_INVAL_INODE, errno.ENOBUFS)]
        monkeypatch.setattr(notifier_module, "MAX_QUEUED_NOTICES", 10)
        notifier.forget_entry(1, b"n")
    finally:
        notifier.close()
        ours.close()
    assert theirs.recv(100) == b"".join(wire.notify_inval_entry(1, b"n"))
    assert outcomes[1:] == [(wire.NOTIFY_INVAL_ENTRY, 0)]
    assert threads[1:] == ["fuse-notify"]  # written by its own thread, never the loop's
    theirs.close()


WRITE_REQUESTS = [
    ("setattr", wire.SETATTR, wire.SETATTR_IN.pack(wire.FATTR_SIZE, 0, 0, 3, *([0] * 12))),
    ("mknod", wire.MKNOD, wire.MKNOD_IN.pack(0o100644, 0, 0, 0) + b"n\0"),
    ("mkdir", wire.MKDIR, wire.MKDIR_IN.pack(0o755, 0) + b"d\0"),
    ("unlink", wire.UNLINK, b"dir\0"),
    ("rmdir", wire.RMDIR, b"dir\0"),
    ("symlink", wire.SYMLINK, b"l\0target\0"),
    ("rename", wire.RENAME, wire.RENAME_IN.pack(ROOT_INODE) + b"dir\0other\0"),
    ("rename2", wire.RENAME2, wire.RENAME2_IN.pack(ROOT_INODE, 0, 0) + b"dir\0other\0"),
    ("link", wire.LINK, wire.LINK_IN.pack(ROOT_INODE) + b"l\0"),
    ("create", wire.CREATE, wire.CREATE_IN.pack(os.O_WRONLY | os.O_CREAT, 0o644, 0, 0) + b"new\0"),
    ("write", wire.WRITE, wire.WRITE_IN.pack(1, 0, 4, 0, 0, 0, 0) + b"data"),
    ("fallocate", wire.FALLOCATE, wire.FALLOCATE_IN.pack(1, 0, 10, 0, 0)),
    ("setxattr", wire.SETXATTR, wire.SETXATTR_IN.pack(1, 0) + b"user.x\0v"),
    ("removexattr", wire.REMOVEXATTR, b"user.x\0"),
]


@pytest.mark.parametrize(("name", "opcode", "body"), WRITE_REQUESTS, ids=[r[0] for r in WRITE_REQUESTS])
async def test_write_requests_are_erofs(fs: CacheFS, name: str, opcode: int, body: bytes) -> None:
    async for kernel, _ in serving(FuseOperations(fs)):
        assert await kernel.call(opcode, body) == (errno.EROFS, b"")


# ------------------------------------------------------------------------------------------ writable
@pytest.fixture
async def writable(tmp_path):
    from tiering.tiers.disk import DiskTier
    from tiering.writeback import WriteBack, WriteBackSettings

    store = InMemoryObjectStore()
    store.put_object("dir/file.bin", b"0123456789", mtime=1_700_000_000)
    disk = DiskTier(tmp_path / "cache", 16 * 1024 * 1024)
    cache = BlockCache(CacheSettings(block_size=BS, ram_bytes=16 * BS), store, RamTier(16 * BS), disk)
    fs = CacheFS(store, cache, FsSettings(attr_ttl_s=5, dir_ttl_s=5), clock=FakeClock())
    wb = WriteBack(WriteBackSettings(upload_delay_s=0), tmp_path / "cache" / "staging", store, cache, disk)
    fs.attach_writeback(wb)
    await wb.start()
    try:
        yield fs, store, wb
    finally:
        await wb.stop()


async def test_direct_io_is_answered_on_every_open_and_create_only_when_asked(writable) -> None:
    fs, _store, _wb = writable
    for direct_io in (False, True):
        async for kernel, _ in serving(FuseOperations(fs, direct_io=direct_io)):
            d = entry_of((await kernel.call(wire.LOOKUP, b"dir\0"))[1])[0]
            f = entry_of((await kernel.call(wire.LOOKUP, b"file.bin\0", nodeid=d))[1])[0]
            for flags in (os.O_RDONLY, os.O_RDWR):
                fh, open_flags = open_of((await kernel.call(wire.OPEN, wire.OPEN_IN.pack(flags, 0), nodeid=f))[1])
                assert bool(open_flags & wire.FOPEN_DIRECT_IO) is direct_io
                assert bool(open_flags & wire.FOPEN_NOFLUSH) is (flags == os.O_RDONLY)  # a writer's close flushes
                await kernel.call(wire.RELEASE, wire.RELEASE_IN.pack(fh, 0, 0, 0), nodeid=f)
            create = wire.CREATE_IN.pack(os.O_WRONLY | os.O_CREAT, 0o100644, 0, 0) + f"new-{direct_io}\0".encode()
            error, payload = await kernel.call(wire.CREATE, create)
            assert error == 0 and len(payload) == 128 + 16
            fh, open_flags = open_of(payload[128:])
            assert bool(open_flags & wire.FOPEN_DIRECT_IO) is direct_io and not open_flags & wire.FOPEN_NOFLUSH
            await kernel.call(wire.RELEASE, wire.RELEASE_IN.pack(fh, 0, 0, 0))
    assert FuseOperations(fs).direct_io is False


async def test_write_path_through_the_adapter(writable) -> None:
    fs, store, wb = writable
    async for kernel, _ in serving(FuseOperations(fs)):
        create = wire.CREATE_IN.pack(os.O_WRONLY | os.O_CREAT, 0o100644, 0, 0) + b"new.txt\0"
        error, payload = await kernel.call(wire.CREATE, create)
        f, mode, size, _ = entry_of(payload)
        fh, flags = open_of(payload[128:])
        assert error == 0 and stat.S_ISREG(mode) and size == 0 and not flags & wire.FOPEN_KEEP_CACHE
        assert await kernel.call(wire.WRITE, wire.WRITE_IN.pack(fh, 0, 5, 0, 0, 0, 0) + b"hello", nodeid=f) == (
            0, wire.write_out(5))
        # fallocate: grows the file to 8 bytes (zeros), then punches [1, 3) (KEEP_SIZE | PUNCH_HOLE)
        assert await kernel.call(wire.FALLOCATE, wire.FALLOCATE_IN.pack(fh, 0, 8, 0, 0), nodeid=f) == (0, b"")
        assert await kernel.call(wire.FALLOCATE, wire.FALLOCATE_IN.pack(fh, 1, 2, 0x03, 0), nodeid=f) == (0, b"")
        assert await kernel.call(wire.FALLOCATE, wire.FALLOCATE_IN.pack(fh, 0, 2, 0x08, 0), nodeid=f) == (
            errno.EOPNOTSUPP, b"")
        assert (await fs.getattr(f)).size == 8
        assert await kernel.call(wire.FLUSH, wire.FLUSH_IN.pack(fh, 0, 0, 0), nodeid=f) == (0, b"")
        assert await kernel.call(wire.FSYNC, wire.FSYNC_IN.pack(fh, 0, 0), nodeid=f) == (0, b"")
        valid = wire.FATTR_SIZE | wire.FATTR_MTIME | wire.FATTR_FH
        setattr_in = wire.SETATTR_IN.pack(valid, 0, fh, 3, 0, 0, 1_600_000_000, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        error, payload = await kernel.call(wire.SETATTR, setattr_in, nodeid=f)
        assert error == 0 and struct.unpack_from("<QQQQQ", payload, 16)[1] == 3
        assert struct.unpack_from("<QQQQQ", payload, 16)[4] == 1_600_000_000
        await kernel.call(wire.RELEASE, wire.RELEASE_IN.pack(fh, 0, 0, 0), nodeid=f)
        error, payload = await kernel.call(wire.MKDIR, wire.MKDIR_IN.pack(0o755, 0o022) + b"made\0")
        d, mode, _, _ = entry_of(payload)
        assert error == 0 and stat.S_ISDIR(mode)
        assert await kernel.call(wire.RENAME, wire.RENAME_IN.pack(d) + b"new.txt\0moved.txt\0") == (0, b"")
        assert await kernel.call(wire.UNLINK, b"moved.txt\0", nodeid=d) == (0, b"")
        assert await kernel.call(wire.RMDIR, b"made\0") == (0, b"")
    report = await wb.flush(5)
    assert report.ok, report.pending
    assert store.keys() == ["dir/file.bin"]


async def test_unsupported_operations_through_the_adapter(writable) -> None:
    fs, _store, _wb = writable
    cases = [
        (wire.SYMLINK, b"l\0target\0", errno.EPERM),
        (wire.LINK, wire.LINK_IN.pack(ROOT_INODE) + b"l\0", errno.EPERM),
        (wire.SETXATTR, wire.SETXATTR_IN.pack(1, 0) + b"user.x\0v", errno.ENOTSUP),
        (wire.REMOVEXATTR, b"user.x\0", errno.ENOTSUP),
        (wire.MKNOD, wire.MKNOD_IN.pack(stat.S_IFIFO | 0o644, 0, 0, 0) + b"p\0", errno.EPERM),
        (wire.UNLINK, b"nope\0", errno.ENOENT),
        (wire.RMDIR, b"dir\0", errno.ENOTEMPTY),
        (wire.MKDIR, wire.MKDIR_IN.pack(0o755, 0) + b"dir\0", errno.EEXIST),
        (wire.WRITE, wire.WRITE_IN.pack(4242, 0, 1, 0, 0, 0, 0) + b"x", errno.EBADF),
    ]
    async for kernel, _ in serving(FuseOperations(fs)):
        for opcode, body, code in cases:
            assert await kernel.call(opcode, body) == (code, b""), wire.OPCODE_NAMES[opcode]


# ------------------------------------------------------------------ mount failures (issue 24, item 2)
def test_fusermount_words_become_the_one_line_reason() -> None:
    allow_other = ("fusermount3: option allow_other only allowed if 'user_allow_other' is set in "
                   "/etc/fuse.conf\n")
    reason = fuse_failure_reason(allow_other)
    assert reason is not None and reason.startswith("fusermount3: option allow_other only allowed")
    assert "drop --allow-other" in reason and "\n" not in reason
    reason = fuse_failure_reason("fuse: failed to open /dev/fuse: Permission denied\n")
    assert reason is not None and reason.startswith("failed to open /dev/fuse: Permission denied; ")
    assert fuse_failure_reason("fuse: unknown option 'x'\n") == "unknown option 'x'"
    assert fuse_failure_reason("\n  \n") is None
    assert len(fuse_failure_reason("x" * 10_000) or "") <= 300


def test_the_mount_source_is_the_url_without_credentials() -> None:
    assert mount_source("s3://bucket/prefix/") == "s3://bucket/prefix/"
    assert mount_source("https://user:secret@example.com:8443/data?X-Amz-Signature=abc#x") == "https://example.com:8443/data"
    assert mount_source("file:///srv/a b,c\n") == "file:///srv/a b,c"
    assert mount_source("") == "cachefs"
    assert len(mount_source("s3://b/" + "k" * 1000)) == 256
