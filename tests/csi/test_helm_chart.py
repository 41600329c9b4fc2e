"""deploy/helm/cachefs: linted and rendered by Helm's own library, and equal to the kustomize install.

Helm runs in-process through ``helm-python-sdk`` (Helm 4's Go SDK in a wheel; no helm binary):

- the committed chart is what ``scripts/helm_chart.py`` generates from deploy/ now (templates,
  values.yaml, values.schema.json, the values table of docs/kubernetes.md): a change to deploy/ that
  was not carried into the chart fails here, and ``python scripts/helm_chart.py`` is the fix;
- ``helm lint --strict`` finds nothing, with the default values and with each option on, for the
  oldest Kubernetes release deploy/README.md supports and the newest kubernetes-validate knows;
- ``helm template`` with the default values and with each option on renders objects that
  ``kubernetes-validate --strict`` accepts (as tests/csi/test_manifests.py does for kustomize), in
  the release namespace, with flags the driver's own parser accepts;
- values.schema.json refuses a misspelt key or a bad value with a message naming where it is;
- for the same choices, the chart renders the objects kustomize renders: the documented overlays,
  and an overlay written here that sets every value through kustomize's own means (``namespace:``,
  ``images:``, JSON patches). What Helm adds by convention is left out of the comparison: its labels
  in each object's metadata and the hook annotations of the bucket Job; the Namespace object is
  kustomize's alone (docs/kubernetes.md, "Helm and kustomize", says why);
- the values file and ``--set`` flags deploy/README.md shows pass the schema and render, the docs'
  values table lists every value with its default, and text of deploy/ that looks like a template
  action reaches the cluster as written.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shlex
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from csi_driver.main import build_parser
from tests.csi.kustomize import kustomize_build, require_kubectl
from tests.csi.test_kustomize_overlay import fenced_blocks
from tests.csi.test_manifests import CLUSTER_SCOPED, DEPLOY, OWN_API_GROUPS, ROOT, VERSIONS, by_kind, containers

CHART = DEPLOY / "helm" / "cachefs"
README = DEPLOY / "README.md"
RELEASE = "cachefs"
# What the documented overlays set (deploy/overlays/*/kustomization.yaml), as values.
SITE = {"image": {"repository": "registry.example.com/cachefs-csi", "tag": "0.1.0"},
        "storageClass": {"bucket": "ml-volumes", "endpointUrl": "https://s3.storage.example.com"}}
# Each option on its own, for lint and render.
OPTIONS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "site": SITE,
    "cluster-store": {"clusterStore": {"enabled": True}},
    "datasets": {"datasets": {"enabled": True}},
    "trust": {"node": {"allowedEndpoints": ["https://s3.storage.example.com", "aws"], "allowedBuckets": ["ml-volumes"],
                       "allowNodeIdentity": True, "mountPodServiceAccount": "cachefs-mounts", "maxVolumes": 20,
                       "serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/c"}}}},
}
HELM_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/instance")
HELM_HOOK_ANNOTATIONS = ("helm.sh/hook", "helm.sh/hook-delete-policy")
# Lint findings: 1 info, 2 warning, 3 error. Strict lint fails on warnings; the one info Helm gives
# is that Chart.yaml has no icon (the project has none).
WARNING = 2


def generator() -> ModuleType:
    """scripts/helm_chart.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("helm_chart", ROOT / "scripts" / "helm_chart.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["helm_chart"] = module
    spec.loader.exec_module(module)
    return module


def render(values: dict[str, Any], namespace: str = "cachefs") -> list[dict[str, Any]]:
    """``helm template RELEASE deploy/helm/cachefs -n NAMESPACE`` with ``values``, parsed."""
    with helm.Chart.load(CHART) as chart:
        files = chart.render(values, name=RELEASE, namespace=namespace)
    objects: list[dict[str, Any]] = []
    for path, text in sorted(files.items()):
        if not path.endswith("NOTES.txt"):
            objects.extend(doc for doc in yaml.safe_load_all(text) if doc is not None)
    return objects


def notes(values: dict[str, Any]) -> str:
    with helm.Chart.load(CHART) as chart:
        return chart.render(values, name=RELEASE, namespace="cachefs")[f"{RELEASE}/templates/NOTES.txt"]


def merged(*parts: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = merged(out[key], value)
            else:
                out[key] = copy.deepcopy(value)
    return out


def normalized(objects: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Objects by (kind, namespace, name), without what Helm adds by convention."""
    out = {}
    for obj in copy.deepcopy(objects):
        if obj["kind"] == "Namespace":
            continue
        metadata = obj["metadata"]
        for label in HELM_LABELS:
            metadata.get("labels", {}).pop(label, None)
        for annotation in HELM_HOOK_ANNOTATIONS:
            metadata.get("annotations", {}).pop(annotation, None)
        for name in ("labels", "annotations"):
            if name in metadata and not metadata[name]:
                del metadata[name]
        out[(obj["kind"], metadata.get("namespace", ""), metadata["name"])] = obj
    return out


def assert_same_objects(chart: list[dict[str, Any]], kustomized: list[dict[str, Any]]) -> None:
    from_chart, from_kustomize = normalized(chart), normalized(kustomized)
    assert sorted(from_chart) == sorted(from_kustomize), "the chart and kustomize render different objects"
    for key, obj in from_kustomize.items():
        assert from_chart[key] == obj, f"{key} differs between the chart and kustomize"


def kustomize_overlay(tmp_path: Path, *, namespace: str, components: list[str], images: list[dict[str, str]],
                      patches: list[tuple[dict[str, str], list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """An overlay of deploy/base written in tmp_path, rendered by real kustomize."""
    spec = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": namespace,
            "resources": [os.path.relpath(DEPLOY / "base", tmp_path)],
            "components": [os.path.relpath(DEPLOY / "components" / c, tmp_path) for c in components],
            "images": images,
            "patches": [{"target": target, "patch": json.dumps(ops)} for target, ops in patches]}
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return kustomize_build(tmp_path)


def flag_patches(args: list[str], container: int, flags: list[str]) -> list[dict[str, Any]]:
    """JSON patches setting each ``--flag[=value]``: in place where the base passes the flag (as the
    chart does), else appended in the given order (the chart's, scripts/helm_chart.py FLAGS)."""
    ops: list[dict[str, Any]] = []
    for flag in flags:
        name = flag.partition("=")[0]
        at = next((i for i, arg in enumerate(args) if arg.partition("=")[0] == name), None)
        path = f"/spec/template/spec/containers/{container}/args"
        ops.append({"op": "add", "path": f"{path}/-", "value": flag} if at is None
                   else {"op": "replace", "path": f"{path}/{at}", "value": flag})
    return ops


def plugin(objects: list[dict[str, Any]], workload: str, container: str) -> dict[str, Any]:
    (obj,) = [o for o in objects if o["metadata"]["name"] == workload and o["kind"] in ("DaemonSet", "Deployment")]
    return next(c for c in containers(obj) if c["name"] == container)


# ------------------------------------------------------------------------------------ one source of truth
def test_the_committed_chart_is_what_deploy_generates() -> None:
    require_kubectl("the Helm chart's generator")
    module = generator()
    stale = module.differences(module.generate())
    assert stale == [], f"the chart is behind deploy/: {stale}; run `python scripts/helm_chart.py`"


def test_the_generator_check_names_a_file_that_was_edited_by_hand(tmp_path: Path, monkeypatch) -> None:
    """``--check`` fails, naming the file, when a template no longer is what deploy/ generates."""
    require_kubectl("the Helm chart's generator")
    module = generator()
    files = module.generate()
    rel = "deploy/helm/cachefs/templates/base/daemonset-cachefs-csi-node.yaml"
    copy_root = tmp_path / "repo"
    for path, text in files.items():
        (copy_root / path).parent.mkdir(parents=True, exist_ok=True)
        (copy_root / path).write_text(text)
    (copy_root / rel).write_text(files[rel].replace("maxUnavailable: 1", "maxUnavailable: 2"))
    monkeypatch.setattr(module, "ROOT", copy_root)
    monkeypatch.setattr(module, "CHART", copy_root / "deploy" / "helm" / "cachefs")
    assert module.differences(files) == [f"{rel}: differs"]


def test_a_component_that_changes_a_base_object_is_refused(tmp_path: Path, monkeypatch) -> None:
    """A Helm condition leaves out whole objects: a component patching the DaemonSet cannot become one."""
    require_kubectl("the Helm chart's generator")
    module = generator()
    components = tmp_path / "components"
    (components / "datasets").mkdir(parents=True)
    (components / "datasets" / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1alpha1", "kind": "Component",
        "patches": [{"target": {"kind": "DaemonSet", "name": "cachefs-csi-node"},
                     "patch": json.dumps([{"op": "replace", "path": "/spec/updateStrategy/rollingUpdate/maxUnavailable",
                                           "value": 2}])}]}))
    monkeypatch.setattr(module, "COMPONENTS", components)
    with pytest.raises(SystemExit, match="deploy/components/datasets changes DaemonSet cachefs-csi-node of the base"):
        module.parts()


# ------------------------------------------------------------------------------------ helm lint and template
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_helm_lint_strict_is_clean(option: str, version: str) -> None:
    report = helm.lint(CHART, OPTIONS[option], strict=True, namespace="cachefs", kube_version=f"v{version}")
    assert report["errors"] == []
    findings = [m for m in report["messages"] if m["severity"] >= WARNING]
    assert findings == [], findings
    assert [m["error"] for m in report["messages"]] == ["icon is recommended"]


def test_helm_lint_reports_a_broken_values_file(tmp_path: Path) -> None:
    """The lint above can fail: the same call on a copy whose values break the schema reports it."""
    broken = tmp_path / "cachefs"
    broken.mkdir()
    for path in CHART.rglob("*"):
        if path.is_file():
            target = broken / path.relative_to(CHART)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
    values = (broken / "values.yaml").read_text()
    (broken / "values.yaml").write_text(values.replace("  logLevel: INFO", "  logLevel: CHATTY", 1))
    report = helm.lint(broken, {}, strict=True)
    problems = [m["error"] for m in report["messages"] if m["severity"] >= WARNING] + report["errors"]
    assert any("logLevel" in p for p in problems), report


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_helm_template_renders_valid_kubernetes(option: str, version: str) -> None:
    objects = render(OPTIONS[option], namespace="ml-cache")
    assert by_kind(objects, "DaemonSet") and by_kind(objects, "StorageClass")
    for obj in objects:
        if not obj["apiVersion"].startswith(OWN_API_GROUPS):
            kubernetes_validate.validate(copy.deepcopy(obj), version, strict=True)
        if obj["kind"] not in CLUSTER_SCOPED:
            assert obj["metadata"]["namespace"] == "ml-cache", (obj["kind"], obj["metadata"]["name"])
        for subject in obj.get("subjects", []):
            assert subject["namespace"] == "ml-cache", obj["metadata"]["name"]
        assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    assert bool(by_kind(objects, "StatefulSet")) is (option == "cluster-store")
    assert bool(by_kind(objects, "CustomResourceDefinition")) is (option == "datasets")
    for storage_class in by_kind(objects, "StorageClass"):
        assert storage_class["parameters"]["csi.storage.k8s.io/provisioner-secret-namespace"] == "ml-cache"
        if "clusterEndpointUrl" in storage_class["parameters"]:  # follows the release namespace
            assert storage_class["parameters"]["clusterEndpointUrl"] == "http://cachefs-cluster-store.ml-cache.svc:8333"


def test_the_trust_values_become_flags_the_driver_parses() -> None:
    node = yaml.safe_load((CHART / "values.yaml").read_text())["node"]
    defaults = build_parser().parse_args(
        [a.replace("$(NODE_NAME)", "node-1") for a in plugin(render({}), "cachefs-csi-node", "cachefs-csi")["args"]])
    assert defaults.allow_node_identity is node["allowNodeIdentity"]
    assert defaults.allowed_endpoints == ",".join(node["allowedEndpoints"])
    assert defaults.allowed_buckets == ",".join(node["allowedBuckets"])
    assert defaults.max_volumes == node["maxVolumes"]
    assert defaults.mount_pod_service_account == node["mountPodServiceAccount"]
    objects = render(OPTIONS["trust"])
    args = build_parser().parse_args(
        [a.replace("$(NODE_NAME)", "node-1") for a in plugin(objects, "cachefs-csi-node", "cachefs-csi")["args"]])
    assert args.allowed_endpoints == "https://s3.storage.example.com,aws"
    assert args.allowed_buckets == "ml-volumes"
    assert args.allow_node_identity and args.max_volumes == 20
    assert args.mount_pod_service_account == "cachefs-mounts"
    (account,) = [a for a in by_kind(objects, "ServiceAccount") if a["metadata"]["name"] == "cachefs-csi-node"]
    assert account["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/c"}


def test_the_releases_own_cluster_store_is_never_a_source_endpoint() -> None:
    """With clusterStore.enabled and no endpoint named, the node plugin still knows the store's
    endpoint (in the release's namespace), which it refuses as any volume's source endpoint."""
    def store_flag(values: dict[str, Any], namespace: str = "cachefs") -> str | None:
        args = plugin(render(values, namespace), "cachefs-csi-node", "cachefs-csi")["args"]
        return build_parser().parse_args([a.replace("$(NODE_NAME)", "node-1") for a in args]).cluster_store_endpoint

    assert not store_flag({})  # no store installed: none
    assert store_flag({"clusterStore": {"enabled": True}}, "ml-infra") == "http://cachefs-cluster-store.ml-infra.svc:8333"
    named = {"clusterStore": {"enabled": True}, "node": {"clusterStoreEndpoint": "http://store.example:8333"}}
    assert store_flag(named) == "http://store.example:8333"


def test_notes_name_the_secrets_each_option_needs() -> None:
    assert "cachefs-provisioner-credentials" in notes({})
    assert "cachefs-cluster-store-credentials" not in notes({})
    assert "cachefs-cluster-store-credentials" in notes({"clusterStore": {"enabled": True}})
    assert "set node.allowedEndpoints" in notes({"node": {"allowedEndpoints": []}})
    assert "set node.allowedEndpoints" not in notes(OPTIONS["trust"])


# ------------------------------------------------------------------------------------ the schema
@pytest.mark.parametrize("values, message", [
    ({"node": {"allowedEndpoint": ["https://s3.example.com"]}},
     "at '/node': additional properties 'allowedEndpoint' not allowed"),
    ({"clusterstore": {"enabled": True}}, "additional properties 'clusterstore' not allowed"),
    ({"datasets": {"enabled": "yes"}}, "at '/datasets/enabled'"),
    ({"node": {"allowedEndpoints": ["s3.example.com"]}}, "at '/node/allowedEndpoints/0'"),
    ({"node": {"allowedEndpoints": "https://s3.example.com"}}, "at '/node/allowedEndpoints'"),
    ({"node": {"resources": {"limits": {"memroy": "1Gi"}}}}, "additional properties 'memroy' not allowed"),
    ({"node": {"resources": {"limits": {"memory": "1 GiB"}}}}, "at '/node/resources/limits/memory'"),
    ({"node": {"logLevel": "CHATTY"}}, "at '/node/logLevel'"),
    ({"controller": {"replicas": 0}}, "at '/controller/replicas'"),
    ({"storageClass": {"parameters": {"ramcache": "2GiB"}}},
     "at '/storageClass/parameters': additional properties 'ramcache' not allowed"),
    ({"storageClass": {"parameters": {"bucket": "other"}}},  # storageClass.bucket's place
     "at '/storageClass/parameters': additional properties 'bucket' not allowed"),
    ({"storageClass": {"parameters": {"ramCache": 2}}}, "at '/storageClass/parameters/ramCache'"),
    ({"storageClass": {"endpointUrl": "s3.example.com"}}, "at '/storageClass/endpointUrl'"),
    ({"image": {"tag": "0.1.0 "}}, "at '/image/tag'"),
    ({"node": {"mountPodServiceAccount": "Mounts"}}, "at '/node/mountPodServiceAccount'"),
])
def test_the_schema_refuses_a_bad_value_and_says_where(values: dict[str, Any], message: str) -> None:
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmValuesError) as refused:
            chart.validate_schema(values)
        assert message in str(refused.value)
        with pytest.raises(helm.HelmValuesError) as at_render:  # what `helm install` meets
            chart.render(values, name=RELEASE, namespace="cachefs")
        assert message in str(at_render.value)


def test_the_default_values_pass_the_schema_and_every_key_is_described() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values)
        assert chart.values == values

    def walk(node: dict[str, Any], subtree: Any, where: str) -> None:
        assert node.get("description"), f"{where or 'the root'} has no description"
        children = node.get("properties", {}).values()
        if children and all("description" in child for child in children):  # a group of values, not one value
            assert node["additionalProperties"] is False, where
            assert set(node["properties"]) == set(subtree), where
            for name, child in node["properties"].items():
                walk(child, subtree[name], f"{where}.{name}".lstrip("."))

    walk(dict(schema, description=schema["title"]), values, "")


def value_keys(schema: dict[str, Any], prefix: str = "") -> list[str]:
    """The values of values.schema.json: its leaves, where a group's members all carry a description
    and a value's own parts (resources' requests, a map's entries) do not."""
    children = schema.get("properties", {})
    if not children or not all("description" in child for child in children.values()):
        return [prefix]
    return [key for name, child in children.items() for key in value_keys(child, f"{prefix}{name}.".lstrip("."))]


def test_the_docs_table_lists_every_value_with_its_default() -> None:
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    module = generator()
    rows = {row.split(" | ")[0].strip("| `"): row
            for row in text.partition(module.DOCS_BEGIN)[2].partition(module.DOCS_END)[0].splitlines()
            if row.startswith("| `")}
    schema = json.loads((CHART / "values.schema.json").read_text())
    keys = [key.rstrip(".") for key in value_keys(schema)]
    assert sorted(rows) == sorted(keys)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for key in keys:
        default: Any = values
        for part in key.split("."):
            default = default[part]
        shown = f"`{json.dumps(default)}`" if not isinstance(default, str) else f"`{default or chr(34) * 2}`"
        assert f"| `{key}` | {shown} |" in rows[key], rows[key]


# ------------------------------------------------------------------------------------ chart == kustomize
def test_the_default_values_render_what_the_base_renders() -> None:
    assert_same_objects(render({}), kustomize_build(DEPLOY / "base"))


# The shipped overlays list the endpoints volumes may name (csi_driver.trust): the site's store, and
# with the cluster store its Service too.
SITE_ENDPOINTS = {"node": {"allowedEndpoints": ["https://s3.storage.example.com/"]}}


@pytest.mark.parametrize("overlay, values", [
    ("example", merged(SITE, SITE_ENDPOINTS)),
    ("with-cluster-store", merged(SITE, {"clusterStore": {"enabled": True}, "node": {"allowedEndpoints": [
        "https://s3.storage.example.com/", "http://cachefs-cluster-store.cachefs.svc:8333/"],
        "clusterStoreEndpoint": "http://cachefs-cluster-store.cachefs.svc:8333"}})),
    ("with-datasets", merged(SITE, {"datasets": {"enabled": True}}, SITE_ENDPOINTS)),
])
def test_the_chart_renders_what_each_documented_overlay_renders(overlay: str, values: dict[str, Any]) -> None:
    assert_same_objects(render(values), kustomize_build(DEPLOY / "overlays" / overlay))


def test_every_value_set_renders_what_kustomize_renders_for_the_same_choices(tmp_path: Path) -> None:
    """Every value away from its default, against an overlay that makes the same choices with
    kustomize's own means; the namespace too, which moves the cluster store's endpoint."""
    base = kustomize_build(DEPLOY / "base")
    node_args = plugin(base, "cachefs-csi-node", "cachefs-csi")["args"]
    controller_args = plugin(base, "cachefs-csi-controller", "cachefs-csi")["args"]
    node_resources = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "2Gi"}}
    small = {"requests": {"cpu": "5m", "memory": "16Mi"}, "limits": {"memory": "32Mi"}}
    registry = "registry.example.com/sig-storage"
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    parameters = {"prefix": "pvc", "onDelete": "delete", "ramCache": "2GiB", "diskCache": "100GiB"}
    # Helm merges maps of values into the defaults; the clustered class's own differences win in it.
    every_class = {**defaults["storageClass"]["parameters"], **parameters}
    clustered = {**defaults["clusterStore"]["storageClassParameters"], "ramCache": "4GiB"}
    values = {
        "image": {"repository": "registry.example.com/cachefs-csi", "tag": "0.2.0", "pullPolicy": "Always"},
        "node": {"logLevel": "DEBUG", "allowedEndpoints": ["https://s3.storage.example.com", "aws"],
                 "allowedBuckets": ["ml-volumes", "ml-out"], "allowNodeIdentity": True,
                 "mountPodServiceAccount": "cachefs-mounts", "maxVolumes": 20,
                 "resources": node_resources,
                 "serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/c"}}},
        "controller": {"replicas": 3, "logLevel": "WARNING", "resources": small},
        "storageClass": {"bucket": "ml-volumes", "endpointUrl": "https://s3.storage.example.com",
                         "parameters": parameters},
        "clusterStore": {"enabled": True, "storage": "500Gi", "storageClassName": "local-nvme",
                         "storageClassParameters": {"ramCache": "4GiB"},
                         "image": "chrislusf/seaweedfs:4.49", "resources": small},
        "datasets": {"enabled": True, "resources": small},
        "sidecars": {"provisioner": {"image": f"{registry}/csi-provisioner:v5.3.0", "resources": small},
                     "nodeDriverRegistrar": {"image": f"{registry}/csi-node-driver-registrar:v2.14.0",
                                             "resources": small},
                     "livenessProbe": {"image": f"{registry}/livenessprobe:v2.16.0", "resources": small}},
    }
    container = "/spec/template/spec/containers"
    kustomized = kustomize_overlay(
        tmp_path, namespace="ml-cache", components=["cluster-store", "datasets"],
        images=[{"name": "ghcr.io/cachefs/cachefs-csi", "newName": "registry.example.com/cachefs-csi",
                 "newTag": "0.2.0"},
                {"name": "chrislusf/seaweedfs", "newTag": "4.49"},
                {"name": "registry.k8s.io/sig-storage/csi-provisioner", "newName": f"{registry}/csi-provisioner",
                 "newTag": "v5.3.0"},
                {"name": "registry.k8s.io/sig-storage/csi-node-driver-registrar",
                 "newName": f"{registry}/csi-node-driver-registrar", "newTag": "v2.14.0"},
                {"name": "registry.k8s.io/sig-storage/livenessprobe", "newName": f"{registry}/livenessprobe",
                 "newTag": "v2.16.0"}],
        patches=[
            ({"kind": "DaemonSet", "name": "cachefs-csi-node"}, flag_patches(node_args, 0, [
                "--log-level=DEBUG", "--allowed-endpoints=https://s3.storage.example.com,aws",
                "--cluster-store-endpoint=http://cachefs-cluster-store.ml-cache.svc:8333",
                "--allowed-buckets=ml-volumes,ml-out", "--allow-node-identity",
                "--mount-pod-service-account=cachefs-mounts", "--max-volumes=20"]) + [
                {"op": "replace", "path": f"{container}/0/imagePullPolicy", "value": "Always"},
                {"op": "replace", "path": f"{container}/0/resources", "value": node_resources},
                {"op": "replace", "path": f"{container}/1/resources", "value": small},
                {"op": "replace", "path": f"{container}/2/resources", "value": small}]),
            ({"kind": "ServiceAccount", "name": "cachefs-csi-node"}, [
                {"op": "add", "path": "/metadata/annotations",
                 "value": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/c"}}]),
            ({"kind": "Deployment", "name": "cachefs-csi-controller"}, flag_patches(
                controller_args, 0, ["--log-level=WARNING"]) + [
                {"op": "replace", "path": "/spec/replicas", "value": 3},
                {"op": "replace", "path": f"{container}/0/imagePullPolicy", "value": "Always"},
                {"op": "replace", "path": f"{container}/0/resources", "value": small},
                {"op": "replace", "path": f"{container}/1/resources", "value": small}]),
            ({"kind": "Deployment", "name": "cachefs-operator"}, [
                {"op": "replace", "path": f"{container}/0/imagePullPolicy", "value": "Always"},
                {"op": "replace", "path": f"{container}/0/resources", "value": small}]),
            ({"kind": "StorageClass"}, [
                {"op": "replace", "path": "/parameters/bucket", "value": "ml-volumes"},
                {"op": "add", "path": "/parameters/endpointUrl", "value": "https://s3.storage.example.com"}] + [
                {"op": "add", "path": f"/parameters/{key}", "value": value} for key, value in every_class.items()]),
            ({"kind": "StorageClass", "name": "cachefs-clustered"}, [
                {"op": "replace", "path": "/parameters/clusterEndpointUrl",
                 "value": "http://cachefs-cluster-store.ml-cache.svc:8333"}] + [
                {"op": "add", "path": f"/parameters/{key}", "value": value} for key, value in clustered.items()]),
            ({"kind": "StatefulSet", "name": "cachefs-cluster-store"}, [
                {"op": "replace", "path": "/spec/volumeClaimTemplates/0/spec/resources/requests/storage",
                 "value": "500Gi"},
                {"op": "add", "path": "/spec/volumeClaimTemplates/0/spec/storageClassName", "value": "local-nvme"},
                {"op": "replace", "path": f"{container}/0/resources", "value": small}]),
        ])
    # Every RBAC subject moved with the overlay's namespace (the operator's were once written as `cachefs`).
    assert {s["namespace"] for obj in kustomized for s in obj.get("subjects", [])} == {"ml-cache"}
    assert plugin(kustomized, "cachefs-csi-controller", "cachefs-csi")["args"].count("--log-level=WARNING") == 1
    chart = render(values, namespace="ml-cache")
    assert_same_objects(chart, kustomized)
    # The comparison can fail: one value the overlay does not make differs.
    with pytest.raises(AssertionError, match="differs between the chart and kustomize"):
        assert_same_objects(render(merged(values, {"node": {"maxVolumes": 21}}), namespace="ml-cache"), kustomized)


# ------------------------------------------------------------------------------------ the docs
def test_the_readme_labels_the_namespace_as_the_base_does() -> None:
    """The chart makes no Namespace (Helm records the release in it first): the README's Helm steps
    create it with the labels deploy/base/namespace.yaml gives it."""
    (namespace,) = by_kind(kustomize_build(DEPLOY / "base"), "Namespace")
    text = README.read_text()
    section = text[text.index("\n## Install with Helm\n"):]
    section = section[:section.index("\n## ", 1)]
    for label, value in namespace["metadata"]["labels"].items():
        assert f"{label}={value}" in section, f"deploy/README.md's Helm install does not set {label}={value}"
    assert "helm install cachefs deploy/helm/cachefs" in section


def test_the_readme_values_file_and_set_flags_are_accepted_and_render() -> None:
    """The values file and the ``--set`` flags deploy/README.md shows pass the schema and render."""
    text = README.read_text()
    section = text[text.index("\n## Install with Helm\n"):]
    section = section[:section.index("\n## ", 1)]
    (shown,) = [yaml.safe_load(block) for block in fenced_blocks(section, "yaml")]
    objects = render(shown)
    (storage_class,) = by_kind(objects, "StorageClass")
    assert storage_class["parameters"]["bucket"] == shown["storageClass"]["bucket"]
    flags = re.findall(r"`(--set [^`]+)`", section)
    assert flags, "the README shows no --set example"
    for flag in flags:
        words = shlex.split(flag)
        for expression in words[1::2]:
            with helm.Chart.load(CHART) as chart:
                chart.validate_schema(helm.parse_set_string(expression))


def test_literal_braces_in_a_manifest_reach_the_cluster_unchanged(tmp_path: Path) -> None:
    """A '{{' in deploy/ (a script in a command, a printf format) would be a template action in the
    chart; the generator quotes it so that Helm renders it back as written."""
    module = generator()
    literal = 'printf "{{ .x }}" and {{- not an action }}'
    markers = module.Markers()
    obj = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"script": literal}}
    text = module.render_template(module.strings(obj, lambda s: markers.inline_text(module.quoted(s))
                                                 if "{{" in s else s), markers)
    assert literal not in text
    chart = tmp_path / "braces"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: braces\nversion: 0.1.0\n")
    (chart / "templates" / "configmap.yaml").write_text(text)
    with helm.Chart.load(chart) as loaded:
        (rendered,) = loaded.render({}, name="b", namespace="n").values()
    assert yaml.safe_load(rendered)["data"]["script"] == literal
