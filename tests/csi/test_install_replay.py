"""deploy/README.md's Install, upgrade (adding a component to a running install) and Uninstall steps,
replayed in order against the API double, which refuses what the API server refuses.

The overlays are rendered by real kustomize (tests/csi/kustomize.py); ``Kubectl`` applies them as
``kubectl apply`` does (create, or a merge patch computed from the last-applied configuration it keeps
in the ``kubectl.kubernetes.io/last-applied-configuration`` annotation) and deletes them as ``kubectl
delete`` does. The double (tests/support/kubeapi.py) checks CRDs for structural schemas, prunes custom
resources, and refuses changes to immutable fields: on a real 1.28 cluster, adding the cluster-store
component to an installed driver failed with "The StorageClass "cachefs" is invalid: parameters:
Forbidden: updates to parameters are forbidden" and the Dataset CRD was refused (issue 23); both
failed here too before deploy/ was fixed.

A dynamically provisioned claim is played through as external-provisioner would (CreateVolume with
the class's parameters, a PV with the provisioner's identity in its attributes); its attributes must
parse as NodeStage parses them, and cannot be changed afterwards.
"""

from __future__ import annotations

import json
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from csi_driver import attributes
from csi_driver.controller import ControllerOps, InMemoryBucketAdmin
from tests.csi.kustomize import kustomize_build
from tests.csi.test_manifests import CLUSTER_SCOPED, DEPLOY
from tests.support.kubeapi import ApiDouble
from tests.support.provisioner import create_parameters, provisioned_attributes

LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"
SITE_IMAGE, SITE_IMAGE_NEXT = "registry.example.com/cachefs-csi:0.1.0", "registry.example.com/cachefs-csi:0.2.0"
REQUEST_TIMEOUT_S = 30


class Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message


def plural(kind: str) -> str:
    lower = kind.lower()
    if lower.endswith("s"):
        return lower + "es"
    if lower.endswith("y"):
        return lower[:-1] + "ies"
    return lower + "s"


class Kubectl:
    """``kubectl apply``/``delete`` (client side) over plain HTTP against the double."""

    def __init__(self, url: str) -> None:
        self.url = url

    def path(self, obj: dict[str, Any], named: bool = True) -> str:
        group_version = obj["apiVersion"]
        root = f"/api/{group_version}" if "/" not in group_version else f"/apis/{group_version}"
        namespace = obj["metadata"].get("namespace")
        if obj["kind"] not in CLUSTER_SCOPED:
            root += f"/namespaces/{namespace or 'default'}"
        root += f"/{plural(obj['kind'])}"
        return root + (f"/{obj['metadata']['name']}" if named else "")

    def call(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": content_type})
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            try:
                message = json.loads(text).get("message", text)
            except ValueError:
                message = text
            raise Refused(exc.code, f"{method} {path}: {message}") from None

    def get(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        try:
            return self.call("GET", self.path(obj))
        except Refused as exc:
            if exc.status == 404:
                return None
            raise

    def apply(self, objects: list[dict[str, Any]]) -> None:
        """Every object in turn; as kubectl, an object refused does not stop the others, and the
        command then fails naming every refusal."""
        refused: list[Refused] = []
        for obj in objects:
            desired = json.loads(json.dumps(obj))
            config = json.dumps(desired, sort_keys=True)
            desired["metadata"].setdefault("annotations", {})[LAST_APPLIED] = config
            try:
                live = self.get(obj)
                if live is None:
                    self.call("POST", self.path(obj, named=False), desired, "application/json")
                    continue
                last = json.loads(((live["metadata"].get("annotations") or {}).get(LAST_APPLIED)) or "{}")
                patch = merge_patch(last, desired)
                if patch:
                    self.call("PATCH", self.path(obj), patch, "application/merge-patch+json")
            except Refused as exc:
                refused.append(exc)
        if refused:
            raise Refused(refused[0].status, "; ".join(exc.message for exc in refused))

    def delete(self, objects: list[dict[str, Any]]) -> None:
        for obj in reversed(objects):  # kubectl delete -k: NotFound is reported, not fatal
            try:
                self.call("DELETE", self.path(obj))
            except Refused as exc:
                if exc.status != 404:
                    raise


def merge_patch(last: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any]:
    """kubectl's three-way patch, as a JSON merge patch: what changed from the last-applied configuration
    (fields dropped from it are removed; fields others set and it never had are left alone)."""
    patch: dict[str, Any] = {}
    for key in last:
        if key not in desired:
            patch[key] = None
    for key, value in desired.items():
        if isinstance(value, dict) and isinstance(last.get(key), dict):
            inner = merge_patch(last[key], value)
            if inner:
                patch[key] = inner
        elif last.get(key) != value:
            patch[key] = value
    return patch


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.fixture
def cluster() -> Iterator[tuple[ApiDouble, Kubectl]]:
    api = ApiDouble(Path(tempfile.mkdtemp(prefix="replay-"))).start()
    try:
        yield api, Kubectl(api.url)
    finally:
        api.stop()


def stored(api: ApiDouble) -> set[tuple[str, str]]:
    assert api.emulator is not None
    return {(key[0].plural, key[2]) for key, obj in list(api.emulator.objects.items()) if not obj.deleted}


def provision(kubectl: Kubectl, claim: dict[str, Any]) -> dict[str, Any]:
    """external-provisioner's part for ``claim``: CreateVolume, then a PV with what it adds, bound."""
    storage_class = kubectl.get({"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
                                 "metadata": {"name": claim["spec"]["storageClassName"]}})
    assert storage_class is not None
    name = f"pvc-{claim['metadata']['name']}"
    created = ControllerOps(InMemoryBucketAdmin(buckets={"ml-volumes": set()})).create_volume(
        name, create_parameters(storage_class["parameters"], claim["metadata"]["name"],
                                claim["metadata"]["namespace"], name), credentials=None)
    pv = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name},
          "spec": {"capacity": {"storage": claim["spec"]["resources"]["requests"]["storage"]},
                   "accessModes": claim["spec"]["accessModes"], "persistentVolumeReclaimPolicy": "Delete",
                   "storageClassName": storage_class["metadata"]["name"],
                   "csi": {"driver": "csi.cachefs.io", "volumeHandle": created.volume_id,
                           "volumeAttributes": provisioned_attributes(created.volume_context)}}}
    kubectl.call("POST", "/api/v1/persistentvolumes", pv)
    return pv


def test_install_add_the_cluster_store_and_datasets_then_uninstall(cluster) -> None:
    api, kubectl = cluster
    example = kustomize_build(DEPLOY / "overlays" / "example")
    # Install 3 and 4: the driver, the workload namespace, the Secrets.
    kubectl.apply(example)
    kubectl.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ml"}}])
    kubectl.apply(documents(DEPLOY / "examples" / "secret.yaml"))
    kubectl.apply(example)  # applying the same overlay again changes nothing and is accepted

    # A PVC of the `cachefs` class, provisioned as external-provisioner does; NodeStage's parser
    # accepts the PV's attributes, and they cannot change afterwards (a real API server's rule).
    (claim, _pod) = documents(DEPLOY / "examples" / "dynamic-pvc.yaml")
    kubectl.apply([claim])
    pv = provision(kubectl, claim)
    settings = attributes.parse_volume_attributes(pv["spec"]["csi"]["volumeAttributes"])
    assert settings.source.startswith("s3://ml-volumes/volumes/")
    with pytest.raises(Refused, match="spec.persistentvolumesource is immutable"):
        kubectl.call("PATCH", "/api/v1/persistentvolumes/" + pv["metadata"]["name"],
                     {"spec": {"csi": {"volumeAttributes": {"ramCache": "2GiB"}}}}, "application/merge-patch+json")

    # Shared cluster store, after the Install steps: its Secret, then the overlay with the component.
    kubectl.apply([{"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                    "metadata": {"name": "cachefs-cluster-store-credentials", "namespace": "cachefs"},
                    "stringData": {"accessKeyId": "AKIAEXAMPLE", "secretAccessKey": "not-a-secret"}}])
    with_store = kustomize_build(DEPLOY / "overlays" / "with-cluster-store")
    kubectl.apply(with_store)
    clustered_claim = {**claim, "metadata": {**claim["metadata"], "name": "shared"},
                       "spec": {**claim["spec"], "storageClassName": "cachefs-clustered"}}
    kubectl.apply([clustered_claim])
    clustered = provision(kubectl, clustered_claim)
    options = attributes.parse_volume_attributes(clustered["spec"]["csi"]["volumeAttributes"]).cache
    assert options.cluster_cache == "s3://cachefs-cluster/"

    # Upgrade 1: a new image tag. The bucket Job's pod template names the image, and a Job's template
    # is immutable: the README has the Job deleted first (creating the bucket again is harmless).
    upgraded = json.loads(json.dumps(with_store).replace(SITE_IMAGE, SITE_IMAGE_NEXT))
    with pytest.raises(Refused, match="Job 'cachefs-cluster-store-bucket' is invalid: spec.template"):
        kubectl.apply(upgraded)
    (job,) = [o for o in upgraded if o["kind"] == "Job"]
    kubectl.delete([job])  # `kubectl -n cachefs delete job cachefs-cluster-store-bucket --ignore-not-found`
    kubectl.apply(upgraded)
    (daemonset,) = [o for o in upgraded if o["kind"] == "DaemonSet"]
    live = kubectl.get(daemonset)
    assert live is not None and SITE_IMAGE_NEXT in json.dumps(live["spec"]["template"])
    with_store = upgraded

    # Datasets: the CRD (structural, or the API server refuses it) and the operator; then a Dataset.
    with_datasets = kustomize_build(DEPLOY / "overlays" / "with-datasets")
    kubectl.apply(with_datasets)
    kubectl.apply(documents(DEPLOY / "examples" / "dataset.yaml"))
    assert ("datasets", "imagenet") in stored(api) or any(p == "datasets" for p, _ in stored(api))

    # Uninstall (deploy/README.md, in its order): Datasets, claims, then the driver and components.
    datasets = [d for d in documents(DEPLOY / "examples" / "dataset.yaml") if d["kind"] == "Dataset"]
    kubectl.delete(datasets)
    kubectl.delete([claim, clustered_claim])
    for volume in (pv, clustered):  # what the provisioner does for a claim's Delete-policy volume
        kubectl.delete([volume])
    kubectl.delete(with_datasets)
    kubectl.delete(with_store)
    kubectl.delete(example)
    left = stored(api)
    assert left == {("namespaces", "ml"), ("secrets", "cachefs-s3-credentials")}, left


def test_the_readme_uninstall_section_gives_the_order_replayed_here() -> None:
    """The order above (Datasets, claims, then the driver) is the one deploy/README.md's Uninstall gives,
    and the section names what stays on the nodes and the command that removes it."""
    text = (DEPLOY / "README.md").read_text()
    section = text[text.index("## Uninstall"):]
    section = section[:section.index("\n## ", 1)]
    steps = [line for line in section.splitlines() if line[:3] in ("1. ", "2. ", "3. ", "4. ")]
    assert [s.split("**")[1] for s in steps] == ["Workloads", "Datasets", "Claims of the cachefs classes", "The driver"]
    assert "kubectl delete datasets --all -A" in section and "kubectl delete -k deploy/overlays/my-site" in section
    assert "rm -rf /var/cache/cachefs-csi /run/cachefs" in section
    assert "reusing the disk caches of N volume(s)" in section  # the plugin's log line, as it writes it
