"""What a container runtime's pivot_root does to the host's other mounts, for the kubelet stand-in.

``unshare --mount`` copies every mount of the host into the new namespace; runc then pivots into the
container's root and detaches the old one, so a container holds only the mounts the kubelet gave it.
Without that, a stand-in container would hold a copy of every FUSE mount present when it started,
other tests' included: an unmount on the host then leaves that copy, so the connection stays open and
its daemon never sees its session end (seen: ``test_frozen_store``'s daemon outliving
``cachefs unmount`` while another worker's workload containers ran). ``detach_foreign_fuse_mounts``
detaches them, as the pivot would, keeping the volumes' sources and what is above or below them.
Imported by the scripts beside it, which run as files (``python tests/support/container_*.py``).
"""

from __future__ import annotations

import ctypes
import os
import re

MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _related(path: str, keep: list[str]) -> bool:
    """Whether ``path`` is a kept path, under one, or an ancestor of one."""
    for k in keep:
        if path == k or path.startswith(k.rstrip("/") + "/") or k.startswith(path.rstrip("/") + "/"):
            return True
    return False


def detach_foreign_fuse_mounts(keep: list[str]) -> list[str]:
    """Detach (``MNT_DETACH``) every FUSE mount of this namespace unrelated to ``keep``; the mountpoints
    detached, deepest first. Call it in the new namespace, before binding the volumes."""
    keep = [os.path.realpath(k) for k in keep]
    foreign = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            fields = left.split()
            fstype = right.split()[0] if right else ""
            if len(fields) > 4 and fstype.startswith("fuse"):
                mountpoint = _unescape(fields[4])
                if not _related(mountpoint, keep):
                    foreign.append(mountpoint)
    detached = []
    for mountpoint in sorted(set(foreign), key=len, reverse=True):
        if _libc.umount2(mountpoint.encode(), MNT_DETACH) == 0:
            detached.append(mountpoint)
    return detached
