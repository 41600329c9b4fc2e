"""A container's filesystem view for the kubelet stand-in: a read-only root with the pod's volumes on it.

Run by ``tests/support/kubelet.py`` as ``unshare --mount --propagation slave -- python container_root.py
SPEC -- COMMAND...`` (as root, in a mount namespace of its own), where SPEC is JSON
``[[source, target], ...]``: each volume's directory on the host and where the container sees it.
It does what a container runtime does for ``readOnlyRootFilesystem: true``:

- every source (a directory, or the termination-message file) is opened first (``O_PATH``), so a volume mounted over an ancestor of another's
  source (an ``emptyDir`` at ``/tmp`` over a hostPath under ``/tmp``) still finds it;
- the volumes are bind-mounted, shallowest target first (runc's order), each writable;
- the image's own files stay visible: here the "image" is this interpreter, its virtualenv and the
  checkout the project is installed from (editable), and where a volume covers one of them (a test
  run from a clone under ``/tmp``, where the mount pod's ``/tmp`` emptyDir goes) it is bound back at
  its own path, read-only, as a container's image files are never hidden by a ``/tmp`` volume;
- ``/`` is remounted read-only; then COMMAND is exec'd (``setpriv`` drops uid and capabilities).

``slave`` propagation: mounts made later on the host (a FUSE mount the plugin makes) still appear
inside, as with ``mountPropagation: HostToContainer``. Nothing here outlives the process: the
namespace goes with it.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

from container_ns import detach_foreign_fuse_mounts  # a sibling module: this runs as a file

MS_RDONLY, MS_REMOUNT, MS_BIND = 1, 32, 4096
_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str, target: str, flags: int) -> None:
    # The syscall, not mount(8): it would resolve /proc/self/fd/N to a path a volume may now cover.
    if _libc.mount(source.encode(), target.encode(), None, flags, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _image_paths() -> list[str]:
    """What the stand-in's "image" holds: the interpreter's installation, the virtualenv, the checkout."""
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, checkout)})


def _covered(path: str, targets: list[str]) -> bool:
    return any(path == t or path.startswith(t.rstrip("/") + "/") for t in targets)


def main(argv: list[str]) -> None:
    spec, separator, *command = argv
    assert separator == "--" and command, "usage: container_root.py SPEC -- COMMAND..."
    binds = json.loads(spec)
    fds = [(os.open(source, os.O_PATH), target) for source, target in binds]  # a file too (the termination log)
    targets = [target for _, target in binds]
    image = [(os.open(path, os.O_PATH | os.O_DIRECTORY), path) for path in _image_paths() if _covered(path, targets)]
    # As runc's pivot_root: no copy of another FUSE mount of the host stays in this namespace (container_ns).
    detach_foreign_fuse_mounts([source for source, _ in binds] + _image_paths())
    for fd, target in sorted(fds, key=lambda pair: pair[1].count("/")):
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.makedirs(target, exist_ok=True)
        else:  # a file is bound on a file, made where a volume bound before holds it (runc does so)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "a").close()
        _mount(f"/proc/self/fd/{fd}", target, MS_BIND)
        os.close(fd)
    for fd, path in image:
        os.makedirs(path, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", path, MS_BIND)
        _mount("none", path, MS_REMOUNT | MS_BIND | MS_RDONLY)
        os.close(fd)
    _mount("none", "/", MS_REMOUNT | MS_BIND | MS_RDONLY)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
