"""Pinned objects: which object versions the disk tier must keep, and how many bytes that takes.

A pin names one version of one object (``ObjectRef``: key, ETag, size). Pinning is per object, not
per block, because that is what users ask for ("keep this dataset") and what survives a change of
block size; the block keys follow from the ref and the block size (``ObjectRef`` -> ``BlockKey`` s).
The disk tier holds the per-block view (a set of digests its eviction skips); this table holds the
per-object view, the byte accounting against the limit, and the persistent form.

One key has at most one pinned version: pinning a new version of a key replaces the old pin (whose
blocks could never be served for the new version anyway, see ``tiering.blocks``).

Bytes are counted as the blocks' footprint on the disk tier (data plus block headers), the unit the
tier's capacity is counted in, so the limit means the same thing as ``--disk-cache``. The table
counts what pinned blocks *will* take once cached, not what is cached now: a limit on intent is
stable, while one on current usage would let a pin pass today and overflow tomorrow.

Persistence: ``save_pin_file`` writes the table as JSON (temp file, fsync, rename, fsync of the
directory: pins are a user's decision and must not come back half-written), ``load_pin_file`` reads it
back. A file that cannot be read or parsed is reported with ``PinFileError``; the daemon logs it and
starts with no pins rather than refusing to mount (a lost pin costs a re-fetch, never data).
"""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path
from typing import Callable, Iterable, Iterator

from tiering.blocks import BlockKey, ObjectRef, block_count
from tiering.errors import CacheError
from tiering.private import open_private

PIN_FILE_VERSION = 1
# The pin file's name in a source's cache directory (next to blocks/, see cachefs.daemon.main).
PIN_FILENAME = "pins.json"

log = logging.getLogger(__name__)


class PinError(CacheError):
    """A pin request cannot be honoured (no disk tier, or over the limit)."""

    errno = errno.ENOSPC


class PinLimitError(PinError):
    """Pinning these objects would take pinned bytes above the configured limit."""


class PinFileError(Exception):
    """The pin file exists but cannot be read or parsed; one-line message."""


def block_keys(ref: ObjectRef, block_size: int) -> Iterator[BlockKey]:
    """Every block key of one object version."""
    for index in range(block_count(ref.size, block_size)):
        yield BlockKey(ref.key, ref.etag, index)


class PinTable:
    """Pinned object versions by key, with their total footprint. In memory; no I/O."""

    def __init__(self, footprint: Callable[[ObjectRef], int]) -> None:
        self._footprint = footprint
        self._objects: dict[str, tuple[ObjectRef, int]] = {}
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._objects)

    def __contains__(self, ref: object) -> bool:
        return isinstance(ref, ObjectRef) and self._objects.get(ref.key, (None, 0))[0] == ref

    @property
    def bytes(self) -> int:
        """Footprint on the disk tier of every pinned object, cached or not."""
        return self._bytes

    def refs(self) -> list[ObjectRef]:
        return [ref for ref, _ in self._objects.values()]

    def get(self, key: str) -> ObjectRef | None:
        entry = self._objects.get(key)
        return entry[0] if entry else None

    def footprint(self, ref: ObjectRef) -> int:
        return self._footprint(ref)

    def bytes_after(self, refs: Iterable[ObjectRef]) -> int:
        """Total pinned footprint if ``refs`` were added (replacing other versions of their keys)."""
        total = self._bytes
        seen: dict[str, ObjectRef] = {}
        for ref in refs:
            seen[ref.key] = ref
        for key, ref in seen.items():
            old = self._objects.get(key)
            if old is not None:
                total -= old[1]
            total += self._footprint(ref)
        return total

    def add(self, refs: Iterable[ObjectRef]) -> list[ObjectRef]:
        """Pin ``refs``; returns the pins they replaced (other versions of the same keys)."""
        replaced: list[ObjectRef] = []
        for ref in refs:
            old = self._objects.pop(ref.key, None)
            if old is not None:
                self._bytes -= old[1]
                if old[0] != ref:
                    replaced.append(old[0])
            size = self._footprint(ref)
            self._objects[ref.key] = (ref, size)
            self._bytes += size
        return replaced

    def remove(self, keys: Iterable[str]) -> list[ObjectRef]:
        """Unpin the objects with these keys; returns the refs that were pinned."""
        removed: list[ObjectRef] = []
        for key in keys:
            old = self._objects.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
                removed.append(old[0])
        return removed


def save_pin_file(path: Path, refs: Iterable[ObjectRef]) -> None:
    """Write the pin file atomically and durably (see the module docstring)."""
    doc = {
        "version": PIN_FILE_VERSION,
        "objects": [{"key": r.key, "etag": r.etag, "size": r.size} for r in sorted(refs, key=lambda r: r.key)],
    }
    data = json.dumps(doc, indent=1, sort_keys=True).encode("utf-8", "surrogateescape") + b"\n"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)  # never through a symlink (tiering.private)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_pin_file(path: Path) -> list[ObjectRef]:
    """The pins saved in ``path``; ``[]`` if there is no file, ``PinFileError`` if it is unusable."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise PinFileError(f"cannot read pin file {path}: {exc.strerror or exc}") from exc
    try:
        doc = json.loads(raw.decode("utf-8", "surrogateescape"))
        if not isinstance(doc, dict) or doc.get("version") != PIN_FILE_VERSION:
            raise ValueError(f"unsupported format (version {doc.get('version') if isinstance(doc, dict) else '?'})")
        refs = []
        for item in doc["objects"]:
            key, etag, size = item["key"], item["etag"], item["size"]
            if not (isinstance(key, str) and key and isinstance(etag, str) and isinstance(size, int) and size >= 0):
                raise ValueError(f"bad entry {item!r}")
            refs.append(ObjectRef(key, etag, size))
        return refs
    except (ValueError, KeyError, TypeError) as exc:
        raise PinFileError(f"pin file {path} is unusable: {exc}") from exc


def pinned_block_keys(path: Path, block_size: int) -> Iterator[BlockKey]:
    """Block keys of the pins saved in ``path``, for the disk tier's start-up scan.

    Lazy, so it runs where it is consumed (the thread that builds the disk tier). An unusable file
    is logged and yields nothing: the mount starts, and the pins are gone, not the data.
    """
    try:
        refs = load_pin_file(path)
    except PinFileError as exc:
        log.error("%s; starting without pins", exc)
        return
    for ref in refs:
        yield from block_keys(ref, block_size)
