"""What ``cachefs status``, ``cachefs flush`` and ``/stats`` show of write-back: the durability stage of
one pending operation, and the engine's counters as one document. Read-only views of the
collaborators' state; nothing here changes it."""

from __future__ import annotations

from typing import Any, Iterable

from tiering.writeback.journal import DELETE, PUT
from tiering.writeback.pending import Entry, PendingIndex
from tiering.writeback.space import StagingSpace
from tiering.writeback.staged import StagedFile
from tiering.writeback.stats import WriteBackStats
from tiering.writeback.uploader import Uploader

WRITING, DIRTY, UPLOADING, DELETING = "writing", "dirty", "uploading", "deleting"
# ``store_state``: whether uploads reach the object store now (every state, for the metrics gauge).
STORE_OK, STORE_UNREACHABLE = "ok", "unreachable"
STORE_STATES = (STORE_OK, STORE_UNREACHABLE)


def entry_status(entry: Entry, uploader: Uploader, *, wall_now: float, now: float,
                 durable_in: str = "local") -> dict[str, Any]:
    """The durability stage of one pending operation, with its attempts, error and next attempt."""
    if entry.in_flight:
        stage = DELETING if entry.op == DELETE else UPLOADING
    elif entry.op == DELETE:
        stage = DELETING
    elif entry.seq is None:
        stage = WRITING
    else:
        stage = DIRTY
    out: dict[str, Any] = {
        "key": entry.key,
        "stage": stage,
        "kind": "directory" if entry.is_marker else "file",
        "op": entry.op,
        "dirty_for_s": round(max(0.0, wall_now - entry.since), 3),
        "attempts": entry.attempts,
        "last_error": entry.last_error,
    }
    if entry.last_error is None and uploader.store_failures and entry.seq is not None:
        out["last_error"] = f"waiting: the object store is unreachable ({uploader.store_error})"
    if entry.seq is not None:  # acknowledged: where it is durable (local disk; also the cluster store)
        out["durable_in"] = durable_in
    if entry.sf is not None:
        out["size"] = entry.sf.size
        out["unsynced"] = entry.sf.unacked
    if entry.seq is not None and not entry.in_flight:
        out["next_attempt_in_s"] = round(max(0.0, uploader.due(entry) - now), 3)
    if entry.seq is not None and entry.acked_at is not None:
        # How stale the store is for this key: the oldest acknowledged version it does not have yet.
        out["unuploaded_for_s"] = round(max(0.0, now - entry.acked_at), 3)
    return out


def stats_document(s: WriteBackStats, entries: list[Entry], files: Iterable[StagedFile], space: StagingSpace,
                   uploader: Uploader, *, wall_now: float, now: float, write_through: bool,
                   durable: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``writeback`` section of ``/stats``."""
    staged = [e for e in entries if e.op == PUT and e.sf is not None]
    oldest = min((e.since for e in entries), default=None)
    oldest_acked = min((e.acked_at for e in entries if e.seq is not None and e.acked_at is not None), default=None)
    last_error = next((e.last_error for e in sorted(entries, key=lambda e: -e.attempts) if e.last_error), None)
    return {
        "dirty_bytes": sum(e.sf.size for e in staged if e.sf is not None),
        "dirty_files": len(staged),
        "pending_deletes": sum(1 for e in entries if e.op == DELETE),
        "pending_directories": sum(1 for e in entries if e.is_marker and e.op == PUT),
        "pending_operations": len(entries),
        "unsynced_files": sum(1 for sf in files if sf.unacked),
        "staged_bytes": space.reserved,
        "staging_limit_bytes": space.budget.capacity_bytes,  # shared with the disk cache
        "uploads_in_flight": len(uploader.running),
        "failed_attempts": s.failed_attempts,
        "files_uploaded": s.uploads,
        "bytes_uploaded": s.bytes_uploaded,
        "deletes_done": s.deletes,
        "directory_markers_done": s.markers,
        "commits": s.commits,
        "copy_on_write_bytes": s.copy_on_write_bytes,
        "cached_after_upload_bytes": s.promoted_bytes,
        "space_waits": s.space_waits,
        "space_waiters": space.waiters,
        "enospc_errors": s.enospc,
        "oldest_dirty_age_s": round(max(0.0, wall_now - oldest), 3) if oldest is not None else 0.0,
        # The oldest acknowledged version not yet in the store (bounded by --upload-max-delay while the store answers).
        "oldest_unuploaded_age_s": round(max(0.0, now - oldest_acked), 3) if oldest_acked is not None else 0.0,
        "store_state": STORE_UNREACHABLE if uploader.store_failures else STORE_OK,
        "store_error": uploader.store_error,
        "last_error": last_error,
        "replayed": s.replayed,
        "quarantined": s.quarantined,
        "reverted_files": s.reverted,
        "write_through": write_through,
        "durability": "cluster" if durable is not None else "local",
        **({"cluster_journal": durable} if durable is not None else {}),
    }


def backlog_text(index: PendingIndex, uploader: Uploader) -> str:
    """For the ENOSPC message: what is waiting for the store."""
    down = ", the store is unreachable" if uploader.store_failures else ""
    return f"{index.journaled()} operations pending{down}"
