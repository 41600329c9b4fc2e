"""Where the disk tier's blocks lie: a file each, or a record of a pack file.

``tiering.tiers.disk`` decides which blocks the tier holds (its index, capacity, recency, pins);
this object owns where each one's bytes are and the I/O that reaches them: ``BlockFiles`` for a
block that is a file of its own (every block of ``ALIGNED_MIN_BYTES`` and more, written and read
with ``O_DIRECT``; small blocks too where packs are off, and those an earlier version wrote),
``PackFiles`` for a small block packed with others (``tiering.tiers.packs`` says why), and the map
from a block's digest to its record. It holds no lock of the tier: the tier calls it for a digest
it has marked busy or looked up under its lock, and every system call here runs outside that lock.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from pathlib import Path

from tiering.blocks import BlockData
from tiering.tiers.blockfile import BlockFiles
from tiering.tiers.blockformat import ALIGNED_MIN_BYTES
from tiering.tiers.diskdir import BLOCK_SUFFIX, TMP_PREFIX, TMP_SUFFIX, scan_blocks
from tiering.tiers.packs import PACKS_DIRNAME, PackFiles, PackSlot
from tiering.tiers.wholefile import WHOLE_PREFIX, whole_path

log = logging.getLogger("tiering.tiers.disk")

# A block's record: where it is and its size (header and data), as the index counts it.
Record = tuple[PackSlot, int]


class BlockPlaces:
    """The files and pack records of one disk tier's blocks (module docstring)."""

    def __init__(self, directory: Path, blocks_dir: Path, whole_dir: Path, name: str, *, pack_small: bool) -> None:
        self.name = name
        self.files = BlockFiles(name)  # the file I/O of one block (O_DIRECT for large ones)
        self.packs = PackFiles(directory / PACKS_DIRNAME, name) if pack_small else None
        self._blocks_dir = blocks_dir
        self._blocks_str = str(blocks_dir)
        self._whole_dir = whole_dir
        self._whole_str = str(whole_dir)
        # digest -> its record, for blocks held in a pack. Kept until the record is freed (``remove``),
        # past the removal of the tier's index entry. Plain dict operations: atomic under the GIL.
        self._records: dict[str, Record] = {}
        self._tmp_seq = itertools.count()

    def record(self, digest: str) -> Record | None:
        return self._records.get(digest)

    def path(self, digest: str) -> Path:
        """The file of a block (or of a whole file, ``w`` + digest) that is not a pack record."""
        if digest.startswith(WHOLE_PREFIX):
            return whole_path(self._whole_dir, digest[len(WHOLE_PREFIX):])
        return self._blocks_dir / digest[:2] / f"{digest}{BLOCK_SUFFIX}"

    def hit_path(self, digest: str) -> str:
        """``path`` as a string, made without pathlib: the path of every disk-tier hit (pathlib cost
        a hit of a 100 KiB file 10-30 us of its 55-67)."""
        if digest.startswith(WHOLE_PREFIX):  # as whole_path: <whole>/<d[:2]>/<d>
            d = digest[len(WHOLE_PREFIX):]
            return f"{self._whole_str}/{d[:2]}/{d}"
        return f"{self._blocks_str}/{digest[:2]}/{digest}{BLOCK_SUFFIX}"

    def temp_path(self, digest: str) -> Path:
        """A new temp name beside the file of ``digest`` (removed by the start-up scan if left)."""
        return self.path(digest).with_name(f"{TMP_PREFIX}{digest}.{os.getpid()}.{next(self._tmp_seq)}{TMP_SUFFIX}")

    def where(self, digest: str, record: Record | None) -> str:
        """Where a block is, for a log line."""
        if record is None or self.packs is None:
            return self.hit_path(digest)
        return f"{self.packs.path(record[0].pack)}@{record[0].offset}"

    def read(self, digest: str, record: Record | None, token: bytes, size: int, *, reply: bool) -> BlockData:
        """The block checked for ``token``: into a pool buffer, or with ``reply`` into this thread's
        reply buffer. Raises ``CorruptBlockError`` or ``OSError`` (``FileNotFoundError``: gone)."""
        if record is not None:
            assert self.packs is not None
            return (self.packs.read_for_reply if reply else self.packs.read)(record[0], token, size)
        path = self.hit_path(digest)
        return (self.files.read_for_reply if reply else self.files.read)(path, token, size)

    def write(self, digest: str, header: bytes, data: BlockData) -> bool:
        """Write a block (busy in the tier): a pack record if it is small and packs are on, else a new
        file renamed over its name. True if it went to a pack. Raises ``OSError``, leaving nothing."""
        if self.packs is not None and len(data) < ALIGNED_MIN_BYTES:
            slot = self.packs.append(header, data)
            self._records[digest] = (slot, len(header) + len(data))
            return True
        tmp = self.temp_path(digest)
        try:
            self.files.write(tmp, self.path(digest), header, data)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return False

    def take(self, digest: str) -> Record | None:
        """Forget the record of ``digest`` (the tier replaces or removes the block) and return it."""
        return self._records.pop(digest, None)

    def keep(self, digest: str, record: Record) -> None:
        self._records[digest] = record

    def remove(self, digest: str, record: Record | None) -> None:
        """Remove a copy of a block the tier no longer indexes: its record, or its file (gone
        already is fine). Raises ``OSError`` when the disk fails."""
        if record is not None:
            assert self.packs is not None
            self.packs.free(*record)
            return
        try:
            os.unlink(self.path(digest))
        except FileNotFoundError:
            pass

    def stamp(self, digest: str, stamp_ns: int) -> None:
        """Recency for the next start-up, on a block file only (a record has none: packs docstring).
        Losing one stamp is harmless, so no error accounting."""
        try:
            os.utime(self.hit_path(digest), ns=(stamp_ns, stamp_ns))
        except OSError as exc:
            log.debug("%s tier: cannot stamp %s: %s", self.name, digest, exc)

    def scan(self) -> tuple[list[tuple[int, int, str, int, Record | None]], int]:
        """Every block found at start-up, files and records, in one recency order: by mtime (a
        record's is when its pack was started), then by the order records were written; and how many
        leftover temp files were removed. Records are remembered here."""
        files, removed_tmp = scan_blocks(self._blocks_dir, self.name)
        found: list[tuple[int, int, str, int, Record | None]] = [
            (mtime_ns, 0, digest, size, None) for mtime_ns, digest, size in files]
        if self.packs is not None:
            found += [(started_ns, order, rec.digest, rec.size, (rec.slot, rec.size))
                      for started_ns, order, rec in self.packs.scan()]
        found.sort(key=lambda item: item[:3])
        return found, removed_tmp
