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
from tiering.engine.blockcache import BlockCache
from tiering.clock import FakeClock
from tiering.errors import ObjectChangedError
from tiering.objectstore.memory import InMemoryObjectStore
from tiering.tiers.ram import RamTier
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


def _import(tmp_path: Path, lines: list[str]) -> list[tuple[str, object]]:
    """The (path, size or None) entries the index of ``lines`` holds, walked from the root."""
    manifest = tmp_path / "m.jsonl"
    manifest.write_bytes(("\n".join(lines) + "\n").encode("utf-8", "surrogatepass"))
    index = open_manifest_index(manifest, tmp_path)
    found: list[tuple[str, object]] = []
    todo = [""]
    while todo:
        directory = todo.pop()
        listing = index.load(directory)
        assert listing is not None
        for name, entry in listing[1].items():
            path = f"{directory}/{name}" if directory else name
            found.append((path, None if entry is None else entry.size))
            if entry is None:
                todo.append(path)
    assert index.total_entries == len(found)
    index.close()
    return sorted(found)


@pytest.mark.parametrize(("line", "path"), [
    ('  {"etag": "e", "path": "lead", "size": 1}', "lead"),             # whitespace around the object
    ('{"etag": "e", "path": "trail", "size": 1}  ', "trail"),
    ('{"path": "keys/any/order", "size": 2, "etag": "e", "more": [1]}', "keys/any/order"),
    ('{"etag": "e", "path": "d\\u00e9j\\u00e0/\\u00e9t\\u00e9.jpg", "size": 1}', "déjà/été.jpg"),  # not ASCII
    ('{"etag": "e", "path": "' + "\u00e9" * 127 + '", "size": 1}', "\u00e9" * 127),  # 254 bytes: fits
    ('{"etag": "e", "path": "' + "n" * 255 + '", "size": 1}', "n" * 255),
])
def test_lines_off_the_fast_path_are_accepted_by_the_full_checks(tmp_path: Path, line: str, path: str) -> None:
    entries = _import(tmp_path, [line])
    assert (path, 1 if path != "keys/any/order" else 2) in entries


@pytest.mark.parametrize(("line", "words"), [
    ('{"etag": "e", "path": "' + "\u00e9" * 128 + '", "size": 1}', "longer than 255 bytes"),  # 256 bytes
    ('{"etag": "e", "path": "' + "n" * 256 + '", "size": 1}', "longer than 255 bytes"),
    ('{"etag": "e", "path": "a\\u0000b", "size": 1}', "NUL"),
    ('{"etag": "e", "path": "a//b", "size": 1}', "empty"),
    ('{"etag": "e", "path": "a/", "size": 1}', "empty"),
    ('{"etag": "e", "path": "a/./b", "size": 1}', "'.' or '..'"),
    ('{"etag": "", "path": "a", "size": 1}', "etag"),
    ('{"etag": "e", "path": "a", "size": true}', "size"),
    ('{"etag": "e", "path": "a", "size": 1.0}', "size"),
    ('{"etag": "e", "path": "", "size": 1}', "path"),
    ('{"etag": "e", "path": "a", "size": 1} {"etag": "e", "path": "b", "size": 1}', "invalid JSON"),
    ('{"etag": "e", "path": "a", "size": 1, "x": ' + "[" * 10_000 + "]" * 10_000 + "}", "invalid JSON"),
    # Nested past the line bound (issue 24, item 9): refused before any parsing.
    ('{"etag": "e", "path": "a", "size": 1, "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "longer than 65536 bytes"),
    ('{"etag": "e", "path": "a\\ud800", "size": 1}', "no character"),  # a lone surrogate: no UTF-8 name
    ('["etag", "path", "size"]', "needs a JSON line"),  # not starting with "{": a plain path line
    ('{"etag": "e", "path": ["a"], "size": 1}', "non-empty string"),
])
def test_lines_off_the_fast_path_are_refused_with_their_line(tmp_path: Path, line: str, words: str) -> None:
    good = '{"etag": "e", "path": "ok/file", "size": 1}'
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(f"{good}\n{line}\n")
    with pytest.raises(ManifestError) as refused:
        open_manifest_index(manifest, tmp_path)
    assert "line 2:" in str(refused.value) and words in str(refused.value)
    assert list(tmp_path.glob("manifest-*")) == []


def test_a_duplicate_in_a_later_batch_names_its_line(tmp_path: Path) -> None:
    from cachefs.fs.metaindex import BULK_BATCH
    lines = [f'{{"etag": "e", "path": "d{i % 3}/f{i}", "size": 1}}' for i in range(BULK_BATCH + 50)]
    lines.insert(BULK_BATCH + 20, '{"etag": "e", "path": "d1/f7", "size": 2}')
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    with pytest.raises(ManifestError, match=f"line {BULK_BATCH + 21}: 'f7' is given twice"):
        open_manifest_index(manifest, tmp_path)
    assert list(tmp_path.glob("manifest-*")) == []


def test_an_index_without_its_complete_marker_is_imported_again(tmp_path: Path, store: InMemoryObjectStore) -> None:
    manifest = write_manifest(tmp_path, store)
    open_manifest_index(manifest, tmp_path).close()
    (built,) = tmp_path.glob("manifest-*.db")
    import sqlite3
    with sqlite3.connect(built) as conn:  # as if a crash had left an index that never got its marker
        conn.execute("DELETE FROM meta WHERE key = 'manifest'")
        conn.execute("DELETE FROM entries WHERE name = 'README'")
    conn.close()
    (tmp_path / f"{built.name}.tmp").write_bytes(b"half an import")  # and a temporary file of a crash
    index = open_manifest_index(manifest, tmp_path)
    assert index.total_entries == 7 and index.lookup("", "README") is not None
    assert [p.name for p in tmp_path.glob("manifest-*.db")] == [built.name]
    assert list(tmp_path.glob("manifest-*.tmp*")) == []
    index.close()


def test_a_remount_of_the_same_file_does_not_read_it_again(tmp_path: Path, store: InMemoryObjectStore,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import cachefs.fs.pinned as pinned
    manifest = write_manifest(tmp_path, store)
    open_manifest_index(manifest, tmp_path).close()
    hashed: list[Path] = []
    real_digest = pinned.manifest_digest
    monkeypatch.setattr(pinned, "manifest_digest", lambda path: hashed.append(path) or real_digest(path))
    index = open_manifest_index(manifest, tmp_path)  # same inode, size, mtime, ctime: not hashed
    assert index.total_entries == 7 and hashed == []
    index.close()
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(manifest.read_bytes())  # the same bytes in another file: hashed, index reused
    index = open_manifest_index(copy, tmp_path)
    assert index.total_entries == 7 and hashed == [copy]
    index.close()
    os.utime(manifest, ns=(manifest.stat().st_atime_ns, manifest.stat().st_mtime_ns))  # ctime moves
    open_manifest_index(manifest, tmp_path).close()
    assert hashed == [copy, manifest]
