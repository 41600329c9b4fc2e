"""Who registers passthrough backing files on a connection: this process (``BackingFiles``, where it
holds CAP_SYS_ADMIN in the initial user namespace: ``may_register_backing``), or the CSI node plugin's
broker (``cachefs.backing.BrokerBackingFiles``); both are a ``Backing``. The session
(``cachefs.fuse.session``) chooses at INIT; the adapter decides which opens use it.
"""

from __future__ import annotations

import os
from typing import Protocol

from cachefs.backing import register, unregister


# The user namespace every process starts in has this fixed inode number (PROC_USER_INIT_INO): the
# kernel checks CAP_SYS_ADMIN there, not in a container's own namespace, before it registers a
# backing file.
_INITIAL_USER_NS_INO = 0xEFFFFFFD
_CAP_SYS_ADMIN = 21


def may_register_backing(status: str = "/proc/self/status", userns: str = "/proc/self/ns/user") -> bool:
    """Whether this process holds CAP_SYS_ADMIN in the initial user namespace (what
    FUSE_DEV_IOC_BACKING_OPEN requires). False where it cannot tell."""
    try:
        if os.stat(userns).st_ino != _INITIAL_USER_NS_INO:
            return False
        with open(status, encoding="ascii") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_ADMIN & 1)
    except (OSError, ValueError, IndexError):
        return False
    return False


class Backing(Protocol):
    """Registers backing files on this connection: ``BackingFiles`` itself, or ``BrokerBackingFiles``
    through the CSI node plugin (``cachefs.backing``)."""

    def open(self, path: str) -> int:
        """The backing id of the plain file at ``path``; ``OSError`` if refused."""
        ...

    def close(self, backing_id: int) -> None: ...


class BackingFiles:
    """Backing files registered on one FUSE connection (passthrough): ``open`` a plain file and get
    the id an OPEN answer names, ``close`` the id when no open file needs it any more (the kernel
    keeps the file itself for as long as an open file uses it). Blocking, but each is one open or
    one ioctl on a local file: microseconds, on the loop."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def open(self, path: str) -> int:
        """Register ``path`` (opened read-only: the kernel reopens it with the reader's flags and
        this process's credentials); ``OSError`` with the kernel's errno if refused."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            return register(self.fd, fd)
        finally:
            os.close(fd)

    def close(self, backing_id: int) -> None:
        unregister(self.fd, backing_id)
