"""What only ``LocalObjectStore`` has to get right: staying inside its root, and stat-based ETags.

The shared behaviour (listing, markers, ranges, ETag checks) is in ``tests/contract``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tiering.errors import AccessDeniedError, ObjectChangedError, ObjectNotFoundError
from tiering.objectstore import LocalObjectStore


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "dir").mkdir(parents=True)
    (root / "dir" / "file").write_bytes(b"inside")
    (tmp_path / "secret").write_bytes(b"outside")
    (tmp_path / "outside-dir").mkdir()
    (tmp_path / "outside-dir" / "x").write_bytes(b"outside")
    return root


@pytest.mark.parametrize("key", [
    "../secret", "dir/../../secret", "/etc/passwd", "dir//file", "./dir/file", "dir/./file",
    "dir/file\x00", "", "dir/",
])
async def test_keys_that_could_escape_or_alias_are_not_found(tree: Path, key: str) -> None:
    store = LocalObjectStore(tree)
    with pytest.raises(ObjectNotFoundError):
        await store.head(key)
    with pytest.raises(ObjectNotFoundError):
        await store.get_range(key, '"x"', 0, 10)


async def test_symlinks_out_of_the_root_are_invisible(tree: Path) -> None:
    (tree / "link-file").symlink_to(tree.parent / "secret")
    (tree / "link-dir").symlink_to(tree.parent / "outside-dir")
    (tree / "dangling").symlink_to(tree / "nowhere")
    store = LocalObjectStore(tree)
    listing = await store.list_dir("")
    assert set(listing.files) == set() and listing.dirs == {"dir"}
    for key in ("link-file", "link-dir/x", "dangling"):
        with pytest.raises(ObjectNotFoundError):
            await store.head(key)
    assert (await store.list_dir("link-dir/")).files == {}


async def test_symlinks_inside_the_root_are_followed(tree: Path) -> None:
    (tree / "alias").symlink_to(tree / "dir" / "file")
    (tree / "alias-dir").symlink_to(tree / "dir")
    store = LocalObjectStore(tree)
    listing = await store.list_dir("")
    assert set(listing.files) == {"alias"} and listing.dirs == {"dir", "alias-dir"}
    info = await store.head("alias")
    assert await store.get_range("alias", info.etag, 0, 100) == b"inside"
    assert set((await store.list_dir("alias-dir/")).files) == {"file"}


async def test_root_reached_through_a_symlink(tree: Path, tmp_path: Path) -> None:
    (tmp_path / "root-link").symlink_to(tree)
    store = LocalObjectStore(tmp_path / "root-link")
    await store.check()
    info = await store.head("dir/file")
    assert await store.get_range("dir/file", info.etag, 0, 6) == b"inside"


async def test_rewrite_in_place_with_the_old_mtime_still_changes_the_etag(tree: Path) -> None:
    path = tree / "dir" / "file"
    store = LocalObjectStore(tree)
    old = await store.head("dir/file")
    st = os.stat(path)
    with open(path, "r+b") as f:  # same size, same inode, other bytes
        f.write(b"INSIDE")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # as cp -p / rsync -t would
    new = await store.head("dir/file")
    assert (new.size, new.mtime) == (old.size, old.mtime)
    assert new.etag != old.etag  # ctime moved
    with pytest.raises(ObjectChangedError):
        await store.get_range("dir/file", old.etag, 0, 6)


async def test_fifos_and_sockets_are_not_objects(tree: Path) -> None:
    os.mkfifo(tree / "fifo")
    store = LocalObjectStore(tree)
    assert "fifo" not in (await store.list_dir("")).files
    with pytest.raises(ObjectNotFoundError):
        await store.head("fifo")


async def test_check_missing_root_or_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ObjectNotFoundError, match="does not exist"):
        await LocalObjectStore(tmp_path / "missing").check()
    (tmp_path / "plain").write_bytes(b"")
    with pytest.raises(ObjectNotFoundError, match="not a directory"):
        await LocalObjectStore(tmp_path / "plain").check()


@pytest.mark.skipif(os.geteuid() == 0, reason="root can read any directory")
async def test_check_unreadable_root(tmp_path: Path) -> None:
    root = tmp_path / "locked"
    root.mkdir()
    root.chmod(0)
    try:
        with pytest.raises(AccessDeniedError):
            await LocalObjectStore(root).check()
    finally:
        root.chmod(0o700)
