"""Paths inside a mount, as requests to the daemon carry them: relative to the mount root.

Requests carry paths relative to the mount root (``""`` is the root). The CLI turns what a user
typed into that form with ``mount_relative``: a path means what it means in a shell (relative paths
are taken relative to the working directory, which the caller passes in), it must lie inside the
mount, and ``..`` that climbs out of the mount is refused, never clamped. Manifest lines are relative
to the mount root: the CLI passes the mountpoint itself as their ``cwd``.
The daemon re-checks the result with ``check_path`` (API clients are not the CLI). Both sides share
this module, so the syntax is defined once; it imports nothing but the naming rules.
"""

from __future__ import annotations

import os

from cachefs.names import name_problem


class PathError(ValueError):
    """A path that is malformed, outside the mount, or not there. One-line message."""


def mount_relative(path: str, mountpoint: str, cwd: str) -> str:
    """``path`` (relative to ``cwd``, or absolute) as a path relative to the mount root.

    Purely lexical (nothing is stat'ed): ``..`` is resolved against the path itself, and a result
    outside the mount is refused with ``PathError`` naming the path as typed.
    """
    if path == "" or "\x00" in path:
        raise PathError(f"invalid path {path!r}")
    root = os.path.normpath(os.path.join(cwd, mountpoint))
    full = os.path.normpath(os.path.join(cwd, path))
    if full == root:
        return ""
    if not full.startswith(root.rstrip("/") + "/"):
        raise PathError(f"{path} is outside the mount {root}")
    return full[len(root.rstrip("/")) + 1 :]


def check_path(path: str) -> str:
    """Validate a mount-relative path from a request; returns it without a trailing ``/``."""
    if not isinstance(path, str):
        raise PathError(f"path must be a string, got {type(path).__name__}")
    if path.startswith("/"):
        raise PathError(f"path {path!r} must be relative to the mount root")
    body = path[:-1] if path.endswith("/") else path
    if not body:
        return ""
    for part in body.split("/"):
        if part in ("", ".", ".."):
            raise PathError(f"path {path!r} has an empty, '.' or '..' component")
        problem = name_problem(part)
        if problem is not None:
            raise PathError(f"path {path!r} is not a valid name in the mount ({problem.reason})")
    return body


def join(parent: str, name: str) -> str:
    """The mount-relative path of ``name`` in directory ``parent`` (``""`` is the root)."""
    return f"{parent}/{name}" if parent else name
