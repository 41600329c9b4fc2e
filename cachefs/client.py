"""How anything outside the daemon talks to a running mount: find its control socket, call a route.

A command names a mountpoint; the mount table says whether it is a cachefs mount, and the daemon
publishes its control socket as the ``user.cachefs.control`` extended attribute of the mount root
(``cachefs.mounts.CONTROL_XATTR``). Routes answer JSON over HTTP on that unix socket (the server is
``cachefs.daemon.control``). This module imports neither the daemon nor the filesystem, so the CLI
and the CSI driver reach a mount through it alone. ``request_json`` fails with ``ControlError``;
``control_socket`` and ``call``, for commands, with a one-line ``UsageError``.
"""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, UnixConnector

from cachefs import mounts

# How long the CLI waits for the daemon to answer a control request. The daemon answers from memory
# on its event loop, so anything beyond a few seconds means it is wedged.
CONTROL_TIMEOUT_S = 10.0


class UsageError(Exception):
    """Bad input from the user, or nothing to talk to: one line, non-zero exit."""


class ControlError(Exception):
    """The daemon could not be reached or answered with an error; one-line message."""


async def _request_json(socket_path: str, route: str, method: str, body: Any, timeout_s: float) -> Any:
    timeout = ClientTimeout(total=timeout_s)
    try:
        async with ClientSession(connector=UnixConnector(path=socket_path), timeout=timeout) as session:
            async with session.request(method, f"http://cachefs{route}", json=body) as response:
                payload = await response.json(content_type=None)
                if response.status != 200:
                    detail = payload.get("error") if isinstance(payload, dict) else None
                    raise ControlError(detail or f"daemon answered {response.status} to {route}")
                return payload
    except (OSError, ClientError, TimeoutError, ValueError) as exc:
        raise ControlError(f"cannot reach the cachefs daemon at {socket_path}: {exc}") from exc


def request_json(
    socket_path: str, route: str, *, method: str = "GET", body: Any = None, timeout_s: float = CONTROL_TIMEOUT_S
) -> Any:
    """Synchronous request to a control route (for the CLI); ``ControlError`` with a one-line reason."""
    return asyncio.run(_request_json(socket_path, route, method, body, timeout_s))


def control_socket(mountpoint: Path) -> str:
    """The control socket of the cachefs mounted at ``mountpoint``; UsageError if there is none."""
    path = Path(os.path.abspath(mountpoint))
    entry = mounts.find_mount(path)
    if entry is None:
        raise UsageError(f"{path} is not a mountpoint")
    if entry.fstype != mounts.FSTYPE:
        raise UsageError(f"{path} is not a cachefs mount (it is {entry.fstype})")
    try:
        return os.getxattr(path, mounts.CONTROL_XATTR).decode()
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            raise UsageError(f"the cachefs daemon of {path} is not running (run 'cachefs unmount {path}')") from None
        raise UsageError(f"cannot query {path}: {exc.strerror}") from None


def call(mountpoint: Path, route: str, *, method: str = "GET", body: Any = None,
         timeout_s: float = CONTROL_TIMEOUT_S) -> Any:
    """One control request to the daemon of ``mountpoint``."""
    try:
        return request_json(control_socket(mountpoint), route, method=method, body=body, timeout_s=timeout_s)
    except ControlError as exc:
        raise UsageError(str(exc)) from None
