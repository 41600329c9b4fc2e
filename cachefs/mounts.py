"""Reading the kernel's mount table, and checks on a mountpoint before mounting.

The CLI finds a running cachefs from the mountpoint alone: the mount table says whether a path is a
cachefs mount (``fuse.cachefs``), and the daemon publishes its control socket as an extended
attribute of the mount's root directory.

A daemon holds an ``flock`` on ``LOCK_FILENAME`` in its source's cache directory (taken in
``cachefs.daemon.main``); ``cache_dir_holder`` lets ``cachefs mount`` see that the source is already
mounted before it starts a daemon, so a refused second mount never touches the live mount's log.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit
from typing import Any

from tiering.private import check_private_dir

FSTYPE = "fuse.cachefs"
# The longest mount source shown (the kernel keeps it in /proc/self/mountinfo for every process).
MAX_SOURCE_CHARS = 256
# The extended attribute of a mount's root that names its control socket (``cachefs.client`` reads
# it, the filesystem answers it). Here, beside FSTYPE, so finding a mount imports no filesystem.
CONTROL_XATTR = "user.cachefs.control"
MOUNTINFO = Path("/proc/self/mountinfo")
LOCK_FILENAME = "lock"
# The daemon's /info, kept beside its control socket (``<digest>.json``) while it serves.
RECORD_SUFFIX = ".json"
# A record is a few hundred bytes; anything much larger is not one.
MAX_RECORD_BYTES = 64 * 1024
# Naming the processes that hold a busy mount reads /proc/PID/{cwd,root,exe,fd/*}: bounded so a host
# with a huge process table or a process with a million descriptors cannot hold `cachefs unmount`.
# The names are a hint for the user; a scan cut short says so ("and maybe others").
HOLDERS_MAX_PROCESSES = 100_000
HOLDERS_MAX_FDS_PER_PROCESS = 10_000
HOLDERS_MAX_NAMED = 10


def mount_source(source: str) -> str:
    """The mount's source as ``df`` and ``findmnt`` show it: the bucket URL, without user, password,
    query or fragment (the mount table is readable by every process), control characters dropped;
    ``cachefs`` when nothing is left. A mount is recognised by its type (``FSTYPE``), never
    by this."""
    try:
        parts = urlsplit(source)
        netloc = parts.hostname or ""
        if parts.port is not None:
            netloc += f":{parts.port}"
        shown = urlunsplit((parts.scheme, netloc, parts.path, "", "")) if parts.scheme else source
    except ValueError:
        shown = ""
    shown = "".join(c for c in shown if c.isprintable())  # the kernel escapes blanks in mountinfo
    return shown[:MAX_SOURCE_CHARS] or FSTYPE.removeprefix("fuse.")


def process_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after ``pid (comm)`` (state first, the start time at index 19),
    or None when there is no such process. The daemon of a mount is waited for and recognised by them."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()  # comm may itself hold spaces or ')'


def process_waits(pid: int) -> str:
    """Where ``pid`` is, for a one-line error about a process that does not exit: its state and what
    its threads wait in (``/proc/PID/task/*/wchan``), most common first; "" if it is gone."""
    fields = process_stat(pid)
    if fields is None:
        return ""
    waits: dict[str, int] = {}
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                wchan = (task / "wchan").read_text().strip()
            except OSError:
                continue
            name = "running" if wchan in ("", "0") else wchan
            waits[name] = waits.get(name, 0) + 1
    except OSError:
        pass
    held = ", ".join(f"{n} in {w}" for w, n in sorted(waits.items(), key=lambda item: -item[1])[:4])
    return f"state {fields[0]}" + (f", threads: {held}" if held else "")


def cache_dir_holder(directory: Path) -> str | None:
    """The pid (as written) of the daemon holding ``directory``'s lock, or None when it is free.

    Only probes: the lock is taken and released at once, and a missing directory is free."""
    try:
        handle = open(directory / LOCK_FILENAME, "r")
    except OSError:
        return None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return handle.read().strip() or "another process"
        except OSError:
            return None
        fcntl.flock(handle, fcntl.LOCK_UN)
    return None


@dataclass(frozen=True)
class MountEntry:
    mountpoint: str
    fstype: str
    source: str
    # major:minor of the mounted filesystem: a bind mount shows the same device as its source, so two
    # entries with one device are one FUSE connection, served by one daemon.
    device: str = field(default="", compare=False)


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and len(field[i + 1 : i + 4]) == 3 and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_entries(mountinfo: Path = MOUNTINFO) -> list[MountEntry]:
    entries = []
    for line in mountinfo.read_text().splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 2:
            continue
        entries.append(MountEntry(_unescape(fields[4]), tail[0], _unescape(tail[1]), fields[2]))
    return entries


def find_mount(path: Path, mountinfo: Path = MOUNTINFO) -> MountEntry | None:
    """The mount whose mountpoint is exactly ``path`` (the last one, if stacked)."""
    target = os.path.abspath(path)
    found = None
    for entry in mount_entries(mountinfo):
        if entry.mountpoint == target:
            found = entry
    return found


def other_views(entry: MountEntry, mountinfo: Path = MOUNTINFO) -> list[str]:
    """Other mountpoints of the same mounted filesystem (bind mounts of it, or the mount a bind shows)."""
    if not entry.device:
        return []
    return [e.mountpoint for e in mount_entries(mountinfo)
            if e.device == entry.device and e.fstype == entry.fstype and e.mountpoint != entry.mountpoint]


def is_cachefs_mount(path: Path) -> bool:
    entry = find_mount(path)
    return entry is not None and entry.fstype == FSTYPE


def check_mountpoint(path: Path) -> str | None:
    """Why ``path`` cannot be mounted on, or None if it can."""
    entry = find_mount(path)
    if entry is not None:
        try:
            os.statvfs(path)  # always asked of the daemon (a stat may be answered from the kernel's cache)
        except OSError as exc:
            if exc.errno in (errno.ENOTCONN, errno.ECONNABORTED):  # its daemon died (kill -9, OOM)
                return (f"mountpoint {path} is a broken {entry.fstype} mount (its daemon is not running): "
                        f"run 'cachefs unmount {path}' first")
        if entry.fstype == FSTYPE:
            return f"mountpoint {path} is already mounted (a live cachefs mount: 'cachefs unmount {path}' first)"
        return f"mountpoint {path} is already mounted ({entry.fstype})"
    try:
        st = path.stat()
    except FileNotFoundError:
        return f"mountpoint {path} does not exist"
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            return f"mountpoint {path} is a dead FUSE mount (run 'cachefs unmount {path}' first)"
        return f"mountpoint {path} is not accessible: {exc.strerror}"
    if not os.path.isdir(path):
        return f"mountpoint {path} is not a directory"
    del st
    try:
        with os.scandir(path) as it:
            if any(True for _ in it):
                return f"mountpoint {path} is not empty"
    except OSError as exc:
        return f"mountpoint {path} is not readable: {exc.strerror}"
    return None


@dataclass(frozen=True)
class MountUsers:
    """Processes found using a mount (``pid``, ``comm``), and whether the scan was cut short."""

    processes: tuple[tuple[int, str], ...]
    incomplete: bool

    def describe(self) -> str:
        """``pid 12 (bash), pid 40 (python3)`` (at most ``HOLDERS_MAX_NAMED``), or ""."""
        named = ", ".join(f"pid {pid} ({comm})" for pid, comm in self.processes[:HOLDERS_MAX_NAMED])
        more = len(self.processes) > HOLDERS_MAX_NAMED or self.incomplete
        return f"{named} and maybe others" if named and more else named


def mount_users(path: Path, proc: Path = Path("/proc")) -> MountUsers:
    """Processes whose working directory, root, executable or an open file lies under the mount at
    ``path`` (what makes ``umount`` answer EBUSY), as far as this user may see them in /proc."""
    target = os.path.abspath(path)
    inside = target.rstrip("/") + "/"

    def under(link: Path) -> bool:
        try:
            where = os.readlink(link)
        except OSError:
            return False
        return where == target or where.startswith(inside)

    found: list[tuple[int, str]] = []
    incomplete = False
    me = os.getpid()
    try:
        entries = [e for e in os.scandir(proc) if e.name.isdigit()]
    except OSError:
        return MountUsers((), True)
    if len(entries) > HOLDERS_MAX_PROCESSES:
        entries, incomplete = entries[:HOLDERS_MAX_PROCESSES], True
    for entry in entries:
        pid = int(entry.name)
        if pid == me:
            continue
        base = proc / entry.name
        holds = any(under(base / name) for name in ("cwd", "root", "exe"))
        if not holds:
            try:
                with os.scandir(base / "fd") as fds:
                    for n, fd in enumerate(fds):
                        if n >= HOLDERS_MAX_FDS_PER_PROCESS:
                            incomplete = True
                            break
                        if under(Path(fd.path)):
                            holds = True
                            break
            except OSError:
                pass  # gone, or another user's: not ours to see
        if holds:
            try:
                comm = (base / "comm").read_text().strip()
            except OSError:
                comm = "?"
            found.append((pid, comm))
    return MountUsers(tuple(found), incomplete)


def runtime_dir() -> Path:
    """Where control sockets live: $XDG_RUNTIME_DIR/cachefs, /run/cachefs as root, else /tmp.

    ``/tmp/cachefs-<uid>`` is a name any user can create first: a directory another user owns or may
    write is refused (``UnsafePathError``, one line), since its owner could replace the socket and
    answer in the daemon's place (``tiering.private``)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if not base:
        base = "/run" if os.geteuid() == 0 and os.access("/run", os.W_OK) else tempfile.gettempdir()
    path = Path(base) / ("cachefs" if base != tempfile.gettempdir() else f"cachefs-{os.geteuid()}")
    return check_private_dir(path, "runtime directory")


def socket_path_for(mountpoint: Path, *, resolve: bool = True) -> Path:
    """The control socket of the mount at ``mountpoint``. ``resolve=False`` for a mount whose daemon
    has not started serving yet: resolving stats the mount's root, which waits for that daemon."""
    name = mountpoint.resolve() if resolve else mountpoint
    digest = hashlib.sha256(str(name).encode()).hexdigest()[:16]
    return runtime_dir() / f"{digest}.sock"


def last_record(mountpoint: str | os.PathLike[str]) -> dict[str, Any]:
    """What the daemon of the mount at ``mountpoint`` (as the mount table names it) said about itself
    at start (its ``/info``: pid, source, cache_dir), or ``{}``: read after it died, when it can no
    longer be asked. The record lies in the private runtime directory (``runtime_dir``)."""
    try:
        path = socket_path_for(Path(mountpoint), resolve=False).with_suffix(RECORD_SUFFIX)
        with open(path, "rb") as f:
            data = f.read(MAX_RECORD_BYTES + 1)
        record = json.loads(data) if len(data) <= MAX_RECORD_BYTES else None
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}
