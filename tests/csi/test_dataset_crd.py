"""Every CRD in deploy/ passes the API server's structural-schema rules, and the API double applies them.

A real API server refused the Dataset CRD at 10 places (``additionalProperties`` beside
``properties``), a rule kubernetes-validate does not check (issue 23). ``tests/support/crd_schema.py``
writes the API server's rules down; here they run over every CRD that deploy/ ships, they are shown to
catch what the API server refused, and the API double (tests/support/kubeapi.py) is shown to refuse a
non-structural CRD and to prune what a schema does not declare, as the API server does.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from kubernetes import client

from tests.support.crd_schema import apply_defaults, invalid_fields, prune, structural_problems
from tests.support.kubeapi import ApiDouble

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def deploy_crds() -> list[tuple[Path, dict[str, Any]]]:
    found = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        if DEPLOY / "helm" in path.parents:  # templates of the objects below (tests/csi/test_helm_chart.py)
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition":
                found.append((path, doc))
    return found


def crd(schema: dict[str, Any], *, status: bool = True) -> dict[str, Any]:
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": "widgets.example.com"},
            "spec": {"group": "example.com", "scope": "Namespaced",
                     "names": {"kind": "Widget", "plural": "widgets", "singular": "widget", "listKind": "WidgetList"},
                     "versions": [{"name": "v1", "served": True, "storage": True,
                                   "subresources": {"status": {}} if status else {},
                                   "schema": {"openAPIV3Schema": schema}}]}}


GOOD = {"type": "object", "properties": {
    "metadata": {"type": "object"},
    "spec": {"type": "object", "properties": {
        "size": {"type": "string"},
        "port": {"x-kubernetes-int-or-string": True},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "items": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"}}}}}},
    "status": {"type": "object", "properties": {
        "phase": {"type": "string"},
        "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}}}


def test_every_crd_in_deploy_is_structural() -> None:
    crds = deploy_crds()
    assert crds, "deploy/ ships the Dataset CRD"
    for path, doc in crds:
        assert structural_problems(doc) == [], path


@pytest.mark.parametrize("change, problem", [
    (lambda s: s["properties"]["spec"].update(additionalProperties=False), "mutual exclusive"),
    (lambda s: s["properties"]["spec"]["properties"]["size"].pop("type"), "properties[size].type: Required value"),
    (lambda s: s["properties"]["spec"]["properties"]["items"].pop("items"), "items: Required value"),
    (lambda s: s["properties"]["spec"]["properties"]["port"].update(type="string"), "must be empty"),
    (lambda s: s["properties"]["status"]["properties"]["free"].update({"x-kubernetes-preserve-unknown-fields": False}),
     "must be true or undefined"),
    (lambda s: s["properties"]["metadata"].update(properties={"labels": {"type": "object"}}),
     "only name and generateName"),
    (lambda s: s["properties"]["spec"].update(anyOf=[{"type": "object", "required": ["size"]}]),
     "anyOf[0].type: Forbidden"),
    (lambda s: s.update(type="array"), "must be object at the root"),
    (lambda s: s["properties"]["spec"]["properties"]["items"].update(uniqueItems=True), "uniqueItems"),
])
def test_the_checker_finds_what_the_api_server_refuses(change: Any, problem: str) -> None:
    assert structural_problems(crd(GOOD)) == []
    schema = copy.deepcopy(GOOD)
    change(schema)
    problems = structural_problems(crd(schema))
    assert any(problem in p for p in problems), problems


def test_the_checker_finds_the_ten_places_the_api_server_named_in_the_old_dataset_crd() -> None:
    (path, doc), = [(p, d) for p, d in deploy_crds() if d["metadata"]["name"] == "datasets.cachefs.io"]
    spec = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    broken = copy.deepcopy(doc)
    broken_spec = broken["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]

    def close(node: dict[str, Any]) -> Iterator[None]:  # the old CRD: every object node closed
        if "properties" in node:
            node["additionalProperties"] = False
            yield None
            for child in node["properties"].values():
                yield from close(child)

    closed = len(list(close(broken_spec)))  # 10 in a115150's CRD, the ten the API server named; more since
    assert closed >= 10 and spec is not broken_spec
    problems = structural_problems(broken)
    assert len(problems) == closed and all("mutual exclusive" in p for p in problems)


def test_pruning_drops_what_is_not_declared() -> None:
    obj = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w", "anything": 1},
           "spec": {"size": "1", "sise": "typo", "labels": {"a": "b"}, "items": [{"name": "x", "extra": 1}]},
           "status": {"phase": "Up", "generation": 3, "free": {"any": {"thing": 1}}}, "other": True}
    pruned, dropped = prune(obj, GOOD)
    assert pruned == {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w", "anything": 1},
                      "spec": {"size": "1", "labels": {"a": "b"}, "items": [{"name": "x"}]},
                      "status": {"phase": "Up", "free": {"any": {"thing": 1}}}}
    assert sorted(dropped) == ["other", "spec.items[0].extra", "spec.sise", "status.generation"]
    assert obj["spec"]["sise"] == "typo"  # the input is left as it was


DEFAULTING = {"type": "object", "properties": {
    "spec": {"type": "object", "properties": {
        "size": {"type": "string", "default": "1Gi"},
        "mode": {"type": "string", "enum": ["Fast", "Safe"], "default": "Safe"},
        "count": {"type": "integer", "minimum": 1, "maximum": 10},
        "target": {"type": "object", "properties": {"tier": {"type": "string", "default": "Cluster"}}},
        "made": {"type": "object", "default": {}, "properties": {"x": {"type": "integer", "default": 3}}},
        "items": {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "pattern": "^[a-z]+$"}, "weight": {"type": "integer", "default": 1}}}},
    }},
}}


def test_defaults_fill_what_is_absent_or_null_inside_parents_that_exist() -> None:
    obj = {"metadata": {"name": "w"}, "spec": {"mode": None, "items": [{"name": "a"}, {"name": "b", "weight": 5}]}}
    out = apply_defaults(obj, DEFAULTING)
    assert out["spec"] == {"size": "1Gi", "mode": "Safe", "made": {"x": 3},
                           "items": [{"name": "a", "weight": 1}, {"name": "b", "weight": 5}]}
    assert "target" not in out["spec"]  # an absent parent is not created for its children's defaults
    assert out["metadata"] == {"name": "w"} and obj["spec"]["mode"] is None  # the input is left as it was
    assert apply_defaults({"spec": {"target": {}}}, DEFAULTING)["spec"]["target"] == {"tier": "Cluster"}


def test_validation_names_each_field_the_schema_refuses() -> None:
    good = apply_defaults({"metadata": {"name": "Not_Checked"}, "spec": {"count": 3, "items": [{"name": "a"}]}},
                          DEFAULTING)
    assert invalid_fields(good, DEFAULTING) == []
    bad = {"spec": {"mode": "Turbo", "count": 0, "size": 5, "items": [{"name": "A1"}, {"weight": 2}]}}
    problems = invalid_fields(bad, DEFAULTING)
    assert any(p.startswith("spec.mode: Unsupported value: 'Turbo'") and '"Fast", "Safe"' in p for p in problems)
    assert any(p.startswith("spec.count: Invalid value: 0") for p in problems)
    assert any(p.startswith("spec.size: Invalid value: 5") for p in problems)
    assert any(p.startswith("spec.items[0].name: Invalid value: 'A1'") for p in problems)
    assert any(p.startswith("spec.items[1]: Required value") and "'name'" in p for p in problems)
    assert len(problems) == 5


@pytest.fixture(scope="module")
def double(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiDouble]:
    api = ApiDouble(tmp_path_factory.mktemp("crd-double")).start()
    try:
        yield api
    finally:
        api.stop()


def test_the_double_refuses_a_non_structural_crd_and_prunes_by_a_structural_one(double: ApiDouble) -> None:
    core = double.client()
    extensions = client.ApiextensionsV1Api(core.api_client)
    custom = client.CustomObjectsApi(core.api_client)
    bad = copy.deepcopy(GOOD)
    bad["properties"]["spec"]["additionalProperties"] = False
    with pytest.raises(client.ApiException) as info:
        extensions.create_custom_resource_definition(crd(bad))
    assert info.value.status == 422 and "mutual exclusive" in info.value.body
    extensions.create_custom_resource_definition(crd(GOOD))

    body = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w", "namespace": "ml"},
            "spec": {"size": "1", "sise": "typo"}, "status": {"phase": "ignored on create"}}
    custom.create_namespaced_custom_object("example.com", "v1", "ml", "widgets", body)
    created = custom.get_namespaced_custom_object("example.com", "v1", "ml", "widgets", "w")
    assert created["spec"] == {"size": "1"} and "status" not in created  # pruned; status is a subresource
    status = {"status": {"phase": "Up", "generation": 2, "free": {"k": "v"}}, "spec": {"size": "2"}}
    patched = custom.patch_namespaced_custom_object_status("example.com", "v1", "ml", "widgets", "w", status)
    assert patched["status"] == {"phase": "Up", "free": {"k": "v"}}  # undeclared generation pruned
    assert patched["spec"] == {"size": "1"}  # a status write changes nothing else
    patched = custom.patch_namespaced_custom_object("example.com", "v1", "ml", "widgets", "w",
                                                    {"spec": {"size": "3", "sise": "x"}, "status": {"phase": "No"}})
    assert patched["spec"] == {"size": "3"} and patched["status"]["phase"] == "Up"
    stored = custom.get_namespaced_custom_object("example.com", "v1", "ml", "widgets", "w")
    assert stored["spec"] == {"size": "3"} and stored["status"] == {"phase": "Up", "free": {"k": "v"}}
    assert [entry[2] for entry in double.emulator.pruned if entry[1] == "w"] == [
        ["spec.sise"], ["status.generation"], ["spec.sise"]]


@pytest.mark.parametrize("path, obj, mutable, immutable, message", [
    ("/apis/storage.k8s.io/v1/storageclasses",
     {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": "sc"},
      "provisioner": "csi.cachefs.io", "parameters": {"bucket": "a"}, "reclaimPolicy": "Delete"},
     {"mountOptions": ["ro"]}, {"parameters": {"clusterCache": "s3://c/"}}, "updates to parameters are forbidden"),
    ("/api/v1/persistentvolumes",
     {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "pv"},
      "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"],
               "csi": {"driver": "csi.cachefs.io", "volumeHandle": "h", "volumeAttributes": {"source": "s3://b/"}}}},
     {"spec": {"capacity": {"storage": "2Gi"}}}, {"spec": {"csi": {"volumeAttributes": {"ramCache": "1GiB"}}}},
     "spec.persistentvolumesource is immutable after creation"),
    ("/apis/storage.k8s.io/v1/csidrivers",
     {"apiVersion": "storage.k8s.io/v1", "kind": "CSIDriver", "metadata": {"name": "csi.example.com"},
      "spec": {"attachRequired": False, "podInfoOnMount": True}},
     {"spec": {"requiresRepublish": True}}, {"spec": {"attachRequired": True}}, "spec.attachRequired"),
    ("/apis/batch/v1/namespaces/ml/jobs",
     {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j", "namespace": "ml"},
      "spec": {"template": {"spec": {"containers": [{"name": "c", "image": "i:1"}]}}}},
     {"spec": {"ttlSecondsAfterFinished": 60}},
     {"spec": {"template": {"spec": {"containers": [{"name": "c", "image": "i:2"}]}}}}, "spec.template"),
])
def test_the_double_refuses_changes_to_immutable_fields(double: ApiDouble, path: str, obj: dict[str, Any],
                                                        mutable: dict[str, Any], immutable: dict[str, Any],
                                                        message: str) -> None:
    api = double.client().api_client
    named = f"{path}/{obj['metadata']['name']}"

    def call(method: str, url: str, body: Any, content_type: str = "application/json") -> None:
        api.call_api(url, method, body=body, header_params={"Content-Type": content_type}, auth_settings=[],
                     response_types_map={200: "object", 201: "object"})

    call("POST", path, obj)
    call("PATCH", named, mutable, "application/merge-patch+json")  # allowed
    with pytest.raises(client.ApiException) as info:
        call("PATCH", named, immutable, "application/merge-patch+json")
    assert info.value.status == 422 and message in info.value.body
