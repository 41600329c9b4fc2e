"""The mount daemon: wires store, tiers, filesystem, FUSE and the control API on one asyncio loop.

``run_daemon`` is what ``cachefs mount --foreground`` runs. It validates everything that can only be
checked with the store at hand (the bucket exists, credentials work, the endpoint answers) before
mounting, reports success or a one-line failure through ``ready`` (the background ``cachefs mount``
waits on that), then serves FUSE until unmounted or signalled (SIGTERM/SIGINT unmount cleanly).

Cache directory layout, per source (so several mounts may share one ``--cache-dir`` safely)::

    CACHE_DIR/<sha256(source, endpoint)[:16]>/
        source.json   what this directory caches (for humans and tools)
        lock          flock'd by the daemon using it: two daemons never share a disk tier
        blocks/       the disk tier (see tiering.disk)
        pins.json     pinned objects (see tiering.pins, cachefs.prefetch)
        staging/      staged writes and their journal, on a writable mount (see tiering.writeback)
"""

from __future__ import annotations

import asyncio
import fcntl
import importlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

from cachefs.control import ControlServer, socket_path_for
from cachefs.errors import SetupError
from cachefs.fs import CacheFS
from cachefs.fuse_adapter import FuseSession
from cachefs.settings import MountSettings
from tiering.disk import DiskTier
from tiering.engine import BlockCache
from tiering.errors import CacheError
from tiering.objectstore import open_object_store
from tiering.pins import PIN_FILENAME, pinned_block_keys
from tiering.protocols import ObjectStore
from tiering.ram import RamTier

log = logging.getLogger(__name__)

# The store check at start-up is bounded separately from reads: connect timeout plus retries of the
# S3 client can add up, and a user must get an answer well under 30 s.
STARTUP_CHECK_TIMEOUT_S = 20.0
# FUSE worker tasks: each in-flight kernel request occupies one; reads block on fetches, so allow
# enough for the kernel's max_background (12 by default) plus metadata requests.
FUSE_MAX_TASKS = 64

# Kernel read-ahead for the FUSE connection. The default (128 KiB) makes the kernel send 128 KiB
# read requests, one Python round trip each; with 16 MiB it sends requests of max_pages (1 MiB with
# libfuse 3) and keeps several in flight. Measured on a 1 GiB file: 8x fewer requests, page-cache
# re-reads 1.9 -> 2.8 GB/s. Needs root (sysfs); without it the mount works with the default.
FUSE_READ_AHEAD_KB = 16 * 1024

# FUSE requests the kernel keeps in flight in the background (read-ahead, async reads), and the
# level at which it considers the connection congested. The kernel's 12/9 let a read-ahead window
# of 16 MiB have only 12 requests of 1 MiB outstanding; 64/48 keeps the daemon's fetches and
# disk-tier loads overlapped. Set through fusectl (/sys/fs/fuse/connections/N, mounted by systemd
# on most distributions; root only): measured, 512 MiB read back from the disk tier after a
# remount, 0.65x -> 0.75x of a local-disk read, median of 3 runs each (benchmarks/bench.py).
FUSE_MAX_BACKGROUND = 64
FUSE_CONGESTION_THRESHOLD = 48
FUSECTL = Path("/sys/fs/fuse/connections")

ReadyCallback = Callable[[str | None], None]

# Feature modules wired into every mount: each has ``install(ctx: DaemonContext) -> Feature``,
# called before the control API starts (so it can add routes); its ``start()`` runs before the
# kernel mount (so a replay or a warm-up finishes first) and its ``stop()`` after the unmount, in
# reverse order, also when the mount failed.
FEATURE_MODULES: tuple[str, ...] = ("cachefs.writeback", "cachefs.prefetch", "cachefs.metrics")


@dataclass
class DaemonContext:
    """Everything a feature may build on. Created once per mount."""

    settings: MountSettings
    store: ObjectStore
    cache: BlockCache
    fs: CacheFS
    control: ControlServer
    cache_dir: Path


class Feature(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def tune_fuse_connection(mountpoint: Path, fusectl: Path = FUSECTL) -> None:
    """Raise the kernel read-ahead and background-request limits of the mount, where permitted."""
    try:
        dev = os.stat(mountpoint).st_dev
    except OSError as exc:
        log.info("FUSE connection left at the kernel's defaults (%s)", exc.strerror or exc)
        return
    try:
        bdi = Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")
        bdi.write_text(str(FUSE_READ_AHEAD_KB))
        log.debug("set %s to %d", bdi, FUSE_READ_AHEAD_KB)
    except OSError as exc:
        log.info("kernel read-ahead left at its default (%s)", exc.strerror or exc)
    set_max_background(dev, fusectl)


def set_max_background(dev: int, fusectl: Path = FUSECTL) -> bool:
    """Raise the background-request limits of the FUSE connection of device ``dev``; False if not permitted."""
    # fusectl names a connection by the kernel's encoding of the superblock's device number.
    connection = fusectl / str((os.major(dev) << 20) | os.minor(dev))
    try:
        (connection / "max_background").write_text(str(FUSE_MAX_BACKGROUND))
        (connection / "congestion_threshold").write_text(str(FUSE_CONGESTION_THRESHOLD))
    except OSError as exc:
        log.info("FUSE max_background left at the kernel's default (%s: %s)", connection, exc.strerror or exc)
        return False
    log.debug("set %s max_background %d, congestion_threshold %d", connection, FUSE_MAX_BACKGROUND,
              FUSE_CONGESTION_THRESHOLD)
    return True


def lock_cache_dir(directory: Path) -> IO[str]:
    """Take the per-source lock; refuse if another daemon holds it."""
    directory.mkdir(parents=True, exist_ok=True)
    handle = open(directory / "lock", "a+")
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


async def run_daemon(settings: MountSettings, ready: ReadyCallback, environ: dict[str, str]) -> None:
    """Mount and serve until unmounted. Raises ``SetupError`` for anything that prevents mounting."""
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
    try:
        try:
            await asyncio.wait_for(store.check(), STARTUP_CHECK_TIMEOUT_S)
        except CacheError as exc:
            raise SetupError(str(exc)) from exc
        except TimeoutError as exc:
            raise SetupError(f"object store did not answer within {STARTUP_CHECK_TIMEOUT_S:g} s") from exc

        cache_dir = settings.source_cache_dir()
        lock = lock_cache_dir(cache_dir)
        (cache_dir / "source.json").write_text(
            json.dumps({"source": settings.source, "endpoint_url": settings.endpoint_url}, indent=2) + "\n"
        )
        cs = settings.cache
        disk = None
        if cs.disk_bytes > 0:
            disk = await asyncio.to_thread(
                DiskTier,
                cache_dir,
                cs.disk_bytes,
                high_watermark=cs.high_watermark,
                low_watermark=cs.low_watermark,
                pinned=pinned_block_keys(cache_dir / PIN_FILENAME, cs.block_size),
            )
        ram = RamTier(cs.ram_bytes)
        cache = BlockCache(cs, store, ram, disk)
        socket_path = socket_path_for(settings.mountpoint)
        fs = CacheFS(store, cache, settings.fs, control_path=str(socket_path))
        control = ControlServer(
            socket_path,
            fs.stats_snapshot,
            {
                "pid": os.getpid(),
                "source": settings.source,
                "mountpoint": str(settings.mountpoint),
                "cache_dir": str(cache_dir),
                "started_at": time.time(),
            },
        )
        ctx = DaemonContext(settings, store, cache, fs, control, cache_dir)
        features: list[Feature] = [importlib.import_module(name).install(ctx) for name in FEATURE_MODULES]
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
                session = FuseSession(
                    fs, str(settings.mountpoint), read_only=settings.fs.read_only, allow_other=settings.allow_other
                )
                try:
                    session.mount()
                except OSError as exc:
                    raise SetupError(exc.strerror or str(exc)) from exc
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.add_signal_handler(sig, session.terminate)
                log.info("mounted %s on %s", settings.source, settings.mountpoint)
                ready(None)
                # After ready: the stat needs the FUSE loop running to answer getattr on the root.
                loop.call_soon(lambda: loop.run_in_executor(None, tune_fuse_connection, settings.mountpoint))
                try:
                    await session.serve(FUSE_MAX_TASKS)
                finally:
                    session.close()
                    log.info("unmounted %s", settings.mountpoint)
            finally:
                for feature in reversed(started):
                    try:
                        await feature.stop()
                    except Exception:  # noqa: BLE001 - one feature must not keep others from stopping
                        log.exception("stopping %s failed", type(feature).__name__)
        finally:
            await control.stop()
            await cache.close()
    finally:
        await store.close()
        if lock is not None:
            lock.close()


def _split_addr(addr: str | None) -> tuple[str | None, int | None]:
    if not addr:
        return None, None
    host, _, port = addr.rpartition(":")
    return host or "127.0.0.1", int(port)


def serve(settings: MountSettings, ready: ReadyCallback, environ: dict[str, str]) -> None:
    """Run the daemon on a fresh asyncio loop with pyfuse3's asyncio support enabled."""
    FuseSession.enable_asyncio()
    asyncio.run(run_daemon(settings, ready, environ))
