"""Pins as the engine keeps them: the table of pinned object versions and the disk tier's marks, in step.

``PinnedBlocks`` owns the ``PinTable`` (``tiering.policy.pins``: the per-object view, the byte
accounting, what the pin file saves) and the limit on its footprint (``--max-pinned``; 0 on a mount
without a disk tier, where there is nowhere to pin). Each change to the table is mirrored at once on
the disk tier's per-block marks, which its eviction skips: a pin that replaces another version of
the same key unpins the old version's blocks. A pin that would take the footprint above the limit is
refused with ``PinLimitError`` before anything changes. Blocks are counted as their footprint on the
disk tier (data plus block headers, ``object_footprint``), the unit ``--disk-cache`` counts in.

Used on the event loop only (the daemon's pin and unpin routes, the restore of the pin file at
start-up); the disk tier's marks are in-memory sets, so no call here does I/O.
"""

from __future__ import annotations

from typing import Iterable

from tiering.blocks import BlockKey, ObjectRef
from tiering.policy.pins import PinError, PinLimitError, PinTable, block_keys
from tiering.protocols import DiskBlockTier
from tiering.tiers.blockformat import object_footprint
from tiering.units import format_size


class PinnedBlocks:
    def __init__(self, disk: DiskBlockTier | None, *, block_size: int, limit_bytes: int) -> None:
        self.table = PinTable(lambda ref: object_footprint(ref.key, ref.etag, ref.size, block_size))
        self.limit_bytes = limit_bytes if disk is not None else 0
        self._disk = disk
        self._block_size = block_size

    def pin(self, refs: Iterable[ObjectRef], *, enforce_limit: bool = True) -> None:
        """Pin these object versions (replacing pins of other versions of the same keys).

        ``PinLimitError`` (and nothing changed) if that takes the pinned footprint above the limit;
        ``enforce_limit=False`` is for restoring pins saved under an older, larger limit.
        """
        refs = list(refs)
        if not refs:
            return
        disk = self._disk
        if disk is None:
            raise PinError("this mount has no disk tier to pin blocks in (--disk-cache 0)")
        if enforce_limit:
            before, after, limit = self.table.bytes, self.table.bytes_after(refs), self.limit_bytes
            if after > limit and after > before:
                if limit == 0:
                    raise PinLimitError("pinning is disabled on this mount (--max-pinned 0)")
                raise PinLimitError(
                    f"pin limit exceeded: pinning {format_size(after - before)} more would take pinned data to "
                    f"{format_size(after)}, above the limit of {format_size(limit)} (--max-pinned); "
                    f"{format_size(before)} is pinned now"
                )
        for old in self.table.add(refs):
            disk.unpin(block_keys(old, self._block_size))
        for ref in refs:
            disk.pin(block_keys(ref, self._block_size))

    def unpin(self, keys: Iterable[str]) -> list[ObjectRef]:
        """Unpin the objects with these keys; returns the refs that were pinned."""
        removed = self.table.remove(keys)
        if self._disk is not None:
            for ref in removed:
                self._disk.unpin(block_keys(ref, self._block_size))
        return removed

    def is_pinned(self, key: BlockKey) -> bool:
        return self._disk is not None and self._disk.is_pinned(key)

    def stats(self) -> dict[str, int]:
        return {
            "objects": len(self.table),
            "bytes": self.table.bytes,
            "cached_bytes": self._disk.pinned_bytes() if self._disk is not None else 0,
            "limit_bytes": self.limit_bytes,
        }
