"""The ``ObjectStore`` contract, run on every implementation.

The same test bodies run on ``InMemoryObjectStore``, ``LocalObjectStore`` over a temporary
directory, and ``S3ObjectStore`` against moto and against SeaweedFS, so the double the unit tests
use means what the real stores do. Each backend is driven through a small ``Backend`` adapter that
writes objects the way that store's users would (S3 PUTs, files written to a temporary name and
renamed into place, dict inserts).

The local and S3 stores are opened on a root prefix (``ds/``) inside their bucket or directory, so
every case also checks that keys are relative to that root and that nothing beside it leaks in.
The in-memory store has no root prefix; the one case about objects outside the root skips it.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable, Iterable

import pytest

from tiering.errors import ObjectChangedError, ObjectNotFoundError
from tiering.objectstore import InMemoryObjectStore, LocalObjectStore, S3ObjectStore
from tiering.protocols import ObjectStore

ROOT = "ds/"  # the prefix the local and S3 stores are opened on
# Keys in the pagination case: more than two full ListObjectsV2 pages (1,000 entries each), with
# subdirectories among the files so continuation runs through CommonPrefixes too.
PAGINATED_FILES = 2_100
PAGINATED_DIRS = 60
# The large-directory case (in-memory and local stores only: uploading 100,000 objects to moto or
# SeaweedFS takes minutes on 2 cores, ~7 ms a PUT; the paging logic is covered above).
LARGE_DIR_ENTRIES = 100_000
# Timeouts for the S3 stores in these tests: loopback servers answer in milliseconds.
CONNECT_TIMEOUT_S = 2.0
READ_TIMEOUT_S = 10.0


@dataclass
class Backend:
    """How to write objects into one store's backing storage and open the store on it."""

    name: str
    open: Callable[[], ObjectStore]
    put: Callable[[str, bytes], None]  # key relative to the store's root; "x/" makes a marker
    put_many: Callable[[Iterable[tuple[str, bytes]]], None]
    delete: Callable[[str], None]
    put_outside: Callable[[str, bytes], None] | None  # key relative to the bucket/dir, beside ROOT
    is_s3: bool = False


def _memory_backend() -> Backend:
    store = InMemoryObjectStore()

    def put_many(items: Iterable[tuple[str, bytes]]) -> None:
        for key, data in items:
            store.put_object(key, data)

    return Backend("memory", lambda: store, store.put_object, put_many, store.delete_object, None)


def _local_backend(base: Path) -> Backend:
    bucket = base / "bucket"
    (bucket / ROOT).mkdir(parents=True)

    def write(path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # a new inode, as any careful writer (and S3) gives a new version

    def put_rel(base_dir: Path, key: str, data: bytes) -> None:
        if key.endswith("/"):
            (base_dir / key).mkdir(parents=True, exist_ok=True)  # a directory is the local "marker"
        else:
            write(base_dir / key, data)

    def put_many(items: Iterable[tuple[str, bytes]]) -> None:
        made: set[Path] = set()  # new files in bulk: create each directory once, write in place
        for key, data in items:
            path = bucket / ROOT / key
            if path.parent not in made:
                path.parent.mkdir(parents=True, exist_ok=True)
                made.add(path.parent)
            with open(path, "wb") as f:
                f.write(data)

    return Backend(
        "local",
        lambda: LocalObjectStore(bucket / ROOT),
        lambda key, data: put_rel(bucket / ROOT, key, data),
        put_many,
        lambda key: (bucket / ROOT / key).unlink(),
        lambda key, data: put_rel(bucket, key, data),
    )


def _s3_backend(name: str, server, bucket: str) -> Backend:
    def open_store() -> ObjectStore:
        return S3ObjectStore(
            bucket, ROOT,
            endpoint_url=server.endpoint_url,
            connect_timeout_s=CONNECT_TIMEOUT_S,
            read_timeout_s=READ_TIMEOUT_S,
            environ=server.env(),
        )

    return Backend(
        name,
        open_store,
        lambda key, data: server.put(bucket, ROOT + key, data),
        lambda items: server.put_many(bucket, ((ROOT + k, d) for k, d in items)),
        lambda key: server.delete(bucket, ROOT + key),
        lambda key, data: server.put(bucket, key, data),
        is_s3=True,
    )


@pytest.fixture(params=[
    "memory",
    "local",
    pytest.param("moto", marks=pytest.mark.s3),
    pytest.param("seaweed", marks=pytest.mark.s3),
])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "memory":
        return _memory_backend()
    if request.param == "local":
        return _local_backend(tmp_path)
    bucket = request.getfixturevalue(f"{request.param}_bucket")
    return _s3_backend(request.param, request.getfixturevalue(request.param), bucket)


@pytest.fixture
async def store(backend: Backend) -> AsyncIterator[ObjectStore]:
    s = backend.open()
    assert isinstance(s, ObjectStore)
    try:
        yield s
    finally:
        await s.close()


# -- listing ------------------------------------------------------------------------------------------


async def test_list_root_and_nested_dirs(backend: Backend, store: ObjectStore) -> None:
    backend.put("top.txt", b"top")
    backend.put("a/one", b"1")
    backend.put("a/b/two", b"22")
    backend.put("c/d/e/three", b"333")
    backend.put("odd name ü+%&.txt", b"odd")

    root = await store.list_dir("")
    assert set(root.files) == {"top.txt", "odd name ü+%&.txt"}
    assert root.dirs == {"a", "c"}
    assert root.files["top.txt"].key == "top.txt"
    assert root.files["top.txt"].size == 3

    a = await store.list_dir("a/")
    assert set(a.files) == {"one"} and a.dirs == {"b"}
    info = a.files["one"]
    assert info.key == "a/one" and info.size == 1
    assert info.etag == (await store.head("a/one")).etag

    assert (await store.list_dir("c/")).dirs == {"d"}
    deep = await store.list_dir("c/d/e/")
    assert set(deep.files) == {"three"} and deep.dirs == set()
    assert deep.files["three"].key == "c/d/e/three"

    nothing = await store.list_dir("no-such-dir/")
    assert nothing.files == {} and nothing.dirs == set()


async def test_listing_prefix_must_be_a_directory(store: ObjectStore) -> None:
    with pytest.raises(ValueError):
        await store.list_dir("a")


async def test_marker_alone_makes_an_empty_directory(backend: Backend, store: ObjectStore) -> None:
    backend.put("empty/", b"")
    root = await store.list_dir("")
    assert root.dirs == {"empty"}
    assert root.files == {}
    inside = await store.list_dir("empty/")
    assert inside.files == {} and inside.dirs == set()


async def test_marker_next_to_files(backend: Backend, store: ObjectStore) -> None:
    backend.put("m/", b"")
    backend.put("m/f", b"data")
    backend.put("m/sub/", b"")
    root = await store.list_dir("")
    assert root.dirs == {"m"} and root.files == {}
    inside = await store.list_dir("m/")
    assert set(inside.files) == {"f"}  # the marker "m/" itself is not a file of its own listing
    assert inside.dirs == {"sub"}


async def test_marker_of_the_store_root_is_not_listed(backend: Backend, store: ObjectStore) -> None:
    if backend.put_outside is None:
        pytest.skip("the in-memory store has no root prefix")
    backend.put_outside(ROOT, b"")  # the bucket's marker object "ds/" (for a directory: it exists)
    backend.put("x", b"x")
    root = await store.list_dir("")
    assert set(root.files) == {"x"} and root.dirs == set()


async def test_objects_outside_the_root_are_invisible(backend: Backend, store: ObjectStore) -> None:
    if backend.put_outside is None:
        pytest.skip("the in-memory store has no root prefix")
    backend.put("inside", b"in")
    backend.put_outside("ds-other/x", b"no")
    backend.put_outside("dsx", b"no")
    backend.put_outside("other/ds/y", b"no")
    backend.put_outside("z-top", b"no")
    root = await store.list_dir("")
    assert set(root.files) == {"inside"} and root.dirs == set()
    for key in ("../ds-other/x", "../dsx", "x", "other/ds/y", "/ds/inside"):
        with pytest.raises(ObjectNotFoundError):
            await store.head(key)


async def test_listing_follows_all_pages(backend: Backend, store: ObjectStore) -> None:
    files = [(f"big/f-{i:05d}", b"") for i in range(PAGINATED_FILES)]
    dirs = [(f"big/d-{i:03d}/x", b"") for i in range(PAGINATED_DIRS)]
    started = time.monotonic()
    backend.put_many(files + dirs)
    upload_s = time.monotonic() - started
    before = store.stats.list_requests
    listing = await store.list_dir("big/")
    assert set(listing.files) == {k.removeprefix("big/") for k, _ in files}
    assert listing.dirs == {f"d-{i:03d}" for i in range(PAGINATED_DIRS)}
    if backend.is_s3:
        assert store.stats.list_requests - before >= 3, "2,160 entries need 3 pages of 1,000"
    print(f"{backend.name}: uploaded {len(files) + len(dirs)} objects in {upload_s:.1f} s")


@pytest.mark.slow
async def test_listing_a_directory_of_100k_entries(backend: Backend, store: ObjectStore) -> None:
    if backend.is_s3:
        pytest.skip("100,000 uploads take minutes on the S3 test servers; paging is covered above")
    backend.put_many((f"huge/{i:06d}", b"") for i in range(LARGE_DIR_ENTRIES))
    listing = await store.list_dir("huge/")
    assert len(listing.files) == LARGE_DIR_ENTRIES
    assert "099999" in listing.files and "000000" in listing.files


# -- head ---------------------------------------------------------------------------------------------


async def test_head(backend: Backend, store: ObjectStore) -> None:
    before = time.time()
    backend.put("a/obj", b"x" * 1234)
    info = await store.head("a/obj")
    assert info.key == "a/obj"
    assert info.size == 1234
    assert info.etag
    # S3 LastModified has one-second resolution; allow for that and for clock skew with the server.
    assert before - 5 <= info.mtime <= time.time() + 5
    listed = (await store.list_dir("a/")).files["obj"]
    assert (listed.size, listed.etag) == (info.size, info.etag)


async def test_head_of_missing_key_or_directory_is_not_found(backend: Backend, store: ObjectStore) -> None:
    backend.put("dir/file", b"f")
    for key in ("missing", "dir", "dir/missing"):
        with pytest.raises(ObjectNotFoundError):
            await store.head(key)


# -- get_range ----------------------------------------------------------------------------------------


async def test_get_range(backend: Backend, store: ObjectStore) -> None:
    data = os.urandom(100_000)
    backend.put("blob", data)
    etag = (await store.head("blob")).etag
    size = len(data)
    assert await store.get_range("blob", etag, 0, size) == data
    assert await store.get_range("blob", etag, 1000, 5000) == data[1000:5000]
    assert await store.get_range("blob", etag, size - 10, size + 1000) == data[-10:]  # end clamped
    assert await store.get_range("blob", etag, 7, 8) == data[7:8]
    assert await store.get_range("blob", etag, 5, 5) == b""
    assert await store.get_range("blob", etag, size, size + 10) == b""  # at EOF
    assert await store.get_range("blob", etag, size + 100, size + 200) == b""  # past EOF


async def test_get_range_of_an_empty_object(backend: Backend, store: ObjectStore) -> None:
    backend.put("empty", b"")
    info = await store.head("empty")
    assert info.size == 0
    assert await store.get_range("empty", info.etag, 0, 4096) == b""


async def test_get_range_refuses_a_changed_object(backend: Backend, store: ObjectStore) -> None:
    backend.put("obj", b"A" * 4096)
    old = (await store.head("obj")).etag
    backend.put("obj", b"B" * 4096)  # same size, other bytes
    new = (await store.head("obj")).etag
    assert new != old
    with pytest.raises(ObjectChangedError):
        await store.get_range("obj", old, 0, 4096)
    with pytest.raises(ObjectChangedError):
        await store.get_range("obj", old, 100, 200)
    assert await store.get_range("obj", new, 0, 4096) == b"B" * 4096


async def test_get_range_of_missing_or_deleted_key(backend: Backend, store: ObjectStore) -> None:
    backend.put("gone", b"bytes")
    etag = (await store.head("gone")).etag
    with pytest.raises(ObjectNotFoundError):
        await store.get_range("never-existed", etag, 0, 5)
    backend.delete("gone")
    with pytest.raises(ObjectNotFoundError):
        await store.get_range("gone", etag, 0, 5)


async def test_concurrent_ranges(backend: Backend, store: ObjectStore) -> None:
    data = os.urandom(256 * 1024)
    backend.put("par", data)
    etag = (await store.head("par")).etag
    step = 16 * 1024
    parts = await asyncio.gather(*(store.get_range("par", etag, s, s + step) for s in range(0, len(data), step)))
    assert b"".join(parts) == data


# -- stats --------------------------------------------------------------------------------------------


async def test_stats_are_counted(backend: Backend, store: ObjectStore) -> None:
    backend.put("s/obj", b"z" * 777)
    stats = store.stats
    start = (stats.requests, stats.list_requests, stats.head_requests, stats.get_requests, stats.bytes_read, stats.errors)

    await store.list_dir("s/")
    assert stats.list_requests == start[1] + 1
    info = await store.head("s/obj")
    assert stats.head_requests == start[2] + 1
    assert await store.get_range("s/obj", info.etag, 0, 700) == b"z" * 700
    assert stats.get_requests == start[3] + 1
    assert stats.bytes_read == start[4] + 700
    assert stats.requests >= start[0] + 3
    assert stats.errors == start[5]

    with pytest.raises(ObjectNotFoundError):
        await store.head("s/missing")
    with pytest.raises(ObjectChangedError):
        await store.get_range("s/obj", '"0123456789abcdef0123456789abcdef"', 0, 10)
    assert stats.errors == start[5] + 2
    assert stats.bytes_read == start[4] + 700


async def test_check_passes_on_a_readable_root(store: ObjectStore) -> None:
    await store.check()
