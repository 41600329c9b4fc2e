"""The kubernetes client where kopf leaves off: create, list by label, delete, read a pod's log.

kopf watches Datasets and pods, patches them and posts events; creating PersistentVolumes, claims and
Jobs, listing them and reading logs goes through the official client here. Its calls block, so the
handlers that use this are plain (sync) functions, which kopf runs in its thread pool, off the loop.

Every call is bounded: one attempt (the HTTP library retries nothing), with ``REQUEST_TIMEOUT_S`` for
connecting and reading the answer together, and none at all once the operator is stopping (``stop``).
kopf cannot interrupt a handler that runs in a thread: the operator's stop waits for it, so a
handler's calls bound the stop (docs/kubernetes-deploy.md, "Datasets", Stopping). A call that gets
no answer fails its handler with a ``KubeError``; kopf runs the handler again after its backoff,
which a stop cuts short.

Creating an object that exists is not an error (handlers are re-run after an operator restart);
deleting one that is gone is not either. Lists ask the API server to filter by label and check the
labels again here: a list is never trusted to hold only what was asked for.
"""

from __future__ import annotations

import copy
import threading
from typing import Any, Callable, Mapping, TypeVar

import urllib3
from kubernetes import client
from kubernetes.client.rest import ApiException

# One call to the API server, connecting included: a read, list or write is answered in milliseconds,
# so one that takes longer than this is stuck (the client's default is to wait forever). It is also
# the longest a stop waits for a call in flight: kopf's own exit (a few seconds) plus this plus one
# round of stats reads (usage.STATS_TIMEOUT_S) stays well inside the 30 s a Deployment's pod gets
# between SIGTERM and SIGKILL (terminationGracePeriodSeconds' default).
REQUEST_TIMEOUT_S = 10.0
# The HTTP library's retries, none: urllib3 retries a GET 3 times by default, each with the whole
# timeout, which made one stuck list four timeouts long and held the operator's stop that long.
URLLIB3_RETRIES = False
# Lines of a warm-up pod's log read on each follow tick: the last JSON line is the latest state, and
# a few more cover lines printed to stdout after it (none today).
LOG_TAIL_LINES = 20
HTTP_NOT_FOUND, HTTP_CONFLICT = 404, 409
# The label the Job controller puts on the pods of a Job (Kubernetes 1.27 and later).
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"


T = TypeVar("T")


class KubeError(Exception):
    """An API call failed; one line with the object and the API server's reason."""


def _fail(what: str, exc: ApiException) -> KubeError:
    return KubeError(f"{what}: HTTP {exc.status} {exc.reason}")


def selector(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def _matches(obj: Any, labels: Mapping[str, str]) -> bool:
    have = (obj.get("metadata", {}) if isinstance(obj, dict) else {}).get("labels") or {}
    return all(have.get(k) == v for k, v in labels.items())


class Kube:
    """The calls the operator makes, on an ``ApiClient`` of its own made from ``configuration`` (with
    the HTTP library's retries off); objects in and out as plain dicts."""

    def __init__(self, configuration: client.Configuration, *, timeout_s: float = REQUEST_TIMEOUT_S,
                 user_agent: str | None = None) -> None:
        configuration = copy.deepcopy(configuration)  # the caller's stays as it was
        configuration.retries = URLLIB3_RETRIES
        self.api = client.ApiClient(configuration)
        if user_agent:
            self.api.user_agent = user_agent
        self.timeout_s = timeout_s
        self.core = client.CoreV1Api(self.api)
        self.batch = client.BatchV1Api(self.api)
        self._stopping = threading.Event()

    def stop(self) -> None:
        """The operator is stopping: every later call fails at once (the one in flight ends within
        ``timeout_s``)."""
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def _call(self, what: str, call: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``call(*args, **kwargs)``, bounded by ``timeout_s``; a failure to get an answer is a
        ``KubeError`` naming ``what`` (the API server's own refusals stay ``ApiException``s, for the
        caller to read their status)."""
        if self._stopping.is_set():
            raise KubeError(f"{what}: not asked, the operator is stopping")
        try:
            return call(*args, _request_timeout=self.timeout_s, **kwargs)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise KubeError(f"{what}: no answer from the API server (one attempt, {self.timeout_s:g} s at most): "
                            f"{type(exc).__name__}: {exc}") from None

    def _dict(self, obj: Any) -> dict[str, Any]:
        return obj if isinstance(obj, dict) else self.api.sanitize_for_serialization(obj)

    # ------------------------------------------------------------------------------------ create
    def ensure(self, body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Create ``body`` (a PV, PVC or Job) unless it exists: ``(the object, created)``."""
        kind, name = body["kind"], body["metadata"]["name"]
        namespace = body["metadata"].get("namespace")
        create: tuple[Any, ...]  # (the call, its arguments)
        read: tuple[Any, ...]
        create, read = {
            "PersistentVolume": ((self.core.create_persistent_volume, body), (self.core.read_persistent_volume, name)),
            "PersistentVolumeClaim": ((self.core.create_namespaced_persistent_volume_claim, namespace, body),
                                      (self.core.read_namespaced_persistent_volume_claim, name, namespace)),
            "Job": ((self.batch.create_namespaced_job, namespace, body),
                    (self.batch.read_namespaced_job, name, namespace)),
        }[kind]
        try:
            return self._dict(self._call(f"cannot create {kind} {name}", *create)), True
        except ApiException as exc:
            if exc.status != HTTP_CONFLICT:
                raise _fail(f"cannot create {kind} {name}", exc) from None
        try:
            return self._dict(self._call(f"cannot read {kind} {name}", *read)), False
        except ApiException as exc:
            raise _fail(f"cannot read {kind} {name}", exc) from None

    # -------------------------------------------------------------------------------------- read
    def read_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        what = f"cannot read Job {namespace}/{name}"
        try:
            return self._dict(self._call(what, self.batch.read_namespaced_job, name, namespace))
        except ApiException as exc:
            if exc.status == HTTP_NOT_FOUND:
                return None
            raise _fail(what, exc) from None

    def _listed(self, what: str, call: Callable[..., Any], labels: Mapping[str, str], *args: Any) -> list[dict[str, Any]]:
        """The objects ``call(*args)`` lists with ``labels``: filtered by the API server, checked again here."""
        try:
            found = self._call(f"cannot list {what}", call, *args, label_selector=selector(labels))
        except ApiException as exc:
            raise _fail(f"cannot list {what}", exc) from None
        return [o for o in (self._dict(item) for item in found.items) if _matches(o, labels)]

    def list_jobs(self, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        return self._listed(f"Jobs in {namespace}", self.batch.list_namespaced_job, labels, namespace)

    def list_pvs(self, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        return self._listed("PersistentVolumes", self.core.list_persistent_volume, labels)

    def list_pvcs(self, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        return self._listed(f"PersistentVolumeClaims in {namespace}",
                            self.core.list_namespaced_persistent_volume_claim, labels, namespace)

    def list_nodes(self, labels: Mapping[str, str]) -> list[str]:
        return sorted(n["metadata"]["name"] for n in self._listed("nodes", self.core.list_node, labels))

    def list_pods(self, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        """Pods by label (the mount pods of a Dataset's volume, for their stats address)."""
        return self._listed(f"pods in {namespace}", self.core.list_namespaced_pod, labels, namespace)

    def job_pod_log(self, namespace: str, job: str) -> str | None:
        """The tail of the log of the newest pod of ``job`` (None: no pod, or no log yet)."""
        pods = self._listed(f"the pods of Job {namespace}/{job}", self.core.list_namespaced_pod,
                            {JOB_NAME_LABEL: job}, namespace)
        if not pods:
            return None
        newest = max(pods, key=lambda p: p["metadata"].get("creationTimestamp") or "")
        what = f"cannot read the log of pod {namespace}/{newest['metadata']['name']}"

        def tail(**timeout: Any) -> bytes:
            # Raw bytes: with its default decoding the client turns a log of JSON lines into a Python
            # repr (kubernetes-client/python#1090), which no JSON parser reads back. Read here, so
            # the body's read is bounded and mapped like the rest of the call.
            response = self.core.read_namespaced_pod_log(newest["metadata"]["name"], namespace, container="prefetch",
                                                         tail_lines=LOG_TAIL_LINES, _preload_content=False, **timeout)
            return bytes(response.data)

        try:
            return self._call(what, tail).decode("utf-8", errors="replace")
        except ApiException as exc:
            if exc.status in (HTTP_NOT_FOUND, 400):  # gone, or not started yet (400: "waiting to start")
                return None
            raise _fail(what, exc) from None

    # ------------------------------------------------------------------------------------ delete
    def delete(self, kind: str, name: str, namespace: str | None = None) -> None:
        """Delete one object the operator made; gone already is fine. Jobs take their pods along."""
        calls: dict[str, tuple[Any, ...]] = {
            "PersistentVolume": (self.core.delete_persistent_volume, name),
            "PersistentVolumeClaim": (self.core.delete_namespaced_persistent_volume_claim, name, namespace),
            "Job": (self.batch.delete_namespaced_job, name, namespace),
        }
        options = {"propagation_policy": "Background"} if kind == "Job" else {}
        try:
            self._call(f"cannot delete {kind} {name}", *calls[kind], **options)
        except ApiException as exc:
            if exc.status != HTTP_NOT_FOUND:
                raise _fail(f"cannot delete {kind} {name}", exc) from None

    # ------------------------------------------------------------------------------------ pods
    def remove_gate(self, namespace: str, name: str, gates: list[dict[str, Any]], gate: str) -> None:
        """Drop ``gate`` from a pod's schedulingGates: a JSON patch that first tests the list is still
        ``gates``, so a concurrent change of the gates fails the patch instead of being overwritten."""
        rest = [g for g in gates if g.get("name") != gate]
        patch: list[dict[str, Any]] = [{"op": "test", "path": "/spec/schedulingGates", "value": gates}]
        patch.append({"op": "replace", "path": "/spec/schedulingGates", "value": rest} if rest
                     else {"op": "remove", "path": "/spec/schedulingGates"})
        what = f"cannot release pod {namespace}/{name}"
        try:
            self._call(what, self.core.patch_namespaced_pod, name, namespace, patch)
        except ApiException as exc:
            if exc.status != HTTP_NOT_FOUND:
                raise _fail(what, exc) from None

    def pod_event(self, pod: Mapping[str, Any], *, reason: str, message: str, warning: bool, now: str) -> None:
        """An Event on a pod (what ``kubectl describe pod`` shows); failures are the caller's to log."""
        meta = pod["metadata"]
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta['name'][:200]}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "namespace": meta["namespace"],
                               "uid": meta.get("uid", "")},
            "reason": reason, "message": message[:1024], "type": "Warning" if warning else "Normal",
            "source": {"component": "cachefs-operator"}, "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        what = f"cannot post an event on pod {meta['namespace']}/{meta['name']}"
        try:
            self._call(what, self.core.create_namespaced_event, meta["namespace"], event)
        except ApiException as exc:
            raise _fail(what, exc) from None

    def container_image(self, namespace: str, pod: str, container: str) -> str | None:
        """The image of ``container`` in a pod (the operator's own, for its warm-up Jobs); None if absent."""
        try:
            body = self._dict(self._call(f"cannot read pod {namespace}/{pod}", self.core.read_namespaced_pod,
                                         pod, namespace))
        except ApiException as exc:
            raise _fail(f"cannot read pod {namespace}/{pod}", exc) from None
        for spec in (body.get("spec") or {}).get("containers") or []:
            if spec.get("name") == container and spec.get("image"):
                return str(spec["image"])
        return None
