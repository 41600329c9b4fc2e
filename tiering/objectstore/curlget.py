"""Small ranged GETs on one libcurl multi handle, driven by one thread.

Why. A cold small file is one GET of ~100 KiB. Received by ``RangedGetter`` (``http.client`` in a
pool of worker threads), each GET woke a worker (the loop hands it over), parsed the status line and
headers in Python (``http.client`` builds an ``email`` message), and woke the loop again; on 2 cores
with 16 workers the hand-offs and the GIL's hand-overs between those threads cost more than the bytes.
Measured alone (2,000 GETs of 100 KiB from SeaweedFS on 127.0.0.1, 16 in flight, CPU of the client
process per GET): ``RangedGetter`` 0.32-0.38 ms, libcurl easy handles in 16 threads 0.25 ms, one
libcurl multi handle in one thread 0.08 ms, and it fetched more files a second (1,785-2,573 against
1,364-1,939). The thread pool, not the parser, was most of the cost.

How. One thread (``cachefs-curl``) runs libcurl's multi interface the event-driven way: libcurl says
which sockets it waits on (``M_SOCKETFUNCTION``) and when it wants its timers run
(``M_TIMERFUNCTION``); the thread waits on those sockets and on an ``eventfd`` with ``epoll``, the GIL
released, and calls ``socket_action`` for what is ready. libcurl connects, sends, parses the answer and
keeps connections alive (its connection cache, at most ``connections`` open) in C. No Python frame
of ours runs while a transfer does: libcurl's header callback is a list's ``append`` and its write
callback a ``BytesIO``'s ``write`` (C methods; libcurl hands the body over in pieces of at most 16 KiB,
about seven for a 100 KiB block, each still taking the GIL back; Python callbacks in their place
measured the same, so this is kept as the simpler code). When the transfer is done the thread reads
the status and ``Content-Length`` from libcurl, the ``ETag`` from the kept header lines, and hands the
``BytesIO``'s bytes over as the block without copying them again. The loop hands a request over by
appending it to a queue and writing the ``eventfd``; the thread hands answers back with one
``call_soon_threadsafe`` for every answer that finished in the same turn.

What the caller's ``then`` returns (the disk-tier write of the block, ``tiering.handoff``) runs in the
same thread once the turn's answers are handed over: measured in ``benchmarks.coldfiles`` (2,000 cold
100 KiB files, two alternating runs each), handing it to a pool of two threads instead cost the daemon
0.965-0.985 ms per file announced against 0.81-0.915, and 1.45-1.53 against 1.38-1.46 not announced:
the pool's wake-ups cost more than the write (an append to a pack, ``tiering.tiers.packs``). A write
that waits for the disk holds up the other transfers meanwhile; it would hold the loads anyway, as a
load keeps its fetch slot until its block is written (``tiering.engine.loads``).

Same contract as ``RangedGetter`` (``tiering.objectstore.rangedget``, which keeps large blocks: its
``MSG_WAITALL`` receive copies each byte once with the GIL released, where this path copies each piece
of body in a callback): an answer's body is handed over only when it is the exact range asked for
(status 200/206, ``Content-Length`` the length asked for), as one read-only buffer; an S3 error
document's ``<Code>`` is read from a body of at most ``MAX_DRAIN_BYTES``; anything else is a status
without data, its connection closed. Redirects are never followed (libcurl's default, and only HTTP
and HTTPS are allowed at all); no proxy from the environment is used (as ``http.client``); TLS is
verified against ``ca_bundle`` or the system's CAs. Each transfer has the connect timeout, a read
timeout (no byte for that long ends it: libcurl's low-speed limit, in whole seconds) and the caller's
deadline (``tiering.storehealth.request_timeout``) as libcurl's own; a caller that stops waiting
aborts its transfer (removed from the multi handle in the thread: its connection is closed, its
bytes dropped). URLs carry a signature: they are never logged or put in a message.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import os
import select
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import pycurl

from tiering.objectstore.rangedget import (
    MAX_DRAIN_BYTES,
    S3_ERROR_CODE,
    RangeAnswer,
    RequestAbandoned,
    Then,
    Url,
    call_soon_from_thread,
    settle,
)
from tiering.storehealth import request_timeout

log = logging.getLogger(__name__)

# Ranges below this go through libcurl (S3ObjectStore): small files' blocks. Larger ones are received
# by RangedGetter, whose MSG_WAITALL receive copies each byte once with the GIL released.
CURL_MAX_BYTES = 1024 * 1024
# libcurl's receive buffer per transfer (its default is 16 KiB): room for a 100 KiB body per socket
# read. The write callback still gets at most 16 KiB a call (CURL_MAX_WRITE_SIZE, fixed at build).
RECEIVE_BUFFER_BYTES = 256 * 1024
# How long close() waits for the thread to end (it ends at its next wake-up, which close() causes).
CLOSE_WAIT_S = 5.0

_EPOLL_FOR = {
    pycurl.POLL_IN: select.EPOLLIN,
    pycurl.POLL_OUT: select.EPOLLOUT,
    pycurl.POLL_INOUT: select.EPOLLIN | select.EPOLLOUT,
}
# libcurl's errors that mean the store could not be reached or stopped answering.
_CONNECT_ERRORS = {pycurl.E_COULDNT_CONNECT, pycurl.E_COULDNT_RESOLVE_HOST, pycurl.E_COULDNT_RESOLVE_PROXY}
_CUT_ERRORS = {pycurl.E_PARTIAL_FILE, pycurl.E_RECV_ERROR, pycurl.E_SEND_ERROR, pycurl.E_GOT_NOTHING}


class CurlTransferError(OSError):
    """A transfer libcurl ended with an error: its code, never its text (which may name the URL)."""


def transfer_error(code: int) -> OSError:
    """The exception for libcurl's error ``code``: a timeout, a connection failure, or else OSError."""
    what = f"libcurl error {code}"
    if code == pycurl.E_OPERATION_TIMEDOUT:
        return TimeoutError(what)
    if code in _CONNECT_ERRORS:
        return ConnectionRefusedError(what)
    if code in _CUT_ERRORS:
        return ConnectionResetError(what)
    return CurlTransferError(what)


@dataclass(eq=False)
class _Transfer:
    """One request, from the caller's ``get`` to its answer; its fields after ``deadline_s`` are the thread's."""

    url: Url = field(repr=False)  # it holds a signature: never in a message
    headers: Mapping[str, str]
    length: int
    then: Then | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[RangeAnswer]
    deadline_s: float | None
    cancelled: bool = False
    handle: pycurl.Curl | None = None
    # libcurl's header and write callbacks are these lists' own C method (``list.append``): no Python
    # frame per header line or per 16 KiB piece of body. The pieces are joined once, at the end: one
    # copy of the body, into memory of its final size (a ``BytesIO`` grew by reallocating, then
    # copied again unless its buffer happened to fit: 18 against 14 us per 100 KiB body measured
    # alone, 77-80 against 58-65 in memory touched for the first time, as a filling RAM tier's is).
    head: list[bytes] = field(default_factory=list)
    body: list[bytes] = field(default_factory=list)

    def etag(self) -> str | None:
        """The ETag header of the last answer received (a 1xx's lines come before its status line)."""
        etag: str | None = None
        for line in self.head:
            if line[:5] == b"HTTP/":
                etag = None
            elif line[:5].lower() == b"etag:":
                etag = line[5:].strip().decode("latin-1")
        return etag

    def answer(self, status: int, declared: float) -> RangeAnswer:
        """The answer: the body as the data where it is the range asked for (status 200/206, the
        ``Content-Length`` libcurl read, ``declared``, and the bytes received are both its length),
        else the status and any S3 error code of a short body."""
        body, etag = b"".join(self.body), self.etag()
        self.body.clear()
        received = len(body)
        if status in (200, 206) and declared == self.length and received == self.length:
            return RangeAnswer(status, etag, memoryview(body))  # bytes: read-only, not copied
        code = S3_ERROR_CODE.search(body) if 0 < received <= MAX_DRAIN_BYTES else None
        return RangeAnswer(status, etag, None, code.group(1).decode("ascii") if code else None)


def _settle_all(results: list[tuple[_Transfer, RangeAnswer | None, BaseException | None]]) -> None:
    """On the loop: every answer that finished in one turn of the thread."""
    for transfer, answer, error in results:
        settle(transfer.future, answer, error)


def _system_ca_paths() -> tuple[str | None, str | None]:
    """The CA file and directory Python's ``ssl`` verifies against (those of its OpenSSL build)."""
    paths = ssl.get_default_verify_paths()
    cafile = next((p for p in (paths.cafile, paths.openssl_cafile) if p and os.path.isfile(p)), None)
    capath = next((p for p in (paths.capath, paths.openssl_capath) if p and os.path.isdir(p)), None)
    return cafile, capath


class CurlGetter:
    """Ranged GETs, at most ``connections`` at once, on one libcurl multi handle in one thread."""

    def __init__(self, *, connections: int, connect_timeout_s: float, read_timeout_s: float,
                 ca_bundle: str | None = None, name: str = "cachefs-curl") -> None:
        if connections < 1:
            raise ValueError("a GET engine needs at least one connection")
        self.connections = connections
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._ca_bundle = ca_bundle
        self._name = name
        self._submitted: collections.deque[_Transfer] = collections.deque()
        self._aborted: collections.deque[_Transfer] = collections.deque()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._wake_fd = -1
        self._closed = False
        # The thread's own, from here on.
        self._active: dict[pycurl.Curl, _Transfer] = {}
        self._idle: list[pycurl.Curl] = []
        self._watched: set[int] = set()  # the sockets registered with epoll
        self._timer_at: float | None = None

    async def get(self, url: Url, headers: Mapping[str, str], length: int,
                  then: Then | None = None) -> RangeAnswer:
        """GET ``url`` with ``headers``; ``RangedGetter.get``'s contract, ``then`` included (what it
        returns runs in libcurl's thread once the answers of its turn are handed over)."""
        loop = asyncio.get_running_loop()
        deadline = request_timeout()
        transfer = _Transfer(url, headers, length, then, loop, loop.create_future(), deadline)
        self._submit(transfer)
        try:
            async with asyncio.timeout(deadline):  # the caller's deadline, however slow the server
                return await transfer.future
        except BaseException:
            self._abort(transfer)
            raise

    def close(self) -> None:
        """Stop: every transfer still running is aborted, every connection closed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
            if thread is not None:
                os.eventfd_write(self._wake_fd, 1)
        if thread is not None and thread is not threading.current_thread():
            thread.join(CLOSE_WAIT_S)

    # -- on the caller's side -----------------------------------------------------------------------

    def _submit(self, transfer: _Transfer) -> None:
        with self._lock:
            if self._closed:
                raise RequestAbandoned()
            if self._thread is None:
                self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
                # A daemon thread: an interpreter that exits without close() must not wait for it.
                self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
                self._thread.start()
            self._submitted.append(transfer)
            os.eventfd_write(self._wake_fd, 1)  # under the lock: the thread closes it under the lock

    def _abort(self, transfer: _Transfer) -> None:
        transfer.cancelled = True
        with self._lock:
            if self._closed or self._thread is None:
                return  # no thread holds it: it ended, and settled every transfer it had
            self._aborted.append(transfer)
            os.eventfd_write(self._wake_fd, 1)

    # -- in the thread ------------------------------------------------------------------------------

    def _serve(self) -> None:
        multi = pycurl.CurlMulti()
        poller = select.epoll()
        try:
            multi.setopt(pycurl.M_SOCKETFUNCTION, lambda what, fd, _m, _d: self._watch(poller, what, fd))
            multi.setopt(pycurl.M_TIMERFUNCTION, self._on_timer)
            multi.setopt(pycurl.M_MAX_TOTAL_CONNECTIONS, self.connections)
            multi.setopt(pycurl.M_MAXCONNECTS, self.connections)
            poller.register(self._wake_fd, select.EPOLLIN)
            self._turns(multi, poller)
        except BaseException as exc:  # noqa: BLE001 - a bug: no caller may wait for ever, and the next starts anew
            log.exception("the libcurl GET thread stopped (the next GET starts another)")
            self._end(multi, CurlTransferError(f"the libcurl GET thread stopped ({type(exc).__name__})"))
        else:
            self._end(multi, None)
        finally:
            poller.close()

    def _turns(self, multi: pycurl.CurlMulti, poller: select.epoll) -> None:
        while not self._closed:
            timeout = -1.0 if self._timer_at is None else max(0.0, self._timer_at - time.monotonic())
            events = poller.poll(timeout)
            for fd, mask in events:
                if fd == self._wake_fd:
                    try:
                        os.eventfd_read(fd)
                    except BlockingIOError:
                        pass
                    self._take(multi)  # libcurl sets its timer to 0 for what was added: run below
                    continue
                flags = 0
                if mask & select.EPOLLIN:
                    flags |= pycurl.CSELECT_IN
                if mask & select.EPOLLOUT:
                    flags |= pycurl.CSELECT_OUT
                if mask & (select.EPOLLERR | select.EPOLLHUP):
                    flags |= pycurl.CSELECT_ERR
                multi.socket_action(fd, flags)
            if self._timer_at is not None and time.monotonic() >= self._timer_at:
                self._timer_at = None
                multi.socket_action(pycurl.SOCKET_TIMEOUT, 0)
            self._finish(multi)

    def _watch(self, poller: select.epoll, what: int, fd: int) -> None:
        """libcurl's socket callback: wait on ``fd`` for ``what`` (or no more)."""
        if what == pycurl.POLL_REMOVE:
            if fd in self._watched:
                self._watched.discard(fd)
                try:
                    poller.unregister(fd)
                except (OSError, ValueError):
                    pass  # closed already
            return
        mask = _EPOLL_FOR.get(what, select.EPOLLIN)
        try:
            if fd in self._watched:
                poller.modify(fd, mask)
            else:
                poller.register(fd, mask)
        except FileNotFoundError:  # closed and opened again under the same number: epoll forgot it
            poller.register(fd, mask)
        except FileExistsError:
            poller.modify(fd, mask)
        self._watched.add(fd)

    def _on_timer(self, timeout_ms: int) -> None:
        """libcurl's timer callback: run its timeouts in ``timeout_ms`` (-1: no timer)."""
        self._timer_at = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000

    def _take(self, multi: pycurl.CurlMulti) -> None:
        """New requests into the multi handle, aborted ones out of it."""
        while self._aborted:
            transfer = self._aborted.popleft()
            handle = transfer.handle
            if handle is not None and self._active.pop(handle, None) is transfer:
                multi.remove_handle(handle)  # mid-answer: libcurl closes its connection
                self._release(handle, transfer)
        while self._submitted:
            transfer = self._submitted.popleft()
            if transfer.cancelled:
                continue
            try:
                handle = self._prepare(transfer)
            except BaseException as exc:  # noqa: BLE001 - signing the URL failed: the request's error
                call_soon_from_thread(transfer.loop, _settle_all, [(transfer, None, exc)])
                continue
            self._active[handle] = transfer
            multi.add_handle(handle)

    def _prepare(self, transfer: _Transfer) -> pycurl.Curl:
        url = transfer.url if isinstance(transfer.url, str) else transfer.url()
        handle = self._idle.pop() if self._idle else self._new_handle()
        handle.setopt(pycurl.URL, url)
        handle.setopt(pycurl.HTTPHEADER, [f"{k}: {v}" for k, v in transfer.headers.items()])
        handle.setopt(pycurl.HEADERFUNCTION, transfer.head.append)
        handle.setopt(pycurl.WRITEFUNCTION, transfer.body.append)
        # A longer body is not received (E_FILESIZE_EXCEEDED, its connection closed): neither the
        # range nor an error document, whatever it is (a whole object for an ignored Range).
        handle.setopt(pycurl.MAXFILESIZE_LARGE, max(transfer.length, MAX_DRAIN_BYTES))
        timeout_ms = 0 if transfer.deadline_s is None else max(1, math.ceil(transfer.deadline_s * 1000))
        handle.setopt(pycurl.TIMEOUT_MS, timeout_ms)
        transfer.handle = handle
        return handle

    def _new_handle(self) -> pycurl.Curl:
        handle = pycurl.Curl()
        handle.setopt(pycurl.NOSIGNAL, 1)
        handle.setopt(pycurl.PROTOCOLS, pycurl.PROTO_HTTP | pycurl.PROTO_HTTPS)
        handle.setopt(pycurl.FOLLOWLOCATION, 0)
        handle.setopt(pycurl.PROXY, "")  # no proxy from the environment
        handle.setopt(pycurl.HTTP_VERSION, pycurl.CURL_HTTP_VERSION_1_1)
        handle.setopt(pycurl.TCP_NODELAY, 1)
        handle.setopt(pycurl.BUFFERSIZE, RECEIVE_BUFFER_BYTES)
        handle.setopt(pycurl.CONNECTTIMEOUT_MS, max(1, math.ceil(self.connect_timeout_s * 1000)))
        handle.setopt(pycurl.LOW_SPEED_LIMIT, 1)
        handle.setopt(pycurl.LOW_SPEED_TIME, max(1, math.ceil(self.read_timeout_s)))
        cafile, capath = (self._ca_bundle, None) if self._ca_bundle else _system_ca_paths()
        if cafile:
            handle.setopt(pycurl.CAINFO, cafile)
        if capath:
            handle.setopt(pycurl.CAPATH, capath)
        return handle

    def _release(self, handle: pycurl.Curl, transfer: _Transfer) -> None:
        """``handle`` free for the next request; nothing of ``transfer`` kept alive by it."""
        handle.setopt(pycurl.HEADERFUNCTION, _ignore)
        handle.setopt(pycurl.WRITEFUNCTION, _ignore)
        transfer.handle = None
        self._idle.append(handle)

    def _finish(self, multi: pycurl.CurlMulti) -> None:
        """Hand every finished transfer's answer over (one hop to each loop), then do the work after."""
        results: list[tuple[_Transfer, RangeAnswer | None, BaseException | None]] = []
        while True:
            queued, done, failed = multi.info_read()
            for handle in done:
                transfer = self._active.pop(handle)
                multi.remove_handle(handle)
                answer = transfer.answer(handle.getinfo(pycurl.RESPONSE_CODE),
                                         handle.getinfo(pycurl.CONTENT_LENGTH_DOWNLOAD_T))
                results.append((transfer, answer, None))
                self._release(handle, transfer)
            for handle, code, _text in failed:  # the text can name the URL: not kept
                transfer = self._active.pop(handle)
                multi.remove_handle(handle)
                if code == pycurl.E_FILESIZE_EXCEEDED:  # an answer, not the range: its status
                    answer = RangeAnswer(handle.getinfo(pycurl.RESPONSE_CODE), transfer.etag(), None)
                    results.append((transfer, answer, None))
                else:
                    results.append((transfer, None, transfer_error(code)))
                self._release(handle, transfer)
            if not queued:
                break
        if not results:
            return
        afters: list[Callable[[], None]] = []
        for transfer, finished, _error in results:
            if finished is not None and transfer.then is not None and not transfer.cancelled:
                after = transfer.then(finished)
                if after is not None:
                    afters.append(after)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Transfer, RangeAnswer | None, BaseException | None]]] = {}
        for result in results:
            by_loop.setdefault(result[0].loop, []).append(result)
        for loop, batch in by_loop.items():
            call_soon_from_thread(loop, _settle_all, batch)
        for after in afters:
            after()  # never raises (tiering.handoff): its outcome goes to the loop

    def _end(self, multi: pycurl.CurlMulti, error: BaseException | None) -> None:
        """The thread's last act. After ``close()`` every transfer not finished is cancelled for its
        caller (as a pool's queued jobs are); after a failure of the thread itself each gets ``error``
        (an ``OSError``: the store repeats the GET through botocore), and the next ``get`` starts a new
        thread."""
        transfers = list(self._active.values())
        for handle in list(self._active):
            multi.remove_handle(handle)
            handle.close()
        self._active.clear()
        for handle in self._idle:
            handle.close()
        self._idle.clear()
        self._watched.clear()
        self._timer_at = None
        multi.close()
        with self._lock:
            transfers += self._submitted
            self._submitted.clear()
            self._aborted.clear()
            os.close(self._wake_fd)
            self._wake_fd = -1
            self._thread = None
        for transfer in transfers:
            call_soon_from_thread(transfer.loop, _end_all, [transfer], error)


def _end_all(transfers: list[_Transfer], error: BaseException | None) -> None:
    """On the loop: ``error`` for each transfer, or its cancellation where there is none."""
    for transfer in transfers:
        if error is None:
            transfer.future.cancel()  # nothing once it is done
        else:
            settle(transfer.future, None, error)


def _ignore(*_args: object) -> None:
    return None


__all__ = ["CURL_MAX_BYTES", "CurlGetter", "CurlTransferError", "transfer_error"]
