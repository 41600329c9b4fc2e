"""Whole files: one object version's bytes as a plain file, for the kernel to read (FUSE passthrough).

The disk tier keeps blocks as framed, checksummed files (``tiering.tiers.blockformat``); the kernel
can only read a plain file whose byte ``n`` is the object's byte ``n``. A whole file is that copy of
one version (key, ETag, size), assembled from the version's blocks on the disk tier: each block is
read and checked as a disk-tier hit is (header, key token, checksum), then written at its offset
into a temp file that is renamed into place. Nothing else writes a whole file, and nothing reads it
but the kernel, unverified, on behalf of a passthrough open: what the daemon checked is what the
kernel serves, as long as nobody but the daemon writes the cache directory (0700, owned by it;
``tiering.private``). Whole files never outlive the process that checked them: the disk tier
removes every one it finds at start-up (the scrub: a new daemon trusts only what it assembled), and
assembles them again from the blocks, which are checked on every read.

Writes go through the page cache, without fsync: the kernel reads the file through the page cache
right after (so the pages written are the ones it wants), and no whole file outlives the process, so
a crash cannot leave a torn one to be trusted. The price is the buffered write of new pages (about
2 CPU-s/GiB on the 2-core VM, ``tiering.tiers.blockfile``), once per version, in a worker thread.

Layout: ``<directory>/whole/<d[:2]>/<d>`` with ``d = whole_digest(ref)`` (hex SHA-256 of the version's
identity): a new ETag or size is a new name, so a whole file can never be taken for another version.

Cost: a whole file is a second copy of the version's bytes on the same disk. The disk tier counts it
in ``used_bytes()`` like a block and evicts it like a block (least recently used, never pinned:
it is rebuilt from the blocks on demand), so the capacity holds; see docs/tiers.md.
"""

from __future__ import annotations

import errno
import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar, overload

from tiering.blocks import BlockData, ObjectRef

_T = TypeVar("_T")
_MISSING: Any = object()

WHOLE_DIRNAME = "whole"
# Index keys of whole files in the disk tier's LRU index: a prefix no block digest (64 hex) has.
WHOLE_PREFIX = "w"


def whole_digest(ref: ObjectRef) -> str:
    """The name of the whole file of ``ref``: key, ETag and size all take part."""
    token = f"whole\x00{ref.size}\x00{ref.etag}\x00{ref.key}"
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()


def whole_path(directory: Path, digest: str) -> Path:
    return directory / digest[:2] / digest


class TierIndex(OrderedDict[str, tuple[int, int]]):
    """The disk tier's LRU index (digest -> (size, generation)), counting the whole files in it as
    entries come and go: ``/stats`` and every metrics scrape read the counts, where they walked the
    whole index, under the tier's lock, each time (0.44 s for a million blocks on the 2-core VM)."""

    def __init__(self) -> None:
        super().__init__()
        self.whole_files = 0
        self.whole_bytes = 0

    def __setitem__(self, key: str, value: tuple[int, int]) -> None:
        if key[:1] == WHOLE_PREFIX:
            old = self.get(key)
            self.whole_files += old is None
            self.whole_bytes += value[0] - (0 if old is None else old[0])
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        if key[:1] == WHOLE_PREFIX:
            self._forget(self[key])
        super().__delitem__(key)

    @overload
    def pop(self, key: str) -> tuple[int, int]: ...

    @overload
    def pop(self, key: str, default: _T) -> tuple[int, int] | _T: ...

    def pop(self, key: str, default: Any = _MISSING) -> Any:
        # (OrderedDict's pop, in C, does not go through __delitem__)
        if key[:1] == WHOLE_PREFIX and key in self:
            self._forget(self[key])
        return super().pop(key) if default is _MISSING else super().pop(key, default)

    def popitem(self, last: bool = True) -> tuple[str, tuple[int, int]]:
        key, value = super().popitem(last)
        if key[:1] == WHOLE_PREFIX:
            self._forget(value)
        return key, value

    def clear(self) -> None:
        super().clear()
        self.whole_files = self.whole_bytes = 0

    def _forget(self, value: tuple[int, int]) -> None:
        self.whole_files -= 1
        self.whole_bytes -= value[0]


@dataclass
class WholeFileStats:
    assembled: int = 0  # whole files written from checked blocks
    assembled_bytes: int = 0
    failed: int = 0  # assemblies abandoned: a block missing or failing its check, or a write error
    removed_at_start: int = 0  # found at start-up and removed (never trusted across a restart)

    def snapshot(self, files: int, nbytes: int) -> dict[str, int]:
        """The counters, with the files held now and their bytes."""
        return {"files": files, "bytes": nbytes, "assembled": self.assembled,
                "assembled_bytes": self.assembled_bytes, "failed": self.failed,
                "removed_at_start": self.removed_at_start}


def write_whole(tmp: Path, final: Path, size: int, blocks: Sequence[tuple[int, Callable[[], BlockData | None]]],
                open_file: Callable[[Path, int], int]) -> None:
    """Write ``size`` bytes to the new file ``tmp`` from ``blocks`` (offset, reader of the checked
    block: None if it is gone), then rename it to ``final``. ``OSError`` (the temp file removed)
    if a block is missing, short, or a write fails."""
    fd = open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        try:
            for offset, read in blocks:
                data = read()
                if data is None:
                    raise FileNotFoundError(errno.ENOENT, f"a block at offset {offset} left the disk tier")
                view = memoryview(data)
                done = 0
                while done < len(view):
                    written = os.pwrite(fd, view[done:], offset + done)
                    if written <= 0:
                        raise OSError(errno.EIO, "short write to a whole file")
                    done += written
            if os.fstat(fd).st_size != size:
                raise OSError(errno.EIO, f"whole file of {os.fstat(fd).st_size} bytes, expected {size}")
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
