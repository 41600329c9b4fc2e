"""CacheFS: a file unlinked, or replaced or moved by a rename, while a handle holds it open.

POSIX: the handle keeps referring to the file it opened, whatever happens to its name. Over an object
store the name is the object, so the content a handle may still need is kept before the object goes:
copied into staging (through the block cache) by the unlink or rename. Every test runs with an
upload delay of 0, so the store's DELETE or PUT of the name lands before the handle's next request,
and every object spans several blocks none of which is cached when the name goes.
"""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path

import pytest

from cachefs.fs import filesystem, keep
from cachefs.fs.errors import FsError
from cachefs.fs.inodes import ROOT_INODE
from tests.unit.test_fs_writes import BS, RW, Env, create, lookup, read_path
from tiering.errors import ObjectChangedError, ObjectNotFoundError
from tiering.writeback import WriteBackSettings

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
    monkeypatch.setattr(keep, "KEEP_FOR_READERS_MAX_BYTES", SIZE - 1)
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
    monkeypatch.setattr(keep, "KEEP_FOR_READERS_MAX_BYTES", SIZE - 1)
    fh = await open_path(env, "victim", os.O_RDONLY)
    await replace_by_rename(env, "stored")
    with pytest.raises(ObjectChangedError):
        await env.fs.read(fh, 0, BS)
    env.fs.release(fh)


# ------------------------------------------------------------------- opens racing a rename or an unlink
# The kernel resolves a path (from its dentry cache, or with a LOOKUP), then sends OPEN for the inode it
# found. An OPEN of a file whose name went in between answers ESTALE; the kernel then retries the open
# once (LOOKUP_REVAL): the same thread looks the name up again and opens what that lookup answered. A
# second rename landing between that lookup and that open must not fail it again: no third try comes,
# and the application would see ESTALE from open(2) of a name that always existed.
THREAD = 4242  # the FUSE header's pid of the opening thread
# ... or 0, where the kernel cannot name the thread in the daemon's pid namespace (another container)
THREADS = pytest.mark.parametrize("thread", [THREAD, 0], ids=["thread", "unknown-thread"])


async def stale_first_open(env: Env, path: str, thread: int = THREAD) -> None:
    """The first attempt: ``path`` resolved, then replaced by a rename, then the OPEN arrives: ESTALE."""
    attrs = await lookup(env.fs, path)
    await create(env.fs, "first", b"the first replacement")
    await env.fs.rename(ROOT_INODE, b"first", ROOT_INODE, path.encode(), 0)
    with pytest.raises(FsError) as stale:
        await env.fs.open(attrs.inode, os.O_RDONLY, caller=thread)
    assert stale.value.errno == errno.ESTALE


@THREADS
@pytest.mark.parametrize("looked_up", ["uploaded", "staged"])
@pytest.mark.parametrize("second", ["staged", "stored", "unlink"])
async def test_a_retried_open_reads_the_version_its_lookup_found_whatever_lands_before_it(
        env: Env, looked_up: str, second: str, thread: int) -> None:
    """The retry's lookup answers the first replacement; a second rename over the name (of a file
    staged through the mount, or of one only in the store: a server-side copy), or an unlink, lands
    before the retry's OPEN: the OPEN opens the version its lookup found, and reads it whole."""
    if looked_up == "staged":  # the first replacement is not uploaded when it is replaced in turn
        env.wb.settings = WriteBackSettings(upload_delay_s=600, space_wait_s=0.5)
    await stale_first_open(env, "victim", thread)
    if looked_up == "uploaded":
        await env.flush()
        assert env.obj("victim") == b"the first replacement"
    retried = await env.fs.lookup(ROOT_INODE, b"victim", caller=thread)
    if second == "unlink":
        await env.fs.unlink(ROOT_INODE, b"victim")
    else:
        await replace_by_rename(env, second)
    env.wb.settings = WriteBackSettings(upload_delay_s=0, space_wait_s=0.5)
    env.wb.poke()
    await env.flush()  # the store holds the second version (or nothing) at the name now
    fh, keep_cache = await env.fs.open(retried.inode, os.O_RDONLY, caller=thread)
    assert not keep_cache
    assert await env.fs.read(fh, 0, SIZE + 10) == b"the first replacement"
    assert env.fs.stats.retried_opens_kept == 1
    kept = env.fs.inodes.get(retried.inode).staged
    assert kept is not None and kept.key is None  # detached: nothing uploads it
    env.fs.release(fh)
    assert kept.disposed  # and it went with the handle


@THREADS
async def test_a_retried_lookup_waits_for_a_rename_of_its_name_under_way(env: Env, thread: int) -> None:
    """The retry's LOOKUP arrives while a rename over the name runs (past the point where it decides
    what to keep): it answers once the rename is done, with the file the rename left there, and the
    OPEN that follows reads it."""
    await stale_first_open(env, "victim", thread)
    await env.flush()
    env.store.write_delay_s = 0.2  # the server-side copy of "stored" over "victim" takes a while
    renaming = asyncio.create_task(env.fs.rename(ROOT_INODE, b"stored", ROOT_INODE, b"victim", 0))
    node = env.fs.inodes.at("victim")
    for _ in range(100):
        await asyncio.sleep(0.01)
        if node.losing_name is not None:
            break
    assert node.losing_name is not None and not renaming.done()
    retried = await env.fs.lookup(ROOT_INODE, b"victim", caller=thread)
    assert renaming.done() and retried.inode != node.inode
    env.store.write_delay_s = 0
    fh, _ = await env.fs.open(retried.inode, os.O_RDONLY, caller=thread)
    assert await env.fs.read(fh, 0, SIZE + 10) == env.obj("victim") == env.inner._objects["victim"].data
    env.fs.release(fh)


async def test_lookups_after_no_stale_open_keep_nothing(env: Env) -> None:
    """Only the retry of an open answered ESTALE is waited for: a file another thread (or the same
    one, later) merely looked up is not copied in when a rename replaces it, nor one an unknown
    thread looked up under a name that was answered no ESTALE."""
    await stale_first_open(env, "victim")
    fh, _ = await env.fs.open((await lookup(env.fs, "stored")).inode, os.O_RDONLY, caller=THREAD)
    env.fs.release(fh)  # the thread's next open: its retry is over
    await env.flush()
    await env.fs.lookup(ROOT_INODE, b"victim", caller=THREAD)
    await env.fs.lookup(ROOT_INODE, b"victim", caller=THREAD + 1)
    await env.fs.lookup(ROOT_INODE, b"victim", caller=0)
    gets = env.inner.stats.get_requests
    await replace_by_rename(env, "staged")
    assert env.inner.stats.get_requests == gets
    assert env.fs.stats.retried_opens_kept == 0


@pytest.mark.parametrize(("end", "thread"), [("forget", THREAD), ("expiry", THREAD), ("other open", THREAD),
                                             ("forget", 0), ("expiry", 0)])
async def test_a_kept_version_goes_when_the_retry_cannot_open_it_any_more(env: Env, end: str, thread: int) -> None:
    """The version kept for a retry whose OPEN never came is dropped when the kernel forgets the
    inode (it can open it no more), when the retry's window passes, or at the thread's next open."""
    await stale_first_open(env, "victim", thread)
    await env.flush()
    retried = await env.fs.lookup(ROOT_INODE, b"victim", caller=thread)
    await replace_by_rename(env, "stored")
    kept = env.fs.inodes.get(retried.inode).staged
    assert kept is not None and kept.key is None and not kept.disposed
    if end == "forget":
        env.fs.forget(retried.inode, env.fs.inodes.get(retried.inode).lookups)  # every reference it had
    elif end == "expiry":
        env.clock.advance(filesystem.RETRY_OPEN_WINDOW_S + 1)
        await env.fs.lookup(ROOT_INODE, b"victim", caller=THREAD)  # any later lookup prunes it
    else:
        fh, _ = await env.fs.open((await lookup(env.fs, "victim")).inode, os.O_RDONLY, caller=THREAD)
        env.fs.release(fh)
    assert kept.disposed


async def test_unknown_threads_retrying_one_name_at_once_each_open_the_version_their_lookup_found(env: Env) -> None:
    """Two threads the kernel cannot name (pid 0) are answered ESTALE for the same name; both retries
    look it up, a rename replaces it again, and the two OPENs come one after the other, the first
    descriptor closed before the second OPEN: each reads the version its lookup found."""
    attrs = await lookup(env.fs, "victim")
    await create(env.fs, "first", b"the first replacement")
    await env.fs.rename(ROOT_INODE, b"first", ROOT_INODE, b"victim", 0)
    for _ in range(2):
        with pytest.raises(FsError) as stale:
            await env.fs.open(attrs.inode, os.O_RDONLY, caller=0)
        assert stale.value.errno == errno.ESTALE
    await env.flush()
    retried = [await env.fs.lookup(ROOT_INODE, b"victim", caller=0) for _ in range(2)]
    assert retried[0].inode == retried[1].inode
    await replace_by_rename(env, "stored")
    await env.flush()
    for _ in range(2):
        fh, _ = await env.fs.open(retried[0].inode, os.O_RDONLY, caller=0)
        assert await env.fs.read(fh, 0, SIZE + 10) == b"the first replacement"
        env.fs.release(fh)
    assert env.fs.stats.retried_opens_kept == 2 and env.fs.inodes.get(retried[0].inode).awaited_opens == 0


async def test_a_retried_open_of_a_version_too_large_to_keep_answers_estale_and_is_counted(env: Env, monkeypatch) -> None:
    """The bound of what is kept for readers holds for a retry too (documented): a version only in the
    store, over ``KEEP_FOR_READERS_MAX_BYTES``, replaced between the retry's lookup and its OPEN is
    not copied in, and the OPEN answers ESTALE, counted in ``retried_opens_stale``."""
    monkeypatch.setattr(keep, "KEEP_FOR_READERS_MAX_BYTES", SIZE - 1)
    attrs = await lookup(env.fs, "victim")
    await env.fs.unlink(ROOT_INODE, b"victim")
    await env.fs.rename(ROOT_INODE, b"stored", ROOT_INODE, b"victim", 0)  # SIZE bytes, only in the store
    with pytest.raises(FsError):
        await env.fs.open(attrs.inode, os.O_RDONLY, caller=THREAD)
    retried = await env.fs.lookup(ROOT_INODE, b"victim", caller=THREAD)
    gets = env.inner.stats.get_requests
    await replace_by_rename(env, "staged")
    assert env.inner.stats.get_requests == gets
    await env.flush()
    with pytest.raises(FsError) as stale:
        await env.fs.open(retried.inode, os.O_RDONLY, caller=THREAD)
    assert stale.value.errno == errno.ESTALE
    assert (env.fs.stats.stale_opens, env.fs.stats.retried_opens_stale, env.fs.stats.retried_opens_kept) == (1, 1, 0)
