"""CacheFS at the edges (issue 19): object keys past the store's limit, over-long names, link counts.

Each test pins one point of the README's semantics section."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from cachefs.fs.errors import FsError
from cachefs.fs.inodes import ROOT_INODE
from tests.unit.test_fs_writes import Env, create, env, errno_of, lookup, names  # noqa: F401 (env: fixture)
from tiering.objectstore import parse_source
from tiering.objectstore.keys import MAX_KEY_BYTES
from tiering.objectstore.memory import InMemoryObjectStore

ROOM = 64  # a store with 64 bytes of key left below its root (as a long prefix would leave)


@pytest.fixture
async def small(tmp_path: Path):
    e = Env(tmp_path, store=InMemoryObjectStore(max_key_bytes=ROOM))
    e.inner.put_object("tree/a/b", b"b")
    e.inner.put_object("tree/c", b"c")
    await e.wb.start()
    try:
        yield e
    finally:
        await e.wb.stop()


def name_of(length: int, ch: str = "n") -> bytes:
    return (ch * length).encode()


async def raises_errno(code: int, coro) -> None:
    with pytest.raises(FsError) as info:
        await coro
    assert errno_of(info) == code


# ------------------------------------------------------------------------------ key length
async def test_create_and_mknod_refuse_a_key_past_the_limit(small: Env) -> None:
    fs = small.fs
    await raises_errno(errno.ENAMETOOLONG, fs.create(ROOT_INODE, name_of(ROOM + 1), 0o644, os.O_WRONLY | os.O_CREAT))
    await raises_errno(errno.ENAMETOOLONG, fs.mknod(ROOT_INODE, name_of(ROOM + 1), 0o100644))
    await create(fs, name_of(ROOM).decode(), b"fits")  # exactly the limit: accepted and uploaded
    await small.flush()
    assert small.obj("n" * ROOM) == b"fits"
    assert all(len(k.encode()) <= ROOM for k in small.keys())


async def test_mkdir_counts_the_markers_slash(small: Env) -> None:
    fs = small.fs
    await raises_errno(errno.ENAMETOOLONG, fs.mkdir(ROOT_INODE, name_of(ROOM), 0o755))
    await fs.mkdir(ROOT_INODE, name_of(ROOM - 1), 0o755)
    await small.flush()
    assert "n" * (ROOM - 1) + "/" in small.keys()


async def test_rename_of_a_file_to_a_long_name_is_refused(small: Env) -> None:
    fs = small.fs
    await create(fs, "f", b"x")
    await raises_errno(errno.ENAMETOOLONG, fs.rename(ROOT_INODE, b"f", ROOT_INODE, name_of(ROOM + 1), 0))
    assert "f" in await names(fs)


async def test_rename_of_a_directory_checks_every_key_below_it(small: Env) -> None:
    fs = small.fs
    # "tree" itself fits under the new name, but "<new>/a/b" (and the marker "<new>/a/") would not.
    new = name_of(ROOM - 3)
    await raises_errno(errno.ENAMETOOLONG, fs.rename(ROOT_INODE, b"tree", ROOT_INODE, new, 0))
    assert set(await names(fs, "tree")) == {"a", "c"}
    await small.flush()
    assert small.keys() == ["tree/a/b", "tree/c"]  # nothing was moved


async def test_a_deep_path_stops_at_s3s_limit(env: Env) -> None:
    """Five 250-byte directories (the issue's case): the fifth would make a 1,254-byte key."""
    fs = env.fs
    assert env.store.max_key_bytes == MAX_KEY_BYTES
    inode = ROOT_INODE
    for level in range(4):
        inode = (await fs.mkdir(inode, name_of(250, "abcd"[level]), 0o755)).inode
    await raises_errno(errno.ENAMETOOLONG, fs.mkdir(inode, name_of(250, "e"), 0o755))
    await raises_errno(errno.ENAMETOOLONG, fs.create(inode, name_of(30), 0o644, os.O_WRONLY | os.O_CREAT))
    fh, _, _ = await fs.create(inode, name_of(20), 0o644, os.O_WRONLY | os.O_CREAT)  # 1,024 bytes exactly
    await fs.flush(fh)
    fs.release(fh)
    await env.flush()
    assert max(len(k.encode()) for k in env.keys()) == MAX_KEY_BYTES


def test_a_prefix_that_leaves_no_room_is_refused() -> None:
    with pytest.raises(ValueError, match="no room for a name"):
        parse_source("s3://bucket/" + "p" * MAX_KEY_BYTES)
    assert parse_source("s3://bucket/" + "p" * (MAX_KEY_BYTES - 2)).prefix.endswith("/")


# ------------------------------------------------------------------------------ POSIX details
async def test_lookup_of_a_name_past_name_max_is_enametoolong(env: Env) -> None:
    await raises_errno(errno.ENAMETOOLONG, env.fs.lookup(ROOT_INODE, name_of(256)))
    await raises_errno(errno.ENOENT, env.fs.lookup(ROOT_INODE, name_of(255)))


async def test_an_unlinked_open_file_has_no_links(env: Env) -> None:
    fs = env.fs
    fh = await create(fs, "open.bin", b"contents", close=False)
    inode = (await lookup(fs, "open.bin")).inode
    assert (await fs.getattr(inode)).nlink == 1
    await fs.unlink(ROOT_INODE, b"open.bin")
    assert (await fs.getattr(inode)).nlink == 0
    await fs.flush(fh)
    fs.release(fh)


async def test_directories_show_one_link(env: Env) -> None:
    """1 is "not counted" to find and fts; 2 would tell find's leaf optimisation "no subdirectories"."""
    d = await lookup(env.fs, "d")
    assert (await env.fs.getattr(d.inode)).nlink == 1
    assert (await env.fs.getattr(ROOT_INODE)).nlink == 1
