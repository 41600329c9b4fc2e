"""What a Dataset saved: its mount pods' read counters, added up in the Dataset's status.

**Collecting.** Every daemon of a Dataset's volume runs in a mount pod (``csi_driver.mountpods``:
one per node, labelled with the volume's hash) and serves its read-only ``/stats`` document on the
pod's IP at ``STATS_PORT`` (the container port named ``stats``). The operator's usage timer lists
those pods in the driver's namespace (``list pods``, the only API call it adds) and reads each one's
``/stats`` over HTTP, a few at a time, each bounded by ``STATS_TIMEOUT_S``. The ``traffic`` section
(``tiering.traffic``) gives, per daemon, the bytes and block requests of reads answered by RAM,
disk, the cluster tier and the source, and what was sent to the source and the cluster store.

**Adding up, across restarts.** A daemon's counters start at zero with its process, so the status
keeps, per mount pod (by uid), the counters last seen (``status.usage.daemons``), and the totals
accumulated so far (``status.usage.totals``). Each collection adds, per pod, what each counter grew
by since it was last seen; a pod seen for the first time adds everything it counted; a counter
that went *down* means a new process behind the same pod, and adds its whole new value. Totals are
never decreased: they hold everything since the Dataset was created, through operator restarts
(the status is the only memory) and mount pod restarts (a new pod: a new uid).

**A pod that cannot be read** (its node is gone, the network refuses) keeps its last-seen entry, so
a later read counts only its growth; what it served since its last read is added when it answers
again, or lost, if it never does (at most one collection interval of that node's reads). The entry
of a pod no longer listed is dropped, its figures staying in the totals. ``status.usage.unreachable``
counts the pods not read in the last collection.

**A pod that ended** (issue 36: a trainer's mount pod could come and go between two collections and
never be counted) leaves its daemon's last counters in its termination message (``cachefs mount
--exit-stats-file``, ``csi_driver.mountpods.TERMINATION_LOG``). The operator watches the mount pods
and keeps each ended pod's last counters (``last_counters``) until the next collection of its
volume, which adds their growth like a read's, listed or not; then they are dropped. What a pod
served is therefore counted however short its life, unless the operator was down from the pod's
end until it was deleted (its status is then gone with it).

**Savings.** Bytes and block requests answered by RAM, disk or the cluster tier did not reach the
source: ``sourceBytesAvoided`` and ``sourceRequestsAvoided`` (each block request answered by a cache
tier is one ranged GET the source did not get). Hit ratios are by bytes: local (RAM + disk), cluster,
source. With prices (``Prices``: from the Dataset's ``spec.pricing``, else the operator's flags),
``estimatedCostAvoided`` = avoided GiB x egress price + avoided requests / 1000 x request price; no
price set, no estimate. The page cache of each node answers some re-reads before the daemon sees
them: those are missing from every figure (the source never saw them either).
"""

from __future__ import annotations

import concurrent.futures
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from csi_driver.mountpods import STATS_PORT, STATS_PORT_NAME

# One /stats request: answered from memory by a live daemon in milliseconds; a node that takes longer
# is as good as gone for this collection (the next one tries again).
STATS_TIMEOUT_S = 3.0
# Pods read at once: a few slow or dead nodes do not hold the collection up for long.
PARALLEL_READS = 8
GIB = 1 << 30

# Counters kept per daemon and in the totals: status name -> (section of the /stats "traffic", field).
COUNTERS: dict[str, tuple[str, str]] = {
    "ramBytes": ("served_bytes", "ram"),
    "diskBytes": ("served_bytes", "disk"),
    "clusterBytes": ("served_bytes", "cluster"),
    "sourceBytes": ("served_bytes", "source"),
    "ramReads": ("served_blocks", "ram"),
    "diskReads": ("served_blocks", "disk"),
    "clusterReads": ("served_blocks", "cluster"),
    "sourceReads": ("served_blocks", "source"),
    "sourceRequests": ("source", "requests"),
    "sourceReadBytes": ("source", "read_bytes"),
    "sourceUploadRequests": ("source", "upload_requests"),
    "sourceUploadedBytes": ("source", "uploaded_bytes"),
    "clusterStoreRequests": ("cluster_store", "requests"),
    "clusterStoreReadBytes": ("cluster_store", "read_bytes"),
    "clusterStoreUploadRequests": ("cluster_store", "upload_requests"),
    "clusterStoreUploadedBytes": ("cluster_store", "uploaded_bytes"),
}


@dataclass(frozen=True)
class Prices:
    """What the source's provider charges: per GiB leaving the bucket, per thousand requests."""

    egress_per_gb: float | None = None
    requests_per_thousand: float | None = None
    currency: str = "USD"

    @property
    def set(self) -> bool:
        return self.egress_per_gb is not None or self.requests_per_thousand is not None

    def cost(self, avoided_bytes: int, avoided_requests: int) -> float:
        return round(avoided_bytes / GIB * (self.egress_per_gb or 0.0)
                     + avoided_requests / 1000 * (self.requests_per_thousand or 0.0), 6)


@dataclass(frozen=True)
class MountPod:
    """One mount pod of a Dataset's volume, as listed: where its /stats is."""

    uid: str
    name: str
    node: str
    address: str | None  # host:port, None while it has no IP (pending, or its node is gone)


StatsReader = Callable[[str], Mapping[str, Any] | None]


def read_stats(address: str) -> Mapping[str, Any] | None:
    """``GET http://address/stats`` (None: no answer in time, refused, or not a stats document)."""
    try:
        with urllib.request.urlopen(f"http://{address}/stats", timeout=STATS_TIMEOUT_S) as response:  # noqa: S310
            doc = json.loads(response.read())
    except (OSError, urllib.error.URLError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def mount_pod(pod: Mapping[str, Any]) -> MountPod:
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    port = STATS_PORT
    for container in spec.get("containers") or []:
        for declared in container.get("ports") or []:
            if declared.get("name") == STATS_PORT_NAME and isinstance(declared.get("containerPort"), int):
                port = declared["containerPort"]
    ip = status.get("podIP") if status.get("phase") == "Running" else None
    return MountPod(uid=str(meta.get("uid", "")), name=str(meta.get("name", "")), node=str(spec.get("nodeName", "")),
                    address=f"{ip}:{port}" if ip else None)


def last_counters(pod: Mapping[str, Any]) -> tuple[MountPod, dict[str, int]] | None:
    """The counters an ended mount pod's daemon wrote as its termination message, or None (still
    running, or it ended without writing them: killed, or an older daemon)."""
    for status in ((pod.get("status") or {}).get("containerStatuses") or []):
        terminated = (status.get("state") or {}).get("terminated") or {}
        message = terminated.get("message")
        if not isinstance(message, str) or not message.strip():
            continue
        try:
            doc = json.loads(message)
        except ValueError:
            continue
        found = counters(doc) if isinstance(doc, Mapping) else None
        if found is not None:
            return mount_pod(pod), found
    return None


def counters(doc: Mapping[str, Any]) -> dict[str, int] | None:
    """The counters of one daemon's /stats document (None: no ``traffic`` section, an older daemon)."""
    traffic = doc.get("traffic")
    if not isinstance(traffic, Mapping):
        return None
    out = {}
    for name, (section, field) in COUNTERS.items():
        value = (traffic.get(section) or {}).get(field, 0)
        out[name] = int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else 0
    return out


def _grown(now: Mapping[str, int], before: Mapping[str, Any] | None) -> dict[str, int]:
    """What each counter added since ``before`` (all of it for a new daemon or after a reset)."""
    if before is None:
        return dict(now)
    grown = {}
    for name, value in now.items():
        last = before.get(name, 0)
        last = last if isinstance(last, int) else 0
        grown[name] = value - last if value >= last else value  # a counter that went down restarted at zero
    return grown


def collect(pods: Iterable[MountPod], read: StatsReader = read_stats,
            stopping: Callable[[], bool] = lambda: False) -> dict[str, dict[str, int] | None]:
    """Each pod's counters by uid (None: not read: no address, no answer, an older daemon, or the
    operator stopping: once ``stopping()``, no further read starts, so a stop waits for one round of
    reads at most)."""
    pods = list(pods)
    found: dict[str, dict[str, int] | None] = {p.uid: None for p in pods}
    readable = [p for p in pods if p.address is not None]
    if not readable:
        return found

    def one(pod: MountPod) -> Mapping[str, Any] | None:
        return None if stopping() else read(pod.address or "")

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(PARALLEL_READS, len(readable))) as pool:
        docs = pool.map(one, readable)
        for pod, doc in zip(readable, docs):
            found[pod.uid] = counters(doc) if doc is not None else None
    return found


def accumulate(previous: Mapping[str, Any] | None, pods: Iterable[MountPod],
               read_counters: Mapping[str, dict[str, int] | None], prices: Prices, now: str) -> dict[str, Any]:
    """The new ``status.usage`` from the previous one and this collection (module docstring)."""
    previous = previous or {}
    totals = {name: int(previous.get("totals", {}).get(name, 0) or 0) for name in COUNTERS}
    last = {d.get("uid"): d for d in previous.get("daemons") or [] if isinstance(d, Mapping)}
    daemons, unreachable = [], 0
    for pod in pods:
        seen = read_counters.get(pod.uid)
        before = last.get(pod.uid)
        if seen is None:
            unreachable += 1
            if before is not None:
                daemons.append(dict(before))
            continue
        for name, value in _grown(seen, before).items():
            totals[name] += value
        daemons.append({"uid": pod.uid, "pod": pod.name, "node": pod.node, "seenAt": now, **seen})
    return {"updatedAt": now, "daemons": sorted(daemons, key=lambda d: (d["node"], d["pod"])),
            "unreachable": unreachable, "totals": totals, **savings(totals, prices)}


def savings(totals: Mapping[str, int], prices: Prices) -> dict[str, Any]:
    served = {p: totals[f"{p}Bytes"] for p in ("ram", "disk", "cluster", "source")}
    total = sum(served.values())
    avoided_bytes = total - served["source"]
    avoided_requests = totals["ramReads"] + totals["diskReads"] + totals["clusterReads"]

    def ratio(n: int) -> float:
        return round(n / total, 6) if total else 0.0

    out: dict[str, Any] = {
        "readBytes": total,
        "localHitRatio": ratio(served["ram"] + served["disk"]),
        "clusterHitRatio": ratio(served["cluster"]),
        "sourceHitRatio": ratio(served["source"]),
        "sourceBytesAvoided": avoided_bytes,
        "sourceRequestsAvoided": avoided_requests,
    }
    if prices.set:
        out["estimatedCostAvoided"] = {"amount": prices.cost(avoided_bytes, avoided_requests),
                                       "currency": prices.currency}
    return out


def display(usage: Mapping[str, Any], format_size: Callable[[int], str]) -> dict[str, str]:
    """The status strings `kubectl get dataset` shows: the hit ratio (not from the source) and the
    source bytes saved."""
    if not usage.get("readBytes"):
        return {"hitRatio": "-", "saved": format_size(0)}
    hit = 1.0 - float(usage.get("sourceHitRatio", 0.0))
    return {"hitRatio": f"{hit:.1%}", "saved": format_size(int(usage.get("sourceBytesAvoided", 0)))}
