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
see a partial block. The caller may give work to do on the bytes in the same worker once they are
handed over (``then``: the engine's disk-tier write of a small block, ``tiering.handoff``), which saves
the loop a hop to another thread and back; the worker hands the answer over itself
(``call_soon_threadsafe``) rather than through ``run_in_executor``, so that it can go on after.

The buffer is an anonymous mapping from the process's one pool (``tiering.buffers``, which says
why a mapping and not ``bytearray``): page-aligned, so the disk tier can write it with ``O_DIRECT``,
and used again once the RAM tier has dropped every view of it.

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
counts over the whole call). A read timeout bounds one read, not the answer: a server that sends a
byte a second never lets one expire (issue 34: such a server pinned a worker past the fetch
deadline, and kept the daemon alive after its unmount, since the interpreter waits for the pool's
threads before it exits). So the whole request is bounded by its caller: ``get`` runs under the
caller's store deadline (``tiering.storehealth.request_timeout``, the fetch timeout for a block),
and a caller that stops waiting (that deadline, a cancelled read, ``close()``) *aborts* the request:
its ``cancelled`` flag is set and its socket is shut down from the caller's thread, which wakes the
worker from whatever read it is blocked in (headers, body, an error document); the worker drops the
buffer and the connection at once. An abandoned request holds neither a thread nor a buffer once its
caller has given up, and ``close()`` leaves no worker that a slow server could keep alive.
"""

from __future__ import annotations

import asyncio
import http.client
import logging
import re
import socket
import ssl
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Mapping
from urllib.parse import urlsplit

from tiering.buffers import BLOCK_BUFFERS, BufferPool
from tiering.storehealth import request_timeout

log = logging.getLogger(__name__)

# The error code of an S3 error document (<Error><Code>NoSuchKey</Code>...): a code, never the message.
S3_ERROR_CODE = re.compile(rb"<Code>([A-Za-z0-9.]{1,64})</Code>")
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


# A URL, or what makes it in the worker (a presigned URL signed off the event loop: the S3 store's).
Url = str | Callable[[], str]


@dataclass(eq=False)
class _Request:
    url: Url = field(repr=False)  # it holds a signature: never in a message
    headers: Mapping[str, str]
    length: int
    cancelled: bool = False  # set by the awaiting caller when it stops waiting
    sock: socket.socket | None = None  # the connection's socket while the worker uses it
    lock: threading.Lock = field(default_factory=threading.Lock)

    def attach(self, sock: socket.socket | None) -> None:
        """The worker is about to use ``sock`` for this request (RequestAbandoned if it was aborted)."""
        with self.lock:
            if self.cancelled:
                raise RequestAbandoned()
            self.sock = sock

    def abort(self) -> None:
        """From any thread: stop the request; a worker blocked reading its socket wakes up now."""
        with self.lock:
            self.cancelled = True
            sock, self.sock = self.sock, None
        if sock is not None:
            try:
                # The plain socket's shutdown, also under TLS (SSLSocket's own would tear down its
                # state while the worker is inside it): the peer and the blocked recv see the end.
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass  # closed already: the worker is done with it


@dataclass
class _Connections:
    """The connections of one worker thread, by origin."""

    by_origin: dict[tuple[str, str, int], http.client.HTTPConnection] = field(default_factory=dict)


# Called in the worker with the answer before it is handed over; returns work to do after (or None).
Then = Callable[[RangeAnswer], Callable[[], None] | None]


def call_soon_from_thread(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: object) -> None:
    """``callback(*args)`` on ``loop``, from any thread; nothing once the loop is closed."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        pass  # the loop is closed: nobody waits for the answer


def settle(future: asyncio.Future[RangeAnswer], answer: RangeAnswer | None, error: BaseException | None) -> None:
    """On the loop: the caller's future gets ``error`` or ``answer``, unless it stopped waiting."""
    if future.done():
        return  # the caller stopped waiting (its deadline, a cancelled read)
    if error is not None:
        future.set_exception(error)
    else:
        assert answer is not None
        future.set_result(answer)


def _cancel(future: asyncio.Future[RangeAnswer]) -> None:
    future.cancel()


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
        self._inflight: set[_Request] = set()  # for close(): aborted, so no worker outlives it
        self.buffers: BufferPool = BLOCK_BUFFERS  # shared with the disk tier (tiering.buffers)
        self._closed = False

    async def get(self, url: Url, headers: Mapping[str, str], length: int,
                  then: Then | None = None) -> RangeAnswer:
        """GET ``url`` with ``headers`` in a worker thread; raises ``OSError``/``http.client`` errors.

        ``url`` may be a callable that returns it, called in the worker (whatever it raises is the
        request's error): work the caller's loop need not do, such as signing the URL.

        ``then(answer)`` is called in the worker with the answer before it is handed over; the
        callable it returns, if any, is called in the same worker right after the handover (work on
        the bytes that the caller's loop need not hand to another thread: ``tiering.handoff``). It
        must not raise."""
        request = _Request(url, headers, length)
        with self._lock:
            self._inflight.add(request)
        try:
            loop = asyncio.get_running_loop()
            future: asyncio.Future[RangeAnswer] = loop.create_future()
            job = self._pool.submit(self._job, request, loop, future, then)
            # close() drops queued jobs: their callers see a cancellation, as run_in_executor gives.
            job.add_done_callback(lambda j: call_soon_from_thread(loop, _cancel, future) if j.cancelled() else None)
            async with asyncio.timeout(request_timeout()):  # the caller's deadline, however slow the server
                return await future
        except BaseException:
            request.abort()  # the thread wakes from its read, drops the buffer and the connection
            raise
        finally:
            with self._lock:
                self._inflight.discard(request)

    def close(self) -> None:
        """Stop taking requests and close every idle connection (running requests end by themselves)."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            groups, self._all = self._all, []
            running, self._inflight = list(self._inflight), set()
        for request in running:
            request.abort()
        for group in groups:
            for conn in list(group.by_origin.values()):
                conn.close()
            group.by_origin.clear()

    # -- in a worker thread -------------------------------------------------------------------------

    def _job(self, request: _Request, loop: asyncio.AbstractEventLoop, future: asyncio.Future[RangeAnswer],
             then: Then | None) -> None:
        """The request, its answer handed to the loop, then whatever ``then`` gave to do after."""
        try:
            answer = self._run(request)
        except BaseException as exc:  # noqa: BLE001 - the caller's, on the loop
            call_soon_from_thread(loop, settle, future, None, exc)
            return
        after = then(answer) if then is not None else None
        call_soon_from_thread(loop, settle, future, answer, None)
        if after is not None:
            after()

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
        parts = urlsplit(request.url if isinstance(request.url, str) else request.url())
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
                request.attach(conn.sock)
                conn.request("GET", target, headers=dict(request.headers))
                response = conn.getresponse()
            except STALE_CONNECTION_ERRORS:
                conn.close()
                if reused and attempt == 0 and not request.cancelled:
                    continue
                raise
            except BaseException:
                conn.close()
                raise
            try:
                answer, keep = self._receive(response, conn.sock, request)
                request.attach(None)  # done with the socket: an abort from now on leaves it be
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
            code = S3_ERROR_CODE.search(response.read())
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
