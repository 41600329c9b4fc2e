"""Every manifest under deploy/, validated offline, and the kustomize base rendered and validated.

``kubernetes-validate --strict`` checks each object against the OpenAPI schemas of a current
Kubernetes release and of the oldest release deploy/README.md supports (unknown fields are errors).
The base is rendered by real kustomize (``kubectl kustomize``, tests/csi/kustomize.py), so what is
validated is what ``kubectl apply -k`` would apply; the documented overlay is rendered the same way
in tests/csi/test_kustomize_overlay.py.

Beyond the schemas, the manifests are checked against the code: the driver name everywhere, the
driver's flags (parsed by ``cachefs-csi``'s own argument parser), the StorageClass parameters and
every example's volume attributes and FlexVolume options (parsed by the driver's own parsers), the
mount options, the ports, and the ``cachefs prefetch`` command line of the training Job.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Iterator

import kubernetes_validate
import pytest
import yaml

from csi_driver import DRIVER_NAME, attributes
from csi_driver.main import build_parser
from tests.csi.kustomize import kustomize_build

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BASE = DEPLOY / "base"
# The newest release the installed kubernetes-validate knows, and the oldest one deploy/README.md
# promises to support (CSIDriver fsGroupPolicy and inline volumes are GA well before it).
OLDEST_SUPPORTED = "1.28.0"
VERSIONS = sorted({kubernetes_validate.latest_version(), OLDEST_SUPPORTED})
# kustomize's own files (a Kustomization, a transformer configuration) are not Kubernetes objects.
KUSTOMIZE_FILES = {"kustomization.yaml", "kustomizeconfig.yaml"}
# Helm charts are templates, not objects: tests/csi/test_helm_chart.py renders and validates them.
HELM_CHARTS = DEPLOY / "helm"
CLUSTER_SCOPED = {"Namespace", "CSIDriver", "StorageClass", "ClusterRole", "ClusterRoleBinding",
                  "PersistentVolume", "PriorityClass", "CustomResourceDefinition"}
# Objects of cachefs's own resources: not in the Kubernetes schemas; each is validated against its
# CRD's openAPIV3Schema instead (tests/csi/test_dataset_manifests.py).
OWN_API_GROUPS = ("cachefs.io/",)


def load_documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def manifest_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*.yaml") if p.name not in KUSTOMIZE_FILES and HELM_CHARTS not in p.parents)


def base_resources() -> list[dict[str, Any]]:
    """The base's objects as written, before kustomize: what the checks against the code read
    (kustomize changes only namespaces and images), so they run where kubectl is missing too."""
    spec = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    return [doc for resource in spec["resources"] for doc in load_documents(BASE / resource)]


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    return kustomize_build(BASE)


@pytest.fixture(scope="module")
def base_objects() -> list[dict[str, Any]]:
    return base_resources()


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]


def containers(obj: dict[str, Any]) -> Iterator[dict[str, Any]]:
    spec = obj["spec"]["template"]["spec"] if "template" in obj["spec"] else obj["spec"]
    if obj["kind"] == "Job":
        spec = obj["spec"]["template"]["spec"]
    yield from spec.get("initContainers", [])
    yield from spec.get("containers", [])


def pod_volumes(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj["spec"]["template"]["spec"] if "template" in obj["spec"] else obj["spec"]
    return spec.get("volumes", [])


# ------------------------------------------------------------------------------------ schemas
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_manifest_is_valid_kubernetes(path: Path, version: str) -> None:
    documents = load_documents(path)
    assert documents, f"{path} holds no objects"
    for doc in documents:
        if doc["apiVersion"].startswith(OWN_API_GROUPS):
            continue
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", VERSIONS)
def test_rendered_base_is_valid_kubernetes(rendered, version: str) -> None:
    kinds = sorted(obj["kind"] for obj in rendered)
    assert kinds == sorted(["Namespace", "CSIDriver", "ServiceAccount", "ServiceAccount", "ClusterRole",
                            "ClusterRoleBinding", "Role", "RoleBinding", "DaemonSet", "Deployment", "StorageClass",
                            "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding", "PriorityClass"])
    for obj in rendered:
        kubernetes_validate.validate(copy.deepcopy(obj), version, strict=True)
        if obj["kind"] not in CLUSTER_SCOPED:
            assert obj["metadata"]["namespace"] == "cachefs"
        for subject in obj.get("subjects", []):
            assert subject["namespace"] == "cachefs", obj["metadata"]["name"]
    images = [c["image"] for obj in rendered if obj["kind"] in ("DaemonSet", "Deployment") for c in containers(obj)]
    assert "ghcr.io/cachefs/cachefs-csi:0.1.0" in images
    assert all(":" in image or "@" in image for image in images), images  # every image pinned


# ------------------------------------------------------------------------------------ against the code
def test_driver_name_and_capabilities_are_consistent(base_objects) -> None:
    (driver,) = by_kind(base_objects, "CSIDriver")
    assert driver["metadata"]["name"] == DRIVER_NAME
    assert driver["spec"]["attachRequired"] is False and driver["spec"]["podInfoOnMount"] is True
    assert set(driver["spec"]["volumeLifecycleModes"]) == {"Persistent", "Ephemeral"}
    # fsGroup is delegated to the driver (VOLUME_MOUNT_GROUP), which needs a policy other than None.
    assert driver["spec"]["fsGroupPolicy"] == "File"
    (storage_class,) = by_kind(base_objects, "StorageClass")
    assert storage_class["provisioner"] == DRIVER_NAME
    (daemonset,) = by_kind(base_objects, "DaemonSet")
    registrar = next(c for c in containers(daemonset) if c["name"] == "node-driver-registrar")
    assert f"--kubelet-registration-path=/var/lib/kubelet/plugins/{DRIVER_NAME}/csi.sock" in registrar["args"]
    plugin_dir = next(v for v in pod_volumes(daemonset) if v["name"] == "plugin-dir")
    assert plugin_dir["hostPath"]["path"] == f"/var/lib/kubelet/plugins/{DRIVER_NAME}"
    for doc in load_documents(DEPLOY / "examples" / "static-pv-pvc.yaml"):
        if doc["kind"] == "PersistentVolume":
            assert doc["spec"]["csi"]["driver"] == DRIVER_NAME


def test_node_plugin_is_set_up_for_fuse(base_objects) -> None:
    (daemonset,) = by_kind(base_objects, "DaemonSet")
    plugin = next(c for c in containers(daemonset) if c["name"] == "cachefs-csi")
    assert plugin["securityContext"]["privileged"] is True
    mounts = {m["name"]: m for m in plugin["volumeMounts"]}
    assert mounts["kubelet-dir"]["mountPropagation"] == "Bidirectional"
    volumes = {v["name"]: v for v in pod_volumes(daemonset)}
    assert volumes["dev-fuse"]["hostPath"] == {"path": "/dev/fuse", "type": "CharDevice"}
    assert volumes["cache-root"]["hostPath"]["path"] == "/var/cache/cachefs-csi"
    assert plugin["resources"]["limits"]["memory"] and plugin["resources"]["requests"]["memory"]
    # The flags are the driver's own (its parser refuses unknown ones), and the ports line up.
    args = build_parser().parse_args([a.replace("$(NODE_NAME)", "node-1") for a in plugin["args"]])
    assert args.mode == "node" and args.node_id == "node-1"
    assert str(args.cache_root) == mounts["cache-root"]["mountPath"]
    ports = {p["name"]: p["containerPort"] for p in plugin["ports"]}
    assert args.metrics_addr.endswith(f":{ports['metrics']}")
    # Metrics on the pod's own address, like the liveness port, never on every address of the node.
    assert args.metrics_addr == f"$(POD_IP):{ports['metrics']}"
    assert not daemonset["spec"]["template"]["spec"].get("hostNetwork")
    probe = next(c for c in containers(daemonset) if c["name"] == "liveness-probe")
    assert f"--health-port={ports['healthz']}" in probe["args"]
    assert plugin["livenessProbe"]["httpGet"]["port"] == "healthz"
    (deployment,) = by_kind(base_objects, "Deployment")
    controller = next(c for c in containers(deployment) if c["name"] == "cachefs-csi")
    assert build_parser().parse_args(controller["args"]).mode == "controller"
    assert any(c["name"] == "csi-provisioner" for c in containers(deployment))


def test_node_plugin_runs_mount_pods_with_least_privilege(base_objects) -> None:
    """The DaemonSet asks for --mount-mode pod with what that mode needs, and the node plugin's RBAC
    is exactly what csi_driver.mountpods uses: pods and Secrets in its own namespace, Events."""
    (daemonset,) = by_kind(base_objects, "DaemonSet")
    pod_spec = daemonset["spec"]["template"]["spec"]
    plugin = next(c for c in containers(daemonset) if c["name"] == "cachefs-csi")
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in plugin["env"] if "valueFrom" in e}
    assert env == {"NODE_NAME": "spec.nodeName", "POD_NAMESPACE": "metadata.namespace", "POD_NAME": "metadata.name",
                   "POD_IP": "status.podIP"}
    # Mount pods run as the driver's default non-root uid; no volume borrows the plugin's identity.
    assert "--daemon-uid" not in " ".join(plugin["args"]) and "--allow-node-identity" not in plugin["args"]
    args = build_parser().parse_args([a.replace("$(NODE_NAME)", "node-1") for a in plugin["args"]])
    assert args.mount_mode == "pod" and not args.mount_pod_image  # the plugin's own image, read through POD_NAME
    from csi_driver.main import PLUGIN_CONTAINER

    assert plugin["name"] == PLUGIN_CONTAINER
    (priority,) = by_kind(base_objects, "PriorityClass")
    assert args.mount_pod_priority_class == priority["metadata"]["name"]
    assert pod_spec["automountServiceAccountToken"] is True
    assert daemonset["spec"]["updateStrategy"]["type"] == "RollingUpdate"  # restarts leave mounts alone
    mounts = {m["name"]: m["mountPath"] for m in plugin["volumeMounts"]}
    assert str(args.run_root) == mounts["control-sockets"]  # the handover and control sockets, on the host
    node_sa = pod_spec["serviceAccountName"]
    rules: dict[str, list[dict[str, Any]]] = {}
    for binding in by_kind(base_objects, "RoleBinding") + by_kind(base_objects, "ClusterRoleBinding"):
        if any(s["name"] == node_sa for s in binding["subjects"]):
            (role,) = [r for r in by_kind(base_objects, binding["roleRef"]["kind"])
                       if r["metadata"]["name"] == binding["roleRef"]["name"]]
            rules[role["kind"]] = role["rules"]
    assert rules["Role"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "create", "delete"]},
        # No list (nor get, nor watch): a list of Secrets returns their data (issue 28). No patch: a mount
        # pod's Secret has no owner, it outlives a dead pod for the next (issue 36).
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create", "delete"]},
    ]
    assert rules["ClusterRole"] == [{"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
                                    {"apiGroups": [""], "resources": ["persistentvolumes"], "verbs": ["list"]}]


def test_storage_class_parameters_parse(base_objects) -> None:
    (storage_class,) = by_kind(base_objects, "StorageClass")
    settings = attributes.parse_provision_parameters(storage_class["parameters"])
    assert settings.on_delete is attributes.DeletePolicy.RETAIN


def test_example_volume_attributes_and_options_parse() -> None:
    examples = {p.name: load_documents(p) for p in (DEPLOY / "examples").glob("*.yaml")}
    seen = 0
    for name, documents in examples.items():
        for doc in documents:
            if doc["kind"] == "PersistentVolume":
                attributes.parse_volume_attributes(doc["spec"]["csi"]["volumeAttributes"])
                attributes.parse_mount_flags(doc["spec"].get("mountOptions", []))  # refuses unknown options
                seen += 1
            if doc["kind"] in ("Pod", "Job"):
                for volume in pod_volumes(doc) if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]["volumes"]:
                    if "csi" in volume:
                        assert volume["csi"]["driver"] == DRIVER_NAME
                        attributes.parse_volume_attributes(volume["csi"]["volumeAttributes"])
                        seen += 1
                    if "flexVolume" in volume:
                        assert volume["flexVolume"]["driver"] == "cachefs.io/cachefs"
                        attributes.parse_volume_attributes(volume["flexVolume"]["options"])
                        seen += 1
            if doc["kind"] == "Secret" and doc["type"] != "kubernetes.io/service-account-token":
                assert attributes.parse_credentials(doc["stringData"]) is not None
    assert seen >= 3


def test_training_job_runs_a_real_prefetch_command() -> None:
    from cachefs.cli.main import build_parser as cachefs_parser

    (job,) = load_documents(DEPLOY / "examples" / "training-job-prefetch.yaml")
    (init,) = job["spec"]["template"]["spec"]["initContainers"]
    command = init["command"]
    assert command[:2] == ["cachefs", "prefetch"]
    args = cachefs_parser().parse_args(command[1:])
    mount_paths = {m["mountPath"] for m in init["volumeMounts"]}
    assert str(args.mountpoint) in mount_paths and "/run/cachefs" in mount_paths
    # PATHs mean what they mean in a shell, from the container's working directory (/ by default).
    from cachefs.paths import mount_relative

    cwd = init.get("workingDir", "/")
    assert [mount_relative(p, str(args.mountpoint), cwd) for p in args.paths] == ["train", "val"]


def test_the_validator_rejects_what_it_should(base_objects) -> None:
    (daemonset,) = copy.deepcopy(by_kind(base_objects, "DaemonSet"))
    daemonset["spec"]["template"]["spec"]["containers"][0]["mountPropagaton"] = "Bidirectional"  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, VERSIONS[-1], strict=True)
