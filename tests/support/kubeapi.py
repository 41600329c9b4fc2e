"""A Kubernetes API double for operator tests: kmock's ``KubernetesEmulator`` plus the metadata a real
API server keeps.

kmock stores objects and streams watch events but, by design, treats them as plain JSON ("inherit
and implement for your cases"). kopf needs what a real server adds: a ``resourceVersion`` that
changes on every write (kopf's finalizer patch tests it), a ``uid``, a ``creationTimestamp``, and a
``generation`` that moves when the spec does. ``ApiServer`` adds exactly those, by rewriting the
request before kmock applies it, so the watch events carry them too. Label selectors are not
applied by kmock; the code under test filters lists itself as well (kube.py), so nothing here
depends on it.

A watch from a list's ``resourceVersion`` skips what the list already showed (kmock replays every
object to a new watch, which a real server does not; kopf would act on the stale copies).

``RESOURCES`` declares the resources the operator uses for discovery (kopf scans the API groups,
and waits for namespaces and CRDs to be listed before it watches anything).
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
from kmock._internal import enums, rendering

RESOURCES: dict[str, dict[str, Any]] = {
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
VERBS = {"list", "watch", "get", "create", "patch", "update", "delete"}


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    _version: int = attrs.field(default=0, init=False)
    # Pod logs, by pod name: what GET .../pods/NAME/log answers (the kubelet's part, played by tests).
    logs: dict[str, str] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for key, info in RESOURCES.items():
            self.resources[key] = kmock.ResourceInfo(verbs=VERBS, **info)
        self[kmock.resource("v1/pods"), kmock.subresource("log")] << self._serve_log

    def _serve_log(self, request: rendering.Request) -> bytes:
        lines = self.logs.get(request.name or "", "").splitlines(keepends=True)
        tail = request.params.get("tailLines", "")
        return "".join(lines[-int(tail):] if tail.isdigit() and int(tail) > 0 else lines).encode()

    async def _handle(self, request: rendering.Request) -> Any:
        if request.resource is not None and isinstance(request.data, (dict, list)):
            self._version += 1
            version = str(self._version)
            if request.action == enums.action.CREATE and isinstance(request.data, dict):
                meta = request.data.setdefault("metadata", {})
                if not meta.get("name") and meta.get("generateName"):
                    meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:5]}"
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("creationTimestamp", _now())
                meta.setdefault("generation", 1)
                meta["resourceVersion"] = version
            elif request.action == enums.action.UPDATE and request.name is not None:
                key = (request.resource, request.namespace, request.name)
                generation = self.objects[key].get("metadata", {}).get("generation", 1) if key in self.objects else 1
                if isinstance(request.data, dict):
                    bump = "spec" in request.data and request.subresource is None
                    meta = request.data.setdefault("metadata", {}) or {}
                    request.data["metadata"] = meta
                    meta["resourceVersion"] = version
                    if bump:
                        meta["generation"] = generation + 1
                else:
                    bump = any(str(op.get("path", "")).startswith("/spec") for op in request.data)
                    request.data.append({"op": "add", "path": "/metadata/resourceVersion", "value": version})
                    if bump:
                        request.data.append({"op": "add", "path": "/metadata/generation", "value": generation + 1})
        return await super()._handle(request)

    async def _serve_list(self, request: rendering.Request) -> Any:
        answer = await super()._serve_list(request)
        answer["metadata"]["resourceVersion"] = str(self._version)
        return answer

    async def _serve_watch(self, request: rendering.Request) -> Any:
        # A watch from a list's resourceVersion sends only what changed after it, as a real server does
        # (kmock replays every object first): a replayed old version would make kopf act on stale data.
        since = request.params.get("resourceVersion", "")
        async for event in super()._serve_watch(request):
            if since.isdigit() and isinstance(event, dict):
                version = str(event.get("object", {}).get("metadata", {}).get("resourceVersion", ""))
                if version.isdigit() and int(version) <= int(since):
                    continue
            yield event

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        # A JSON patch whose "test" fails (a stale resourceVersion) is 422 Unprocessable Entity on a real
        # server, not a 500: kopf retries 5xx with the same patch, and takes 422 as "re-read the object".
        if isinstance(exc, jsonpatch.JsonPatchException):
            exc = kmock.KubernetesError(status=422, reason="Invalid", message=f"the patch does not apply: {exc}",
                                        details={})
        return await super()._render_error(exc)
