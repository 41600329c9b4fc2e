"""deploy/README.md's node drain, replayed against the API double with the rendered manifests.

On a node that runs a workload using a cachefs volume, its mount pod, the node plugin and a controller
replica, the README's ``kubectl drain`` command must evict the workload and the controller replica,
leave the mount pod to the unstage that follows the workload (which flushes first), skip the node
plugin, and refuse nothing (``tests/support/drain.py`` holds kubectl's rules: a pod with an emptyDir,
which the controller has for its CSI socket, is refused without ``--delete-emptydir-data``).
"""

from __future__ import annotations

import copy
import re
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from csi_driver.launchers import DaemonSpec, daemon_name
from csi_driver.mountpods import MountPodSettings, build_pod
from tests.csi.kustomize import kustomize_build
from tests.support.drain import plan
from tests.support.kubeapi import ApiDouble

ROOT = Path(__file__).resolve().parents[2]
NODE = "gpu-node-1"


def readme_drain_commands() -> list[str]:
    """Every ``kubectl drain`` command line deploy/README.md gives, with NODE for the node."""
    text = (ROOT / "deploy" / "README.md").read_text()
    return [m.group(1) for m in re.finditer(r"`(kubectl drain NODE [^`]+)`", text)]


def _pod_from(template: dict[str, Any], name: str, namespace: str, owner_kind: str) -> dict[str, Any]:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": copy.deepcopy(template["metadata"]),
           "spec": copy.deepcopy(template["spec"])}
    pod["metadata"].update(name=name, namespace=namespace, ownerReferences=[{
        "apiVersion": "apps/v1", "kind": owner_kind, "name": name.rsplit("-", 1)[0], "uid": str(uuid.uuid4()),
        "controller": True}])
    pod["spec"]["nodeName"] = NODE
    return pod


@pytest.fixture
def node_pods() -> Iterator[Any]:
    """The API double holding the pods of one node: workload, mount pod, node plugin, controller."""
    objects = kustomize_build(ROOT / "deploy" / "base")
    by_kind = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    controller = by_kind[("Deployment", "cachefs-csi-controller")]
    plugin = by_kind[("DaemonSet", "cachefs-csi-node")]
    namespace = controller["metadata"]["namespace"]
    workdir = Path(tempfile.mkdtemp(prefix="drain-", dir="/tmp"))
    api = ApiDouble(workdir).start()
    core = api.client()
    try:
        core.create_namespaced_pod(namespace, _pod_from(controller["spec"]["template"],
                                                        "cachefs-csi-controller-5d8f-abcde", namespace, "ReplicaSet"))
        core.create_namespaced_pod(namespace, _pod_from(plugin["spec"]["template"], "cachefs-csi-node-x7k2p",
                                                        namespace, "DaemonSet"))
        target = Path("/var/lib/kubelet/plugins/kubernetes.io/csi/csi.cachefs.io/abc/globalmount")
        spec = DaemonSpec(name=daemon_name(target), volume_id="v1:retain:::bucket/volumes/pvc-1", target=target,
                          args=("mount",), env={}, cache_dir=Path("/var/cache/cachefs-csi/volumes/v/slot-0"),
                          run_dir=Path("/var/cache/cachefs-csi/run/x"))
        mount_pod = build_pod(MountPodSettings(namespace=namespace, node_name=NODE, image="img:1"), spec)
        core.create_namespaced_pod(namespace, mount_pod)
        core.create_namespaced_pod("ml", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "train-0", "namespace": "ml", "labels": {"app": "train"},
                         "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "train",
                                              "uid": str(uuid.uuid4()), "controller": True}]},
            "spec": {"nodeName": NODE, "containers": [{"name": "train", "image": "train:1"}],
                     "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]},
        })
        yield core, namespace, mount_pod["metadata"]["name"]
    finally:
        api.stop()


def test_the_readme_drain_evicts_workloads_and_the_controller_and_refuses_nothing(node_pods) -> None:
    core, namespace, mount_pod = node_pods
    (command,) = readme_drain_commands()
    result = plan(core, command.replace("NODE", NODE))
    assert result.ok, f"{command} is refused: {result.refused}"
    assert sorted(result.evicted) == [f"{namespace}/cachefs-csi-controller-5d8f-abcde", "ml/train-0"]
    assert f"{namespace}/{mount_pod}" not in result.evicted + result.skipped, (
        "the drain must leave mount pods to the unstage that follows their workloads (it flushes first)")


def test_the_double_refuses_what_kubectl_drain_refuses(node_pods) -> None:
    """The rules the replay relies on: without --delete-emptydir-data the controller replica (its CSI
    socket is an emptyDir) stops the drain; without --ignore-daemonsets the node plugin does; without
    the pod selector the mount pod (no controller) does unless --force."""
    core, namespace, mount_pod = node_pods
    base = f"kubectl drain {NODE} --ignore-daemonsets --pod-selector=app.kubernetes.io/name!=cachefs-mount"
    refused = plan(core, base).refused
    assert list(refused) == [f"{namespace}/cachefs-csi-controller-5d8f-abcde"]
    assert "local storage" in refused[f"{namespace}/cachefs-csi-controller-5d8f-abcde"]
    assert plan(core, base + " --delete-emptydir-data").ok
    no_daemonsets = plan(core, f"kubectl drain {NODE} --delete-emptydir-data "
                               "--pod-selector=app.kubernetes.io/name!=cachefs-mount")
    assert "DaemonSet-managed" in no_daemonsets.refused[f"{namespace}/cachefs-csi-node-x7k2p"]
    everything = plan(core, f"kubectl drain {NODE} --ignore-daemonsets --delete-emptydir-data")
    assert "no controller" in everything.refused[f"{namespace}/{mount_pod}"]
    assert f"{namespace}/{mount_pod}" in plan(core, f"kubectl drain {NODE} --ignore-daemonsets "
                                                    "--delete-emptydir-data --force").evicted
