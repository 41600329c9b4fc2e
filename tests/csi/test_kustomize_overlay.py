"""The Kubernetes install path exactly as deploy/README.md gives it, rendered by real kustomize.

Three things a reader relies on, each checked against ``kubectl kustomize`` (tests/csi/kustomize.py):

- The overlay the README shows is ``deploy/overlays/example/kustomization.yaml``, character for
  character, and rendering it really changes the image, keeps every namespaced object, RBAC subject
  and the provisioner Secret reference in the driver's namespace, and validates against the
  Kubernetes schemas. (An overlay whose ``images:`` entry names an image the base does not use is
  silently ignored by kustomize; only a real render shows it.)
- The same overlay with another ``namespace:`` moves all of them.
- The README's install commands, replayed in order on a model of an empty cluster, never put an
  object into a namespace that does not exist yet, name only objects that exist, and leave behind
  the Secrets the StorageClass and the examples refer to; every example then applies.

The replay knows the few commands the README uses (``docker``, ``cp``, ``kubectl apply -k/-f``,
``kubectl create namespace``, ``kubectl rollout status``, ``kubectl get``) and fails on any other,
so a new step in the README needs a matching step here.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.csi import kustomize
from tests.csi.kustomize import kustomize_build
from tests.csi.test_manifests import CLUSTER_SCOPED, DEPLOY, ROOT, VERSIONS, by_kind, containers, load_documents

README = DEPLOY / "README.md"
OVERLAY = DEPLOY / "overlays" / "example"
BASE_IMAGE = "ghcr.io/cachefs/cachefs-csi"
SITE_IMAGE = "registry.example.com/cachefs-csi:0.1.0"
PROVISIONER_SECRET_NAMESPACE = "csi.storage.k8s.io/provisioner-secret-namespace"
PROVISIONER_SECRET_NAME = "csi.storage.k8s.io/provisioner-secret-name"
NODE_PUBLISH_SECRET_NAMESPACE = "csi.storage.k8s.io/node-publish-secret-namespace"
NODE_PUBLISH_SECRET_NAME = "csi.storage.k8s.io/node-publish-secret-name"
# What `kubectl get KIND` accepts for the kinds the README names.
KIND_ALIASES = {"csidriver": "CSIDriver", "daemonset": "DaemonSet", "deployment": "Deployment",
                "storageclass": "StorageClass", "namespace": "Namespace"}
# Namespaces every new cluster has.
BUILT_IN_NAMESPACES = {"default", "kube-system", "kube-public", "kube-node-lease"}


def install_section() -> str:
    text = README.read_text()
    start = text.index("\n## Install\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def fenced_blocks(markdown: str, language: str) -> list[str]:
    """The bodies of the README's fenced blocks of one language, dedented (they sit in list items)."""
    pattern = re.compile(rf"^([ \t]*)```{language}\n(.*?)^\1```", re.M | re.S)
    return [textwrap.dedent(match.group(2)) for match in pattern.finditer(markdown)]


def rendered_overlay(tmp_path: Path, namespace: str) -> list[dict[str, Any]]:
    """The example overlay with its ``namespace:`` line changed, written elsewhere and rendered."""
    text = (OVERLAY / "kustomization.yaml").read_text()
    assert text.count("\nnamespace: cachefs\n") == 1 and text.count("  - ../../base ") == 1
    base = os.path.relpath(DEPLOY / "base", tmp_path)  # kustomize refuses absolute resource paths
    text = text.replace("\nnamespace: cachefs\n", f"\nnamespace: {namespace}\n").replace("../../base", base)
    (tmp_path / "kustomization.yaml").write_text(text)
    return kustomize_build(tmp_path)


def assert_installed_in(objects: list[dict[str, Any]], namespace: str, version: str) -> None:
    (ns,) = by_kind(objects, "Namespace")
    assert ns["metadata"]["name"] == namespace
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    namespaced = [obj for obj in objects if obj["kind"] not in CLUSTER_SCOPED]
    assert namespaced
    for obj in namespaced:
        assert obj["metadata"]["namespace"] == namespace, (obj["kind"], obj["metadata"]["name"])
    bindings = by_kind(objects, "RoleBinding") + by_kind(objects, "ClusterRoleBinding")
    assert len(bindings) == 4  # the provisioner's two, the node plugin's two (mount pods, Events)
    for binding in bindings:
        for subject in binding["subjects"]:
            assert subject["namespace"] == namespace, (binding["kind"], subject)
    (storage_class,) = by_kind(objects, "StorageClass")
    assert storage_class["parameters"][PROVISIONER_SECRET_NAMESPACE] == namespace
    # Each claim's mounting Secret is in the claim's own namespace, filled in by the provisioner.
    assert storage_class["parameters"][NODE_PUBLISH_SECRET_NAMESPACE] == "${pvc.namespace}"
    # The site's image replaces the base's in every container that ran it, and no other image moves.
    images = [c["image"] for obj in objects if obj["kind"] in ("DaemonSet", "Deployment") for c in containers(obj)]
    assert images.count(SITE_IMAGE) == 2, images
    assert not [image for image in images if image.startswith(BASE_IMAGE)], images
    assert storage_class["parameters"]["bucket"] == "ml-volumes"
    assert storage_class["parameters"]["endpointUrl"] == "https://s3.storage.example.com"
    for obj in objects:
        kubernetes_validate.validate(copy.deepcopy(obj), version, strict=True)


# ------------------------------------------------------------------------------------ the overlay
def test_readme_shows_the_example_overlay_verbatim() -> None:
    shown = [block for block in fenced_blocks(install_section(), "yaml")
             if block.startswith("# deploy/overlays/example/kustomization.yaml")]
    assert len(shown) == 1, "deploy/README.md's Install section must show deploy/overlays/example/kustomization.yaml"
    assert shown[0] == (OVERLAY / "kustomization.yaml").read_text()


def test_every_image_the_overlay_sets_is_one_the_base_uses() -> None:
    """kustomize ignores an ``images:`` entry that matches nothing; here it is an error."""
    base_images = {c["image"].partition("@")[0].rpartition(":")[0] for obj in kustomize_build(DEPLOY / "base")
                   if obj["kind"] in ("DaemonSet", "Deployment") for c in containers(obj)}
    spec = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    assert spec["images"]
    for entry in spec["images"]:
        assert entry["name"] in base_images, f"images: {entry['name']} matches none of the base's {sorted(base_images)}"


@pytest.mark.parametrize("version", VERSIONS)
def test_documented_overlay_sets_the_image_and_keeps_the_namespace(version: str) -> None:
    assert_installed_in(kustomize_build(OVERLAY), "cachefs", version)


@pytest.mark.parametrize("version", VERSIONS)
def test_an_overlay_namespace_moves_subjects_and_the_provisioner_secret(tmp_path: Path, version: str) -> None:
    assert_installed_in(rendered_overlay(tmp_path, "storage-system"), "storage-system", version)


@pytest.mark.parametrize("overlay", ["example", "with-cluster-store", "with-datasets"])
def test_every_shipped_overlay_lists_its_endpoints_and_caps_what_a_volume_may_ask(overlay: str) -> None:
    """Issue 34: the default install let a pod author's endpointUrl reach any host, port and path, and
    left ramCache, the mount pod's resources and stopTimeout uncapped."""
    from csi_driver.attributes import Credentials, parse_provision_parameters, parse_volume_attributes
    from csi_driver.errors import CsiError
    from csi_driver.main import build_parser, volume_caps
    from csi_driver.trust import VolumeTrust

    objects = kustomize_build(DEPLOY / "overlays" / overlay)
    (node,) = [obj for obj in by_kind(objects, "DaemonSet") if obj["metadata"]["name"] == "cachefs-csi-node"]
    (plugin,) = [c for c in containers(node) if c["name"] == "cachefs-csi"]
    args = build_parser().parse_args(plugin["args"])
    caps = volume_caps(args)
    assert None not in (caps.max_ram_cache_bytes, caps.max_mount_pod_memory_bytes, caps.max_mount_pod_cpu_milli,
                        caps.max_stop_timeout_s)
    trust = VolumeTrust.from_flags(args.allow_node_identity, args.allowed_endpoints, args.allowed_buckets,
                                   args.cluster_store_endpoint, caps)
    assert trust.allowed_endpoints is not None
    keys = Credentials("AKIDEXAMPLE", "secret")
    for storage_class in by_kind(objects, "StorageClass"):  # what the overlay's own classes name passes
        parameters = {k: v for k, v in storage_class.get("parameters", {}).items() if "/" not in k}
        provision = parse_provision_parameters(parameters)
        context = {"source": f"s3://{provision.bucket}/pvc-1", **provision.cache_attributes}
        if provision.endpoint_url:
            context["endpointUrl"] = provision.endpoint_url
        trust.check("v", parse_volume_attributes(context), keys)
    for hostile in ("http://169.254.169.254/latest", "http://10.0.0.1:6443/", "https://s3.storage.example.com.evil/"):
        with pytest.raises(CsiError, match="not among this driver's allowed endpoints"):
            trust.check("v", parse_volume_attributes({"source": "s3://ml-volumes/p", "endpointUrl": hostile}), keys)
    with pytest.raises(CsiError, match="above this driver's cap"):
        trust.check("v", parse_volume_attributes({"source": "s3://ml-volumes/p", "endpointUrl":
                                                  "https://s3.storage.example.com", "ramCache": "20GiB"}), keys)


def test_the_base_renders_with_its_own_image() -> None:
    images = {c["image"] for obj in kustomize_build(DEPLOY / "base") if obj["kind"] in ("DaemonSet", "Deployment")
              for c in containers(obj) if c["name"] == "cachefs-csi"}
    assert images == {f"{BASE_IMAGE}:0.1.0"}


# ------------------------------------------------------------------------------------ the install steps
@dataclass
class EmptyCluster:
    """What the API server would hold after each command: enough to tell a step that would fail."""

    namespaces: set[str] = field(default_factory=lambda: set(BUILT_IN_NAMESPACES))
    objects: dict[tuple[str, str | None, str], dict[str, Any]] = field(default_factory=dict)

    def apply(self, objects: list[dict[str, Any]], step: str) -> None:
        # kubectl applies in the order given; kustomize puts Namespaces first.
        for obj in objects:
            kind, name = obj["kind"], obj["metadata"]["name"]
            namespace = None
            if kind == "Namespace":
                self.namespaces.add(name)
            elif kind not in CLUSTER_SCOPED:
                namespace = obj["metadata"].get("namespace", "default")
                assert namespace in self.namespaces, \
                    f"`{step}`: {kind} {name} goes into namespace {namespace}, which does not exist yet"
            self.objects[(kind, namespace, name)] = obj

    def has(self, kind: str, namespace: str | None, name: str) -> bool:
        if kind == "Namespace":
            return name in self.namespaces
        return (kind, None if kind in CLUSTER_SCOPED else namespace, name) in self.objects


def install_commands() -> list[list[str]]:
    commands = []
    for block in fenced_blocks(install_section(), "sh"):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(words)
    return commands


def replay(commands: list[list[str]]) -> EmptyCluster:
    cluster = EmptyCluster()
    copies: dict[str, Path] = {}  # what a `cp` made, as the repository path it was copied from

    def path(arg: str) -> Path:
        clean = os.path.normpath(arg)
        for made, source in copies.items():
            if clean == made or clean.startswith(made + os.sep):
                return source / os.path.relpath(clean, made)
        resolved = ROOT / clean
        assert resolved.exists(), f"the README names {arg}, which is not in the repository"
        return resolved

    for words in commands:
        step = shlex.join(words)
        if words[0] == "docker":
            continue  # building and pushing the image touches no cluster
        if words[0] == "cp":
            source, target = [w for w in words[1:] if not w.startswith("-")]
            copies[os.path.normpath(target)] = path(source)
            continue
        assert words[0] == "kubectl", f"`{step}`: the replay does not know this command; teach it"
        args, namespace = list(words[1:]), "default"
        if "-n" in args:
            i = args.index("-n")
            namespace = args[i + 1]
            del args[i:i + 2]
            assert namespace in cluster.namespaces, f"`{step}`: namespace {namespace} does not exist yet"
        if args[:2] == ["apply", "-k"]:
            cluster.apply(kustomize_build(path(args[2])), step)
        elif args[:2] == ["apply", "-f"]:
            cluster.apply(load_documents(path(args[2])), step)
        elif args[:2] == ["create", "namespace"]:
            assert args[2] not in cluster.namespaces, f"`{step}`: namespace {args[2]} already exists (AlreadyExists)"
            cluster.namespaces.add(args[2])
        elif args[:2] == ["rollout", "status"]:
            kind, _, name = args[2].partition("/")
            assert cluster.has(KIND_ALIASES[kind], namespace, name), f"`{step}`: no such object yet"
        elif args[0] == "get":
            assert cluster.has(KIND_ALIASES[args[1]], namespace, args[2]), f"`{step}`: no such object yet"
        else:
            pytest.fail(f"`{step}`: the replay does not know this kubectl command; teach it")
    return cluster


def test_readme_install_steps_work_on_an_empty_cluster() -> None:
    commands = install_commands()
    assert any(words[:3] == ["kubectl", "apply", "-k"] for words in commands)
    cluster = replay(commands)
    # Nothing is missing: the Secrets the StorageClass names exist where it looks for them ...
    (storage_class,) = [obj for (kind, _, _), obj in cluster.objects.items() if kind == "StorageClass"]
    parameters = storage_class["parameters"]
    assert cluster.has("Secret", parameters[PROVISIONER_SECRET_NAMESPACE], parameters[PROVISIONER_SECRET_NAME])
    assert cluster.has("Secret", "ml", parameters[NODE_PUBLISH_SECRET_NAME])
    # ... and every example can be applied next, into namespaces that exist.
    for example in sorted((DEPLOY / "examples").glob("*.yaml")):
        cluster.apply(load_documents(example), f"kubectl apply -f {example.relative_to(ROOT)}")


def test_a_missing_kubectl_skips_here_and_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kustomize, "kubectl_path", lambda: None)
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("CACHEFS_REQUIRE_KUBECTL", raising=False)
    with pytest.raises(pytest.skip.Exception, match="kubectl is not installed"):
        kustomize.require_kubectl()
    for name, value in (("CI", "true"), ("CACHEFS_REQUIRE_KUBECTL", "1")):
        with monkeypatch.context() as env:
            env.setenv(name, value)
            with pytest.raises(pytest.fail.Exception, match=f"kubectl is not installed.*{name}"):
                kustomize.require_kubectl()
