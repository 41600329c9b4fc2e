"""Which open files the kernel may read by itself: whole files on the disk tier (FUSE passthrough).

The FUSE adapter asks ``CacheFS.backing_file(fh)`` when it answers an OPEN on a connection that
agreed to passthrough; a path means "the kernel may read this plain file for this handle, the
daemon need not see its READs". Only a handle that reads one fixed store version qualifies: opened
only for reading, no staged (written, not yet uploaded) data on the file, no writer, not being
removed, and every block of that version on the disk tier. The plain file is the version's whole
file (``tiering.tiers.wholefile``): assembled here, from blocks checked on the way, the first time
such an open finds the blocks all on disk.

When: a version of at most ``WHOLE_AT_OPEN_MAX_BYTES`` is assembled before the open is answered (a
worker thread), so the first such open already passes through; a larger one is assembled in the
background (at most ``BACKGROUND_ASSEMBLIES`` at once) while this open is served by the daemon as
before, and the opens after it pass through.

A whole file stays registered with the kernel between opens (``cachefs.fuse.adapter.Passthrough``
keeps its backing id), so the store tells ``watch`` of every whole file it removes: that id is then
closed, and the space is freed rather than held by an unlinked file the kernel still has open.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from pathlib import Path
from typing import Callable, Protocol

from tiering.blocks import ObjectRef, block_count

log = logging.getLogger(__name__)

# Assembled before the open is answered up to this size: one default block (8 MiB), so the wait is
# one checked block read and one write of the same bytes, about what serving the open's first reads
# would cost the daemon anyway; a bigger file would hold its open for a copy of the whole file.
WHOLE_AT_OPEN_MAX_BYTES = 8 * 1024 * 1024
# Larger versions are copied in the background, two at once at most: each is a sequential read and
# write of the whole file, which two cores keep busy without starving the reads being served.
BACKGROUND_ASSEMBLIES = 2


class WholeFileStore(Protocol):
    """Where whole files live (the disk tier, ``tiering.tiers.disk.DiskTier``)."""

    def whole_file(self, ref: ObjectRef) -> str | None: ...

    def whole_name(self, ref: ObjectRef) -> Path: ...

    def assemble_whole(self, ref: ObjectRef, block_size: int) -> Path | None: ...

    def discard_whole(self, ref: ObjectRef) -> None: ...

    def whole_snapshot(self) -> dict[str, int]: ...

    def on_whole_dropped(self, callback: Callable[[Path], None]) -> None: ...


class WholeFiles:
    """The whole file of a version, assembled when its blocks are all on the disk tier."""

    def __init__(self, store: WholeFileStore, block_size: int, cached_blocks: Callable[[ObjectRef], int]) -> None:
        self.store = store
        self.block_size = block_size
        self._cached_blocks = cached_blocks  # ref -> how many of its blocks are on the disk tier
        self._background: dict[ObjectRef, asyncio.Task[Path | None]] = {}

    async def for_version(self, ref: ObjectRef, *, assemble: bool = True) -> str | None:
        """The whole file of ``ref`` (assembled now if small), or None: not all of it is on disk,
        it is being assembled in the background, or it could not be written. ``assemble=False``:
        only the name it has, held or not (the kernel may hold it open after its eviction)."""
        if not assemble:
            return str(self.store.whole_name(ref))
        held = self.store.whole_file(ref)
        if held is not None:
            return held
        if self._cached_blocks(ref) < block_count(ref.size, self.block_size):
            return None
        if ref.size <= WHOLE_AT_OPEN_MAX_BYTES:
            path = await asyncio.to_thread(self.store.assemble_whole, ref, self.block_size)
            return str(path) if path is not None else None
        if ref not in self._background and len(self._background) < BACKGROUND_ASSEMBLIES:
            task = asyncio.get_running_loop().create_task(
                asyncio.to_thread(self.store.assemble_whole, ref, self.block_size))
            self._background[ref] = task
            task.add_done_callback(functools.partial(self._assembled, ref))
        return None

    def _assembled(self, ref: ObjectRef, _task: asyncio.Task[Path | None]) -> None:
        self._background.pop(ref, None)

    def discard(self, ref: ObjectRef) -> None:
        self.store.discard_whole(ref)

    def watch(self, callback: Callable[[str], None]) -> None:
        """Have ``callback(path)`` called after each whole file the store removes, from the thread that
        removed it (``DiskTier.on_whole_dropped``): the FUSE layer closes the backing id it keeps for it."""
        self.store.on_whole_dropped(lambda path: callback(str(path)))

    async def close(self) -> None:
        """Wait for the background assemblies (each ends by itself: a bounded copy)."""
        if self._background:
            await asyncio.wait(list(self._background.values()))
