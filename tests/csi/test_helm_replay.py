"""deploy/README.md's "Install with Helm" (install, upgrade, uninstall) replayed against the API double.

The chart is rendered by Helm's own library (tests/csi/test_helm_chart.py ``render``); what Helm then
does with the objects is played here as Helm does it: the ordinary objects applied (a three-way
patch on upgrade, as tests/csi/test_install_replay.py's ``Kubectl``), the hooks (the cluster store's
bucket Job) created after them and deleted once they succeed (``hook-succeeded``; there is no Job
controller here, so success is taken), and on uninstall the release's objects deleted. The double
(tests/support/kubeapi.py) refuses what an API server refuses: a CRD that is not structural, a change
to a Job's pod template, to a StorageClass's parameters.

The namespace is made from the README's own ``kubectl create namespace`` and ``kubectl label``
lines, and the upgrade is the README's: a new ``image.tag`` with the cluster store and Datasets
switched on, by ``helm upgrade`` alone.
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

import pytest

from tests.csi.test_helm_chart import SITE, merged, render
from tests.csi.test_install_replay import Kubectl, Refused, cluster, documents, stored  # noqa: F401 (fixture)
from tests.csi.test_manifests import DEPLOY

HOOK = "helm.sh/hook"


def helm_section() -> str:
    text = (DEPLOY / "README.md").read_text()
    section = text[text.index("\n## Install with Helm\n"):]
    return section[:section.index("\n## ", 1)]


def readme_namespace() -> dict[str, Any]:
    """The Namespace the README's `kubectl create namespace` and `kubectl label namespace` make."""
    commands = [shlex.split(line.strip()) for line in helm_section().splitlines()
                if re.match(r"\s*kubectl (create|label) namespace ", line)]
    (create,) = [c for c in commands if c[1] == "create"]
    (label,) = [c for c in commands if c[1] == "label"]
    assert create[3] == label[3], "the README labels another namespace than it creates"
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": create[3], "labels": dict(arg.split("=", 1) for arg in label[4:])}}


def release(values: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The chart's objects for ``values``: (ordinary objects, hooks)."""
    objects = render(values)
    hooks = [o for o in objects if HOOK in (o["metadata"].get("annotations") or {})]
    return [o for o in objects if o not in hooks], hooks


def run_hooks(kubectl: Kubectl, hooks: list[dict[str, Any]]) -> None:
    for hook in hooks:
        policy = hook["metadata"]["annotations"]["helm.sh/hook-delete-policy"].split(",")
        if "before-hook-creation" in policy:
            kubectl.delete([hook])
        kubectl.apply([hook])
        if "hook-succeeded" in policy:  # the Job succeeded (no Job controller here to run it)
            kubectl.delete([hook])


def test_helm_install_upgrade_and_uninstall_as_the_readme_gives_them(cluster) -> None:  # noqa: F811
    api, kubectl = cluster
    namespace = readme_namespace()
    assert namespace["metadata"]["name"] == "cachefs"
    # Steps 2 and 3: the namespace with its labels, then the Secrets (the workload namespace first).
    kubectl.apply([namespace, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ml"}}])
    kubectl.apply(documents(DEPLOY / "examples" / "secret.yaml"))
    kubectl.apply([{"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                    "metadata": {"name": "cachefs-cluster-store-credentials", "namespace": "cachefs"},
                    "stringData": {"accessKeyId": "AKIAEXAMPLE", "secretAccessKey": "not-a-secret"}}])
    # Step 4: helm install with the site's values and the cluster store.
    installed = merged(SITE, {"clusterStore": {"enabled": True}})
    objects, hooks = release(installed)
    assert [h["kind"] for h in hooks] == ["Job"]
    kubectl.apply(objects)
    run_hooks(kubectl, hooks)

    # Upgrade: a new image tag, Datasets switched on; `helm upgrade` alone, nothing deleted by hand.
    upgraded_values = merged(installed, {"image": {"tag": "0.2.0"}, "datasets": {"enabled": True}})
    upgraded, hooks = release(upgraded_values)
    kubectl.apply(upgraded)
    run_hooks(kubectl, hooks)
    (daemonset,) = [o for o in upgraded if o["kind"] == "DaemonSet"]
    live = kubectl.get(daemonset)
    assert live is not None and "registry.example.com/cachefs-csi:0.2.0" in json.dumps(live["spec"]["template"])
    kubectl.apply(documents(DEPLOY / "examples" / "dataset.yaml"))
    assert any(plural == "datasets" for plural, _ in stored(api))

    # Uninstall: Datasets first (the operator's finalizer), then `helm uninstall`, then the namespace.
    kubectl.delete([d for d in documents(DEPLOY / "examples" / "dataset.yaml") if d["kind"] == "Dataset"])
    kubectl.delete(upgraded)
    left = stored(api)
    # What the README says stays: the namespace it created and the Secrets put in it and in `ml`.
    assert left == {("namespaces", "cachefs"), ("namespaces", "ml"), ("secrets", "cachefs-s3-credentials"),
                    ("secrets", "cachefs-provisioner-credentials"),
                    ("secrets", "cachefs-cluster-store-credentials")}, left
    kubectl.delete([namespace])
    assert stored(api) == {("namespaces", "ml"), ("secrets", "cachefs-s3-credentials")}


def test_the_bucket_job_as_an_ordinary_object_would_stop_that_upgrade(cluster) -> None:  # noqa: F811
    """Why the Job is a hook: applied as an ordinary object, the new image in its pod template is
    refused (a Job's template is immutable), so `helm upgrade` with a new tag would fail."""
    _, kubectl = cluster
    kubectl.apply([readme_namespace()])
    _, (job,) = release(merged(SITE, {"clusterStore": {"enabled": True}}))
    kubectl.apply([job])
    _, (next_job,) = release(merged(SITE, {"clusterStore": {"enabled": True}, "image": {"tag": "0.2.0"}}))
    with pytest.raises(Refused, match="Job 'cachefs-cluster-store-bucket' is invalid: spec.template"):
        kubectl.apply([next_job])


def test_a_new_storage_class_value_needs_the_class_deleted_first_as_the_readme_says(cluster) -> None:  # noqa: F811
    """StorageClass parameters cannot change: `helm upgrade` with another storageClass value is
    refused until the class is deleted (its volumes keep the attributes they were made with)."""
    _, kubectl = cluster
    kubectl.apply([readme_namespace()])
    objects, _ = release(SITE)
    kubectl.apply(objects)
    changed, _ = release(merged(SITE, {"storageClass": {"parameters": {"diskCache": "100GiB"}}}))
    with pytest.raises(Refused, match="updates to parameters are forbidden"):
        kubectl.apply(changed)
    assert "kubectl delete storageclass cachefs" in helm_section()
    (storage_class,) = [o for o in objects if o["kind"] == "StorageClass"]
    kubectl.delete([storage_class])
    kubectl.apply(changed)
    live = kubectl.get(storage_class)
    assert live is not None and live["parameters"]["diskCache"] == "100GiB"
