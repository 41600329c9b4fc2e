"""The mount daemon: wires store, tiers, filesystem, FUSE and the control API on one asyncio loop.

``run_daemon`` is what ``cachefs mount --foreground`` runs. It validates everything that can only be
checked with the store at hand (the bucket exists, credentials work, the endpoint answers) before
mounting (or, with ``settings.fuse_fd``, before serving the mount a privileged process made and handed
over: ``cachefs.handover``; then it neither mounts nor unmounts), reports success or a one-line failure through ``ready`` (the background ``cachefs mount``
waits on that), then serves FUSE until unmounted or signalled. Every way of stopping (SIGTERM/SIGINT, an unmount by any
route) uploads what is pending first, within ``--stop-timeout``, and says what stays journaled
(``cachefs.daemon.stopping``); a second signal stops at once.

Cache directory layout, per source (so several mounts may share one ``--cache-dir`` safely); the
daemon runs with umask 077, refuses a cache root or per-source directory another user owns or may
write, and opens its own files there without following symlinks (``tiering.private``)::

    CACHE_DIR/<sha256(source, endpoint)[:16]>/
        source.json   what this directory caches (for humans and tools)
        lock          flock'd by the daemon using it: two daemons never share a disk tier
        blocks/       the disk tier (see tiering.tiers.disk)
        pins.json     pinned objects (see tiering.policy.pins, cachefs.daemon.prefetch)
        metadata.db   listings that outlive the mount (see cachefs.fs.metaindex, cachefs.daemon.metadata)
        manifest-<sha256>.db   the namespace of a --manifest mount (see cachefs.fs.pinned)
        staging/      staged writes and their journal, on a writable mount (see tiering.writeback)
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import fcntl
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from cachefs.daemon import announce, metadata, metrics, prefetch, writeback
from cachefs.daemon.heap import freeze_startup_heap, time_collections
from cachefs.daemon.context import DaemonContext, Feature
from cachefs.daemon.control import ControlServer, socket_path_for
from cachefs.daemon.errors import SetupError
from cachefs.daemon.stats import stats_document
from cachefs.daemon.stopping import Stopping
from cachefs.fs.filesystem import CacheFS
from cachefs.fuse.adapter import FuseOperations
from cachefs.fuse.session import FuseSession
from cachefs.fuse.sharedloop import SharedLoop
from cachefs.tuning import tune_fuse_connection
from cachefs.mounts import LOCK_FILENAME
from cachefs.sourcedir import has_staged_changes
from cachefs.settings import MountSettings
from tiering.clock import SystemClock
from tiering.clusterkey import ClusterKey, ClusterKeyError
from tiering.tiers.cluster import ClusterTier, WriteBehind
from tiering.tiers.disk import DiskTier, filesystem_free_bytes
from tiering.engine.blockcache import BlockCache
from tiering.errors import CacheError, ObjectStoreUnavailableError
from tiering.objectstore import CHECK_TIMEOUT_S, DEFAULT_CONNECT_TIMEOUT_S, open_object_store
from tiering.protocols import ObjectStore
from tiering.policy.pins import PIN_FILENAME, pinned_block_keys
from tiering.private import PRIVATE_DIR_MODE, check_cache_dirs, open_private, write_private_file
from tiering.tiers.ram import RamTier
from tiering.policy.readorder import ReadOrder
from tiering.storehealth import StoreHealth

log = logging.getLogger(__name__)

# FUSE worker tasks: each in-flight kernel request occupies one; reads block on fetches, so allow
# enough for the kernel's max_background (12 by default) plus metadata requests.
FUSE_MAX_TASKS = 64
# The start-up check of a --cluster-cache store (one LIST of at most one key): a live in-cluster store
# answers in milliseconds; one that has not answered within this (or the cluster timeout, if longer)
# is taken as down, and the mount goes on without it rather than waiting for it. 5 s covers a first
# connection to a loaded store without holding a pod's start long for a tier that is only a cache.
CLUSTER_CHECK_TIMEOUT_S = 5.0

ReadyCallback = Callable[[str | None], None]
# Things the user should see at mount but that do not stop it (an empty prefix): one line each.
WarnCallback = Callable[[str], None]

# The features wired into every mount, in start order; they stop in reverse (see cachefs.daemon.context).
FEATURES = (writeback.install, prefetch.install, announce.install, metrics.install)

def private_cache_dir(settings: MountSettings) -> Path:
    """Refuse a cache root or per-source directory another user owns or may write (``tiering.private``:
    whoever can plant files there could have blocks served or files of ours overwritten); create them
    0700. Returns the per-source directory."""
    cache_dir = settings.source_cache_dir()
    try:
        check_cache_dirs(settings.cache_dir, cache_dir)
    except OSError as exc:
        raise SetupError(exc.strerror or str(exc)) from exc
    return cache_dir


def lock_cache_dir(directory: Path) -> IO[str]:
    """Take the per-source lock; refuse if another daemon holds it."""
    directory.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    try:
        handle = os.fdopen(open_private(directory / LOCK_FILENAME, os.O_RDWR | os.O_CREAT), "r+")
    except OSError as exc:
        raise SetupError(exc.strerror or str(exc)) from exc
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise SetupError(f"cache dir {directory} is in use by another cachefs mount (pid {holder})") from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def _store_name(settings: MountSettings) -> str:
    """The endpoint a start-up failure is about, for the one-line message."""
    if settings.endpoint_url:
        return settings.endpoint_url
    return "the default AWS S3 endpoint" if settings.source.startswith("s3://") else settings.source


async def open_cluster_tier(settings: MountSettings, environ: dict[str, str],
                            warn: WarnCallback | None = None) -> ClusterTier | None:
    """The shared cluster tier of ``--cluster-cache``, its store checked at start-up.

    A store that answers with an error (a missing bucket, refused credentials) is a misconfiguration
    and stops the mount with one line. A store that cannot be reached (connection refused, no answer
    within ``CLUSTER_CHECK_TIMEOUT_S``) does not: the tier is only a cache, and a cluster store
    restarting must not stop every pod scheduled meanwhile. The tier starts with its circuit open
    (``/stats`` ``cluster.state`` is ``down``, ``cachefs_tier_state{tier="cluster"}``), every block
    comes from the source, and the circuit's probe (``tiering.storehealth``) brings the tier back
    once the store answers, with no restart; the user gets one warning line at mount."""
    cluster = settings.cluster
    if cluster is None:
        return None
    try:
        store: ObjectStore = open_object_store(
            cluster.url,
            endpoint_url=cluster.endpoint_url,
            connect_timeout_s=min(DEFAULT_CONNECT_TIMEOUT_S, cluster.timeout_s),
            read_timeout_s=cluster.timeout_s,
            environ=cluster.environ(environ),
        )
    except ValueError as exc:
        raise SetupError(f"cluster cache {cluster.url}: {exc}") from exc
    if cluster.key_file is None:
        raise SetupError(f"cluster cache {cluster.url}: no cluster key (--cluster-key-file); see docs/security.md")
    try:
        key = await asyncio.to_thread(ClusterKey.from_file, cluster.key_file)
    except ClusterKeyError as exc:
        raise SetupError(str(exc)) from None
    tier = ClusterTier(store, source_id=settings.source_identity(), block_size=settings.cache.block_size,
                       key=key, timeout_s=cluster.timeout_s, clock=SystemClock(), where=cluster.url)
    where = cluster.endpoint_url or "the default AWS S3 endpoint"
    try:
        await asyncio.wait_for(store.check(), max(cluster.timeout_s, CLUSTER_CHECK_TIMEOUT_S))
    except (ObjectStoreUnavailableError, TimeoutError) as exc:
        reason = str(exc) if isinstance(exc, CacheError) else "it did not answer in time"
        if cluster.endpoint_url is None:  # AWS itself, unreachable from here: no restart brings it back
            await tier.close()
            raise SetupError(f"cluster cache {cluster.url} at the default AWS S3 endpoint is unreachable ({reason}): "
                             f"give the in-cluster store's URL with --cluster-endpoint-url") from exc
        message = (f"cluster cache {cluster.url} at {where} is unreachable ({reason}); mounting without it: "
                   f"blocks come from the source until it answers, then the tier is used again")
        log.warning("%s", message)
        if warn is not None:
            warn(message)
        tier.health.record_failure(exc)  # the circuit starts open; its probe closes it
    except CacheError as exc:
        await tier.close()
        raise SetupError(f"cluster cache {cluster.url} at {where} is not usable: {exc}") from exc
    return tier


async def run_daemon(settings: MountSettings, ready: ReadyCallback, environ: dict[str, str],
                     warn: WarnCallback | None = None, watchdog: "ExitWatchdog | None" = None) -> None:
    """Mount and serve until unmounted. Raises ``SetupError`` for anything that prevents mounting.

    ``warn`` gets each start-up warning (also logged), for ``cachefs mount`` to show the user."""
    try:
        store = open_object_store(
            settings.source,
            endpoint_url=settings.endpoint_url,
            connect_timeout_s=settings.connect_timeout_s,
            read_timeout_s=settings.read_timeout_s,
            environ=environ,
        )
    except ValueError as exc:
        raise SetupError(str(exc)) from exc
    lock = None
    cluster = None
    index = None
    pinned = False
    served_to_the_end = False
    try:
        cluster = await open_cluster_tier(settings, environ, warn)
        try:
            has_objects = await asyncio.wait_for(store.check(), CHECK_TIMEOUT_S)
        except CacheError as exc:
            raise SetupError(str(exc)) from exc
        except TimeoutError as exc:
            raise SetupError(f"object store at {_store_name(settings)} did not answer within "
                             f"{CHECK_TIMEOUT_S:g} s (checking {settings.source})") from exc
        # An empty prefix is likely a typo: worth a line, not a refusal; but not when this mount is about
        # to upload changes an earlier one left staged there (a new output prefix after a crash).
        if not has_objects and (settings.fs.read_only or not has_staged_changes(settings.source_cache_dir())):
            message = f"{settings.source} holds no objects yet (check the prefix for a typo)"
            log.warning("%s", message)
            if warn is not None:
                warn(message)

        cache_dir = private_cache_dir(settings)
        lock = lock_cache_dir(cache_dir)
        source_doc = (json.dumps({"source": settings.source, "endpoint_url": settings.endpoint_url}, indent=2)
                      + "\n").encode()
        if _read_or_none(cache_dir / "source.json") != source_doc:  # unchanged: nothing to write on a full disk
            write_private_file(cache_dir / "source.json", source_doc)
        index, pinned = await metadata.open_index(settings, store, cache_dir)
        cs = settings.cache
        # Announced read orders rank both tiers' eviction victims (tiering.policy.readorder, cachefs.daemon.announce).
        read_order = ReadOrder(cs.block_size)
        disk = None
        if cs.disk_bytes > 0:
            disk = await asyncio.to_thread(
                DiskTier,
                cache_dir,
                cs.disk_bytes,
                high_watermark=cs.high_watermark,
                low_watermark=cs.low_watermark,
                pinned=pinned_block_keys(cache_dir / PIN_FILENAME, cs.block_size),
                min_free_bytes=cs.disk_min_free_bytes,
                free_space=lambda: filesystem_free_bytes(cache_dir),
                victim_order=read_order,
            )
        ram = RamTier(cs.ram_bytes, victim_order=read_order)
        # One store-health circuit for reads, metadata and write-back (tiering.storehealth).
        health = StoreHealth(SystemClock(), probe=store.check)
        write_behind = None
        if cluster is not None and settings.cluster is not None:
            write_behind = WriteBehind(cluster, max_blocks=settings.cluster.write_behind_blocks,
                                       max_bytes=settings.cluster.write_behind_bytes)
        cache = BlockCache(cs, store, ram, disk, health=health, cluster=cluster, write_behind=write_behind)
        # A handed-over mount is already in the mount table, and waits for this very daemon.
        handed_over = settings.fuse_fd is not None
        try:
            socket_path = socket_path_for(settings.mountpoint, resolve=not handed_over)
        except OSError as exc:  # a runtime directory another user owns or may write (tiering.private)
            raise SetupError(exc.strerror or str(exc)) from exc
        fs = CacheFS(store, cache, settings.fs, control_path=str(socket_path), read_order=read_order,
                     index=index, pinned=pinned, whole_files=disk)
        control = ControlServer(
            socket_path,
            lambda: stats_document(fs, settings.source_label()),
            {
                "pid": os.getpid(),
                "source": settings.source,
                "mountpoint": str(settings.mountpoint),
                "cache_dir": str(cache_dir),
                "started_at": time.time(),
                "stop_timeout_s": settings.writeback.stop_timeout_s,
            },
        )
        stopping = Stopping(settings.writeback.stop_timeout_s)
        stopping.add_routes(control)
        ctx = DaemonContext(settings, store, cache, fs, control, cache_dir, stopping)
        features: list[Feature] = [install(ctx) for install in FEATURES]
        host, port = _split_addr(settings.stats_addr)
        try:
            await control.start(host, port)
        except OSError as exc:
            raise SetupError(f"cannot serve stats on {settings.stats_addr}: {exc.strerror or exc}") from exc
        try:
            started: list[Feature] = []
            try:
                for feature in features:
                    await feature.start()
                    started.append(feature)
                # A handed-over descriptor is already mounted: the session neither mounts nor, at the
                # end, unmounts it (the privileged process that mounted does).
                # pinned: the namespace is a manifest's, every file's version fixed (immutable).
                ops = FuseOperations(fs, direct_io=settings.fs.direct_io, immutable=pinned,
                                     read_only=settings.fs.read_only, passthrough=settings.fs.passthrough)
                session = FuseSession(ops, str(settings.mountpoint),
                                      source=settings.source, read_only=settings.fs.read_only,
                                      allow_other=settings.allow_other, fd=settings.fuse_fd,
                                      broker=settings.backing_broker, threads=settings.fuse_threads,
                                      clones=settings.fuse_clones)
                fs.stats.fuse_requests = session.requests
                # Start-up's objects (botocore's model, the indexes) out of every later collection.
                log.debug("%d objects made at start-up frozen", freeze_startup_heap())
                time_collections()
                try:
                    session.mount()
                except OSError as exc:
                    raise SetupError(exc.strerror or str(exc)) from exc
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.add_signal_handler(sig, stopping.signalled, sig.name, session.terminate)
                log.info("%s %s on %s", "serving the handed-over mount of" if handed_over else "mounted",
                         settings.source, settings.mountpoint)
                ready(None)
                # After ready: the stat needs the FUSE loop running to answer getattr on the root.
                # A handed-over mount is tuned by the process that mounted it (this one may see
                # neither the mountpoint nor sysfs).
                if not handed_over:
                    loop.call_soon(lambda: loop.run_in_executor(None, tune_fuse_connection, settings.mountpoint))
                try:
                    await session.serve(FUSE_MAX_TASKS)
                    served_to_the_end = True
                finally:
                    stopping.session_ended()  # an unmount (umount, fusermount3 -u) starts the deadline here
                    if watchdog is not None:
                        watchdog.arm(max(stopping.remaining(), EXIT_WATCHDOG_FLOOR_S) + EXIT_WATCHDOG_MARGIN_S)
                    await stopping.close()
                    session.close()
                    log.info("unmounted %s", settings.mountpoint)
            finally:
                stopped_cleanly = True
                for feature in reversed(started):
                    try:
                        await feature.stop()
                    except Exception:  # noqa: BLE001 - one feature must not keep others from stopping
                        stopped_cleanly = False
                        log.exception("stopping %s failed", type(feature).__name__)
            if (stopped_cleanly and served_to_the_end and index is not None and not pinned
                    and (fs.writeback is None or not fs.writeback.has_pending())):
                metadata.mark_clean_exit(index)
        finally:
            await control.stop()
            if settings.exit_stats_file is not None:
                _write_exit_stats(settings.exit_stats_file, stats_document(fs, settings.source_label()))
            await cache.close()
            await health.close()
    finally:
        if cluster is not None:
            await cluster.close()
        await store.close()
        if index is not None:
            index.close()
        if lock is not None:
            lock.close()


# Kubernetes keeps at most 4096 bytes of a container's termination message; the traffic section is
# about 700.
EXIT_STATS_MAX_BYTES = 4096


def _write_exit_stats(path: Path, doc: dict[str, Any]) -> None:
    """The daemon's last counters (the ``traffic`` section of /stats) as one JSON line at ``path``
    (``--exit-stats-file``: a mount pod's termination message, so that what a short-lived pod served
    is counted after it is gone: csi_driver.operator.usage). A failure is logged, never raised."""
    text = json.dumps({"traffic": doc.get("traffic"), "volume": doc.get("volume")}, separators=(",", ":"))
    try:
        path.write_text(text[:EXIT_STATS_MAX_BYTES] + "\n")
    except OSError as exc:
        log.warning("cannot write the last counters to %s: %s", path, exc.strerror or exc)


def _split_addr(addr: str | None) -> tuple[str | None, int | None]:
    if not addr:
        return None, None
    host, _, port = addr.rpartition(":")
    return host or "127.0.0.1", int(port)


def _read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def serve(settings: MountSettings, ready: ReadyCallback, environ: dict[str, str],
          warn: WarnCallback | None = None) -> None:
    """Run the daemon on a fresh asyncio loop (the FUSE session serves on it)."""
    watchdog = ExitWatchdog()
    status = 1
    # Several FUSE readers answer on the daemon's state in turn: its loop must be one they can share.
    loop_factory = SharedLoop if settings.fuse_threads > 1 else None
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(run_daemon(settings, ready, environ, warn, watchdog))
        status = 0
    finally:
        watchdog.loop_ended(status)


# Past its stop deadline (--stop-timeout, counted from the end of the session), a daemon whose mount
# is gone gives itself this much more to close its stores and threads, and then exits anyway:
# ``cachefs unmount`` (and a mount pod's grace period) wait the deadline plus STOP_MARGIN_S (5 s).
EXIT_WATCHDOG_MARGIN_S = 3.0
# ... and never less than this after the session's end (a stop that abandons its uploads still closes).
EXIT_WATCHDOG_FLOOR_S = 10.0
# Once the event loop has ended, the threads it leaves (a worker blocked in a socket that no one
# waits for, an executor the interpreter joins at exit) get this long before the process exits
# without them, and never beyond the deadline above.
EXIT_LINGER_S = 2.0
# The exit status of a daemon the watchdog ended (sysexits' EX_SOFTWARE): its log holds every thread's stack.
EXIT_STOP_OVERRUN = 70


class ExitWatchdog:
    """Ends a daemon that outlives its stop deadline, whatever holds it (a thread blocked in a socket,
    a close that waits, the interpreter joining a worker at exit): every thread's stack goes to stderr
    (the daemon's log) first, so the next look at it says what held it.

    Two deadlines, the earlier wins: ``arm`` at the session's end (the stop deadline plus a margin; if
    it passes, the exit status is ``EXIT_STOP_OVERRUN``) and ``loop_ended`` when the event loop is done
    (``EXIT_LINGER_S`` for the threads it leaves; the stop itself finished, so the exit status is the
    daemon's own). Safe for data either way: acknowledged writes are in the staging journal, which the
    next mount uploads, and the metadata index is marked clean only by a stop that finished."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._status: int | None = None  # set once the loop ended
        self._started = False

    def arm(self, seconds: float) -> None:
        self._set(seconds, None)

    def loop_ended(self, status: int, linger_s: float = EXIT_LINGER_S) -> None:
        self._set(linger_s, status)

    def _set(self, seconds: float, status: int | None) -> None:
        with self._cond:
            deadline = time.monotonic() + seconds
            if self._deadline is None or deadline < self._deadline:
                self._deadline = deadline
            if status is not None:
                self._status = status
            self._cond.notify_all()
            if not self._started:
                self._started = True
                threading.Thread(target=self._watch, name="exit-watchdog", daemon=True).start()

    def _watch(self) -> None:
        with self._cond:
            while self._deadline is not None and (left := self._deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            status = self._status
        if status is None:
            log.error("the daemon did not finish stopping within its deadline after its session's end: exiting "
                      "now (acknowledged writes stay staged for the next mount); every thread's stack follows")
            status = EXIT_STOP_OVERRUN
        else:
            held = sorted(t.name for t in threading.enumerate()
                          if t.is_alive() and not t.daemon and t is not threading.main_thread())
            log.warning("the daemon stopped, but %s still ran %.0f s later: exiting without them; every "
                        "thread's stack follows", ", ".join(held) or "its threads", EXIT_LINGER_S)
        with contextlib.suppress(Exception):
            for handler in logging.getLogger().handlers:
                handler.flush()
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(status)
