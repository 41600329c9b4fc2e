"""``RangedGetter``: ranged GETs received in worker threads into one buffer per block.

Against a small stdlib HTTP server on 127.0.0.1 that answers what each test scripts (a range, an S3
error document, a redirect, a short body, a connection the server drops between requests), so the
cases a real S3 server seldom produces on demand are exercised on the real ``http.client`` path.
"""

from __future__ import annotations

import asyncio
import http.client
import http.server
import os
import threading
from typing import Callable, Iterator

import pytest

from tiering.objectstore.rangedget import WAITALL_MIN_BYTES, RangeAnswer, RangedGetter

BODY = os.urandom(WAITALL_MIN_BYTES * 3 + 12345)  # above the MSG_WAITALL threshold, not a round size
Script = Callable[[http.server.BaseHTTPRequestHandler], None]


class Server:
    """Answers every GET with ``script(handler)``; counts requests and connections."""

    def __init__(self) -> None:
        self.script: Script = serve_range
        self.requests = 0
        self.connections = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as S3

            def setup(self) -> None:
                outer.connections += 1
                super().setup()

            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                outer.requests += 1
                outer.script(self)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def serve_range(h: http.server.BaseHTTPRequestHandler) -> None:
    first, last = h.headers["Range"].removeprefix("bytes=").split("-")
    body = BODY[int(first) : int(last) + 1]
    h.send_response(206)
    h.send_header("Content-Length", str(len(body)))
    h.send_header("ETag", '"e1"')
    h.end_headers()
    h.wfile.write(body)


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def getter() -> Iterator[RangedGetter]:
    g = RangedGetter(threads=2, connect_timeout_s=2.0, read_timeout_s=5.0)
    try:
        yield g
    finally:
        g.close()


@pytest.fixture
def one_thread() -> Iterator[RangedGetter]:
    """One worker thread, so one connection unless one is dropped: connection counts mean something."""
    g = RangedGetter(threads=1, connect_timeout_s=2.0, read_timeout_s=5.0)
    try:
        yield g
    finally:
        g.close()


def ranged(start: int, end: int) -> dict[str, str]:
    return {"Range": f"bytes={start}-{end - 1}"}


async def test_the_range_arrives_whole_in_one_read_only_buffer(server: Server, one_thread: RangedGetter) -> None:
    getter = one_thread
    for start, end in ((0, len(BODY)), (5, 1000), (1, WAITALL_MIN_BYTES + 7)):
        answer = await getter.get(f"{server.url}/k", ranged(start, end), end - start)
        assert answer.status == 206 and answer.etag == '"e1"'
        assert answer.data is not None and answer.data.readonly
        assert answer.data == BODY[start:end]
    assert server.connections == 1  # kept alive between requests


async def test_then_runs_in_the_worker_after_the_answer_is_handed_over(server: Server, one_thread: RangedGetter) -> None:
    """``then`` sees the answer in the worker before the handover; what it returns runs there after it
    (tiering.handoff): the caller has its bytes without waiting for that work."""
    loop_thread = threading.get_ident()
    seen: list[tuple[str, int]] = []
    handed_over = asyncio.Event()
    done = threading.Event()

    def after() -> None:
        # The caller was woken with the answer before this ran (it blocks until it was).
        assert asyncio.run_coroutine_threadsafe(handed_over.wait(), loop).result(5) is True
        seen.append(("after", threading.get_ident()))
        done.set()

    def then(answer: RangeAnswer) -> Callable[[], None]:
        assert answer.data == BODY[:100]
        seen.append(("then", threading.get_ident()))
        return after

    loop = asyncio.get_running_loop()
    answer = await one_thread.get(f"{server.url}/k", ranged(0, 100), 100, then)
    assert answer.data == BODY[:100]
    assert [what for what, _ in seen] == ["then"]  # not yet "after": the answer came first
    handed_over.set()
    assert await asyncio.to_thread(done.wait, 5)
    assert [what for what, _ in seen] == ["then", "after"]
    assert seen[0][1] == seen[1][1] != loop_thread  # both in the worker that received the bytes


async def test_then_may_decline_and_sees_failures_too(server: Server, one_thread: RangedGetter) -> None:
    """An answer without the range (another length) still goes to ``then``, which returns nothing to do."""
    answers: list[RangeAnswer] = []

    def then(answer: RangeAnswer) -> None:
        answers.append(answer)
        return None

    answer = await one_thread.get(f"{server.url}/k", ranged(0, 100), 99, then)
    assert answer.data is None and answers == [answer]


async def test_a_redirect_is_never_followed(server: Server, getter: RangedGetter) -> None:
    """The request carries a signature: a 3xx is handed back, never sent on to another origin."""
    elsewhere = Server()
    try:
        def redirect(h: http.server.BaseHTTPRequestHandler) -> None:
            h.send_response(307)
            h.send_header("Location", f"{elsewhere.url}/stolen")
            h.send_header("Content-Length", "0")
            h.end_headers()

        server.script = redirect
        answer = await getter.get(f"{server.url}/k?X-Amz-Signature=abc", ranged(0, 100), 100)
        assert answer.status == 307 and answer.data is None
        assert elsewhere.requests == 0
    finally:
        elsewhere.stop()


async def test_an_s3_error_gives_its_code_and_keeps_the_connection(server: Server, one_thread: RangedGetter) -> None:
    getter = one_thread
    def missing(h: http.server.BaseHTTPRequestHandler) -> None:
        body = b"<?xml version='1.0'?><Error><Code>NoSuchKey</Code><Message>secret words</Message></Error>"
        h.send_response(404)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    server.script = missing
    answer = await getter.get(f"{server.url}/k", ranged(0, 10), 10)
    assert (answer.status, answer.error_code, answer.data) == (404, "NoSuchKey", None)
    server.script = serve_range
    assert (await getter.get(f"{server.url}/k", ranged(0, 10), 10)).data == BODY[:10]
    assert server.connections == 1  # the error's connection carried the next request


async def test_another_length_is_no_data(server: Server, getter: RangedGetter) -> None:
    """A server that answers another range (or ignores Range) gives nothing the caller could misuse."""
    answer = await getter.get(f"{server.url}/k", ranged(0, 100), 99)
    assert answer.status == 206 and answer.data is None


async def test_a_body_cut_short_is_an_error(server: Server, getter: RangedGetter) -> None:
    def short(h: http.server.BaseHTTPRequestHandler) -> None:
        h.send_response(206)
        h.send_header("Content-Length", str(len(BODY)))
        h.end_headers()
        h.wfile.write(BODY[: len(BODY) // 2])
        h.close_connection = True

    server.script = short
    with pytest.raises((http.client.HTTPException, OSError)):
        await getter.get(f"{server.url}/k", ranged(0, len(BODY)), len(BODY))


async def test_a_connection_the_server_dropped_is_replaced_once(server: Server, one_thread: RangedGetter) -> None:
    """A kept-alive connection closed by the server while idle: the request goes again on a new one."""
    def once(h: http.server.BaseHTTPRequestHandler) -> None:
        serve_range(h)
        h.close_connection = True  # closes after answering, without saying so in a header

    server.script = once
    for _ in range(3):
        assert (await one_thread.get(f"{server.url}/k", ranged(0, 64), 64)).data == BODY[:64]
    assert server.requests == 3 and server.connections == 3


async def test_a_caller_that_stops_waiting_frees_the_thread(server: Server, getter: RangedGetter) -> None:
    """Cancelled mid-body: the thread stops at its next read and closes the connection."""
    released = threading.Event()

    def slow(h: http.server.BaseHTTPRequestHandler) -> None:
        h.send_response(206)
        h.send_header("Content-Length", str(len(BODY)))
        h.end_headers()
        h.wfile.write(BODY[:1000])
        h.wfile.flush()
        released.wait(5)
        try:
            h.wfile.write(BODY[1000:])
        except OSError:
            pass

    server.script = slow
    task = asyncio.ensure_future(getter.get(f"{server.url}/k", ranged(0, len(BODY)), len(BODY)))
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    released.set()
    server.script = serve_range
    # Both threads serve new requests: the abandoned one finished (its connection closed, not kept).
    answers = await asyncio.gather(*(getter.get(f"{server.url}/k", ranged(0, 10), 10) for _ in range(4)))
    assert all(a.data == BODY[:10] for a in answers)


def test_a_block_buffer_is_used_again_only_when_no_view_of_it_is_alive() -> None:
    """A reused buffer must never be one a reader, the RAM tier or a disk write still holds."""
    from tiering.buffers import MAP_MIN_BYTES, BufferPool

    pool = BufferPool(keep_free=1)
    size = MAP_MIN_BYTES * 2
    first = pool.take(size)
    first[:4] = b"AAAA"
    held = first.toreadonly()[0:4]  # a slice handed out (a FUSE reply, a RAM-tier entry)
    del first
    second = pool.take(size)  # the first is still viewed: a new mapping
    assert pool.mapped == 2 and pool.reused == 0
    assert held == b"AAAA"
    del held
    third = pool.take(size)  # the first is free now: used again
    assert pool.reused == 1 and pool.mapped == 2
    third[:4] = b"BBBB"
    del second, third
    # Idle buffers beyond keep_free are let go: two idle now, one kept.
    pool.take(MAP_MIN_BYTES * 3)
    assert len(pool._mappings) == 2  # the new one and one idle
