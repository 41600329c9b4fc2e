"""``FsspecObjectStore`` beyond the contract: the version checks and failure modes of its sources.

Real parts: fsspec's HTTP filesystem against a static file server on 127.0.0.1
(``tests/support/httpserver.py``), and fsspec's memory filesystem. What is checked is what the
contract suite cannot express: a server that ignores ``If-Match``, a file served without an ETag,
an object rewritten *during* a read on a source checked after the read, an outage that must not
look like deleted files, and a listing of an HTML index page.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import fsspec
import pytest

from tests.support.httpserver import StaticHttpServer, write_file
from tiering.errors import ObjectChangedError, ObjectNotFoundError, ObjectStoreUnavailableError
from tiering.objectstore import FsspecObjectStore, parse_source
from tiering.objectstore.fsspec_store import UnversionedObjectError

CONNECT_TIMEOUT_S = 2.0
READ_TIMEOUT_S = 5.0


@pytest.fixture
def www(tmp_path: Path) -> Path:
    root = tmp_path / "www"
    (root / "ds").mkdir(parents=True)
    return root


@pytest.fixture
def server(www: Path) -> Iterator[StaticHttpServer]:
    with StaticHttpServer(www) as s:
        yield s


@pytest.fixture
async def store(server: StaticHttpServer) -> AsyncIterator[FsspecObjectStore]:
    s = FsspecObjectStore(parse_source(server.url + "ds/"), connect_timeout_s=CONNECT_TIMEOUT_S,
                          read_timeout_s=READ_TIMEOUT_S)
    try:
        yield s
    finally:
        await s.close()


async def test_a_server_that_ignores_if_match_still_never_gives_other_bytes(
        www: Path, server: StaticHttpServer, store: FsspecObjectStore) -> None:
    write_file(www / "ds" / "obj", b"A" * 4096)
    old = await store.head("obj")
    write_file(www / "ds" / "obj", b"B" * 4096)  # same size, other bytes, a new ETag
    server.ignore_if_match = True  # the server now answers 206 with the new bytes
    with pytest.raises(ObjectChangedError):
        await store.get_range("obj", old.etag, 0, 4096)
    new = await store.head("obj")
    assert new.etag != old.etag
    assert await store.get_range("obj", new.etag, 10, 20) == b"B" * 10


async def test_a_file_without_an_etag_is_not_served(www: Path, server: StaticHttpServer,
                                                    store: FsspecObjectStore, caplog) -> None:
    write_file(www / "ds" / "tagged", b"t")
    write_file(www / "ds" / "untagged", b"u")
    server.no_etag.add("/ds/untagged")
    with pytest.raises(UnversionedObjectError) as info:
        await store.head("untagged")
    assert "untagged" in str(info.value) and "\n" not in str(info.value)
    listing = await store.list_dir("")
    assert set(listing.files) == {"tagged"}  # left out, with one warning naming it
    await store.list_dir("")
    warnings = [r for r in caplog.records if "untagged" in r.getMessage()]
    assert len(warnings) == 1


async def test_a_server_that_sends_no_etag_is_refused_by_the_check(www: Path, server: StaticHttpServer,
                                                                   store: FsspecObjectStore) -> None:
    """Issue 24, item 3: every file below the root (here one directory down) comes without an ETag,
    as from ``python -m http.server``: the mount-time check says so in one line, instead of an
    empty mount."""
    for key in ("train/a.bin", "train/b.bin", "val/c.bin"):
        write_file(www / "ds" / key, b"x")
        server.no_etag.add(f"/ds/{key}")
    with pytest.raises(UnversionedObjectError) as info:
        await store.check()
    message = str(info.value)
    assert "\n" not in message and "sends no ETag" in message and "train/a.bin" in message, message
    # One dynamic page among tagged files is no reason to refuse: it is left out of listings.
    write_file(www / "ds" / "train" / "0.bin", b"tagged")
    assert await store.check() is True


async def test_html_index_listing(www: Path, store: FsspecObjectStore) -> None:
    write_file(www / "ds" / "a b+c%d.txt", b"odd")
    write_file(www / "ds" / "sub" / "x", b"x")
    (www / "ds" / "empty").mkdir()
    write_file(www / "beside", b"not below the root")
    listing = await store.list_dir("")
    assert set(listing.files) == {"a b+c%d.txt"}  # no parent link, no sort links, nothing beside
    assert listing.dirs == {"sub", "empty"}
    assert listing.files["a b+c%d.txt"].size == 3
    assert await store.get_range("a b+c%d.txt", listing.files["a b+c%d.txt"].etag, 0, 3) == b"odd"
    assert set((await store.list_dir("sub/")).files) == {"x"}
    assert (await store.list_dir("missing/")).files == {}


async def test_an_outage_is_unavailable_not_missing(www: Path, tmp_path: Path) -> None:
    write_file(www / "ds" / "f", b"data")
    with StaticHttpServer(www) as server:
        store = FsspecObjectStore(parse_source(server.url + "ds/"), connect_timeout_s=CONNECT_TIMEOUT_S,
                                  read_timeout_s=READ_TIMEOUT_S)
        try:
            info = await store.head("f")
            server.stop()
            with pytest.raises(ObjectStoreUnavailableError):
                await store.head("f")
            with pytest.raises(ObjectStoreUnavailableError):
                await store.get_range("f", info.etag, 0, 4)
            with pytest.raises(ObjectStoreUnavailableError):
                await store.list_dir("")
        finally:
            await store.close()


async def test_a_missing_root_fails_the_check(www: Path, server: StaticHttpServer) -> None:
    store = FsspecObjectStore(parse_source(server.url + "no-such-dir/"))
    try:
        with pytest.raises(ObjectNotFoundError):
            await store.check()
    finally:
        await store.close()


async def test_a_server_without_index_pages_lists_nothing_but_serves_files(www: Path) -> None:
    write_file(www / "ds" / "f", b"data")
    with StaticHttpServer(www, index=False) as server:
        store = FsspecObjectStore(parse_source(server.url + "ds/"))
        try:
            assert (await store.list_dir("")).files == {}  # the documented limit of HTTP listings
            info = await store.head("f")
            assert await store.get_range("f", info.etag, 0, 4) == b"data"
        finally:
            await store.close()


# -- verify-after sources (memory:// here; az:// and hf:// read the same way) -------------------------


@pytest.fixture
def memory_root() -> Iterator[str]:
    root = f"t-{uuid.uuid4().hex[:12]}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{root}"):
        fs.rm(f"/{root}", recursive=True)


async def test_an_object_changed_between_head_and_get_is_refused(memory_root: str) -> None:
    fs = fsspec.filesystem("memory")
    fs.pipe_file(f"/{memory_root}/f", b"A" * 1000)
    store = FsspecObjectStore(parse_source(f"memory://{memory_root}"))
    info = await store.head("f")
    fs.pipe_file(f"/{memory_root}/f", b"B" * 1000)
    with pytest.raises(ObjectChangedError):
        await store.get_range("f", info.etag, 0, 10)
    assert store.stats.errors == 1


async def test_an_object_changed_during_the_get_is_refused(memory_root: str, monkeypatch) -> None:
    """The version is read again after the bytes: a rewrite in the middle of the GET is caught."""
    fs = fsspec.filesystem("memory")
    path = f"/{memory_root}/f"
    fs.pipe_file(path, b"A" * 1000)
    store = FsspecObjectStore(parse_source(f"memory://{memory_root}"))
    info = await store.head("f")
    real_cat = type(fs).cat_file

    def cat_then_rewrite(self: Any, p: str, start: Any = None, end: Any = None, **kw: Any) -> bytes:
        data = real_cat(self, p, start=start, end=end, **kw)
        if start is not None:  # the ranged read of get_range, not the hash of the re-check
            real_pipe(self, path, os.urandom(1000))
        return data

    real_pipe = type(fs).pipe_file
    monkeypatch.setattr(type(fs), "cat_file", cat_then_rewrite)
    with pytest.raises(ObjectChangedError):
        await store.get_range("f", info.etag, 0, 10)
