"""A Kubernetes API double for tests: kmock's ``KubernetesEmulator`` on 127.0.0.1, in a thread.

kmock (by kopf's author) keeps objects in memory and serves create, read, list, watch, patch and
delete over real HTTP, so the official ``kubernetes`` client talks to it unchanged (through a
kubeconfig written by ``ApiDouble``). It is deliberately simple; ``ClusterEmulator`` adds the few
behaviours of a real API server that the node plugin relies on:

- ``metadata.uid``, ``resourceVersion`` and ``creationTimestamp`` on create (an ownerReference
  needs the owner's uid);
- ``?watch=True`` as the kubernetes client sends it (kmock expects ``true``);
- ``labelSelector`` (equality terms, ``k=v,k2=v2``, and ``k!=v``) on list and watch;
- the garbage collector's part: deleting an object deletes the objects whose ``ownerReferences``
  name its uid (a mount pod's Secret goes with the pod); the namespace controller's: deleting a
  Namespace deletes everything in it;
- ``/api/v1/namespaces[/NAME]`` as Namespace objects (kmock reads a namespace segment there).

``OperatorApiServer`` (at the end) adds what kopf relies on, for the Dataset operator's tests.

What a real API server refuses or rewrites, and the double too (``_admit``; issue 23: each of these
once passed the tests and failed on a real cluster):

- **CustomResourceDefinitions** must have structural schemas (``tests/support/crd_schema.py`` lists
  the rules); one that is not is refused with 422 ``Invalid``, as ``kubectl apply`` shows it.
- **Pruning**: a custom resource's fields that its CRD's schema does not declare are dropped on
  create, update, patch and status patch, before the object is stored (``pruned`` records what was
  dropped, per write, so a test can name the field a writer lost); with ``?fieldValidation=Strict``
  (kubectl's default) an undeclared field is refused instead, 400 ``BadRequest`` naming it. With a
  ``status`` subresource, a create stores no status, a write of the main resource keeps the stored
  status, and a ``/status`` write changes nothing but the status.
- **Immutable fields** (``IMMUTABLE``, from each kind's ``Validate*Update`` in Kubernetes 1.28):
  StorageClass ``parameters``, ``provisioner``, ``reclaimPolicy``, ``volumeBindingMode``; a
  PersistentVolume's source (``spec.csi`` with its ``volumeAttributes``, and every other source);
  CSIDriver ``attachRequired``, ``podInfoOnMount``, ``volumeLifecycleModes``, ``fsGroupPolicy``;
  workload selectors, a Job's pod template, a StatefulSet's claim templates; a claim's spec but its
  requests. A change to one is refused with 422 ``Invalid`` naming the field, the whole write refused.
- A PUT replaces the object (kmock merges it).
- **Graceful deletion of pods** (``_delete_pod``; Kubernetes 1.28's ``podStrategy.CheckGracefulDelete``
  and ``rest.BeforeDelete``; kmock removes every object at once). A DELETE of a pod takes the
  ``gracePeriodSeconds`` of its DeleteOptions (the body, else the query), else the pod's
  ``spec.terminationGracePeriodSeconds``, else 30 (the API's default for that field); a negative one
  is 1. A pod not bound to a node (no ``spec.nodeName``) or already ended (phase ``Failed`` or
  ``Succeeded``) gets 0. With 0 the pod is removed at once; otherwise it stays, readable and listed,
  with ``metadata.deletionGracePeriodSeconds`` set to that grace and ``metadata.deletionTimestamp`` to
  now plus it (a MODIFIED event), until its kubelet has stopped it and deletes it with grace 0
  (``tests/support/kubelet.py``; a pod on a node no kubelet serves stays, as on a cluster). A
  later DELETE may only shorten the grace (the timestamp moves back by the difference; 0 removes the
  pod), never lengthen it: a longer or equal one, or none, changes nothing. Writes to a pod being
  deleted keep it (kmock would remove it). A pod's finalizers are not considered (no pod of the
  tests has one). ``pod_deletions`` records what each DELETE of a pod asked for and what the pod's
  grace was after it.

- **Defaulting and validation** of custom resources: after pruning, the schema's ``default``s are
  applied and its value checks run (type, enum, pattern, bounds, required); a write the schema
  refuses is a 422 ``Invalid`` naming each field, status writes included.

RBAC, and the built-in kinds' defaulting (but for the grace above) and field validation, are not
emulated: the manifests are validated separately (tests/csi/test_manifests.py), and tests assert on
the objects as stored. Nor are DeleteOptions' ``preconditions``, nor the garbage collector's graceful
deletion of dependents (the double removes them at once).
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import json
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp.web
import jsonpatch
import kmock
import yaml
from kmock._internal import dicts, enums, parsing, rendering

from tests.support.crd_schema import apply_defaults, invalid_fields, merge_patch_between, prune, structural_problems

START_TIMEOUT_S = 10.0
RESOURCES = ("v1/pods", "v1/secrets", "v1/events", "v1/namespaces", "v1/persistentvolumes")


_guess_k8s = parsing.guess_k8s


def _guess_k8s_any_bool(k8s: Any, method: Any, query: dict[str, str]) -> Any:
    """kmock's guess, with ``watch=True`` (how the kubernetes client writes a bool) as ``watch=true``."""
    if str(query.get("watch", "")).lower() in ("true", "1"):
        query = {**query, "watch": "true"}
    return _guess_k8s(k8s, method, query)


parsing.guess_k8s = _guess_k8s_any_bool

_parse_path = parsing.parse_path


def _parse_path_with_namespaces(path: str) -> Any:
    """kmock's parse, with ``/api/v1/namespaces[/NAME]`` as the Namespace objects (kmock reads a
    namespace segment there and fails on the list)."""
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and len(parts) <= 4:
        return parsing.ParsedPath("", "v1", "namespaces", None, parts[3] if len(parts) == 4 else None, None)
    return _parse_path(path)


parsing.parse_path = _parse_path_with_namespaces


def _selector(text: str | None) -> list[tuple[str, bool, str]]:
    """``(key, equal, value)`` per term: ``k=v`` and ``k==v`` (equal), ``k!=v`` (not equal: also true
    for an object without the label, as a real API server answers, e.g. ``kubectl drain --pod-selector``)."""
    terms: list[tuple[str, bool, str]] = []
    for term in (text or "").split(","):
        if term.strip():
            key, _, value = term.partition("=")
            equal = not key.endswith("!")
            terms.append((key.rstrip("!").strip(), equal, value.lstrip("=").strip()))
    return terms


def _is_pod(request: rendering.Request) -> bool:
    resource = request.resource
    return (resource is not None and request.name is not None and not resource.group
            and resource.plural == "pods")


def _matches(obj: dict[str, Any], terms: list[tuple[str, bool, str]]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all((labels.get(k) == v) == equal for k, equal, v in terms)


# Fields an update may not change, by (API group, plural): (path, the API server's message). From
# Kubernetes 1.28's ValidateStorageClassUpdate, ValidatePersistentVolumeUpdate, ValidateCSIDriverUpdate,
# ValidateJobUpdate, ValidateDeploymentUpdate/DaemonSetUpdate/StatefulSetUpdate, ValidatePersistentVolumeClaimUpdate.
_PV_SOURCES = ("csi", "hostPath", "local", "nfs", "flexVolume", "awsElasticBlockStore", "gcePersistentDisk")
_IMMUTABLE_FIELD = "field is immutable"
IMMUTABLE: dict[tuple[str, str], tuple[tuple[tuple[str, ...], str], ...]] = {
    ("storage.k8s.io", "storageclasses"): (
        (("parameters",), "parameters: Forbidden: updates to parameters are forbidden."),
        (("provisioner",), "provisioner: Forbidden: updates to provisioner are forbidden."),
        (("reclaimPolicy",), "reclaimPolicy: Forbidden: updates to reclaimPolicy are forbidden."),
        (("volumeBindingMode",), f"volumeBindingMode: Invalid value: {_IMMUTABLE_FIELD}"),
    ),
    ("", "persistentvolumes"): tuple(
        (("spec", source), "spec.persistentvolumesource: Forbidden: spec.persistentvolumesource is immutable "
                           "after creation") for source in _PV_SOURCES) + (
        (("spec", "volumeMode"), f"spec.volumeMode: Invalid value: {_IMMUTABLE_FIELD}"),
    ),
    ("storage.k8s.io", "csidrivers"): tuple(
        (("spec", key), f"spec.{key}: Invalid value: {_IMMUTABLE_FIELD}")
        for key in ("attachRequired", "podInfoOnMount", "volumeLifecycleModes", "fsGroupPolicy")),
    ("batch", "jobs"): (
        (("spec", "selector"), f"spec.selector: Invalid value: {_IMMUTABLE_FIELD}"),
        (("spec", "template"), f"spec.template: Invalid value: {_IMMUTABLE_FIELD}"),
    ),
    ("apps", "deployments"): ((("spec", "selector"), f"spec.selector: Invalid value: {_IMMUTABLE_FIELD}"),),
    ("apps", "daemonsets"): ((("spec", "selector"), f"spec.selector: Invalid value: {_IMMUTABLE_FIELD}"),),
    ("apps", "statefulsets"): tuple(
        (("spec", key), f"spec: Forbidden: updates to statefulset spec for fields other than 'replicas', "
                        f"'ordinals', 'template', 'updateStrategy', 'persistentVolumeClaimRetentionPolicy' and "
                        f"'minReadySeconds' are forbidden ({key})")
        for key in ("selector", "volumeClaimTemplates", "serviceName", "podManagementPolicy")),
    ("", "persistentvolumeclaims"): tuple(
        (("spec", key), f"spec: Forbidden: spec is immutable after creation except resources.requests ({key})")
        for key in ("accessModes", "storageClassName", "selector", "volumeMode", "dataSource")),
}
CRD_KEY = ("apiextensions.k8s.io", "customresourcedefinitions")


# The API server's default of a pod's spec.terminationGracePeriodSeconds (SetDefaults_PodSpec).
DEFAULT_POD_GRACE_S = 30
TIMESTAMP = "%Y-%m-%dT%H:%M:%SZ"  # metav1.Time: RFC 3339, whole seconds, UTC


@dataclass(frozen=True)
class PodDeletion:
    """One DELETE of an existing pod: the grace it asked for (None: none) and the pod's
    ``deletionGracePeriodSeconds`` after it (0: removed)."""

    namespace: str | None
    name: str
    requested: int | None
    grace: int
    user_agent: str


def _requested_grace(request: rendering.Request) -> int | None:
    """DeleteOptions.gracePeriodSeconds: from the body where there is one (any, ``{}`` too), else from
    the query, as the API server decodes them."""
    if request.body:
        value = request.data.get("gracePeriodSeconds") if isinstance(request.data, dict) else None
    else:
        value = request.params.get("gracePeriodSeconds")
    return int(value) if value is not None else None


def deletion_grace(pod: dict[str, Any], requested: int | None) -> int:
    """The grace a real API server gives the deletion of ``pod`` (podStrategy.CheckGracefulDelete)."""
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    grace = spec.get("terminationGracePeriodSeconds") if requested is None else requested
    if grace is None:
        grace = DEFAULT_POD_GRACE_S
    if not spec.get("nodeName") or status.get("phase") in ("Failed", "Succeeded"):
        return 0
    return 1 if grace < 0 else int(grace)


def _get(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj


def _invalid(kind: str, name: str | None, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=422, reason="Invalid", message=f"{kind} {name!r} is invalid: {message}",
                                 details={"name": name, "kind": kind})


class ClusterEmulator(kmock.KubernetesEmulator):
    """kmock's emulator plus uids, label selectors, owner-reference garbage collection, and the API
    server's admission rules above (structural CRDs, pruning, immutable fields)."""

    _versions = itertools.count(1)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        # By (group, version, plural) of each installed CRD version: its openAPIV3Schema.
        self.schemas: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.status_subresource: set[tuple[str, str, str]] = set()
        # Every write that lost fields to pruning: (plural, name, the dropped paths, the writer's User-Agent).
        self.pruned: list[tuple[str, str | None, list[str], str]] = []
        self.pod_deletions: list[PodDeletion] = []

    def install_crd(self, crd: dict[str, Any]) -> None:
        """Serve ``crd``'s resource with its schema, as creating it in a real cluster does; refuse a
        CRD whose schema is not structural (``kmock.KubernetesError`` 422)."""
        problems = structural_problems(crd)
        if problems:
            raise _invalid("CustomResourceDefinition", (crd.get("metadata") or {}).get("name"), "; ".join(problems))
        spec = crd["spec"]
        for version in spec["versions"]:
            key = (spec["group"], version["name"], spec["names"]["plural"])
            self.schemas[key] = version["schema"]["openAPIV3Schema"]
            subresources = set(version.get("subresources") or {})
            if "status" in subresources:
                self.status_subresource.add(key)
            self.resources["/".join(key)] = kmock.ResourceInfo(
                kind=spec["names"]["kind"], namespaced=spec.get("scope") == "Namespaced",
                verbs={"list", "watch", "get", "create", "patch", "update", "delete"}, subresources=subresources)

    def _admit(self, request: rendering.Request) -> None:
        """Refuse what the API server refuses; rewrite the write into what it stores (see the module doc)."""
        resource = request.resource
        assert resource is not None
        key = (resource.group or "", resource.version or "", resource.plural or "")
        if request.action == enums.action.CREATE and isinstance(request.data, dict):
            if (key[0], key[2]) == CRD_KEY:
                self.install_crd(request.data)
            if key in self.schemas:
                new = dict(request.data)
                if key in self.status_subresource:
                    new.pop("status", None)
                new = self._pruned(request, key, new)
                request.data.clear()
                request.data.update(new)
            return
        if request.action != enums.action.UPDATE or request.name is None:
            return
        object_key = (resource, request.namespace, request.name)
        if object_key not in self.objects or self.objects[object_key].deleted:
            return  # kmock answers 404
        old = json.loads(json.dumps(self.objects[object_key].raw))
        if request.method.value == "PUT" and isinstance(request.data, dict):
            new = json.loads(json.dumps(request.data))
        else:
            new = dict(dicts.patch_dict(old, request.data))  # a JsonPatchException becomes 422
        if key in self.status_subresource:
            if request.subresource == "status":
                version, status = (new.get("metadata") or {}).get("resourceVersion"), new.get("status")
                new = {k: v for k, v in old.items() if k != "status"}
                new["metadata"] = {**old["metadata"], "resourceVersion": version}
                if status is not None:
                    new["status"] = status
            else:
                new = {k: v for k, v in new.items() if k != "status"}
                if "status" in old:
                    new["status"] = old["status"]
        kind = (old.get("kind") or resource.plural or "object")
        for path, message in IMMUTABLE.get((key[0], key[2]), ()):
            if _get(old, path) != _get(new, path):
                raise _invalid(kind, request.name, message)
        if (key[0], key[2]) == CRD_KEY:
            self.install_crd(new)
        if key in self.schemas:
            new = self._pruned(request, key, new)
        if isinstance(request.data, dict):
            request.data.clear()
            request.data.update(merge_patch_between(old, new))
        elif isinstance(request.data, list):
            request.data[:] = [{"op": "replace", "path": "", "value": new}]

    def _pruned(self, request: rendering.Request, key: tuple[str, str, str], obj: dict[str, Any]) -> dict[str, Any]:
        """``obj`` pruned, defaulted and validated, as the API server stores a custom resource: with
        ``?fieldValidation=Strict`` (kubectl's default) an undeclared field is a 400; a value the
        schema refuses a 422 naming each field (``tests/support/crd_schema.py``)."""
        pruned, dropped = prune(obj, self.schemas[key])
        pruned = apply_defaults(pruned, self.schemas[key])
        name = request.name or (obj.get("metadata") or {}).get("name")
        if problems := invalid_fields(pruned, self.schemas[key]):
            raise _invalid(f"{obj.get('kind') or key[2]}.{key[0]}", name, ", ".join(problems))
        if dropped and request.params.get("fieldValidation") == "Strict":
            kind = obj.get("kind") or key[2]
            fields = ", ".join(f'unknown field "{path}"' for path in dropped)
            raise kmock.KubernetesError(status=400, reason="BadRequest", details={"name": name, "kind": kind},
                                        message=f"{kind} in version {key[1]!r} cannot be handled as a {kind}: "
                                                f"strict decoding error: {fields}")
        if dropped:
            self.pruned.append((key[2], name, dropped, request.headers.get("User-Agent", "")))
        return pruned

    async def _handle(self, request: rendering.Request) -> Any:
        if request.resource is not None and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            if request.action == enums.action.CREATE:
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("creationTimestamp", datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
            if request.action in (enums.action.CREATE, enums.action.UPDATE):
                meta["resourceVersion"] = str(next(self._versions))
        if request.resource is not None:
            self._admit(request)
        if _is_pod(request) and request.action == enums.action.DELETE:
            answer = await self._delete_pod(request)
            if answer is not None:
                await self._collect_garbage()  # where it removed the pod, its dependents go
                return aiohttp.web.json_response(answer)
        elif _is_pod(request) and request.action == enums.action.UPDATE:
            answer = await self._update_terminating_pod(request)
            if answer is not None:
                return aiohttp.web.json_response(answer)
        response = await super()._handle(request)
        if request.resource is not None and request.action == enums.action.DELETE and request.name is not None:
            gone = request.name if (request.resource.group, request.resource.plural) == ("", "namespaces") else None
            await self._collect_garbage(gone)
        return response

    async def _delete_pod(self, request: rendering.Request) -> dict[str, Any] | None:
        """A graceful DELETE of a pod (see the module doc): the pod as it now is, or None where kmock's
        own DELETE is right (no such pod: 404; a grace of 0: removed at once)."""
        assert request.resource is not None and request.name is not None
        key = (request.resource, request.namespace, request.name)
        requested = _requested_grace(request)
        async with self._lock:
            if key not in self.objects or self.objects[key].deleted:
                return None
            obj = self.objects[key]
            meta = obj.get("metadata") or {}
            now = datetime.datetime.now(datetime.UTC)
            if not meta.get("deletionTimestamp"):
                current, grace, start = None, deletion_grace(obj.raw, requested), now
            else:
                current = grace = meta.get("deletionGracePeriodSeconds") or 0
                deadline = datetime.datetime.strptime(meta["deletionTimestamp"], TIMESTAMP)
                start = deadline.replace(tzinfo=datetime.UTC) - datetime.timedelta(seconds=current)
                if requested is not None and max(0, requested) < current:  # only ever shortened
                    grace = max(0, requested)
            self.pod_deletions.append(PodDeletion(request.namespace, request.name, requested, grace,
                                                  request.headers.get("User-Agent", "")))
            if grace == 0 and not current:
                return None  # kmock removes it (or keeps it for its finalizers)
            if grace == 0:
                raw = obj.raw
                obj.delete()
                await self._buses[request.resource].put({"type": "DELETED", "object": raw})
                return raw
            if grace != current:
                deadline = start + datetime.timedelta(seconds=grace)
                obj.patch({"metadata": {"deletionTimestamp": deadline.strftime(TIMESTAMP),
                                        "deletionGracePeriodSeconds": grace,
                                        "resourceVersion": str(next(self._versions))}})
                await self._buses[request.resource].put({"type": "MODIFIED", "object": obj.raw})
            return obj.raw

    async def _update_terminating_pod(self, request: rendering.Request) -> dict[str, Any] | None:
        """A write to a pod being deleted, kept (kmock removes an object with a deletionTimestamp and no
        finalizers on any write); None for any other pod."""
        assert request.resource is not None
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            if key not in self.objects or self.objects[key].deleted:
                return None
            obj = self.objects[key]
            if not (obj.get("metadata") or {}).get("deletionTimestamp"):
                return None
            obj.patch(request.data)
            await self._buses[request.resource].put({"type": "MODIFIED", "object": obj.raw})
            return obj.raw

    async def _collect_garbage(self, namespace: str | None = None) -> None:
        """The garbage collector (owners gone) and, for a deleted ``namespace``, the namespace
        controller (everything in it goes)."""
        async with self._lock:
            live = {(obj.get("metadata") or {}).get("uid") for obj in self.objects.values() if not obj.deleted}
            for key, obj in list(self.objects.items()):
                if obj.deleted:
                    continue
                owners = (obj.get("metadata") or {}).get("ownerReferences") or []
                if (namespace is not None and key[1] == namespace) or (
                        owners and not any(owner.get("uid") in live for owner in owners)):
                    raw = obj.raw
                    obj.delete()
                    await self._buses[key[0]].put({"type": "DELETED", "object": raw})

    async def _serve_list(self, request: rendering.Request) -> Any:
        answer = await super()._serve_list(request)
        terms = _selector(request.params.get("labelSelector"))
        answer["items"] = [item for item in answer["items"] if _matches(item, terms)]
        answer["kind"], answer["apiVersion"] = "List", "v1"
        return answer

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[Any]:
        terms = _selector(request.params.get("labelSelector"))
        async for event in super()._serve_watch(request):
            if isinstance(event, dict) and not _matches(event.get("object") or {}, terms):
                continue
            yield event


class ApiDouble:
    """The emulator served on 127.0.0.1 from a thread of its own; ``kubeconfig`` points a client at it."""

    def __init__(self, workdir: Path, port: int | None = None,
                 emulator: type[ClusterEmulator] | None = None) -> None:
        self.workdir = workdir
        self.port = port
        self._emulator_class = emulator or ClusterEmulator
        self.url = ""
        self.kubeconfig = workdir / "kubeconfig"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kube-api-double", daemon=True)
        self._error: BaseException | None = None
        self.emulator: ClusterEmulator | None = None

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported by start()
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with self._emulator_class() as emulator, kmock.Server(emulator, port=self.port) as server:
            self.emulator = emulator
            for resource in RESOURCES:
                if resource not in emulator.resources:  # an OperatorApiServer declares its own
                    emulator.resources[resource] = {}
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def start(self) -> ApiDouble:
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S) or self._error is not None:
            raise RuntimeError(f"the API double did not start: {self._error!r}")
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "double",
            "clusters": [{"name": "double", "cluster": {"server": self.url}}],
            "users": [{"name": "plugin", "user": {"token": "not-a-secret"}}],
            "contexts": [{"name": "double", "context": {"cluster": "double", "user": "plugin"}}],
        }
        self.kubeconfig.write_text(json.dumps(config))
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=START_TIMEOUT_S)

    def calls(self, user_agent: str) -> set[tuple[str, str, str | None]]:
        """(verb, resource, namespace) of every request so far whose User-Agent starts with ``user_agent``,
        with the verbs RBAC names (get, list, watch, create, patch, delete)."""
        assert self.emulator is not None
        found = set()
        for request in list(self.emulator):  # a kmock view iterates over its requests
            if request.resource is None or not request.headers.get("User-Agent", "").startswith(user_agent):
                continue
            method = request.method.value
            if method == "GET":
                verb = "watch" if request.action == enums.action.WATCH else "get" if request.name else "list"
            else:
                verb = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}[method]
            plural = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
            found.add((verb, plural, request.namespace))
        return found

    def client(self) -> Any:
        """A ``kubernetes.client.CoreV1Api`` for the test's own reads and writes."""
        from kubernetes import client, config

        configuration = client.Configuration()
        config.load_kube_config(config_file=str(self.kubeconfig), client_configuration=configuration)
        return client.CoreV1Api(client.ApiClient(configuration))


# ------------------------------------------------------------------------------ the Dataset operator
# What kopf (cachefs-operator, tests/csi/test_operator.py) finds by discovery: it scans the API groups
# and waits until namespaces and CRDs are listed before it watches anything.
OPERATOR_RESOURCES: dict[str, dict[str, Any]] = {
    "cachefs.io/v1alpha1/datasets": dict(kind="Dataset", namespaced=True, subresources={"status"}),
    "v1/pods": dict(kind="Pod", namespaced=True, subresources={"log", "status"}),
    "v1/persistentvolumes": dict(kind="PersistentVolume", namespaced=False),
    "v1/persistentvolumeclaims": dict(kind="PersistentVolumeClaim", namespaced=True),
    "v1/nodes": dict(kind="Node", namespaced=False),
    "v1/events": dict(kind="Event", namespaced=True),
    "v1/namespaces": dict(kind="Namespace", namespaced=False),
    "apiextensions.k8s.io/v1/customresourcedefinitions": dict(kind="CustomResourceDefinition", namespaced=False),
    "batch/v1/jobs": dict(kind="Job", namespaced=True, subresources={"status"}),
}
OPERATOR_VERBS = {"list", "watch", "get", "create", "patch", "update", "delete"}
DATASET_CRD = Path(__file__).resolve().parents[2] / "deploy" / "components" / "datasets" / "crd.yaml"


class OperatorApiServer(ClusterEmulator):
    """``ClusterEmulator`` plus what kopf relies on, served on the test's own loop (never on the loop
    kopf runs on: kopf's exit cancels every task of its loop that it did not start, the server's
    connections among them, and a request a client then sends on a kept-alive one is never read:
    tests/csi/test_operator.py's ``running_operator`` gives kopf a loop of its own):

    - a ``resourceVersion`` on every write, JSON patches included (kopf adds its finalizer with a JSON
      patch that first tests the version), and 422 when such a test fails (a real server's answer;
      kopf retries a 5xx with the same patch, and takes 422 as "re-read the object");
    - ``metadata.generation``, moved by a change of ``spec``; ``generateName``;
    - a watch from a list's ``resourceVersion`` sends only what changed after it (kmock replays
      every object to a new watch; kopf would act on the stale copies);
    - pod logs: ``logs[POD]`` is what ``GET .../pods/POD/log`` answers (``tailLines`` honoured).
    """

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.logs: dict[str, str] = {}
        for key, info in OPERATOR_RESOURCES.items():
            self.resources[key] = kmock.ResourceInfo(verbs=OPERATOR_VERBS, **info)
        # The Dataset CRD as deploy/ ships it: refused here if the API server would refuse it, and
        # its schema prunes every Dataset write.
        self.install_crd(yaml.safe_load(DATASET_CRD.read_text()))
        self[kmock.resource("v1/pods"), kmock.subresource("log")] << self._serve_log

    def _serve_log(self, request: rendering.Request) -> bytes:
        lines = self.logs.get(request.name or "", "").splitlines(keepends=True)
        tail = request.params.get("tailLines", "")
        return "".join(lines[-int(tail):] if tail.isdigit() and int(tail) > 0 else lines).encode()

    async def _handle(self, request: rendering.Request) -> Any:
        if request.resource is not None and request.action == enums.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:5]}"
            meta.setdefault("generation", 1)
        elif request.resource is not None and request.action == enums.action.UPDATE and request.name is not None:
            key = (request.resource, request.namespace, request.name)
            generation = self.objects[key].get("metadata", {}).get("generation", 1) if key in self.objects else 1
            if isinstance(request.data, dict):  # a merge patch: ClusterEmulator sets its resourceVersion
                if "spec" in request.data and request.subresource is None:
                    request.data.setdefault("metadata", {})["generation"] = generation + 1
            elif isinstance(request.data, list):  # a JSON patch
                if any(str(op.get("path", "")).startswith("/spec") for op in request.data):
                    request.data.append({"op": "add", "path": "/metadata/generation", "value": generation + 1})
                request.data.append({"op": "add", "path": "/metadata/resourceVersion",
                                     "value": str(next(self._versions))})
        return await super()._handle(request)

    async def _serve_list(self, request: rendering.Request) -> Any:
        answer = await super()._serve_list(request)
        answer["metadata"]["resourceVersion"] = str(next(self._versions))  # newer than anything listed
        return answer

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[Any]:
        since = request.params.get("resourceVersion", "")
        async for event in super()._serve_watch(request):
            if since.isdigit() and isinstance(event, dict):
                version = str(event.get("object", {}).get("metadata", {}).get("resourceVersion", ""))
                if version.isdigit() and int(version) <= int(since):
                    continue
            yield event

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        if isinstance(exc, jsonpatch.JsonPatchException):
            exc = kmock.KubernetesError(status=422, reason="Invalid", message=f"the patch does not apply: {exc}",
                                        details={})
        return await super()._render_error(exc)
