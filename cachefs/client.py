"""What every CLI command that talks to a running mount shares: find its daemon, call its API.

A command names a mountpoint; the mount table says whether it is a cachefs mount, and the daemon
publishes its control socket as the ``user.cachefs.control`` extended attribute of the mount root.
Every failure is a ``UsageError`` with a one-line message.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

from cachefs import mounts
from cachefs.control import CONTROL_TIMEOUT_S, ControlError, request_json
from cachefs.fs import CONTROL_XATTR


class UsageError(Exception):
    """Bad input from the user, or nothing to talk to: one line, non-zero exit."""


def control_socket(mountpoint: Path) -> str:
    """The control socket of the cachefs mounted at ``mountpoint``; UsageError if there is none."""
    path = Path(os.path.abspath(mountpoint))
    entry = mounts.find_mount(path)
    if entry is None:
        raise UsageError(f"{path} is not a mountpoint")
    if entry.fstype != mounts.FSTYPE:
        raise UsageError(f"{path} is not a cachefs mount (it is {entry.fstype})")
    try:
        return os.getxattr(path, CONTROL_XATTR).decode()
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
