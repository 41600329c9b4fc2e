"""In-memory object stores: the double used by unit tests of the engine and the filesystem, and the demo.

``InMemoryObjectStore`` keeps objects in a dict and follows the S3 semantics that the rest of cachefs
relies on, so a test written against it means the same thing against a real bucket (the contract
suite in ``tests/contract`` runs the same cases on both):

- a one-level listing with delimiter ``/``: keys directly under the prefix are files, the first
  component of deeper keys is a directory; a zero-byte marker ``a/`` makes ``a`` a directory of the
  parent and is not a file of its own listing;
- ETags are the quoted MD5 hex of the content, as S3 gives for single-part uploads, so rewriting an
  object with other bytes of the same size changes its ETag;
- ``get_range`` refuses to read an object whose ETag is no longer the one asked for
  (``ObjectChangedError``), like a GET with ``If-Match``, and clamps the range to the object's end.

- ``put`` replaces an object in one step (as a PUT or a completed multipart upload), ``delete`` of an
  absent key succeeds, ``copy`` refuses a source whose ETag is no longer the one given.

``FailingObjectStore`` wraps any store to inject failures and latency; its flags are plain mutable
attributes so a test can break and heal the store in the middle of a read or an upload.

Every call awaits ``asyncio.sleep(0)`` once so that concurrent callers interleave as they would
against a real store, instead of each call completing without ever yielding the loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from tiering.blocks import BlockData
from tiering.handoff import AfterReceive
from tiering.errors import ObjectChangedError, ObjectNotFoundError, ObjectStoreError, ObjectStoreUnavailableError
from tiering.objectstore.keys import (
    MAX_KEY_BYTES,
    check_key,
    check_list_prefix,
    check_range,
    check_write_key,
    clamp_range,
    split_listing_key,
)
from tiering.protocols import ANY_VERSION, Listing, ObjectInfo, ObjectStore, ObjectStoreStats, ReadRange
from tiering.storehealth import request_timeout

# Called as on_get(key, start, end) at the start of every get_range, before any failure is injected.
GetHook = Callable[[str, int, int], None]
# Called as on_write(op, key) at the start of every put/delete/copy ("put", "delete", "copy"), before
# any failure is injected; it may raise to inject an error of its choice.
WriteHook = Callable[[str, str], None]


def md5_etag(data: bytes) -> str:
    """The ETag S3 gives a single-part upload: the MD5 hex of the bytes, in double quotes."""
    return '"' + hashlib.md5(data, usedforsecurity=False).hexdigest() + '"'


@dataclass(frozen=True, slots=True)
class _Stored:
    data: bytes
    info: ObjectInfo
    metadata: dict[str, str] = field(default_factory=dict)  # user metadata (S3's x-amz-meta-*)


class InMemoryObjectStore:
    """A dict-backed ``ObjectStore``. ``put_object``/``delete_object`` are synchronous test helpers."""

    def __init__(self, *, on_get: GetHook | None = None, max_key_bytes: int = MAX_KEY_BYTES) -> None:
        self.stats = ObjectStoreStats()
        self.on_get = on_get
        # S3's limit by default; a test gives less to stand for a store opened below a prefix.
        self.max_key_bytes = max_key_bytes
        self._objects: dict[str, _Stored] = {}

    # -- test helpers -------------------------------------------------------------------------------

    def put_object(self, key: str, data: bytes, mtime: float | None = None,
                   metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        """Create or overwrite ``key``. A key ending in ``/`` is a directory marker (usually empty)."""
        if not key:
            raise ValueError("object key must not be empty")
        data = bytes(data)
        info = ObjectInfo(
            key=key,
            size=len(data),
            etag=md5_etag(data),
            mtime=time.time() if mtime is None else float(mtime),
        )
        self._objects[key] = _Stored(data, info, dict(metadata or {}))
        return info

    def delete_object(self, key: str) -> None:
        """Remove ``key``; absent keys are ignored, as S3's DeleteObject does."""
        self._objects.pop(key, None)

    def keys(self) -> list[str]:
        return sorted(self._objects)

    # -- ObjectStore --------------------------------------------------------------------------------

    async def check(self) -> bool:
        self.stats.requests += 1
        await asyncio.sleep(0)
        return bool(self._objects)

    async def list_dir(self, prefix: str) -> Listing:
        check_list_prefix(prefix)
        self.stats.requests += 1
        self.stats.list_requests += 1
        await asyncio.sleep(0)
        listing = Listing()
        for key, stored in self._objects.items():
            if not key.startswith(prefix):
                continue
            split = split_listing_key(prefix, key)
            if split is None:
                continue
            name, is_dir = split
            if is_dir:
                listing.dirs.add(name)
            else:
                listing.files[name] = stored.info
        return listing

    async def head(self, key: str) -> ObjectInfo:
        self.stats.requests += 1
        self.stats.head_requests += 1
        await asyncio.sleep(0)
        return self._lookup(key).info

    async def get_range(self, key: str, etag: str, start: int, end: int, *,
                        after: AfterReceive[Any] | None = None) -> bytes:
        # Receives on the loop: ``after`` stays unclaimed, for the caller to do.
        check_range(start, end)
        if self.on_get is not None:
            self.on_get(key, start, end)
        if start == end:
            return b""  # as the S3 store: nothing to read, so no request and no ETag check
        self.stats.requests += 1
        self.stats.get_requests += 1
        await asyncio.sleep(0)
        stored = self._lookup(key)
        if etag != ANY_VERSION and stored.info.etag != etag:
            self.stats.errors += 1
            raise ObjectChangedError(f"object {key!r} changed: ETag is now {stored.info.etag}, not {etag}")
        start, end = clamp_range(start, end, stored.info.size)
        data = stored.data[start:end]
        self.stats.bytes_read += len(data)
        return data

    async def put(self, key: str, size: int, read: ReadRange, *,
                  metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        check_write_key(key)
        self.stats.requests += 1
        self.stats.put_requests += 1
        data = await asyncio.to_thread(read, 0, size) if size else b""
        if len(data) != size:
            self.stats.errors += 1
            raise ObjectStoreError(f"put {key!r}: the source gave {len(data)} bytes, not {size}")
        self.stats.bytes_written += size
        return self.put_object(key, data, metadata=metadata)

    async def delete(self, key: str) -> None:
        check_write_key(key)
        self.stats.requests += 1
        self.stats.delete_requests += 1
        await asyncio.sleep(0)
        self._objects.pop(key, None)

    async def put_if(self, key: str, size: int, read: ReadRange, *, if_match: str | None = None,
                     if_none_match: bool = False, metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        """A put refused as S3 refuses it: 412 (``ObjectChangedError``) when the object exists under
        ``If-None-Match: *`` or has another ETag than ``if_match``; 404 when ``if_match`` names an
        absent object. ``metadata``: user metadata stored with it (``head_metadata``)."""
        check_write_key(key)
        self.stats.requests += 1
        self.stats.put_requests += 1
        data = await asyncio.to_thread(read, 0, size) if size else b""
        current = self._objects.get(key)
        if if_none_match and current is not None:
            raise ObjectChangedError(f"put {key!r}: the object exists (If-None-Match)")
        if if_match is not None:
            if current is None:
                raise ObjectNotFoundError(f"put {key!r}: no such object (If-Match)")
            if current.info.etag != if_match:
                raise ObjectChangedError(f"put {key!r}: ETag is {current.info.etag}, not {if_match}")
        self.stats.bytes_written += len(data)
        return self.put_object(key, data, metadata=metadata)

    async def head_metadata(self, key: str) -> tuple[ObjectInfo, dict[str, str]]:
        """``head`` with the object's user metadata (keys in lower case, as S3 returns them)."""
        info = await self.head(key)
        return info, {name.lower(): value for name, value in self._lookup(key).metadata.items()}

    async def delete_if(self, key: str, if_match: str) -> None:
        check_write_key(key)
        self.stats.requests += 1
        self.stats.delete_requests += 1
        await asyncio.sleep(0)
        current = self._objects.get(key)
        if current is None:
            raise ObjectNotFoundError(f"delete {key!r}: no such object (If-Match)")
        if current.info.etag != if_match:
            raise ObjectChangedError(f"delete {key!r}: ETag is {current.info.etag}, not {if_match}")
        self._objects.pop(key, None)

    async def copy(self, src: str, etag: str, dst: str, *,
                   metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        check_write_key(dst)
        self.stats.requests += 1
        self.stats.copy_requests += 1
        await asyncio.sleep(0)
        stored = self._lookup(src)
        if stored.info.etag != etag:
            self.stats.errors += 1
            raise ObjectChangedError(f"object {src!r} changed: ETag is now {stored.info.etag}, not {etag}")
        # S3 copies the user metadata too; ``metadata`` sets names in it (MetadataDirective REPLACE).
        return self.put_object(dst, stored.data, metadata={**stored.metadata, **(metadata or {})})

    async def close(self) -> None:
        pass

    def _lookup(self, key: str) -> _Stored:
        try:
            check_key(key)  # as every store: a '.'/'..' key is never served, even if it was put
        except ObjectNotFoundError:
            self.stats.errors += 1
            raise
        stored = self._objects.get(key)
        if stored is None:
            self.stats.errors += 1
            raise ObjectNotFoundError(f"no such object: {key!r}")
        return stored


class FailingObjectStore:
    """Wraps a store to inject failures and latency.

    ``fail_gets`` makes ``get_range`` raise ``ObjectStoreUnavailableError``; ``fail_lists`` does the
    same for ``list_dir`` and ``check``; ``fail_heads`` for ``head``; ``fail_writes`` for ``put``,
    ``delete`` and ``copy`` (``write_error``, if set, is raised instead: an ``AccessDeniedError`` to
    test a store that refuses writes). ``delay_s`` makes every call sleep first (to simulate a slow
    or hanging store; the caller's timeout decides what happens); ``write_delay_s`` only the writes.
    All are plain attributes: flip them at any time. ``stats`` is the inner store's, with injected
    failures counted as errors. ``on_get(key, start, end)`` is called on every ``get_range``,
    ``on_write(op, key)`` on every write.
    """

    def __init__(
        self,
        inner: ObjectStore,
        *,
        fail_gets: bool = False,
        fail_lists: bool = False,
        fail_heads: bool = False,
        fail_writes: bool = False,
        write_error: ObjectStoreError | None = None,
        delay_s: float = 0.0,
        write_delay_s: float = 0.0,
        on_get: GetHook | None = None,
        on_write: WriteHook | None = None,
    ) -> None:
        self.inner = inner
        self.fail_gets = fail_gets
        self.fail_lists = fail_lists
        self.fail_heads = fail_heads
        self.fail_writes = fail_writes
        self.write_error = write_error
        self.delay_s = delay_s
        self.write_delay_s = write_delay_s
        self.on_get = on_get
        self.on_write = on_write

    @property
    def stats(self) -> ObjectStoreStats:
        return self.inner.stats

    @property
    def max_key_bytes(self) -> int:
        return self.inner.max_key_bytes

    async def _before(self, failing: bool, what: str) -> None:
        if self.delay_s > 0:
            try:
                # The caller's per-request deadline, as the S3 store honours it (tiering.storehealth).
                async with asyncio.timeout(request_timeout()):
                    await asyncio.sleep(self.delay_s)
            except TimeoutError as exc:
                raise ObjectStoreUnavailableError(f"{what}: did not answer in time (injected delay)") from exc
        if failing:
            self.inner.stats.requests += 1
            self.inner.stats.errors += 1
            raise ObjectStoreUnavailableError(f"injected failure: {what}")

    async def check(self) -> bool:
        await self._before(self.fail_lists, "check")
        return await self.inner.check()

    async def list_dir(self, prefix: str) -> Listing:
        await self._before(self.fail_lists, f"list {prefix!r}")
        return await self.inner.list_dir(prefix)

    async def head(self, key: str) -> ObjectInfo:
        await self._before(self.fail_heads, f"head {key!r}")
        return await self.inner.head(key)

    async def get_range(self, key: str, etag: str, start: int, end: int, *,
                        after: AfterReceive[Any] | None = None) -> BlockData:
        if self.on_get is not None:
            self.on_get(key, start, end)
        await self._before(self.fail_gets, f"get {key!r} [{start}, {end})")
        return await self.inner.get_range(key, etag, start, end, after=after)

    async def _before_write(self, op: str, key: str) -> None:
        if self.on_write is not None:
            self.on_write(op, key)
        if self.write_delay_s > 0:
            await asyncio.sleep(self.write_delay_s)
        await self._before(self.fail_writes and self.write_error is None, f"{op} {key!r}")
        if self.fail_writes and self.write_error is not None:
            self.inner.stats.requests += 1
            self.inner.stats.errors += 1
            raise self.write_error

    async def head_metadata(self, key: str) -> tuple[ObjectInfo, dict[str, str]]:
        await self._before(self.fail_heads, f"head {key!r}")
        return await self.inner.head_metadata(key)

    async def put(self, key: str, size: int, read: ReadRange, *,
                  metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        await self._before_write("put", key)
        return await self.inner.put(key, size, read, metadata=metadata)

    async def delete(self, key: str) -> None:
        await self._before_write("delete", key)
        await self.inner.delete(key)

    async def copy(self, src: str, etag: str, dst: str, *,
                   metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        await self._before_write("copy", dst)
        return await self.inner.copy(src, etag, dst, metadata=metadata)

    async def close(self) -> None:
        await self.inner.close()
