"""The ``ObjectStore`` contract, run on every implementation.

The same test bodies run on ``InMemoryObjectStore``, ``LocalObjectStore`` over a temporary
directory, and ``S3ObjectStore`` against moto and against SeaweedFS, so the double the unit tests
use means what the real stores do. Each backend is driven through a small ``Backend`` adapter that
writes objects the way that store's users would (S3 PUTs, files written to a temporary name and
renamed into place, dict inserts).

The local and S3 stores are opened on a root prefix (``ds/``) inside their bucket or directory, so
every case also checks that keys are relative to that root and that nothing beside it leaks in.
The in-memory store has no root prefix; the one case about objects outside the root skips it.

The write half (``put``, ``delete``, ``copy``: what write-back uploads with) is checked the same
way; every write is read back through the store and, for S3, through the server's own client.

``FsspecObjectStore`` runs the read half twice: on fsspec's ``memory://`` filesystem and on its
HTTP filesystem against a static file server on 127.0.0.1 (``tests/support/httpserver.py``: ETags,
ranges, ``If-Match``, HTML index pages). Both are read-only sources, so the write half (marked
``writes``) is skipped for them, with that reason.
"""

from __future__ import annotations

import asyncio
import errno
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable, Iterable, Iterator

import pytest

from tiering.errors import ObjectChangedError, ObjectNotFoundError, ObjectStoreError, ReadOnlySourceError
from tiering.objectstore.mtimes import metadata_mtime, mtime_metadata
from tiering.objectstore import FsspecObjectStore, InMemoryObjectStore, LocalObjectStore, S3ObjectStore, parse_source
from tiering.protocols import ANY_VERSION, ObjectStore
from tests.support.httpserver import StaticHttpServer, write_file

ROOT = "ds/"  # the prefix the local and S3 stores are opened on
# Keys in the pagination case: more than two full ListObjectsV2 pages (1,000 entries each), with
# subdirectories among the files so continuation runs through CommonPrefixes too.
PAGINATED_FILES = 2_100
PAGINATED_DIRS = 60
# The large-directory case (in-memory and local stores only: uploading 100,000 objects to moto or
# SeaweedFS takes minutes on 2 cores, ~7 ms a PUT; the paging logic is covered above).
LARGE_DIR_ENTRIES = 100_000
# Part size of the S3 stores here: S3's minimum, so a 12 MiB upload is a three-part multipart upload.
PART_SIZE = 5 * 1024 * 1024
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
    writable: bool = True  # False: a read-only source; the write half of the contract is skipped
    lists_by_head: bool = False  # its listings HEAD each file (an HTML index has no sizes or ETags)


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
            part_size=PART_SIZE,
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


def _fsspec_memory_backend() -> Backend:
    import fsspec

    fs = fsspec.filesystem("memory")
    bucket = f"contract-{uuid.uuid4().hex[:12]}"  # fsspec's memory store is one per process

    def put_rel(key: str, data: bytes) -> None:
        if key.endswith("/"):
            fs.makedirs(f"/{bucket}/{key}".rstrip("/"), exist_ok=True)  # a directory is the marker
        else:
            fs.pipe_file(f"/{bucket}/{key}", data)

    def put_many(items: Iterable[tuple[str, bytes]]) -> None:
        for key, data in items:
            put_rel(ROOT + key, data)

    return Backend(
        "fsspec-memory",
        lambda: FsspecObjectStore(parse_source(f"memory://{bucket}/{ROOT}")),
        lambda key, data: put_rel(ROOT + key, data),
        put_many,
        lambda key: fs.rm_file(f"/{bucket}/{ROOT}{key}"),
        put_rel,
        writable=False,
        lists_by_head=True,  # memory:// files carry no version: it is computed by reading them
    )


def _http_backend(base: Path, server: StaticHttpServer) -> Backend:
    served = server.root
    (served / ROOT).mkdir(parents=True)

    def put_rel(key: str, data: bytes) -> None:
        if key.endswith("/"):
            (served / key).mkdir(parents=True, exist_ok=True)
        else:
            write_file(served / key, data)

    def put_many(items: Iterable[tuple[str, bytes]]) -> None:
        for key, data in items:
            path = served / ROOT / key
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)

    return Backend(
        "http",
        lambda: FsspecObjectStore(parse_source(f"{server.url}{ROOT}"), connect_timeout_s=CONNECT_TIMEOUT_S,
                                  read_timeout_s=READ_TIMEOUT_S),
        lambda key, data: put_rel(ROOT + key, data),
        put_many,
        lambda key: (served / ROOT / key).unlink(),
        put_rel,
        writable=False,
        lists_by_head=True,
    )


@pytest.fixture
def http_server(tmp_path: Path) -> Iterator[StaticHttpServer]:
    (tmp_path / "www").mkdir()
    with StaticHttpServer(tmp_path / "www") as server:
        yield server


@pytest.fixture(params=[
    "memory",
    "local",
    "fsspec-memory",
    "http",
    pytest.param("moto", marks=pytest.mark.s3),
    pytest.param("seaweed", marks=pytest.mark.s3),
])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "memory":
        return _memory_backend()
    if request.param == "local":
        return _local_backend(tmp_path)
    if request.param == "fsspec-memory":
        return _fsspec_memory_backend()
    if request.param == "http":
        return _http_backend(tmp_path, request.getfixturevalue("http_server"))
    bucket = request.getfixturevalue(f"{request.param}_bucket")
    return _s3_backend(request.param, request.getfixturevalue(request.param), bucket)


@pytest.fixture
async def store(backend: Backend, request: pytest.FixtureRequest) -> AsyncIterator[ObjectStore]:
    if request.node.get_closest_marker("writes") is not None and not backend.writable:
        pytest.skip(f"{backend.name} is a read-only source: cachefs never writes to it (writes raise EROFS)")
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
    if backend.lists_by_head:
        pytest.skip("an HTML-index listing HEADs every file: 100,000 HEADs; listing is covered above")
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


async def test_get_range_of_any_version(backend: Backend, store: ObjectStore) -> None:
    """``ANY_VERSION`` reads the current version in one request, whatever its ETag; absent is absent."""
    backend.put("obj", b"A" * 4096)
    before = store.stats.get_requests + store.stats.head_requests
    assert await store.get_range("obj", ANY_VERSION, 0, 4096) == b"A" * 4096
    backend.put("obj", b"B" * 4096)
    assert await store.get_range("obj", ANY_VERSION, 100, 200) == b"B" * 100
    assert store.stats.get_requests + store.stats.head_requests - before == 2  # no HEAD beside the GETs
    with pytest.raises(ObjectNotFoundError):
        await store.get_range("never-existed", ANY_VERSION, 0, 5)


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
    heads = stats.head_requests  # a listing of an HTML index HEADs each file too
    assert heads == start[2] + (1 if backend.lists_by_head else 0)
    info = await store.head("s/obj")
    assert stats.head_requests == heads + 1
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


async def test_check_tells_whether_the_root_holds_anything(backend: Backend, store: ObjectStore) -> None:
    """An empty root at mount is likely a typo in the prefix (issue 12): check() says so, in its one request."""
    if backend.put_outside is not None:
        backend.put_outside("elsewhere/x", b"not under the root")
    assert await store.check() is False
    backend.put("d/x", b"data")
    assert await store.check() is True


# -- writes (put, delete, copy) -----------------------------------------------------------------------


def reader(data: bytes, calls: list[tuple[int, int]] | None = None):
    """A ``ReadRange`` over ``data`` that records the ranges asked for."""

    def read(start: int, end: int) -> bytes:
        if calls is not None:
            calls.append((start, end))
        return data[start:end]

    return read


async def content(store: ObjectStore, key: str) -> bytes:
    info = await store.head(key)
    return await store.get_range(key, info.etag, 0, info.size)


@pytest.mark.writes
async def test_put_creates_and_replaces(store: ObjectStore) -> None:
    first = os.urandom(3000)
    info = await store.put("w/new.bin", len(first), reader(first))
    assert info.key == "w/new.bin" and info.size == len(first) and info.etag
    assert await content(store, "w/new.bin") == first
    assert (await store.head("w/new.bin")).etag == info.etag
    assert set((await store.list_dir("w/")).files) == {"new.bin"}
    assert "w" in (await store.list_dir("")).dirs

    second = os.urandom(3000)  # same size, other bytes: a new version
    again = await store.put("w/new.bin", len(second), reader(second))
    assert again.etag != info.etag
    assert await content(store, "w/new.bin") == second
    with pytest.raises(ObjectChangedError):
        await store.get_range("w/new.bin", info.etag, 0, 10)


@pytest.mark.writes
async def test_put_of_an_empty_object_and_a_directory_marker(store: ObjectStore) -> None:
    info = await store.put("empty.txt", 0, reader(b""))
    assert info.size == 0 and (await store.head("empty.txt")).size == 0
    await store.put("made/", 0, reader(b""))
    root = await store.list_dir("")
    assert "made" in root.dirs and "empty.txt" in root.files
    inside = await store.list_dir("made/")
    assert inside.files == {} and inside.dirs == set()


@pytest.mark.writes
async def test_put_is_idempotent(store: ObjectStore) -> None:
    data = os.urandom(10_000)
    one = await store.put("idem", len(data), reader(data))
    two = await store.put("idem", len(data), reader(data))
    assert await content(store, "idem") == data
    assert (await store.head("idem")).size == len(data)
    if not isinstance(store, LocalObjectStore):  # a local file's tag is its stat: a new inode each time
        assert one.etag == two.etag


@pytest.mark.writes
async def test_multipart_put_reads_each_range_once(backend: Backend, store: ObjectStore) -> None:
    data = os.urandom(12 * 1024 * 1024 + 12345)  # three parts of 5 MiB on S3
    calls: list[tuple[int, int]] = []
    info = await store.put("big/blob", len(data), reader(data, calls))
    assert info.size == len(data)
    assert await content(store, "big/blob") == data
    covered = sorted(calls)
    assert covered[0][0] == 0 and covered[-1][1] == len(data)
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), "ranges must tile the content exactly"
    if backend.is_s3:
        assert len(calls) == 3
        assert store.stats.put_requests >= 5  # create, three parts, complete
        assert "-" in info.etag.strip('"'), "a multipart ETag ends in -<parts>"


@pytest.mark.writes
async def test_a_failed_put_leaves_the_old_object(store: ObjectStore) -> None:
    old = os.urandom(2000)
    await store.put("keep", len(old), reader(old))

    def short(start: int, end: int) -> bytes:
        return b"x" * max(0, end - start - 1)

    with pytest.raises(ObjectStoreError):
        await store.put("keep", 5000, short)
    assert await content(store, "keep") == old

    def broken(start: int, end: int) -> bytes:
        raise OSError(5, "staged file unreadable")

    with pytest.raises((ObjectStoreError, OSError)):
        await store.put("keep", 5000, broken)
    assert await content(store, "keep") == old


@pytest.mark.writes
async def test_failed_multipart_put_leaves_the_old_object(backend: Backend, store: ObjectStore) -> None:
    old = os.urandom(1000)
    await store.put("mp", len(old), reader(old))
    big = os.urandom(11 * 1024 * 1024)

    def fails_late(start: int, end: int) -> bytes:
        if end > 10 * 1024 * 1024:
            raise OSError(5, "disk error in the last part")
        return big[start:end]

    with pytest.raises((ObjectStoreError, OSError)):
        await store.put("mp", len(big), fails_late)
    assert await content(store, "mp") == old


@pytest.mark.writes
async def test_delete(backend: Backend, store: ObjectStore) -> None:
    backend.put("d/a", b"a")
    backend.put("d/b", b"b")
    await store.delete("d/a")
    assert set((await store.list_dir("d/")).files) == {"b"}
    with pytest.raises(ObjectNotFoundError):
        await store.head("d/a")
    await store.delete("d/a")  # absent: not an error
    await store.delete("never/was")
    await store.delete("d/b")
    assert (await store.list_dir("d/")).files == {}
    # Whether "d" is still listed now is up to the server: S3 and moto drop a prefix with no keys,
    # SeaweedFS and a local directory keep the directory until its marker ("d/") is deleted.
    await store.delete("d/")
    assert "d" not in (await store.list_dir("")).dirs


@pytest.mark.writes
async def test_delete_of_a_marker(store: ObjectStore) -> None:
    await store.put("m/", 0, reader(b""))
    assert "m" in (await store.list_dir("")).dirs
    await store.delete("m/")
    assert "m" not in (await store.list_dir("")).dirs
    await store.delete("m/")


@pytest.mark.writes
async def test_copy(store: ObjectStore) -> None:
    data = os.urandom(50_000)
    src = await store.put("c/src", len(data), reader(data))
    info = await store.copy("c/src", src.etag, "c/dst")
    assert info.key == "c/dst" and info.size == len(data)
    assert await content(store, "c/dst") == data
    assert await content(store, "c/src") == data
    assert (await store.head("c/dst")).etag == info.etag

    newer = os.urandom(50_000)
    await store.put("c/src", len(newer), reader(newer))
    with pytest.raises(ObjectChangedError):
        await store.copy("c/src", src.etag, "c/other")
    with pytest.raises(ObjectNotFoundError):
        await store.head("c/other")
    with pytest.raises(ObjectNotFoundError):
        await store.copy("c/missing", src.etag, "c/x")


@pytest.mark.writes
async def test_copy_above_the_single_request_limit(backend: Backend, store: ObjectStore,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    if not backend.is_s3:
        pytest.skip("only S3 has a size limit on CopyObject")
    from tiering.objectstore import s3

    monkeypatch.setattr(s3, "MAX_COPY_OBJECT_BYTES", 6 * 1024 * 1024)
    monkeypatch.setattr(s3, "COPY_PART_SIZE", 5 * 1024 * 1024)
    data = os.urandom(12 * 1024 * 1024 + 7)
    src = await store.put("cp/src", len(data), reader(data))
    info = await store.copy("cp/src", src.etag, "cp/dst")
    assert info.size == len(data)
    assert await content(store, "cp/dst") == data


# A writer's mtime with microseconds, far from any upload time, in rclone's form.
WRITER_MTIME = 1_500_000_000.123456


@pytest.mark.writes
@pytest.mark.parametrize("size", [700, 12 * 1024 * 1024 + 3], ids=["single", "multipart"])
async def test_put_keeps_the_writers_mtime_and_a_copy_keeps_it(backend: Backend, store: ObjectStore,
                                                                monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    """The mtime write-back uploads with (``x-amz-meta-mtime``, rclone's format) is read back by
    ``head_metadata``, also after a PutObject / multipart upload and after a server-side copy, under
    CopyObject's limit and above it (UploadPartCopy parts carry no metadata of their own)."""
    if size > 1024 * 1024 and not backend.is_s3:
        pytest.skip("multipart uploads and copies are S3's")
    if backend.is_s3:
        from tiering.objectstore import s3

        monkeypatch.setattr(s3, "MAX_COPY_OBJECT_BYTES", 6 * 1024 * 1024)
        monkeypatch.setattr(s3, "COPY_PART_SIZE", 5 * 1024 * 1024)
    data = os.urandom(size)
    src = await store.put("m/src", size, reader(data), metadata=mtime_metadata(WRITER_MTIME))
    _, metadata = await store.head_metadata("m/src")
    assert metadata_mtime(metadata) == pytest.approx(WRITER_MTIME, abs=1e-6)
    if backend.is_s3:
        assert metadata["mtime"] == "1500000000.123456"  # exactly what rclone writes and reads
    copied = await store.copy("m/src", src.etag, "m/dst")
    _, metadata = await store.head_metadata("m/dst")
    assert metadata_mtime(metadata) == pytest.approx(WRITER_MTIME, abs=1e-6)
    assert await content(store, "m/dst") == data and copied.size == size


@pytest.mark.writes
async def test_a_copy_onto_itself_sets_a_new_mtime_and_keeps_the_bytes(backend: Backend, store: ObjectStore) -> None:
    """utimens on a file only in the store: CopyObject onto itself with MetadataDirective REPLACE
    (rclone's SetModTime), guarded by the source's ETag; the other metadata stays."""
    data = os.urandom(5000)
    src = await store.put("t/f", len(data), reader(data), metadata={"mtime": "1400000000", "owner": "me"})
    await store.copy("t/f", src.etag, "t/f", metadata=mtime_metadata(WRITER_MTIME))
    info, metadata = await store.head_metadata("t/f")
    assert metadata_mtime(metadata) == pytest.approx(WRITER_MTIME, abs=1e-6)
    if backend.is_s3 or backend.name == "memory":
        assert metadata.get("owner") == "me"
    assert await content(store, "t/f") == data
    newer = os.urandom(10)
    await store.put("t/f", len(newer), reader(newer))
    with pytest.raises(ObjectChangedError):
        await store.copy("t/f", info.etag, "t/f", metadata=mtime_metadata(WRITER_MTIME))


@pytest.mark.writes
async def test_write_stats_are_counted(store: ObjectStore) -> None:
    stats = store.stats
    before = (stats.put_requests, stats.delete_requests, stats.copy_requests, stats.bytes_written)
    info = await store.put("s/w", 700, reader(b"q" * 700))
    await store.copy("s/w", info.etag, "s/w2")
    await store.delete("s/w")
    assert stats.put_requests == before[0] + 1
    assert stats.delete_requests == before[1] + 1
    assert stats.copy_requests >= before[2] + 1
    assert stats.bytes_written == before[3] + 700


@pytest.mark.writes
@pytest.mark.parametrize("key", ["", "/abs", "a//b", "a/../b", "./a", "a/.", "x\x00y", "//"])
async def test_bad_keys_are_never_written(store: ObjectStore, key: str) -> None:
    with pytest.raises(ValueError):
        await store.put(key, 1, reader(b"x"))
    with pytest.raises(ValueError):
        await store.delete(key)


async def test_a_read_only_source_refuses_every_write(backend: Backend, store: ObjectStore) -> None:
    if backend.writable:
        pytest.skip(f"{backend.name} is writable")
    backend.put("ro/x", b"data")
    info = await store.head("ro/x")
    for attempt in (store.put("ro/x", 1, reader(b"y")), store.delete("ro/x"), store.copy("ro/x", info.etag, "ro/y")):
        with pytest.raises(ReadOnlySourceError) as refused:
            await attempt
        assert refused.value.errno == errno.EROFS and "read-only" in str(refused.value)
    assert await content(store, "ro/x") == b"data"


# -- conditional writes (the leases and recovery of --write-durability cluster) -----------------------

@pytest.mark.writes
@pytest.mark.parametrize("size", [3000, 12 * 1024 * 1024 + 7], ids=["single", "multipart"])
async def test_conditional_put_and_delete(backend: Backend, store: ObjectStore, size: int) -> None:
    if not callable(getattr(store, "put_if", None)):
        pytest.skip(f"{backend.name} has no conditional writes (only the S3 and in-memory stores need them)")
    if backend.name == "moto" and size > PART_SIZE:
        pytest.skip("moto's server ignores If-Match/If-None-Match on CompleteMultipartUpload (S3 and SeaweedFS "
                    "evaluate them)")
    put_if, delete_if = store.put_if, store.delete_if  # type: ignore[attr-defined]
    first, second = os.urandom(size), os.urandom(size)
    made = await put_if("c/obj", size, reader(first), if_none_match=True)
    with pytest.raises(ObjectChangedError):  # 412: it exists now
        await put_if("c/obj", size, reader(second), if_none_match=True)
    with pytest.raises(ObjectChangedError):  # 412: another version than the one named
        await put_if("c/obj", size, reader(second), if_match='"0123456789abcdef0123456789abcdef"')
    assert await content(store, "c/obj") == first
    replaced = await put_if("c/obj", size, reader(second), if_match=made.etag)
    assert replaced.etag != made.etag and await content(store, "c/obj") == second
    with pytest.raises(ObjectChangedError):
        await delete_if("c/obj", made.etag)
    await delete_if("c/obj", replaced.etag)
    with pytest.raises(ObjectNotFoundError):
        await store.head("c/obj")
    with pytest.raises(ObjectNotFoundError):  # gone: not "another version" (SeaweedFS answers 412 here)
        await delete_if("c/obj", replaced.etag)
