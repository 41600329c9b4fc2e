"""The GET engines of the S3 store: ``RangedGetter`` (``http.client`` in worker threads, large blocks)
and ``CurlGetter`` (one libcurl multi handle in one thread, small blocks), one contract.

Against a small stdlib HTTP server on 127.0.0.1 that answers what each test scripts (a range, an S3
error document, a redirect, a short body, a connection the server drops between requests), so the
cases a real S3 server seldom produces on demand are exercised on the real ``http.client`` and
libcurl paths. Every contract test runs on both engines (``engine``); libcurl's own are at the end.
"""

from __future__ import annotations

import asyncio
import http.client
import http.server
import os
import threading
from typing import Callable, Iterator

import pytest

from tiering.objectstore.curlget import CurlGetter
from tiering.objectstore.rangedget import WAITALL_MIN_BYTES, RangeAnswer, RangedGetter

Getter = RangedGetter | CurlGetter

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


def make_getter(engine: str, connections: int, *, read_timeout_s: float = 5.0) -> Getter:
    if engine == "curl":
        return CurlGetter(connections=connections, connect_timeout_s=2.0, read_timeout_s=read_timeout_s)
    return RangedGetter(threads=connections, connect_timeout_s=2.0, read_timeout_s=read_timeout_s)


@pytest.fixture(params=["threads", "curl"])
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def getter(engine: str) -> Iterator[Getter]:
    g = make_getter(engine, 2)
    try:
        yield g
    finally:
        g.close()


@pytest.fixture
def one_thread(engine: str) -> Iterator[Getter]:
    """One connection unless one is dropped (one worker thread; libcurl's cap): counts mean something."""
    g = make_getter(engine, 1)
    try:
        yield g
    finally:
        g.close()


def ranged(start: int, end: int) -> dict[str, str]:
    return {"Range": f"bytes={start}-{end - 1}"}


async def test_the_range_arrives_whole_in_one_read_only_buffer(server: Server, one_thread: Getter) -> None:
    getter = one_thread
    for start, end in ((0, len(BODY)), (5, 1000), (1, WAITALL_MIN_BYTES + 7)):
        answer = await getter.get(f"{server.url}/k", ranged(start, end), end - start)
        assert answer.status == 206 and answer.etag == '"e1"'
        assert answer.data is not None and answer.data.readonly
        assert answer.data == BODY[start:end]
    assert server.connections == 1  # kept alive between requests


async def test_then_runs_in_the_worker_after_the_answer_is_handed_over(server: Server, one_thread: Getter) -> None:
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
    assert seen[0][1] == seen[1][1] != loop_thread  # both in the thread that received the bytes


async def test_then_may_decline_and_sees_failures_too(server: Server, one_thread: Getter) -> None:
    """An answer without the range (another length) still goes to ``then``, which returns nothing to do."""
    answers: list[RangeAnswer] = []

    def then(answer: RangeAnswer) -> None:
        answers.append(answer)
        return None

    answer = await one_thread.get(f"{server.url}/k", ranged(0, 100), 99, then)
    assert answer.data is None and answers == [answer]


async def test_a_redirect_is_never_followed(server: Server, getter: Getter) -> None:
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


async def test_an_s3_error_gives_its_code_and_keeps_the_connection(server: Server, one_thread: Getter) -> None:
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


async def test_another_length_is_no_data(server: Server, getter: Getter) -> None:
    """A server that answers another range (or ignores Range) gives nothing the caller could misuse."""
    answer = await getter.get(f"{server.url}/k", ranged(0, 100), 99)
    assert answer.status == 206 and answer.data is None


async def test_a_body_cut_short_is_an_error(server: Server, getter: Getter) -> None:
    def short(h: http.server.BaseHTTPRequestHandler) -> None:
        h.send_response(206)
        h.send_header("Content-Length", str(len(BODY)))
        h.end_headers()
        h.wfile.write(BODY[: len(BODY) // 2])
        h.close_connection = True

    server.script = short
    with pytest.raises((http.client.HTTPException, OSError)):
        await getter.get(f"{server.url}/k", ranged(0, len(BODY)), len(BODY))


async def test_a_connection_the_server_dropped_is_replaced_once(server: Server, one_thread: Getter) -> None:
    """A kept-alive connection closed by the server while idle: the request goes again on a new one."""
    def once(h: http.server.BaseHTTPRequestHandler) -> None:
        serve_range(h)
        h.close_connection = True  # closes after answering, without saying so in a header

    server.script = once
    for _ in range(3):
        assert (await one_thread.get(f"{server.url}/k", ranged(0, 64), 64)).data == BODY[:64]
    assert server.requests == 3 and server.connections == 3


async def test_a_caller_that_stops_waiting_frees_the_thread(server: Server, getter: Getter) -> None:
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


# -- libcurl's engine: what its own machinery must not get wrong ---------------------------------


async def test_curl_a_long_answer_that_is_not_the_range_is_not_read(server: Server) -> None:
    """A 200 of the whole object (the Range ignored), larger than an error document: not received,
    its connection closed, the next request on a new one."""
    def whole(h: http.server.BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Length", str(len(BODY)))
        h.end_headers()
        h.wfile.write(BODY)

    getter = CurlGetter(connections=1, connect_timeout_s=2.0, read_timeout_s=5.0)
    try:
        server.script = whole
        answer = await getter.get(f"{server.url}/k", ranged(0, 100), 100)
        assert (answer.status, answer.data, answer.error_code) == (200, None, None)
        server.script = serve_range
        assert (await getter.get(f"{server.url}/k", ranged(0, 100), 100)).data == BODY[:100]
        assert server.connections == 2
    finally:
        getter.close()


async def test_curl_a_body_of_unknown_length_is_cut_at_what_could_be_used(server: Server) -> None:
    """Chunked (no Content-Length), far longer than the range or an error document: libcurl stops
    receiving it past that bound; the answer is its status without data."""
    from tiering.objectstore.rangedget import MAX_DRAIN_BYTES

    sent: list[int] = []

    def chunked(h: http.server.BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        piece = b"x" * 65536
        try:
            for _ in range(256):  # 16 MiB, unless the client stops reading
                h.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                sent.append(len(piece))
            h.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass
        h.close_connection = True

    getter = CurlGetter(connections=1, connect_timeout_s=2.0, read_timeout_s=5.0)
    try:
        server.script = chunked
        answer = await getter.get(f"{server.url}/k", ranged(0, 100), 100)
        assert (answer.status, answer.data) == (200, None)
        await asyncio.sleep(0.2)
        assert sum(sent) < 16 * 1024 * 1024  # the client hung up long before the end
        assert MAX_DRAIN_BYTES < 16 * 1024 * 1024
    finally:
        getter.close()


async def test_curl_a_server_that_stops_sending_times_out(server: Server) -> None:
    """Headers, then silence: the read timeout ends the transfer (TimeoutError), the engine goes on."""
    release = threading.Event()

    def stall(h: http.server.BaseHTTPRequestHandler) -> None:
        h.send_response(206)
        h.send_header("Content-Length", "100")
        h.end_headers()
        h.wfile.flush()
        release.wait(10)

    getter = CurlGetter(connections=2, connect_timeout_s=2.0, read_timeout_s=1.0)
    try:
        server.script = stall
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(TimeoutError):
            await getter.get(f"{server.url}/k", ranged(0, 100), 100)
        assert 0.9 <= loop.time() - started < 4.0
        release.set()
        server.script = serve_range
        assert (await getter.get(f"{server.url}/k", ranged(0, 100), 100)).data == BODY[:100]
    finally:
        release.set()
        getter.close()


async def test_curl_errors_name_no_url(server: Server) -> None:
    """A refused connection is a ConnectionError whose text is libcurl's code, not the (signed) URL."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once it is closed
    getter = CurlGetter(connections=1, connect_timeout_s=2.0, read_timeout_s=5.0)
    try:
        with pytest.raises(ConnectionError) as raised:
            await getter.get(f"http://127.0.0.1:{port}/k?X-Amz-Signature=secret", ranged(0, 10), 10)
        assert "secret" not in str(raised.value) and "127.0.0.1" not in str(raised.value)
    finally:
        getter.close()


async def test_curl_refuses_other_schemes_and_the_environments_proxy(
        server: Server, tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Only HTTP(S) to the URL's own origin: no file:// read, no proxy taken from the environment."""
    proxy = Server()
    try:
        monkeypatch.setenv("http_proxy", proxy.url)
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        monkeypatch.setenv("all_proxy", proxy.url)
        getter = CurlGetter(connections=1, connect_timeout_s=2.0, read_timeout_s=5.0)
        try:
            assert (await getter.get(f"{server.url}/k", ranged(0, 10), 10)).data == BODY[:10]
            assert proxy.requests == 0 and server.requests == 1
            secret = os.path.join(tmp_path, "secret")
            with open(secret, "wb") as f:
                f.write(b"0123456789")
            with pytest.raises(OSError):
                await getter.get(f"file://{secret}", {}, 10)
        finally:
            getter.close()
    finally:
        proxy.stop()


async def test_curl_a_url_that_cannot_be_made_is_the_requests_error(server: Server) -> None:
    def unsigned() -> str:
        raise PermissionError("no credentials")

    getter = CurlGetter(connections=1, connect_timeout_s=2.0, read_timeout_s=5.0)
    try:
        with pytest.raises(PermissionError):
            await getter.get(unsigned, ranged(0, 10), 10)
        assert (await getter.get(f"{server.url}/k", ranged(0, 10), 10)).data == BODY[:10]
    finally:
        getter.close()


async def test_curl_close_cancels_what_runs_and_ends_its_thread(server: Server) -> None:
    release = threading.Event()

    def stall(h: http.server.BaseHTTPRequestHandler) -> None:
        release.wait(10)

    getter = CurlGetter(connections=2, connect_timeout_s=2.0, read_timeout_s=30.0)
    try:
        server.script = stall
        task = asyncio.ensure_future(getter.get(f"{server.url}/k", ranged(0, 10), 10))
        await asyncio.sleep(0.2)
        thread = getter._thread
        assert thread is not None and thread.is_alive()
        await asyncio.to_thread(getter.close)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
        assert not thread.is_alive()
        with pytest.raises(Exception):
            await getter.get(f"{server.url}/k", ranged(0, 10), 10)  # closed: refused at once
    finally:
        release.set()
        getter.close()


async def test_curl_many_at_once_each_gets_its_own_range(server: Server) -> None:
    """64 requests on 4 connections, each range different: every answer is its own bytes."""
    getter = CurlGetter(connections=4, connect_timeout_s=2.0, read_timeout_s=5.0)
    try:
        spans = [(i * 997, i * 997 + 100 + i) for i in range(64)]
        answers = await asyncio.gather(*(getter.get(f"{server.url}/k", ranged(a, b), b - a) for a, b in spans))
        assert [a.data for a in answers] == [BODY[a:b] for a, b in spans]
        assert server.connections <= 4
    finally:
        getter.close()


def self_signed(directory: str) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key, as PEM files in ``directory`` (cryptography: moto's)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return cert_path, key_path


async def test_tls_is_verified_against_the_ca_bundle_or_the_systems(
        engine: str, server: Server, tmp_path: os.PathLike[str]) -> None:
    """Over HTTPS: the range arrives when the server's certificate is in ``ca_bundle``; with the
    system's CAs only (which do not hold it) the request fails and gives no data."""
    import ssl

    cert, key = self_signed(os.fspath(tmp_path))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.httpd.socket = context.wrap_socket(server.httpd.socket, server_side=True)
    url = f"https://127.0.0.1:{server.httpd.server_address[1]}/k"
    trusting = (CurlGetter(connections=1, connect_timeout_s=2.0, read_timeout_s=5.0, ca_bundle=cert)
                if engine == "curl" else
                RangedGetter(threads=1, connect_timeout_s=2.0, read_timeout_s=5.0, ca_bundle=cert))
    system = make_getter(engine, 1)
    try:
        for start, end in ((0, 100), (7, len(BODY))):
            assert (await trusting.get(url, ranged(start, end), end - start)).data == BODY[start:end]
        with pytest.raises(OSError):
            await system.get(url, ranged(0, 100), 100)
    finally:
        trusting.close()
        system.close()


async def test_curl_aborts_among_many_transfers_leave_nothing_behind(server: Server) -> None:
    """200 requests on 4 connections, a third of them given up mid-way (some before libcurl took them,
    some while their body trickles): every other one gets its own bytes, and afterwards libcurl's
    thread holds no transfer, and every handle it made is idle for the next request."""
    import random

    rng = random.Random(35)

    def sometimes_slow(h: http.server.BaseHTTPRequestHandler) -> None:
        first, last = h.headers["Range"].removeprefix("bytes=").split("-")
        body = BODY[int(first) : int(last) + 1]
        h.send_response(206)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if h.path.endswith("slow"):
            h.wfile.write(body[:10])
            h.wfile.flush()
            threading.Event().wait(0.3)
        try:
            h.wfile.write(body[10:] if h.path.endswith("slow") else body)
        except OSError:
            pass  # the client gave up and closed

    getter = CurlGetter(connections=4, connect_timeout_s=2.0, read_timeout_s=5.0)
    server.script = sometimes_slow
    try:
        async def one(i: int) -> tuple[int, bytes | None]:
            start, end = i * 101, i * 101 + 1000 + i
            slow = rng.random() < 0.3
            request = asyncio.ensure_future(
                getter.get(f"{server.url}/k{i}{'slow' if slow else ''}", ranged(start, end), end - start))
            if slow:
                await asyncio.sleep(rng.choice([0.0, 0.01, 0.1]))
                request.cancel()
            try:
                answer = await request
            except asyncio.CancelledError:
                return i, None
            assert answer.data is not None
            return i, bytes(answer.data)

        results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(200))), 60)
        got = [(i, data) for i, data in results if data is not None]
        assert len(got) >= 100
        assert all(data == BODY[i * 101 : i * 101 + 1000 + i] for i, data in got)
        # The thread settles: nothing active, nothing queued, every handle idle (at most one per
        # request ever in flight at once).
        for _ in range(100):
            if not getter._active and not getter._submitted and not getter._aborted:
                break
            await asyncio.sleep(0.05)
        assert not getter._active and not getter._submitted and not getter._aborted
        assert 1 <= len(getter._idle) <= 200
        assert (await getter.get(f"{server.url}/k", ranged(0, 100), 100)).data == BODY[:100]
    finally:
        getter.close()


async def test_curl_a_failure_of_its_thread_is_an_error_for_the_caller_and_the_next_get_starts_anew(
        server: Server, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A bug that stops libcurl's thread: the request in flight fails with an OSError (which the S3
    store answers by repeating the GET through botocore), not a cancellation the reader would see,
    and the engine is not left dead: the next request starts a new thread."""
    getter = CurlGetter(connections=2, connect_timeout_s=2.0, read_timeout_s=5.0)
    real = CurlGetter._finish
    failures = [RuntimeError("a bug")]

    def failing_once(self: CurlGetter, multi: object) -> None:
        if failures and self._active:
            raise failures.pop()
        real(self, multi)  # type: ignore[arg-type]

    monkeypatch.setattr(CurlGetter, "_finish", failing_once)
    try:
        with pytest.raises(OSError, match="thread stopped"):
            await getter.get(f"{server.url}/k", ranged(0, 100), 100)
        assert getter._thread is None  # the stopped thread let go of before its callers heard
        assert "libcurl GET thread stopped" in caplog.text
        assert (await getter.get(f"{server.url}/k", ranged(0, 100), 100)).data == BODY[:100]
        assert getter._thread is not None and getter._thread.is_alive()
    finally:
        getter.close()
