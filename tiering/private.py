"""The daemon's own state on disk: private directories and files no other local user can read or plant.

A cache directory holds raw object bytes (``blocks/``), every key, ETag and size (``metadata.db``),
staged writes and the daemon's log; a runtime directory holds the control socket. Two rules keep
them to the user running cachefs:

- **Private modes.** The daemon runs with umask ``PRIVATE_UMASK`` (077), so every directory it makes
  is 0700 and every file 0600, and files it creates by hand ask for ``PRIVATE_FILE_MODE`` as well.
  The modes a mount *presents* (``--file-mode``/``--dir-mode``) are attributes the filesystem
  reports, not the modes of cache files, so the umask does not change them.
- **Owned, not writable by others.** A directory that already exists is used only if it is owned by
  the effective uid and not writable by group or others (``check_private_dir``). Whoever owns or may
  write a directory can plant files in it: a block served as object data, a symlink that makes the
  daemon overwrite a file of the victim's (``source.json -> /etc/...``), a socket answering in the
  daemon's place. Refusing such a directory is what makes every file under it trustworthy; the
  names are predictable (a hash of the source; ``/tmp/cachefs-<uid>``), so another user can prepare
  them in advance. Each refusal is one line naming the path and the fix. Directories cachefs names
  itself (the per-source directory, the runtime directory) are also narrowed to 0700 when found
  wider (a cache made by an older version was 0755), and must not be symlinks; a ``--cache-dir``
  the user names may be a symlink (to a faster disk), and its target is checked.

Files the daemon opens by name in those directories are opened with ``O_NOFOLLOW``
(``open_private``), so a symlink planted before the check (or by root) is an error, never a write
through it. The checks run on the directory itself, not on every ancestor: the ancestors of a
user's cache directory are the user's (or root's) to guard.

Why no key authenticating block headers: with the directory owned by the euid and 0700, only that
user and root can write a block, and both could read a key kept beside the blocks as well. A MAC
would have to cover the data (the header's data checksum is a CRC, which chosen data can match), and
keyed BLAKE2b over the data costs 0.81 CPU-seconds per GiB read from the disk tier against 0.018 for
the CRC-32 (HMAC-SHA256: 0.63; ``benchmarks/block_mac.py``, 4 MiB blocks, one thread of this 2-core
machine): forty times the checking cost on the busiest path, for no protection the ownership check
does not already give. The cluster tier (a store other nodes write) is a different trust
domain: its blocks are as trusted as the credentials that may write that bucket.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

# The daemon's umask: directories 0700, files 0600. Nothing a daemon writes is meant for other users.
PRIVATE_UMASK = 0o077
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
# Write bits for group and others: whoever holds them may create, rename or unlink entries.
_SHARED_WRITE = stat.S_IWGRP | stat.S_IWOTH


class UnsafePathError(PermissionError):
    """A directory or file another user could have prepared. ``strerror`` is the one-line message."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EPERM, message)


def check_private_dir(path: Path, what: str, *, create: bool = True, follow_symlinks: bool = False,
                      narrow: bool = True) -> Path:
    """Make sure ``path`` is a directory only the effective uid can write; create it 0700 if missing.

    ``what`` names the directory in messages ("cache directory"). ``follow_symlinks``: accept a
    symlink and check its target (a directory the user named); otherwise a symlink is refused.
    ``narrow``: take group and other bits off a directory cachefs names itself. Raises
    ``UnsafePathError`` (owner, mode, symlink) or ``OSError`` (cannot create), both with one line.
    """
    path = Path(path)
    if create:
        try:
            # Parents too, each 0700 under the daemon's umask (os.makedirs applies ``mode`` to the
            # last one only; the umask covers the rest).
            os.makedirs(path, mode=PRIVATE_DIR_MODE, exist_ok=True)
        except FileExistsError:
            pass  # a file or a dangling symlink: the checks below name it
        except OSError as exc:
            raise OSError(exc.errno, f"{what} {path} cannot be created: {exc.strerror or exc}") from exc
    try:
        st = os.stat(path) if follow_symlinks else os.lstat(path)
    except OSError as exc:
        raise OSError(exc.errno, f"{what} {path} is not usable: {exc.strerror or exc}") from exc
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(f"{what} {path} is a symlink; cachefs uses only a real directory there: remove it")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"{what} {path} exists and is not a directory: remove it or choose another path")
    euid = os.geteuid()
    if st.st_uid != euid:
        raise UnsafePathError(
            f"{what} {path} is owned by uid {st.st_uid}, not by uid {euid} that runs cachefs (another user could "
            f"have planted files there): remove it, or `chown {euid} {path}` if you trust its contents")
    if st.st_mode & _SHARED_WRITE:
        raise UnsafePathError(
            f"{what} {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}), so other users "
            f"could plant files there: `chmod go-w {path}`, or choose another path")
    if narrow and stat.S_IMODE(st.st_mode) & ~PRIVATE_DIR_MODE & 0o777:
        os.chmod(path, PRIVATE_DIR_MODE, follow_symlinks=False)
    return path


def check_cache_dirs(root: Path, source_dir: Path) -> None:
    """The checks of a cache root (``--cache-dir``: may be a symlink the user made, to a faster disk,
    and keeps its mode) and of the per-source directory in it (a name cachefs makes: no symlink,
    narrowed to 0700). Raises ``OSError`` with one line (``UnsafePathError`` for owner and mode)."""
    check_private_dir(root, "cache directory", follow_symlinks=True, narrow=False)
    check_private_dir(source_dir, "cache directory")


def open_private(path: Path | str, flags: int) -> int:
    """``os.open`` of one of the daemon's own files: never through a symlink, 0600 if created, no
    inheritance by children. ``flags`` as for ``os.open`` (``O_RDWR | O_CREAT``, ...)."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePathError(f"{path} is a symlink; cachefs writes only its own files there: remove it") from exc
        raise


def write_private_file(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` (0600, written to a temp name and renamed: a symlink planted at
    ``path`` is replaced, never written through)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as f:
        f.write(data)
    os.replace(tmp, path)
