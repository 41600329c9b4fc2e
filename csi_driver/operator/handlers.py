"""The kopf handlers of cachefs-operator, registered in a registry of their own (``build_registry``).

**Datasets.** ``create``/``update``/``resume`` parse the spec (``spec.parse_spec``): a bad spec sets
phase ``Failed`` and the Ready condition's message, and creates nothing. A good one gets its
PersistentVolume and claim (``manifests``), then a warm-up run: one Job per target. A run starts on
create, on every spec change, on resume when the generation has no run yet, and, with policy
``Cron``, each time the schedule comes due (checked by the follow timer). The follow timer
(``FOLLOW_INTERVAL_S``) reads each Job's state and its pod's last ``--json-progress`` line into
``status.tiers``, and when all Jobs have ended sets ``lastWarmUp`` and the Warm condition (True only
when every target ended with everything cached). ``delete`` (kopf's finalizer, named
``cachefs.io/dataset-cleanup``) deletes the Jobs, the claim and the PersistentVolume; the bucket's
data is never touched.

**Gated pods.** Pods labelled ``cachefs.io/dataset: NAME`` that carry the scheduling gate
``cachefs.io/warm`` are noted by a watch (``on.event``; a timer on pods would put kopf's finalizer on
every user pod) in ``OperatorState.gated``; Datasets' warmth is noted the same way. A loop started at
operator start-up (``GATE_INTERVAL_S``) removes the gate from the pods whose Dataset is Warm, whose
Dataset's spec is invalid (it will never be warm), or whose gate timeout (the Dataset's
``spec.gate.timeoutSeconds``, else ``DEFAULT_GATE_TIMEOUT_S``) has passed since the pod was created;
the last two with a Warning Event on the pod, so a stuck warm-up never holds training forever.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import kopf

from csi_driver import mountpods
from csi_driver.operator import manifests as m
from csi_driver.operator import usage as u
from csi_driver.operator.kube import Kube, KubeError
from csi_driver.operator.spec import (DEFAULT_GATE_TIMEOUT_S, POLICY_CRON, TIER_CLUSTER, TIER_NODE, DatasetSettings,
                                      SpecError, parse_spec)

# How often a Dataset's warm-up Jobs are read into its status: `kubectl get datasets` lags the Jobs by
# at most this; each tick is a few GETs per Job. Cron schedules have minute resolution, well within.
FOLLOW_INTERVAL_S = 15.0
# How often gated pods are checked against their Datasets: a pod waits at most this long after its
# Dataset turns Warm.
GATE_INTERVAL_S = 5.0
# How often a Dataset's mount pods are read into status.usage (csi_driver.operator.usage): one list
# and one small GET per node; the figures of a node lost between two reads are lost with it.
USAGE_INTERVAL_S = 30.0
# Where the CSI node plugins run mount pods (their --namespace; deploy/base's namespace).
DEFAULT_MOUNT_NAMESPACE = "cachefs"
FINALIZER = "cachefs.io/dataset-cleanup"
MAX_ERRORS = 20  # status.errors keeps the last 20 (the CRD's maxItems)
DEFAULT_IMAGE = "ghcr.io/cachefs/cachefs-csi:0.1.0"

log = logging.getLogger("cachefs.operator")


@dataclass(frozen=True)
class OperatorSettings:
    image: str = DEFAULT_IMAGE
    follow_interval_s: float = FOLLOW_INTERVAL_S
    gate_interval_s: float = GATE_INTERVAL_S
    usage_interval_s: float = USAGE_INTERVAL_S
    mount_namespace: str = DEFAULT_MOUNT_NAMESPACE
    prices: u.Prices = field(default_factory=u.Prices)  # a Dataset's spec.pricing overrides each price
    read_stats: u.StatsReader = u.read_stats
    now: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.timezone.utc)


@dataclass
class GatedPod:
    body: dict[str, Any]
    dataset: str
    created: dt.datetime | None


@dataclass
class OperatorState:
    """What the handlers share: the client, the settings, and what the watches noted."""

    kube: Kube
    settings: OperatorSettings = field(default_factory=OperatorSettings)
    gated: dict[tuple[str, str], GatedPod] = field(default_factory=dict)
    # (namespace, name) -> (warm, spec invalid, gate timeout)
    datasets: dict[tuple[str, str], tuple[bool, bool, int]] = field(default_factory=dict)
    # mount pod uid -> (its volume label, the pod, its daemon's last counters): ended pods not yet
    # counted by a collection of their volume (csi_driver.operator.usage, "A pod that ended")
    ended: dict[str, tuple[str, u.MountPod, dict[str, int]]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _stamp(when: dt.datetime) -> str:
    return when.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(text: Any) -> dt.datetime | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=dt.timezone.utc)


def _conditions(status: Mapping[str, Any], updates: list[dict[str, Any]]) -> list[dict[str, Any]]:
    kept = [c for c in status.get("conditions") or [] if c.get("type") not in {u["type"] for u in updates}]
    return sorted(kept + updates, key=lambda c: c["type"])


def _errors(status: Mapping[str, Any], new: list[str]) -> list[str]:
    return ([*(status.get("errors") or []), *new])[-MAX_ERRORS:]


# --------------------------------------------------------------------------------------- reconcile
def reconcile(body: Mapping[str, Any], status: Mapping[str, Any], patch: Any, state: OperatorState, *,
              start: bool) -> None:
    """Create what a Dataset needs; start a run when ``start`` (or none ran for this generation)."""
    meta = body["metadata"]
    generation = meta.get("generation")
    now = _stamp(state.settings.now())
    try:
        settings = parse_spec(body.get("spec") or {})
    except SpecError as exc:
        message = str(exc)
        log.warning("Dataset %s/%s: %s", meta["namespace"], meta["name"], message)
        patch.status["phase"] = "Failed"
        patch.status["observedGeneration"] = generation
        patch.status["errors"] = _errors(status, [message]) if message not in (status.get("errors") or []) \
            else list(status.get("errors") or [])
        patch.status["conditions"] = _conditions(status, [
            m.condition("Ready", False, "InvalidSpec", message, generation=generation, now=now,
                        previous=status.get("conditions") or []),
            m.condition("Warm", False, "InvalidSpec", "the spec is invalid: nothing was created", generation=generation,
                        now=now, previous=status.get("conditions") or [])])
        return
    # The claim first: if a claim of that name is someone else's, nothing else is created (a PV
    # pre-bound to it could be bound to it).
    claim, _ = state.kube.ensure(m.persistent_volume_claim(body, settings))
    patch.status["observedGeneration"] = generation
    if _taken("PersistentVolumeClaim", claim, meta["uid"], status, patch, generation, now):
        return
    # A claim created by an earlier release is bound to a volume of the earlier naming
    # (``cachefs-NS-NAME``): keep using it (its volumeName is immutable), or the claim and the PV
    # would part. Whose that volume is, is checked below like any other.
    bound = (claim.get("spec") or {}).get("volumeName") or None
    pv, _ = state.kube.ensure(m.persistent_volume(body, settings, bound))
    wanted = m.persistent_volume(body, settings, bound)["spec"]["csi"]["volumeAttributes"]
    have = ((pv.get("spec") or {}).get("csi") or {}).get("volumeAttributes") or {}
    if _taken("PersistentVolume", pv, meta["uid"], status, patch, generation, now):
        return
    patch.status["claimName"] = meta["name"]
    patch.status["volumeName"] = pv["metadata"]["name"]
    if dict(have) != dict(wanted):
        message = ("the volume's attributes cannot change (a PersistentVolume's CSI attributes are immutable): "
                   "delete the Dataset and create it again to change source, endpoint or cache options")
        patch.status["conditions"] = _conditions(status, [m.condition(
            "Ready", False, "VolumeChanged", message, generation=generation, now=now,
            previous=status.get("conditions") or [])])
        patch.status["errors"] = _errors(status, [message])
        return
    ready = m.condition("Ready", True, "Bound", f"claim {meta['name']} pre-bound to volume {pv['metadata']['name']}",
                        generation=generation, now=now, previous=status.get("conditions") or [])
    patch.status["conditions"] = _conditions(status, [ready])
    ran = (status.get("warmUp") or status.get("lastWarmUp") or {})
    if start or not ran or ran.get("generation") != generation:
        start_run(body, settings, status, patch, state, conditions=patch.status["conditions"])
    elif not status.get("phase") or status.get("phase") == "Failed":
        patch.status["phase"] = "Bound"


def _taken(kind: str, obj: Mapping[str, Any], uid: str, status: Mapping[str, Any], patch: Any,
           generation: int | None, now: str) -> bool:
    """Whether ``obj`` (found under the name the Dataset needs) is not the Dataset's; if so, say so."""
    if (obj["metadata"].get("labels") or {}).get(m.OWNER_UID_LABEL) == uid:
        return False
    message = f"{kind} {obj['metadata']['name']} exists already and is not this Dataset's: rename the Dataset"
    patch.status["phase"] = "Failed"
    patch.status["conditions"] = _conditions(status, [m.condition(
        "Ready", False, "NameTaken", message, generation=generation, now=now, previous=status.get("conditions") or [])])
    patch.status["errors"] = _errors(status, [message])
    return True


def start_run(body: Mapping[str, Any], settings: DatasetSettings, status: Mapping[str, Any], patch: Any,
              state: OperatorState, *, conditions: list[dict[str, Any]] | None = None) -> None:
    """Delete the previous run's Jobs and create this run's: one per target."""
    meta = body["metadata"]
    now_time = state.settings.now()
    now = _stamp(now_time)
    generation = meta.get("generation")
    previous = (status.get("warmUp") or {}).get("run") or (status.get("lastWarmUp") or {}).get("run") or 0
    run = int(previous) + 1
    for job in state.kube.list_jobs(meta["namespace"], m.labels(meta["uid"])):
        state.kube.delete("Job", job["metadata"]["name"], meta["namespace"])
    warm = settings.warm_up
    nodes: list[str | None] = [None] if warm.tier == TIER_CLUSTER else list(state.kube.list_nodes(warm.node_selector))
    base = conditions if conditions is not None else list(status.get("conditions") or [])
    if not nodes:
        message = f"no node matches spec.warmUp.target.nodeSelector {dict(warm.node_selector)}"
        patch.status["phase"] = "NotWarm"
        patch.status["conditions"] = _conditions({"conditions": base}, [m.condition(
            "Warm", False, "NoNodes", message, generation=generation, now=now, previous=base)])
        patch.status["errors"] = _errors(status, [message])
        patch.status["lastWarmUp"] = {"run": run, "startedAt": now, "finishedAt": now, "result": "Failed",
                                      "generation": generation}
        return
    jobs, tiers = [], []
    for node in nodes:
        job, _ = state.kube.ensure(m.warm_up_job(body, settings, run=run, image=state.settings.image, node=node))
        jobs.append(job["metadata"]["name"])
        tiers.append(m.tier_entry(job["metadata"]["name"], node, "Pending", None, warm.tier))
    log.info("Dataset %s/%s: warm-up run %d started (%d Jobs)", meta["namespace"], meta["name"], run, len(jobs))
    patch.status["phase"] = "WarmingUp"
    patch.status["warmUp"] = {"run": run, "startedAt": now, "jobs": jobs, "generation": generation}
    patch.status["tiers"] = tiers
    patch.status["conditions"] = _conditions({"conditions": base}, [m.condition(
        "Warm", False, "WarmingUp", f"warm-up run {run}: {len(jobs)} Job(s) running", generation=generation,
        now=now, previous=base)])


def _job_state(job: Mapping[str, Any] | None) -> str:
    if job is None:
        return "Missing"
    st = job.get("status") or {}
    for cond in st.get("conditions") or []:
        if cond.get("status") == "True" and cond.get("type") in ("Complete", "Failed"):
            return "Succeeded" if cond["type"] == "Complete" else "Failed"
    if st.get("succeeded"):
        return "Succeeded"
    return "Running" if st.get("active") or st.get("startTime") else "Pending"


def _never() -> bool:
    return False


def follow(body: Mapping[str, Any], status: Mapping[str, Any], patch: Any, state: OperatorState,
           stopping: Callable[[], bool] = _never) -> None:
    """One follow tick: progress of a running run into status, or a due scheduled run started. Once
    ``stopping()`` (the timer's ``stopped`` flag), it reads no further Job and writes nothing."""
    meta = body["metadata"]
    if status.get("phase") == "Failed":
        return
    run = status.get("warmUp")
    if not run:
        try:
            settings = parse_spec(body.get("spec") or {})
        except SpecError:
            return  # reconcile reports it
        cron = settings.warm_up.cron
        last = _parse_time((status.get("lastWarmUp") or {}).get("startedAt"))
        if settings.warm_up.policy == POLICY_CRON and cron is not None and last is not None \
                and cron.due(last, state.settings.now()):
            start_run(body, settings, status, patch, state)
        return
    previous = {t.get("job"): t for t in status.get("tiers") or []}
    tiers, states, docs = [], [], []
    for name in run.get("jobs") or []:
        if stopping():
            return  # the next operator's first tick reads them all
        job = state.kube.read_job(meta["namespace"], name)
        job_state = _job_state(job)
        log_text = state.kube.job_pod_log(meta["namespace"], name) if job is not None else None
        doc = m.last_document(log_text) if log_text else None
        old = previous.get(name, {})
        node = old.get("node") or ((job or {}).get("metadata", {}).get("annotations") or {}).get("cachefs.io/node") or None
        tier_kind = TIER_NODE if old.get("tier") == "disk" else TIER_CLUSTER
        entry = m.tier_entry(name, node, job_state, doc, tier_kind)
        if doc is None and "totalBytes" in old:  # keep the last figures seen (the pod may be gone)
            entry.update({k: old[k] for k in ("totalBytes", "cachedBytes", "cachedPercent", "filesTotal",
                                              "filesCached") if k in old})
        tiers.append(entry)
        states.append(job_state)
        docs.append(doc)
    patch.status["tiers"] = tiers
    patch.status.update(m.totals(tiers))
    if any(s in ("Pending", "Running") for s in states):
        return
    now = _stamp(state.settings.now())
    generation = meta.get("generation")
    errors = []
    for entry, doc in zip(tiers, docs):
        where = f"Job {entry['job']}" + (f" on node {entry['node']}" if entry.get("node") else "")
        if entry["state"] != "Succeeded":
            errors.append(f"warm-up {where}: {entry['state'].lower()}"
                          + (f": {doc['error']}" if doc and doc.get("error") else ""))
        elif doc is not None and not doc.get("ok", False):
            errors.append(f"warm-up {where}: {entry.get('cachedPercent', 0):.1f}% cached "
                          f"({doc.get('failures_count', 0)} failed, {doc.get('changed_count', 0)} changed)")
    warm = not errors and all(d is not None for d in docs)
    if not errors and not warm:
        errors.append(f"warm-up run {run.get('run')}: the Jobs succeeded but printed no progress document")
    message = (f"warm-up run {run.get('run')}: {m.totals(tiers).get('cached', '100.0%')} cached"
               if warm else "; ".join(errors))
    conditions = list(status.get("conditions") or [])
    patch.status["conditions"] = _conditions(status, [m.condition(
        "Warm", warm, "WarmedUp" if warm else "WarmUpIncomplete", message, generation=generation, now=now,
        previous=conditions)])
    patch.status["phase"] = "Warm" if warm else "NotWarm"
    patch.status["lastWarmUp"] = {"run": run.get("run"), "startedAt": run.get("startedAt"), "finishedAt": now,
                                  "result": "Succeeded" if warm else "Failed", "generation": run.get("generation")}
    patch.status["warmUp"] = None
    if errors:
        patch.status["errors"] = _errors(status, errors)
    log.info("Dataset %s/%s: warm-up run %s ended: %s", meta["namespace"], meta["name"], run.get("run"), message)


def collect_usage(body: Mapping[str, Any], status: Mapping[str, Any], patch: Any, state: OperatorState,
                  stopping: Callable[[], bool] = _never) -> None:
    """One usage tick: read the mount pods of the Dataset's volume, add their growth to status.usage.
    Once ``stopping()`` (the timer's ``stopped`` flag), it starts no further read and writes nothing:
    the daemons' counters only grow, so the next operator's first collection adds what this one
    would have."""
    volume = status.get("volumeName")
    if not volume:
        return  # no volume yet, so no mount pods
    try:
        settings = parse_spec(body.get("spec") or {})
    except SpecError:
        return  # reconcile reports it
    label = mountpods.volume_label(volume)
    selector = {mountpods.LABEL_APP: mountpods.APP, mountpods.LABEL_VOLUME: label}
    pods = [u.mount_pod(p) for p in state.kube.list_pods(state.settings.mount_namespace, selector)]
    if stopping():
        return
    with state.lock:
        ended = {uid: (pod, last) for uid, (of, pod, last) in state.ended.items() if of == label}
    listed = {p.uid for p in pods}
    previous = status.get("usage") or {}
    if not pods and not ended and not previous.get("daemons"):
        return  # nothing mounted it yet, nothing to forget
    read = u.collect(pods, state.settings.read_stats, stopping)
    if stopping():
        return  # some pods were not read for the stop, not for being unreachable
    for uid, (pod, last) in ended.items():  # an ended pod's last counters, listed still or gone already
        if uid not in listed:
            pods.append(pod)
        if read.get(uid) is None:
            read[uid] = last
    with state.lock:
        for uid in ended:
            state.ended.pop(uid, None)
    usage = u.accumulate(previous, pods, read, settings.prices(state.settings.prices), _stamp(state.settings.now()))
    if previous and all(usage.get(k) == previous.get(k) for k in ("totals", "unreachable", "estimatedCostAvoided")) \
            and [d["uid"] for d in usage["daemons"]] == [d.get("uid") for d in previous.get("daemons") or []]:
        return  # nothing moved: no write
    patch.status["usage"] = usage
    patch.status.update(u.display(usage, m.format_size))


def cleanup(body: Mapping[str, Any], state: OperatorState) -> None:
    """Delete the Jobs, the claim and the PersistentVolume of a Dataset (never the bucket's data)."""
    meta = body["metadata"]
    owned = m.labels(meta["uid"])
    for job in state.kube.list_jobs(meta["namespace"], owned):
        state.kube.delete("Job", job["metadata"]["name"], meta["namespace"])
    for claim in state.kube.list_pvcs(meta["namespace"], owned):  # never a claim of the same name not ours
        state.kube.delete("PersistentVolumeClaim", claim["metadata"]["name"], meta["namespace"])
    for pv in state.kube.list_pvs(owned):
        state.kube.delete("PersistentVolume", pv["metadata"]["name"])


# -------------------------------------------------------------------------------------------- gates
def note_dataset(body: Mapping[str, Any], event_type: str | None, state: OperatorState) -> None:
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    with state.lock:
        if event_type == "DELETED":
            state.datasets.pop(key, None)
            return
        st = body.get("status") or {}
        warm = any(c.get("type") == "Warm" and c.get("status") == "True" for c in st.get("conditions") or [])
        timeout = ((body.get("spec") or {}).get("gate") or {}).get("timeoutSeconds", DEFAULT_GATE_TIMEOUT_S)
        state.datasets[key] = (warm, st.get("phase") == "Failed", int(timeout) if isinstance(timeout, int) else
                               DEFAULT_GATE_TIMEOUT_S)


def note_mount_pod(body: Mapping[str, Any], state: OperatorState) -> None:
    """A mount pod changed or went: keep its daemon's last counters, if it ended and left them."""
    found = u.last_counters(body)
    label = ((body.get("metadata") or {}).get("labels") or {}).get(mountpods.LABEL_VOLUME)
    if found is None or not label:
        return
    pod, last = found
    with state.lock:
        state.ended[pod.uid] = (label, pod, last)


def note_pod(body: Mapping[str, Any], event_type: str | None, state: OperatorState) -> None:
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    gates = (body.get("spec") or {}).get("schedulingGates") or []
    dataset = (meta.get("labels") or {}).get(m.DATASET_LABEL)
    with state.lock:
        if event_type == "DELETED" or not dataset or not any(g.get("name") == m.GATE_NAME for g in gates):
            state.gated.pop(key, None)
        else:
            state.gated[key] = GatedPod(dict(body), dataset, _parse_time(meta.get("creationTimestamp")))


def release_due(state: OperatorState) -> list[tuple[str, str, str]]:
    """Release every gated pod that may go now; ``[(namespace, pod, reason)]`` of those released."""
    now = state.settings.now()
    with state.lock:
        pods = list(state.gated.items())
        datasets = dict(state.datasets)
    released = []
    for key, pod in pods:
        warm, invalid, timeout = datasets.get((key[0], pod.dataset), (False, False, DEFAULT_GATE_TIMEOUT_S))
        waited = (now - pod.created).total_seconds() if pod.created else 0.0
        if warm:
            reason, message, warning = "DatasetWarm", f"Dataset {pod.dataset} is warm: scheduling gate removed", False
        elif invalid:
            reason, warning = "DatasetInvalid", True
            message = f"Dataset {pod.dataset} has an invalid spec and will not warm: released cold"
        elif pod.created is None or waited >= timeout:
            reason, warning = "WarmUpTimeout", True
            message = (f"Dataset {pod.dataset} is not warm after {timeout} s (its gate timeout): released cold"
                       if (key[0], pod.dataset) in datasets else
                       f"no Dataset {pod.dataset} in this namespace after {timeout} s: released")
        else:
            continue
        gates = list((pod.body.get("spec") or {}).get("schedulingGates") or [])
        try:
            state.kube.remove_gate(key[0], key[1], gates, m.GATE_NAME)
        except KubeError as exc:
            log.warning("%s", exc)  # the pod changed meanwhile: the watch brings its new state
            continue
        with state.lock:
            state.gated.pop(key, None)
        try:
            state.kube.pod_event(pod.body, reason=reason, message=message, warning=warning, now=_stamp(now))
        except KubeError as exc:
            log.warning("%s", exc)
        released.append((key[0], key[1], reason))
    return released


async def gate_loop(state: OperatorState) -> None:
    """Check the gated pods every ``gate_interval_s`` until cancelled (at operator shutdown)."""
    while True:
        await asyncio.sleep(state.settings.gate_interval_s)
        try:
            for namespace, pod, reason in await asyncio.to_thread(release_due, state):
                log.info("pod %s/%s released (%s)", namespace, pod, reason)
        except Exception:  # a bug or an API outage must not end the loop: log it, try again next tick
            log.exception("releasing gated pods failed")


# ---------------------------------------------------------------------------------------- registry
def build_registry(state: OperatorState, *, login: Callable[..., Any] | None = None) -> kopf.OperatorRegistry:
    """Every handler of the operator, bound to ``state``, in a fresh registry."""
    registry = kopf.OperatorRegistry()
    res = (m.GROUP, m.VERSION, m.PLURAL)

    if login is not None:
        kopf.on.login(registry=registry)(login)

    @kopf.on.startup(registry=registry)
    async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        settings.persistence.finalizer = FINALIZER
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="cachefs.io")
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="cachefs.io")
        memo["gate_task"] = asyncio.create_task(gate_loop(state))

    @kopf.on.cleanup(registry=registry)
    async def stop(memo: kopf.Memo, **_: Any) -> None:
        state.kube.stop()  # a handler still running (kopf waits for it) asks nothing more
        task = memo.get("gate_task")
        if task is not None:
            task.cancel()

    @kopf.on.create(*res, registry=registry)
    def created(body: Any, status: Any, patch: Any, **_: Any) -> None:
        reconcile(body, status, patch, state, start=True)

    @kopf.on.update(*res, field="spec", registry=registry)
    def updated(body: Any, status: Any, patch: Any, **_: Any) -> None:
        reconcile(body, status, patch, state, start=True)

    @kopf.on.resume(*res, registry=registry)
    def resumed(body: Any, status: Any, patch: Any, **_: Any) -> None:
        reconcile(body, status, patch, state, start=False)

    @kopf.on.delete(*res, registry=registry)
    def deleted(body: Any, **_: Any) -> None:
        cleanup(body, state)

    # The timers run in kopf's threads, which kopf cannot interrupt: its stop waits for them. They
    # look at their ``stopped`` flag (set at once on the operator's stop, or when the Dataset goes)
    # between calls, and each call is bounded (csi_driver.operator.kube).
    @kopf.timer(*res, interval=state.settings.follow_interval_s, registry=registry)
    def followed(body: Any, status: Any, patch: Any, stopped: kopf.DaemonStopped | None = None, **_: Any) -> None:
        follow(body, status, patch, state, lambda: bool(stopped) or state.kube.stopping)

    @kopf.timer(*res, interval=state.settings.usage_interval_s, registry=registry)
    def usage(body: Any, status: Any, patch: Any, stopped: kopf.DaemonStopped | None = None, **_: Any) -> None:
        collect_usage(body, status, patch, state, lambda: bool(stopped) or state.kube.stopping)

    @kopf.on.event(*res, registry=registry)
    def dataset_seen(body: Any, type: str | None, **_: Any) -> None:
        note_dataset(body, type, state)

    @kopf.on.event("", "v1", "pods", labels={m.DATASET_LABEL: kopf.PRESENT}, registry=registry)
    def pod_seen(body: Any, type: str | None, **_: Any) -> None:
        note_pod(body, type, state)

    @kopf.on.event("", "v1", "pods", labels={mountpods.LABEL_APP: mountpods.APP}, registry=registry)
    def mount_pod_seen(body: Any, **_: Any) -> None:
        note_mount_pod(body, state)

    return registry
