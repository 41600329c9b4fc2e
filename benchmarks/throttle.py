"""A throttled TCP link on 127.0.0.1: a stand-in for a remote region between a mount and its source.

``ThrottledProxy`` listens on a free loopback port and forwards every connection to one upstream
``host:port`` (also loopback), adding what a WAN adds: ``delay_s`` before a new connection is opened
upstream and before each chunk a client sends (an HTTP request is one chunk or a few: roughly a round
trip per request), and one bandwidth cap shared by every connection for the bytes coming back (a
single "next free" instant that each chunk books ``len / rate`` seconds of, so the sum over all
connections stays under the cap whatever the parallelism). It runs its own event loop in a daemon
thread, so a synchronous harness can start it, use its port, and ``stop()`` it (bounded); bytes are
passed through unchanged, so SigV4 signatures (which cover the Host header) still verify.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

from tests.support.s3servers import HOST, free_ports

# Bytes read from the upstream per chunk: small enough that the cap is smooth, large enough that
# the per-chunk cost of Python stays far below what the cap allows.
CHUNK = 64 * 1024
# How long start() and stop() wait for the proxy's loop (a loopback bind takes milliseconds).
LOOP_WAIT_S = 10.0


class ThrottledProxy:
    """Forward 127.0.0.1:``port`` to ``upstream_port`` with a per-request delay and a shared cap."""

    def __init__(self, upstream_port: int, *, delay_s: float = 0.010, rate_bytes_s: float = 40e6) -> None:
        if delay_s < 0 or rate_bytes_s <= 0:
            raise ValueError(f"throttle: delay {delay_s} s must be >= 0 and rate {rate_bytes_s} B/s > 0")
        self.upstream_port = upstream_port
        self.delay_s = delay_s
        self.rate = rate_bytes_s
        (self.port,) = free_ports(1)
        self.bytes_down = 0
        self.connections = 0
        self._next_free = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> "ThrottledProxy":
        self._thread = threading.Thread(target=self._run, name="throttled-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(LOOP_WAIT_S):
            raise RuntimeError(f"throttled proxy did not start within {LOOP_WAIT_S:g} s")
        if self._error is not None:
            raise RuntimeError(f"throttled proxy on port {self.port}: {self._error}")
        return self

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(LOOP_WAIT_S)

    def __enter__(self) -> "ThrottledProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the loop -----------------------------------------------------------------------------------

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            self._server = loop.run_until_complete(asyncio.start_server(self._client, HOST, self.port))
        except OSError as exc:
            self._error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            self._server.close()
            for task in asyncio.all_tasks(loop):
                task.cancel()
            with contextlib.suppress(Exception):
                loop.run_until_complete(asyncio.sleep(0))
            loop.close()

    async def _throttle(self, n: int) -> None:
        """Book ``n`` bytes on the shared cap; sleep until their slot has passed."""
        now = time.monotonic()
        start = max(now, self._next_free)
        self._next_free = start + n / self.rate
        if self._next_free > now:
            await asyncio.sleep(self._next_free - now)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        await asyncio.sleep(self.delay_s)
        try:
            up_reader, up_writer = await asyncio.open_connection(HOST, self.upstream_port)
        except OSError:
            writer.close()
            return

        async def upstream() -> None:  # client -> server: a delay per chunk (per request)
            while chunk := await reader.read(CHUNK):
                await asyncio.sleep(self.delay_s)
                up_writer.write(chunk)
                await up_writer.drain()
            up_writer.close()

        async def downstream() -> None:  # server -> client: the shared bandwidth cap
            while chunk := await up_reader.read(CHUNK):
                await self._throttle(len(chunk))
                self.bytes_down += len(chunk)
                writer.write(chunk)
                await writer.drain()
            writer.close()

        try:
            await asyncio.gather(upstream(), downstream())
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for w in (writer, up_writer):
                with contextlib.suppress(Exception):
                    w.close()
