"""Backing files for FUSE passthrough: the two ioctls that register them, and the broker's protocol.

**The ioctls** (``register``, ``unregister``) act on a ``/dev/fuse`` descriptor: ``FUSE_DEV_IOC_BACKING_OPEN``
takes an open file and answers the id an OPEN reply names with FOPEN_PASSTHROUGH;
``FUSE_DEV_IOC_BACKING_CLOSE`` drops an id. Both need CAP_SYS_ADMIN in the initial user namespace
(fs/fuse/passthrough.c: ``capable(CAP_SYS_ADMIN)`` in each, "until backing files are visible to lsof"),
and the kernel records the caller's credentials with the file: it reopens the backing file with them
for every passed-through open.

**The broker** is for a daemon without that capability (the CSI node plugin's mounts: uid 65534, no
capabilities): the node plugin, which has it, listens on ``<run_dir>/backing.sock`` (``BROKER_SOCKET``;
``csi_driver.backing``) and does the ioctl for it. The node plugin keeps no copy of the mount's
``/dev/fuse`` descriptor (the daemon must be its only holder, so that its death ends the connection),
so each request carries the daemon's own descriptor: one message on a ``SOCK_SEQPACKET`` connection,
``REQUEST`` (an operation and a backing id) with the descriptors attached (SCM_RIGHTS):

- ``PING`` + [fuse fd]: is the broker there and willing (the daemon asks once, at INIT);
- ``OPEN`` + [fuse fd, backing file fd]: register; the answer is the id;
- ``CLOS`` + [fuse fd], id: drop an id this mount's broker registered.

The answer is one ``ANSWER``: the id or 0, or a negative errno. ``BrokerBackingFiles`` is the daemon's
side: a blocking round trip of a few syscalls each way (tens of microseconds), bounded by
``BROKER_TIMEOUT_S``; a broker that does not answer in time, cannot be reached, or refuses a file turns
passthrough off for the session (``BrokerError``), and the daemon serves every read as before.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import struct
from pathlib import Path
from typing import NoReturn

# ioctls on /dev/fuse (``_IOW(229, nr, type)``: direction write 1 << 30, the argument's size << 16,
# the magic << 8, the number), for passthrough: register an open file as a backing file (returns its
# id) and drop a registration. The kernel keeps the file itself while an open file uses it.
_IOC_WRITE = 1 << 30
DEV_IOC_MAGIC = 229
BACKING_MAP = struct.Struct("<iIQ")            # fuse_backing_map: fd flags padding
DEV_IOC_BACKING_OPEN = _IOC_WRITE | BACKING_MAP.size << 16 | DEV_IOC_MAGIC << 8 | 1
DEV_IOC_BACKING_CLOSE = _IOC_WRITE | 4 << 16 | DEV_IOC_MAGIC << 8 | 2


def backing_map(fd: int) -> bytearray:
    """The argument of DEV_IOC_BACKING_OPEN for the open file ``fd`` (flags and padding must be 0).

    A bytearray: ``fcntl.ioctl`` then returns the call's result, which is the backing id."""
    return bytearray(BACKING_MAP.pack(fd, 0, 0))


def register(fuse_fd: int, file_fd: int) -> int:
    """Register the open file ``file_fd`` on the connection of ``fuse_fd``; its backing id, or
    ``OSError`` with the kernel's errno."""
    return fcntl.ioctl(fuse_fd, DEV_IOC_BACKING_OPEN, backing_map(file_fd))


def unregister(fuse_fd: int, backing_id: int) -> None:
    fcntl.ioctl(fuse_fd, DEV_IOC_BACKING_CLOSE, bytearray(struct.pack("<I", backing_id)))


# ------------------------------------------------------------------------------------- the broker
BROKER_SOCKET = "backing.sock"
REQUEST = struct.Struct("<4sI")  # operation, backing id (CLOS only)
ANSWER = struct.Struct("<i")     # the id or 0; a negative errno
OP_PING, OP_OPEN, OP_CLOSE = b"PING", b"OPEN", b"CLOS"
# The descriptors each operation carries (the fuse fd first).
OP_FDS = {OP_PING: 1, OP_OPEN: 2, OP_CLOSE: 1}
# How long the daemon waits for one answer. The broker answers after an fstat, a readlink, an lstat
# and an ioctl (tens of microseconds); the wait runs on the daemon's event loop, so it is kept to
# what a busy node plugin (a 2-core node at full load) answers in by a wide margin, and a plugin that
# misses it is taken to be stuck: passthrough ends for the session rather than stall every open.
BROKER_TIMEOUT_S = 2.0
# Live backing ids the broker keeps per mount (beyond it an OPEN is answered ENFILE and that open is
# served by the daemon). The daemon holds one per inode read through passthrough, shared by that
# inode's opens and kept between them (``cachefs.fuse.adapter.IDLE_IDS``, half of this); a training
# job with 64 loader workers has a few hundred files open at once. It bounds the plugin's bookkeeping
# and the kernel's memory per mount (an open file each, roughly 1-2 KiB: some 32 MiB at most).
BROKER_MAX_IDS = 16384


class BrokerError(OSError):
    """The broker cannot be used any more (unreachable, stuck, or it refused a file): passthrough is
    off for this session. ``strerror`` is the one line that says why."""


class BrokerBackingFiles:
    """``BackingFiles`` through the node plugin's broker at ``path`` (see the module docstring), for
    the connection of ``fuse_fd``. Blocking, each call bounded by ``timeout_s``."""

    def __init__(self, path: Path, fuse_fd: int, timeout_s: float = BROKER_TIMEOUT_S) -> None:
        self.path = path
        self.fuse_fd = fuse_fd
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._broken: str | None = None

    def probe(self) -> None:
        """``BrokerError`` unless the broker answers and accepts this connection's descriptor."""
        self._call(OP_PING, 0, [self.fuse_fd])

    def open(self, path: str) -> int:
        """Have the broker register ``path`` (opened here read-only: it checks the descriptor, not
        the name); ``OSError`` for this file, ``BrokerError`` for every file from now on."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            return self._call(OP_OPEN, 0, [self.fuse_fd, fd])
        finally:
            os.close(fd)

    def close(self, backing_id: int) -> None:
        self._call(OP_CLOSE, backing_id, [self.fuse_fd])

    def shutdown(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(str(self.path))
        except BaseException:
            sock.close()
            raise
        return sock

    def _call(self, op: bytes, arg: int, fds: list[int]) -> int:
        if self._broken is not None:
            raise BrokerError(errno.EPIPE, self._broken)
        # One retry on a new connection: a node plugin that restarted listens again on the same path.
        for attempt in range(2):
            try:
                if self._sock is None:
                    self._sock = self._connect()
                socket.send_fds(self._sock, [REQUEST.pack(op, arg)], fds)
                answer = self._sock.recv(ANSWER.size)
            except TimeoutError:
                self._fail(f"the node plugin's broker {self.path} did not answer within {self.timeout_s:g} s")
            except OSError as exc:
                self.shutdown()
                if attempt == 0 and exc.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
                    continue
                self._fail(f"cannot reach the node plugin's broker {self.path}: {exc.strerror or exc}")
            if not answer:  # the plugin closed the connection (it restarted, or refused this peer)
                self.shutdown()
                if attempt == 0:
                    continue
                self._fail(f"the node plugin's broker {self.path} closed the connection")
            if len(answer) != ANSWER.size:
                self._fail(f"the node plugin's broker {self.path} answered {len(answer)} bytes")
            (result,) = ANSWER.unpack(answer)
            if result >= 0:
                return result
            code = -result
            if code in (errno.ENFILE, errno.ENOENT, errno.ELOOP, errno.EOPNOTSUPP):
                # This file or id only (the bound on live ids; an id gone), or what the kernel said.
                raise OSError(code, os.strerror(code))
            self._fail(f"the node plugin's broker {self.path} refused: {os.strerror(code)}", code)
        raise AssertionError("unreachable")  # pragma: no cover - every pass returns or raises

    def _fail(self, reason: str, code: int = errno.EPIPE) -> NoReturn:
        self.shutdown()
        self._broken = reason
        raise BrokerError(code, reason)
