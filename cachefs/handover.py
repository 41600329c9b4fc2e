"""The FUSE fd handover's wire protocol, shared by the node plugin and ``cachefs mount --fuse-fd-socket``.

A privileged process (the CSI node plugin) opens ``/dev/fuse``, mounts it with ``fd=N`` and listens
on a unix socket. The daemon connects and receives, in one message, the line ``FUSE`` with the
descriptor attached (SCM_RIGHTS). On the same connection the daemon then reports its start-up the
way a background ``cachefs mount`` reports to its parent: ``WARN <line>`` for each warning, then
``OK`` once it serves the mount, or ``ERR <line>`` with the reason it cannot. The daemon's FUSE
session (``cachefs.fuse.session``) serves the descriptor as it is, already mounted: it neither mounts
nor, at the end, unmounts, so it needs no privilege of its own.
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

FD_MESSAGE = b"FUSE\n"
# /dev/fuse is the misc character device 10:229 on Linux.
FUSE_DEVICE = (10, 229)
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


def send_fd(conn: socket.socket, fd: int) -> None:
    """Send ``fd`` (a mounted ``/dev/fuse``) over the connected ``conn``."""
    socket.send_fds(conn, [FD_MESSAGE], [fd])


def receive_fd(path: Path, timeout_s: float) -> tuple[int, socket.socket]:
    """Connect to the handover socket at ``path`` and receive the FUSE descriptor.

    Returns the descriptor and the connection (for the start-up report); ``HandoverError`` with one
    line if nothing usable arrives within ``timeout_s``."""
    check_socket_path(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(str(path))
        message, fds, _flags, _addr = socket.recv_fds(sock, len(FD_MESSAGE), 1)
    except TimeoutError:
        sock.close()
        raise HandoverError(f"no FUSE descriptor arrived on {path} within {timeout_s:g} s") from None
    except OSError as exc:
        sock.close()
        raise HandoverError(f"cannot receive the FUSE descriptor from {path}: {exc.strerror or exc}") from None
    if message != FD_MESSAGE or len(fds) != 1 or not is_fuse_device(fds[0]):
        for fd in fds:
            os.close(fd)
        sock.close()
        raise HandoverError(f"{path} did not hand over a /dev/fuse descriptor")
    sock.settimeout(None)
    return fds[0], sock
