"""The FUSE fd handover's wire protocol, shared by the node plugin and ``cachefs mount --fuse-fd-socket``.

A privileged process (the CSI node plugin) opens ``/dev/fuse``, mounts it with ``fd=N`` and listens
on a unix socket. The daemon connects and receives, in one message, the line ``FUSE`` with the
descriptor attached (SCM_RIGHTS). On the same connection the daemon then reports its start-up the
way a background ``cachefs mount`` reports to its parent: ``WARN <line>`` for each warning, then
``OK`` once it serves the mount, or ``ERR <line>`` with the reason it cannot. The daemon's FUSE
session (``cachefs.fuse.session``) serves the descriptor as it is, already mounted: it neither mounts
nor, at the end, unmounts, so it needs no privilege of its own.

**Clones for several readers** (``cachefs mount --fuse-threads N``): the same message may carry up to
``N - 1`` more descriptors after the mounted one, each a clone of its connection
(``FUSE_DEV_IOC_CLONE``, ``clone_fuse``) that the privileged process opened: an unprivileged daemon in a
mount pod has no ``/dev/fuse`` to open clones itself. A daemon of an older cachefs receives only the
first (the kernel drops the descriptors that do not fit) and serves as before; an older plugin sends
none, and the daemon then clones where it can.
"""

from __future__ import annotations

import fcntl
import os
import socket
import stat
import struct
from collections.abc import Sequence
from pathlib import Path

FD_MESSAGE = b"FUSE\n"
# /dev/fuse is the misc character device 10:229 on Linux.
FUSE_DEVICE = (10, 229)
# FUSE_DEV_IOC_CLONE, _IOR(229, 0, uint32_t): cachefs.fuse.wire's, which a leaf module may not import
# (tests/unit/test_fuse_threads.py checks that the two agree).
DEV_IOC_CLONE = 2 << 30 | 4 << 16 | 229 << 8 | 0
# Longest path a unix socket address holds (sun_path is 108 bytes, NUL included).
MAX_SOCKET_PATH = 107


class HandoverError(Exception):
    """The handover failed: one line saying why."""


def check_socket_path(path: Path) -> None:
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise HandoverError(f"socket path {path} is longer than {MAX_SOCKET_PATH} bytes")


def is_fuse_device(fd: int) -> bool:
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == FUSE_DEVICE


def clone_fuse(fd: int, count: int) -> list[int]:
    """Up to ``count`` new ``/dev/fuse`` descriptors of the connection of ``fd`` (FUSE_DEV_IOC_CLONE on a
    fresh open of the device); fewer, down to none, where the device cannot be opened or cloned."""
    clones: list[int] = []
    for _ in range(count):
        try:
            clone = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            break
        try:
            fcntl.ioctl(clone, DEV_IOC_CLONE, struct.pack("<I", fd))
        except OSError:
            os.close(clone)
            break
        clones.append(clone)
    return clones


def send_fd(conn: socket.socket, fd: int, clones: Sequence[int] = ()) -> None:
    """Send ``fd`` (a mounted ``/dev/fuse``), and ``clones`` of its connection, over the connected ``conn``."""
    socket.send_fds(conn, [FD_MESSAGE], [fd, *clones])


def receive_fd(path: Path, timeout_s: float, max_clones: int = 0) -> tuple[int, list[int], socket.socket]:
    """Connect to the handover socket at ``path`` and receive the FUSE descriptor and its clones.

    Returns the descriptor, the clones (at most ``max_clones``, maybe none: the kernel drops those
    past it) and the connection (for the start-up report); ``HandoverError`` with one line if
    nothing usable arrives within ``timeout_s``."""
    check_socket_path(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(str(path))
        message, fds, _flags, _addr = socket.recv_fds(sock, len(FD_MESSAGE), 1 + max(0, max_clones))
    except TimeoutError:
        sock.close()
        raise HandoverError(f"no FUSE descriptor arrived on {path} within {timeout_s:g} s") from None
    except OSError as exc:
        sock.close()
        raise HandoverError(f"cannot receive the FUSE descriptor from {path}: {exc.strerror or exc}") from None
    if message != FD_MESSAGE or not fds or not all(is_fuse_device(fd) for fd in fds):
        for fd in fds:
            os.close(fd)
        sock.close()
        raise HandoverError(f"{path} did not hand over a /dev/fuse descriptor")
    sock.settimeout(None)
    return fds[0], fds[1:], sock
