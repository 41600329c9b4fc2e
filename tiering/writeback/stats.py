"""Counters of the write-back engine, shared by its collaborators (``WriteBack.stats_snapshot`` reports them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WriteBackStats:
    commits: int = 0
    uploads: int = 0
    bytes_uploaded: int = 0
    deletes: int = 0
    markers: int = 0
    failed_attempts: int = 0
    space_waits: int = 0
    enospc: int = 0
    copy_on_write_bytes: int = 0  # bytes copied into staging from the store, or between versions
    promoted_bytes: int = 0  # uploaded bytes also put into the disk tier as clean blocks
    replayed: int = 0
    quarantined: int = 0
    reverted: int = 0  # files whose writer left after acknowledging failed: back to their last acknowledged state

    def count_applied(self, *, deleted: bool, marker: bool, uploaded_bytes: int) -> None:
        """One operation reached the store: a delete, a directory marker, or an upload of this size."""
        if deleted:
            self.deletes += 1
        elif marker:
            self.markers += 1
        else:
            self.uploads += 1
            self.bytes_uploaded += uploaded_bytes
