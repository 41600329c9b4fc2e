"""Stopping a mount pod never cuts its daemon's uploads short, against an API double that deletes pods
gracefully as a real API server does and a kubelet stand-in that honours the deletion's grace period.

A volume's ``stopTimeout`` is how long its daemon goes on uploading after SIGTERM; the mount pod
declares ``terminationGracePeriodSeconds`` = stopTimeout + 5 s to cover it. A DELETE that names a
shorter ``gracePeriodSeconds`` replaces the pod's own on a real cluster, and the kubelet then SIGKILLs
the daemon early: writes still only on the node stay there. The first tests hold the double to the API
server's rules (``tests/support/kubeapi.py`` lists them) and the stand-in to the kubelet's; the last
stop mount pods through the plugin's own path (``HandoverMounter.unmount`` -> ``PodLauncher.stop``,
which is given the plugin-wide STOP_TIMEOUT_S). No test waits out a grace period: the stand-in's
containers exit on SIGTERM, or are given 2 s.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from kubernetes.client.rest import ApiException

from cachefs.settings import STOP_MARGIN_S
from csi_driver import handover
from csi_driver.attributes import parse_cache_options
from csi_driver.handover import STOP_TIMEOUT_S, HandoverMounter
from csi_driver.mounter import MountRequest
from csi_driver.mountpods import USER_AGENT, MountPodSettings, PodLauncher, api_client
from tests.csi import conftest as csi_conftest
from tests.support.kubeapi import DEFAULT_POD_GRACE_S, ApiDouble
from tests.support.kubelet import MIN_GRACE_S, Kubelet

NAMESPACE = "cachefs"
NODE = "stop-node"
WAIT_S = 30.0
# A container that exits on SIGTERM at once (the default action), and one that ignores it.
SLEEPER = "import time; time.sleep(600)"
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"


def wait_for(what: str, check: Any, timeout_s: float = WAIT_S) -> Any:
    return csi_conftest.wait_for(what, check, timeout_s, poll_s=0.05)


@pytest.fixture
def api(workdir: Path) -> Iterator[ApiDouble]:
    double = ApiDouble(workdir).start()
    try:
        yield double
    finally:
        double.stop()


@pytest.fixture
def kubelet(api: ApiDouble, workdir: Path) -> Iterator[Kubelet]:
    stand_in = Kubelet(api.client(), NODE, NAMESPACE, workdir / "containers",
                       {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}).start()
    try:
        yield stand_in
    finally:
        stand_in.stop()


def bare_pod(name: str, *, node: str | None = NODE, grace: int | None = None,
             code: str = SLEEPER) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{
        "name": "c", "image": "img:1", "command": [sys.executable, "-c", code],
        "securityContext": {"privileged": False, "allowPrivilegeEscalation": False}}]}
    if node is not None:
        spec["nodeName"] = node
    if grace is not None:
        spec["terminationGracePeriodSeconds"] = grace
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE}, "spec": spec}


def read(core: Any, name: str) -> Any:
    try:
        return core.read_namespaced_pod(name, NAMESPACE)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


# ---------------------------------------------------------------------------- the API double's rules
def test_the_double_deletes_a_bound_pod_gracefully_and_only_ever_shortens_the_grace(api: ApiDouble) -> None:
    core = api.client()
    uid = core.create_namespaced_pod(NAMESPACE, bare_pod("p", grace=45)).metadata.uid
    core.create_namespaced_secret(NAMESPACE, {"metadata": {"name": "p", "ownerReferences": [
        {"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": uid}]}})
    before = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    core.delete_namespaced_pod("p", NAMESPACE)  # no gracePeriodSeconds: the pod's own
    pod = read(core, "p")
    assert pod is not None, "a pod bound to a node stays until its kubelet has stopped it"
    assert pod.metadata.deletion_grace_period_seconds == 45
    deadline = pod.metadata.deletion_timestamp
    assert before + datetime.timedelta(seconds=44) <= deadline <= before + datetime.timedelta(seconds=47)
    assert [p.metadata.name for p in core.list_namespaced_pod(NAMESPACE).items] == ["p"]
    assert [s.metadata.name for s in core.list_namespaced_secret(NAMESPACE).items] == ["p"], "its owner is there"

    core.delete_namespaced_pod("p", NAMESPACE, body={"gracePeriodSeconds": 60})  # longer: ignored
    assert read(core, "p").metadata.deletion_grace_period_seconds == 45
    core.delete_namespaced_pod("p", NAMESPACE, grace_period_seconds=10)  # in the query; shorter: taken
    pod = read(core, "p")
    assert pod.metadata.deletion_grace_period_seconds == 10
    assert pod.metadata.deletion_timestamp == deadline - datetime.timedelta(seconds=35)
    core.patch_namespaced_pod_status("p", NAMESPACE, {"status": {"phase": "Running"}})
    assert read(core, "p").status.phase == "Running", "a write to a pod being deleted keeps it"
    core.delete_namespaced_pod("p", NAMESPACE, body={"gracePeriodSeconds": 0})  # the kubelet's last step
    assert read(core, "p") is None
    assert core.list_namespaced_secret(NAMESPACE).items == [], "the garbage collector deletes what it owned"
    assert [(d.name, d.requested, d.grace) for d in api.emulator.pod_deletions] == [
        ("p", None, 45), ("p", 60, 45), ("p", 10, 10), ("p", 0, 0)]


@pytest.mark.parametrize(("pod", "status", "requested", "grace"), [
    (bare_pod("default"), None, None, DEFAULT_POD_GRACE_S),  # no terminationGracePeriodSeconds: 30
    (bare_pod("explicit", grace=300), None, 7, 7),  # an explicit value replaces the pod's, shorter or longer
    (bare_pod("longer", grace=5), None, 120, 120),
    (bare_pod("negative", grace=30), None, -3, 1),
    (bare_pod("unscheduled", node=None, grace=30), None, None, 0),  # no node: removed at once
    (bare_pod("ended", grace=30), {"phase": "Succeeded"}, None, 0),  # ended: removed at once
])
def test_the_grace_a_deletion_gets(api: ApiDouble, pod: dict[str, Any], status: dict[str, Any] | None,
                                   requested: int | None, grace: int) -> None:
    core = api.client()
    name = pod["metadata"]["name"]
    core.create_namespaced_pod(NAMESPACE, pod)
    if status is not None:
        core.patch_namespaced_pod_status(name, NAMESPACE, {"status": status})
    core.delete_namespaced_pod(name, NAMESPACE, body={} if requested is None else {"gracePeriodSeconds": requested})
    left = read(core, name)
    assert (left.metadata.deletion_grace_period_seconds if left is not None else 0) == grace
    assert api.emulator.pod_deletions[-1].grace == grace


# ------------------------------------------------------------------------------ the kubelet stand-in
def test_the_kubelet_stand_in_kills_after_the_deletions_grace_and_then_removes_the_pod(
        api: ApiDouble, kubelet: Kubelet) -> None:
    """``asked``: SIGKILL after the DELETE's grace (2 s, the least), not the pod's 600; ``shortened``:
    deleted with the pod's 600, then again with 1, which the stand-in takes from then on."""
    core = api.client()
    for name in ("asked", "shortened"):
        core.create_namespaced_pod(NAMESPACE, bare_pod(name, grace=600, code=STUBBORN))
    for name in ("asked", "shortened"):
        wait_for(f"the container of {name} to run", lambda: kubelet.running(name))
    time.sleep(0.5)  # the interpreters have set SIG_IGN by now
    start = time.monotonic()
    core.delete_namespaced_pod("asked", NAMESPACE, body={"gracePeriodSeconds": 1})
    core.delete_namespaced_pod("shortened", NAMESPACE)
    stubborn = {c.name: c for c in kubelet.containers.values()}
    wait_for("the SIGTERM", lambda: stubborn["shortened"].sigterm_at is not None)
    assert stubborn["shortened"].stop_grace_s == 600
    core.delete_namespaced_pod("shortened", NAMESPACE, body={"gracePeriodSeconds": 1})
    for name in ("asked", "shortened"):
        wait_for(f"{name} to be removed", lambda: read(core, name) is None)
    took = time.monotonic() - start
    assert MIN_GRACE_S <= took < MIN_GRACE_S + 5, f"SIGKILL after {took:.1f} s, not after the deletion's grace"
    for container in stubborn.values():
        assert container.stop_grace_s == MIN_GRACE_S and container.proc.returncode == -9
    # The stand-in's last DELETE of each: grace 0.
    for name, expected in (("asked", [(1, 1), (0, 0)]), ("shortened", [(None, 600), (1, 1), (0, 0)])):
        assert [(d.requested, d.grace) for d in api.emulator.pod_deletions if d.name == name] == expected


def test_a_pod_the_kubelet_never_started_is_removed_once_deleted(api: ApiDouble, kubelet: Kubelet) -> None:
    core = api.client()
    pod = bare_pod("refused", grace=600)
    pod["spec"]["containers"][0]["securityContext"]["privileged"] = True
    core.create_namespaced_pod(NAMESPACE, pod)
    wait_for("the refusal", lambda: "refused" in kubelet.refused)
    core.delete_namespaced_pod("refused", NAMESPACE)
    wait_for("the pod to be removed", lambda: read(core, "refused") is None, 10)


# ------------------------------------------------------------------------------ the plugin's stop
def pod_launcher(api: ApiDouble) -> PodLauncher:
    settings = MountPodSettings(namespace=NAMESPACE, node_name=NODE, image="img:test",
                                command=(sys.executable, "-c", SLEEPER))  # the daemon's args are ignored
    return PodLauncher(settings, api_client(str(api.kubeconfig)))


@pytest.mark.parametrize(("stop_timeout", "own", "grace"), [
    # The pod's own grace (stopTimeout + the margin), longer than the plugin's STOP_TIMEOUT_S: kept.
    ("120", 120 + int(STOP_MARGIN_S), 120 + int(STOP_MARGIN_S)),
    ("3", 3 + int(STOP_MARGIN_S), int(STOP_TIMEOUT_S)),  # a shorter one: the plugin's stop timeout, as before
])
def test_unstage_stops_a_mount_pod_with_at_least_its_own_grace_period(
        api: ApiDouble, kubelet: Kubelet, workdir: Path, monkeypatch: pytest.MonkeyPatch,
        stop_timeout: str, own: int, grace: int) -> None:
    core = api.client()
    launcher = pod_launcher(api)
    mounter = HandoverMounter(launcher, workdir / "run", command=["cachefs"])  # stop timeout: STOP_TIMEOUT_S
    request = MountRequest(source="s3://bucket/train", target=workdir / "globalmount", cache_dir=workdir / "slot-0",
                           cache=parse_cache_options({"stopTimeout": stop_timeout}), volume_id="vol-stop")
    spec = mounter.spec_for(request)
    for directory in (spec.run_dir, spec.cache_dir):
        directory.mkdir(parents=True)
    launcher.start(spec)
    name = launcher.pod_name(spec.name)
    assert read(core, name).spec.termination_grace_period_seconds == own
    wait_for("the mount pod's container", lambda: kubelet.running(name))

    # Unmount of a target that is not mounted: the daemon is stopped at once (the wait for it to exit
    # by itself, after a real unmount, is skipped).
    monkeypatch.setattr(handover, "EXIT_WAIT_S", 0.0)
    start = time.monotonic()
    mounter.unmount(spec.target)
    assert time.monotonic() - start < WAIT_S
    assert read(core, name) is None and kubelet.running(name) is None

    (deletion,) = [d for d in api.emulator.pod_deletions if d.user_agent.startswith(USER_AGENT)]
    assert deletion.requested == grace, "the DELETE shortened the mount pod's grace period"
    assert deletion.grace == grace
    (container,) = [c for c in kubelet.containers.values() if c.name == name]
    assert container.stop_grace_s == grace and container.proc.returncode == -15  # SIGTERM, not SIGKILL


def test_stopping_a_mount_pod_that_is_gone_asks_as_before_and_does_not_wait(api: ApiDouble) -> None:
    start = time.monotonic()
    pod_launcher(api).stop("no-such-daemon", STOP_TIMEOUT_S)
    assert time.monotonic() - start < 5
    assert api.emulator.pod_deletions == []
    assert ("delete", "pods", NAMESPACE) in api.calls(USER_AGENT)  # asked, answered 404, as before
