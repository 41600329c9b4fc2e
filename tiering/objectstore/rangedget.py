"""Ranged GETs received off the event loop, straight into one buffer per block.

Why. A cold read used to receive every block on the event loop that also answers FUSE: aiohttp
reads the socket in 64-256 KiB pieces, one loop callback and one ``bytes`` copy each, then joins the
pieces (a second copy). Profiled on a cold read of 256 MiB from SeaweedFS on 127.0.0.1
(``benchmarks/dataplane.py``), that receiving was most of the loop thread's samples, and the loop
thread was the daemon's busiest at 1.3-3.5 CPU-s per GiB, while eight plain boto3 threads fetched the
same object at 0.45-0.5 CPU-s/GiB. docs/dataplane.md has the figures.

How. ``RangedGetter.get`` hands one request to a worker thread of its own pool and awaits it. The
thread sends the GET on a keep-alive ``http.client`` connection it owns (one per thread and origin:
the pool of threads is the pool of connections, nothing is shared, no lock), takes one buffer of
exactly the range's length (``BufferPool.take``) and receives the body into it: what came with the
headers first, then the rest with one ``recv_into(..., MSG_WAITALL)`` on the blocking socket, with
the GIL released for the whole block (``_receive_waitall``). That is one copy per byte (kernel to
the block's buffer) and one release and re-take of the GIL per block instead of one per socket
buffer; the loop does one hop to the pool and one back per block. The buffer is handed to the caller, as a read-only
``memoryview``, only when it is full: a request that fails or is cancelled drops it, so nothing can
see a partial block.

Why an anonymous mapping per block (``mmap`` with ``MAP_POPULATE``), and used again
(``BufferPool``), not ``bytearray``: a cold read keeps every block it fetches (the RAM tier), so
until the RAM tier is full each one is new memory, and new memory costs page faults whatever
allocates it. ``bytearray(n)`` takes those faults and zero-fills under
the GIL: measured on this 2-core VM, 3.4 ms per 8 MiB block that is kept (0.43 CPU-s/GiB, the
heaviest line of the GIL profile of a cold read, 23% of its samples). ``MAP_POPULATE`` makes the
kernel fault the whole mapping in one ``mmap`` call, which CPython makes with the GIL released:
2.6 ms per block, in the worker thread, off the GIL. And a mapping goes back to the system the moment
its last view is dropped, so the daemon's RSS follows the RAM tier, with none of the heap
fragmentation that freed 8 MiB ``bytearray``s leave behind. Once the RAM tier is full, every block
fetched evicts one: ``BufferPool`` hands the evicted block's mapping out again as soon as no view of
it is alive, so a long cold read pays no page faults at all (measured, 256 MiB through a 64 MiB RAM
tier, engine only: 0.72 CPU-s/GiB with a new mapping per block, 0.36-0.44 with the pool, which is
what threaded boto3 spends).

Why ``http.client`` under a thread pool, not urllib3, aiohttp or obstore: urllib3's ``readinto`` reads
into a temporary ``bytes`` and copies it over (a second copy per byte, with the GIL held); aiohttp
receives on the loop (the cost above); obstore (Rust, GIL released) measured 716-924 MB/s against
901-1,061 for threaded boto3 on the same server (issue 25), needs its own credential plumbing and
would replace the error classification this store already has. The request is a presigned URL the
S3 store signs (``tiering.objectstore.s3presign``), so nothing here knows about credentials.

What it refuses. Redirects are never followed (``http.client`` does not, and a 3xx is returned as a
status for the store to fall back on): a presigned URL carries a signature, and following a
redirect would hand it, or the request, to another origin. Only the exact status, length and ETag
the caller can use are taken; anything else is an answer the caller repeats through botocore.
URLs (they hold the signature and any session token) are never logged or put in a message.

Deadlines. Each connection has the connect timeout for connecting and the read timeout for every
socket read after, as botocore's (``SO_RCVTIMEO`` for the ``MSG_WAITALL`` receive, which the kernel
counts over the whole call); a caller that stops waiting (its deadline, a cancelled read) sets the
request's ``cancelled`` flag, and the thread stops before its next read and closes the connection,
so an abandoned request holds neither a thread nor a buffer for longer than one socket read.
"""

from __future__ import annotations

import asyncio
import collections
import http.client
import logging
import mmap
import re
import socket
import ssl
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Mapping
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

# Ranges below this get a bytearray: an mmap call costs ~14 us, a 100 KiB bytearray ~3 us (measured
# on this VM), and a small file's block is too small for its page faults to matter.
MAP_MIN_BYTES = 1024 * 1024
# Idle block buffers the pool keeps for the next fetches (BufferPool): a cold read past a full RAM
# tier frees one block per block it fetches, so two cover the reuse (the engine measured the same
# reuse with 2 as with 4), and 2 x 8 MiB is all the memory idle buffers add to the RAM tier's.
IDLE_BUFFERS = 2
# A private anonymous mapping, populated by the mmap call itself (Linux); elsewhere faulted on use.
_MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
# The error code of an S3 error document (<Error><Code>NoSuchKey</Code>...): a code, never the message.
_ERROR_CODE = re.compile(rb"<Code>([A-Za-z0-9.]{1,64})</Code>")
# Bodies above this are received with MSG_WAITALL (_receive_waitall); smaller ones arrive in one or
# two socket reads anyway. Above http.client's 8 KiB read buffer, so readinto1 never leaves bytes in it.
WAITALL_MIN_BYTES = 256 * 1024
# Bytes of an error answer's body read (and dropped) to keep its connection for the next request; a
# longer (or unknown-length) body closes the connection instead. S3 error documents are < 1 KiB.
MAX_DRAIN_BYTES = 64 * 1024
# A request on a kept-alive connection that the server closed meanwhile fails before any answer
# (RemoteDisconnected, a reset): it is sent once more, on a new connection, as botocore does.
STALE_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError,
)


@dataclass
class RangeAnswer:
    """What the server answered: its status and ETag header, and the body when it was the range asked
    for (200/206 with exactly ``length`` bytes), else None."""

    status: int
    etag: str | None
    data: memoryview | None
    error_code: str | None = None  # the S3 error document's <Code>, where the body was one


@dataclass
class _Request:
    url: str
    headers: Mapping[str, str]
    length: int
    cancelled: bool = False  # set by the awaiting caller when it stops waiting


@dataclass
class _Connections:
    """The connections of one worker thread, by origin."""

    by_origin: dict[tuple[str, str, int], http.client.HTTPConnection] = field(default_factory=dict)


def allocate_block(length: int) -> memoryview:
    """A new writable buffer of ``length`` bytes, faulted in at once, off the GIL (module docstring)."""
    if length < MAP_MIN_BYTES:
        return memoryview(bytearray(length))
    return memoryview(mmap.mmap(-1, length, flags=_MAP_FLAGS))


def _unused(mapping: mmap.mmap) -> bool:
    """Whether no view of ``mapping`` is alive anywhere (a RAM-tier entry, a reply, a disk write).

    CPython refuses to resize a mapping while any buffer is exported from it, and every view or
    slice of a block keeps that export; resizing to its own size changes nothing else (0.3 us).
    """
    try:
        mapping.resize(len(mapping))
    except BufferError:
        return False
    return True


def _can_probe() -> bool:
    """Whether this platform resizes anonymous mappings (Linux's ``mremap``): without it no buffer
    can be proven free, so the pool would only grow; it then maps a new buffer every time."""
    try:
        _unused(mmap.mmap(-1, mmap.PAGESIZE))
    except (OSError, ValueError, SystemError):
        return False
    return True


class BufferPool:
    """Block buffers allocated once and used again once nothing holds a view of them.

    Why: a new mapping per block costs its page faults (2.6 ms per 8 MiB, 0.33 CPU-s/GiB) every
    time, while a cold read that evicts from a full RAM tier frees a block for every one it
    fetches. Each mapping of ``MAP_MIN_BYTES`` or more that this pool hands out is remembered by
    the pool; ``take`` first looks, oldest first, for one of the length asked that no view is alive of
    any more (``_unused``), and only maps a new one when none is. So the pool holds the blocks that
    are alive anyway (the RAM tier's, those in flight) plus at most ``keep_free`` idle ones of any
    size: memory stays bounded by the RAM tier and the fetch slots, and an idle mapping beyond that
    is dropped (unmapped). A scan probes every mapping held (~0.3 us each, ~40 us for a 1 GiB RAM
    tier of 8 MiB blocks), against 2.6 ms for a new mapping.
    """

    def __init__(self, keep_free: int) -> None:
        self.keep_free = keep_free
        self._lock = threading.Lock()
        self._mappings: collections.deque[mmap.mmap] = collections.deque()  # oldest handed out first
        self.enabled = _can_probe()
        self.reused = 0  # buffers handed out again (tests, benchmarks)
        self.mapped = 0  # new mappings made

    def take(self, length: int) -> memoryview:
        if length < MAP_MIN_BYTES or not self.enabled:
            return allocate_block(length)
        with self._lock:
            found: mmap.mmap | None = None
            kept: collections.deque[mmap.mmap] = collections.deque()
            idle = 0
            for mapping in self._mappings:  # the oldest first: the most likely to be evicted by now
                if not _unused(mapping):
                    kept.append(mapping)
                elif found is None and len(mapping) == length:
                    found = mapping
                elif idle < self.keep_free:
                    idle += 1
                    kept.append(mapping)
                # else: one idle mapping too many (any size), dropped: unmapped when this reference goes
            self._mappings = kept
            if found is not None:
                kept.append(found)  # now the most recently handed out
                self.reused += 1
                return memoryview(found)  # the view exists before the lock is let go
        mapping = mmap.mmap(-1, length, flags=_MAP_FLAGS)  # outside the lock: the slow part
        view = memoryview(mapping)  # before the pool knows it, so no other thread can take it
        with self._lock:
            self._mappings.append(mapping)
            self.mapped += 1
        return view


class RequestAbandoned(Exception):
    """The caller stopped waiting; the thread dropped the request (internal)."""


class RangedGetter:
    """A pool of ``threads`` worker threads, each with its own keep-alive connections."""

    def __init__(self, *, threads: int, connect_timeout_s: float, read_timeout_s: float,
                 ca_bundle: str | None = None, name: str = "cachefs-get") -> None:
        if threads < 1:
            raise ValueError("a ranged GET pool needs at least one thread")
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._ca_bundle = ca_bundle
        self._tls: ssl.SSLContext | None = None
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: list[_Connections] = []  # every thread's, for close()
        self.buffers = BufferPool(keep_free=IDLE_BUFFERS)
        self._closed = False

    async def get(self, url: str, headers: Mapping[str, str], length: int) -> RangeAnswer:
        """GET ``url`` with ``headers`` in a worker thread; raises ``OSError``/``http.client`` errors."""
        request = _Request(url, headers, length)
        future = asyncio.get_running_loop().run_in_executor(self._pool, self._run, request)
        try:
            return await future
        except BaseException:
            request.cancelled = True  # the thread stops at its next read and drops the buffer
            raise

    def close(self) -> None:
        """Stop taking requests and close every idle connection (running requests end by themselves)."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            groups, self._all = self._all, []
        for group in groups:
            for conn in list(group.by_origin.values()):
                conn.close()
            group.by_origin.clear()

    # -- in a worker thread -------------------------------------------------------------------------

    def _connections(self) -> _Connections:
        mine = getattr(self._local, "connections", None)
        if mine is None:
            mine = self._local.connections = _Connections()
            with self._lock:
                self._all.append(mine)
        return mine

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context(cafile=self._ca_bundle)
        return self._tls

    def _connect(self, scheme: str, host: str, port: int) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection
        if scheme == "https":
            conn = http.client.HTTPSConnection(host, port, timeout=self.connect_timeout_s,
                                               context=self._tls_context())
        else:
            conn = http.client.HTTPConnection(host, port, timeout=self.connect_timeout_s)
        conn.connect()
        assert conn.sock is not None
        conn.sock.settimeout(self.read_timeout_s)
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # For the blocking MSG_WAITALL receive (_receive_waitall): the kernel's own read timeout.
        seconds = int(self.read_timeout_s)
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                             struct.pack("ll", seconds, int((self.read_timeout_s - seconds) * 1e6)))
        return conn

    def _run(self, request: _Request) -> RangeAnswer:
        if self._closed or request.cancelled:
            raise RequestAbandoned()
        parts = urlsplit(request.url)
        scheme = parts.scheme
        host = parts.hostname or ""
        port = parts.port or (443 if scheme == "https" else 80)
        origin = (scheme, host, port)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        group = self._connections()
        for attempt in range(2):
            conn = group.by_origin.pop(origin, None)
            reused = conn is not None
            if conn is None:
                conn = self._connect(scheme, host, port)
            try:
                conn.request("GET", target, headers=dict(request.headers))
                response = conn.getresponse()
            except STALE_CONNECTION_ERRORS:
                conn.close()
                if reused and attempt == 0:
                    continue
                raise
            except BaseException:
                conn.close()
                raise
            try:
                answer, keep = self._receive(response, conn.sock, request)
            except BaseException:
                conn.close()
                raise
            if keep and not self._closed:
                group.by_origin[origin] = conn
            else:
                conn.close()
            return answer
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    def _receive(self, response: http.client.HTTPResponse, sock: socket.socket | None,
                 request: _Request) -> tuple[RangeAnswer, bool]:
        """The answer, and whether the connection can carry the next request."""
        status = response.status
        etag = response.getheader("ETag")
        length = response.length  # None: no Content-Length (chunked or until close)
        if status in (200, 206) and length == request.length:
            view = self.buffers.take(request.length)
            got = 0
            if request.length > WAITALL_MIN_BYTES and sock is not None and not isinstance(sock, ssl.SSLSocket):
                got = self._receive_waitall(response, sock, view, request)
            while got < request.length:
                if request.cancelled:
                    raise RequestAbandoned()
                n = response.readinto(view[got:])
                if not n:
                    raise http.client.IncompleteRead(b"", request.length - got)
                got += n
            return RangeAnswer(status, etag, view.toreadonly()), not response.will_close
        if length is not None and length <= MAX_DRAIN_BYTES:
            code = _ERROR_CODE.search(response.read())
            return (RangeAnswer(status, etag, None, code.group(1).decode("ascii") if code else None),
                    not response.will_close)
        return RangeAnswer(status, etag, None), False

    def _receive_waitall(self, response: http.client.HTTPResponse, sock: socket.socket, view: memoryview,
                         request: _Request) -> int:
        """Receive the whole body into ``view`` in as few ``recv`` calls as the kernel allows.

        What ``http.client`` buffered with the headers comes first (``readinto1`` copies it and reads
        nothing more, or, with nothing buffered, makes one read straight into ``view``); the rest
        comes from the socket with ``MSG_WAITALL`` on a blocking socket, so one call (one release
        and one re-take of the GIL) receives what would otherwise take one call per socket buffer,
        a hundred or more per 8 MiB. ``SO_RCVTIMEO`` (set at connect) bounds each call by the read
        timeout, as the socket timeout bounds ``http.client``'s own reads. The response is then
        complete and closed, and the connection goes on to the next request.
        """
        assert response.fp is not None
        got = response.fp.readinto1(view)
        if not got:
            raise http.client.IncompleteRead(b"", request.length)
        sock.settimeout(None)
        try:
            while got < request.length:
                if request.cancelled:
                    raise RequestAbandoned()
                n = sock.recv_into(view[got:], request.length - got, socket.MSG_WAITALL)
                if not n:
                    raise http.client.IncompleteRead(b"", request.length - got)
                got += n
        finally:
            sock.settimeout(self.read_timeout_s)
        response.length = 0
        response.close()  # the file object only: the connection's socket stays open
        return got
