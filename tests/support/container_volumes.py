"""A workload container's mount namespace for the kubelet stand-in: the pod's volumes bound in, with
the propagation each volume mount asks for, as runc makes them.

Run by ``tests/support/kubelet.py`` (``Kubelet.start_workload``) as ``unshare --mount --propagation
slave -- python container_volumes.py SPEC`` (as root), where SPEC is JSON ``[[source, dest,
propagation, read_only], ...]``: each volume's directory on the host (the CSI target path the node
plugin published), where the container sees it, and its ``mountPropagation``. It does what runc does
with the mounts the kubelet passes it:

- the new namespace starts as a **slave** copy of the host's (runc's default ``rootfsPropagation``,
  ``rslave``), so nothing made inside leaks out;
- each volume is bind-mounted recursively at its destination (``MS_BIND | MS_REC``), then given the
  propagation the kubelet maps its ``mountPropagation`` to: ``None`` (the default) -> ``rprivate``,
  ``HostToContainer`` -> ``rslave``, ``Bidirectional`` -> ``rshared``; a ``readOnly`` volume mount
  is remounted read-only (``MS_REMOUNT | MS_BIND | MS_RDONLY``) on the container's bind alone;
- every other FUSE mount the namespace copied from the host is detached first, as runc's pivot_root
  leaves the host's mounts behind (``container_ns``);
- then it sleeps until killed: the test runs commands in the namespace with ``nsenter``.

What this reproduces (issue 36): a bind made ``rslave`` receives the mounts later made *on top of*
its source on the host, and the unmounts of them, but it keeps the mount it was made from: a host
that detaches the target and mounts a new one in its place leaves the container on the old one.
That only holds where the source is in a peer group: the kubelet makes its root directory
``rshared`` (``Kubelet.share``), so every target mounted under it is.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys

from container_ns import detach_foreign_fuse_mounts  # a sibling module: this runs as a file

MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC = 1, 32, 4096, 16384
MS_PRIVATE, MS_SLAVE, MS_SHARED = 1 << 18, 1 << 19, 1 << 20
PROPAGATION = {"None": MS_PRIVATE, "HostToContainer": MS_SLAVE, "Bidirectional": MS_SHARED}
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)


def _mount(source: str | None, target: str, flags: int) -> None:
    if _libc.mount(source.encode() if source else None, target.encode(), None, flags, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target} (flags {flags:#x}): {os.strerror(err)}")


def main(argv: list[str]) -> None:
    (spec,) = argv
    volumes = json.loads(spec)
    detach_foreign_fuse_mounts([source for source, *_ in volumes])  # as runc's pivot_root would
    for source, dest, propagation, read_only in volumes:
        os.makedirs(dest, exist_ok=True)
        _mount(source, dest, MS_BIND | MS_REC)
        _mount(None, dest, MS_REC | PROPAGATION[propagation])
        if read_only:
            _mount(None, dest, MS_REMOUNT | MS_BIND | MS_RDONLY)
    print("ready", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        signal.pause()


if __name__ == "__main__":
    main(sys.argv[1:])
