"""CacheFS: a file unlinked, or replaced or moved by a rename, while a handle holds it open.

POSIX: the handle keeps referring to the file it opened, whatever happens to its name. Over an object
store the name is the object, so the content a handle may still need is kept before the object goes:
copied into staging (through the block cache) by the unlink or rename. Every test runs with an
upload delay of 0, so the store's DELETE or PUT of the name lands before the handle's next request,
and every object spans several blocks none of which is cached when the name goes.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from cachefs.fs import filesystem
from cachefs.fs.inodes import ROOT_INODE
from tests.unit.test_fs_writes import BS, RW, Env, create, lookup, read_path
from tiering.errors import ObjectChangedError, ObjectNotFoundError

SIZE = 3 * BS + 7  # several blocks and a short last one


@pytest.fixture
async def env(tmp_path: Path):
    e = Env(tmp_path, upload_delay_s=0)
    e.inner.put_object("victim", os.urandom(SIZE))
    e.inner.put_object("stored", os.urandom(SIZE))
    await e.wb.start()
    try:
        yield e
    finally:
        await e.wb.stop()


async def open_path(env: Env, path: str, flags: int) -> int:
    fh, _ = await env.fs.open((await lookup(env.fs, path)).inode, flags)
    return fh


async def replace_by_rename(env: Env, source: str) -> bytes:
    """rename(``source``, "victim"): a file staged through the mount, or one only in the store."""
    if source == "staged":
        await create(env.fs, "new", b"the replacement")
        await env.fs.rename(ROOT_INODE, b"new", ROOT_INODE, b"victim", 0)
        return b"the replacement"
    data = env.obj("stored")
    await env.fs.rename(ROOT_INODE, b"stored", ROOT_INODE, b"victim", 0)
    return data


# ------------------------------------------------------------------------------------------ writers
@pytest.mark.parametrize("source", ["staged", "stored"])
async def test_a_writer_keeps_the_file_a_rename_replaced(env: Env, source: str) -> None:
    """open(O_RDWR) of a stored file, no write yet; another file is renamed over it; then write and
    read through the handle: they are of the replaced file (case A)."""
    before = env.obj("victim")
    fh = await open_path(env, "victim", RW)
    replacement = await replace_by_rename(env, source)
    await env.flush()  # the new object is at the key now
    await env.fs.write(fh, 3, b"NEW")
    assert await env.fs.read(fh, 0, SIZE + 10) == before[:3] + b"NEW" + before[6:]
    assert await read_path(env.fs, "victim") == replacement
    await env.fs.flush(fh)
    env.fs.release(fh)
    await env.flush()
    assert env.obj("victim") == replacement  # the replaced file's handle uploads nothing


async def test_a_writer_follows_its_file_renamed_after_its_staged_copy_was_unloaded(env: Env) -> None:
    """A file written, uploaded and still open; under space pressure its staged copy is dropped (the
    store has it: the next write copies it in again). Renamed then, it is copied in before the move
    (case A): the handle's next write goes to the new name, not to a copy nobody can reach."""
    fh = await open_path(env, "victim", RW)
    await env.fs.write(fh, 0, b"v1")
    await env.fs.flush(fh)
    await env.flush()
    expected = env.obj("victim")
    sf = env.wb.file("victim")
    for _ in range(100):  # what a full cache does (once the upload's promotion lets go of the copy)
        if env.wb.files.unload_clean() or (sf is not None and sf.current is None):
            break
        await asyncio.sleep(0.01)
    assert sf is not None and sf.current is None and sf.holders == 1  # staged, copied in on the next change
    await env.fs.rename(ROOT_INODE, b"victim", ROOT_INODE, b"moved", 0)
    await env.fs.write(fh, 2, b"+v2")
    expected = expected[:2] + b"+v2" + expected[5:]
    assert await env.fs.read(fh, 0, SIZE + 10) == expected
    await env.fs.flush(fh)
    env.fs.release(fh)
    assert await read_path(env.fs, "moved") == expected
    await env.flush()
    assert env.obj("moved") == expected and "victim" not in env.keys()


# ------------------------------------------------------------------------------------------ readers
async def test_a_reader_keeps_reading_a_file_unlinked_before_it_read_it_all(env: Env) -> None:
    """open(O_RDONLY), read the first bytes, unlink; the DELETE lands; the rest still reads (case B)."""
    data = env.obj("victim")
    attrs = await lookup(env.fs, "victim")
    fh = await open_path(env, "victim", os.O_RDONLY)
    assert await env.fs.read(fh, 0, 10) == data[:10]
    await env.fs.unlink(ROOT_INODE, b"victim")
    await env.flush()
    assert "victim" not in env.keys()
    assert await env.fs.read(fh, 0, SIZE + 10) == data
    after = await env.fs.getattr(attrs.inode)  # fstat: the same file, with no link
    assert (after.size, after.mtime_ns, after.nlink) == (attrs.size, attrs.mtime_ns, 0)
    env.fs.release(fh)
    await env.flush()
    assert "victim" not in env.keys()


@pytest.mark.parametrize("source", ["staged", "stored"])
async def test_a_reader_keeps_reading_the_file_a_rename_replaced(env: Env, source: str) -> None:
    data = env.obj("victim")
    fh = await open_path(env, "victim", os.O_RDONLY)
    replacement = await replace_by_rename(env, source)
    await env.flush()
    assert await env.fs.read(fh, 0, SIZE + 10) == data
    assert await read_path(env.fs, "victim") == replacement
    env.fs.release(fh)


async def test_unlink_of_a_large_file_open_for_reading_copies_nothing(env: Env, monkeypatch) -> None:
    """The copy is bounded: a file over ``KEEP_FOR_READERS_MAX_BYTES`` open only for reading is not
    fetched by the unlink; what was cached still reads, the rest answers ENOENT (documented)."""
    monkeypatch.setattr(filesystem, "KEEP_FOR_READERS_MAX_BYTES", SIZE - 1)
    data = env.obj("victim")
    fh = await open_path(env, "victim", os.O_RDONLY)
    assert await env.fs.read(fh, 0, 10) == data[:10]  # block 0 is cached now
    gets = env.inner.stats.get_requests
    await env.fs.unlink(ROOT_INODE, b"victim")
    assert env.inner.stats.get_requests == gets
    await env.flush()
    assert await env.fs.read(fh, 0, BS) == data[:BS]
    with pytest.raises(ObjectNotFoundError):
        await env.fs.read(fh, 2 * BS, BS)
    env.fs.release(fh)


async def test_a_replaced_file_too_large_to_keep_is_never_read_as_its_replacement(env: Env, monkeypatch) -> None:
    """Over the bound, a reader of a file replaced by a server-side copy gets ESTALE, not the bytes of
    the file now at its name (the copy used to count as a new version of the file it replaced)."""
    monkeypatch.setattr(filesystem, "KEEP_FOR_READERS_MAX_BYTES", SIZE - 1)
    fh = await open_path(env, "victim", os.O_RDONLY)
    await replace_by_rename(env, "stored")
    with pytest.raises(ObjectChangedError):
        await env.fs.read(fh, 0, BS)
    env.fs.release(fh)
