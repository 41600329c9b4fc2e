"""The daemon's write-back feature: staging and uploads for a writable mount, and their control routes.

``install(ctx)`` (listed in ``cachefs.daemon.main.FEATURES``) builds, on a writable mount, the
``tiering.writeback.WriteBack`` engine over ``<per-source cache dir>/staging`` with the disk tier
as its space budget (staged bytes and cached blocks share ``--disk-cache``), and attaches it to the
filesystem. ``start()`` replays the journal before the kernel mount, so what an earlier mount left
(after a crash or ``unmount --force``) is visible and queued before the first request. Stopping
drains (``cachefs.daemon.stopping``): at a SIGTERM the mount keeps serving while everything pending
is flushed (``_drain_while_serving``); ``stop()`` runs after the session ended (that drain, or an
unmount by any route), acknowledges what open files held, flushes again within what is left of the
stop deadline, and leaves whatever is still not in the store journaled for the next mount, saying
which changes on stderr (the log).

Control routes (unix socket only: they act on the mount):

``POST /writeback/flush``   ``{"timeout_s": S}`` -> ``{"ok", "pending": [...], "unsynced": [...],
                            "elapsed_s"}``: waits until every acknowledged change is in the store, or
                            S seconds. Each pending entry names its path, stage and error; ``unsynced``
                            lists open files with writes not yet closed or fsync'd (not flushed).
``POST /writeback/status``  ``{"paths": ["a/b", ...]}`` (relative to the mount root) ->
                            ``{"paths": [...]}``: the durability stage of each (see ``path_status``).

On a read-only mount nothing is staged: flush answers ``ok`` at once, status says ``clean``. Staged
data an earlier writable mount left is not uploaded by a read-only one (it may have no write
permission); it is reported in the log and waits for the next writable mount.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from cachefs.daemon.control import ControlRequestError
from cachefs.daemon.context import DaemonContext
from cachefs.daemon.errors import SetupError
from cachefs.fs.errors import FsError
from cachefs.fs.filesystem import CacheFS
from cachefs.sourcedir import STAGING_DIRNAME
from tiering.tiers.cluster import ClusterTier
from tiering.errors import CacheError
from tiering.protocols import ObjectInfo
from tiering.writeback import MISSING, FlushReport, WriteBack
from tiering.writeback.durable import DurableJournal, conditional
from tiering.writeback.settings import DURABILITY_CLUSTER
from tiering.writeback.journal import RECORD_SUFFIX, RECORDS_DIR, StagingFormatError

log = logging.getLogger(__name__)

# The longest flush a control request may ask for; `cachefs flush` and `unmount` pass their own.
MAX_FLUSH_TIMEOUT_S = 24 * 3600.0
# Paths per status request.
MAX_STATUS_PATHS = 10_000
# Paths named in the line a stopping daemon leaves when changes stay journaled (the rest are counted).
MAX_NAMED_AT_STOP = 10


def install(ctx: DaemonContext) -> "WriteBackFeature":
    return WriteBackFeature(ctx)


class WriteBackFeature:
    def __init__(self, ctx: DaemonContext) -> None:
        self.ctx = ctx
        self.staging_dir = ctx.cache_dir / STAGING_DIRNAME
        self.writeback: WriteBack | None = None
        if not ctx.settings.fs.read_only:
            disk = ctx.cache.disk
            if disk is None:
                raise SetupError("a writable mount stages writes in the disk cache: give --disk-cache a size, "
                                 "or mount with --read-only")
            durable = self._durable_journal(ctx) if ctx.settings.writeback.durability == DURABILITY_CLUSTER else None
            try:
                self.writeback = WriteBack(
                    ctx.settings.writeback,
                    self.staging_dir,
                    ctx.store,
                    ctx.cache,
                    disk,
                    eager_fraction=ctx.settings.cache.high_watermark,
                    health=ctx.cache.health,
                    durable=durable,
                )
            except (OSError, StagingFormatError) as exc:
                raise SetupError(f"cannot use the staging area {self.staging_dir}: {exc}") from exc
            ctx.fs.attach_writeback(self.writeback)
        ctx.control.add_json_route("POST", "/writeback/flush", self._flush)
        ctx.control.add_json_route("POST", "/writeback/status", self._status)

    def _durable_journal(self, ctx: DaemonContext) -> DurableJournal:
        """--write-durability cluster: the journal's copy in the cluster tier's store."""
        tier = ctx.cache.cluster
        store = conditional(tier.store) if isinstance(tier, ClusterTier) else None
        if store is None:
            raise SetupError("--write-durability cluster needs an S3 cluster tier (--cluster-cache s3://BUCKET[/PREFIX])")
        assert isinstance(tier, ClusterTier)
        return DurableJournal(store, key=tier.key, volume=ctx.cache_dir.name, node=ctx.settings.node_id, source=ctx.settings.source,
                              data_dir=self.staging_dir / "data", staging_root=self.staging_dir,
                              lease_ttl_s=ctx.settings.writeback.lease_ttl_s)

    async def start(self) -> None:
        if self.writeback is not None:
            try:
                await self.writeback.start()
            except CacheError as exc:  # the cluster store's errors; DurabilityError
                if self.writeback.records.durable is None:
                    raise
                raise SetupError(f"--write-durability cluster: the write-back journal in the cluster store is not "
                                 f"usable: {exc}") from exc
            self.ctx.stopping.on_drain(self._drain_while_serving)
            return
        records = self.staging_dir / RECORDS_DIR
        if records.is_dir():
            left = sum(1 for p in records.iterdir() if p.name.endswith(RECORD_SUFFIX))
            if left:
                log.warning("write-back: %d staged operations from an earlier writable mount wait in %s; a read-only "
                            "mount does not upload them (mount writable to do so)", left, self.staging_dir)

    async def stop(self) -> None:
        wb = self.writeback
        if wb is None:
            return
        stopping = self.ctx.stopping
        started = time.monotonic()
        await wb.acknowledge_open()
        # Only a mount that served drains: one that failed to mount reports that at once (what the
        # journal replayed stays journaled, as before).
        report = await self._upload_pending() if stopping.begun else None
        await wb.stop()
        if not wb.has_pending():
            if report is not None and report.elapsed_s > 0:
                log.info("write-back: everything acknowledged reached the object store before exiting (%.1f s)",
                         time.monotonic() - started)
            return
        pending = wb.pending()
        names = ", ".join(_describe(entry)["path"] or "/" for entry in pending[:MAX_NAMED_AT_STOP])
        more = f" and {len(pending) - MAX_NAMED_AT_STOP} more" if len(pending) > MAX_NAMED_AT_STOP else ""
        if not stopping.begun:
            why = "the mount did not start"
        elif stopping.abandoned.is_set():
            why = "the stop was forced (a second signal, or cachefs unmount --force)"
        elif wb.uploader.store_failures:
            why = f"the object store is unreachable ({wb.uploader.store_error})"
        else:
            why = f"--stop-timeout ({stopping.timeout_s:g} s) passed"
        log.warning("write-back: exiting with %d changes not in the object store (%s): %s%s; they stay journaled "
                    "in %s and the next mount of %s uploads them", len(pending), why, names, more, self.staging_dir,
                    self.ctx.settings.source)

    async def _drain_while_serving(self) -> None:
        """At the first SIGTERM/SIGINT: upload what is pending while the mount still answers."""
        report = await self._upload_pending()
        if report is not None and report.ok:
            log.info("write-back: everything acknowledged is in the object store (%.1f s); unmounting",
                     report.elapsed_s)

    async def _upload_pending(self) -> FlushReport | None:
        """Flush within what is left of the stop deadline; None if it ran out or the stop was forced."""
        wb = self.writeback
        assert wb is not None
        if not wb.has_pending():
            return FlushReport(ok=True, pending=[], elapsed_s=0.0)
        stopping = self.ctx.stopping
        remaining = stopping.remaining()
        if remaining <= 0:
            return None
        log.info("write-back: uploading %d pending changes before exiting (at most %.0f s)",
                 wb.index.journaled(), remaining)
        return await stopping.bounded(wb.flush(remaining))

    # -- routes ------------------------------------------------------------------------------------

    async def _flush(self, params: dict[str, Any]) -> dict[str, Any]:
        try:
            timeout_s = float(params.get("timeout_s", 60))
        except (TypeError, ValueError):
            raise ControlRequestError(400, "timeout_s must be a number of seconds") from None
        if not 0 <= timeout_s <= MAX_FLUSH_TIMEOUT_S:
            raise ControlRequestError(400, f"timeout_s must be between 0 and {MAX_FLUSH_TIMEOUT_S:g}")
        if self.writeback is None:
            return {"ok": True, "pending": [], "elapsed_s": 0.0, "read_only": True}
        report = await self.writeback.flush(timeout_s)
        return {
            "ok": report.ok,
            "pending": [_describe(entry) for entry in report.pending],
            "unsynced": [_describe(entry) for entry in report.unsynced],
            "elapsed_s": round(report.elapsed_s, 3),
        }

    async def _status(self, params: dict[str, Any]) -> dict[str, Any]:
        paths = params.get("paths")
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise ControlRequestError(400, "paths must be a list of paths relative to the mount root")
        if len(paths) > MAX_STATUS_PATHS:
            raise ControlRequestError(400, f"at most {MAX_STATUS_PATHS} paths per request")
        out = []
        for path in paths:
            try:
                status = await path_status(self.ctx.fs, path)
            except (FsError, CacheError, OSError) as exc:
                status = {"path": path.strip("/"), "stage": "unknown", "error": str(exc) or type(exc).__name__}
            if "pending" in status:
                status["pending"] = [_describe(entry) for entry in status["pending"]]
            out.append(status)
        return {"paths": out, "write_through": self.ctx.settings.writeback.write_through,
                "read_only": self.writeback is None}


async def path_status(fs: CacheFS, path: str) -> dict[str, Any]:
    """``cachefs status``: the durability stage of one path (a directory: of what is pending below it)."""
    path = path.strip("/")
    value = await fs.listings.resolve_path(path)
    out: dict[str, Any] = {"path": path}
    wb = fs.writeback
    if value is MISSING:
        pending = wb.status(path) if wb is not None else None
        out.update(pending or {"stage": "missing"})
        out["path"] = path
        return out
    if value is None:
        below = wb.pending(path + "/" if path else "") if wb is not None else []
        own = wb.status(path + "/") if wb is not None and path else None
        out.update({"kind": "directory", "stage": "dirty" if below or own else "clean",
                    "pending": below + ([own] if own else [])})
        return out
    status = wb.status(path) if wb is not None else None
    if status is None:
        assert isinstance(value, ObjectInfo)  # neither MISSING nor None (a directory): a file
        out.update({"kind": "file", "stage": "clean", "size": value.size, "etag": value.etag, "durable_in": "source"})
    else:
        out.update(status)
        out["path"] = path
    return out


def _describe(entry: dict[str, Any]) -> dict[str, Any]:
    """A pending entry for the CLI: its key turned into a path (a directory marker ``a/`` is ``a``)."""
    out = dict(entry)
    key = str(out.pop("key", out.get("path", "")))
    out["path"] = key[:-1] if key.endswith("/") else key
    return out
