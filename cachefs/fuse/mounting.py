"""Mounting a FUSE file system: /dev/fuse, mount(2) as root, the setuid fusermount3 otherwise, unmounting.

The half of ``cachefs.fuse.session`` that runs before the first request and after the last: open the
device (or clone a descriptor of a connection), mount it with ``mount(2)`` where the process may,
have ``fusermount3`` do it (and send the descriptor back over a socket) where it may not, turn what
either reports into one line with what to do about it, and detach the mount at the end.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import logging
import os
import socket
import stat
import struct
import subprocess
import sys

from cachefs.fuse import wire
from cachefs.mounts import FSTYPE

log = logging.getLogger("cachefs.fuse.session")

FUSE_DEVICE = "/dev/fuse"
SUBTYPE = FSTYPE.removeprefix("fuse.")
FUSERMOUNT = "fusermount3"
# How long fusermount3 may take to mount or unmount (it checks the mountpoint and calls mount(2)).
FUSERMOUNT_TIMEOUT_S = 30
# The longest part of fusermount3's stderr that becomes the reason (its messages are one line).
MAX_REASON_CHARS = 300


# --------------------------------------------------------------------------------------- mounting
# What a user can do about the failures the kernel and fusermount3 report, by words of their message.
FUSE_FAILURE_HINTS = (
    ("/dev/fuse: Permission denied", "the mounting user needs read and write access to /dev/fuse "
                                     "(through a group that owns it), or mount as root"),
    ("user_allow_other", "drop --allow-other, or have root add user_allow_other to /etc/fuse.conf"),
    ("device not found", "load the fuse kernel module (modprobe fuse), or give the container /dev/fuse"),
)


def fuse_failure_reason(text: str) -> str | None:
    """The last line fusermount3 (or this module) wrote, with what to do about it; None if empty."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return None
    reason = lines[-1].removeprefix("fuse: ")[:MAX_REASON_CHARS]
    hint = next((hint for words, hint in FUSE_FAILURE_HINTS if words in reason), None)
    return f"{reason}; {hint}" if hint else reason


def _escape_option(value: str) -> str:
    # fusermount3 splits -o at commas and takes a backslash as an escape.
    return value.replace("\\", "\\\\").replace(",", "\\,")


_MS_RDONLY, _MS_NOSUID, _MS_NODEV = 0x1, 0x2, 0x4
_MNT_DETACH = 0x2
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)


class MountError(OSError):
    """The mount was refused; ``reason`` is the one line the user sees."""


def open_device() -> int:
    try:
        return os.open(FUSE_DEVICE, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENODEV):
            raise MountError(exc.errno, "device not found, try 'modprobe fuse' first") from None
        raise MountError(exc.errno, f"failed to open {FUSE_DEVICE}: {os.strerror(exc.errno or errno.EIO)}") from None


def clone_device(session_fd: int) -> int:
    """A new /dev/fuse descriptor bound to the connection of ``session_fd`` (FUSE_DEV_IOC_CLONE): it
    reads from the connection's one queue of requests, and a request read from it is answered on it."""
    fd = open_device()
    try:
        fcntl.ioctl(fd, wire.DEV_IOC_CLONE, struct.pack("<I", session_fd))
    except OSError:
        os.close(fd)
        raise
    return fd


def kernel_options(fd: int, rootmode: int, *, allow_other: bool) -> str:
    options = [f"fd={fd}", f"rootmode={rootmode:o}", f"user_id={os.getuid()}", f"group_id={os.getgid()}",
               "default_permissions"]
    if allow_other:
        options.append("allow_other")
    return ",".join(options)


def mount_syscall(fd: int, mountpoint: str, fsname: str, *, read_only: bool, allow_other: bool) -> None:
    """mount(2) the open /dev/fuse ``fd`` at ``mountpoint``; ``OSError`` with the kernel's errno."""
    rootmode = stat.S_IFMT(os.stat(mountpoint).st_mode)
    flags = _MS_NOSUID | _MS_NODEV | (_MS_RDONLY if read_only else 0)
    data = kernel_options(fd, rootmode, allow_other=allow_other)
    if _libc.mount(fsname.encode(), os.fsencode(mountpoint), FSTYPE.encode(), flags, data.encode()) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def fusermount(mountpoint: str, fsname: str, *, read_only: bool, allow_other: bool) -> int:
    """Have the setuid fusermount3 mount ``mountpoint``; the /dev/fuse descriptor it sends back."""
    options = ["default_permissions", f"fsname={_escape_option(fsname)}", f"subtype={SUBTYPE}"]
    if read_only:
        options.append("ro")
    if allow_other:
        options.append("allow_other")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        env = dict(os.environ, _FUSE_COMMFD=str(theirs.fileno()))
        try:
            result = subprocess.run([FUSERMOUNT, "-o", ",".join(options), "--", mountpoint], env=env,
                                    pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=FUSERMOUNT_TIMEOUT_S)
        except FileNotFoundError:
            raise MountError(errno.ENOENT, f"{FUSERMOUNT} is not installed (the fuse3 package has it)") from None
        except subprocess.TimeoutExpired:
            raise MountError(errno.ETIMEDOUT, f"{FUSERMOUNT} did not finish in {FUSERMOUNT_TIMEOUT_S} s") from None
        text = result.stderr.decode(errors="replace")
        if text:
            sys.stderr.write(text)  # the daemon's log keeps fusermount3's own words
            sys.stderr.flush()
        theirs.close()
        if result.returncode != 0:
            raise MountError(errno.EPERM, fuse_failure_reason(text) or f"{FUSERMOUNT} failed")
        ours.settimeout(FUSERMOUNT_TIMEOUT_S)
        try:
            _, fds, _, _ = socket.recv_fds(ours, 1, 1)
        except OSError as exc:
            raise MountError(errno.EIO, f"no descriptor from {FUSERMOUNT}: {exc.strerror or exc}") from None
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise MountError(errno.EIO, f"no descriptor from {FUSERMOUNT}")
    os.set_inheritable(fds[0], False)
    return fds[0]


def unmount(mountpoint: str, *, privileged: bool) -> None:
    """Detach the mount (lazily, as libfuse did at the end of a session); failures are logged."""
    if privileged:
        if _libc.umount2(os.fsencode(mountpoint), _MNT_DETACH) != 0:
            code = ctypes.get_errno()
            if code not in (errno.EINVAL, errno.ENOENT):  # not mounted (any more)
                log.warning("cannot unmount %s: %s", mountpoint, os.strerror(code))
        return
    try:
        result = subprocess.run([FUSERMOUNT, "-u", "-q", "-z", "--", mountpoint], stdin=subprocess.DEVNULL,
                                capture_output=True, timeout=FUSERMOUNT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("cannot unmount %s: %s", mountpoint, exc)
        return
    if result.returncode != 0:
        log.warning("cannot unmount %s: %s", mountpoint, result.stderr.decode(errors="replace").strip())
