"""The S3 object store: s3fs/aiobotocore on the caller's asyncio loop.

How it talks to S3. One ``s3fs.S3FileSystem`` with ``asynchronous=True`` is created lazily, inside
the running loop on first use, so its aiohttp connection pool belongs to the loop that also serves
FUSE; no hidden sync loop in a thread. Requests go through ``S3FileSystem._call_s3`` (the raw
aiobotocore calls: ``list_objects_v2``, ``head_object``, ``get_object``), not through the
file-like layer, whose read-ahead and block caches would duplicate the engine's own. s3fs's listing
cache is off: the filesystem keeps its own TTL caches and must see a fresh listing when it asks.

Retries and time limits. botocore's "standard" retry mode retries throttling, 5xx and connection
errors with jittered backoff, ``S3_MAX_ATTEMPTS`` attempts in all; s3fs's own retry loop is cut to
one pass so the two do not multiply. Connect and read timeouts bound every attempt, so a dead
endpoint fails in seconds (``check()``) and a reader is never parked on a hung socket. A listing is
bounded as a whole too, whatever the server answers: ``MAX_LIST_PAGES`` pages, ``LIST_DEADLINE_S``
seconds, and no continuation token twice (``list_dir``; an ``ObjectStoreError``, EIO, naming the
directory). A ranged GET is bounded by its caller's deadline however slowly the body comes
(``tiering.objectstore.rangedget``).

Consistency. ``get_range`` sends ``If-Match: <etag>`` with the ``Range``: a server that has a newer
object answers 412 and we raise ``ObjectChangedError``; the returned ``ETag`` header is checked too,
for servers that ignore ``If-Match``. Blocks cached under the old ETag are then never served for
the new object (see ``tiering.blocks``).

Ranged GETs on a presigned URL. botocore spends about 4 ms of CPU on every request (parameter
validation, event hooks, signing, response parsing): measured on SeaweedFS over loopback, a 100 KiB
``get_object`` took 5.6-6.6 ms, the same GET through aiohttp on a presigned URL 1.7-2.3 ms, and the
presigning itself 0.4 ms (0.16 ms since ``tiering.objectstore.s3presign`` signs every key after the
first without the client's per-call machinery). So ``get_range`` presigns ``GetObject`` and sends
each ``Range`` + ``If-Match`` GET from a worker thread of its own (``tiering.objectstore.rangedget``:
the body is received off the event loop, straight into the block's buffer, and no redirect is ever
followed; a range under ``CURL_MAX_BYTES``, a small file's block, goes through one libcurl multi
handle in one thread instead, a quarter of the CPU per GET: ``tiering.objectstore.getengines``). The
URL of every key after the first is signed in that thread, as it sends the GET
(``UrlSigner.sign_later``; the credentials are taken on the loop): signing was 6-10% of the event
loop's GIL samples in a cold pass of small files (issue 35), one URL per file; such URLs are not
kept, each block signs its own (7 us). The first URL, the client's, is kept for its key
(``PRESIGN_TTL_S``, reused for ``PRESIGN_REUSE_S``, at most ``PRESIGN_CACHE_KEYS`` keys), as are all
where the URL's shape could not be learned. Only answers it can read without
botocore are taken from that path: 206/200 with the exact length, 412 (changed), 416 (past the end),
404 with the error code ``NoSuchKey`` (absent: the cluster tier's miss costs one request, not two).
Anything else (403, 404, 5xx, a connection error or timeout, a store without credentials to
presign with) drops the URL and repeats the request through botocore, so retries, error
classification and messages are those of every other request. A presigned URL carries the access key
ID, the signature and any session token: it is kept in memory only and never logged or put in an
error message.

Errors. Every failure goes through ``classify_error`` (``tiering.objectstore.s3errors``), which maps
exception *types* and S3 error *codes* / HTTP statuses (never message text) to a ``tiering.errors``
type with a one-line message.
Messages name the bucket, the key and the endpoint, never credentials: those come only from the
standard AWS chain, are never passed, logged or formatted by this module.

Writes (write-back). ``put`` sends content up to ``part_size`` bytes (16 MiB by default) as one
PutObject; larger content as a multipart upload whose parts go up in parallel, each read from the
staged file only when its turn comes. One semaphore per store bounds the parts (and single PUTs)
in flight, and with it the memory of all uploads together: ``MAX_UPLOAD_PARTS_IN_FLIGHT`` parts.
PutObject and CompleteMultipartUpload are atomic on S3: a reader sees the old object or the whole
new one. A multipart upload that fails or is cancelled is aborted; one cut short by a crash of the
daemon stays incomplete on the server (invisible, but billed) until the bucket's
AbortIncompleteMultipartUpload lifecycle rule removes it. ``copy`` (rename) is a server-side
CopyObject guarded by ``CopySourceIfMatch``, or UploadPartCopy parts above CopyObject's 5 GiB limit.
User metadata (the writer's ``mtime``, ``tiering.objectstore.mtimes``) goes with the PutObject or the
CreateMultipartUpload; a copy keeps the source's (a multipart copy is created with it), and a copy
onto itself with new metadata (REPLACE) is how an mtime changes without re-uploading the bytes.

Credentials and ``environ`` (``tiering.objectstore.s3session``). The botocore session is built so that its configuration chain
(profile, config and credentials file paths, region, ...) and its environment credential provider
read the ``environ`` mapping given to the store instead of ``os.environ``: tests can hand a store
the environment of one server without touching the process's; ``AWS_EC2_METADATA_DISABLED=true`` in
it drops the EC2 instance-metadata provider. The other providers (ECS container, web identity, SSO)
are the standard ones and read the process environment.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Any, Callable, Mapping

import aiohttp
import s3fs

from tiering.errors import (
    ObjectChangedError,
    ObjectNotFoundError,
    ObjectStoreError,
)
from tiering.objectstore import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_READ_TIMEOUT_S
from tiering.objectstore.keys import (
    check_key,
    check_list_prefix,
    check_range,
    check_write_key,
    key_room,
    split_listing_key,
)
from tiering.objectstore.redirects import NO_REDIRECT_CONFIG
from tiering.objectstore.getengines import GetEngines
from tiering.objectstore.rangedget import RangeAnswer, Url
from tiering.objectstore.s3presign import UrlSigner
from tiering.objectstore.s3session import aws_session, check_endpoint, configured_endpoint_url, proxied
from tiering.objectstore.s3errors import (
    INVALID_RANGE_CODES,
    NOT_FOUND_CODES,
    changed_error,
    classify_error,
    client_error_code,
    not_s3_error,
)
from tiering.blocks import BlockData
from tiering.handoff import AfterReceive
from tiering.protocols import ANY_VERSION, Listing, ObjectInfo, ObjectStoreStats, ReadRange
from tiering.storehealth import request_timeout

log = logging.getLogger(__name__)

# Connection pool: 16 concurrent block fetches (DEFAULT_MAX_CONCURRENT_FETCHES) plus listing and
# HEAD traffic without queueing behind the pool; botocore's default of 10 would cap the fetches.
# Ranged GETs go through their own threads (tiering.objectstore.rangedget), half of this: one thread
# and one connection per block fetch in flight; botocore keeps the other half for everything else.
# Small ranges go through libcurl (tiering.objectstore.curlget), with as many connections at most.
DEFAULT_MAX_POOL_CONNECTIONS = 32
# Attempts per request in botocore's standard mode (first try included): one retry rides out a
# dropped keep-alive connection, a second a short 503/SlowDown burst; more only delays the error a
# reader gets anyway, and the engine bounds each fetch with its own timeout.
S3_MAX_ATTEMPTS = 3
# s3fs wraps each call in its own retry loop (5 passes, backoff up to 15 s); one pass leaves retries
# to botocore alone, so the time to fail is bounded by S3_MAX_ATTEMPTS x the timeouts above.
S3FS_PASSES = 1
# Presigned GetObject URLs (see the module docstring): valid for 15 min, reused for 10 (so a URL is
# never used in its last 5 minutes, whatever the clock skew between here and the store), for the
# most recently read keys.
PRESIGN_TTL_S = 900
PRESIGN_REUSE_S = 600.0
PRESIGN_CACHE_KEYS = 4096
# After this many presigned GETs in a row had to be repeated through botocore (a store that refuses
# query-string authentication, say), the store stops trying them: each costs a wasted request.
PRESIGN_MAX_FALLBACKS = 8
# Keys per ListObjectsV2 page: S3's maximum. Fewer pages, fewer round trips for large directories.
LIST_PAGE_SIZE = 1000
# One listing of one directory ends, with an error naming the directory, after this many pages or
# this long, whatever the server says: a server that answers every page with a new continuation
# token (or the same one) would otherwise grow the daemon forever while `ls` waits in the kernel
# (issue 34: 100 -> 340 MB in 4 minutes). 1,000 pages are a million direct children, ~390 bytes each
# in the listing (measured: ObjectInfo and its name) and as much again in the listing cache: ~0.8 GB,
# the most one directory may cost a daemon whose default mount pod has 1.3 GiB. 300 s covers those
# pages at 300 ms each, five times the ~60 ms S3 takes for a page of 1,000 keys. A repeated
# continuation token is an error at once: S3 never sends one twice in a listing.
MAX_LIST_PAGES = 1_000
LIST_DEADLINE_S = 300.0

MiB = 1024 * 1024
# Multipart part size (and the size above which an upload is multipart): 16 MiB. S3 wants at least
# 5 MiB per part; per-request costs flatten out around 8-16 MiB (benchmarks/blocksize.py measured
# GETs, which pay the same fixed costs), and 10,000 parts of 16 MiB cover objects up to 156 GiB
# before the part size has to grow (it does, see _part_size_for).
DEFAULT_PART_SIZE = 16 * MiB
MIN_PART_SIZE = 5 * MiB  # S3's minimum for every part but the last
MAX_PARTS = 10_000  # S3's maximum number of parts
# Parts (and single PUTs) being sent at once, per store: 8 x 16 MiB = 128 MiB of upload buffers at
# most, and 8 streams fill a 10 Gbit/s link at the ~150 MiB/s one S3 connection typically carries.
MAX_UPLOAD_PARTS_IN_FLIGHT = 8
# CopyObject copies at most 5 GiB; larger sources are copied with UploadPartCopy parts of this size.
MAX_COPY_OBJECT_BYTES = 5 * 1024 * MiB
COPY_PART_SIZE = 512 * MiB
# Headers of an object that a copy with new metadata (MetadataDirective REPLACE) or a multipart copy
# would drop unless sent again: what a HEAD returns of them is passed on (boto3's parameter names).
_REPLACED_HEADERS = ("ContentType", "ContentEncoding", "ContentDisposition", "ContentLanguage", "CacheControl")
# How long aborting a failed multipart upload may take; it is a courtesy (the upload is invisible),
# so it must never hold up the error the caller is waiting for.
ABORT_TIMEOUT_S = 10.0

def _strip_etag(etag: str) -> str:
    etag = etag.strip()
    if etag.startswith("W/"):
        etag = etag[2:]
    return etag.strip('"')


def _etag_matches(returned: str | None, etag: str) -> bool:
    """Whether an answer with ETag header ``returned`` is the version asked for (no header: trusted,
    If-Match having been sent; servers that ignore If-Match show their ETag)."""
    return etag == ANY_VERSION or returned is None or _strip_etag(returned) == _strip_etag(etag)


def _then(after: AfterReceive[Any], etag: str) -> Callable[[RangeAnswer], Callable[[], None] | None]:
    """For the GET engines' ``get``: ``after`` claimed, in the receiving thread, for an answer
    ``_presigned_get`` returns (the exact range, the version asked for), and run in that thread once the
    answer is handed over."""
    def then(answer: RangeAnswer) -> Callable[[], None] | None:
        data = answer.data
        if data is None or not _etag_matches(answer.etag, etag):
            return None
        after.claim()
        return lambda: after.run(data)
    return then


def _quote_etag(etag: str) -> str:
    """The ETag in the quoted form listings and HEAD give (some servers answer writes without quotes)."""
    return f'"{_strip_etag(etag)}"'


class S3ObjectStore:
    """An ``ObjectStore`` over ``s3://bucket/prefix``. Use from one event loop; ``close()`` when done."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        max_pool_connections: int = DEFAULT_MAX_POOL_CONNECTIONS,
        part_size: int = DEFAULT_PART_SIZE,
        max_list_pages: int = MAX_LIST_PAGES,
        list_deadline_s: float = LIST_DEADLINE_S,
        environ: Mapping[str, str],
    ) -> None:
        check_list_prefix(prefix)
        if max_list_pages < 1 or not list_deadline_s > 0:
            raise ValueError("a listing needs at least one page and a positive deadline")
        if endpoint_url is None:
            endpoint_url = configured_endpoint_url(environ)  # and told to botocore: one place decides
        if endpoint_url is not None:
            check_endpoint(endpoint_url)
        if not (0 < connect_timeout_s <= 600 and 0 < read_timeout_s <= 3600):
            raise ValueError("S3 timeouts must be positive (connect <= 600 s, read <= 3600 s)")
        if not 1 <= max_pool_connections <= 4096:
            raise ValueError("S3 connection pool size must be between 1 and 4096")
        if not MIN_PART_SIZE <= part_size <= 5 * 1024 * MiB:
            raise ValueError(f"S3 part size must be between {MIN_PART_SIZE} bytes and 5 GiB")
        self.bucket = bucket
        self.prefix = prefix
        self.max_key_bytes = key_room(prefix)
        self.endpoint_url = endpoint_url
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_pool_connections = max_pool_connections
        self.part_size = part_size
        self.max_list_pages = max_list_pages
        self.list_deadline_s = list_deadline_s
        self.stats = ObjectStoreStats()
        self._upload_slots = asyncio.Semaphore(MAX_UPLOAD_PARTS_IN_FLIGHT)
        self._aborts: set[asyncio.Task[None]] = set()  # multipart aborts under way (``_abort_later``)
        self._environ = dict(environ)
        self._fs: s3fs.S3FileSystem | None = None
        self._client: Any = None
        self._gets = GetEngines(connections=max(1, max_pool_connections // 2), connect_timeout_s=connect_timeout_s,
                                read_timeout_s=read_timeout_s, ca_bundle=self._environ.get("AWS_CA_BUNDLE") or None)
        self._presigned: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._signer: UrlSigner | None = None
        self._presign_ok = True  # False once presigning failed (e.g. anonymous access): botocore only
        self._fallbacks_in_a_row = 0

    def __repr__(self) -> str:
        return f"S3ObjectStore(s3://{self.bucket}/{self.prefix}, endpoint={self._endpoint_name})"

    @property
    def _endpoint_name(self) -> str:
        return self.endpoint_url or "(AWS default)"

    def _where(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{self.prefix}{key}"

    # -- plumbing -----------------------------------------------------------------------------------

    def _filesystem(self) -> s3fs.S3FileSystem:
        """The s3fs filesystem, created on first use inside the running loop."""
        if self._fs is None:
            asyncio.get_running_loop()  # raises outside a loop: this store is async-only
            client_kwargs: dict[str, Any] = {}
            if self.endpoint_url is not None:
                client_kwargs["endpoint_url"] = self.endpoint_url
            region = self._environ.get("AWS_REGION") or self._environ.get("AWS_DEFAULT_REGION")
            if region:
                client_kwargs["region_name"] = region
            fs = s3fs.S3FileSystem(
                asynchronous=True,
                skip_instance_cache=True,  # one client per store, on this loop; never shared
                use_listings_cache=False,  # the filesystem layer has its own TTL caches
                session=aws_session(self._environ),
                client_kwargs=client_kwargs,
                config_kwargs={
                    "connect_timeout": self.connect_timeout_s,
                    "read_timeout": self.read_timeout_s,
                    "retries": {"total_max_attempts": S3_MAX_ATTEMPTS, "mode": "standard"},
                    "max_pool_connections": self.max_pool_connections,
                    # Requests are signed with SigV4 anyway; presigned URLs would default to the
                    # deprecated SigV2 query signature, which new AWS regions refuse.
                    "signature_version": "s3v4",
                    # The endpoint is the one given or configured_endpoint_url's, never one botocore
                    # finds later in the process's own environment (the identity must name it).
                    "ignore_configured_endpoint_urls": True,
                    **NO_REDIRECT_CONFIG,  # credentials never follow a redirect (tiering.objectstore.redirects)
                },
            )
            fs.retries = S3FS_PASSES
            self._fs = fs
        return self._fs

    async def _session(self) -> Any:
        """The aiobotocore S3 client of the s3fs filesystem, opened on first use."""
        if self._client is None:
            self._client = await self._filesystem().set_session()
        return self._client

    async def _call(self, method: str, *, op: str, where: str, tolerate: frozenset[str] = frozenset(),
                    **kwargs: Any) -> Any:
        """One S3 request through s3fs, counted, with every failure classified.

        An S3 error whose code is in ``tolerate`` is not a failure: None is returned instead.
        """
        fs = self._filesystem()
        self.stats.requests += 1
        try:
            await self._session()
            async with asyncio.timeout(request_timeout()):  # the caller's deadline, if any (storehealth)
                return await fs._call_s3(method, Bucket=self.bucket, **kwargs)
        except Exception as exc:
            coded = client_error_code(exc)
            if coded is not None and coded[0] in tolerate:
                return None
            self.stats.errors += 1
            raise classify_error(exc, op=op, where=where, bucket=self.bucket, endpoint=self._endpoint_name) from exc

    def _check_key(self, key: str) -> None:
        try:
            check_key(key)
        except ObjectNotFoundError:
            self.stats.errors += 1
            raise

    # -- ObjectStore --------------------------------------------------------------------------------

    async def check(self) -> bool:
        """One ListObjectsV2 (MaxKeys=1) on the root prefix: proves the bucket exists and is listable,
        and tells whether anything lies under the prefix."""
        self.stats.list_requests += 1
        page = await self._call("list_objects_v2", op="LIST", where=self._where(), Prefix=self.prefix, MaxKeys=1)
        if "Name" not in page and "MaxKeys" not in page:  # every ListBucketResult names its bucket
            raise not_s3_error("LIST", self._where(), self._endpoint_name, "its answer to a LIST is not an S3 listing")
        return bool(page.get("Contents")) or int(page.get("KeyCount") or 0) > 0

    async def create_bucket(self) -> bool:
        """CreateBucket of this store's bucket: True if made now, False if it exists already (a setup
        step, ``cachefs cluster init``; never part of serving)."""
        made = await self._call("create_bucket", op="CREATE", where=self._where(),
                                tolerate=frozenset({"BucketAlreadyOwnedByYou", "BucketAlreadyExists"}))
        return made is not None

    async def list_dir(self, prefix: str) -> Listing:
        """The direct children of ``prefix``: every page of ListObjectsV2, within ``max_list_pages``
        pages and ``list_deadline_s`` seconds, no continuation token twice (``ObjectStoreError``, EIO)."""
        check_list_prefix(prefix)
        try:
            async with asyncio.timeout(self.list_deadline_s):
                return await self._list_pages(prefix)
        except TimeoutError:
            self.stats.errors += 1
            raise ObjectStoreError(f"LIST {self._where(prefix)}: not finished after {self.list_deadline_s:g} s "
                                   f"(a listing's limit); the server may be sending pages without end") from None

    async def _list_pages(self, prefix: str) -> Listing:
        full = self.prefix + prefix
        listing = Listing()
        token: str | None = None
        seen: set[str] = set()
        for _page in range(self.max_list_pages):
            kwargs: dict[str, Any] = {"Prefix": full, "Delimiter": "/", "MaxKeys": LIST_PAGE_SIZE}
            if token is not None:
                kwargs["ContinuationToken"] = token
            self.stats.list_requests += 1
            page = await self._call("list_objects_v2", op="LIST", where=self._where(prefix), **kwargs)
            for item in page.get("Contents", ()):
                split = split_listing_key(full, item["Key"])
                if split is None:
                    continue  # the marker object of the listed prefix itself
                name, is_dir = split
                if is_dir:
                    listing.dirs.add(name)
                else:
                    listing.files[name] = ObjectInfo(
                        key=item["Key"][len(self.prefix):],
                        size=int(item["Size"]),
                        etag=item["ETag"],
                        mtime=item["LastModified"].timestamp(),
                    )
            for common in page.get("CommonPrefixes", ()):
                split = split_listing_key(full, common["Prefix"])
                if split is not None:
                    listing.dirs.add(split[0])
            if not page.get("IsTruncated"):
                return listing
            token = page.get("NextContinuationToken")
            if not token:
                self.stats.errors += 1
                raise ObjectStoreError(f"LIST {self._where(prefix)}: truncated page without a continuation token")
            if token in seen:
                self.stats.errors += 1
                raise ObjectStoreError(f"LIST {self._where(prefix)}: the server sent a continuation token a second "
                                       f"time (the listing would never end)")
            seen.add(token)
        self.stats.errors += 1
        raise ObjectStoreError(f"LIST {self._where(prefix)}: more than {self.max_list_pages} pages of "
                               f"{LIST_PAGE_SIZE} keys (a listing's limit); the server may be sending pages without end")

    def _check_returned_etag(self, returned: str | None, etag: str, where: str) -> None:
        """For servers that ignore If-Match: a GET answered with another version is a change."""
        if not _etag_matches(returned, etag):
            self.stats.errors += 1
            raise changed_error(where)

    async def _presign(self, key: str) -> Url | None:
        """A presigned GetObject URL for ``key`` (cached), or what signs it in the GET worker
        (``UrlSigner.sign_later``: not cached, signed again for each block, off the loop), or None
        where the store cannot presign."""
        now = time.monotonic()
        cached = self._presigned.get(key)
        if cached is not None and cached[1] > now:
            self._presigned.move_to_end(key)
            return cached[0]
        if not self._presign_ok:
            return None
        try:
            signer = self._signer or await self._url_signer()
            later = await signer.sign_later(self.prefix + key)
            if later is not None:
                return later
            url = await signer.sign(self.prefix + key)
        except Exception as exc:  # noqa: BLE001 - no presigning (no credentials, ...): botocore serves GETs
            self._presign_ok = False
            log.info("ranged GETs go through botocore only: cannot presign (%s)", type(exc).__name__)
            return None
        if not self._presigned and proxied(url):
            # botocore sends requests through the environment's proxy; so would this path, but its
            # session does not read the environment (aiohttp would read ~/.netrc on every request).
            self._presign_ok = False
            log.info("ranged GETs go through botocore only: the endpoint is reached through a proxy")
            return None
        self._presigned[key] = (url, now + PRESIGN_REUSE_S)
        if len(self._presigned) > PRESIGN_CACHE_KEYS:
            self._presigned.popitem(last=False)
        return url

    async def _url_signer(self) -> UrlSigner:
        if self._signer is None:
            client = await self._session()
            credentials = await self._filesystem().session.get_credentials()  # the client's, cached
            self._signer = UrlSigner(client, credentials, self.bucket, PRESIGN_TTL_S)
        return self._signer

    async def _presigned_get(self, key: str, etag: str, start: int, end: int, where: str,
                             after: AfterReceive[Any] | None) -> BlockData | None:
        """Bytes ``[start, end)`` by a GET on a presigned URL; None to have botocore do the request.

        Received in a worker thread straight into the block's buffer (``tiering.objectstore.rangedget``).
        Raises only ``ObjectChangedError`` (412, or another ETag answered); returns b"" for 416.
        ``after`` is claimed and run by that worker for the answers returned here (the range in full,
        the ETag asked for: the same test as below), and for no other.
        """
        url = await self._presign(key)
        if url is None:
            return None
        self.stats.requests += 1
        headers = {"Range": f"bytes={start}-{end - 1}"}
        if etag != ANY_VERSION:
            headers["If-Match"] = etag
        status = 0
        try:
            answer = await self._gets.for_length(end - start).get(url, headers, end - start,
                                              None if after is None else _then(after, etag))
            status = answer.status
            if status == 412:
                self.stats.errors += 1
                raise changed_error(where)
            if status == 416:
                return b""
            if status == 404 and answer.error_code in NOT_FOUND_CODES:
                # Absent: final, and the cheap miss of the cluster tier (one request, not two).
                self.stats.errors += 1
                raise ObjectNotFoundError(f"GET {where}: not found")
            if answer.data is not None:
                if etag != ANY_VERSION:
                    self._check_returned_etag(answer.etag, etag, where)
                self.stats.presigned_gets += 1
                self._fallbacks_in_a_row = 0
                return answer.data
        except ObjectStoreError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of the fast path: botocore repeats the GET
            # Neither the URL nor the exception's text is logged or kept: they can carry the
            # signature (and any session token). botocore's own attempt gives the reader its error.
            log.debug("presigned GET of %s failed (%s); retrying through botocore", where, type(exc).__name__)
        else:
            log.debug("presigned GET of %s answered %d; retrying through botocore", where, status)
        self._presigned.pop(key, None)
        self.stats.presigned_fallbacks += 1
        self._fallbacks_in_a_row += 1
        if self._fallbacks_in_a_row >= PRESIGN_MAX_FALLBACKS:
            self._presign_ok = False
            self._presigned.clear()
            log.info("ranged GETs go through botocore only: %d presigned GETs in a row failed", self._fallbacks_in_a_row)
        return None

    async def head(self, key: str) -> ObjectInfo:
        self._check_key(key)
        self.stats.head_requests += 1
        response = await self._call("head_object", op="HEAD", where=self._where(key), Key=self.prefix + key)
        return ObjectInfo(
            key=key,
            size=int(response["ContentLength"]),
            etag=response["ETag"],
            mtime=response["LastModified"].timestamp(),
        )

    async def get_range(self, key: str, etag: str, start: int, end: int, *,
                        after: AfterReceive[Any] | None = None) -> BlockData:
        check_range(start, end)
        if start == end:
            return b""
        self._check_key(key)
        where = self._where(key)
        self.stats.get_requests += 1
        fast = await self._presigned_get(key, etag, start, end, where, after)
        if fast is not None:
            self.stats.bytes_read += len(fast)
            return fast
        condition = {} if etag == ANY_VERSION else {"IfMatch": etag}
        response = await self._call(
            "get_object", op="GET", where=where, tolerate=INVALID_RANGE_CODES,
            Key=self.prefix + key, Range=f"bytes={start}-{end - 1}", **condition,
        )
        if response is None:
            # 416: the range starts at or past the end. If-Match is evaluated before the range (412
            # wins over 416 on S3, SeaweedFS and moto), so this is the version asked for: clamp to b"".
            return b""
        body = response["Body"]
        try:
            if etag != ANY_VERSION:
                self._check_returned_etag(response.get("ETag"), etag, where)
            data = await body.read()
        except ObjectStoreError:
            raise
        except Exception as exc:
            self.stats.errors += 1
            raise classify_error(exc, op="GET", where=where, bucket=self.bucket,
                                 endpoint=self._endpoint_name) from exc
        finally:
            body.close()
        self.stats.bytes_read += len(data)
        return data

    # -- writes -------------------------------------------------------------------------------------

    def _part_size_for(self, size: int) -> int:
        """The part size: the configured one, grown (in whole MiB) so that at most MAX_PARTS are needed."""
        needed = -(-size // MAX_PARTS)
        return max(self.part_size, -(-needed // MiB) * MiB)

    async def _read(self, read: ReadRange, start: int, end: int, where: str) -> bytes:
        data = await asyncio.to_thread(read, start, end) if end > start else b""
        if len(data) != end - start:
            raise ObjectStoreError(f"PUT {where}: the staged source gave {len(data)} bytes for [{start}, {end})")
        if not isinstance(data, (bytes, bytearray)):
            data = bytes(data)  # a view of a block (botocore takes bytes, bytearray or a file)
        return data

    async def put(self, key: str, size: int, read: ReadRange, *,
                  metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        check_write_key(key)
        where = self._where(key)
        part_size = self._part_size_for(size)
        if size <= part_size:
            extra: dict[str, Any] = {"Metadata": dict(metadata)} if metadata else {}
            async with self._upload_slots:
                data = await self._read(read, 0, size, where)
                self.stats.put_requests += 1
                response = await self._call("put_object", op="PUT", where=where, Key=self.prefix + key, Body=data,
                                            **extra)
        else:
            response = await self._put_multipart(key, size, part_size, read, metadata=metadata)
        self.stats.bytes_written += size
        return ObjectInfo(key=key, size=size, etag=_quote_etag(response["ETag"]), mtime=time.time())

    async def _put_multipart(self, key: str, size: int, part_size: int, read: ReadRange,
                             conditions: dict[str, Any] | None = None,
                             metadata: Mapping[str, str] | None = None) -> Any:
        where = self._where(key)
        full = self.prefix + key
        self.stats.put_requests += 1
        extra: dict[str, Any] = {"Metadata": dict(metadata)} if metadata else {}
        created = await self._call("create_multipart_upload", op="PUT", where=where, Key=full, **extra)
        upload_id = created["UploadId"]
        count = -(-size // part_size)

        async def one(number: int) -> dict[str, Any]:
            start = (number - 1) * part_size
            end = min(size, start + part_size)
            async with self._upload_slots:
                data = await self._read(read, start, end, where)
                self.stats.put_requests += 1
                answer = await self._call("upload_part", op="PUT", where=f"{where} part {number}", Key=full,
                                          UploadId=upload_id, PartNumber=number, Body=data)
            part = {"ETag": answer["ETag"], "PartNumber": number}
            if answer.get("ChecksumCRC32"):
                part["ChecksumCRC32"] = answer["ChecksumCRC32"]
            return part

        parts: list[dict[str, Any]] = []
        numbers = iter(range(1, count + 1))

        async def worker() -> None:
            for number in numbers:  # a shared iterator: each part is taken by exactly one worker
                parts.append(await one(number))

        try:
            async with asyncio.TaskGroup() as group:  # the first failure cancels the other workers
                for _ in range(min(count, MAX_UPLOAD_PARTS_IN_FLIGHT)):
                    group.create_task(worker())
            parts.sort(key=lambda part: part["PartNumber"])
            self.stats.put_requests += 1
            return await self._call("complete_multipart_upload", op="PUT", where=where, Key=full,
                                    UploadId=upload_id, MultipartUpload={"Parts": parts}, **(conditions or {}))
        except BaseException as exc:
            self._abort_later(full, upload_id, where)
            if isinstance(exc, BaseExceptionGroup):
                first = exc.exceptions[0]
                if isinstance(first, Exception):
                    raise classify_error(first, op="PUT", where=where, bucket=self.bucket,
                                         endpoint=self._endpoint_name) from exc
            raise

    def _abort_later(self, full_key: str, upload_id: str, where: str) -> None:
        """Abort a failed or cancelled multipart upload in the background: the caller's error (often
        a deadline, e.g. write durability's) is raised now, not ABORT_TIMEOUT_S later against a store
        that stopped answering (issue 38, finding 6: a 64 MiB close failed 10 s past its bound).
        ``close`` waits for the aborts still under way, at most ABORT_TIMEOUT_S."""
        task = asyncio.get_running_loop().create_task(self._abort(full_key, upload_id, where))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort(self, full_key: str, upload_id: str, where: str) -> None:
        try:
            await asyncio.wait_for(self._call("abort_multipart_upload", op="ABORT", where=where, Key=full_key,
                                              UploadId=upload_id), ABORT_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - an incomplete upload is invisible; the caller's error matters
            log.info("could not abort the multipart upload of %s (%s); a lifecycle rule will remove it", where, exc)

    async def delete(self, key: str) -> None:
        check_write_key(key)
        self.stats.delete_requests += 1
        await self._call("delete_object", op="DELETE", where=self._where(key), Key=self.prefix + key)

    # -- conditional writes (tiering.writeback.durable: leases and recovery) --------------------------

    async def put_if(self, key: str, size: int, read: ReadRange, *, if_match: str | None = None,
                     if_none_match: bool = False, metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        """``put`` sent with ``If-Match: if_match`` or ``If-None-Match: *`` (on the PutObject, or on
        the CompleteMultipartUpload of a large object, where S3 evaluates them).

        ``ObjectChangedError`` (412) when the condition fails, ``ObjectNotFoundError`` when
        ``if_match`` names an object that is gone. AWS S3 and SeaweedFS (4.x, PUT and multipart
        completion) evaluate both; a server that ignores them would make this an unconditional put
        (see ``tiering.writeback.durable`` on the read-back check that narrows that case).
        ``metadata``: user metadata (x-amz-meta-*) stored with the object (``head_metadata``).
        """
        check_write_key(key)
        where = self._where(key)
        conditions: dict[str, Any] = {}
        if if_match is not None:
            conditions["IfMatch"] = if_match
        if if_none_match:
            conditions["IfNoneMatch"] = "*"
        part_size = self._part_size_for(size)
        if size <= part_size:
            extra: dict[str, Any] = {"Metadata": dict(metadata)} if metadata else {}
            async with self._upload_slots:
                data = await self._read(read, 0, size, where)
                self.stats.put_requests += 1
                response = await self._call("put_object", op="PUT", where=where, Key=self.prefix + key, Body=data,
                                            **conditions, **extra)
        else:
            response = await self._put_multipart(key, size, part_size, read, conditions, metadata)
        self.stats.bytes_written += size
        return ObjectInfo(key=key, size=size, etag=_quote_etag(response["ETag"]), mtime=time.time())

    async def head_metadata(self, key: str) -> tuple[ObjectInfo, dict[str, str]]:
        """``head`` with the object's user metadata (names in lower case, without ``x-amz-meta-``)."""
        info, metadata, _ = await self._head_full(key)
        return info, metadata

    async def _head_full(self, key: str) -> tuple[ObjectInfo, dict[str, str], dict[str, Any]]:
        """HEAD: the info, the user metadata, and the headers a metadata REPLACE must send again."""
        self._check_key(key)
        self.stats.head_requests += 1
        response = await self._call("head_object", op="HEAD", where=self._where(key), Key=self.prefix + key)
        info = ObjectInfo(key=key, size=int(response["ContentLength"]), etag=response["ETag"],
                          mtime=response["LastModified"].timestamp())
        metadata = {str(name).lower(): str(value) for name, value in (response.get("Metadata") or {}).items()}
        kept = {name: response[name] for name in _REPLACED_HEADERS if response.get(name)}
        return info, metadata, kept

    async def delete_if(self, key: str, if_match: str) -> None:
        """DeleteObject sent with ``If-Match``: ``ObjectChangedError`` if the object has another ETag,
        ``ObjectNotFoundError`` if there is none. Stores differ on the second: SeaweedFS answers 412
        for a missing object, so a 412 is followed by one HEAD to tell the two apart (recovery reports
        a delete whose object is gone as done, and one that met another version as kept)."""
        check_write_key(key)
        self.stats.delete_requests += 1
        where = self._where(key)
        try:
            await self._call("delete_object", op="DELETE", where=where, Key=self.prefix + key, IfMatch=if_match)
        except ObjectChangedError:
            try:
                await self.head(key)
            except ObjectNotFoundError:
                raise ObjectNotFoundError(f"DELETE {where}: no such object (If-Match)") from None
            raise

    async def copy(self, src: str, etag: str, dst: str, *,
                   metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        """CopyObject keeps the source's user metadata by itself (MetadataDirective COPY); with
        ``metadata`` it is sent whole (REPLACE: the source's, with those names set, and the content
        headers read by the HEAD, which REPLACE would drop). UploadPartCopy parts carry none, so the
        multipart upload is created with the source's (and ``metadata``)."""
        check_write_key(dst)
        # The size decides CopyObject or UploadPartCopy; the metadata goes to a REPLACE or a multipart copy.
        source, source_metadata, headers = await self._head_full(src)
        if _strip_etag(source.etag) != _strip_etag(etag):
            raise changed_error(self._where(src))
        where = self._where(dst)
        copy_source = {"Bucket": self.bucket, "Key": self.prefix + src}
        merged = {**source_metadata, **(metadata or {})}
        self.stats.copy_requests += 1
        if source.size <= MAX_COPY_OBJECT_BYTES:
            extra: dict[str, Any] = {}
            if metadata:
                extra = {"MetadataDirective": "REPLACE", "Metadata": merged, **headers}
            response = await self._call("copy_object", op="COPY", where=where, Key=self.prefix + dst,
                                        CopySource=copy_source, CopySourceIfMatch=etag, **extra)
            new_etag = response["CopyObjectResult"]["ETag"]
        else:
            new_etag = await self._copy_multipart(dst, copy_source, etag, source.size, {"Metadata": merged, **headers})
        return ObjectInfo(key=dst, size=source.size, etag=_quote_etag(new_etag), mtime=time.time())

    async def _copy_multipart(self, dst: str, copy_source: dict[str, str], etag: str, size: int,
                              attributes: dict[str, Any]) -> str:
        where = self._where(dst)
        full = self.prefix + dst
        created = await self._call("create_multipart_upload", op="COPY", where=where, Key=full, **attributes)
        upload_id = created["UploadId"]
        count = -(-size // COPY_PART_SIZE)

        async def one(number: int) -> dict[str, Any]:
            start = (number - 1) * COPY_PART_SIZE
            end = min(size, start + COPY_PART_SIZE)
            async with self._upload_slots:
                self.stats.copy_requests += 1
                answer = await self._call("upload_part_copy", op="COPY", where=f"{where} part {number}", Key=full,
                                          UploadId=upload_id, PartNumber=number, CopySource=copy_source,
                                          CopySourceIfMatch=etag, CopySourceRange=f"bytes={start}-{end - 1}")
            return {"ETag": answer["CopyPartResult"]["ETag"], "PartNumber": number}

        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(one(n)) for n in range(1, count + 1)]
            done = await self._call("complete_multipart_upload", op="COPY", where=where, Key=full,
                                    UploadId=upload_id,
                                    MultipartUpload={"Parts": [task.result() for task in tasks]})
            return done["ETag"]
        except BaseException as exc:
            self._abort_later(full, upload_id, where)
            if isinstance(exc, BaseExceptionGroup):
                first = exc.exceptions[0]
                if isinstance(first, Exception):
                    raise classify_error(first, op="COPY", where=where, bucket=self.bucket,
                                         endpoint=self._endpoint_name) from exc
            raise

    async def close(self) -> None:
        if self._aborts:  # each is bounded by ABORT_TIMEOUT_S already
            await asyncio.wait(set(self._aborts), timeout=ABORT_TIMEOUT_S)
        self._presigned.clear()
        await self._gets.close()
        client, self._client, self._fs = self._client, None, None
        if client is not None:
            try:
                await client.close()
            except Exception:  # closing a broken connection pool must not mask the caller's outcome
                log.debug("closing the S3 client failed", exc_info=True)
