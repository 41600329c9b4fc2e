"""What the node plugin does with its mount pods beyond starting and stopping them (``take_over``).

At start-up of ``cachefs-csi --mount-mode pod`` the plugin takes over its node's mount pods: it adopts
those that serve a staged volume or a cachefs mount still in the mount table and deletes the others
(``PodLauncher.cleanup``, retried in the background while the API server does not answer), then
watches them (``PodLauncher.watch``). Each pod that ended is checked once, in a thread of its own
(``_OncePerPod``), by two reporters:

- ``BrokenMountReporter``: a pod that died while its mount is still in the mount table and answers
  ENOTCONN is a broken mount: a log line and a Kubernetes Event on the mount pod and on every
  workload pod bound to the volume on this node; then the volume is **recovered** (``NodeOps.recover``):
  a new mount pod, with the Secret of the first, serves the staged mount again and a fresh bind is
  stacked on every pod's target, so running pods read on (those whose volume mount has
  ``mountPropagation: HostToContainer``); a pod that cannot be restored gets ``CachefsMountNotRestored``.
  A mount that goes on answering for ``SETTLE_S`` is taken as served by a new pod.
- ``StagedWritesReporter``: a pod that ended with changes still journaled in its cache directory
  (its daemon could not upload them within its stop timeout) gets an Event ``CachefsWritesStaged``
  on the workload pods and ``cachefs_csi_mount_pods_ended_with_staged_writes_total``.

Split from ``csi_driver.mountpods`` (which makes, deletes and watches the pods through the API) so
that each stays within the project's file bound; nothing here calls the Kubernetes API directly.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from csi_driver import metrics
from csi_driver.errors import CsiError
from csi_driver.mountpods import TERMINATION_GRACE_S, WATCH_RETRY_S, PodLauncher, PodState

if TYPE_CHECKING:
    from csi_driver.node import NodeOps

log = logging.getLogger(__name__)

# How long a dead or deleted pod's mount may go on answering before it is taken as served by a new
# pod: the old process's grace period (SIGTERM to SIGKILL) and a little more.
SETTLE_POLL_S = 0.5
SETTLE_S = TERMINATION_GRACE_S + 5.0
# How long after a mount pod ended or was deleted its daemon may still hold its cache directory
# (uploading within its stop timeout) before the staged-writes check gives up; a volume's own
# stopTimeout longer than the default is waited for too (``StagedWritesReporter``).
STAGED_CHECK_SLACK_S = 15.0
STAGED_POLL_S = 0.5


@dataclass(frozen=True)
class WorkloadPod:
    """A pod that uses a volume on this node, as ``podInfoOnMount`` named it in its publish."""

    namespace: str
    name: str
    uid: str = ""


class _OncePerPod:
    """What both reporters share: each ended mount pod (by uid) is checked once, in a thread of its own,
    so a check that waits (a mount slow to answer, a daemon still holding its cache) never holds the
    watch. Subclasses say which events concern them (``_wants``) and what the check does (``_check``)."""

    def __init__(self) -> None:
        self._seen: set[str] = set()  # uids checked or being checked
        self._done: dict[str, threading.Event] = {}  # uid -> set once its check has run
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _wants(self, event_type: str, state: PodState) -> bool:
        raise NotImplementedError

    def _check(self, event_type: str, state: PodState) -> None:
        raise NotImplementedError

    def observe(self, event_type: str, state: PodState) -> None:
        if not self._wants(event_type, state):
            return
        with self._lock:
            if state.uid in self._seen:
                return
            self._seen.add(state.uid)
            done = self._done[state.uid] = threading.Event()

            def check() -> None:
                try:
                    self._check(event_type, state)
                finally:
                    done.set()

            thread = threading.Thread(target=check, daemon=True, name=f"{type(self).__name__} {state.name}")
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def wait_checked(self, uid: str, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until the check of the pod ``uid`` has run, if one was started."""
        with self._lock:
            done = self._done.get(uid)
        if done is not None:
            done.wait(timeout_s)

    def join(self, timeout_s: float) -> None:
        """Wait for the checks in flight (tests)."""
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout_s)


class BrokenMountReporter(_OncePerPod):
    """Turns a dead mount pod into a log line and Events, once per pod (by uid).

    ``is_mounted(target)``/``is_broken(target)``: the pod's mount in the mount table, and whether it
    answers ENOTCONN. A pod whose mount is gone (unstage unmounts before it deletes the pod) is not
    news. One whose mount still answers is watched a little longer (``SETTLE_S``): a deleted pod's
    process may still be stopping. Each check runs in a thread of its own, so a mount that is slow to
    answer never holds the watch. ``workloads_of(volume_id)``: the pods bound to the volume on this
    node. ``on_broken(volume_id)``: for the caller's counters. ``recover(target)``: mount it again
    (``NodeOps.recover``), after the report; None: the next publish does."""

    def __init__(self, launcher: PodLauncher, is_mounted: Callable[[Path], bool], is_broken: Callable[[Path], bool],
                 workloads_of: Callable[[str], Sequence[WorkloadPod]],
                 on_broken: Callable[[str], None] = lambda volume_id: None, settle_s: float | None = None,
                 recover: Callable[[Path], bool] | None = None,
                 before_recover: Callable[[PodState], None] = lambda state: None,
                 mounting: Callable[[Path], bool] = lambda target: False) -> None:
        self.launcher = launcher
        self.mounting = mounting
        self.recover = recover
        self.before_recover = before_recover
        self.is_mounted = is_mounted
        self.is_broken = is_broken
        self.workloads_of = workloads_of
        self.on_broken = on_broken
        self.settle_s = SETTLE_S if settle_s is None else settle_s
        super().__init__()

    def _wants(self, event_type: str, state: PodState) -> bool:
        return (event_type == "DELETED" or state.dead) and bool(state.target)

    def _check(self, event_type: str, state: PodState) -> None:
        target = Path(state.target)
        if self.mounting(target):  # it died before it ever served: the mount in progress fails, and says why
            log.info("mount pod %s ended before it served %s: not a broken mount", state.name, target)
            return
        deadline = time.monotonic() + self.settle_s
        while self.is_mounted(target) and not self.is_broken(target):
            if time.monotonic() >= deadline:
                return  # still served: a replaced pod's mount, remade before the old pod went
            time.sleep(SETTLE_POLL_S)
        if not self.is_mounted(target):
            return  # unmounted first (unstage), or never mounted: nothing is broken
        self._report(event_type, state)
        if self.recover is None:
            return
        self.before_recover(state)
        try:
            recovered = self.recover(target)
        except CsiError as exc:
            log.error("volume %s: recovering %s after its mount pod ended failed: %s", state.volume_id, target, exc)
            return
        if recovered:
            log.info("volume %s: recovered %s after mount pod %s ended", state.volume_id, target, state.name)

    def _report(self, event_type: str, state: PodState) -> None:
        # A pod deleted (kubectl delete pod, an eviction) ends too, and its kubelet reports that first.
        deleted = event_type == "DELETED" or state.deleting
        why = "was deleted" if deleted else f"ended ({state.terminated})"
        then = ("the node plugin is starting a new mount pod, and pods whose volume mount has mountPropagation "
                "HostToContainer read on once it serves; any other pod needs a restart" if self.recover is not None
                else "until the volume is published again on this node (restart the pods that use it)")
        message = (f"cachefs mount pod {state.name} of volume {state.volume_id} {why}: its mount at {state.target} "
                   f"is broken (Transport endpoint is not connected); {then}")
        log.error("%s", message)
        self.on_broken(state.volume_id)
        if not deleted:
            self.launcher.event(self.launcher.settings.namespace, state.name, state.uid, "MountPodDied", message)
        for workload in self.workloads_of(state.volume_id):
            self.launcher.event(workload.namespace, workload.name, workload.uid, "CachefsMountBroken", message)


class StagedWritesReporter(_OncePerPod):
    """Says when a mount pod ended leaving writes on this node: an Event on every workload pod bound to
    the volume here (and on the mount pod while it exists), a log line, and the counter of
    ``csi_driver.metrics``.

    A stopping daemon uploads what is pending first, within its stop timeout (``cachefs.daemon.stopping``);
    what it could not upload stays journaled in the volume's cache directory until the next mount of the
    volume on this node. The check waits until no daemon holds that directory (its lock), bounded by
    ``wait_s`` (the grace period and a margin), then counts the journal records (``cachefs.admin.staged_changes``).
    Once per pod (by uid), in a thread of its own."""

    def __init__(self, launcher: PodLauncher, workloads_of: Callable[[str], Sequence[WorkloadPod]],
                 on_left: Callable[[str, int], None] = lambda volume_id, count: None,
                 wait_s: float = SETTLE_S + STAGED_CHECK_SLACK_S) -> None:
        self.launcher = launcher
        self.workloads_of = workloads_of
        self.on_left = on_left
        self.wait_s = wait_s
        super().__init__()

    def _wants(self, event_type: str, state: PodState) -> bool:
        return (event_type == "DELETED" or state.dead or state.deleting) and bool(state.cache_dir)

    def _check(self, event_type: str, state: PodState) -> None:
        from cachefs.admin import staged_changes

        deadline = time.monotonic() + self.wait_s
        while (count := staged_changes(Path(state.cache_dir))) is None:
            if time.monotonic() >= deadline:
                log.warning("mount pod %s ended, but a daemon still holds %s after %g s; not checking it for "
                            "staged writes", state.name, state.cache_dir, self.wait_s)
                return
            time.sleep(STAGED_POLL_S)
        if count == 0:
            return
        message = (f"cachefs mount pod {state.name} of volume {state.volume_id} ended with {count} written changes "
                   f"not in the bucket: they stay journaled in {state.cache_dir} on node "
                   f"{self.launcher.settings.node_name} and are uploaded by the next mount of the volume on this "
                   "node (see the mount pod's log for which files)")
        log.error("%s", message)
        self.on_left(state.volume_id, count)
        if event_type != "DELETED" and not state.deleting:
            self.launcher.event(self.launcher.settings.namespace, state.name, state.uid, "WritesStaged", message)
        for workload in self.workloads_of(state.volume_id):
            self.launcher.event(workload.namespace, workload.name, workload.uid, "CachefsWritesStaged", message)


def _spec_target(run_root: Path, name: str) -> str | None:
    """The target of daemon ``name`` from its saved spec (``HandoverMounter``), None if unreadable."""
    try:
        return str(json.loads((run_root / f"{name}.spec.json").read_text())["target"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def take_over(launcher: PodLauncher, node: NodeOps, run_root: Path | None = None) -> threading.Event:
    """At plugin start-up: adopt this node's mount pods that serve a staged volume (a stage record)
    or a cachefs mount still in the mount table, delete the others and (by name) Secrets without a pod, then
    watch. Returns the watcher's stop event. An API server that cannot be reached does not stop the
    plugin (unpublish and unstage of mounted volumes need no API): the take-over is retried by the
    watcher thread until it succeeds."""
    mounter = node.mounter

    def cleanup() -> None:
        staged = {record.staging_path for record in node.records.all()}  # now, not at start-up

        def keep(pod: PodState) -> bool:
            return pod.target in staged or (bool(pod.target) and mounter.is_mounted(Path(pod.target)))

        known: list[str] = []
        if run_root is not None and run_root.is_dir():  # one run directory per daemon ever started here
            # ...less those of staged volumes: their Secret serves the next mount pod (recovery).
            known = sorted(entry.name for entry in run_root.iterdir()
                           if entry.is_dir() and _spec_target(run_root, entry.name) not in staged)
        adopted, deleted = launcher.cleanup(keep, known)
        log.info("mount pods on node %s (image %s): %d adopted (%s), %d deleted", launcher.settings.node_name,
                 launcher.settings.image, len(adopted), ", ".join(p.name for p in adopted) or "-", len(deleted))

    def workloads(volume_id: str) -> list[WorkloadPod]:
        return [WorkloadPod(p.get("namespace", ""), p.get("name", ""), p.get("uid", ""))
                for p in node.workloads(volume_id)]

    prepare: Callable[[], None] | None = None
    try:
        cleanup()
    except CsiError as exc:
        log.warning("cannot take over this node's mount pods yet (%s); retrying every %g s", exc, WATCH_RETRY_S)
        prepare = cleanup
    staged = StagedWritesReporter(launcher, workloads, on_left=lambda volume_id, count: metrics.record_staged_writes_left())
    # The dead pod's journal is counted before a new daemon takes its cache directory (and replays it).
    reporter = BrokenMountReporter(launcher, mounter.is_mounted, mounter.is_broken, workloads, recover=node.recover,
                                   before_recover=lambda state: staged.wait_checked(state.uid, staged.wait_s),
                                   mounting=lambda target: target in getattr(mounter, "mounting", ()))

    def observe(event_type: str, state: PodState) -> None:
        staged.observe(event_type, state)
        reporter.observe(event_type, state)

    def unrestored(volume_id: str, pod: Mapping[str, str], message: str) -> None:
        # A pod whose bind could not be restored is told again: its earlier Event said "until the
        # volume is published again", and that has now happened without helping it.
        launcher.event(pod.get("namespace", ""), pod.get("name", ""), pod.get("uid", ""), "CachefsMountNotRestored",
                       message)

    node.on_unrestored = unrestored
    return launcher.start_watching(observe, prepare)
