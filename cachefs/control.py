"""The daemon's control API: HTTP over a unix socket (and, when asked, over TCP for stats).

Endpoints: ``GET /stats`` (the JSON of ``cachefs stats --json``), ``GET /healthz`` (200 while the mount
is serving), ``GET /info`` (pid, source, mountpoint). The unix socket lives in a private directory
(mode 0700) and its path is published as the ``user.cachefs.control`` extended attribute of the mount
root, so the CLI needs nothing but the mountpoint. aiohttp is already on the event loop through
s3fs, so the control API costs no extra thread or dependency.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, UnixConnector, web

# How long the CLI waits for the daemon to answer a control request. The daemon answers from memory
# on its event loop, so anything beyond a few seconds means it is wedged.
CONTROL_TIMEOUT_S = 10.0


def runtime_dir() -> Path:
    """Where control sockets live: $XDG_RUNTIME_DIR/cachefs, /run/cachefs as root, else /tmp."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if not base:
        base = "/run" if os.geteuid() == 0 and os.access("/run", os.W_OK) else tempfile.gettempdir()
    path = Path(base) / ("cachefs" if base != tempfile.gettempdir() else f"cachefs-{os.geteuid()}")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def socket_path_for(mountpoint: Path) -> Path:
    digest = hashlib.sha256(str(mountpoint.resolve()).encode()).hexdigest()[:16]
    return runtime_dir() / f"{digest}.sock"


class ControlServer:
    def __init__(self, socket_path: Path, stats: Callable[[], dict[str, Any]], info: dict[str, Any]) -> None:
        self.socket_path = socket_path
        self._stats = stats
        self._info = info
        self._runner: web.AppRunner | None = None
        self.tcp_port: int | None = None

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/stats", self._handle_stats)
        app.router.add_get("/healthz", self._handle_health)
        app.router.add_get("/info", self._handle_info)
        return app

    async def _handle_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self._stats(), dumps=lambda o: json.dumps(o, sort_keys=True))

    async def _handle_health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _handle_info(self, request: web.Request) -> web.Response:
        return web.json_response(self._info)

    async def start(self, tcp_host: str | None = None, tcp_port: int | None = None) -> None:
        self._runner = web.AppRunner(self._app(), access_log=None)
        await self._runner.setup()
        if self.socket_path.exists():
            self.socket_path.unlink()
        await web.UnixSite(self._runner, str(self.socket_path)).start()
        os.chmod(self.socket_path, 0o600)
        if tcp_host is not None and tcp_port is not None:
            site = web.TCPSite(self._runner, tcp_host, tcp_port)
            await site.start()
            server = site._server  # aiohttp exposes the bound port only here
            if server is not None and getattr(server, "sockets", None):
                self.tcp_port = server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        try:
            self.socket_path.unlink()
        except FileNotFoundError:
            pass


class ControlError(Exception):
    """The daemon could not be reached or answered with an error; one-line message."""


async def _get_json(socket_path: str, route: str) -> Any:
    timeout = ClientTimeout(total=CONTROL_TIMEOUT_S)
    try:
        async with ClientSession(connector=UnixConnector(path=socket_path), timeout=timeout) as session:
            async with session.get(f"http://cachefs{route}") as response:
                if response.status != 200:
                    raise ControlError(f"daemon answered {response.status} to {route}")
                return await response.json()
    except (OSError, ClientError, TimeoutError, ValueError) as exc:
        raise ControlError(f"cannot reach the cachefs daemon at {socket_path}: {exc}") from exc


def request_json(socket_path: str, route: str) -> Any:
    """Synchronous GET of a control route (for the CLI)."""
    return asyncio.run(_get_json(socket_path, route))
