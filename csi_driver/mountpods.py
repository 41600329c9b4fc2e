"""Mount pods (``cachefs-csi --mount-mode pod``): each volume's daemon in an unprivileged pod of its own.

The privileged node plugin mounts ``/dev/fuse`` at the staging path and hands the fd to the daemon
over a unix socket (``launchers.py``, ``HandoverMounter``); this module starts that daemon as a
**mount pod** through the Kubernetes API, so the daemon belongs to no container of the node
plugin: a plugin restart, an upgrade or an OOM kill of the plugin's container leaves it serving.

**One pod per volume per node.** Its name is deterministic, ``cachefs-mount-`` + a hash of the node
and the daemon's name (``launchers.daemon_name``, a hash of the staging path: the same on every node,
hence the node in the hash), 34 characters, so a restarted plugin finds it again and two creates of
one pod cannot both succeed (the API answers 409 to the second). Labels
name the app, the volume (a hash: a volume id may be 128 bytes of anything, a label value only 63
characters of a few) and the node; annotations carry the volume id and the staging path in full.
The pod is bound to the node (``nodeName``), tolerates every taint as the DaemonSet does, runs with
``restartPolicy: Never`` (a restarted daemon could never get its FUSE fd back: the kernel aborted
the connection when the old one died), a priority class from ``--mount-pod-priority-class``, the
volume's ``mountPod*`` resources, no privilege, no capabilities, no service account token and no
preStop hook: deleting it must never unmount anything under a running pod; unstage does that
first, through the privileged plugin. Host directories (the volume's cache directory, the
handover socket directory, the control-socket directory) are ``hostPath`` volumes mounted at the
same path in the container, so every path in the daemon's argv and logs is the host's.

**Credentials are never in the pod spec.** Every environment variable of the daemon goes into a
Secret of the same name in the driver's namespace, and reaches the container through
``secretKeyRef``. The Secret lives as long as the mount, not the pod: when the mount pod dies the
plugin starts a new one (``restart``) that refers to the same Secret, without ever reading it (the
plugin's Role has no ``get`` on Secrets; docs/security.md, "The mount pods' Secrets"). It is deleted
with the pod at unstage, and at start-up with every pod that is deleted and every daemon of this node
whose volume is no longer staged (``cleanup``).

**Never a leaked pod.** Unstage deletes the pod and its Secret, with the pod's own grace period or a
longer one, never a shorter (an explicit ``gracePeriodSeconds`` replaces the pod's, and the pod's
covers the volume's stopTimeout), and waits that long and a margin for the pod to go. At start-up
(``take_over``) the plugin lists the mount pods of its node: a pod that serves a staged volume (a
stage record) or a cachefs mount still in the mount table is adopted (kept, watched), any other is
deleted, as is the Secret of any daemon of the node whose volume is neither staged nor mounted there
(podwatch.take_over). An API server that does not answer then is
retried in the background: the plugin serves meanwhile.

**Watching** (``PodLauncher.watch``; what is done with what it sees is ``csi_driver.podwatch``). One
thread watches this node's mount pods (a list, then a watch bounded by
``WATCH_S``, then a fresh list: level-triggered, so a lost event costs at most one round). A pod
that died (phase Failed or Succeeded, a terminated container, or the pod deleted) while its mount
is still in the mount table and answers ENOTCONN is a broken
mount: a log line, a Kubernetes Event on the mount pod and on every workload pod bound to the
volume on this node (``podInfoOnMount`` names them), and ``cachefs_csi_mounts{state="broken"}``
(which counts dead mounts from the mount table). Then the plugin recovers the volume itself
(``restart``: a new pod of the same name with the same Secret; ``NodeOps.recover`` stacks a bind on
every pod's target); where that fails the next publish mounts it again, as in process mode. A pod
that dies before its daemon ever served (a mount in progress) is that mount's failure, not news. A pod that ended (deleted, evicted, died) is also checked for
writes its daemon left journaled: SIGTERM makes it upload first, within the volume's stopTimeout,
which its ``terminationGracePeriodSeconds`` covers; what stays is reported by ``StagedWritesReporter``
(an Event on the workload pods, ``cachefs_csi_mount_pods_ended_with_staged_writes_total``).

**API calls** are bounded (``API_TIMEOUT_S`` each) and their failures become one-line ``CsiError``s:
a server that cannot be reached, 429 and 5xx are UNAVAILABLE (the kubelet retries), 401/403
PERMISSION_DENIED (naming the RBAC rule that is missing), anything else INTERNAL.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import hashlib
import logging
import math
import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes import watch as k8s_watch
from kubernetes.client.rest import ApiException

from cachefs.settings import DEFAULT_STOP_TIMEOUT_S, STOP_MARGIN_S
from csi_driver import metrics
from csi_driver.attributes import MountPodResources, memory_bytes, mount_pod_memory_bytes
from csi_driver.errors import Code, CsiError
from csi_driver.launchers import DaemonSpec
from csi_driver.redact import REGISTRY

log = logging.getLogger(__name__)

APP = "cachefs-mount"
LABEL_APP = "app.kubernetes.io/name"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_VOLUME = "cachefs.io/volume"
LABEL_NODE = "cachefs.io/node"
ANNOTATION_DAEMON = "cachefs.io/daemon"  # launchers.daemon_name of the mount it serves
ANNOTATION_VOLUME_ID = "cachefs.io/volume-id"
ANNOTATION_TARGET = "cachefs.io/target"  # the host mountpoint it serves (the staging path)
CONTAINER = "cachefs"
CACHE_DIR_VOLUME = "cache-dir"  # the pod's hostPath volume of the volume's cache slot
USER_AGENT = "cachefs-csi-node"
POD_NAME_PREFIX = "cachefs-mount-"
# Pod names are DNS subdomains, but a pod's hostname is its name cut at 63: keep them that short.
MAX_NAME = 63
_LABEL_VALUE_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")

# One API call: the kubelet gives a publish ~2 minutes; an API server slower than this is down.
API_TIMEOUT_S = 10.0
# A watch is ended by the server after this many seconds, then the pods are listed and watched
# afresh: an event lost in between delays a report by at most this long.
WATCH_S = 30
# After a watch failed (API server down), wait this long before the next attempt.
WATCH_RETRY_S = 5.0
# How long a deleted pod may take to disappear (the kubelet stops its container: SIGTERM, then
# SIGKILL after terminationGracePeriodSeconds) before a new pod of the same name is refused; a pod
# that declares a longer grace period is waited for that plus DELETE_SLACK_S.
DELETE_WAIT_S = 60.0
POLL_S = 0.2
# A deletion waits for the pod this much longer than its grace period (the kubelet's own latency).
DELETE_SLACK_S = 15.0
# Resources of a volume that sets no mountPod* attribute: memory, requested and limited, for the RAM
# tier plus the daemon's own needs (attributes.mount_pod_memory_bytes); a tenth of a core idles the
# daemon and keeps it scheduled (see pod_resources for the limits).
MiB = 1 << 20
DEFAULT_CPU_REQUEST = "100m"
# /tmp of a mount pod (its root filesystem is read-only): the daemon writes nothing there itself.
TMP_SIZE = "64Mi"
# The daemon of a mount pod serves its read-only /stats and /metrics on the pod's own IP at this port
# (cachefs's default stats port; a pod has its own network namespace, so every mount pod uses the
# same one), declared as the container port "stats": what Prometheus scrapes and the Dataset
# operator reads (csi_driver.operator.usage). The IP comes from the downward API ($(POD_IP)).
STATS_PORT = 9750
STATS_PORT_NAME = "stats"
POD_IP_ENV = "POD_IP"
# The daemon writes its last counters here when it exits (``cachefs mount --exit-stats-file``): the
# container's termination message, which the kubelet keeps in the pod's status after the pod ended,
# so the Dataset operator counts what a mount pod served however short its life
# (csi_driver.operator.usage). Under the pod's /tmp (a volume), where the runtime can make the file
# on a read-only root.
TERMINATION_LOG = "/tmp/termination-log"
# A container waiting for one of these will not start by itself: the mount fails at once (naming
# the reason) instead of after the whole mount timeout; the kubelet retries the publish anyway.
STUCK_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
                           "CreateContainerError", "RunContainerError"})
# The daemon gets this long after SIGTERM to upload what is pending (unstage has flushed already; this
# covers a pod deleted or evicted by someone else, e.g. kubectl drain): its --stop-timeout (the volume's
# stopTimeout, 25 s by default) plus STOP_MARGIN_S for acknowledging open files and exiting, so the
# default is Kubernetes' own 30 s (docs/stopping.md).
TERMINATION_GRACE_S = math.ceil(DEFAULT_STOP_TIMEOUT_S + STOP_MARGIN_S)


def termination_grace_s(spec: DaemonSpec) -> int:
    """The mount pod's terminationGracePeriodSeconds: its daemon's stop timeout plus the margin."""
    if spec.stop_timeout_s is None:
        return TERMINATION_GRACE_S
    return math.ceil(spec.stop_timeout_s + STOP_MARGIN_S)


# Where a mount pod sees the driver's cluster-store Secret (``cluster_store_volume``).
CLUSTER_STORE_VOLUME = "cluster-store"
CLUSTER_STORE_DIR = "/etc/cachefs/cluster-store"


def kubelet_literal(arg: str) -> str:
    """``arg`` as a container argument the kubelet leaves as it is: ``$(VAR)`` is expanded, ``$$`` is ``$``."""
    return arg.replace("$", "$$")


def label_value(text: str) -> str:
    """``text`` if it is a valid label value, else a readable part of it and a hash (63 chars at most)."""
    if _LABEL_VALUE_RE.fullmatch(text):
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    readable = _UNSAFE.sub("-", text).strip("._-")[:40].strip("._-")
    return f"{readable}-{digest}" if readable else digest


def pod_name(node: str, daemon: str) -> str:
    """The mount pod of daemon ``daemon`` (``launchers.daemon_name``) on ``node``: deterministic, a
    DNS label of 34 characters. The node is part of it: every node stages a volume at the same path."""
    return POD_NAME_PREFIX + hashlib.sha256(f"{node}\0{daemon}".encode()).hexdigest()[:20]


def node_id(node: str) -> str:
    """The daemon's ``--node-id``: the node's name (its write-durability journal prefix names it, so
    ``cachefs recover --list`` names nodes, not mount pods that are gone: issue 36), hashed where it
    is longer than the 128 characters the option takes."""
    return node if len(node) <= 128 else f"{node[:100]}-{hashlib.sha256(node.encode()).hexdigest()[:16]}"


def volume_label(volume_id: str) -> str:
    return hashlib.sha256(volume_id.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class MountPodSettings:
    """Where and how mount pods run: from ``cachefs-csi`` flags."""

    namespace: str
    node_name: str
    image: str
    priority_class: str = ""  # "": the cluster's default priority
    service_account: str = ""  # "": the namespace's default, with no token mounted
    image_pull_policy: str = "IfNotPresent"
    command: tuple[str, ...] = ("cachefs",)  # the program in the image; the spec's args follow it
    api_timeout_s: float = API_TIMEOUT_S
    # The driver's Secret with the cluster store's credentials and the cluster key (``--cluster-store-secret``):
    # mounted into the pods of volumes with a cluster tier; a volume's own Secret never carries them.
    cluster_store_secret: str = ""
    default_cpu_limit: str = ""  # the CPU limit of a volume that sets none ("": none; --max-mount-pod-cpu)

    def node_selector(self) -> str:
        return f"{LABEL_APP}={APP},{LABEL_NODE}={label_value(self.node_name)}"


def _labels(settings: MountPodSettings, spec: DaemonSpec) -> dict[str, str]:
    return {LABEL_APP: APP, LABEL_PART_OF: "cachefs-csi", LABEL_VOLUME: volume_label(spec.volume_id),
            LABEL_NODE: label_value(settings.node_name)}


def _annotations(spec: DaemonSpec) -> dict[str, str]:
    return {ANNOTATION_DAEMON: spec.name, ANNOTATION_VOLUME_ID: spec.volume_id, ANNOTATION_TARGET: str(spec.target)}


def default_resources(spec: DaemonSpec) -> MountPodResources:
    """Resources when the volume sets none: memory for the RAM tier and the daemon, as request and
    limit (issue 34: without a limit a 64Mi request could carry a 20 GiB RAM tier, outside any quota)."""
    memory = f"{mount_pod_memory_bytes(spec.ram_cache_bytes) // MiB}Mi"
    return MountPodResources(cpu_request=DEFAULT_CPU_REQUEST, memory_request=memory, memory_limit=memory)


def pod_resources(settings: MountPodSettings, spec: DaemonSpec) -> MountPodResources:
    """The volume's mountPod* resources, else the defaults; a memory limit always (the larger of the
    default and the volume's request, where the volume sets none), a CPU limit where the admin caps
    CPU (``--max-mount-pod-cpu``, the limit of a volume that sets none). A memory limit that is hit
    kills the daemon and breaks the mount; the default one is sized so that it is not."""
    wanted = spec.pod_resources
    chosen = wanted if wanted.requests() or wanted.limits() else default_resources(spec)
    memory_limit = chosen.memory_limit
    if memory_limit is None:
        memory = mount_pod_memory_bytes(spec.ram_cache_bytes)
        request = chosen.memory_request
        memory_limit = request if request and memory_bytes("memory", request) > memory else f"{memory // MiB}Mi"
    return dataclasses.replace(chosen, memory_limit=memory_limit,
                               cpu_limit=chosen.cpu_limit or settings.default_cpu_limit or None)


def build_secret(settings: MountPodSettings, spec: DaemonSpec) -> dict[str, Any]:
    """The Secret holding the daemon's whole environment (credentials among it)."""
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": pod_name(settings.node_name, spec.name), "namespace": settings.namespace,
                     "labels": _labels(settings, spec), "annotations": _annotations(spec)},
        "data": {key: base64.b64encode(value.encode()).decode() for key, value in sorted(spec.env.items())},
    }


def cluster_store_volume(secret: str, volumes: list[dict[str, Any]], mounts: list[dict[str, Any]],
                         env: list[dict[str, Any]]) -> None:
    """The driver's cluster-store Secret, read-only in the pod, and the variables pointing the daemon
    at it: the store's credentials as the profile ``cluster`` (``--cluster-profile``) of a credentials
    file, and the cluster key's file (``--cluster-key-file``). Paths only: no secret in the spec."""
    # Optional: a driver whose admin made no such Secret mounts clustered volumes without it, and the
    # daemon refuses in one line (no cluster key) rather than the pod waiting for a Secret forever.
    volumes.append({"name": CLUSTER_STORE_VOLUME, "secret": {"secretName": secret, "defaultMode": 0o444,
                                                             "optional": True}})
    mounts.append({"name": CLUSTER_STORE_VOLUME, "mountPath": CLUSTER_STORE_DIR, "readOnly": True})
    env += [{"name": "AWS_SHARED_CREDENTIALS_FILE", "value": f"{CLUSTER_STORE_DIR}/credentials"},
            {"name": "CACHEFS_CLUSTER_PROFILE", "value": "cluster"},
            {"name": "CACHEFS_CLUSTER_KEY_FILE", "value": f"{CLUSTER_STORE_DIR}/key"}]


def build_pod(settings: MountPodSettings, spec: DaemonSpec) -> dict[str, Any]:
    """The mount pod's manifest (plain JSON, as the API takes it): no credential anywhere in it."""
    name = pod_name(settings.node_name, spec.name)
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    for volume, path in ((CACHE_DIR_VOLUME, spec.cache_dir), ("run-dir", spec.run_dir)):
        volumes.append({"name": volume, "hostPath": {"path": str(path), "type": "Directory"}})
        mounts.append({"name": volume, "mountPath": str(path)})
    # The root filesystem is read-only; a library's temporary file goes to a small tmpfs.
    volumes.append({"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": TMP_SIZE}})
    mounts.append({"name": "tmp", "mountPath": "/tmp"})
    env = [{"name": key, "valueFrom": {"secretKeyRef": {"name": name, "key": key}}} for key in sorted(spec.env)]
    env.append({"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    if settings.cluster_store_secret and "--cluster-cache" in spec.args:
        cluster_store_volume(settings.cluster_store_secret, volumes, mounts, env)
    chosen = pod_resources(settings, spec)
    resources: dict[str, dict[str, str]] = {}
    if chosen.requests():
        resources["requests"] = chosen.requests()
    if chosen.limits():
        resources["limits"] = chosen.limits()
    pod_security: dict[str, Any] = {"seccompProfile": {"type": "RuntimeDefault"},
                                    "runAsUser": spec.uid if spec.uid is not None else 0}
    if spec.gid is not None:
        pod_security["runAsGroup"] = spec.gid
    pod_spec: dict[str, Any] = {
        "nodeName": settings.node_name,
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": termination_grace_s(spec),
        "tolerations": [{"operator": "Exists"}],
        "securityContext": pod_security,
        "containers": [{
            "name": CONTAINER,
            "image": settings.image,
            "imagePullPolicy": settings.image_pull_policy,
            # The kubelet expands $(VAR) in a container's command from its environment: $(POD_IP) here,
            # and in an argument taken from a volume attribute the daemon's own credentials
            # ($(AWS_SECRET_ACCESS_KEY) in a source). Every '$' of those is doubled ('$$' is a
            # literal '$' to the kubelet), so they reach the daemon as written.
            "command": [*settings.command, *(kubelet_literal(arg) for arg in spec.args),
                        "--node-id", node_id(settings.node_name),
                        "--stats-addr", f"$({POD_IP_ENV}):{STATS_PORT}", "--exit-stats-file", TERMINATION_LOG],
            "terminationMessagePath": TERMINATION_LOG,
            "terminationMessagePolicy": "File",
            "ports": [{"name": STATS_PORT_NAME, "containerPort": STATS_PORT, "protocol": "TCP"}],
            "env": env,
            "resources": resources,
            "volumeMounts": mounts,
            "securityContext": {"privileged": False, "allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": True},
        }],
        "volumes": volumes,
    }
    if settings.priority_class:
        pod_spec["priorityClassName"] = settings.priority_class
    if settings.service_account:
        pod_spec["serviceAccountName"] = settings.service_account
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": settings.namespace, "labels": _labels(settings, spec),
                     "annotations": _annotations(spec)},
        "spec": pod_spec,
    }


# ---------------------------------------------------------------------------------------- API calls
_API_ERRORS = (ApiException, urllib3.exceptions.HTTPError, OSError)


def api_client(kubeconfig: str | None = None) -> k8s.ApiClient:
    """A client from ``kubeconfig``, else the pod's in-cluster service account."""
    configuration = k8s.Configuration()
    try:
        if kubeconfig:
            k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        else:
            k8s_config.load_incluster_config(client_configuration=configuration)
    except (k8s_config.ConfigException, OSError, ValueError) as exc:
        raise CsiError(Code.FAILED_PRECONDITION, f"no Kubernetes API configuration: {exc}") from None
    configuration.retries = 1  # urllib3: one retry on a dropped connection, no more (calls are bounded)
    api = k8s.ApiClient(configuration)
    api.user_agent = USER_AGENT  # audit logs (and the tests) tell the plugin's calls apart
    return api


def own_image(api: k8s.ApiClient, namespace: str, pod: str, container: str, timeout_s: float = API_TIMEOUT_S) -> str:
    """The image of ``container`` in the plugin's own pod: mount pods run the plugin's own version,
    whatever an overlay's ``images:`` renamed it to (kustomize rewrites image fields, not flags)."""
    try:
        own = k8s.CoreV1Api(api).read_namespaced_pod(pod, namespace, _request_timeout=timeout_s)
    except (ApiException, *_API_ERRORS) as exc:
        raise api_error(exc, f"reading the plugin's own pod {namespace}/{pod} for its image") from None
    for candidate in own.spec.containers:
        if candidate.name == container and candidate.image:
            return str(candidate.image)
    raise CsiError(Code.FAILED_PRECONDITION, f"pod {namespace}/{pod} has no container {container!r}")


def _status_message(exc: ApiException) -> str:
    import json

    try:
        return str(json.loads(exc.body or "{}").get("message") or exc.reason)
    except (ValueError, AttributeError):
        return str(exc.reason)


def api_error(exc: Exception, what: str) -> CsiError:
    """One line and a code for a failed API call."""
    if isinstance(exc, ApiException):
        status = exc.status or 0
        message = REGISTRY.scrub(_status_message(exc)).splitlines()[0][:300] if _status_message(exc) else ""
        if status in (401, 403):
            return CsiError(Code.PERMISSION_DENIED,
                            f"{what}: the API refused it ({status}: {message}); check the node plugin's RBAC "
                            "(deploy/base/node-rbac.yaml)")
        if status == 429 or status >= 500 or status == 0:
            return CsiError(Code.UNAVAILABLE, f"{what}: the API server answered {status}: {message}")
        return CsiError(Code.INTERNAL, f"{what}: the API answered {status}: {message}")
    return CsiError(Code.UNAVAILABLE, f"{what}: the API server cannot be reached ({type(exc).__name__})")


@dataclass(frozen=True)
class PodState:
    """What the API says about one mount pod."""

    name: str
    uid: str
    daemon: str
    volume_id: str
    target: str
    phase: str
    terminated: str | None  # why the container ended ("Error, exit code 137"), or None while it runs
    deleting: bool
    waiting: str | None = None  # why the container has not started ("ErrImagePull: ..."), if it says
    cache_dir: str = ""  # the host directory of its "cache-dir" volume (staged writes live there)
    # spec.terminationGracePeriodSeconds as read (``termination_grace_s``); a stop never gives it less
    grace_s: int | None = None

    @property
    def dead(self) -> bool:
        return self.terminated is not None or self.phase in ("Failed", "Succeeded")

    @property
    def stuck(self) -> bool:
        """The container cannot start without someone changing something (image, Secret, spec)."""
        return self.waiting is not None and self.waiting.split(":", 1)[0] in STUCK_REASONS

    @property
    def running(self) -> bool:
        return not self.dead and not self.deleting and not self.stuck

    def describe(self) -> str:
        if self.terminated is not None:
            return f"phase {self.phase}, {self.terminated}"
        return f"phase {self.phase}" + (f", waiting: {self.waiting}" if self.waiting else "")

    @classmethod
    def of(cls, pod: Any) -> PodState:
        meta, status = pod.metadata, pod.status
        annotations = meta.annotations or {}
        terminated = waiting = None
        for container in (status.container_statuses or []) if status is not None else []:
            state = container.state.terminated if container.state is not None else None
            if state is not None:
                terminated = f"{state.reason or 'terminated'}, exit code {state.exit_code}"
            held = container.state.waiting if container.state is not None else None
            if held is not None and held.reason:
                waiting = held.reason + (f": {held.message[:200]}" if held.message else "")
        phase = (status.phase if status is not None else None) or "Pending"
        if terminated is None and phase in ("Failed", "Succeeded"):
            terminated = phase + (f": {status.message}" if status.message else "")
        spec = getattr(pod, "spec", None)
        cache_dir = next((v.host_path.path for v in (getattr(spec, "volumes", None) or [])
                          if v.name == CACHE_DIR_VOLUME and v.host_path is not None), "")
        grace = getattr(spec, "termination_grace_period_seconds", None)
        return cls(meta.name, meta.uid or "", annotations.get(ANNOTATION_DAEMON, ""),
                   annotations.get(ANNOTATION_VOLUME_ID, ""), annotations.get(ANNOTATION_TARGET, ""), phase,
                   terminated, meta.deletion_timestamp is not None, waiting, cache_dir,
                   int(grace) if grace is not None else None)


class PodLauncher:
    """``DaemonLauncher`` over the Kubernetes API: each daemon in a mount pod on this node."""

    def __init__(self, settings: MountPodSettings, api: k8s.ApiClient, *, watch_s: int = WATCH_S) -> None:
        self.settings = settings
        self.core = k8s.CoreV1Api(api)
        self.watch_s = watch_s
        self._timeout = settings.api_timeout_s

    # -- helpers ------------------------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[..., Any], *args: Any, missing_ok: bool = False, **kwargs: Any) -> Any:
        try:
            return fn(*args, _request_timeout=self._timeout, **kwargs)
        except ApiException as exc:
            if missing_ok and exc.status == 404:
                return None
            raise api_error(exc, what) from None
        except _API_ERRORS as exc:
            raise api_error(exc, what) from None

    def _mine(self, obj: Any) -> bool:
        """Whether ``obj`` is a mount pod (or Secret) of this node: the label selector, checked again."""
        labels = obj.metadata.labels or {}
        return labels.get(LABEL_APP) == APP and labels.get(LABEL_NODE) == label_value(self.settings.node_name)

    def pod_name(self, name: str) -> str:
        return pod_name(self.settings.node_name, name)

    def get(self, name: str) -> PodState | None:
        pod = self._call(f"reading mount pod {self.pod_name(name)}", self.core.read_namespaced_pod,
                         self.pod_name(name), self.settings.namespace, missing_ok=True)
        return PodState.of(pod) if pod is not None else None

    # -- DaemonLauncher -----------------------------------------------------------------------------
    def start(self, spec: DaemonSpec) -> None:
        name, ns = self.pod_name(spec.name), self.settings.namespace
        old = self.get(spec.name)
        if old is not None and old.running:
            raise CsiError(Code.ALREADY_EXISTS, f"daemon {spec.name} is already running ({self.describe(spec.name)})")
        if old is not None:
            log.info("replacing mount pod %s/%s of %s (%s)", ns, name, spec.target, old.terminated or "being deleted")
            self._delete(spec.name)
        self._call(f"deleting the stale Secret {name}", self.core.delete_namespaced_secret, name, ns, missing_ok=True)
        self._call(f"creating the Secret {name}", self.core.create_namespaced_secret, ns, build_secret(self.settings, spec))
        self._call(f"creating mount pod {name}", self.core.create_namespaced_pod, ns, build_pod(self.settings, spec))
        log.info("started daemon %s for %s (volume %s): mount pod %s/%s on node %s", spec.name, spec.target,
                 spec.volume_id, ns, name, self.settings.node_name)

    def restart(self, spec: DaemonSpec) -> None:
        """A new mount pod for a daemon that died: the dead pod deleted (its Secret kept), a new one of
        the same name created from ``spec`` (whose ``env`` names the variables only); the kubelet
        fills them from the Secret the first start created. A Secret gone meanwhile leaves the pod
        waiting (CreateContainerConfigError): the mount then fails at once, naming it."""
        name, ns = self.pod_name(spec.name), self.settings.namespace
        old = self.get(spec.name)
        if old is not None and old.running:
            raise CsiError(Code.ALREADY_EXISTS, f"daemon {spec.name} is already running ({self.describe(spec.name)})")
        if old is not None:
            self._delete(spec.name, secret=False)
        self._call(f"creating mount pod {name}", self.core.create_namespaced_pod, ns, build_pod(self.settings, spec))
        log.info("restarted daemon %s for %s (volume %s): a new mount pod %s/%s on node %s, with the Secret of "
                 "the first", spec.name, spec.target, spec.volume_id, ns, name, self.settings.node_name)

    def is_running(self, name: str) -> bool:
        state = self.get(name)
        return state is not None and state.running

    def stop(self, name: str, timeout_s: float) -> None:
        """Delete the mount pod, giving its daemon ``timeout_s`` after SIGTERM, or the pod's own grace
        period where that is longer (a volume's stopTimeout above the plugin's default), and wait for it."""
        self._delete(name, grace_s=timeout_s)

    def names(self) -> list[str]:
        return sorted(p.daemon for p in self.pods() if p.running and p.daemon)

    def describe(self, name: str) -> str:
        where = f"mount pod {self.settings.namespace}/{self.pod_name(name)}"
        try:
            state = self.get(name)
        except CsiError:
            return where
        return f"{where}, " + (state.describe() if state is not None else "gone")

    # -- deletion -----------------------------------------------------------------------------------
    def _delete(self, name: str, grace_s: float | None = None, *, secret: bool = True) -> None:
        """Delete the pod and (unless ``secret`` is false) its Secret, then wait until the pod is gone (so its name is free).

        ``grace_s`` (a stop): the DELETE's ``gracePeriodSeconds`` is the longer of it and the pod's own
        ``terminationGracePeriodSeconds``, which covers the daemon's stop timeout (an explicit value
        replaces the pod's on a real API server). It is sent even where the pod's own is the longer, so
        that the DELETE states the grace this waits for (plus ``DELETE_SLACK_S``). Without ``grace_s``
        the pod's own applies, waited for at least ``DELETE_WAIT_S``. A pod gone already: as asked (404)."""
        pod, ns = self.pod_name(name), self.settings.namespace
        state = self.get(name)
        own = state.grace_s if state is not None else None
        options: dict[str, int] = {}
        if grace_s is not None:
            options["gracePeriodSeconds"] = max(0, int(grace_s), own or 0)
            wait_s = options["gracePeriodSeconds"] + DELETE_SLACK_S
        else:
            wait_s = max(DELETE_WAIT_S, (own or 0) + DELETE_SLACK_S)
        self._call(f"deleting mount pod {pod}", self.core.delete_namespaced_pod, pod, ns, missing_ok=True,
                   body=options)
        if secret:
            self._call(f"deleting the Secret {pod}", self.core.delete_namespaced_secret, pod, ns, missing_ok=True)
        deadline = time.monotonic() + wait_s
        while self.get(name) is not None:
            if time.monotonic() > deadline:
                raise CsiError(Code.UNAVAILABLE, f"mount pod {ns}/{pod} was deleted but still exists after {wait_s:g} s")
            time.sleep(POLL_S)
        grace = options.get("gracePeriodSeconds", own)
        log.info("deleted mount pod %s/%s (daemon %s, grace period %s)", ns, pod, name,
                 f"{grace} s" if grace is not None else "the API's default")

    # -- the node's pods ----------------------------------------------------------------------------
    def pods(self) -> list[PodState]:
        pods = self._call("listing mount pods", self.core.list_namespaced_pod, self.settings.namespace,
                          label_selector=self.settings.node_selector())
        return [PodState.of(p) for p in pods.items if self._mine(p)]

    def cleanup(self, keep: Callable[[PodState], bool],
                known: Iterable[str] = ()) -> tuple[list[PodState], list[PodState]]:
        """Adopt this node's mount pods ``keep`` accepts; delete the others with their Secrets, and the
        Secret of every ``known`` daemon (one this node has a run directory for) that has no pod.

        Secrets are deleted by name, never listed: a list of Secrets returns their data, and the
        plugin's Role grants no read of any Secret (deploy/base/node-rbac.yaml). ``known`` is what the
        caller has found no more use for: a Secret outlives its pod while the volume stays mounted
        (``restart``). Returns (adopted, deleted).
        Deletion does not wait: nothing will need those names soon."""
        adopted, deleted = [], []
        pods = self.pods()
        for pod in pods:
            if keep(pod):
                adopted.append(pod)
                continue
            log.info("deleting mount pod %s: %s is neither staged nor mounted on this node", pod.name,
                     pod.target or "its target")
            self._call(f"deleting mount pod {pod.name}", self.core.delete_namespaced_pod, pod.name,
                       self.settings.namespace, missing_ok=True)
            deleted.append(pod)
        live = {p.name for p in adopted}
        orphans = {p.name for p in deleted} | {self.pod_name(daemon) for daemon in known}
        for name in sorted(orphans - live):
            self._call(f"deleting the Secret {name}", self.core.delete_namespaced_secret, name,
                       self.settings.namespace, missing_ok=True)
        return adopted, deleted

    # -- Events -------------------------------------------------------------------------------------
    def event(self, namespace: str, pod: str, uid: str, reason: str, message: str) -> None:
        """A Warning Event on a pod; a failure is logged, never raised (an Event is a courtesy)."""
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{pod}.{uuid.uuid4().hex[:16]}", "namespace": namespace},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": namespace, "name": pod,
                               **({"uid": uid} if uid else {})},
            "reason": reason, "message": message[:1024], "type": "Warning",
            "source": {"component": "cachefs-csi-node", "host": self.settings.node_name},
            "reportingComponent": "csi.cachefs.io/node", "reportingInstance": self.settings.node_name,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        try:
            self._call(f"creating an Event on pod {namespace}/{pod}", self.core.create_namespaced_event, namespace, body)
        except CsiError as exc:
            log.warning("%s", exc)

    # -- watching -----------------------------------------------------------------------------------
    def watch(self, on_pod: Callable[[str, PodState], None], stop: threading.Event,
              prepare: Callable[[], None] | None = None) -> None:
        """Call ``on_pod(event_type, state)`` for every change of this node's mount pods until ``stop``.

        Level-triggered: each round lists the pods (a pod gone since the last list is reported as
        DELETED, every other one as ADDED), then watches from that list's resourceVersion for up to
        ``watch_s`` seconds; an event missed between rounds is caught by the next list. ``prepare``
        runs first, again each round until it succeeds (the start-up take-over)."""
        known: dict[str, PodState] = {}
        failures = 0
        while not stop.is_set():
            watcher = k8s_watch.Watch()
            try:
                if prepare is not None:
                    prepare()
                    prepare = None
                listed = self._call("listing mount pods", self.core.list_namespaced_pod, self.settings.namespace,
                                    label_selector=self.settings.node_selector())
                current = {p.metadata.name: PodState.of(p) for p in listed.items if self._mine(p)}
                for name, old in known.items():
                    if name not in current:
                        on_pod("DELETED", old)
                for state in current.values():
                    on_pod("ADDED", state)
                known = current
                failures = 0
                for event in watcher.stream(self.core.list_namespaced_pod, self.settings.namespace,
                                            label_selector=self.settings.node_selector(),
                                            resource_version=listed.metadata.resource_version,
                                            timeout_seconds=self.watch_s,
                                            _request_timeout=(self._timeout, self.watch_s * 1.5 + 1)):
                    if stop.is_set():
                        break
                    pod, kind = event.get("object"), str(event.get("type"))
                    if kind in ("ADDED", "MODIFIED", "DELETED") and pod is not None and self._mine(pod):
                        state = PodState.of(pod)
                        if kind == "DELETED":
                            known.pop(state.name, None)
                        else:
                            known[state.name] = state
                        on_pod(kind, state)
            except (CsiError, *_API_ERRORS) as exc:
                if isinstance(exc, urllib3.exceptions.ReadTimeoutError) or "Read timed out" in str(exc):
                    continue  # a quiet watch past its deadline: list and watch again
                failures += 1
                if failures == 1:
                    reason = exc if isinstance(exc, CsiError) else api_error(exc, "watch")
                    log.warning("watching mount pods failed (%s); retrying every %g s", reason, WATCH_RETRY_S)
                stop.wait(WATCH_RETRY_S)
            finally:
                watcher.stop()

    def start_watching(self, on_pod: Callable[[str, PodState], None],
                       prepare: Callable[[], None] | None = None) -> threading.Event:
        """``watch`` in a daemon thread; set the returned event to stop it."""
        stop = threading.Event()
        threading.Thread(target=self.watch, args=(on_pod, stop, prepare), name="mount-pod-watch", daemon=True).start()
        return stop
