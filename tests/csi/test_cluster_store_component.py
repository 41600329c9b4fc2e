"""deploy/components/cluster-store (SeaweedFS as the cluster tier's store) rendered by real kustomize.

The example overlay that uses it, ``deploy/overlays/with-cluster-store``, is rendered with
``kubectl kustomize`` (tests/csi/kustomize.py) and every object validated against the Kubernetes
schemas (the component's own files are also validated one by one by tests/csi/test_manifests.py).
Then the pieces are checked against each other and against the driver's parsers: the StorageClass
parameters the component adds parse and point at the component's Service and port, the store
listens where the Service sends, the bucket Job creates the bucket the StorageClass names, both
read the same Secret with the keys the driver's credential parser knows, and every image is pinned
(the cachefs one renamed by the overlay).
"""

from __future__ import annotations

import copy
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest

from csi_driver import attributes
from tests.csi.kustomize import kustomize_build
from tests.csi.test_manifests import CLUSTER_SCOPED, DEPLOY, VERSIONS, by_kind, containers

OVERLAY = DEPLOY / "overlays" / "with-cluster-store"
SITE_IMAGE = "registry.example.com/cachefs-csi:0.1.0"
STORE_SECRET = "cachefs-cluster-store-credentials"


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    return kustomize_build(OVERLAY)


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (obj,) = by_kind(objects, kind)
    return obj


@pytest.mark.parametrize("version", VERSIONS)
def test_overlay_with_the_component_is_valid_kubernetes(rendered, version: str) -> None:
    kinds = {obj["kind"] for obj in rendered}
    assert {"StatefulSet", "Service", "Job", "StorageClass", "DaemonSet", "Deployment"} <= kinds
    for obj in rendered:
        kubernetes_validate.validate(copy.deepcopy(obj), version, strict=True)
        if obj["kind"] not in CLUSTER_SCOPED:
            assert obj["metadata"]["namespace"] == "cachefs", obj["metadata"]["name"]


def storage_class(objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (obj,) = [o for o in by_kind(objects, "StorageClass") if o["metadata"]["name"] == name]
    return obj


def test_the_component_adds_a_storage_class_and_leaves_cachefs_alone(rendered) -> None:
    """StorageClass parameters are immutable: the component must not change `cachefs` (issue 23)."""
    base = storage_class(kustomize_build(DEPLOY / "overlays" / "example"), "cachefs")
    assert storage_class(rendered, "cachefs") == base
    clustered = storage_class(rendered, "cachefs-clustered")
    assert clustered["provisioner"] == base["provisioner"]
    # the site's bucket and endpoint reach both classes; only the cluster tier differs
    assert {k: v for k, v in clustered["parameters"].items() if not k.startswith("cluster")} == base["parameters"]


def test_storage_class_points_at_the_component_store(rendered) -> None:
    params = storage_class(rendered, "cachefs-clustered")["parameters"]
    attributes.parse_provision_parameters(params)  # the driver accepts them
    options = attributes.parse_cache_options(params)
    assert options.cluster_cache == "s3://cachefs-cluster/"
    url = urlsplit(params["clusterEndpointUrl"])
    service = one(rendered, "Service")
    assert url.hostname == f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"
    (port,) = service["spec"]["ports"]
    assert url.port == port["port"] == 8333


def test_store_listens_where_the_service_sends_and_keeps_its_data(rendered) -> None:
    store, service = one(rendered, "StatefulSet"), one(rendered, "Service")
    assert store["spec"]["serviceName"] == service["metadata"]["name"]
    labels = store["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
    (server,) = store["spec"]["template"]["spec"]["containers"]
    args = server["args"]
    assert args[0] == "server" and "-s3" in args
    (s3_port,) = [p for p in server["ports"] if p["name"] == service["spec"]["ports"][0]["targetPort"]]
    assert f"-s3.port={s3_port['containerPort']}" in args
    data_dir = next(a.split("=", 1)[1] for a in args if a.startswith("-dir="))
    (claim,) = store["spec"]["volumeClaimTemplates"]
    assert {"name": claim["metadata"]["name"], "mountPath": data_dir} in server["volumeMounts"]
    config = next(a.split("=", 1)[1] for a in args if a.startswith("-s3.config="))
    (init,) = store["spec"]["template"]["spec"]["initContainers"]
    assert config in init["command"][-1]  # the init container writes the identities file the server reads


def test_bucket_job_and_store_share_the_secret_and_the_bucket(rendered) -> None:
    store, job = one(rendered, "StatefulSet"), one(rendered, "Job")
    params = storage_class(rendered, "cachefs-clustered")["parameters"]
    (creator,) = job["spec"]["template"]["spec"]["containers"]
    command = creator["command"]
    endpoint, url = (command[command.index(flag) + 1] for flag in ("--cluster-endpoint-url", "--cluster-cache"))
    assert f"{url}/" == params["clusterCache"]
    assert urlsplit(endpoint).port == 8333
    for container in [creator, *containers(store)]:
        refs = {e["valueFrom"]["secretKeyRef"]["name"]: None for e in container.get("env", []) if "valueFrom" in e}
        keys = {e["valueFrom"]["secretKeyRef"]["key"] for e in container.get("env", []) if "valueFrom" in e}
        if container["name"] == "seaweedfs":
            continue  # the server reads the identities file, not the Secret
        assert set(refs) == {STORE_SECRET}, container["name"]
        # the same keys as a volume's Secret, as the driver's credential parser reads them
        assert attributes.parse_credentials({k: "x" for k in keys}) is not None


def test_images_are_pinned_and_the_overlay_renames_cachefs(rendered) -> None:
    images = [c["image"] for obj in rendered if obj["kind"] in ("DaemonSet", "Deployment", "StatefulSet", "Job")
              for c in containers(obj)]
    assert all(":" in image and not image.endswith(":latest") for image in images), images
    assert SITE_IMAGE in [c["image"] for c in containers(one(rendered, "Job"))]
    assert {c["image"] for c in containers(one(rendered, "StatefulSet"))} == {"chrislusf/seaweedfs:4.48"}


def test_only_the_drivers_namespace_reaches_the_store(rendered) -> None:
    """Issue 34: tenants' pods (other namespaces) cannot reach the store; the driver's pods can."""
    policy = one(rendered, "NetworkPolicy")
    store = one(rendered, "StatefulSet")
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= store["spec"]["template"]["metadata"]["labels"].items()
    assert policy["metadata"]["namespace"] == store["metadata"]["namespace"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    [rule] = policy["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {}}]  # no namespaceSelector: this namespace only
    assert [p["port"] for p in rule["ports"]] == [8333]


def test_mount_pods_get_the_stores_keys_from_the_drivers_secret(rendered) -> None:
    """The node plugin names the store's Secret in its own namespace; a volume's Secret never holds them."""
    [node] = [o for o in rendered if o["kind"] == "DaemonSet" and o["metadata"]["name"].endswith("csi-node")]
    [plugin] = [c for c in node["spec"]["template"]["spec"]["containers"] if "--mode=node" in c.get("args", [])]
    assert f"--cluster-store-secret={STORE_SECRET}" in plugin["args"]
