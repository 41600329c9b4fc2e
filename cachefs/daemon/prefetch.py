"""Prefetch jobs, pins, snapshots and evict: the daemon side of the cache-management commands.

Prefetch runs inside the daemon
-------------------------------
``cachefs prefetch`` does not read files through FUSE: that would fill the kernel's page cache and
the RAM tier with data the training job may not read for hours, and each 128 KiB-1 MiB kernel
request would cost a round trip through the daemon. Instead the CLI posts a request to the control
socket and the daemon warms the blocks itself with ``BlockCache.warm_block``: parallel ranged GETs
straight into the disk tier, through the same single-flight table and fetch slots as reads, so a
prefetch and a reader never fetch the same block twice and memory in flight stays bounded.

A job is asynchronous: ``POST /prefetch`` answers at once with a job document holding an ``id``;
``GET /prefetch/<id>`` returns its progress (the CLI polls it to draw its progress bar), and
``DELETE /prefetch/<id>`` cancels it. A job goes ``resolving`` (listing the store to find the files)
-> ``running`` -> ``done``, or ends ``rejected`` (a bad request: a missing path, a directory without
``--recursive``, a dataset that cannot fit, the pin limit; nothing was fetched), ``failed`` (the
store could not be listed, the disk tier went down) or ``cancelled``. ``done`` says nothing about
success by itself: the document lists the files that failed, changed or are not cached, and
``ok`` is true only when every requested byte is on the disk tier.

Leases: a job started with ``lease_s`` (the CLI sends ``DEFAULT_LEASE_S``) is cancelled when nobody
has polled it for that long, so a CLI killed with SIGKILL or a dropped ssh session does not leave a
job fetching a dataset nobody waits for. Cancelling stops dispatching blocks; loads already in
flight complete and land on disk (they may have readers), so a second run skips them: resume is
just "run it again", because blocks already on disk are skipped with an index lookup.

Fitting: before fetching anything, the job checks that the files' footprint on the disk tier, plus
what other pinned objects and staged write-back data take, fits under the tier's low watermark (the
level eviction frees down to). A dataset that does not fit would evict its own first blocks to make
room for its last ones: the job is rejected with the sizes instead. Blocks the job skips are
refreshed in the tier's LRU order, and new ones land as most recent, so the job's own inserts evict
older data, never the dataset. At the end every file is checked again (index lookups): a file whose
blocks were evicted meanwhile by concurrent reads is reported, not counted as cached.

The cluster tier
----------------
``tier: "cluster"`` (``cachefs prefetch --tier cluster``) warms the shared cluster tier instead
(``BlockCache.warm_cluster_block``): one HEAD per block finds those already there, the others are
fetched from the source and uploaded at once, with no RAM or disk use on this node, so one node warms
a dataset for the whole cluster. There is no fitting (the cluster store has no capacity the daemon
knows) and no pinning (``cachefs cluster gc`` or a lifecycle rule bounds the tier). ``--check`` with
it counts the blocks the cluster store holds (one HEAD each). A file is cached when every block was
found or uploaded.

Pins
----
``--pin`` pins the files' current versions before fetching (``BlockCache.pin``: the pin limit is
checked first, and a rejected job changes nothing). A pin is a declaration: it stays if the job is
cancelled, so a rerun completes it. Pins live in ``pins.json`` in the source's cache directory
(``tiering.policy.pins``), rewritten atomically on every change and restored at start-up (the daemon hands
them to the disk tier before its start-up scan, so a restart never evicts pinned blocks). A pin
restored above a since-lowered limit is kept, with a warning: pins are only dropped by ``unpin``.

Snapshot, unpin, evict
----------------------
``POST /snapshot`` lists the files under a path (path, ETag, size; sorted); the CLI writes the
manifest. ``POST /unpin`` unpins files by path prefix (all without paths). ``POST /evict`` drops the
cached blocks of files (all without paths) from RAM and/or disk, keeping pinned blocks on disk; the
kernel's page cache of files already read through the mount is not touched.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from aiohttp import web

from cachefs.daemon.context import DaemonContext
from cachefs.daemon.control import ControlRequestError, ControlServer
from cachefs.daemon.resolver import Resolver
from cachefs.fs.passthrough import WholeFiles
from cachefs.manifest import MAX_SIZE, PREFETCH_TIERS, ManifestEntry, same_etag, size_problem
from cachefs.paths import PathError, check_path
from tiering.blocks import BlockKey, ObjectRef, block_count, block_range
from tiering.clock import Clock, SystemClock
from tiering.engine.blockcache import BlockCache
from tiering.engine.loads import WarmOutcome
from tiering.errors import CacheError, ObjectChangedError, ObjectNotFoundError, ObjectStoreError
from tiering.health import TierState
from tiering.policy.pins import PIN_FILENAME, PinError, PinFileError, load_pin_file, save_pin_file
from tiering.protocols import ObjectInfo, ObjectStore
from tiering.units import format_size

log = logging.getLogger(__name__)

# A job nobody polled for this long is cancelled. The CLI polls every fraction of a second; 30 s
# rides out a suspended terminal or a slow control socket, and bounds what a dead CLI costs.
DEFAULT_LEASE_S = 30.0
MAX_LEASE_S = 24 * 3600.0
# How often a job's lease is checked (at most; shorter leases are checked 4 times per lease).
LEASE_CHECK_S = 1.0
# Jobs running at once. They share the fetch slots, so more would not fetch faster; the bound
# keeps a looping script from piling up jobs that each hold a resolved file list in memory.
MAX_ACTIVE_JOBS = 8
# Finished jobs kept for polling (the CLI reads the final document once, right after the end).
FINISHED_JOBS_KEPT = 32
# Paths listed per category (failures, changed, not cached) in a job document; counts are exact.
MAX_LISTED = 200
# Names quoted in a one-line rejection before "and N more".
NAMES_IN_ERROR = 5
# Largest --parallel: the engine's own limit on fetch slots.
MAX_PARALLEL = 1024
# How long DELETE waits for a cancelled job to settle before answering.
CANCEL_WAIT_S = 5.0


class JobState(enum.StrEnum):
    RESOLVING = "resolving"
    RUNNING = "running"
    DONE = "done"
    REJECTED = "rejected"
    FAILED = "failed"
    CANCELLED = "cancelled"


FINISHED_STATES = frozenset({JobState.DONE, JobState.REJECTED, JobState.FAILED, JobState.CANCELLED})


class _Rejected(Exception):
    """The request cannot be carried out as asked; nothing was fetched. One line."""


def _names(items: list[str]) -> str:
    shown = ", ".join(items[:NAMES_IN_ERROR])
    more = len(items) - NAMES_IN_ERROR
    return shown + (f" (and {more} more)" if more > 0 else "")


def _bad(message: str) -> ControlRequestError:
    return ControlRequestError(400, message)


def _str_list(params: dict[str, Any], name: str) -> list[str]:
    value = params.get(name) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _bad(f"{name!r} must be a list of strings")
    try:
        return [check_path(v) for v in value]
    except PathError as exc:
        raise _bad(str(exc)) from None


@dataclass(frozen=True)
class PrefetchRequest:
    paths: tuple[str, ...] = ()
    manifest: tuple[ManifestEntry, ...] = ()
    manifest_name: str = "manifest"
    recursive: bool = False
    parallel: int | None = None
    check: bool = False
    pin: bool = False
    lease_s: float | None = None
    tier: str = "disk"  # "disk" (this node's disk tier) or "cluster" (the shared cluster tier)

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> "PrefetchRequest":
        """Validate a request body; ``ControlRequestError(400)`` naming the first problem."""
        paths = _str_list(params, "paths")
        raw_manifest = params.get("manifest") or []
        if not isinstance(raw_manifest, list):
            raise _bad("'manifest' must be a list of {path, line, etag, size} objects")
        name = params.get("manifest_name") or "manifest"
        if not isinstance(name, str):
            raise _bad("'manifest_name' must be a string")
        manifest: list[ManifestEntry] = []
        for number, item in enumerate(raw_manifest, start=1):
            if not isinstance(item, dict):
                raise _bad(f"manifest entry {number} must be an object")
            line = item.get("line", number)
            where = f"manifest {name} line {line}"
            path, etag, size = item.get("path"), item.get("etag"), item.get("size")
            if size_problem(line) is not None or not isinstance(path, str):
                raise _bad(f"manifest {name} entry {number}: needs a string 'path' and an integer 'line' "
                           f"from 0 to {MAX_SIZE}")
            if etag is not None and not isinstance(etag, str):
                raise _bad(f"{where}: 'etag' must be a string")
            if size is not None and (problem := size_problem(size)) is not None:
                raise _bad(f"{where}: {problem}")
            try:
                path = check_path(path)
            except PathError as exc:
                raise _bad(f"{where}: {exc}") from None
            manifest.append(ManifestEntry(path, line, etag, size))
        for flag in ("recursive", "check", "pin"):
            if not isinstance(params.get(flag, False), bool):
                raise _bad(f"{flag!r} must be true or false")
        parallel = params.get("parallel")
        if parallel is not None and (isinstance(parallel, bool) or not isinstance(parallel, int)
                                     or not 1 <= parallel <= MAX_PARALLEL):
            raise _bad(f"'parallel' must be an integer from 1 to {MAX_PARALLEL}")
        lease = params.get("lease_s")
        if lease is not None and (isinstance(lease, bool) or not isinstance(lease, (int, float))
                                  or not 0 < lease <= MAX_LEASE_S):
            raise _bad(f"'lease_s' must be a number of seconds from 0 to {MAX_LEASE_S:g}")
        if not paths and not manifest:
            raise _bad("nothing to prefetch: no paths and no manifest entries")
        if params.get("check") and params.get("pin"):
            raise _bad("--check and --pin do not go together: --check changes nothing")
        tier = params.get("tier", "disk")
        if tier not in PREFETCH_TIERS:
            raise _bad(f"'tier' must be one of {', '.join(PREFETCH_TIERS)}")
        if tier == "cluster" and params.get("pin"):
            raise _bad("--pin applies to the disk tier only: the cluster tier has no pins")
        return cls(tuple(paths), tuple(manifest), name, bool(params.get("recursive")), parallel,
                   bool(params.get("check")), bool(params.get("pin")), None if lease is None else float(lease),
                   str(tier))


@dataclass
class _File:
    ref: ObjectRef
    blocks: int
    left: int
    cached_bytes: int = 0
    error: str | None = None


@dataclass
class PrefetchJob:
    id: str
    request: PrefetchRequest
    polled_at: float
    started_at: float = field(default_factory=time.time)
    state: JobState = JobState.RESOLVING
    error: str | None = None
    files_total: int = 0
    files_done: int = 0
    files_cached: int = 0
    bytes_total: int = 0
    bytes_done: int = 0
    bytes_cached: int = 0
    bytes_fetched: int = 0
    bytes_skipped: int = 0
    failures: dict[str, str] = field(default_factory=dict)
    changed: list[dict[str, Any]] = field(default_factory=list)
    not_cached: list[str] = field(default_factory=list)
    cancel_reason: str | None = None
    t0: float = 0.0
    t1: float | None = None
    task: asyncio.Task[None] | None = None

    @property
    def finished(self) -> bool:
        return self.state in FINISHED_STATES

    def document(self, now: float) -> dict[str, Any]:
        elapsed = max(0.0, (self.t1 if self.t1 is not None else now) - self.t0)
        ok = (self.state is JobState.DONE and not self.failures and not self.changed
              and self.bytes_cached == self.bytes_total and self.files_cached == self.files_total)
        return {
            "id": self.id,
            "state": str(self.state),
            "error": self.error,
            "ok": ok,
            "check": self.request.check,
            "pin": self.request.pin,
            "tier": self.request.tier,
            "recursive": self.request.recursive,
            "parallel": self.request.parallel,
            "files_total": self.files_total,
            "files_done": self.files_done,
            "files_cached": self.files_cached,
            "bytes_total": self.bytes_total,
            "bytes_done": self.bytes_done,
            "bytes_cached": self.bytes_cached,
            "bytes_fetched": self.bytes_fetched,
            "bytes_skipped": self.bytes_skipped,
            "cached_ratio": round(self.bytes_cached / self.bytes_total, 6) if self.bytes_total else 1.0,
            "failures": [{"path": p, "error": e} for p, e in list(self.failures.items())[:MAX_LISTED]],
            "failures_count": len(self.failures),
            "changed": self.changed[:MAX_LISTED],
            "changed_count": len(self.changed),
            "not_cached": self.not_cached[:MAX_LISTED],
            "not_cached_count": len(self.not_cached),
            "started_at": self.started_at,
            "elapsed_s": round(elapsed, 3),
            "rate_bytes_per_s": round(self.bytes_fetched / elapsed, 1) if elapsed > 0 else 0.0,
        }


class PrefetchManager:
    """Runs prefetch jobs and answers pin, snapshot and evict requests for one mount."""

    def __init__(self, store: ObjectStore, cache: BlockCache, *, pin_file: Path | None,
                 clock: Clock | None = None, whole: WholeFiles | None = None) -> None:
        self.store = store
        self.cache = cache
        self.whole = whole  # whole files of the disk tier (passthrough): an evicted file loses its own too
        self.pin_file = pin_file
        self.clock = clock or SystemClock()
        self._jobs: OrderedDict[str, PrefetchJob] = OrderedDict()
        self._pin_lock = asyncio.Lock()

    # ------------------------------------------------------------------ jobs
    def jobs(self) -> list[PrefetchJob]:
        return list(self._jobs.values())

    def active_jobs(self) -> int:
        return sum(1 for job in self._jobs.values() if not job.finished)

    def start(self, request: PrefetchRequest) -> PrefetchJob:
        if self.active_jobs() >= MAX_ACTIVE_JOBS:
            raise ControlRequestError(429, f"{MAX_ACTIVE_JOBS} prefetch jobs are running already; wait for one to end")
        job = PrefetchJob(secrets.token_hex(6), request, polled_at=self.clock.monotonic(), t0=self.clock.monotonic())
        self._jobs[job.id] = job
        job.task = asyncio.get_running_loop().create_task(self._run(job))
        self._forget_old()
        return job

    def get(self, job_id: str) -> PrefetchJob:
        job = self._jobs.get(job_id)
        if job is None:
            raise ControlRequestError(404, f"no prefetch job {job_id!r}")
        job.polled_at = self.clock.monotonic()
        return job

    async def cancel(self, job_id: str, reason: str = "cancelled") -> PrefetchJob:
        job = self.get(job_id)
        if not job.finished and job.task is not None:
            job.cancel_reason = reason
            job.task.cancel()
            await asyncio.wait({job.task}, timeout=CANCEL_WAIT_S)
        return job

    def document(self, job: PrefetchJob) -> dict[str, Any]:
        return job.document(self.clock.monotonic())

    async def stop(self) -> None:
        tasks = [job.task for job in self._jobs.values() if job.task is not None and not job.task.done()]
        for job in self._jobs.values():
            if not job.finished:
                job.cancel_reason = "the daemon is stopping"
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CANCEL_WAIT_S)

    def _forget_old(self) -> None:
        finished = [job_id for job_id, job in self._jobs.items() if job.finished]
        for job_id in finished[: max(0, len(finished) - FINISHED_JOBS_KEPT)]:
            del self._jobs[job_id]

    async def _run(self, job: PrefetchJob) -> None:
        watchdog = None
        if job.request.lease_s is not None:
            watchdog = asyncio.get_running_loop().create_task(self._watch_lease(job))
        try:
            files = await self._resolve(job)
            if job.request.tier == "cluster" and self.cache.cluster is None:
                raise _Rejected("this mount has no cluster tier (mount it with --cluster-cache)")
            if job.request.check and job.request.tier == "cluster":
                await self._check_cluster(job, files)
            elif job.request.check:
                self._check(job, files)
            else:
                await self._prepare(job, files)
                job.state = JobState.RUNNING
                await self._fetch(job, files)
                self._verify(job, files)
            job.state = JobState.DONE
        except _Rejected as exc:
            job.state, job.error = JobState.REJECTED, str(exc)
        except asyncio.CancelledError:
            job.state, job.error = JobState.CANCELLED, job.cancel_reason or "cancelled"
        except CacheError as exc:
            job.state, job.error = JobState.FAILED, str(exc)
        except Exception as exc:  # noqa: BLE001 - a job must end with a document, never vanish
            log.exception("prefetch job %s failed", job.id)
            job.state, job.error = JobState.FAILED, f"internal error: {exc.__class__.__name__}: {exc}"
        finally:
            job.t1 = self.clock.monotonic()
            if watchdog is not None:
                watchdog.cancel()
            log.info("prefetch job %s %s: %d/%d files cached, %d bytes fetched%s", job.id, job.state,
                     job.files_cached, job.files_total, job.bytes_fetched, f" ({job.error})" if job.error else "")

    async def _watch_lease(self, job: PrefetchJob) -> None:
        lease = job.request.lease_s
        assert lease is not None
        while not job.finished:
            await asyncio.sleep(min(LEASE_CHECK_S, lease / 4))
            if not job.finished and self.clock.monotonic() - job.polled_at > lease and job.task is not None:
                job.cancel_reason = f"abandoned: nobody polled it for {lease:g} s"
                log.warning("prefetch job %s %s", job.id, job.cancel_reason)
                job.task.cancel()
                return

    # ------------------------------------------------------------------ job phases
    async def _resolve(self, job: PrefetchJob) -> list[_File]:
        """The files of the request, in path order; rejects missing paths, records changed ones."""
        request = job.request
        resolver = Resolver(self.store)
        found: dict[str, ObjectInfo] = {}
        problems: list[str] = []
        resolved = await resolver.resolve(list(request.paths), recursive=request.recursive)
        found.update(resolved.files)
        if resolved.missing:
            problems.append(f"no such file or directory in the mount: {_names(resolved.missing)}")
        if resolved.directories:
            problems.append(f"is a directory (use --recursive): {_names(resolved.directories)}")
        await resolver.preload([e.path for e in request.manifest])
        for entry in request.manifest:
            where = f"manifest {request.manifest_name} line {entry.line}"
            current = await resolver.lookup(entry.path)
            verify = entry.etag is not None or entry.size is not None
            if verify and not isinstance(current, ObjectInfo):
                self._changed(job, entry, None, "deleted" if current is False else "now a directory")
            elif current is False:
                problems.append(f"{where}: no such file or directory in the mount: {entry.path or '/'}")
            elif current is None:
                if not request.recursive:
                    problems.append(f"{where}: is a directory (use --recursive): {entry.path or '/'}")
                else:
                    for info in await resolver.walk(entry.path):
                        found.setdefault(info.key, info)
            else:
                assert isinstance(current, ObjectInfo)
                if entry.etag is not None and not same_etag(entry.etag, current.etag):
                    self._changed(job, entry, current, "ETag differs")
                elif entry.size is not None and entry.size != current.size:
                    self._changed(job, entry, current, "size differs")
                else:
                    found.setdefault(current.key, current)
        if problems:
            raise _Rejected(problems[0] if len(problems) == 1 else "; ".join(problems[:NAMES_IN_ERROR]))
        files = []
        for key in sorted(found):
            info = found[key]
            n = block_count(info.size, self.cache.block_size)
            files.append(_File(ObjectRef(info.key, info.etag, info.size), n, n))
        job.files_total = len(files)
        job.bytes_total = sum(f.ref.size for f in files)
        return files

    @staticmethod
    def _changed(job: PrefetchJob, entry: ManifestEntry, now: ObjectInfo | None, reason: str) -> None:
        job.changed.append({
            "path": entry.path, "line": entry.line, "reason": reason,
            "expected_etag": entry.etag, "expected_size": entry.size,
            "etag": now.etag if now else None, "size": now.size if now else None,
        })

    def _cached_bytes(self, ref: ObjectRef) -> int:
        """Bytes of ``ref`` on the disk tier now (index lookups, no I/O)."""
        disk = self.cache.disk
        if disk is None:
            return 0
        total = 0
        for index in range(block_count(ref.size, self.cache.block_size)):
            if disk.contains(BlockKey(ref.key, ref.etag, index)):
                start, end = block_range(index, ref.size, self.cache.block_size)
                total += end - start
        return total

    def _check(self, job: PrefetchJob, files: list[_File]) -> None:
        """--check: how much of each file is on the disk tier; nothing is fetched."""
        for f in files:
            self._checked(job, f, self._cached_bytes(f.ref))
        job.bytes_done = job.bytes_cached

    async def _check_cluster(self, job: PrefetchJob, files: list[_File]) -> None:
        """--check --tier cluster: how much of each file the cluster tier holds; nothing is fetched."""
        for f in files:
            self._checked(job, f, await self._cluster_cached_bytes(f.ref))
        job.bytes_done = job.bytes_cached

    @staticmethod
    def _checked(job: PrefetchJob, f: _File, cached_bytes: int) -> None:
        """Count one file of a --check: cached whole, or named among those not cached."""
        f.cached_bytes = cached_bytes
        job.bytes_cached += cached_bytes
        job.files_done += 1
        if cached_bytes == f.ref.size:
            job.files_cached += 1
        else:
            job.not_cached.append(f.ref.key)

    async def _cluster_cached_bytes(self, ref: ObjectRef) -> int:
        """Bytes of ``ref`` the cluster tier holds (one HEAD per block, at most the fetch slots at once)."""
        cluster = self.cache.cluster
        assert cluster is not None
        limit = asyncio.Semaphore(self.cache.settings.max_concurrent_fetches)

        async def one(index: int) -> int:
            async with limit:
                present = await cluster.contains(BlockKey(ref.key, ref.etag, index))
            start, end = block_range(index, ref.size, self.cache.block_size)
            return end - start if present else 0

        return sum(await asyncio.gather(*(one(i) for i in range(block_count(ref.size, self.cache.block_size)))))

    async def _prepare(self, job: PrefetchJob, files: list[_File]) -> None:
        """Refuse what cannot work before fetching anything: no disk tier, no room, pin limit."""
        if job.request.tier == "cluster":
            return  # the shared store has no capacity known here, and no pins
        disk = self.cache.disk
        if disk is None:
            raise _Rejected("this mount has no disk tier (--disk-cache 0): there is nowhere to prefetch to")
        if disk.health.state is TierState.DOWN:
            raise CacheError("the disk tier is down (repeated I/O errors); see the daemon log")
        refs = [f.ref for f in files]
        pins = self.cache.pins
        dataset = sum(pins.footprint(ref) for ref in refs)
        wanted = set(refs)
        pinned_other = sum(pins.footprint(ref) for ref in pins.refs() if ref not in wanted)
        room = int(disk.capacity_bytes * disk.low_watermark)
        # Staged write-back data shares the disk tier and can never be evicted: it takes room too.
        staged = disk.reserved_space()
        if dataset + pinned_other + staged > room:
            other = f" plus {format_size(pinned_other)} pinned by other files" if pinned_other else ""
            other += f" plus {format_size(staged)} of write-back data not yet uploaded" if staged else ""
            raise _Rejected(
                f"the files do not fit the disk tier: they take {format_size(dataset)} on disk{other}, more than "
                f"{format_size(room)} (the eviction low watermark of the {format_size(disk.capacity_bytes)} "
                f"disk tier); raise --disk-cache or prefetch less"
            )
        if job.request.pin:
            try:
                self.cache.pin(refs)
            except PinError as exc:
                raise _Rejected(str(exc)) from None
            await self.save_pins()

    async def _fetch(self, job: PrefetchJob, files: list[_File]) -> None:
        for f in files:
            if f.blocks == 0:  # empty files are cached by definition
                job.files_done += 1
        work: Iterator[tuple[_File, int]] = ((f, i) for f in files for i in range(f.blocks))
        parallel = job.request.parallel or self.cache.settings.max_concurrent_fetches
        abort: list[str] = []

        async def worker() -> None:
            for f, index in work:  # one shared iterator: each block goes to exactly one worker
                if abort:
                    return
                try:
                    if f.error is None:
                        await self._warm_one(job, f, index, abort)
                finally:
                    f.left -= 1
                    if f.left == 0:
                        job.files_done += 1

        async with asyncio.TaskGroup() as group:
            for _ in range(min(parallel, sum(f.blocks for f in files)) or 0):
                group.create_task(worker())
        if abort:
            raise CacheError(abort[0])

    async def _warm_one(self, job: PrefetchJob, f: _File, index: int, abort: list[str]) -> None:
        cluster = job.request.tier == "cluster"
        try:
            if cluster:
                outcome, length = await self.cache.warm_cluster_block(f.ref, index)
            else:
                outcome, length = await self.cache.warm_block(f.ref, index)
        except ObjectChangedError:
            self._fail(job, f, "changed on the store while it was being prefetched")
            return
        except ObjectNotFoundError:
            self._fail(job, f, "deleted from the store while it was being prefetched")
            return
        except ObjectStoreError as exc:
            self._fail(job, f, str(exc))
            return
        if outcome is WarmOutcome.NOT_STORED and cluster:
            self._fail(job, f, "the cluster tier did not store a block (its store is failing; see the daemon log)")
            return
        if outcome is WarmOutcome.NOT_STORED:
            disk = self.cache.disk
            if disk is not None and disk.health.state is TierState.DOWN:
                abort.append("the disk tier went down during the prefetch (repeated I/O errors); see the daemon log")
            self._fail(job, f, "the disk tier did not keep a block "
                               "(full of pinned data or in-flight writes, or failing)")
            return
        job.bytes_done += length
        if outcome is WarmOutcome.FETCHED:
            job.bytes_fetched += length
        elif outcome is WarmOutcome.SKIPPED:
            job.bytes_skipped += length

    @staticmethod
    def _fail(job: PrefetchJob, f: _File, error: str) -> None:
        if f.error is None:
            f.error = error
            job.failures[f.ref.key] = error

    def _verify(self, job: PrefetchJob, files: list[_File]) -> None:
        """Count what is on disk now: concurrent reads may have evicted blocks since they landed."""
        job.bytes_cached = job.files_cached = 0
        if job.request.tier == "cluster":  # shared and never evicted by this node: what was stored stays
            for f in files:
                f.cached_bytes = f.ref.size if f.error is None else 0
                job.bytes_cached += f.cached_bytes
                if f.error is None:
                    job.files_cached += 1
                else:
                    job.not_cached.append(f.ref.key)
            return
        for f in files:
            f.cached_bytes = self._cached_bytes(f.ref)
            job.bytes_cached += f.cached_bytes
            if f.cached_bytes == f.ref.size:
                job.files_cached += 1
                continue
            job.not_cached.append(f.ref.key)
            self._fail(job, f, "evicted again before the prefetch ended: the disk tier is too small for this "
                               "dataset next to the data being read")

    # ------------------------------------------------------------------ pins
    async def restore_pins(self) -> None:
        if self.pin_file is None or self.cache.disk is None:
            return
        try:
            refs = await asyncio.to_thread(load_pin_file, self.pin_file)
        except PinFileError as exc:
            log.error("%s; starting without pins", exc)
            return
        if not refs:
            return
        self.cache.pin(refs, enforce_limit=False)
        stats = self.cache.pin_stats()
        log.info("restored %d pinned objects (%d bytes)", stats["objects"], stats["bytes"])
        if stats["bytes"] > stats["limit_bytes"]:
            log.warning("pinned data (%s) exceeds the pin limit (%s, --max-pinned): new pins are refused until "
                        "some are unpinned", format_size(stats["bytes"]), format_size(stats["limit_bytes"]))

    async def save_pins(self) -> None:
        if self.pin_file is None:
            return
        async with self._pin_lock:
            refs = self.cache.pins.refs()
            try:
                await asyncio.to_thread(save_pin_file, self.pin_file, refs)
            except OSError as exc:
                log.error("cannot save pins to %s: %s (they hold until the daemon stops)", self.pin_file, exc)

    async def unpin(self, params: dict[str, Any]) -> dict[str, Any]:
        paths = _str_list(params, "paths")
        pins = self.cache.pins
        if not paths:
            keys = {ref.key for ref in pins.refs()}
        else:
            keys, missing = set(), []
            resolver = Resolver(self.store)
            for path in paths:
                matched = {r.key for r in pins.refs() if not path or r.key == path or r.key.startswith(path + "/")}
                if not matched and await self._lookup(resolver, path) is False:
                    missing.append(path)
                keys |= matched
            if missing:
                raise _bad(f"no such file or directory in the mount: {_names(missing)}")
        footprint = sum(pins.footprint(ref) for ref in pins.refs() if ref.key in keys)
        removed = self.cache.unpin(keys)
        if removed:
            await self.save_pins()
        remaining = {f"pinned_{k}": v for k, v in self.cache.pin_stats().items()}
        return {"files": len(removed), "bytes": footprint, **remaining}

    # ------------------------------------------------------------------ snapshot and evict
    async def _lookup(self, resolver: Resolver, path: str) -> ObjectInfo | None | bool:
        try:
            return await resolver.lookup(path)
        except ObjectStoreError as exc:
            raise ControlRequestError(502, str(exc)) from None

    async def snapshot(self, params: dict[str, Any]) -> dict[str, Any]:
        path = params.get("path", "")
        try:
            path = check_path(path)
        except PathError as exc:
            raise _bad(str(exc)) from None
        resolver = Resolver(self.store)
        found = await self._lookup(resolver, path)
        if found is False:
            raise _bad(f"no such file or directory in the mount: {path}")
        try:
            files = [found] if isinstance(found, ObjectInfo) else await resolver.walk(path)
        except ObjectStoreError as exc:
            raise ControlRequestError(502, str(exc)) from None
        return {
            "files": [{"path": f.key, "etag": f.etag, "size": f.size} for f in files],
            "skipped_keys": resolver.skipped_keys,
        }

    async def evict(self, params: dict[str, Any]) -> dict[str, Any]:
        tier = params.get("tier", "all")
        if tier not in ("all", "ram", "disk"):
            raise _bad("'tier' must be one of all, ram, disk")
        ram, disk = tier in ("all", "ram"), tier in ("all", "disk")
        paths = _str_list(params, "paths")
        if not paths:
            blocks, freed = await self.cache.evict_all(ram=ram, disk=disk)
            kept = self.cache.pin_stats()["cached_bytes"] if disk else 0
            return {"files": None, "blocks": blocks, "bytes": freed, "pinned_blocks_kept": None,
                    "pinned_bytes_kept": kept, "tier": tier}
        try:
            resolved = await Resolver(self.store).resolve(paths, recursive=True)
        except ObjectStoreError as exc:
            raise ControlRequestError(502, str(exc)) from None
        if resolved.missing:
            raise _bad(f"no such file or directory in the mount: {_names(resolved.missing)}")
        blocks = freed = kept = 0
        for info in resolved.files.values():
            ref = ObjectRef(info.key, info.etag, info.size)
            b, n, k = await self.cache.evict(ref, ram=ram, disk=disk)
            if disk and self.whole is not None:
                await asyncio.to_thread(self.whole.discard, ref)
            blocks, freed, kept = blocks + b, freed + n, kept + k
        return {"files": len(resolved.files), "blocks": blocks, "bytes": freed, "pinned_blocks_kept": kept,
                "pinned_bytes_kept": None, "tier": tier}


# ---------------------------------------------------------------------------------------- wiring
def _json(value: Any, status: int = 200) -> web.Response:
    return web.json_response(value, status=status)


def register_routes(control: ControlServer, manager: PrefetchManager) -> None:
    """Control routes (unix socket only: they change the cache)."""

    async def start(params: dict[str, Any]) -> dict[str, Any]:
        return manager.document(manager.start(PrefetchRequest.from_params(params)))

    async def listing(_params: dict[str, Any]) -> list[dict[str, Any]]:
        return [manager.document(job) for job in manager.jobs()]

    async def one(request: web.Request) -> web.Response:
        try:
            job = manager.get(request.match_info["id"])
            if request.method == "DELETE":
                job = await manager.cancel(job.id, "cancelled by request")
        except ControlRequestError as exc:
            return _json({"error": str(exc)}, exc.status)
        return _json(manager.document(job))

    control.add_json_route("POST", "/prefetch", start)
    control.add_json_route("GET", "/prefetch", listing)
    control.add_route("GET", "/prefetch/{id}", one)
    control.add_route("DELETE", "/prefetch/{id}", one)
    control.add_json_route("POST", "/snapshot", manager.snapshot)
    control.add_json_route("POST", "/unpin", manager.unpin)
    control.add_json_route("POST", "/evict", manager.evict)


class PrefetchFeature:
    def __init__(self, manager: PrefetchManager) -> None:
        self.manager = manager

    async def start(self) -> None:
        await self.manager.restore_pins()

    async def stop(self) -> None:
        await self.manager.stop()


def install(ctx: DaemonContext) -> PrefetchFeature:
    manager = PrefetchManager(ctx.store, ctx.cache, pin_file=ctx.cache_dir / PIN_FILENAME, whole=ctx.fs.whole)
    register_routes(ctx.control, manager)
    return PrefetchFeature(manager)
