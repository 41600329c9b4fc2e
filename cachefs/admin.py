"""What a control plane (the CSI driver) needs from cachefs besides mounting: validation and
bucket administration, behind one small interface.

The CSI driver mounts by running the ``cachefs`` CLI and must not reach into ``tiering`` (the import
contracts forbid it). It still has to refuse a bad source URL or cache size before it starts a
daemon, check a bucket when it provisions a volume, and delete a volume's objects when asked. This
module gives it exactly that, built on ``tiering``: the same URL parser, size parser and cache
settings the CLI uses (so a value the driver accepts is one ``cachefs mount`` accepts), and the
same object stores the daemon uses (so credentials are read the same way, from an ``environ``
mapping passed in, never from arguments, and never logged).

Store failures come out as ``AdminError`` subclasses, so callers can map them to their own error
codes by type without importing ``tiering.errors``. Messages name the bucket, the key and the
endpoint, never credentials.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from cachefs.mounts import cache_dir_holder
from cachefs.settings import parse_id, parse_mode
from tiering.errors import AccessDeniedError, CacheError, ObjectNotFoundError, ObjectStoreUnavailableError
from tiering.objectstore import (
    CHECK_TIMEOUT_S,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_READ_TIMEOUT_S,
    open_object_store,
    parse_source,
)
from tiering.settings import CacheSettings
from tiering.units import parse_size as _parse_size
from tiering.writeback.journal import RECORD_SUFFIX, RECORDS_DIR
from tiering.writeback.settings import WriteBackSettings

__all__ = [
    "AdminAccessDenied",
    "AdminError",
    "AdminNotFound",
    "AdminUnavailable",
    "SourceInfo",
    "check_cache_options",
    "check_writeback_options",
    "staged_changes",
    "check_source_access",
    "delete_prefix",
    "delete_small_object",
    "read_small_object",
    "write_small_object",
    "parse_id",
    "parse_mode",
    "parse_size",
    "validate_source",
]

# DeleteObject requests in flight while deleting a volume: enough to hide per-request latency,
# few enough not to trip an S3 request-rate limit on one prefix (3,500 writes/s).
DELETE_CONCURRENCY = 16


class AdminError(Exception):
    """An administrative store operation failed; the message is one line without credentials."""


class AdminNotFound(AdminError):
    """The bucket (or key) does not exist."""


class AdminAccessDenied(AdminError):
    """Credentials are missing, wrong, or lack permission."""


class AdminUnavailable(AdminError):
    """The endpoint could not be reached or did not answer in time."""


@dataclass(frozen=True)
class SourceInfo:
    """A validated source URL: ``scheme`` is ``s3`` or ``file``; ``prefix`` is ``""`` or ends in ``/``."""

    url: str
    scheme: str
    bucket: str
    prefix: str


def parse_size(text: str) -> int:
    """Bytes named by ``512MiB``, ``2GiB``, ...: the same parser as ``cachefs mount``. ValueError if bad."""
    return _parse_size(text)


def validate_source(url: str) -> SourceInfo:
    """Parse a source URL exactly as ``cachefs mount`` will; ValueError with a one-line reason."""
    source = parse_source(url)
    return SourceInfo(source.url, source.scheme, source.bucket, source.prefix)


def check_cache_options(
    *,
    ram_bytes: int | None = None,
    disk_bytes: int | None = None,
    block_size: int | None = None,
    readahead_bytes: int | None = None,
    max_fetches: int | None = None,
) -> None:
    """Raise ValueError if ``cachefs mount`` would refuse this combination (None: its default)."""
    given: dict[str, Any] = {
        "ram_bytes": ram_bytes,
        "disk_bytes": disk_bytes,
        "block_size": block_size,
        "readahead_max_bytes": readahead_bytes,
        "max_concurrent_fetches": max_fetches,
    }
    CacheSettings(**{name: value for name, value in given.items() if value is not None})


def check_writeback_options(*, upload_delay_s: float | None = None, upload_max_delay_s: float | None = None,
                            stop_timeout_s: float | None = None) -> None:
    """Raise ValueError if ``cachefs mount`` would refuse these write-back timings (None: its default)."""
    given: dict[str, Any] = {"upload_delay_s": upload_delay_s, "upload_max_delay_s": upload_max_delay_s,
                             "stop_timeout_s": stop_timeout_s}
    WriteBackSettings(**{name: value for name, value in given.items() if value is not None})


def staged_changes(cache_dir: Path) -> int | None:
    """Changes a stopped daemon left journaled, not yet uploaded, under ``cache_dir`` (every source
    directory in it); None while a daemon still holds one of them (it may still upload: not final).
    The next writable mount of the source uploads them (``cachefs.daemon.stopping``)."""
    from cachefs.sourcedir import STAGING_DIRNAME

    total = 0
    try:
        sources = [d for d in cache_dir.iterdir() if d.is_dir()]
    except OSError:
        return 0
    for source in sources:
        if cache_dir_holder(source) is not None:
            return None
        records = source / STAGING_DIRNAME / RECORDS_DIR
        try:
            total += sum(1 for entry in os.scandir(records) if entry.name.endswith(RECORD_SUFFIX))
        except OSError:
            continue
    return total


def _translate(exc: BaseException) -> AdminError:
    if isinstance(exc, ObjectNotFoundError):
        return AdminNotFound(str(exc))
    if isinstance(exc, AccessDeniedError):
        return AdminAccessDenied(str(exc))
    if isinstance(exc, (ObjectStoreUnavailableError, TimeoutError)):
        return AdminUnavailable(str(exc) or "the object store did not answer in time")
    return AdminError(str(exc) or type(exc).__name__)


async def check_source_access(url: str, *, endpoint_url: str | None, environ: Mapping[str, str],
                              timeout_s: float = CHECK_TIMEOUT_S) -> None:
    """Prove the bucket exists and the credentials in ``environ`` may list ``url``'s prefix."""
    store = open_object_store(url, endpoint_url=endpoint_url, connect_timeout_s=DEFAULT_CONNECT_TIMEOUT_S,
                              read_timeout_s=DEFAULT_READ_TIMEOUT_S, environ=environ)
    try:
        await asyncio.wait_for(store.check(), timeout_s)
    except (CacheError, TimeoutError) as exc:
        raise _translate(exc) from exc
    finally:
        await store.close()


async def delete_prefix(url: str, *, endpoint_url: str | None, environ: Mapping[str, str]) -> int:
    """Delete every object under ``url``'s prefix (directory markers included); return the count.

    The prefix is walked one ``/``-level at a time with the store's own listing, deleting files, then
    each directory's marker, then the prefix's own marker; deletes of one level run concurrently
    (bounded). Idempotent: a prefix that is already empty, or was never created, deletes nothing and
    succeeds, and deleting an absent key is not an error. Keys that are not POSIX paths (an empty,
    ``.`` or ``..`` component, which no cachefs mount can create) are left in place.
    """
    info = validate_source(url)
    if info.scheme != "s3" or not info.prefix:
        raise ValueError("delete_prefix needs an s3://bucket/prefix/ URL with a non-empty prefix")
    # Open the store one level up, so the volume's own marker ("<name>/") is an ordinary key in it.
    parent, _, _ = info.prefix[:-1].rpartition("/")
    root = f"{parent}/" if parent else ""
    store = open_object_store(f"s3://{info.bucket}/{root}", endpoint_url=endpoint_url,
                              connect_timeout_s=DEFAULT_CONNECT_TIMEOUT_S, read_timeout_s=DEFAULT_READ_TIMEOUT_S,
                              environ=environ)
    slots = asyncio.Semaphore(DELETE_CONCURRENCY)

    async def delete(key: str) -> None:
        async with slots:
            await store.delete(key)

    async def walk(prefix: str) -> int:
        listing = await store.list_dir(prefix)
        count = 0
        for name in sorted(listing.dirs):
            if name not in ("", ".", ".."):
                count += await walk(f"{prefix}{name}/")
        files = [obj.key for name, obj in sorted(listing.files.items()) if name not in ("", ".", "..")]
        await asyncio.gather(*(delete(key) for key in files))
        await delete(prefix)  # the directory marker, if there is one
        return count + len(files)

    try:
        return await walk(info.prefix[len(root):])
    except CacheError as exc:
        raise _translate(exc) from exc
    finally:
        await store.close()


def _store_of(url: str, endpoint_url: str | None, environ: Mapping[str, str]) -> tuple[Any, str]:
    """The store one level above ``url``'s key, and the key's name in it."""
    info = validate_source(url)
    if info.scheme != "s3" or not info.prefix or url.endswith("/"):
        raise ValueError("a small object needs an s3://bucket/key URL naming an object, not a prefix")
    parent, _, name = info.prefix.rstrip("/").rpartition("/")
    store = open_object_store(f"s3://{info.bucket}/{parent}/" if parent else f"s3://{info.bucket}/",
                              endpoint_url=endpoint_url, connect_timeout_s=DEFAULT_CONNECT_TIMEOUT_S,
                              read_timeout_s=DEFAULT_READ_TIMEOUT_S, environ=environ)
    return store, name


async def read_small_object(url: str, *, endpoint_url: str | None, environ: Mapping[str, str]) -> bytes | None:
    """The bytes of the object at ``s3://bucket/key`` (a record of a few bytes), or None if it is absent."""
    store, name = _store_of(url, endpoint_url, environ)
    try:
        try:
            info = await store.head(name)
        except ObjectNotFoundError:
            return None
        return bytes(await store.get_range(name, info.etag, 0, info.size)) if info.size else b""
    except CacheError as exc:
        raise _translate(exc) from exc
    finally:
        await store.close()


async def write_small_object(url: str, data: bytes, *, endpoint_url: str | None,
                             environ: Mapping[str, str]) -> None:
    """Store ``data`` at ``s3://bucket/key`` in one PUT (a record of a few bytes)."""
    store, name = _store_of(url, endpoint_url, environ)
    try:
        await store.put(name, len(data), lambda start, end: data[start:end])
    except CacheError as exc:
        raise _translate(exc) from exc
    finally:
        await store.close()


async def delete_small_object(url: str, *, endpoint_url: str | None, environ: Mapping[str, str]) -> None:
    """Delete the object at ``s3://bucket/key``; an absent one is success."""
    store, name = _store_of(url, endpoint_url, environ)
    try:
        await store.delete(name)
    except ObjectNotFoundError:
        return
    except CacheError as exc:
        raise _translate(exc) from exc
    finally:
        await store.close()
