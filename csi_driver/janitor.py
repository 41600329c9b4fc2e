"""Removes the node caches of volumes that no longer exist.

A persistent volume's cache stays on the node after its pods leave (``node.py``: the next pod on the
node starts warm), and DeleteVolume runs on the controller, which cannot reach the nodes. So the node
plugin sweeps its own cache root every ``CACHE_SWEEP_INTERVAL_S`` (``--cache-sweep-seconds``): it lists
the PersistentVolumes of its driver (one LIST) and removes the cache directory of every volume that
none of them names (its ``volumeHandle``), that this node does not use (no stage record, no slot's
target mounted, no daemon holding a slot) and whose slots hold no write still journaled (those are
kept, with a warning: they are uploaded by the next mount, or by the operator, never thrown away).
An inline ephemeral volume's cache is removed at unpublish already; one left by a plugin that died
in between goes the same way, as no PersistentVolume names it either.

**Known gone, or unnamed for an hour** (issue 36: a reinstall's reused caches were removed ten
minutes after it, as an uninstall deletes the PersistentVolumes and the reinstall had not yet made
them again). A volume this plugin has seen named by a PersistentVolume, in an earlier round of its
own, is *known gone* once no PersistentVolume names it: its cache goes at that round. A cache never
seen named since this plugin started (an earlier install's, or one whose PersistentVolume went while
no plugin ran) is kept for ``UNNAMED_GRACE_S`` from the first round that found it unnamed (recorded
in its directory, ``UNNAMED_MARK``, so a restart does not reset it): a reinstall that makes its
volumes again within that time mounts them warm; after it, the cache goes.

Each removal is a log line naming the volume, its size and why. A round that cannot list the volumes
(API server away, RBAC missing) removes nothing and says so once until a list works again. A volume
whose operation is in progress (its lock held by a CSI call) is left for the next round.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

from csi_driver.errors import CsiError
from csi_driver.node import SLOT_RECORD, NodeOps, cache_dir_name

log = logging.getLogger(__name__)

# How often the caches of deleted volumes are looked for: a deleted volume's cache is gone from the
# node within this (plus one LIST). Ten minutes costs one PersistentVolume LIST per node per ten
# minutes, and a deleted volume's disk space comes back long before a node's disk fills with them.
CACHE_SWEEP_INTERVAL_S = 600.0
API_TIMEOUT_S = 10.0
# How long a cache no PersistentVolume has named since this plugin started is kept: a reinstall (the
# uninstall deletes the PersistentVolumes) has this long to make its volumes again and find their
# caches warm (deploy/README.md, "Uninstall"); an hour is many times a reinstall and costs a deleted
# volume's disk space for at most that long when no plugin saw it go.
UNNAMED_GRACE_S = 3600.0
UNNAMED_MARK = "unnamed-since"  # in a volume's cache directory: when a round first found it unnamed


def persistent_volume_handles(core: Any, driver_name: str) -> set[str]:
    """The ``volumeHandle`` of every PersistentVolume of ``driver_name`` (raises on an API failure)."""
    volumes = core.list_persistent_volume(_request_timeout=API_TIMEOUT_S)
    handles = set()
    for pv in volumes.items:
        csi = pv.spec.csi if pv.spec is not None else None
        if csi is not None and csi.driver == driver_name and csi.volume_handle:
            handles.add(str(csi.volume_handle))
    return handles


def _size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


class CacheJanitor:
    """One node's sweeper (see the module docstring). ``live()`` returns the volume ids that exist."""

    def __init__(self, node: NodeOps, live: Callable[[], set[str]], driver_name: str, *,
                 grace_s: float = UNNAMED_GRACE_S, now: Callable[[], float] = time.time) -> None:
        self.node = node
        self.live = live
        self.driver_name = driver_name
        self.grace_s = grace_s
        self.now = now
        self._listing_failed = False
        self._seen: set[str] = set()  # volume ids a PersistentVolume named in a round of this plugin
    def sweep(self) -> list[str]:
        """One round; returns the volume ids whose caches were removed."""
        from cachefs.admin import staged_changes

        try:
            live = self.live()
        except Exception as exc:  # noqa: BLE001 - an API failure skips the round, never removes anything
            if not self._listing_failed:
                log.warning("cannot list PersistentVolumes (%s); caches of deleted volumes are not removed until "
                            "a list works", type(exc).__name__ if not str(exc) else str(exc).splitlines()[0][:200])
            self._listing_failed = True
            return []
        if self._listing_failed:
            log.info("PersistentVolumes can be listed again: removing the caches of deleted volumes")
        self._listing_failed = False
        self._seen |= live
        root = self.node.settings.cache_root / "volumes"
        try:
            bases = sorted(p for p in root.iterdir() if p.is_dir())
        except OSError:
            return []
        removed = []
        for base in bases:
            volume_id = self._volume_id(base)
            if volume_id is None or base.name != cache_dir_name(volume_id):
                continue
            if volume_id in live:
                (base / UNNAMED_MARK).unlink(missing_ok=True)
                continue
            why = self._why_gone(base, volume_id)
            if why is None:
                continue
            try:
                with self.node.locks.hold(f"volume {volume_id}"):
                    if self._in_use(base, volume_id):
                        continue
                    staged = [staged_changes(slot) for slot in base.glob("slot-*")]
                    if any(count is None for count in staged):
                        continue  # a daemon still holds a slot: in use
                    left = sum(count for count in staged if count is not None)
                    if left:
                        log.warning("volume %s no longer exists, but its cache %s holds %d written changes not in "
                                    "the bucket: kept (mount the source with this cache directory to upload them, or "
                                    "delete it by hand)", volume_id, base, left)
                        continue
                    size = _size(base)
                    shutil.rmtree(base, ignore_errors=True)
                    log.info("removed the cache of volume %s (%s, %.1f MiB): %s, and this node does not use it",
                             volume_id, base, size / (1 << 20), why)
                    removed.append(volume_id)
            except CsiError:
                continue  # a CSI call on this volume is in progress: next round
        return removed

    def _why_gone(self, base: Path, volume_id: str) -> str | None:
        """Why the cache of unnamed ``volume_id`` may go now, or None while it is kept (see above)."""
        if volume_id in self._seen:
            return f"its PersistentVolume of {self.driver_name} was deleted"
        mark = base / UNNAMED_MARK
        try:
            since = float(mark.read_text())
        except (OSError, ValueError):
            try:
                mark.write_text(f"{self.now():.0f}\n")
            except OSError as exc:
                log.warning("cannot write %s: %s; keeping the cache", mark, exc.strerror)
                return None
            log.info("volume %s: no PersistentVolume of %s names its cache %s; kept %.0f minutes for a reinstall to "
                     "make it again", volume_id, self.driver_name, base, self.grace_s / 60)
            return None
        if self.now() - since < self.grace_s:
            return None
        return f"no PersistentVolume of {self.driver_name} has named it for {(self.now() - since) / 60:.0f} minutes"

    def _volume_id(self, base: Path) -> str | None:
        for slot in sorted(base.glob("slot-*")):
            try:
                data = json.loads((slot / SLOT_RECORD).read_text())
            except (OSError, ValueError):
                continue
            if isinstance(data, dict) and isinstance(data.get("volume_id"), str):
                return str(data["volume_id"])
        return None

    def _in_use(self, base: Path, volume_id: str) -> bool:
        if self.node.records.load(cache_dir_name(volume_id)) is not None:
            return True  # staged on this node
        for slot in base.glob("slot-*"):
            try:
                data = json.loads((slot / SLOT_RECORD).read_text())
            except (OSError, ValueError):
                continue
            target = data.get("target") if isinstance(data, dict) else None
            if target and self.node.mounter.is_mounted(Path(target)):
                return True
        return False

    def start(self, interval_s: float = CACHE_SWEEP_INTERVAL_S) -> threading.Event:
        """Sweep every ``interval_s`` in a daemon thread; set the returned event to stop."""
        stop = threading.Event()

        def run() -> None:
            while not stop.wait(interval_s):
                try:
                    self.sweep()
                except Exception:  # noqa: BLE001 - the sweeper must outlive a bad round
                    log.exception("sweeping the caches of deleted volumes failed")

        threading.Thread(target=run, name="cache-janitor", daemon=True).start()
        return stop
