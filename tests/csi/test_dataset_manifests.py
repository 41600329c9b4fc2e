"""deploy/ for Datasets: the CRD, the operator's component and overlay, the examples, checked offline.

- Every Dataset under deploy/ is validated against the CRD's own ``openAPIV3Schema`` (jsonschema) and
  accepted by the operator's spec parser; the schema refuses what it should (a typo'd field, a bad
  enum, an out-of-range number).
- The overlay ``deploy/overlays/with-datasets`` is rendered by real kustomize and every object
  validated against the Kubernetes schemas; the operator runs as its ServiceAccount in the driver's
  namespace, with the renamed image.
- The objects the operator would create for the example Dataset (PV, PVC, warm-up Job) are valid
  Kubernetes, the Job's command parses with cachefs's own CLI parser, and the gated training Job
  names the label, gate and claim the operator uses.
- The RBAC deploy/README.md lists is the ClusterRole's, rule for rule.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from csi_driver.operator import manifests as m
from csi_driver.operator.handlers import DEFAULT_IMAGE
from csi_driver.operator.spec import SpecError, parse_spec
from tests.csi.kustomize import kustomize_build
from tests.csi.test_manifests import CLUSTER_SCOPED, DEPLOY, VERSIONS, by_kind, load_documents, manifest_files
from tests.support.crd_schema import prune

COMPONENT = DEPLOY / "components" / "datasets"
OVERLAY = DEPLOY / "overlays" / "with-datasets"
README = DEPLOY / "README.md"


def crd() -> dict[str, Any]:
    (doc,) = load_documents(COMPONENT / "crd.yaml")
    return doc


def schema() -> dict[str, Any]:
    (version,) = crd()["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def datasets() -> list[dict[str, Any]]:
    return [doc for path in manifest_files() for doc in load_documents(path) if doc.get("kind") == "Dataset"]


def example() -> dict[str, Any]:
    (doc,) = load_documents(DEPLOY / "examples" / "dataset.yaml")
    return doc


def test_crd_names_and_columns() -> None:
    doc = crd()
    assert doc["metadata"]["name"] == f"{m.PLURAL}.{m.GROUP}" and doc["spec"]["scope"] == "Namespaced"
    (version,) = doc["spec"]["versions"]
    assert version["name"] == m.VERSION and version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"] if c.get("priority", 0) == 0]
    assert columns == ["Phase", "Cached", "Size", "Hit ratio", "Saved", "Age"]


def test_every_example_dataset_validates_against_the_crd_schema_and_parses() -> None:
    found = datasets()
    assert found, "no Dataset under deploy/"
    validator = jsonschema.Draft7Validator(schema())
    for doc in found:
        errors = sorted(validator.iter_errors(doc), key=str)
        assert not errors, [e.message for e in errors]
        assert prune(doc, schema())[1] == []  # kubectl's strict field validation finds no unknown field
        parse_spec(doc["spec"])  # and the operator accepts it


def test_a_misspelt_field_is_unknown_to_the_schema() -> None:
    """A structural schema cannot close an object (no additionalProperties: false): the API server
    drops an undeclared field, and kubectl's strict field validation refuses it naming it."""
    doc = copy.deepcopy(example())
    doc["spec"]["cache"] = {"ramcache": "1GiB"}
    assert prune(doc, schema())[1] == ["spec.cache.ramcache"]


def test_spec_cache_declares_exactly_the_keys_the_operator_takes() -> None:
    """A key the operator takes but the CRD does not declare would be pruned by the API server before
    the operator ever saw it (what issue 23 found for status fields)."""
    from csi_driver.operator.spec import DATASET_CACHE_KEYS, volume_attributes

    declared = schema()["properties"]["spec"]["properties"]["cache"]["properties"]
    assert set(declared) == set(DATASET_CACHE_KEYS)
    doc = copy.deepcopy(example())
    doc["spec"]["cache"] = {"directIo": True, "ramCache": "1GiB"}
    assert not list(jsonschema.Draft7Validator(schema()).iter_errors(doc))
    assert prune(doc, schema())[1] == []
    assert volume_attributes(doc["spec"])["directIo"] == "true"
    assert parse_spec(doc["spec"])  # the driver's parser takes the value
    doc["spec"]["cache"] = {"diskCache": "50%"}  # a share of the node's cache disk, as StorageClasses may ask
    assert not list(jsonschema.Draft7Validator(schema()).iter_errors(doc))
    assert volume_attributes(doc["spec"])["diskCache"] == "50%"
    assert parse_spec(doc["spec"])
    doc["spec"]["cache"] = {"diskCache": "150%"}  # the schema takes the shape, the driver's parser the range
    with pytest.raises(SpecError, match="from 1% to 100%"):
        parse_spec(doc["spec"])
    doc["spec"]["cache"] = {"fuseThreads": 4}  # several FUSE readers, for a training job's small files
    assert not list(jsonschema.Draft7Validator(schema()).iter_errors(doc))
    assert volume_attributes(doc["spec"])["fuseThreads"] == "4"
    assert parse_spec(doc["spec"]).volume_attributes["fuseThreads"] == "4"
    from cachefs.settings import MAX_FUSE_THREADS
    assert declared["fuseThreads"]["maximum"] == MAX_FUSE_THREADS  # the schema's range is cachefs's
    doc["spec"]["cache"] = {"uploadDelay": 5}  # a write-back key: a Dataset volume is read-only
    with pytest.raises(SpecError, match="unknown key 'uploadDelay'"):
        parse_spec(doc["spec"])


@pytest.mark.parametrize("change, where", [
    ({"warmUp": {"target": {"tier": "Everywhere"}}}, "tier"),
    ({"gate": {"timeoutSeconds": -1}}, "-1"),
    ({"source": "https://bucket/x"}, "source"),
    ({"warmUp": {"schedule": {"policy": "Hourly"}}}, "Hourly"),
    ({"cache": {"maxFetches": 5000}}, "5000"),
    ({"cache": {"fuseThreads": 33}}, "33"),
    ({"cache": {"fuseThreads": 0}}, "0"),
])
def test_the_schema_refuses_bad_specs(change: dict[str, Any], where: str) -> None:
    doc = copy.deepcopy(example())
    for key, value in change.items():
        doc["spec"][key] = value
    errors = list(jsonschema.Draft7Validator(schema()).iter_errors(doc))
    assert errors and any(where in str(e.message) or where in str(list(e.path)) for e in errors), errors


@pytest.mark.parametrize("version", VERSIONS)
def test_overlay_with_datasets_is_valid_kubernetes(version: str) -> None:
    rendered = kustomize_build(OVERLAY)
    assert {"CustomResourceDefinition", "Deployment", "ClusterRole", "ServiceAccount"} <= {o["kind"] for o in rendered}
    for obj in rendered:
        kubernetes_validate.validate(copy.deepcopy(obj), version, strict=True)
        if obj["kind"] not in CLUSTER_SCOPED:
            assert obj["metadata"]["namespace"] == "cachefs", obj["metadata"]["name"]
        for subject in obj.get("subjects", []):
            assert subject["namespace"] == "cachefs"
    (operator,) = [d for d in by_kind(rendered, "Deployment") if d["metadata"]["name"] == "cachefs-operator"]
    pod = operator["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "cachefs-operator"
    (container,) = pod["containers"]
    assert container["name"] == "operator" and container["image"] == "registry.example.com/cachefs-csi:0.1.0"
    assert container["command"] == ["cachefs-operator"]  # warm-up Jobs take this pod's image
    assert {e["name"] for e in container["env"]} == {"POD_NAME", "POD_NAMESPACE"}


def test_what_the_operator_creates_for_the_example_is_valid_kubernetes() -> None:
    from cachefs.cli.main import build_parser

    doc = copy.deepcopy(example())
    doc["metadata"]["uid"] = "00000000-0000-0000-0000-000000000001"
    settings = parse_spec(doc["spec"])
    objects = [m.persistent_volume(doc, settings), m.persistent_volume_claim(doc, settings),
               m.warm_up_job(doc, settings, run=1, image=DEFAULT_IMAGE, node=None),
               m.warm_up_job(doc, settings, run=7, image=DEFAULT_IMAGE, node="gpu-node-17")]
    for obj in objects:
        for version in VERSIONS:
            kubernetes_validate.validate(copy.deepcopy(obj), version, strict=True)
    job = objects[2]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(container["command"][1:])
    assert str(args.mountpoint) == m.DATA_MOUNT and args.json_progress and args.tier == "cluster"
    assert [str(p) for p in args.paths] == ["/data/train", "/data/val"] and args.recursive
    mounts = {v["mountPath"] for v in container["volumeMounts"]}
    assert {m.DATA_MOUNT, m.CONTROL_DIR} <= mounts
    assert len(objects[3]["metadata"]["name"]) <= 63


def test_gated_training_job_matches_the_operator_and_the_example_dataset() -> None:
    (job,) = load_documents(DEPLOY / "examples" / "training-job-gated.yaml")
    template = job["spec"]["template"]
    name = example()["metadata"]["name"]
    assert template["metadata"]["labels"][m.DATASET_LABEL] == name
    assert template["spec"]["schedulingGates"] == [{"name": m.GATE_NAME}]
    claims = [v["persistentVolumeClaim"]["claimName"] for v in template["spec"]["volumes"]]
    assert claims == [name]  # the Dataset's claim is named after it
    assert job["metadata"]["namespace"] == example()["metadata"]["namespace"]


def test_readme_lists_the_operator_rbac_rule_for_rule() -> None:
    (role,) = [d for d in load_documents(COMPONENT / "rbac.yaml") if d["kind"] == "ClusterRole"]
    text = README.read_text()
    section = text[text.index("\n## Datasets\n"):]
    section = section[:section.index("\n## ", 1)]
    listed = set()
    for resources, verbs in re.findall(r"^\| `([^`]+)` \| ([^|]+) \|", section, flags=re.M):
        for resource in resources.split(", "):
            listed.add((resource, frozenset(v.strip(" `") for v in verbs.split(","))))
    expected = set()
    for rule in role["rules"]:
        for group in rule["apiGroups"][:1]:
            for resource in rule["resources"]:
                qualified = f"{resource}.{group}" if group else resource
                expected.add((qualified, frozenset(rule["verbs"])))
    assert listed == expected
