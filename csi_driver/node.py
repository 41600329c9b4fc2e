"""Node semantics: stage, publish, unpublish and unstage a volume, idempotently and self-repairing.

The CSI node plugin advertises STAGE_UNSTAGE_VOLUME: the kubelet stages each volume once per node
and publishes it into each pod; ``staging.py`` holds that design (one shared daemon per volume per
node, bind mounts into the pods). A publish without a staging path (the FlexVolume shim, or a CO
that does not stage) mounts cachefs directly at the target, one daemon per target, as described
here. **Direct publish** steps:

1. A mount already at the target that is healthy is the answer to a repeated call: success, as long
   as it was made read-only or not as this call asks (else ALREADY_EXISTS).
2. A broken mount at the target (its daemon died: every access fails with ENOTCONN, "Transport
   endpoint is not connected") is detached lazily and mounted again.
3. Otherwise the volume is checked against the driver's trust rules (``csi_driver.trust``: whose
   identity, which endpoints; checked wherever a daemon is started), the target directory is
   created if missing, must be an empty directory, and is mounted.

**Cache directories.** Each volume gets its own directory under the node cache root, named from its
volume id (sanitised, plus a hash so two ids never collide): volumes never share or see each other's
cache. Because the id of a persistent volume is stable, the disk tier survives the pod: the next pod
that mounts the volume on this node starts warm. Two pods of one volume on the same node at the same
time cannot share a disk tier (cachefs locks it), so a volume's directory holds numbered *slots*
(``slot-0``, ``slot-1``, ...); a publish takes the lowest slot no live mount uses, and most of the
time that is ``slot-0`` with everything the last pod cached. Each slot records which target it
serves (``publish.json``). The cache of an inline ephemeral volume (its id is new for every pod) is
deleted on unpublish.

**Unpublish** unmounts (``cachefs unmount`` flushes dirty data first; a broken mount is detached
lazily, there is nothing left to flush), then removes the target directory. A target that is
already gone, or not mounted, is success: the CO may repeat the call.

Calls for one volume are serialised; a call that finds another in progress for the same volume is
answered ABORTED, which the CO retries (the CSI spec's answer for concurrent operations).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import stat as stat_mod
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping

from csi_driver.attributes import (
    K8S_POD_NAME,
    K8S_POD_NAMESPACE,
    K8S_POD_UID,
    CacheOptions,
    Credentials,
    OwnerOptions,
    VolumeSettings,
)
from cachefs.cli.resources import directory_bytes
from csi_driver.errors import Code, CsiError, invalid
from csi_driver.mounter import BROKEN_ERRNOS, Mounter, MountRequest, probe_broken
from csi_driver.staging import StageRecord, StageRecords
from csi_driver.trust import VolumeTrust
from csi_driver.volume_id import MAX_VOLUME_ID_BYTES

log = logging.getLogger(__name__)

# Pods of one volume mounted on one node at the same time. Beyond this a publish is refused with
# RESOURCE_EXHAUSTED rather than filling the node's cache disk with ever more copies.
MAX_SLOTS_PER_VOLUME = 32
SLOT_RECORD = "publish.json"
# Longest readable part of a cache directory name (the hash that follows keeps names unique).
_CACHE_NAME_MAX = 80
_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]+")
MiB, GiB = 1 << 20, 1 << 30
# The smallest disk tier a diskCache share may come to; below it the volume is refused, not mounted
# with a disk tier too small to hold a working set.
MIN_DISK_CACHE_BYTES = 256 * MiB
# Target paths: longer than a volume id may be (PATH_MAX).
MAX_PATH_BYTES = 4096
# Binds stacked at one target at most: the pod's first and a live one (NodeOps._stack_bind); the
# bound on the loops that detach them (one found beyond it is left for the pod's end).
MAX_STACKED_BINDS = 8
# A recovery (NodeOps.recover) that finds a call on the volume in progress waits for it this long:
# that call (a publish) mounts the volume again itself, and a stage's mount is bounded at 130 s.
RECOVER_LOCK_WAIT_S = 140.0
RECOVER_POLL_S = 0.2


@dataclass(frozen=True)
class NodeSettings:
    node_id: str
    cache_root: Path
    max_volumes_per_node: int = 0  # 0: no limit reported to the CO
    state_dir: Path | None = None  # the stage records; None: <cache_root>/staged
    trust: VolumeTrust = field(default_factory=VolumeTrust)  # whose identity, which endpoints (csi_driver.trust)

    @property
    def stage_dir(self) -> Path:
        return self.state_dir if self.state_dir is not None else self.cache_root / "staged"


@dataclass(frozen=True)
class PublishRequest:
    volume_id: str
    target_path: Path
    volume: VolumeSettings
    read_only: bool  # the effective mode: the request, the access mode and the volume's own attribute
    credentials: Credentials | None = None
    context: Mapping[str, str] = field(default_factory=dict)  # the CO's pod info (csi.storage.k8s.io/pod.*)


def pod_of(context: Mapping[str, str]) -> dict[str, str]:
    """The pod a publish is for, from its pod info (podInfoOnMount): namespace, name, uid; {} if unnamed."""
    namespace, name = context.get(K8S_POD_NAMESPACE, ""), context.get(K8S_POD_NAME, "")
    if not namespace or not name:
        return {}
    return {"namespace": namespace, "name": name, "uid": context.get(K8S_POD_UID, "")}


def describe_owner(owner: OwnerOptions) -> str:
    """Owner options as a person writes them: ``uid 1000, gid 2000, file mode 0664``; modes in octal."""
    parts = [f"{label} {format(value, fmt)}" for label, value, fmt in (
        ("uid", owner.uid, "d"), ("gid", owner.gid, "d"), ("file mode", owner.file_mode, "04o"),
        ("dir mode", owner.dir_mode, "04o")) if value is not None]
    return ", ".join(parts) or "the defaults (no uid, gid or modes set)"


def check_volume_id(volume_id: str) -> str:
    if not volume_id:
        raise invalid("volume_id is required")
    if len(volume_id.encode()) > MAX_VOLUME_ID_BYTES or "\x00" in volume_id:
        raise invalid(f"volume_id must be at most {MAX_VOLUME_ID_BYTES} bytes without NUL characters")
    return volume_id


def check_target_path(path: str, name: str = "target_path") -> Path:
    if not path:
        raise invalid(f"{name} is required")
    if not os.path.isabs(path) or "\x00" in path or len(path.encode()) > MAX_PATH_BYTES:
        raise invalid(f"{name} must be an absolute path, got {path[:200]!r}")
    if any(part in (".", "..") for part in path.split("/")):
        raise invalid(f"{name} must not contain '.' or '..' components, got {path[:200]!r}")
    return Path(os.path.normpath(path))


def cache_dir_name(volume_id: str) -> str:
    """A directory name for a volume: readable, filesystem-safe, and unique per id."""
    readable = _UNSAFE_CHARS.sub("_", volume_id).strip("._")[:_CACHE_NAME_MAX] or "volume"
    return f"{readable}-{hashlib.sha256(volume_id.encode()).hexdigest()[:16]}"


class VolumeLocks:
    """One non-blocking lock per key: a second concurrent operation on a volume gets ABORTED."""

    def __init__(self) -> None:
        self._held: set[str] = set()
        self._guard = threading.Lock()

    @contextlib.contextmanager
    def hold(self, key: str) -> Iterator[None]:
        with self._guard:
            if key in self._held:
                raise CsiError(Code.ABORTED, f"an operation on {key} is already in progress")
            self._held.add(key)
        try:
            yield
        finally:
            with self._guard:
                self._held.discard(key)


def _path_state(path: Path) -> str:
    """``missing``, ``broken``, ``dir`` or ``other``, without following a dead FUSE mount."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        if exc.errno in BROKEN_ERRNOS:
            return "broken"
        raise CsiError(Code.INTERNAL, f"cannot inspect {path}: {exc.strerror}") from None
    if not stat_mod.S_ISDIR(st.st_mode):
        return "other"
    return "broken" if probe_broken(path) else "dir"


class NodeOps:
    """NodePublishVolume / NodeUnpublishVolume semantics over a ``Mounter``."""

    def __init__(self, settings: NodeSettings, mounter: Mounter) -> None:
        self.settings = settings
        self.mounter = mounter
        self.locks = VolumeLocks()
        self.records = StageRecords(settings.stage_dir)
        # Told of each pod target whose bind could not be restored after its volume's daemon was
        # replaced: (volume id, the pod as its publish named it, the message). Pod mode reports it
        # as an Event on that pod (podwatch.take_over); the log line is written either way.
        self.on_unrestored: Callable[[str, Mapping[str, str], str], None] | None = None

    # -- start-up -----------------------------------------------------------------------------------
    def adopt(self) -> list[StageRecord]:
        """Take up the volumes a previous run of the plugin staged: report each one's state, and drop
        from its record the targets that are no longer mounted, and have the mounter serve again what
        the live mounts need of it (``Mounter.resume``). Nothing is mounted or unmounted."""
        self.mounter.resume()
        found = self.records.all()
        for record in found:
            staging = Path(record.staging_path)
            if not self.mounter.is_mounted(staging):
                state = "not mounted (its first publish will mount it)"
            elif self.mounter.is_broken(staging):
                state = "BROKEN (its daemon died; the next publish mounts it again)"
            else:
                state = "healthy"
            live = {t: ro for t, ro in record.targets.items() if self.mounter.is_mounted(Path(t))}
            if live != record.targets:
                record.targets = live
                record.pods = {t: pod for t, pod in record.pods.items() if t in live}
                self.records.save(cache_dir_name(record.volume_id), record)
            log.info("adopted staged volume %s at %s: %s, %d target(s)", record.volume_id, staging, state, len(live))
        self._report_reused_caches({cache_dir_name(record.volume_id) for record in found})
        return found

    def _report_reused_caches(self, adopted: set[str]) -> None:
        """Say so when the cache root holds volumes' disk caches that no live mount of this node uses:
        an earlier install (an uninstall leaves them on the node) or an earlier run left them, and
        the next mount of those volumes serves their blocks (deploy/README.md, "Uninstall")."""
        root = self.settings.cache_root / "volumes"
        try:
            entries = sorted(p for p in root.iterdir() if p.is_dir() and p.name not in adopted)
        except OSError:
            return

        def in_use(volume_dir: Path) -> bool:
            targets = [str(data["target"]) for slot in volume_dir.glob("slot-*")
                       if (data := _read_record(slot)) and data.get("target")]
            return any(self.mounter.is_mounted(Path(target)) for target in targets)

        left = [p for p in entries if not in_use(p)]
        if left:
            log.info("reusing the disk caches of %d volume(s) found under %s from an earlier install or run "
                     "(their blocks serve the next mounts of those volumes; to start cold, remove %s on the node "
                     "while no cachefs volume is mounted there)", len(left), root, root)

    def bound_targets(self) -> dict[str, str]:
        """Every pod target bound to a staged volume on this node -> the volume id (for the metrics)."""
        return {target: record.volume_id for record in self.records.all() for target in record.targets}

    def workloads(self, volume_id: str) -> list[dict[str, str]]:
        """The pods bound to staged volume ``volume_id`` on this node, as their publishes named them."""
        record = self.records.load(cache_dir_name(volume_id))
        return list(record.pods.values()) if record is not None else []

    # -- stage --------------------------------------------------------------------------------------
    def stage(self, request: PublishRequest) -> None:
        """Stage ``request.volume_id`` at ``request.target_path`` (the staging path)."""
        staging = request.target_path
        key = cache_dir_name(request.volume_id)
        with self.locks.hold(f"volume {request.volume_id}"), self.locks.hold(f"target {staging}"):
            record = self.records.load(key)
            if record is not None:
                if (record.staging_path, record.read_only, record.owner) != (str(staging), request.read_only,
                                                                             request.volume.owner):
                    raise CsiError(Code.ALREADY_EXISTS,
                                   f"volume {request.volume_id} is already staged at {record.staging_path} "
                                   "with another staging path, read-only mode or owner")
            else:
                state = _path_state(staging)
                if state == "missing":
                    self._prepare_target(staging)
                elif state == "other":
                    raise CsiError(Code.FAILED_PRECONDITION, f"{staging} exists and is not a directory")
                record = StageRecord(request.volume_id, str(staging), request.read_only, request.volume.owner,
                                     request.volume.source)
                self.records.save(key, record)
            if request.credentials is not None:
                self._ensure_staged_mount(request, record)
            else:
                log.info("staged volume %s at %s; the first publish mounts it (with its own credentials, "
                         "if any)", request.volume_id, staging)

    def _ensure_staged_mount(self, request: PublishRequest, record: StageRecord) -> None:
        """The staged mount, healthy: mounted now if missing, mounted again if its daemon died."""
        staging = Path(record.staging_path)
        if self.mounter.is_mounted(staging):
            if not self.mounter.is_broken(staging):
                return
            log.warning("volume %s: the staged mount at %s is broken (its daemon died); mounting it again",
                        record.volume_id, staging)
            self.mounter.unmount(staging)  # a broken mount is detached lazily
        elif _path_state(staging) == "broken":
            raise CsiError(Code.FAILED_PRECONDITION, f"{staging} is a dead mount of another filesystem")
        self.settings.trust.check(record.volume_id, request.volume, request.credentials)
        self._prepare_target(staging)
        staged = PublishRequest(record.volume_id, staging, request.volume, record.read_only, request.credentials,
                                request.context)
        cache_dir = self._claim_slot(staged)
        cache = self._sized_cache(record.volume_id, request.volume.cache, cache_dir)
        self.mounter.mount(MountRequest(
            source=request.volume.source, target=staging, cache_dir=cache_dir,
            endpoint_url=request.volume.endpoint_url, region=request.volume.region, cache=cache,
            read_only=record.read_only, credentials=request.credentials, owner=record.owner,
            volume_id=record.volume_id, context=request.context, pod_resources=request.volume.mount_pod,
        ))
        log.info("mounted volume %s (%s) at staging path %s%s, cache %s", record.volume_id, request.volume.source,
                 staging, " read-only" if record.read_only else "", cache_dir)
        self._restore_binds(record, skip=request.target_path)

    def recover(self, staging: Path) -> bool:
        """The daemon of the staged mount at ``staging`` died (its mount pod ended): mount it again with
        a new daemon given what the first one had (``Mounter.relaunch``; no request, so no credentials
        in hand) and stack a fresh bind on every pod's target, so running pods read on without a new
        pod or publish. True once done (or nothing was broken); False where it could not be, each pod
        then told (``on_unrestored``). Waits, bounded, for a call on the volume in progress."""
        record = next((r for r in self.records.all() if r.staging_path == str(staging)), None)
        if record is None:
            return False  # not a staged volume of this plugin (or unstaged meanwhile)
        key = cache_dir_name(record.volume_id)
        deadline = time.monotonic() + RECOVER_LOCK_WAIT_S
        while True:
            try:
                with self.locks.hold(f"volume {record.volume_id}"), self.locks.hold(f"target {staging}"):
                    return self._recover(key, staging)
            except CsiError as exc:
                if exc.code != Code.ABORTED or time.monotonic() >= deadline:
                    raise
            time.sleep(RECOVER_POLL_S)

    def _recover(self, key: str, staging: Path) -> bool:
        record = self.records.load(key)
        if record is None or record.staging_path != str(staging) or not self.mounter.is_mounted(staging):
            return True  # unstaged, or unmounted on purpose meanwhile: nothing to restore
        if self.mounter.is_broken(staging):
            try:
                self.mounter.relaunch(staging)
            except CsiError as exc:
                for target, pod in sorted(record.pods.items()):
                    message = (f"volume {record.volume_id}: its mount pod died and a new one could not serve it "
                               f"({exc.message}); the mount at {target} stays broken until the volume is published "
                               "again on this node (restart the pod)")
                    if self.on_unrestored is not None and pod:
                        self.on_unrestored(record.volume_id, pod, message)
                log.error("volume %s: cannot mount %s again after its daemon died: %s", record.volume_id, staging,
                          exc.message)
                return False
            log.info("volume %s: mounted %s again after its daemon died", record.volume_id, staging)
        return self._restore_binds(record, skip=None)

    def _stack_bind(self, staging: Path, target: Path, read_only: bool) -> None:
        """Bind the staged mount at ``target`` ON TOP of the dead bind there, never in its place: a
        container holds the bind its pod started with (rslave, ``mountPropagation: HostToContainer``)
        and receives mounts made on top of it, not the replacement of it (issue 36). A dead layer
        stacked by an earlier recovery is detached first, so at most two stay: the pod's first bind
        (which only the pod's end frees) and the live one."""
        for _ in range(MAX_STACKED_BINDS):
            if self.mounter.layers(target) <= 1 or not self.mounter.is_broken(target):
                break
            self.mounter.unbind(target)  # the top layer, dead: detached lazily (and in the containers)
        self.mounter.bind(staging, target, read_only)

    def _restore_binds(self, record: StageRecord, skip: Path | None) -> bool:
        """After the staged mount was made again (its daemon, or mount pod, had died): a fresh bind is
        stacked on every target of the volume on this node still showing the dead mount, so pods
        already running get their volume back without a restart (they see it where their volume
        mount propagates from the host: ``mountPropagation: HostToContainer``). A target that cannot
        be restored stays broken, logged here, told to ``on_unrestored`` and counted in
        ``cachefs_csi_mounts{state="broken"}`` until its pod is gone. ``skip``: the target of the
        publish in progress (it binds its own). True when every target was restored."""
        staging = Path(record.staging_path)
        restored = True
        for target, read_only in sorted(record.targets.items()):
            path = Path(target)
            if path == skip or not self.mounter.is_mounted(path) or not self.mounter.is_broken(path):
                continue
            pod = record.pods.get(target, {})
            who = f"pod {pod.get('namespace')}/{pod.get('name')}" if pod.get("name") else "its pod"
            try:
                self._stack_bind(staging, path, read_only)
            except CsiError as exc:
                restored = False
                message = (f"volume {record.volume_id}: cannot restore the bind at {target} ({who}) after its daemon "
                           f"was replaced: {exc.message}; it stays broken until that pod restarts")
                log.error("%s", message)
                if self.on_unrestored is not None and pod:
                    self.on_unrestored(record.volume_id, pod, message)
                continue
            log.info("volume %s: restored the bind at %s (%s%s) from the new staged mount", record.volume_id,
                     target, who, ", read-only" if read_only else "")
        return restored

    def unstage(self, volume_id: str, staging: Path) -> None:
        key = cache_dir_name(volume_id)
        with self.locks.hold(f"volume {volume_id}"), self.locks.hold(f"target {staging}"):
            record = self.records.load(key)
            if record is not None and record.staging_path != str(staging):
                raise CsiError(Code.FAILED_PRECONDITION,
                               f"volume {volume_id} is staged at {record.staging_path}, not {staging}")
            users = [t for t in (record.targets if record else {}) if self.mounter.is_mounted(Path(t))]
            if users:
                raise CsiError(Code.FAILED_PRECONDITION,
                               f"volume {volume_id} is still published at {', '.join(sorted(users))}")
            if self.mounter.is_mounted(staging):
                self.mounter.unmount(staging)  # flushes written data first
                log.info("unstaged volume %s: unmounted %s", volume_id, staging)
            if _path_state(staging) == "broken":
                raise CsiError(Code.INTERNAL, f"{staging} is still a dead mount after unmounting")
            self._release_slot(volume_id, str(staging))
            self.records.remove(key)

    # -- publish of a staged volume -----------------------------------------------------------------
    def publish_staged(self, request: PublishRequest, staging: Path) -> None:
        """Bind the staged mount of ``request.volume_id`` at the pod's target."""
        target = request.target_path
        key = cache_dir_name(request.volume_id)
        with self.locks.hold(f"volume {request.volume_id}"), self.locks.hold(f"target {target}"):
            record = self.records.load(key)
            if record is None or record.staging_path != str(staging):
                raise CsiError(Code.FAILED_PRECONDITION, f"volume {request.volume_id} is not staged at {staging}")
            if record.read_only and not request.read_only:
                raise CsiError(Code.FAILED_PRECONDITION,
                               f"volume {request.volume_id} is staged read-only; a writable publish needs a "
                               "writable stage")
            if record.owner != request.volume.owner:
                raise CsiError(Code.FAILED_PRECONDITION,
                               f"volume {request.volume_id} is staged with owner {describe_owner(record.owner)}, this "
                               f"publish asks for {describe_owner(request.volume.owner)}: pods sharing a volume on a node share its owner "
                               "(fsGroup, uid, gid, modes)")
            self._ensure_staged_mount(request, record)
            if self.mounter.is_mounted(target):
                if not self.mounter.is_broken(target):
                    if record.targets.get(str(target)) == request.read_only:
                        log.info("volume %s is already published at %s", request.volume_id, target)
                        return
                    raise CsiError(Code.ALREADY_EXISTS,
                                   f"{target} is already published with another volume or read-only mode")
                log.warning("volume %s: the bind at %s is broken (its daemon died); binding it again",
                            request.volume_id, target)
                self._stack_bind(staging, target, request.read_only)
            elif _path_state(target) == "broken":
                raise CsiError(Code.FAILED_PRECONDITION, f"{target} is a dead mount of another filesystem")
            else:
                self._prepare_target(target)
                self.mounter.bind(staging, target, request.read_only)
            record.targets[str(target)] = request.read_only
            workload = pod_of(request.context)
            if workload:
                record.pods[str(target)] = workload
            self.records.save(key, record)
            log.info("published staged volume %s at %s%s", request.volume_id, target,
                     " (read-only bind)" if request.read_only else "")

    # -- publish ------------------------------------------------------------------------------------
    def publish(self, request: PublishRequest) -> None:
        target = request.target_path
        with self.locks.hold(f"volume {request.volume_id}"), self.locks.hold(f"target {target}"):
            if self.mounter.is_mounted(target):
                if not self.mounter.is_broken(target):
                    self._check_compatible(request)
                    log.info("volume %s is already published at %s", request.volume_id, target)
                    return
                log.warning("volume %s: the mount at %s is broken (its daemon died); mounting it again",
                            request.volume_id, target)
                self.mounter.unmount(target)
            elif _path_state(target) == "broken":
                # A FUSE mount the mount table no longer lists as cachefs (or another driver's).
                raise CsiError(Code.FAILED_PRECONDITION, f"{target} is a dead mount of another filesystem")
            self.settings.trust.check(request.volume_id, request.volume, request.credentials)
            self._prepare_target(target)
            cache_dir = self._claim_slot(request)
            cache = self._sized_cache(request.volume_id, request.volume.cache, cache_dir)
            self.mounter.mount(MountRequest(
                source=request.volume.source,
                target=target,
                cache_dir=cache_dir,
                endpoint_url=request.volume.endpoint_url,
                region=request.volume.region,
                cache=cache,
                read_only=request.read_only,
                credentials=request.credentials,
                owner=request.volume.owner,
                volume_id=request.volume_id,
                context=request.context,
                pod_resources=request.volume.mount_pod,
            ))
            log.info("published volume %s (%s) at %s%s, cache %s", request.volume_id, request.volume.source,
                     target, " read-only" if request.read_only else "", cache_dir)

    def _check_compatible(self, request: PublishRequest) -> None:
        record = self._find_record(str(request.target_path), request.volume_id)
        if record is None:
            return  # mounted before records existed, or by hand: nothing to compare with
        _, data = record
        if data.get("volume_id") != request.volume_id or bool(data.get("read_only")) != request.read_only:
            raise CsiError(Code.ALREADY_EXISTS,
                           f"{request.target_path} is already published with another volume or read-only mode")

    def _prepare_target(self, target: Path) -> None:
        state = _path_state(target)
        if state == "missing":
            try:
                target.mkdir(mode=0o750, parents=True, exist_ok=True)
            except OSError as exc:
                raise CsiError(Code.INTERNAL, f"cannot create {target}: {exc.strerror}") from None
            return
        if state != "dir":
            raise CsiError(Code.FAILED_PRECONDITION, f"{target} exists and is not a directory")
        try:
            with os.scandir(target) as entries:
                if any(True for _ in entries):
                    raise CsiError(Code.FAILED_PRECONDITION, f"{target} is not empty")
        except OSError as exc:
            raise CsiError(Code.INTERNAL, f"cannot read {target}: {exc.strerror}") from None

    # -- the disk cache's size ----------------------------------------------------------------------
    def _sized_cache(self, volume_id: str, cache: CacheOptions, slot: Path) -> CacheOptions:
        """``cache`` with a disk tier that fits this node, or RESOURCE_EXHAUSTED before any daemon (or
        mount pod) is started: a ``diskCache`` share (``"50%"``) becomes that share of the room on
        the cache filesystem (its free space plus what this volume's slot holds already); a size is
        checked against that room as ``cachefs mount`` would check it. The refusal's message is the
        same on every retry (sizes rounded to GiB), so the kubelet's Events fold into one, and has no
        ``%``: the Event would show it as a sign no StorageClass accepts (``errors.for_kubernetes``)."""
        if cache.disk_share_percent is None and not cache.disk_bytes:
            return cache
        try:
            st = os.statvfs(slot)
        except OSError as exc:
            raise CsiError(Code.INTERNAL, f"cannot read the free space of {slot}: {exc.strerror}") from None
        free = st.f_bavail * st.f_frsize
        held = 0 if cache.disk_bytes and cache.disk_bytes <= free else directory_bytes(slot)
        room = free + held
        if cache.disk_share_percent is not None:
            size = int(room * cache.disk_share_percent / 100) // MiB * MiB
            if size >= MIN_DISK_CACHE_BYTES:
                log.info("volume %s: diskCache %g%% of %.1f GiB of room on the node's cache disk is %d MiB",
                         volume_id, cache.disk_share_percent, room / GiB, size // MiB)
                return dataclasses.replace(cache, disk_bytes=size, disk_share_percent=None)
            asked = f"diskCache {cache.disk_share_percent:g} percent (less than {MIN_DISK_CACHE_BYTES // MiB} MiB here)"
        elif cache.disk_bytes is not None and cache.disk_bytes > room:
            asked = f"diskCache {cache.disk_bytes / GiB:.1f} GiB"
        else:
            return cache
        raise CsiError(Code.RESOURCE_EXHAUSTED,
                       f"volume {volume_id}: {asked} does not fit this node's cache disk ({room / GiB:.0f} GiB free "
                       f"for it, at {self.settings.cache_root}); give the volume a smaller diskCache, or a share of "
                       "the free space in percent, as the default StorageClass cachefs does (a StorageClass's "
                       "parameters cannot change: a new StorageClass, or a PersistentVolume's volumeAttributes)")

    # -- cache slots --------------------------------------------------------------------------------
    def volume_cache_dir(self, volume_id: str) -> Path:
        return self.settings.cache_root / "volumes" / cache_dir_name(volume_id)

    def _claim_slot(self, request: PublishRequest) -> Path:
        base = self.volume_cache_dir(request.volume_id)
        for index in range(MAX_SLOTS_PER_VOLUME):
            slot = base / f"slot-{index}"
            data = _read_record(slot)
            holder = data.get("target") if data else None
            if holder and holder != str(request.target_path) and self.mounter.is_mounted(Path(holder)):
                continue
            try:
                slot.mkdir(mode=0o700, parents=True, exist_ok=True)
                _write_record(slot, {
                    "volume_id": request.volume_id,
                    "target": str(request.target_path),
                    "read_only": request.read_only,
                    "ephemeral": request.volume.ephemeral,
                    "source": request.volume.source,
                })
            except OSError as exc:
                raise CsiError(Code.INTERNAL, f"cannot prepare the cache directory {slot}: {exc.strerror}") from None
            return slot
        raise CsiError(Code.RESOURCE_EXHAUSTED,
                       f"volume {request.volume_id} is already mounted {MAX_SLOTS_PER_VOLUME} times on this node")

    def _find_record(self, target: str, volume_id: str | None) -> tuple[Path, dict] | None:
        """The slot serving ``target`` (searching every volume when ``volume_id`` is None)."""
        if volume_id is not None:
            bases = [self.volume_cache_dir(volume_id)]
        else:
            try:
                bases = sorted((self.settings.cache_root / "volumes").iterdir())
            except OSError:
                return None
        for base in bases:
            try:
                slots = sorted(base.glob("slot-*"))
            except OSError:
                continue
            for slot in slots:
                data = _read_record(slot)
                if data and data.get("target") == target:
                    return slot, data
        return None

    # -- unpublish ----------------------------------------------------------------------------------
    def unpublish(self, volume_id: str | None, target_path: Path) -> None:
        """Unmount ``target_path`` and remove it. ``volume_id`` is None for the FlexVolume shim."""
        target = target_path
        volume_lock = self.locks.hold(f"volume {volume_id}") if volume_id else contextlib.nullcontext()
        with volume_lock, self.locks.hold(f"target {target}"):
            record = self.records.load(cache_dir_name(volume_id)) if volume_id else None
            bound = record is not None and str(target) in record.targets
            if self.mounter.is_mounted(target):
                if bound or self._find_record(str(target), volume_id) is None:
                    # A bind of a staged mount (or a mount this plugin did not make directly): remove
                    # the binds alone, every layer a recovery stacked; `cachefs unmount` would stop the
                    # daemon every other pod shares.
                    layers = 0
                    while self.mounter.is_mounted(target) and layers < MAX_STACKED_BINDS:
                        self.mounter.unbind(target)
                        layers += 1
                    log.info("removed the bind mount %s (%d layer%s)", target, layers, "" if layers == 1 else "s")
                else:
                    self.mounter.unmount(target)
                    log.info("unmounted %s", target)
            state = _path_state(target)
            if state == "broken":
                raise CsiError(Code.INTERNAL, f"{target} is still a dead mount after unmounting")
            if state == "dir":
                try:
                    target.rmdir()
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    if exc.errno == errno.ENOTEMPTY:
                        # Not ours to delete: something wrote into the directory under the mount.
                        raise CsiError(Code.FAILED_PRECONDITION,
                                       f"{target} is not empty after unmounting; leaving it in place") from None
                    raise CsiError(Code.INTERNAL, f"cannot remove {target}: {exc.strerror}") from None
            elif state == "other":
                raise CsiError(Code.FAILED_PRECONDITION, f"{target} is not a directory")
            if bound and record is not None and volume_id:
                del record.targets[str(target)]
                record.pods.pop(str(target), None)
                self.records.save(cache_dir_name(volume_id), record)
                return
            self._release_slot(volume_id, str(target))

    def _release_slot(self, volume_id: str | None, target: str) -> None:
        found = self._find_record(target, volume_id)
        if found is None:
            return
        slot, data = found
        if data.get("ephemeral"):
            # An inline volume's id is unique to its pod: nobody will mount this cache again.
            shutil.rmtree(slot, ignore_errors=True)
            try:
                slot.parent.rmdir()  # the volume's directory, once its last slot is gone
            except OSError:
                pass
            log.info("removed the cache of ephemeral volume %s", data.get("volume_id"))
            return
        data["target"] = None  # the slot is free; its cache stays for the next pod on this node
        try:
            _write_record(slot, data)
        except OSError as exc:
            log.warning("cannot update %s: %s", slot / SLOT_RECORD, exc.strerror)


def _read_record(slot: Path) -> dict | None:
    try:
        data = json.loads((slot / SLOT_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_record(slot: Path, data: dict) -> None:
    tmp = slot / (SLOT_RECORD + ".tmp")
    tmp.write_text(json.dumps(data, sort_keys=True) + "\n")
    os.replace(tmp, slot / SLOT_RECORD)
