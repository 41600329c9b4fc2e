"""The objects the operator creates for a Dataset, and its status, as plain dicts (no API calls).

Per Dataset ``NS/NAME``:

- a **PersistentVolume** ``cachefs-NS.NAME`` (shortened with a hash past 253 characters) of the CSI
  driver, read-only, ``Retain`` (deleting it never touches the bucket: only DeleteVolume of a
  provisioned volume could, and this one is static), pre-bound to
- a **PersistentVolumeClaim** ``NAME`` in ``NS``: the claim a training pod names;
- per warm-up run, a **Job** per target (the cluster tier: one; node tiers: one per matching node,
  pinned to it by node affinity) running ``cachefs prefetch /data ... --json-progress`` with the
  claim at ``/data`` and the node plugin's control sockets (``/run/cachefs``), as the init container
  of deploy/examples/training-job-prefetch.yaml does.

Everything carries ``app.kubernetes.io/managed-by: cachefs-operator`` and ``cachefs.io/owner-uid``
(the Dataset's uid): the PV is cluster-scoped and cannot have a namespaced owner, so it is found by
label; the claim and Jobs also get an ownerReference, so the garbage collector removes them even if
the operator is gone. Jobs are *not* labelled ``cachefs.io/dataset``: that label marks the pods
held by the scheduling gate.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable, Mapping

from csi_driver import DRIVER_NAME
from csi_driver.operator.spec import TIER_CLUSTER, DatasetSettings

GROUP, VERSION, PLURAL = "cachefs.io", "v1alpha1", "datasets"
DATASET_LABEL = "cachefs.io/dataset"  # on pods a gate holds: the Dataset's name
GATE_NAME = "cachefs.io/warm"  # the scheduling gate the operator removes
MANAGED_BY = {"app.kubernetes.io/managed-by": "cachefs-operator"}
OWNER_UID_LABEL = "cachefs.io/owner-uid"
WARMUP_OF_LABEL = "cachefs.io/warm-up-of"
RUN_LABEL = "cachefs.io/run"
CONTAINER = "prefetch"
DATA_MOUNT = "/data"
CONTROL_DIR = "/run/cachefs"
MANIFEST_DIR = "/etc/cachefs-warmup"
# A finished Job lingers this long (its pod log holds the final progress line the operator reads
# on its next follow tick, seconds later); the next run deletes the previous run's Jobs anyway.
JOB_TTL_AFTER_FINISHED_S = 3600
# One retry for a pod lost with its node; a prefetch that fails twice is reported, not looped.
JOB_BACKOFF_LIMIT = 1
MAX_NAME = 253
MAX_JOB_NAME = 63  # the Job controller puts the Job's name in a label of its pods


def _shortened(name: str, limit: int) -> str:
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:10]
    return f"{name[:limit - 11].rstrip('-.')}-{digest}"


def pv_name(namespace: str, name: str) -> str:
    """The Dataset's PersistentVolume (cluster-scoped, so one name space for every namespace's Datasets).

    A namespace is a DNS label (no '.'), so the first '.' ends it: ``team-a/data`` and ``team/a-data``
    get ``cachefs-team-a.data`` and ``cachefs-team.a-data``, never the same name (with '-' between them
    both were ``cachefs-team-a-data``, and the second Dataset failed with NameTaken, issue 34). A name
    past 253 characters keeps a hash of the whole, so the shortened names stay apart too.
    """
    return _shortened(f"cachefs-{namespace}.{name}", MAX_NAME)


def job_name(name: str, run: int, node: str | None = None) -> str:
    suffix = f"-warm-{run}" + (f"-{hashlib.sha256(node.encode()).hexdigest()[:8]}" if node else "")
    return _shortened(name, MAX_JOB_NAME - len(suffix)).rstrip("-.") + suffix


def labels(uid: str) -> dict[str, str]:
    return {**MANAGED_BY, OWNER_UID_LABEL: uid}


def owner_reference(body: Mapping[str, Any]) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Dataset", "name": body["metadata"]["name"],
            "uid": body["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}


def persistent_volume(body: Mapping[str, Any], settings: DatasetSettings, name: str | None = None) -> dict[str, Any]:
    """The Dataset's PV, named ``name`` (the claim's bound volume) or ``pv_name``."""
    meta = body["metadata"]
    name = name or pv_name(meta["namespace"], meta["name"])
    csi: dict[str, Any] = {"driver": DRIVER_NAME, "volumeHandle": name, "readOnly": True,
                           "volumeAttributes": dict(settings.volume_attributes)}
    if settings.secret_name:
        csi["nodePublishSecretRef"] = {"name": settings.secret_name, "namespace": meta["namespace"]}
    return {
        "apiVersion": "v1", "kind": "PersistentVolume",
        "metadata": {"name": name, "labels": labels(meta["uid"])},
        "spec": {
            "capacity": {"storage": settings.capacity},
            "accessModes": ["ReadOnlyMany"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "",
            "mountOptions": ["ro"],
            "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "namespace": meta["namespace"],
                         "name": meta["name"]},
            "csi": csi,
        },
    }


def persistent_volume_claim(body: Mapping[str, Any], settings: DatasetSettings) -> dict[str, Any]:
    meta = body["metadata"]
    return {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": meta["name"], "namespace": meta["namespace"], "labels": labels(meta["uid"]),
                     "ownerReferences": [owner_reference(body)]},
        "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "",
                 "volumeName": pv_name(meta["namespace"], meta["name"]),
                 "resources": {"requests": {"storage": settings.capacity}}},
    }


def prefetch_command(settings: DatasetSettings) -> list[str]:
    """The warm-up container's command: ``cachefs prefetch`` on the claim mounted at ``/data``."""
    warm = settings.warm_up
    command = ["cachefs", "prefetch", DATA_MOUNT]
    if warm.manifest_config_map:
        command += ["--manifest", f"{MANIFEST_DIR}/{warm.manifest_key}"]
    elif warm.paths:
        command += [f"{DATA_MOUNT}/{p}" for p in warm.paths] + ["--recursive"]
    if warm.tier == TIER_CLUSTER:
        command += ["--tier", "cluster"]
    if warm.pin:
        command.append("--pin")
    if warm.parallel is not None:
        command += ["--parallel", str(warm.parallel)]
    return command + ["--json-progress"]


def warm_up_job(body: Mapping[str, Any], settings: DatasetSettings, *, run: int, image: str,
                node: str | None) -> dict[str, Any]:
    meta = body["metadata"]
    job_labels = {**labels(meta["uid"]), WARMUP_OF_LABEL: meta["name"], RUN_LABEL: str(run)}
    mounts = [{"name": "dataset", "mountPath": DATA_MOUNT, "readOnly": True},
              {"name": "cachefs-control", "mountPath": CONTROL_DIR, "readOnly": True}]
    volumes: list[dict[str, Any]] = [
        {"name": "dataset", "persistentVolumeClaim": {"claimName": meta["name"], "readOnly": True}},
        {"name": "cachefs-control", "hostPath": {"path": CONTROL_DIR, "type": "Directory"}},
    ]
    warm = settings.warm_up
    if warm.manifest_config_map:
        mounts.append({"name": "manifest", "mountPath": MANIFEST_DIR, "readOnly": True})
        volumes.append({"name": "manifest", "configMap": {"name": warm.manifest_config_map}})
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,  # the pod only prints; the operator reads its log
        "containers": [{
            "name": CONTAINER, "image": image, "command": prefetch_command(settings),
            # The control sockets are root's (mode 0700), as for the training-job-prefetch example.
            "securityContext": {"runAsUser": 0, "allowPrivilegeEscalation": False},
            "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
            "terminationMessagePolicy": "FallbackToLogsOnError",
            "volumeMounts": mounts,
        }],
        "volumes": volumes,
    }
    if node is not None:
        pod_spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}
        pod_spec["tolerations"] = [{"operator": "Exists"}]  # a node chosen by name is warmed even if tainted
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": job_name(meta["name"], run, node), "namespace": meta["namespace"], "labels": job_labels,
                     "annotations": {"cachefs.io/node": node or ""}, "ownerReferences": [owner_reference(body)]},
        "spec": {"backoffLimit": JOB_BACKOFF_LIMIT, "activeDeadlineSeconds": warm.active_deadline_s,
                 "ttlSecondsAfterFinished": JOB_TTL_AFTER_FINISHED_S,
                 "template": {"metadata": {"labels": job_labels}, "spec": pod_spec}},
    }


# ------------------------------------------------------------------------------------------- status
def last_document(log: str) -> dict[str, Any] | None:
    """The last complete JSON line of a ``prefetch --json-progress`` log (a line cut short is skipped)."""
    for line in reversed(log.splitlines()):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and "bytes_total" in doc:
            return doc
    return None


def format_size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "PiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} PiB"


def percent(cached: int, total: int) -> float:
    return round(100.0 * cached / total, 1) if total else 100.0


def tier_entry(job: str, node: str | None, state: str, doc: Mapping[str, Any] | None, tier: str) -> dict[str, Any]:
    entry: dict[str, Any] = {"tier": "cluster" if tier == TIER_CLUSTER else "disk", "job": job, "state": state}
    if node:
        entry["node"] = node
    if doc is not None:
        total, cached = int(doc.get("bytes_total", 0)), int(doc.get("bytes_cached", doc.get("bytes_done", 0)))
        entry.update(totalBytes=total, cachedBytes=cached, cachedPercent=percent(cached, total),
                     filesTotal=int(doc.get("files_total", 0)), filesCached=int(doc.get("files_cached", 0)))
    return entry


def totals(tiers: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Dataset-level figures: the size seen by any target, and the least-cached target's share."""
    entries = [t for t in tiers if "totalBytes" in t]
    if not entries:
        return {}
    total = max(t["totalBytes"] for t in entries)
    least = min(entries, key=lambda t: t["cachedPercent"])
    return {"totalBytes": total, "cachedBytes": least["cachedBytes"], "cachedPercent": least["cachedPercent"],
            "cached": f"{least['cachedPercent']:.1f}%", "size": format_size(total)}


def condition(kind: str, ok: bool | None, reason: str, message: str, *, generation: int | None,
              now: str, previous: Iterable[Mapping[str, Any]] = ()) -> dict[str, Any]:
    status = "Unknown" if ok is None else "True" if ok else "False"
    since = now
    for old in previous:
        if old.get("type") == kind and old.get("status") == status and old.get("lastTransitionTime"):
            since = old["lastTransitionTime"]
    cond: dict[str, Any] = {"type": kind, "status": status, "reason": reason, "message": message[:1024],
                            "lastTransitionTime": since}
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond
