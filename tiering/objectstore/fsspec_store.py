"""Read-only sources beyond S3, through fsspec: GCS, Azure Blob, the Hugging Face Hub, HTTP(S), memory.

Why it is safe to cache them. cachefs keys every cached block by the object's ETag (``tiering.blocks``)
and refuses a ranged read whose object has moved on (``ObjectChangedError``, ESTALE at the mount). A
protocol is mounted only if its filesystem gives each object a *version identity* that changes when
its bytes change; this store reports it as ``ObjectInfo.etag`` and pins every read to it:

=========  ==========================================  ==============================================
protocol   version identity (``info()`` field)          how a ranged read is pinned to it
=========  ==========================================  ==============================================
gs://      ``generation`` (a new number on every write)  the read names it (``path#generation``, gcsfs
                                                        ``version_aware``): another generation is 404,
                                                        then a HEAD tells changed from deleted
az://      ``etag`` (a new value on every write)         verify-after: GET, then HEAD; another ETag
                                                        raises. Sound because Azure never reuses an
                                                        ETag, so an object that changed during the GET
                                                        cannot show the old one afterwards
hf://      ``lfs.sha256`` for LFS files, else             verify-after, as az://. Content hashes: an
           ``blob_id`` (the git blob SHA-1)             object rewritten and rewritten back *during one
                                                        GET* (A->B->A) is not detected: the only window
http(s)    the ``ETag`` response header (strong only:    ``If-Match: <etag>`` on the ``Range`` GET: the
           a weak ``W/`` tag is no identity)            server answers 412 for another version; the
                                                        ETag of the answer is checked too, for servers
                                                        that ignore ``If-Match``
memory://  MD5 of the content, as S3 gives (fsspec's     verify-after; for tests: the identity costs a
           memory files carry none of their own)        read of the whole object on every HEAD/listing
=========  ==========================================  ==============================================

An http(s) ETag is only as good as the server makes it: nginx and aiohttp derive it from the
file's mtime and size, so a file rewritten with the same size within the mtime's resolution (one
second for nginx) keeps its ETag and cannot be told apart. A file served without a strong ETag is
left out of listings (one warning per key) and answers ``ObjectStoreError`` to ``head``.

Listing. ``list_dir`` asks fsspec's ``ls`` and turns names back into keys relative to the root.
fsspec lists an http(s) directory by fetching its URL and taking the ``<a href>`` links below it
from the HTML (an autoindex page, as nginx, Apache or ``python -m http.server`` serve): a directory
without an index page lists as empty, links ending in ``/`` are directories, links with a query
(Apache's sort links) or outside the directory are ignored, and since an index gives no sizes or
ETags, every file listed costs one HEAD (bounded, in parallel). Listings count one list request;
those HEADs count as head requests.

HTTP requests. ``head`` and ``get_range`` on http(s) use the aiohttp session of fsspec's
``HTTPFileSystem`` directly, not its ``info``/``cat_file``: ``info`` turns every failure (a 503,
a refused connection) into ``FileNotFoundError``, which would make an outage look like deleted
files, and ``cat_file`` hides the status and headers the version check needs.

Concurrency and time. Every call holds one of ``max_concurrency`` slots; a synchronous filesystem
(memory, the Hub) is called through ``asyncio.to_thread``, an asynchronous one (http, gcsfs, adlfs)
is created inside the running loop with ``asynchronous=True``, so no hidden sync loop is involved.
The per-request deadline of ``tiering.storehealth`` bounds each call, and aiohttp's connect and
read timeouts bound each http(s) socket.

Writes. All these sources are read-only: ``put``/``delete``/``copy`` raise ``ReadOnlySourceError``
(EROFS), and ``cachefs mount`` refuses a writable mount of them. Credentials come from each
library's own chain (``GOOGLE_APPLICATION_CREDENTIALS``, ``AZURE_STORAGE_*``, ``HF_TOKEN``, their
config files) and fsspec's configuration (``FSSPEC_CONFIG_DIR``, ``FSSPEC_<PROTOCOL>_<OPTION>``),
never from the URL or the command line, and are never formatted into a message here.
"""

from __future__ import annotations

import asyncio
import email.utils
import errno
import logging
from datetime import datetime
from typing import Any, AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from urllib.parse import quote, unquote

import aiohttp
import fsspec
import yarl
from fsspec.registry import known_implementations

from tiering.errors import (
    AccessDeniedError,
    ObjectChangedError,
    ObjectNotFoundError,
    ObjectStoreError,
    ObjectStoreUnavailableError,
    ReadOnlySourceError,
)
from tiering.handoff import AfterReceive
from tiering.objectstore import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_READ_TIMEOUT_S, Source
from tiering.objectstore.fsspec_sources import FSSPEC_PROTOCOLS
from tiering.objectstore.keys import check_key, check_list_prefix, check_range, check_write_key, key_room
from tiering.objectstore.memory import md5_etag
from tiering.protocols import ANY_VERSION, Listing, ObjectInfo, ObjectStoreStats, ReadRange
from tiering.storehealth import request_timeout

log = logging.getLogger(__name__)

# Calls in flight per store: as the S3 store's connection pool (16 block fetches plus listing and
# HEAD traffic), so a listing's HEADs cannot starve reads.
DEFAULT_MAX_CONCURRENCY = 32
# An http(s) listing HEADs every file it finds (an index page gives no ETags); at most this many
# of them at once, leaving the other slots to reads.
LISTING_HEADS_IN_FLIGHT = 16
# At mount, an http(s) source is checked for ETags on at most this many files, found in at most
# this many directory listings (breadth first): enough to tell a server that sends none from a
# dynamic page among static files, in a handful of requests whatever the size of the tree.
VERSION_PROBE_FILES = 3
VERSION_PROBE_LISTINGS = 8
# Keys remembered so that a file without a version identity is warned about once, not per listing.
MAX_WARNED_KEYS = 10_000


class UnversionedObjectError(ObjectStoreError):
    """The filesystem gives this object no version identity (an http file without a strong ETag)."""


def known_protocol(scheme: str) -> bool:
    """Whether fsspec has (or knows where to find) a filesystem for ``scheme``."""
    return scheme in known_implementations


def _mtime(info: dict[str, Any]) -> float:
    """Seconds since the epoch from whichever field the filesystem gives (0.0 if none)."""
    for name in ("mtime", "updated", "last_modified", "Last-Modified", "created"):
        value = info.get(name)
        if value is None:
            continue
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, str):
            try:
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                pass
            try:
                return email.utils.parsedate_to_datetime(value).timestamp()
            except (TypeError, ValueError):
                pass
    return 0.0


def _version(protocol: str, info: dict[str, Any]) -> str | None:
    """The version identity of one object from its ``info()`` (None: it has none usable)."""
    if protocol in ("http", "https"):
        tag = info.get("ETag")
        return tag if isinstance(tag, str) and tag and not tag.startswith("W/") else None
    if protocol == "gs":
        value = info.get("generation")
    elif protocol == "az":
        value = info.get("etag")
    elif protocol == "hf":
        lfs = info.get("lfs")
        value = lfs.get("sha256") if isinstance(lfs, dict) else None
        value = value or info.get("blob_id")
    else:
        value = info.get("md5")  # memory: filled in by the store (_with_memory_md5)
    return str(value) if value not in (None, "") else None


def _classify(exc: BaseException, what: str) -> ObjectStoreError:
    """An exception of fsspec, aiohttp or a backend as a ``tiering.errors`` type, by type and status."""
    if isinstance(exc, ObjectStoreError):
        return exc
    if isinstance(exc, FileNotFoundError):
        return ObjectNotFoundError(f"no such object: {what}")
    if isinstance(exc, PermissionError):
        return AccessDeniedError(f"access denied: {what}")
    if isinstance(exc, aiohttp.ClientResponseError):
        return _status_error(exc.status, what)
    if isinstance(exc, (TimeoutError, aiohttp.ClientConnectionError, ConnectionError)):
        return ObjectStoreUnavailableError(f"{what}: {type(exc).__name__} (store unreachable or too slow)")
    if isinstance(exc, OSError) and exc.errno in (errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EHOSTUNREACH):
        return ObjectStoreUnavailableError(f"{what}: {type(exc).__name__} (store unreachable)")
    return ObjectStoreError(f"{what}: {type(exc).__name__}")


def _status_error(status: int, what: str) -> ObjectStoreError:
    if status == 404 or status == 410:
        return ObjectNotFoundError(f"no such object: {what} (HTTP {status})")
    if status in (401, 403):
        return AccessDeniedError(f"access denied: {what} (HTTP {status})")
    if status == 412:
        return ObjectChangedError(f"object changed: {what} (HTTP 412 to If-Match)")
    if status == 429 or status >= 500:
        return ObjectStoreUnavailableError(f"{what}: HTTP {status}")
    return ObjectStoreError(f"{what}: unexpected HTTP {status}")


class FsspecObjectStore:
    """An ``ObjectStore`` over an fsspec filesystem, for the protocols of ``fsspec_sources``. Read-only.

    ``filesystem`` is for tests (an instance to use instead of one made from the protocol).
    """

    def __init__(
        self,
        source: Source,
        *,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
        filesystem: Any = None,
    ) -> None:
        protocol = FSSPEC_PROTOCOLS.get(source.scheme)
        if protocol is None:
            raise ValueError(f"{source.scheme}:// is not an fsspec source of cachefs")
        if filesystem is None:
            try:
                self._fs_class: Any = fsspec.get_filesystem_class(source.scheme)
            except ImportError as exc:
                raise ValueError(f"{source.scheme}:// sources need the {protocol.package} package: "
                                 f"pip install 'cachefs-fuse[{protocol.extra}]'") from exc
        self.stats = ObjectStoreStats()
        self.source = source
        self.protocol = source.scheme
        self._read = protocol.read
        self._http = source.scheme in ("http", "https")
        self.max_key_bytes = key_room(source.prefix)
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._slots = asyncio.Semaphore(max_concurrency)
        self._fs: Any = filesystem
        self._making = asyncio.Lock()
        self._session: aiohttp.ClientSession | None = None
        self._warned: set[str] = set()
        if self._http:
            self._root = f"{source.scheme}://{source.bucket}/" + quote(source.prefix, safe="/")
        elif source.scheme == "memory":
            self._root = f"/{source.bucket}/{source.prefix}"
        else:
            self._root = f"{source.bucket}/{source.prefix}"

    def __repr__(self) -> str:
        return f"FsspecObjectStore({self.source.url!r})"

    # -- plumbing -----------------------------------------------------------------------------------

    async def _filesystem(self) -> Any:
        """The filesystem, made on first use inside the running loop (its sessions belong to it)."""
        if self._fs is not None:
            return self._fs
        async with self._making:  # concurrent first calls make one filesystem (and one session)
            if self._fs is None:
                self._fs = await self._make_filesystem()
        return self._fs

    async def _make_filesystem(self) -> Any:
        # No instance shared with other code, and no listing cache: the filesystem layer keeps its
        # own TTL caches, and a version re-read after a GET must come from the store, not a cache.
        options: dict[str, Any] = {"skip_instance_cache": True, "use_listings_cache": False}
        if self._http:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout_s,
                                            sock_read=self._read_timeout_s)
            options.update(asynchronous=True, encoded=True, client_kwargs={"timeout": timeout})
        elif self._fs_class.async_impl:
            options["asynchronous"] = True
            if self.protocol == "gs":
                options["version_aware"] = True  # reads may name a generation (module docstring)
        fs = self._fs_class(**options)
        if self._http:
            self._session = await fs.set_session()
        return fs

    @asynccontextmanager
    async def _guard(self, what: str) -> AsyncIterator[None]:
        """One slot and the caller's deadline around a call; failures as ``tiering.errors`` types."""
        async with self._slots:
            try:
                async with asyncio.timeout(request_timeout()):
                    yield
            except ObjectStoreError:
                self.stats.errors += 1
                raise
            except Exception as exc:
                self.stats.errors += 1
                raise _classify(exc, what) from exc

    async def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """``fs.<name>(...)``: the coroutine ``_<name>`` of an async filesystem, else in a thread."""
        fs = await self._filesystem()
        if fs.async_impl:
            return await getattr(fs, "_" + name)(*args, **kwargs)
        method: Callable[..., Any] = getattr(fs, name)
        return await asyncio.to_thread(method, *args, **kwargs)

    def _path(self, key: str) -> str:
        """The filesystem path (an URL for http) of ``key``; keys that could leave the root are absent."""
        check_key(key)
        if key.startswith("/") or "//" in key or key.endswith("/"):
            raise ObjectNotFoundError(f"no such object: {key!r}")
        return self._root + (quote(key, safe="/") if self._http else key)

    def _where(self, key: str) -> str:
        return f"{key!r} in {self.source.url}"

    # -- reading --------------------------------------------------------------------------------------

    async def check(self) -> bool:
        self.stats.requests += 1
        self.stats.list_requests += 1
        async with self._guard(f"listing {self.source.url}"):
            try:
                entries = await self._ls(self._root)
            except FileNotFoundError:
                if self._http:
                    raise ObjectNotFoundError(f"{self.source.url}: no such directory on the server (HTTP 404)") from None
                entries = []
                if self.protocol in ("gs", "az") and not await self._call("exists", self.source.bucket):
                    raise ObjectNotFoundError(f"{self.protocol}:// bucket {self.source.bucket!r} not found") from None
        dirs, files = self._split(self._root, entries)
        if self._http:
            await self._check_versioned(dirs, files)
        return bool(dirs or files)

    async def _check_versioned(self, dirs: set[str], files: dict[str, dict[str, Any]]) -> None:
        """Refuse, at mount, a server that sends no strong ETag (``python -m http.server``, say).

        Without one, every file would be left out of the listings and the mount would show an empty
        tree, with the reason only in the daemon's log. The first few files found (breadth first,
        at most ``VERSION_PROBE_LISTINGS`` directory listings) are HEADed; if none of them has an
        ETag, ``UnversionedObjectError`` names the server and what to do. One file without a tag
        among tagged ones (a dynamic page) is no reason to refuse: it is left out, as in a listing."""
        pending = [(self._root, "", dirs, files)]
        probed = untagged = listings = 0
        example = ""
        while pending and probed < VERSION_PROBE_FILES:
            base, prefix, sub_dirs, sub_files = pending.pop(0)
            for name in sorted(sub_files)[: VERSION_PROBE_FILES - probed]:
                probed += 1
                try:
                    await self.head(prefix + name)
                except UnversionedObjectError:
                    untagged += 1
                    example = example or prefix + name
                except ObjectNotFoundError:
                    pass  # gone since the listing: says nothing about the server
            for name in sorted(sub_dirs):
                if listings >= VERSION_PROBE_LISTINGS:
                    break
                listings += 1
                path = base + (quote(name, safe="/") + "/")
                self.stats.requests += 1
                self.stats.list_requests += 1
                try:
                    async with self._guard(f"listing {path}"):
                        entries = await self._ls(path)
                except ObjectNotFoundError:
                    continue  # a directory without an index page: nothing to probe there
                more_dirs, more_files = self._split(path, entries)
                pending.append((path, f"{prefix}{name}/", more_dirs, more_files))
        if probed and untagged == probed:
            raise UnversionedObjectError(
                f"{self.source.url}: the server sends no ETag (e.g. for {example!r}), so cachefs cannot tell "
                f"a changed file from an unchanged one and would serve none of them; serve the files with a "
                f"server that sends strong ETags (nginx, Apache, Caddy) or copy them to a bucket")

    async def _ls(self, path: str) -> list[dict[str, Any]]:
        if self._http:
            fs = await self._filesystem()
            entries = await fs._ls(path, detail=True)
        else:
            (await self._filesystem()).invalidate_cache(path.rstrip("/"))
            entries = await self._call("ls", path.rstrip("/") or "/", detail=True)
        return [entry for entry in entries if isinstance(entry, dict)]

    async def list_dir(self, prefix: str) -> Listing:
        check_list_prefix(prefix)
        self.stats.requests += 1
        self.stats.list_requests += 1
        base = self._root + (quote(prefix, safe="/") if self._http else prefix)
        async with self._guard(f"listing {prefix!r} in {self.source.url}"):
            try:
                entries = await self._ls(base)
            except FileNotFoundError:
                entries = []
        listing = Listing()
        listing.dirs, files = self._split(base, entries)
        for info in await self._infos(prefix, files):
            if info is not None:
                listing.files[info.key[len(prefix):]] = info
        return listing

    def _split(self, base: str, entries: list[dict[str, Any]]) -> tuple[set[str], dict[str, dict[str, Any]]]:
        """The child directories and files (name -> listing entry) of ``base`` among ``entries``."""
        dirs: set[str] = set()
        files: dict[str, dict[str, Any]] = {}
        for entry in entries:
            name = str(entry.get("name", ""))
            if not name.startswith(base):
                continue
            rest = name[len(base):]
            is_dir = entry.get("type") == "directory" or rest.endswith("/")
            rest = unquote(rest.rstrip("/")) if self._http else rest.rstrip("/")
            if not rest or "/" in rest or "?" in rest or "#" in rest or rest in (".", ".."):
                continue  # the directory itself, a link elsewhere, a sort link of an index page
            if is_dir:
                dirs.add(rest)
            else:
                files[rest] = entry
        return dirs, files

    async def _infos(self, prefix: str, files: dict[str, dict[str, Any]]) -> list[ObjectInfo | None]:
        """``ObjectInfo`` of listed files: from the listing entry where it has the version, else by HEAD."""
        heads = asyncio.Semaphore(LISTING_HEADS_IN_FLIGHT)

        async def one(name: str, entry: dict[str, Any]) -> ObjectInfo | None:
            key = prefix + name
            version = _version(self.protocol, entry)
            if version is not None and entry.get("size") is not None:
                return ObjectInfo(key, int(entry["size"]), version, _mtime(entry))
            async with heads:
                try:
                    return await self.head(key)
                except ObjectNotFoundError:
                    return None  # listed, but gone since (or a link to nothing)
                except UnversionedObjectError as exc:
                    if key not in self._warned and len(self._warned) < MAX_WARNED_KEYS:
                        self._warned.add(key)
                        log.warning("left out of the listing: %s", exc)
                    return None

        return list(await asyncio.gather(*(one(name, entry) for name, entry in files.items())))

    async def head(self, key: str) -> ObjectInfo:
        path = self._path(key)
        self.stats.requests += 1
        self.stats.head_requests += 1
        async with self._guard(self._where(key)):
            info = await (self._http_head(path) if self._http else self._info(path))
            if info.get("type") == "directory":
                raise ObjectNotFoundError(f"no such object: {self._where(key)} (a directory)")
            version = _version(self.protocol, info)
            if version is None:
                identity = FSSPEC_PROTOCOLS[self.protocol].identity
                raise UnversionedObjectError(f"{self._where(key)} has no version identity ({identity} missing): "
                                             "not served")
        return ObjectInfo(key, int(info.get("size") or 0), version, _mtime(info))

    async def _info(self, path: str) -> dict[str, Any]:
        (await self._filesystem()).invalidate_cache(path)  # a backend that caches anyway must ask again
        info = dict(await self._call("info", path))
        if self.protocol == "memory" and info.get("type") == "file":
            info["md5"] = md5_etag(bytes(await self._call("cat_file", path)))
        return info

    async def _http_head(self, url: str) -> dict[str, Any]:
        await self._filesystem()
        assert self._session is not None
        headers = {"Accept-Encoding": "identity"}
        async with self._session.head(yarl.URL(url, encoded=True), headers=headers, allow_redirects=True) as r:
            if r.status != 200:
                raise _status_error(r.status, url)
            if str(r.url).endswith("/") and not url.endswith("/"):
                raise FileNotFoundError(url)  # redirected to a directory's index page
            length = r.headers.get("Content-Length")
            if length is None or r.headers.get("Content-Encoding", "identity") != "identity":
                raise ObjectStoreError(f"{url}: the server gives no plain Content-Length")
            return {"size": int(length), "ETag": r.headers.get("ETag"),
                    "Last-Modified": r.headers.get("Last-Modified"), "type": "file"}

    async def get_range(self, key: str, etag: str, start: int, end: int, *,
                        after: AfterReceive[Any] | None = None) -> bytes:
        # Receives on the loop (fsspec's async client): ``after`` stays unclaimed, for the caller to do.
        check_range(start, end)
        if start == end:
            return b""  # as every store: nothing to read, so no request and no version check
        path = self._path(key)
        self.stats.requests += 1
        self.stats.get_requests += 1
        where = f"{self._where(key)} [{start}, {end})"
        async with self._guard(where):
            if self._http:
                data = await self._http_get(path, etag, start, end, where)
            elif self._read == "generation" and etag != ANY_VERSION:
                data = await self._generation_get(key, path, etag, start, end)
            else:
                data = bytes(await self._call("cat_file", path, start=start, end=end))
                if etag == ANY_VERSION:
                    self.stats.bytes_read += len(data)
                    return data
                self.stats.requests += 1
                self.stats.head_requests += 1
                now = _version(self.protocol, await self._info(path))
                if now != etag:
                    raise ObjectChangedError(f"object {self._where(key)} changed: version is now {now}, not {etag}")
        self.stats.bytes_read += len(data)
        return data

    async def _generation_get(self, key: str, path: str, etag: str, start: int, end: int) -> bytes:
        try:
            return bytes(await self._call("cat_file", f"{path}#{etag}", start=start, end=end))
        except FileNotFoundError:
            info = await self._info(path)  # FileNotFoundError again: the object is gone
            raise ObjectChangedError(f"object {self._where(key)} changed: generation is now "
                                     f"{_version(self.protocol, info)}, not {etag}") from None

    async def _http_get(self, url: str, etag: str, start: int, end: int, where: str) -> bytes:
        await self._filesystem()
        assert self._session is not None
        headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
        if etag != ANY_VERSION:
            headers["If-Match"] = etag
        async with self._session.get(yarl.URL(url, encoded=True), headers=headers, allow_redirects=False) as r:
            if r.status == 416:
                return b""  # the range starts at or past the end: clamped, as every store
            if r.status not in (200, 206):
                raise _status_error(r.status, where)
            returned = r.headers.get("ETag")
            if etag != ANY_VERSION and returned != etag:  # a server that ignores If-Match, or answers without a tag
                raise ObjectChangedError(f"object {where} changed: ETag is now {returned}, not {etag}")
            body = await r.read()
        if r.status == 200:
            return body[start:end]  # the server ignored Range and sent the whole object
        content_range = r.headers.get("Content-Range", "")
        if not content_range.startswith(f"bytes {start}-"):
            raise ObjectStoreError(f"{where}: the server answered another range ({content_range!r})")
        return body[:end - start]

    # -- writing: refused -----------------------------------------------------------------------------

    def _read_only(self, key: str) -> ReadOnlySourceError:
        check_write_key(key)
        self.stats.requests += 1
        self.stats.errors += 1
        return ReadOnlySourceError(f"{self.protocol}:// sources are read-only in cachefs: cannot write {key!r}")

    async def head_metadata(self, key: str) -> tuple[ObjectInfo, dict[str, str]]:
        """No user metadata is read from these sources: their own dates stand (``_mtime``)."""
        return await self.head(key), {}

    async def put(self, key: str, size: int, read: ReadRange, *,
                  metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        raise self._read_only(key)

    async def delete(self, key: str) -> None:
        raise self._read_only(key)

    async def copy(self, src: str, etag: str, dst: str, *,
                   metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        raise self._read_only(dst)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
