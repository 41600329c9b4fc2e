"""The backing-file broker: the node plugin registers passthrough backing files for a mount's daemon.

FUSE passthrough (``cachefs.backing``) needs CAP_SYS_ADMIN for both of its ioctls, which a daemon of
this plugin (uid 65534, no capabilities, in a mount pod or as a host process) lacks; the plugin has
it. ``BackingBroker`` is one read-only mount's broker: a ``SOCK_SEQPACKET`` socket at
``<run_dir>/backing.sock`` (owned by the daemon's uid, mode 0600, in the daemon's 0700 run directory,
which a mount pod already mounts), served by one thread for the mount's life (``HandoverMounter``
starts it before the daemon and stops it at unmount; after a plugin restart ``resume`` starts it
again).

The plugin keeps no copy of the mount's ``/dev/fuse`` descriptor: the daemon must stay its only
holder, so that the daemon's death ends the connection (ENOTCONN to readers) and the volume can be
recovered (issue 36). So each request carries the daemon's own descriptor beside the backing file's,
and both copies are closed as soon as the ioctl returns.

**A trust boundary.** The kernel records the caller's credentials (the plugin's: root) with a backing
file and reopens it with them for every passed-through open, so nothing is registered unchecked
(``check_fuse_fd``, ``check_backing_fd``; each refusal answers an errno and logs one line):

- the peer: the connection's ``SO_PEERCRED`` uid is the daemon's (else EPERM and the connection ends);
- the "fuse" descriptor is ``/dev/fuse`` (character device 10:229): an ioctl number means something
  else on another device, so no other descriptor is ever given to ``ioctl``;
- the backing descriptor: a regular file, opened read-only (not O_PATH, which the kernel would take),
  owned by the daemon's uid, with one link (no hard link to another user's file), whose path
  (``/proc/self/fd/N``) lies under this volume's cache directory as the plugin resolves it, and names
  that same file (``lstat``: same device and inode);
- at most ``MAX_IDS`` live ids per mount (ENFILE beyond), and an id is dropped only if this mount's
  broker registered it (ENOENT otherwise). The ids are forgotten when the broker stops: the kernel
  drops them with the connection.

**After a plugin restart** (``resumed``) the connection still holds the ids the earlier plugin
registered, and the daemon keeps using them (it keeps an inode's id between opens), but this broker
never saw them. So a resumed broker also passes on a close of an id it does not know: the descriptor
is the daemon's own connection (the only one its pod holds), on which every id was registered for that
daemon by this mount's broker, in one life or another; the kernel answers ENOENT for an id the
connection does not hold. Without it those ids could not be closed until the mount ended, and each
would keep its whole file open after the disk tier evicted it: space the tier counts as free.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import select
import socket
import stat
import struct
import threading
from pathlib import Path
from typing import Callable

from cachefs.backing import ANSWER, BROKER_MAX_IDS, OP_CLOSE, OP_FDS, OP_OPEN, OP_PING, REQUEST, register, unregister
from cachefs.handover import check_socket_path, is_fuse_device

log = logging.getLogger(__name__)

# Live backing ids per mount (cachefs.backing says how the daemon uses them and why this bound).
MAX_IDS = BROKER_MAX_IDS
# Connections served at once: the daemon's one, and a reconnecting one while the old is being closed.
MAX_CONNECTIONS = 4
# How often the serving thread looks at whether it should stop.
POLL_S = 0.5
# Every socket operation of the broker is bounded: an answer (a few bytes into an empty socket buffer)
# that cannot be sent in this time means a peer that does not read, and its connection is closed.
SEND_TIMEOUT_S = 2.0
# How long stop() waits for the thread (it ends within one POLL_S once told).
STOP_WAIT_S = 10.0
_O_PATH = getattr(os, "O_PATH", 0o10000000)


class Refused(Exception):
    """A request the broker will not carry out: ``code`` (an errno) is the answer, ``reason`` the log line."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


def peer_uid(conn: socket.socket) -> int:
    _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                          struct.calcsize("3i")))
    return int(uid)


def check_fuse_fd(fd: int) -> None:
    if not is_fuse_device(fd):
        raise Refused(errno.EBADF, "the descriptor sent as the mount's is not /dev/fuse")


def check_backing_fd(fd: int, uid: int, cache_dir: str) -> str:
    """The path of ``fd`` if the plugin may register it as a backing file for the daemon ``uid`` whose
    cache directory is ``cache_dir`` (resolved); ``Refused`` saying why not."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if flags & _O_PATH:
        raise Refused(errno.EBADF, "the backing file was opened with O_PATH, not for reading")
    if flags & os.O_ACCMODE != os.O_RDONLY:
        raise Refused(errno.EACCES, "the backing file is not opened read-only")
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise Refused(errno.EINVAL, "the backing file is not a regular file")
    if st.st_uid != uid:
        raise Refused(errno.EACCES, f"the backing file is owned by uid {st.st_uid}, not the daemon's {uid}")
    if st.st_nlink != 1:
        raise Refused(errno.EMLINK, f"the backing file has {st.st_nlink} links (a cache file has one)")
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError as exc:
        raise Refused(errno.EACCES, f"the backing file's path cannot be read: {exc.strerror}") from None
    if not path.startswith(cache_dir + os.sep):
        raise Refused(errno.EACCES, f"the backing file {path} is outside the volume's cache directory {cache_dir}")
    try:
        named = os.lstat(path)
    except OSError as exc:
        raise Refused(errno.EACCES, f"the backing file {path} cannot be found by its path: {exc.strerror}") from None
    if (named.st_dev, named.st_ino) != (st.st_dev, st.st_ino):
        raise Refused(errno.EACCES, f"the path {path} names another file than the one sent")
    return path


class BackingBroker:
    """One mount's broker (see the module docstring): ``start`` listens at ``path`` and serves in a
    thread, ``stop`` ends it and forgets the ids. ``register``/``unregister``: the ioctls (passed in,
    so the bookkeeping can be tested without a mount)."""

    def __init__(self, path: Path, *, uid: int, gid: int | None, cache_dir: Path, max_ids: int = MAX_IDS,
                 resumed: bool = False, register: Callable[[int, int], int] = register,
                 unregister: Callable[[int, int], None] = unregister) -> None:
        check_socket_path(path)
        self.resumed = resumed  # started after a plugin restart: the earlier plugin's ids may be closed too
        self.path = path
        self.uid = uid
        self.gid = gid
        self.cache_dir = os.path.realpath(cache_dir)
        self.max_ids = max_ids
        self.ids: set[int] = set()
        self._register = register
        self._unregister = unregister
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._refused: set[socket.socket] = set()  # connections of a peer of another uid
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Listen (``OSError`` if the socket cannot be made) and serve in a thread."""
        self.path.unlink(missing_ok=True)  # left by a plugin that was killed
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.bind(str(self.path))
            os.chmod(self.path, 0o600)
            os.chown(self.path, self.uid, -1 if self.gid is None else self.gid)
            sock.listen(MAX_CONNECTIONS)
        except BaseException:
            sock.close()
            self.path.unlink(missing_ok=True)
            raise
        self._listener = sock
        self._thread = threading.Thread(target=self._serve, name=f"backing broker {self.path.parent.name}",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop serving, remove the socket, forget the ids (the connection that held them is gone)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(STOP_WAIT_S)
        for sock in [*self._conns, *([self._listener] if self._listener else [])]:
            sock.close()
        self._conns.clear()
        self._refused.clear()
        self._listener = None
        self.ids.clear()
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass

    def _serve(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                readable, _, _ = select.select([self._listener, *self._conns], [], [], POLL_S)
            except (OSError, ValueError):  # a socket closed by stop()
                return
            for sock in readable:
                if sock is self._listener:
                    self._accept()
                else:
                    self._serve_one(sock)

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        conn.settimeout(SEND_TIMEOUT_S)
        try:
            uid = peer_uid(conn)
        except OSError:
            uid = -1
        if len(self._conns) >= MAX_CONNECTIONS:
            log.warning("backing broker %s: refused a connection beyond %d", self.path, MAX_CONNECTIONS)
            conn.close()
            return
        if uid != self.uid:
            # Its first request is answered EPERM (so the peer can say why), and the connection closed.
            log.warning("backing broker %s: refused a peer of uid %d, not the daemon's %d", self.path, uid, self.uid)
            self._refused.add(conn)
        self._conns.append(conn)

    def _drop(self, conn: socket.socket) -> None:
        conn.close()
        self._conns.remove(conn)
        self._refused.discard(conn)

    def _serve_one(self, conn: socket.socket) -> None:
        try:
            data, fds, msg_flags, _ = socket.recv_fds(conn, REQUEST.size, 2)
        except OSError:
            self._drop(conn)
            return
        try:
            if not data:
                self._drop(conn)  # the daemon closed it (or exited)
                return
            if msg_flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(data) != REQUEST.size:
                result = -errno.EINVAL
                log.warning("backing broker %s: refused a malformed request", self.path)
            elif conn in self._refused:
                result = -errno.EPERM
            else:
                op, arg = REQUEST.unpack(data)
                result = self.handle(op, arg, fds)
        finally:
            for fd in fds:
                os.close(fd)
        if not self._answer(conn, result) or conn in self._refused:
            self._drop(conn)

    def _answer(self, conn: socket.socket, result: int) -> bool:
        try:
            conn.send(ANSWER.pack(result))
            return True
        except OSError:
            return False

    def handle(self, op: bytes, arg: int, fds: list[int]) -> int:
        """The answer to one request (the id, 0, or a negative errno); ``fds`` stay the caller's."""
        try:
            if OP_FDS.get(op) != len(fds):
                raise Refused(errno.EINVAL, f"a request {op!r} with {len(fds)} descriptor(s)")
            check_fuse_fd(fds[0])
            if op == OP_PING:
                return 0
            if op == OP_OPEN:
                path = check_backing_fd(fds[1], self.uid, self.cache_dir)
                if len(self.ids) >= self.max_ids:
                    raise Refused(errno.ENFILE, f"{self.max_ids} backing files are registered already")
                backing_id = self._register(fds[0], fds[1])
                self.ids.add(backing_id)
                log.debug("backing broker %s: registered %s as backing id %d", self.path, path, backing_id)
                return backing_id
            if arg not in self.ids and not self.resumed:
                raise Refused(errno.ENOENT, f"backing id {arg} was not registered by this mount's broker")
            self.ids.discard(arg)
            self._unregister(fds[0], arg)
            return 0
        except Refused as exc:
            if exc.code == errno.ENFILE:
                log.debug("backing broker %s: %s", self.path, exc.reason)
            else:
                log.warning("backing broker %s: refused: %s", self.path, exc.reason)
            return -exc.code
        except OSError as exc:  # the kernel's refusal, passed on
            return -(exc.errno or errno.EIO)
