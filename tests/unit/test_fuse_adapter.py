"""The pyfuse3 adapter: every failure leaves a handler as FUSEError with the right errno."""

from __future__ import annotations

import errno
import logging
import os
import stat

import pyfuse3
import pytest

from cachefs.fs.errors import FsError
from cachefs.fs.filesystem import CacheFS
from cachefs.fs.inodes import ROOT_INODE
from cachefs.fuse.adapter import FuseOperations, errno_of
from cachefs.mounts import CONTROL_XATTR
from cachefs.settings import FsSettings
from tiering.blocks import MIN_BLOCK_SIZE
from tiering.clock import FakeClock
from tiering.engine.blockcache import BlockCache
from tiering.errors import ObjectChangedError, ObjectStoreUnavailableError
from tiering.objectstore.memory import InMemoryObjectStore
from tiering.tiers.ram import RamTier
from tiering.settings import CacheSettings

BS = MIN_BLOCK_SIZE


class RaisingFs:
    """Stands in for CacheFS; every operation raises ``exc``."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def _raise(self, *args: object) -> None:
        raise self.exc

    async def _araise(self, *args: object) -> None:
        raise self.exc

    lookup = getattr = open = read = opendir = _araise
    forget = release = releasedir = readdir = statfs = getxattr = listxattr = add_lookup = _raise
    refuse_write = _raise


# Each read-side handler with arguments that reach the fs method.
HANDLERS = [
    ("lookup", (ROOT_INODE, b"x", None)),
    ("getattr", (ROOT_INODE, None)),
    ("open", (5, os.O_RDONLY, None)),
    ("read", (3, 0, 4096)),
    ("release", (3,)),
    ("opendir", (ROOT_INODE, None)),
    ("readdir", (3, 0, None)),  # the fs raises before any reply is made, so no token is needed
    ("releasedir", (3,)),
    ("statfs", (None,)),
    ("getxattr", (ROOT_INODE, b"user.x", None)),
    ("listxattr", (ROOT_INODE, None)),
    ("forget", ([(5, 1)],)),
]

FAILURES = [
    (FsError(errno.ENOENT), errno.ENOENT),
    (ObjectChangedError("overwritten"), errno.ESTALE),
    (OSError(errno.ENOSPC, "No space left on device"), errno.ENOSPC),
    (ValueError("bug"), errno.EIO),
    (ObjectStoreUnavailableError("store down"), errno.EIO),
    (OSError("no errno at all"), errno.EIO),
    (KeyError("missing"), errno.EIO),
]


@pytest.mark.parametrize(("exc", "code"), FAILURES, ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v))
@pytest.mark.parametrize(("handler", "args"), HANDLERS, ids=[h for h, _ in HANDLERS])
async def test_every_failure_becomes_fuse_error_with_its_errno(
    handler: str, args: tuple, exc: BaseException, code: int
) -> None:
    ops = FuseOperations(RaisingFs(exc))  # type: ignore[arg-type]
    with pytest.raises(pyfuse3.FUSEError) as info:
        await getattr(ops, handler)(*args)
    assert info.value.errno == code
    assert info.value.__cause__ is exc


async def test_unexpected_errors_are_logged_with_their_traceback(caplog: pytest.LogCaptureFixture) -> None:
    bug = ValueError("bug")
    ops = FuseOperations(RaisingFs(bug))  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="cachefs.fuse.adapter"):
        with pytest.raises(pyfuse3.FUSEError):
            await ops.lookup(ROOT_INODE, b"x", None)
    records = [r for r in caplog.records if r.name == "cachefs.fuse.adapter"]
    assert len(records) == 1
    assert records[0].levelno == logging.ERROR
    assert "lookup" in records[0].getMessage()
    assert records[0].exc_info is not None and records[0].exc_info[1] is bug
    assert "ValueError: bug" in caplog.text


async def test_expected_errors_are_not_logged_as_bugs(caplog: pytest.LogCaptureFixture) -> None:
    ops = FuseOperations(RaisingFs(FsError(errno.ENOENT)))  # type: ignore[arg-type]
    with caplog.at_level(logging.DEBUG, logger="cachefs.fuse.adapter"):
        with pytest.raises(pyfuse3.FUSEError):
            await ops.lookup(ROOT_INODE, b"x", None)
    assert not [r for r in caplog.records if r.name == "cachefs.fuse.adapter" and r.exc_info]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_fuse_errors_pass_through_unchanged() -> None:
    original = pyfuse3.FUSEError(errno.EPERM)
    ops = FuseOperations(RaisingFs(original))  # type: ignore[arg-type]
    with pytest.raises(pyfuse3.FUSEError) as info:
        await ops.getattr(ROOT_INODE, None)
    assert info.value is original


def test_errno_of() -> None:
    assert errno_of(FsError(errno.ENOTDIR)) == errno.ENOTDIR
    assert errno_of(ObjectChangedError("x")) == errno.ESTALE
    assert errno_of(FileNotFoundError(errno.ENOENT, "gone")) == errno.ENOENT
    assert errno_of(RuntimeError("x")) == errno.EIO


# ------------------------------------------------------------------------------------------ with CacheFS
@pytest.fixture
def store() -> InMemoryObjectStore:
    s = InMemoryObjectStore()
    s.put_object("dir/file.bin", b"0123456789" * 10, mtime=1_700_000_000)
    return s


@pytest.fixture
def ops(store: InMemoryObjectStore) -> FuseOperations:
    settings = CacheSettings(block_size=BS, ram_bytes=16 * BS)
    cache = BlockCache(settings, store, RamTier(16 * BS))
    settings = FsSettings(attr_ttl_s=5, dir_ttl_s=5, read_only=True)
    fs = CacheFS(store, cache, settings, clock=FakeClock(), control_path="/run/c.sock")
    return FuseOperations(fs)


async def test_read_path_through_the_adapter(ops: FuseOperations) -> None:
    d = await ops.lookup(ROOT_INODE, b"dir", None)
    assert stat.S_ISDIR(d.st_mode)
    f = await ops.lookup(d.st_ino, b"file.bin", None)
    assert stat.S_ISREG(f.st_mode) and f.st_size == 100
    assert f.st_mtime_ns == 1_700_000_000 * 10**9
    assert (await ops.getattr(f.st_ino, None)).st_size == 100
    fi = await ops.open(f.st_ino, os.O_RDONLY, None)
    assert fi.keep_cache is False
    assert await ops.read(fi.fh, 10, 15) == b"012345678901234"
    await ops.release(fi.fh)
    fi2 = await ops.open(f.st_ino, os.O_RDONLY, None)
    assert fi2.keep_cache is True
    await ops.release(fi2.fh)
    st = await ops.statfs(None)
    assert st.f_blocks == 16 * BS // st.f_bsize and st.f_namemax == 255
    assert await ops.getxattr(ROOT_INODE, CONTROL_XATTR.encode(), None) == b"/run/c.sock"
    assert await ops.listxattr(ROOT_INODE, None) == [CONTROL_XATTR.encode()]


async def test_posix_errors_through_the_adapter(ops: FuseOperations) -> None:
    cases = [
        (ops.lookup(ROOT_INODE, b"nope", None), errno.ENOENT),
        (ops.getattr(424242, None), errno.ENOENT),
        (ops.read(999, 0, 10), errno.EBADF),
        (ops.getxattr(ROOT_INODE, b"user.other", None), errno.ENODATA),
    ]
    for call, code in cases:
        with pytest.raises(pyfuse3.FUSEError) as info:
            await call
        assert info.value.errno == code
    d = await ops.lookup(ROOT_INODE, b"dir", None)
    with pytest.raises(pyfuse3.FUSEError) as info:
        await ops.open(d.st_ino, os.O_RDONLY, None)
    assert info.value.errno == errno.EISDIR
    f = await ops.lookup(d.st_ino, b"file.bin", None)
    with pytest.raises(pyfuse3.FUSEError) as info:
        await ops.open(f.st_ino, os.O_WRONLY, None)
    assert info.value.errno == errno.EROFS


async def test_a_changed_object_is_estale_through_the_adapter(ops: FuseOperations, store: InMemoryObjectStore) -> None:
    d = await ops.lookup(ROOT_INODE, b"dir", None)
    f = await ops.lookup(d.st_ino, b"file.bin", None)
    fi = await ops.open(f.st_ino, os.O_RDONLY, None)
    store.put_object("dir/file.bin", b"x" * 100)
    with pytest.raises(pyfuse3.FUSEError) as info:
        await ops.read(fi.fh, 0, 10)
    assert info.value.errno == errno.ESTALE


WRITE_HANDLERS = [
    ("setattr", (ROOT_INODE, None, None, None, None)),
    ("mknod", (ROOT_INODE, b"n", 0o644, 0, None)),
    ("mkdir", (ROOT_INODE, b"d", 0o755, None)),
    ("unlink", (ROOT_INODE, b"dir", None)),
    ("rmdir", (ROOT_INODE, b"dir", None)),
    ("symlink", (ROOT_INODE, b"l", b"target", None)),
    ("rename", (ROOT_INODE, b"dir", ROOT_INODE, b"other", 0, None)),
    ("link", (ROOT_INODE, ROOT_INODE, b"l", None)),
    ("create", (ROOT_INODE, b"new", 0o644, os.O_WRONLY | os.O_CREAT, None)),
    ("write", (1, 0, b"data")),
    ("setxattr", (ROOT_INODE, b"user.x", b"v", None)),
    ("removexattr", (ROOT_INODE, b"user.x", None)),
]


@pytest.mark.parametrize(("handler", "args"), WRITE_HANDLERS, ids=[h for h, _ in WRITE_HANDLERS])
async def test_write_handlers_are_erofs(ops: FuseOperations, handler: str, args: tuple) -> None:
    with pytest.raises(pyfuse3.FUSEError) as info:
        await getattr(ops, handler)(*args)
    assert info.value.errno == errno.EROFS


async def test_flush_and_fsync_of_a_read_only_file(ops: FuseOperations) -> None:
    """On a read-only mount FLUSH answers ENOSYS (the kernel then answers close() itself and sends no
    more FLUSH: tests/fuse/test_close_requests.py); fsync has nothing to do and succeeds."""
    assert ops.fs.settings.read_only
    d = await ops.lookup(ROOT_INODE, b"dir", None)
    f = await ops.lookup(d.st_ino, b"file.bin", None)
    fi = await ops.open(f.st_ino, os.O_RDONLY, None)
    with pytest.raises(pyfuse3.FUSEError) as flushed:
        await ops.flush(fi.fh)
    assert flushed.value.errno == errno.ENOSYS
    assert await ops.fsync(fi.fh, True) is None
    await ops.release(fi.fh)
    for call in (ops.flush(999), ops.fsync(999, False)):
        with pytest.raises(pyfuse3.FUSEError) as info:
            await call
        assert info.value.errno == errno.EBADF


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
        yield FuseOperations(fs), store, wb
    finally:
        await wb.stop()


async def test_direct_io_is_answered_on_every_open_and_create_only_when_asked(writable) -> None:
    ops, _store, _wb = writable
    for direct_io in (False, True):
        ops.direct_io = direct_io
        d = await ops.lookup(ROOT_INODE, b"dir", None)
        f = await ops.lookup(d.st_ino, b"file.bin", None)
        for flags in (os.O_RDONLY, os.O_RDWR):
            fi = await ops.open(f.st_ino, flags, None)
            assert fi.direct_io is direct_io
            await ops.release(fi.fh)
        fi, _entry = await ops.create(ROOT_INODE, f"new-{direct_io}".encode(), 0o644, os.O_WRONLY | os.O_CREAT, None)
        assert fi.direct_io is direct_io
        await ops.release(fi.fh)
    assert FuseOperations(ops.fs).direct_io is False
    assert FuseOperations(ops.fs, direct_io=True).direct_io is True


def _fields(**updates: bool) -> object:
    import types

    names = ("update_atime", "update_mtime", "update_ctime", "update_mode", "update_uid", "update_gid",
             "update_size")
    return types.SimpleNamespace(**{name: updates.get(name, False) for name in names})


async def test_write_path_through_the_adapter(writable) -> None:
    ops, store, wb = writable
    fi, entry = await ops.create(ROOT_INODE, b"new.txt", 0o644, os.O_WRONLY | os.O_CREAT, None)
    assert stat.S_ISREG(entry.st_mode) and entry.st_size == 0 and fi.keep_cache is False
    assert await ops.write(fi.fh, 0, b"hello") == 5
    await ops.flush(fi.fh)
    await ops.fsync(fi.fh, False)
    attr = pyfuse3.EntryAttributes()
    attr.st_size = 3
    attr.st_mtime_ns = 1_600_000_000 * 10**9
    out = await ops.setattr(entry.st_ino, attr, _fields(update_size=True, update_mtime=True), fi.fh, None)
    assert out.st_size == 3 and out.st_mtime_ns == 1_600_000_000 * 10**9
    await ops.release(fi.fh)
    d = await ops.mkdir(ROOT_INODE, b"made", 0o755, None)
    assert stat.S_ISDIR(d.st_mode)
    await ops.rename(ROOT_INODE, b"new.txt", d.st_ino, b"moved.txt", 0, None)
    await ops.unlink(d.st_ino, b"moved.txt", None)
    await ops.rmdir(ROOT_INODE, b"made", None)
    report = await wb.flush(5)
    assert report.ok, report.pending
    assert store.keys() == ["dir/file.bin"]


async def test_unsupported_operations_through_the_adapter(writable) -> None:
    ops, _store, _wb = writable
    cases = [
        (ops.symlink(ROOT_INODE, b"l", b"target", None), errno.EPERM),
        (ops.link(ROOT_INODE, ROOT_INODE, b"l", None), errno.EPERM),
        (ops.setxattr(ROOT_INODE, b"user.x", b"v", None), errno.ENOTSUP),
        (ops.removexattr(ROOT_INODE, b"user.x", None), errno.ENOTSUP),
        (ops.mknod(ROOT_INODE, b"p", stat.S_IFIFO | 0o644, 0, None), errno.EPERM),
        (ops.unlink(ROOT_INODE, b"nope", None), errno.ENOENT),
        (ops.rmdir(ROOT_INODE, b"dir", None), errno.ENOTEMPTY),
        (ops.mkdir(ROOT_INODE, b"dir", 0o755, None), errno.EEXIST),
        (ops.write(4242, 0, b"x"), errno.EBADF),
    ]
    for call, code in cases:
        with pytest.raises(pyfuse3.FUSEError) as info:
            await call
        assert info.value.errno == code


# ------------------------------------------------------------------ mount failures (issue 24, item 2)
def test_fusermount_words_become_the_one_line_reason() -> None:
    from cachefs.fuse.adapter import fuse_failure_reason

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


def test_captured_stderr_takes_what_a_child_process_writes_and_restores_fd_2() -> None:
    import os
    import subprocess
    import sys

    from cachefs.fuse.adapter import captured_stderr

    before = os.fstat(2)
    with captured_stderr() as captured:
        subprocess.run([sys.executable, "-c", "import sys; sys.stderr.write('fusermount3: nope\\n')"], check=True)
        os.write(2, b"libfuse: too\n")
    assert captured.text == "fusermount3: nope\nlibfuse: too\n"
    after = os.fstat(2)
    assert (before.st_dev, before.st_ino) == (after.st_dev, after.st_ino)
