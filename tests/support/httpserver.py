"""A static HTTP file server on 127.0.0.1 for the http(s):// source tests (aiohttp, in its own thread).

It serves a directory as the usual static web servers do, which is what ``FsspecObjectStore`` meets
in the field:

- files through aiohttp's ``FileResponse``: ``Range`` (206, 416 past the end), a strong ``ETag``
  derived from the file's mtime (ns) and size, ``If-Match`` answered with 412 for another ETag,
  ``HEAD``;
- a directory requested without its trailing ``/`` is redirected (301) to it, as nginx does;
- a directory with its ``/`` answers an HTML index page of relative, percent-encoded links (``name``
  for files, ``name/`` for directories), plus a parent link and Apache-style sort links that a
  lister must ignore; ``index=False`` serves no index (404), as a server without autoindex;
- paths that would leave the served directory answer 404.

Faults a test may switch on at any time (plain attributes): ``ignore_if_match`` serves a file as if
the request had no ``If-Match`` (a server that does not implement it), ``no_etag`` names paths
served whole, without an ``ETag`` (a dynamic page, or a server that sends none).

``requests`` counts requests by method (``GET``/``HEAD``) and path, so a test can tell how many
GETs reached the server. The server runs on its own event loop in a daemon thread, so sync tests
(FUSE mounts in subprocesses) and async tests alike can use it; ``stop()`` is bounded.
"""

from __future__ import annotations

import asyncio
import html
import os
import threading
from collections import Counter
from pathlib import Path
from urllib.parse import quote, unquote

from aiohttp import web

# Bound on starting and stopping the server thread: loopback binds in milliseconds.
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0


class StaticHttpServer:
    """Serves ``root`` on ``http://127.0.0.1:<port>/``. Use as a context manager, or start()/stop()."""

    def __init__(self, root: Path, *, index: bool = True) -> None:
        self.root = root.resolve()
        self.index = index
        self.port = 0
        self.requests: Counter[tuple[str, str]] = Counter()
        self.ignore_if_match = False
        self.no_etag: set[str] = set()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def gets(self, path_prefix: str = "/", *, files_only: bool = False) -> int:
        """GET requests seen so far for paths below ``path_prefix`` (decoded, e.g. ``/ds/``);
        with ``files_only``, not those of directories' index pages (paths ending in ``/``)."""
        with self._lock:
            return sum(n for (method, path), n in self.requests.items()
                       if method == "GET" and path.startswith(path_prefix)
                       and not (files_only and path.endswith("/")))

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = unquote(request.raw_path.partition("?")[0])
        with self._lock:
            self.requests[(request.method, path)] += 1
        target = (self.root / path.lstrip("/")).resolve()
        if target != self.root and self.root not in target.parents:
            raise web.HTTPNotFound()
        if target.is_dir():
            if not path.endswith("/"):
                raise web.HTTPMovedPermanently(location=quote(path) + "/")
            if not self.index:
                raise web.HTTPNotFound()
            return web.Response(text=self._index_page(target, path), content_type="text/html")
        if not target.is_file():
            raise web.HTTPNotFound()
        if path in self.no_etag:
            return web.Response(body=target.read_bytes(), content_type="application/octet-stream")
        if self.ignore_if_match and "Range" in request.headers:
            return self._range_ignoring_if_match(request, target)
        return web.FileResponse(target)

    @staticmethod
    def _range_ignoring_if_match(request: web.Request, target: Path) -> web.Response:
        """What ``FileResponse`` would answer to a ``Range`` GET whose ``If-Match`` it never read."""
        stat = target.stat()
        data = target.read_bytes()
        wanted = request.http_range
        start = wanted.start or 0
        stop = len(data) if wanted.stop is None else min(wanted.stop, len(data))
        headers = {"ETag": f'"{stat.st_mtime_ns:x}-{stat.st_size:x}"',
                   "Content-Range": f"bytes {start}-{stop - 1}/{len(data)}"}
        return web.Response(status=206, body=data[start:stop], headers=headers)

    @staticmethod
    def _index_page(directory: Path, path: str) -> str:
        links = ['<a href="../">Parent Directory</a>', '<a href="?C=N;O=D">Name</a>', '<a href="?C=S;O=A">Size</a>']
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            name = entry.name + ("/" if entry.is_dir() else "")
            links.append(f'<a href="{html.escape(quote(name))}">{html.escape(name)}</a>')
        body = "<br>\n".join(links)
        return f"<html><head><title>Index of {html.escape(path)}</title></head><body>\n{body}\n</body></html>\n"

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None and isinstance(server, asyncio.base_events.Server)
        self.port = server.sockets[0].getsockname()[1]

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._start())
        except BaseException as exc:  # reported to start(), which raises it
            self._error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            if self._runner is not None:
                loop.run_until_complete(self._runner.cleanup())
            loop.close()

    def start(self) -> "StaticHttpServer":
        self._thread = threading.Thread(target=self._run, name="static-http", daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise RuntimeError("the test HTTP server did not start in time")
        if self._error is not None:
            raise RuntimeError(f"the test HTTP server did not start: {self._error}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(STOP_TIMEOUT_S)

    def __enter__(self) -> "StaticHttpServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


_mtime_lock = threading.Lock()
_last_mtime_ns = 0


def write_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` as a careful publisher does (temp file, rename), with a fresh mtime.

    The server's ETag is its mtime (ns) and size, and the kernel stamps mtimes with a coarse clock
    (a few ms): two rewrites of the same size in one tick would share an ETag. Each write here gets
    an mtime later than every earlier one, so each version has its own ETag, as a real publisher's
    files, written seconds apart, do.
    """
    global _last_mtime_ns
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    with _mtime_lock:
        stamp = max(os.stat(tmp).st_mtime_ns, _last_mtime_ns + 1_000)
        _last_mtime_ns = stamp
    os.utime(tmp, ns=(stamp, stamp))
    os.replace(tmp, path)
