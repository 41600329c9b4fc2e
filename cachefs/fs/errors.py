"""Filesystem errors. Like the engine's errors they carry an errno, mapped once at the FUSE edge."""

from __future__ import annotations

import errno as errno_mod


class FsError(Exception):
    """A POSIX-level failure: ``FsError(errno.ENOENT, "no such entry 'x'")``."""

    def __init__(self, errno: int, message: str = "") -> None:
        super().__init__(message or errno_mod.errorcode.get(errno, str(errno)))
        self.errno = errno
