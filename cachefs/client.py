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
import json
import os
from pathlib import Path
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, UnixConnector

from cachefs import mounts

# How long the CLI waits for the daemon to answer a control request. The daemon answers from memory
# on its event loop, so anything beyond a few seconds means it is wedged.
CONTROL_TIMEOUT_S = 10.0


HTTP_TOO_LARGE = 413
# How much of a non-JSON answer an error message quotes (an HTML error page must stay one line).
MAX_QUOTED_CHARS = 200


class UsageError(Exception):
    """Bad input from the user, or nothing to talk to: one line, non-zero exit."""


class ControlError(Exception):
    """The daemon could not be reached or answered with an error; one-line message."""


async def _request_json(socket_path: str, route: str, method: str, body: Any, timeout_s: float) -> Any:
    timeout = ClientTimeout(total=timeout_s)
    data = None if body is None else json.dumps(body).encode()
    headers = None if data is None else {"Content-Type": "application/json"}
    try:
        async with ClientSession(connector=UnixConnector(path=socket_path), timeout=timeout) as session:
            async with session.request(method, f"http://cachefs{route}", data=data, headers=headers) as response:
                text = await response.text(errors="replace")
                return answer_value(route, response.status, text, sent=len(data) if data is not None else 0)
    except (asyncio.TimeoutError, TimeoutError) as exc:
        raise ControlError(f"the cachefs daemon at {socket_path} did not answer {route} within {timeout_s:g} s") from exc
    except (OSError, ClientError) as exc:
        raise ControlError(f"cannot reach the cachefs daemon at {socket_path}: {exc}") from exc


def answer_value(route: str, status: int, text: str, *, sent: int) -> Any:
    """The JSON value of an answer, or ``ControlError`` saying truly what came back: the daemon's own
    ``{"error": ...}``, a request too large (413, ``sent`` bytes), or an answer that is not JSON."""
    try:
        payload = json.loads(text)
    except ValueError:
        payload = None
        parsed = False
    else:
        parsed = True
    if status == 200 and parsed:
        return payload
    detail = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(detail, str) and detail:
        raise ControlError(detail)
    first = _first_line(text)
    if status == HTTP_TOO_LARGE:
        raise ControlError(f"request too large ({sent} bytes): the daemon refused {route} ({first})")
    if status == 200:
        raise ControlError(f"the daemon answered {route} with something that is not JSON: {first}")
    raise ControlError(f"the daemon answered {route} with HTTP {status}: {first}")


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else "(empty answer)"
    return line if len(line) <= MAX_QUOTED_CHARS else line[:MAX_QUOTED_CHARS] + "..."


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


def enclosing_mount(path: str | os.PathLike[str], cwd: str | None = None) -> tuple[str, str]:
    """``(mountpoint, path relative to it)`` of the innermost cachefs mount holding ``path``
    (relative to ``cwd``, or absolute), found by walking up from it as ``juicefs`` and ``rclone``
    commands do, so any file or directory inside a mount names that mount. The walk is lexical
    (nothing inside a mount is stat'ed); a path reached only through a symlink outside the mounts
    is resolved first. ``UsageError`` with one line: a missing path says it is missing, a path on
    another filesystem says it is not inside a cachefs mount (or what is mounted there)."""
    typed = os.fspath(path)
    base = cwd if cwd is not None else os.getcwd()
    full = os.path.normpath(os.path.join(base, typed))
    entries = mounts.mount_entries()
    entry = _innermost(entries, full)
    if entry is None or entry.fstype != mounts.FSTYPE:
        resolved = os.path.realpath(full)
        if resolved != full and (inner := _innermost(entries, resolved)) is not None and inner.fstype == mounts.FSTYPE:
            full, entry = resolved, inner
    if entry is None or entry.fstype != mounts.FSTYPE:
        if not os.path.lexists(full):
            raise UsageError(f"{typed}: no such file or directory")
        if entry is not None and entry.mountpoint == full:
            raise UsageError(f"{typed} is not a cachefs mount (it is {entry.fstype})")
        raise UsageError(f"{typed} is not inside a cachefs mount")
    root = entry.mountpoint
    return root, "" if full == root else full[len(root.rstrip("/")) + 1:]


def mount_holding(path: str | os.PathLike[str]) -> Path:
    """The mountpoint of the cachefs mount holding ``path`` (``enclosing_mount``), for commands that
    act on a whole mount (``stats``, ``flush``); a path inside it that does not exist is refused as
    missing, not taken to mean the mount."""
    root, inside = enclosing_mount(path)
    if inside:
        try:
            os.lstat(os.path.join(root, inside))
        except FileNotFoundError:
            raise UsageError(f"{os.fspath(path)}: no such file or directory in the mount {root}") from None
        except OSError:
            pass  # a daemon that does not answer: the control request says so
    return Path(root)


def _innermost(entries: list[mounts.MountEntry], full: str) -> mounts.MountEntry | None:
    """The mount entry whose mountpoint is the longest prefix of ``full`` (the last one, if stacked)."""
    best = None
    for entry in entries:
        point = entry.mountpoint
        if full == point or full.startswith(point.rstrip("/") + "/"):
            if best is None or len(point) >= len(best.mountpoint):
                best = entry
    return best


def call(mountpoint: Path, route: str, *, method: str = "GET", body: Any = None,
         timeout_s: float = CONTROL_TIMEOUT_S) -> Any:
    """One control request to the daemon of ``mountpoint``."""
    try:
        return request_json(control_socket(mountpoint), route, method=method, body=body, timeout_s=timeout_s)
    except ControlError as exc:
        raise UsageError(str(exc)) from None
