"""The test doubles themselves: ``InMemoryObjectStore`` helpers and ``FailingObjectStore`` injection.

The ``ObjectStore`` behaviour of the in-memory store is checked by ``tests/contract``.
"""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from tiering.errors import InvalidRangeError, ObjectNotFoundError, ObjectStoreUnavailableError
from tiering.objectstore import FailingObjectStore, InMemoryObjectStore
from tiering.protocols import ObjectStore


async def test_put_object_gives_s3_style_etags_and_mtime() -> None:
    store = InMemoryObjectStore()
    info = store.put_object("a/b", b"hello", mtime=123.0)
    assert info.etag == '"' + hashlib.md5(b"hello").hexdigest() + '"'
    assert (info.key, info.size, info.mtime) == ("a/b", 5, 123.0)
    assert await store.head("a/b") == info
    store.delete_object("a/b")
    store.delete_object("a/b")  # absent: ignored, like S3
    with pytest.raises(ObjectNotFoundError):
        await store.head("a/b")


async def test_on_get_hook_sees_every_read() -> None:
    seen: list[tuple[str, int, int]] = []
    store = InMemoryObjectStore(on_get=lambda key, start, end: seen.append((key, start, end)))
    info = store.put_object("k", b"0123456789")
    await store.get_range("k", info.etag, 2, 5)
    assert seen == [("k", 2, 5)]


async def test_bad_ranges_are_refused() -> None:
    store = InMemoryObjectStore()
    info = store.put_object("k", b"0123456789")
    for start, end in ((-1, 3), (5, 4)):
        with pytest.raises(InvalidRangeError):
            await store.get_range("k", info.etag, start, end)


async def test_failing_store_flags_can_be_flipped_mid_test() -> None:
    inner = InMemoryObjectStore()
    info = inner.put_object("d/k", b"data")
    calls: list[str] = []
    store = FailingObjectStore(inner, fail_gets=True, on_get=lambda k, s, e: calls.append(k))
    assert isinstance(store, ObjectStore)
    assert store.stats is inner.stats

    with pytest.raises(ObjectStoreUnavailableError):
        await store.get_range("d/k", info.etag, 0, 4)
    assert inner.stats.errors == 1 and calls == ["d/k"]
    assert set((await store.list_dir("d/")).files) == {"k"}  # lists still work

    store.fail_gets, store.fail_lists = False, True
    assert await store.get_range("d/k", info.etag, 0, 4) == b"data"
    with pytest.raises(ObjectStoreUnavailableError):
        await store.list_dir("d/")
    with pytest.raises(ObjectStoreUnavailableError):
        await store.check()
    assert (await store.head("d/k")).size == 4

    store.fail_lists, store.fail_heads = False, True
    with pytest.raises(ObjectStoreUnavailableError):
        await store.head("d/k")


async def test_failing_store_delay_simulates_a_hung_store() -> None:
    inner = InMemoryObjectStore()
    info = inner.put_object("k", b"x")
    store = FailingObjectStore(inner, delay_s=30.0)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(store.get_range("k", info.etag, 0, 1), timeout=0.05)
    store.delay_s = 0.0
    assert await store.get_range("k", info.etag, 0, 1) == b"x"
