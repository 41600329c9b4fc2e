"""Mounts pinned to a manifest (cachefs.fs.pinned) without FUSE: namespace, no LISTs, ESTALE, bad lines."""

from __future__ import annotations

import errno
import gzip
import os
from pathlib import Path

import pytest

from cachefs.fs.filesystem import CacheFS
from cachefs.fs.pinned import open_manifest_index
from cachefs.manifest import ManifestError, format_manifest
from cachefs.settings import FsSettings
from tests.unit.test_fs import BS, RAM_BYTES, listdir, lookup_path
from tiering.blockcache import BlockCache
from tiering.clock import FakeClock
from tiering.errors import ObjectChangedError
from tiering.objectstore.memory import InMemoryObjectStore
from tiering.ram import RamTier
from tiering.settings import CacheSettings

FILES = {"train/0001.jpg": b"one", "train/0002.jpg": b"two!", "val/deep/x.bin": b"x" * 100, "README": b"r"}


@pytest.fixture
def store() -> InMemoryObjectStore:
    s = InMemoryObjectStore()
    s.put_object("not-in-manifest.txt", b"hidden")
    return s


def write_manifest(tmp_path: Path, store: InMemoryObjectStore, *, compress: bool = False) -> Path:
    infos = [store.put_object(key, data) for key, data in FILES.items()]
    text = format_manifest((i.key, i.etag, i.size) for i in infos)
    path = tmp_path / ("m.jsonl.gz" if compress else "m.jsonl")
    path.write_bytes(gzip.compress(text.encode()) if compress else text.encode())
    return path


def pinned_fs(store, manifest: Path, cache_dir: Path) -> CacheFS:
    settings = CacheSettings(block_size=BS, ram_bytes=RAM_BYTES)
    cache = BlockCache(settings, store, RamTier(RAM_BYTES), None)
    index = open_manifest_index(manifest, cache_dir)
    return CacheFS(store, cache, FsSettings(read_only=True), clock=FakeClock(), index=index, pinned=True)


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
async def test_the_namespace_comes_from_the_manifest_with_no_list(tmp_path: Path, store: InMemoryObjectStore,
                                                                  compress: bool) -> None:
    manifest = write_manifest(tmp_path, store, compress=compress)
    fs = pinned_fs(store, manifest, tmp_path)
    assert set(await listdir(fs, 1)) == {"train", "val", "README"}
    train = await lookup_path(fs, "train")
    assert set(await listdir(fs, train.inode)) == {"0001.jpg", "0002.jpg"}
    attrs = await lookup_path(fs, "val/deep/x.bin")
    assert attrs.size == 100 and attrs.mtime_ns == int(manifest.stat().st_mtime * 1e9)
    fh, _ = await fs.open(attrs.inode, os.O_RDONLY)
    assert bytes(await fs.read(fh, 0, 200)) == b"x" * 100
    with pytest.raises(Exception) as missing:
        await lookup_path(fs, "not-in-manifest.txt")
    assert getattr(missing.value, "errno", None) == errno.ENOENT
    assert store.stats.list_requests == 0


async def test_a_changed_object_is_estale_never_other_bytes(tmp_path: Path, store: InMemoryObjectStore) -> None:
    manifest = write_manifest(tmp_path, store)
    fs = pinned_fs(store, manifest, tmp_path)
    store.put_object("train/0002.jpg", b"TWO!")  # same size, other bytes, other ETag
    attrs = await lookup_path(fs, "train/0002.jpg")
    fh, _ = await fs.open(attrs.inode, os.O_RDONLY)
    with pytest.raises(ObjectChangedError) as changed:
        await fs.read(fh, 0, 4)
    assert changed.value.errno == errno.ESTALE and "train/0002.jpg" in str(changed.value)


def test_the_same_manifest_reuses_its_index(tmp_path: Path, store: InMemoryObjectStore) -> None:
    manifest = write_manifest(tmp_path, store)
    first = open_manifest_index(manifest, tmp_path)
    first.close()
    built = sorted(p.name for p in tmp_path.glob("manifest-*"))
    stamp = (tmp_path / built[0]).stat().st_mtime_ns
    second = open_manifest_index(manifest, tmp_path)
    assert second.total_entries == first.total_entries == 7  # 4 files, 3 directories
    assert (tmp_path / built[0]).stat().st_mtime_ns == stamp
    manifest.write_text('{"etag": "e", "path": "only", "size": 1}\n')
    third = open_manifest_index(manifest, tmp_path)  # another manifest: the old index is replaced
    assert third.total_entries == 1 and len(list(tmp_path.glob("manifest-*.db"))) == 1


@pytest.mark.parametrize(("lines", "line", "words"), [
    (['{"etag": "e", "path": "a", "size": 1}', "{not json"], 2, "invalid JSON"),
    (['{"etag": "e", "path": "a", "size": 1}', "", "plain/path.txt"], 3, "needs a JSON line"),
    (['{"path": "a", "size": 1}'], 1, "needs a JSON line"),
    (['{"etag": "e", "path": "a", "size": -1}'], 1, "size"),
    (['{"etag": "e", "path": "../up", "size": 1}'], 1, "'.' or '..'"),
    (['{"etag": "e", "path": "/abs", "size": 1}'], 1, "relative"),
    (['{"etag": "e", "path": "a", "size": 1}', '{"etag": "e", "path": "a", "size": 1}'], 2, "twice"),
    (['{"etag": "e", "path": "a", "size": 1}', '{"etag": "e", "path": "a/b", "size": 1}'], 2, "directory"),
])
def test_a_bad_line_is_one_line_naming_it_and_nothing_is_left(tmp_path: Path, lines: list[str], line: int,
                                                                 words: str) -> None:
    manifest = tmp_path / "bad.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    cache = tmp_path / "cache"
    cache.mkdir()
    with pytest.raises(ManifestError) as refused:
        open_manifest_index(manifest, cache)
    message = str(refused.value)
    assert f"line {line}:" in message and words in message and "\n" not in message
    assert list(cache.iterdir()) == []


def test_compressed_forms(tmp_path: Path) -> None:
    zst = tmp_path / "m.jsonl.zst"
    zst.write_bytes(b"\x28\xb5\x2f\xfd" + b"\x00" * 20)
    with pytest.raises(ManifestError, match="zstd"):
        open_manifest_index(zst, tmp_path)
    broken = tmp_path / "m.jsonl.gz"
    broken.write_bytes(gzip.compress(b'{"etag": "e", "path": "a", "size": 1}\n' * 1000)[:-30])
    with pytest.raises(ManifestError, match="cannot decompress"):
        open_manifest_index(broken, tmp_path)
