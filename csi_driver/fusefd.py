"""The privileged half of the FUSE fd handover: mount ``/dev/fuse`` at a target, hand the fd over.

``mount_fuse`` opens ``/dev/fuse`` and calls ``mount(2)`` (through libc, with ctypes) the way the daemon
does for ``cachefs mount`` (``cachefs.fuse.session``): type ``fuse.cachefs``, source the bucket URL, data
``fd=N,rootmode=40000,user_id=0,group_id=0,default_permissions,allow_other``, flags ``nosuid,nodev``
(and ``ro`` for a read-only mount), so the mount table cannot tell a handed-over mount from one the
daemon made itself. The kernel then waits for a daemon to read from that fd (every access to the
mount blocks until one answers the INIT request).

``HandoverSocket`` listens on a unix socket (mode 0600, owned by the daemon's user) in a private
directory, accepts the daemon's one connection and sends the fd with SCM_RIGHTS
(``cachefs.handover``); ``read_report`` then reads the daemon's start-up report on that connection.
Every wait is bounded by a deadline and gives up early when the daemon is seen to have exited.

The caller closes its own copy of the fd once it has been sent: the daemon must be its only holder,
so that the daemon's death ends the FUSE connection (every access then fails with ENOTCONN, which
``mounter.probe_broken`` detects) instead of leaving the mount hanging on a descriptor nobody reads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import select
import socket
import stat
import struct
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

from cachefs.handover import HandoverError, check_socket_path, send_fd
from cachefs.mounts import FSTYPE, mount_source

log = logging.getLogger(__name__)

FUSE_DEVICE = "/dev/fuse"
# mount(2) flags (linux/mount.h) and umount2(2) flags: part of the kernel ABI, not syscall numbers.
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_PRIVATE = 1 << 18
MNT_DETACH = 0x2
# How often a wait looks at whether the daemon is still alive.
ALIVE_POLL_S = 1.0
# The longest report line read (a one-line reason).
MAX_REPORT_BYTES = 64 * 1024

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)


def mount_options(fd: int, rootmode: int, *, user_id: int = 0, group_id: int = 0, allow_other: bool = True,
                  default_permissions: bool = True) -> str:
    """The FUSE mount data string for a mount of ``/dev/fuse`` descriptor ``fd``."""
    options = [f"fd={fd}", f"rootmode={rootmode:o}", f"user_id={user_id}", f"group_id={group_id}"]
    if default_permissions:
        options.append("default_permissions")
    if allow_other:
        options.append("allow_other")
    return ",".join(options)


def mount_flags(read_only: bool) -> int:
    return MS_NOSUID | MS_NODEV | (MS_RDONLY if read_only else 0)


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def mount_fuse(target: Path, *, read_only: bool, allow_other: bool = True, default_permissions: bool = True,
               source: str = "") -> int:
    """Open ``/dev/fuse`` and mount it at ``target``; the open fd (close-on-exec). ``OSError`` if refused.

    ``source`` is the bucket URL the mount table shows (``cachefs.mounts.mount_source``), as for a
    mount the daemon makes itself."""
    fd = os.open(FUSE_DEVICE, os.O_RDWR | os.O_CLOEXEC)
    try:
        st = os.stat(target)
        if not stat.S_ISDIR(st.st_mode):
            raise OSError(errno.ENOTDIR, f"{target} is not a directory")
        data = mount_options(fd, stat.S_IFMT(st.st_mode), user_id=os.getuid(), group_id=os.getgid(),
                             allow_other=allow_other, default_permissions=default_permissions)
        _check(_libc.mount(mount_source(source).encode(), os.fsencode(target), FSTYPE.encode(), mount_flags(read_only),
                           data.encode()), f"mount {FSTYPE} on {target}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def bind(source: Path, target: Path, *, read_only: bool) -> None:
    """Bind the mount at ``source`` on ``target``, on top of whatever is mounted there (a dead FUSE
    mount too: the syscall resolves the path without asking the filesystem, where ``mount --bind``
    would stat it and get ENOTCONN). ``OSError`` if the kernel refuses.

    The bind reaches ``target`` in a peer group of its own. A plain bind of a shared mount joins the
    source's peer group: every pod's target would be a peer of the staged mount and of each other
    (under the kubelet's rshared root they are), and a bind later stacked on one target would appear
    on all of them, read-write on a read-only pod's too (issue 36). So the source is bound first in a
    private scratch directory, that bind made private (out of the source's group) and, for a
    read-only bind, read-only (keeping the FUSE mount's nosuid and nodev: a remount does not
    propagate, so it must happen before the bind reaches ``target``), and then that mount is bound on
    ``target``: it keeps its flags, and under a shared parent gets a new peer group, which the host
    and the containers holding ``target`` (rslave) follow."""
    scratch = tempfile.mkdtemp(prefix="cachefs-csi-bind-")
    layers = 0
    try:
        # The scratch directory, a private mount of its own: nothing made under it propagates anywhere.
        _check(_libc.mount(scratch.encode(), scratch.encode(), None, MS_BIND, None), f"bind {scratch} on itself")
        layers += 1
        _check(_libc.mount(None, scratch.encode(), None, MS_PRIVATE, None), f"make {scratch} private")
        _check(_libc.mount(os.fsencode(source), scratch.encode(), None, MS_BIND, None), f"bind {source} on {scratch}")
        layers += 1
        _check(_libc.mount(None, scratch.encode(), None, MS_PRIVATE, None), f"make the bind of {source} private")
        if read_only:
            _check(_libc.mount(None, scratch.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV,
                               None), f"make the bind of {source} read-only")
        _check(_libc.mount(scratch.encode(), os.fsencode(target), None, MS_BIND, None), f"bind {source} on {target}")
    finally:
        for _ in range(layers):
            _libc.umount2(scratch.encode(), MNT_DETACH)
        os.rmdir(scratch)


def unmount(target: Path, *, lazy: bool = False) -> None:
    """Unmount ``target`` (``lazy``: detach now, even busy or dead). ``OSError`` if the kernel refuses."""
    _check(_libc.umount2(os.fsencode(target), MNT_DETACH if lazy else 0), f"unmount {target}")


class HandoverTimeout(HandoverError):
    """The daemon did not connect, or did not report, before the deadline."""


def _peer(conn: socket.socket) -> str:
    try:
        pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                            struct.calcsize("3i")))
    except OSError:
        return "an unknown peer"
    return f"pid {pid} (uid {uid}, gid {gid})"


class HandoverSocket:
    """A listening unix socket for one handover; ``close`` (or leaving the ``with``) removes it."""

    def __init__(self, path: Path, *, uid: int | None = None, gid: int | None = None) -> None:
        check_socket_path(path)
        self.path = path
        path.unlink(missing_ok=True)  # left by a handover that never completed
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self.sock.bind(str(path))
            os.chmod(path, 0o600)
            if uid is not None or gid is not None:
                os.chown(path, -1 if uid is None else uid, -1 if gid is None else gid)
            self.sock.listen(1)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> HandoverSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass

    def hand_over(self, fd: int, deadline: float, alive: Callable[[], bool],
                  clones: Sequence[int] = ()) -> socket.socket:
        """Accept the daemon's connection and send it ``fd`` and ``clones`` of its connection; the
        connection, for ``read_report``.

        ``HandoverError`` when no daemon connects before ``deadline`` (``time.monotonic``) or
        ``alive()`` says the daemon is gone."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise HandoverTimeout(f"the daemon did not connect to {self.path} in time")
            readable, _, _ = select.select([self.sock], [], [], min(ALIVE_POLL_S, remaining))
            if readable:
                break
            if not alive():
                raise HandoverError("the daemon exited before taking the mount")
        conn, _ = self.sock.accept()
        conn.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            send_fd(conn, fd, clones)
        except OSError as exc:
            conn.close()
            raise HandoverError(f"cannot send the FUSE descriptor: {exc.strerror or exc}") from None
        log.debug("handed the FUSE descriptor of %s over to %s", self.path, _peer(conn))
        return conn


def read_report(conn: socket.socket, deadline: float, alive: Callable[[], bool]) -> tuple[list[str], str | None, bool]:
    """The daemon's start-up report: ``(warnings, error, invalid)``; ``error`` is None once it serves.

    ``invalid`` is True when the daemon refused its arguments (``BAD`` rather than ``ERR``)."""
    warnings: list[str] = []
    buffer = b""
    while True:
        while b"\n" in buffer:
            raw, buffer = buffer.split(b"\n", 1)
            line = raw.decode(errors="replace").strip()
            if line.startswith("WARN "):
                warnings.append(line[5:])
            elif line == "OK":
                return warnings, None, False
            elif line.startswith(("ERR ", "BAD ")):
                return warnings, line[4:] or "unknown error", line.startswith("BAD ")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise HandoverTimeout("the daemon did not report that it serves the mount in time")
        readable, _, _ = select.select([conn], [], [], min(ALIVE_POLL_S, remaining))
        if not readable:
            if not alive():
                raise HandoverError("the daemon exited during start-up")
            continue
        try:
            chunk = conn.recv(4096)
        except OSError as exc:
            raise HandoverError(f"lost the daemon's report: {exc.strerror or exc}") from None
        if not chunk:
            raise HandoverError("the daemon exited during start-up")
        buffer += chunk
        if len(buffer) > MAX_REPORT_BYTES:
            raise HandoverError("the daemon's report is too long")
