"""The daemon's control API: HTTP over a unix socket (and, when asked, over TCP for stats).

Endpoints: ``GET /stats`` (the JSON of ``cachefs stats --json``), ``GET /healthz`` (200 while the mount
is serving), ``GET /info`` (pid, source, mountpoint; ``stats_addr``, the TCP address bound, port 0
answered by the one the kernel gave). The unix socket lives in a private directory
(mode 0700) and its path is published as the ``user.cachefs.control`` extended attribute of the mount
root (``cachefs.mounts.CONTROL_XATTR``), so the CLI needs nothing but the mountpoint. aiohttp is
already on the event loop through s3fs, so the control API costs no extra thread or dependency. The
client side (``request_json``) is ``cachefs.client``: the CLI and the CSI driver use it without
importing the daemon.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from cachefs.mounts import RECORD_SUFFIX
# Re-exported: the daemon names its socket with these (they live in cachefs.mounts, which the CLI may import).
from cachefs.mounts import runtime_dir as runtime_dir
from cachefs.mounts import socket_path_for as socket_path_for
from tiering.private import write_private_file

# The largest request body the unix socket accepts (aiohttp's default is 1 MiB). The largest request
# is a prefetch job's manifest, sent whole: a snapshot line averages ~90 bytes (15,000 files made
# 1.37 MB), so a million entries is ~100 MB and 256 MiB leaves room for long paths. The body is held
# in memory while it is parsed; the socket is the owner's alone (mode 0600), so the bound is against
# mistakes, not attacks. The TCP listener serves read-only GETs and keeps aiohttp's default.
MAX_REQUEST_BYTES = 256 * 1024 * 1024

JsonHandler = Callable[[dict[str, Any]], Awaitable[Any]]
RawHandler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _bind_problem(code: int) -> str:
    """Why a listening socket could not be bound, in words (no Python tuple of the address)."""
    if code == errno.EADDRINUSE:
        return "the port is in use by another process: pick another port"
    if code == errno.EADDRNOTAVAIL:
        return "no interface of this machine has that address"
    if code == errno.EACCES:
        return "permission denied (ports below 1024 need privilege)"
    return os.strerror(code)


class ControlRequestError(Exception):
    """Raised by a route handler: answered as ``{"error": message}`` with ``status``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ControlServer:
    """The control API. Features register their routes with ``add_json_route`` before ``start``.

    A JSON route's handler receives one dict (the query parameters merged with the JSON body, the
    body winning) and returns any JSON-serialisable value; it raises ``ControlRequestError`` for a
    bad request. ``add_route`` takes a raw aiohttp handler, for streaming or non-JSON answers
    (Prometheus text).
    """

    def __init__(self, socket_path: Path, stats: Callable[[], dict[str, Any]], info: dict[str, Any], *,
                 max_request_bytes: int = MAX_REQUEST_BYTES) -> None:
        self.socket_path = socket_path
        self.max_request_bytes = max_request_bytes
        self._runner: web.AppRunner | None = None
        self._routes: list[tuple[str, str, RawHandler, bool]] = []
        self._tcp_runner: web.AppRunner | None = None
        self.tcp_port: int | None = None
        self.add_json_route("GET", "/stats", lambda _params: _async_value(stats()), public=True)
        self.info = info
        self.add_json_route("GET", "/info", lambda _params: _async_value(info))
        self.add_route("GET", "/healthz", self._handle_health, public=True)

    def add_route(self, method: str, path: str, handler: RawHandler, *, public: bool = False) -> None:
        """Register a route. Every route is served on the unix socket (mode 0600, owner only);
        ``public`` ones (read-only views: stats, metrics, health) also on the TCP ``--stats-addr``."""
        self._routes.append((method, path, handler, public))

    def add_json_route(self, method: str, path: str, handler: JsonHandler, *, public: bool = False) -> None:
        async def wrapped(request: web.Request) -> web.Response:
            params: dict[str, Any] = dict(request.query)
            if request.can_read_body:
                try:
                    body = await request.json()
                except web.HTTPRequestEntityTooLarge:
                    size = request.content_length
                    sent = f"{size} bytes" if size is not None else "more bytes"
                    limit = self.max_request_bytes
                    return _json({"error": f"request too large ({sent}, limit {limit})", "limit": limit}, 413)
                except ValueError:
                    return _json({"error": "request body is not valid JSON"}, 400)
                if not isinstance(body, dict):
                    return _json({"error": "request body must be a JSON object"}, 400)
                params.update(body)
            try:
                return _json(await handler(params))
            except ControlRequestError as exc:
                return _json({"error": str(exc)}, exc.status)

        self.add_route(method, path, wrapped, public=public)

    async def _handle_health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    def _app(self, *, public_only: bool) -> web.Application:
        app = web.Application() if public_only else web.Application(client_max_size=self.max_request_bytes)
        for method, path, handler, public in self._routes:
            if public or not public_only:
                app.router.add_route(method, path, handler)
        return app

    async def start(self, tcp_host: str | None = None, tcp_port: int | None = None) -> None:
        self._runner = web.AppRunner(self._app(public_only=False), access_log=None)
        await self._runner.setup()
        if self.socket_path.exists():
            self.socket_path.unlink()
        await web.UnixSite(self._runner, str(self.socket_path)).start()
        os.chmod(self.socket_path, 0o600)
        if tcp_host is not None and tcp_port is not None:
            self._tcp_runner = web.AppRunner(self._app(public_only=True), access_log=None)
            await self._tcp_runner.setup()
            site = web.TCPSite(self._tcp_runner, tcp_host, tcp_port)
            try:
                await site.start()
            except OSError as exc:  # asyncio words it with the address as a Python tuple: the caller names it
                if exc.errno is None:
                    raise
                raise OSError(exc.errno, _bind_problem(exc.errno)) from exc
            server = site._server  # aiohttp exposes the bound port only here
            if isinstance(server, asyncio.Server) and server.sockets:
                self.tcp_port = server.sockets[0].getsockname()[1]
                # The address bound (port 0 asks the kernel for a free one: /info names it).
                self.info["stats_addr"] = f"{tcp_host}:{self.tcp_port}"
        # What /info says, kept beside the socket: a mount whose daemon died (kill -9, OOM) can no
        # longer be asked, and `cachefs unmount` still finds its cache directory here.
        write_private_file(self.socket_path.with_suffix(RECORD_SUFFIX),
                           (json.dumps(self.info, default=str, sort_keys=True) + "\n").encode())

    async def stop(self) -> None:
        for runner in (self._tcp_runner, self._runner):
            if runner is not None:
                await runner.cleanup()
        for path in (self.socket_path, self.socket_path.with_suffix(RECORD_SUFFIX)):
            try:
                path.unlink()
            except FileNotFoundError:
                pass


async def _async_value(value: Any) -> Any:
    return value


def _json(value: Any, status: int = 200) -> web.Response:
    return web.json_response(value, status=status, dumps=lambda o: json.dumps(o, sort_keys=True))
