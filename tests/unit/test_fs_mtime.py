"""The writer's mtime kept in the object's ``mtime`` metadata (docs/semantics.md, "Times"), without a mount.

Over the in-memory store (it keeps user metadata as S3 does, ``head_metadata``); the same behaviour
on a real mount over SeaweedFS, with remounts and a wiped cache, is ``tests/fuse/test_mtime.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cachefs.fs.filesystem import CacheFS
from cachefs.fs.inodes import ROOT_INODE
from cachefs.settings import FsSettings
from tests.unit.test_fs_writes import TTL, Env, create, lookup, names
from tiering.objectstore.mtimes import metadata_mtime

SET_MTIME = 1_500_000_000.25  # a writer's mtime far from any upload time, exact in binary


@pytest.fixture
async def env(tmp_path: Path):
    e = Env(tmp_path)
    e.inner.put_object("clean.txt", b"abc", mtime=1_700_000_000)
    await e.wb.start()
    try:
        yield e
    finally:
        await e.wb.stop()


def stored_mtime(env: Env, key: str) -> float | None:
    return metadata_mtime(env.inner._objects[key].metadata)


async def test_an_upload_carries_the_mtime_of_the_last_write_and_the_view_keeps_it(env: Env) -> None:
    env.clock.advance(1)
    await create(env.fs, "new.bin", b"hello")
    shown = (await lookup(env.fs, "new.bin")).mtime_ns / 1e9
    await env.flush()
    assert stored_mtime(env, "new.bin") == pytest.approx(shown, abs=1e-6)
    env.clock.advance(TTL + 1)  # listed again: the same version keeps the mtime shown for it
    assert (await lookup(env.fs, "new.bin")).mtime_ns / 1e9 == pytest.approx(shown, abs=1e-6)


async def test_utimens_on_a_file_only_in_the_store_is_a_copy_onto_itself(env: Env) -> None:
    attrs = await lookup(env.fs, "clean.txt")
    copies = env.inner.stats.copy_requests
    after = await env.fs.setattr(attrs.inode, mtime=SET_MTIME)
    assert after.mtime_ns == int(SET_MTIME * 1e9)
    assert env.inner.stats.copy_requests == copies + 1  # no upload of the bytes: a server-side copy
    assert stored_mtime(env, "clean.txt") == SET_MTIME and env.obj("clean.txt") == b"abc"
    env.clock.advance(TTL + 1)
    assert (await lookup(env.fs, "clean.txt")).mtime_ns == int(SET_MTIME * 1e9)
    await env.fs.setattr(attrs.inode, mtime=SET_MTIME)  # the same again: nothing to send
    assert env.inner.stats.copy_requests == copies + 1


async def test_utimens_after_close_is_journaled_and_uploaded_with_the_bytes(env: Env) -> None:
    await create(env.fs, "staged.bin", b"data")
    attrs = await lookup(env.fs, "staged.bin")
    await env.fs.setattr(attrs.inode, mtime=SET_MTIME)  # rsync -t: write, close, then utimes
    await env.flush()
    assert stored_mtime(env, "staged.bin") == SET_MTIME and env.obj("staged.bin") == b"data"
    env.clock.advance(TTL + 1)
    assert (await names(env.fs))["staged.bin"].mtime_ns == int(SET_MTIME * 1e9)  # type: ignore[attr-defined]


async def test_utimens_on_an_open_file_goes_with_its_close(env: Env) -> None:
    fh = await create(env.fs, "cp.bin", b"copied", close=False)
    attrs = await lookup(env.fs, "cp.bin")
    await env.fs.setattr(attrs.inode, mtime=SET_MTIME, fh=fh)  # cp -p: futimens before close
    await env.fs.flush(fh)
    env.fs.release(fh)
    await env.flush()
    assert stored_mtime(env, "cp.bin") == SET_MTIME


async def test_a_rename_keeps_the_mtime(env: Env) -> None:
    attrs = await lookup(env.fs, "clean.txt")
    await env.fs.setattr(attrs.inode, mtime=SET_MTIME)
    await env.fs.rename(ROOT_INODE, b"clean.txt", ROOT_INODE, b"moved.txt", 0)
    await env.flush()
    assert stored_mtime(env, "moved.txt") == SET_MTIME
    assert (await lookup(env.fs, "moved.txt")).mtime_ns == int(SET_MTIME * 1e9)


@pytest.mark.parametrize("value, shown", [
    ("1500000000.123456789", 1_500_000_000.123456789),  # rclone
    ("1500000000", 1_500_000_000.0),  # s3fs-fuse
])
async def test_mtime_from_metadata_shows_what_rclone_and_s3fs_wrote(env: Env, value: str, shown: float) -> None:
    env.inner.put_object("other.bin", b"x", mtime=1_700_000_000, metadata={"mtime": value})
    assert (await lookup(env.fs, "other.bin")).mtime_ns == 1_700_000_000 * 10**9  # default: LastModified
    reader = CacheFS(env.store, env.cache, FsSettings(attr_ttl_s=TTL, dir_ttl_s=TTL, read_only=True,
                                                      mtime_from_metadata=True), clock=env.clock)
    heads = env.inner.stats.head_requests
    assert (await lookup(reader, "other.bin")).mtime_ns / 1e9 == pytest.approx(shown, abs=1e-6)
    assert (await lookup(reader, "clean.txt")).mtime_ns == 1_700_000_000 * 10**9  # no metadata
    assert env.inner.stats.head_requests == heads + 2  # one per file of the listing
    env.clock.advance(TTL + 1)
    assert (await lookup(reader, "other.bin")).mtime_ns / 1e9 == pytest.approx(shown, abs=1e-6)
    assert env.inner.stats.head_requests == heads + 2  # the same versions: not HEADed again


async def test_a_journaled_mtime_is_uploaded_by_the_next_mount(tmp_path: Path) -> None:
    """The mtime is in the journal record: a mount that stopped (or died) before the upload leaves
    it to the next one, which uploads the file with it."""
    first = Env(tmp_path, upload_delay_s=600)
    await first.wb.start()
    await create(first.fs, "later.bin", b"not uploaded yet")
    await first.fs.setattr((await lookup(first.fs, "later.bin")).inode, mtime=SET_MTIME)
    await first.wb.stop()
    assert "later.bin" not in first.keys()
    second = Env(tmp_path, store=first.inner)
    await second.wb.start()
    try:
        await second.flush()
        assert stored_mtime(second, "later.bin") == SET_MTIME
        assert (await lookup(second.fs, "later.bin")).mtime_ns == int(SET_MTIME * 1e9)
    finally:
        await second.wb.stop()
