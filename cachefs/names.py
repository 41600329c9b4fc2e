"""Which object-key components may become POSIX names.

A key component becomes a file or directory name only if it is a valid POSIX name: not empty, not
``.`` or ``..``, no NUL or ``/``, at most 255 bytes in UTF-8. Anything else is skipped (and logged
once), never mapped to some other name: a mapping could collide with a real key, and a skipped key is
obviously absent rather than subtly renamed. Skipping ``..`` and empty components is also what keeps
every path inside the mount root.
"""

from __future__ import annotations

import errno
import logging
from collections import OrderedDict
from dataclasses import dataclass

log = logging.getLogger(__name__)

NAME_MAX = 255
# How many distinct bad keys we remember having warned about. A bucket with millions of bad keys
# must not grow the daemon's memory; past this, a key may be warned about again.
MAX_WARNED_KEYS = 10_000


def encode_name(name: str) -> bytes:
    return name.encode("utf-8", "surrogateescape")


@dataclass(frozen=True, slots=True)
class NameProblem:
    """Why a name cannot be a POSIX file name, and the errno a request naming it is answered with."""

    errno: int
    reason: str


def name_problem(name: str) -> NameProblem | None:
    """What keeps ``name`` from being a POSIX file name, or None if nothing does."""
    if name == "":
        return NameProblem(errno.EINVAL, "empty path component")
    if name in (".", ".."):
        return NameProblem(errno.EINVAL, f"path component {name!r}")
    if "\x00" in name:
        return NameProblem(errno.EINVAL, "NUL byte in name")
    if "/" in name:
        return NameProblem(errno.EINVAL, "slash in name")
    if len(encode_name(name)) > NAME_MAX:
        return NameProblem(errno.ENAMETOOLONG, f"name longer than {NAME_MAX} bytes")
    return None


def key_length_problem(path: str, room: int, *, directory: bool) -> str | None:
    """Why the object key of ``path`` (a directory's marker ends in ``/``) cannot be stored below a
    root with ``room`` bytes of key left (``ObjectStore.max_key_bytes``), or None if it can."""
    length = len(encode_name(path)) + (1 if directory else 0)
    if length > room:
        return f"object key of /{path} would be {length} bytes; the store holds at most {room} below its root"
    return None


class WarnOnce:
    """Logs one warning per key, remembering a bounded number of keys."""

    def __init__(self, limit: int = MAX_WARNED_KEYS) -> None:
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._limit = limit
        self.count = 0

    def warn(self, key: str, reason: str) -> None:
        if key in self._seen:
            return
        self._seen[key] = None
        if len(self._seen) > self._limit:
            self._seen.popitem(last=False)
        self.count += 1
        log.warning("skipping object %r: %s", key, reason)
