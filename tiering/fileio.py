"""Small POSIX file helpers shared by the tiers that make files durable on local disk."""

from __future__ import annotations

import ctypes
import os
from typing import Any, Callable


def libc_function(name: str, argtypes: list[Any], restype: Any) -> Callable[..., int] | None:
    """The C library's function ``name`` (errno kept for ``ctypes.get_errno``), typed; None where the
    platform has none. For the system calls Python's ``os`` lacks (``sync_file_range``, ``fallocate``
    with a mode)."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)  # the process's own symbols, libc among them
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory, so that the entries created, renamed or removed in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
