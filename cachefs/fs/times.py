"""utimens on a writable mount: the mtime a writer sets is kept in the object's ``mtime`` metadata.

rclone's convention (``tiering.objectstore.mtimes``), so the time survives a remount and a cache wipe
and other tools read it (docs/semantics.md, "Times"):

- a file with staged changes (being written, or acknowledged and not yet uploaded) carries it with
  its next upload: write-back journals it like a write (``WriteBack.set_mtime``);
- a file only in the store gets it by a server-side copy onto itself with the new metadata, as
  rclone's and s3fs-fuse's ``touch`` do: no bytes move, and it is in the store when utimens returns.
  The key's own uploads are held off meanwhile (``WriteBack.quiesce``), the copy is guarded by the
  version's ETag, and the new version is this writer's base for a recovery (``note_base``).
"""

from __future__ import annotations

import dataclasses

from cachefs.fs.inodes import Node
from cachefs.fs.listings import ListingCache
from tiering.blocks import ObjectRef
from tiering.objectstore.mtimes import mtime_metadata
from tiering.writeback import STAGED_ETAG, WriteBack
from tiering.writeback.staged import StagedFile

# Two mtimes this close are the same one: the kernel's nanoseconds and our float seconds differ by a
# fraction of a microsecond, which is also what the metadata keeps (``tiering.objectstore.mtimes``).
SAME_MTIME_S = 1e-6


async def set_mtime(wb: WriteBack, listings: ListingCache, node: Node, staged: StagedFile | None,
                    mtime: float) -> None:
    """Set the mtime of file ``node`` (``staged``: its staged file, if any) to ``mtime``."""
    key = node.path
    shown = staged.mtime if staged is not None else node.info.mtime if node.info is not None else None
    if shown is not None and abs(shown - mtime) < SAME_MTIME_S:
        return  # already so (``touch -a``, ``cp -p`` onto an equal file, a second ``touch -d``): no request
    if staged is not None and staged.current is not None:
        entry = wb.index.get(key)
        if staged.unacked or (entry is not None and entry.sf is staged):
            await wb.set_mtime(staged, mtime)  # goes with the bytes not yet uploaded
            return
    ref = (staged.clean_ref or staged.base) if staged is not None else None
    etag = ref.etag if ref is not None else node.info.etag if node.info is not None else STAGED_ETAG
    if etag == STAGED_ETAG:
        return  # nothing in the store yet (a creation not acknowledged): its first upload carries it
    async with wb.quiesce(key):
        copied = await wb.store.copy(key, etag, key, metadata=mtime_metadata(mtime))
    wb.records.note_base(key, copied.etag)
    if staged is not None:  # the same bytes under the copy's ETag (a new one if the object had parts)
        staged.mtime = mtime
        if staged.base is not None:
            staged.base = ObjectRef(key, copied.etag, staged.base.size)
        if staged.clean_ref is not None:
            staged.clean_ref = ObjectRef(key, copied.etag, staged.clean_ref.size)
    listings.applied(key, dataclasses.replace(copied, mtime=mtime))  # the view, the node and the index
