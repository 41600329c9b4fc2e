"""The disk tier's directory: checking it at mount, its free space, and what a start-up finds in it.

``tiering.tiers.disk`` owns the blocks while the process runs; this module holds what needs no index:
proving a cache directory usable (``check_cache_dir``, for the CLI's one-line errors), the free-space
probe the daemon passes in (``filesystem_free_bytes``), and the start-up scan: block files by name
and stat only (``scan_blocks``, leftover temp files removed) and the removal of every whole file
(``remove_whole_files``: none is trusted across a restart, ``tiering.tiers.wholefile``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from pathlib import Path

from tiering.private import PRIVATE_DIR_MODE

log = logging.getLogger("tiering.tiers.disk")

BLOCK_SUFFIX = ".blk"
TMP_PREFIX = "."
TMP_SUFFIX = ".tmp"
_DIGEST_LEN = 64  # hex SHA-256
_HEX = frozenset("0123456789abcdef")


def check_cache_dir(path: Path) -> None:
    """Create ``path`` if needed and prove it writable with a probe file; raise ``OSError`` if not.

    The message is one line naming the path and the reason, for the CLI to show as is.
    """
    path = Path(path)
    try:
        path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    except FileExistsError as exc:
        raise NotADirectoryError(errno.ENOTDIR, f"cache directory {path} exists and is not a directory") from exc
    except OSError as exc:
        raise OSError(exc.errno, f"cache directory {path} cannot be created: {exc.strerror or exc}") from exc
    if not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, f"cache directory {path} is not a directory")
    probe = path / f".probe-{os.getpid()}-{threading.get_ident()}{TMP_SUFFIX}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"cachefs")
        finally:
            os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            # Writable, but full (another program filled the disk): not a permission problem. Whether
            # the caches fit is decided with the sizes (``cachefs.cli.resources``); the disk tier
            # evicts, and pending writes must still be uploaded from here.
            with contextlib.suppress(OSError):
                os.unlink(probe)
            return
        raise OSError(exc.errno, f"cache directory {path} is not writable: {exc.strerror or exc}") from exc


def filesystem_free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of ``path`` (``f_bavail``), the
    probe the daemon passes as ``free_space``: the root-reserved blocks stay for the system."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _is_hex(text: str) -> bool:
    return all(c in _HEX for c in text)


def scan_blocks(blocks_dir: Path, tier_name: str) -> tuple[list[tuple[int, str, int]], int]:
    """The block files under ``blocks_dir`` as ``(mtime_ns, digest, size)``, by name and stat only,
    and how many leftover temp files were removed. Anything else is left alone (logged)."""
    found: list[tuple[int, str, int]] = []
    removed_tmp = 0
    with os.scandir(blocks_dir) as subdirs:
        for sub in subdirs:
            if len(sub.name) != 2 or not _is_hex(sub.name) or not sub.is_dir(follow_symlinks=False):
                continue
            with os.scandir(sub.path) as entries:
                for entry in entries:
                    name = entry.name
                    if name.startswith(TMP_PREFIX) and name.endswith(TMP_SUFFIX):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(entry.path)
                            removed_tmp += 1
                        continue
                    digest = name[: -len(BLOCK_SUFFIX)]
                    if (name.endswith(BLOCK_SUFFIX) and len(digest) == _DIGEST_LEN and digest.startswith(sub.name)
                            and _is_hex(digest) and entry.is_file(follow_symlinks=False)):
                        st = entry.stat(follow_symlinks=False)
                        found.append((st.st_mtime_ns, digest, st.st_size))
                    else:
                        log.debug("%s tier: ignoring unexpected file %s", tier_name, entry.path)
    return found, removed_tmp


def remove_whole_files(whole_dir: Path) -> int:
    """Remove every whole file (and temp file) under ``whole_dir``; how many were removed."""
    removed = 0
    with os.scandir(whole_dir) as subdirs:
        for sub in subdirs:
            if not sub.is_dir(follow_symlinks=False):
                continue
            with os.scandir(sub.path) as entries:
                for entry in entries:
                    if entry.is_file(follow_symlinks=False) or entry.is_symlink():
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(entry.path)
                            removed += 1
    return removed
