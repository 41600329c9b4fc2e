"""The Dataset operator end to end on an API double: kopf's real reactor, watches and patches, against
kmock's stateful emulator (``OperatorApiServer``, tests/support/kubeapi.py) on 127.0.0.1.

The operator runs as ``kopf.operator(...)`` with its own registry and a login that points at the
double, on an event loop of its own in a thread (``running_operator``), as ``kopf.run`` runs it in its
pod: never on the test's loop, where the double is served. kopf's exit cancels every task of its loop
that it did not start itself; beside the double, those were the double's connections, and a client's
next request on one was never answered (a flaky test_dataset_usage.py: the operator's usage timer
waited out its request, and kopf's stop waited for the timer). The kubelet's and the Job controller's parts are
played by the tests: they create a Job's pod, give it a log of ``cachefs prefetch --json-progress``
lines, and set the Job's status; tests/fuse/test_dataset_warmup.py runs a Job's real command.

Every wait is bounded (``eventually``); nothing asserts on timings.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime as dt
import inspect
import json
import threading
from typing import Any, AsyncIterator, Callable

import kmock
import kopf
import pytest
from kubernetes import client

from csi_driver import attributes
from csi_driver.operator import manifests as m
from csi_driver.operator.handlers import OperatorSettings, OperatorState, build_registry
from csi_driver.operator.kube import JOB_NAME_LABEL, REQUEST_TIMEOUT_S as OPERATOR_REQUEST_TIMEOUT_S, Kube, KubeError
from csi_driver.operator.spec import parse_spec
from tests.support.kubeapi import OperatorApiServer

NS = "ml"
WAIT_S = 30.0
FAST = dict(follow_interval_s=0.3, gate_interval_s=0.2)
STOP_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 30
TEST_AGENT = "cachefs-tests"


@pytest.fixture
async def api() -> AsyncIterator[OperatorApiServer]:
    async with OperatorApiServer() as server, kmock.Server(server):
        yield server


class Cluster:
    """The test's side of the API: a kubernetes client on the double, called off the loop."""

    def __init__(self, api: OperatorApiServer) -> None:
        self.api = api
        self.client = client.ApiClient(client.Configuration(host=str(api.url).rstrip("/")))
        self.client.user_agent = TEST_AGENT  # the operator's writes are the others
        self.core = client.CoreV1Api(self.client)
        self.batch = client.BatchV1Api(self.client)
        self.custom = client.CustomObjectsApi(self.client)

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        # Bounded: a request left hanging would keep its thread, and the test process, alive.
        return await asyncio.to_thread(fn, *args, _request_timeout=REQUEST_TIMEOUT_S, **kwargs)

    def get(self, resource: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        for obj in self.all(resource):
            if obj["metadata"]["name"] == name and obj["metadata"].get("namespace") == namespace:
                return obj
        return None

    def all(self, resource: str) -> list[dict[str, Any]]:
        wanted = kmock.resource(resource)
        out = []
        for key in list(self.api.objects):
            obj = self.api.objects[key]
            if (key[0].group, key[0].version, key[0].plural) == (wanted.group, wanted.version, wanted.plural) \
                    and not obj.deleted:
                out.append(json.loads(json.dumps(obj.raw)))
        return out

    def dataset(self, name: str) -> dict[str, Any] | None:
        return self.get("cachefs.io/v1alpha1/datasets", NS, name)

    def status(self, name: str) -> dict[str, Any]:
        return (self.dataset(name) or {}).get("status") or {}

    async def create_dataset(self, name: str, spec: dict[str, Any]) -> None:
        body = {"apiVersion": "cachefs.io/v1alpha1", "kind": "Dataset", "metadata": {"name": name, "namespace": NS},
                "spec": spec}
        await self.call(self.custom.create_namespaced_custom_object, m.GROUP, m.VERSION, NS, m.PLURAL, body)

    async def create_gated_pod(self, name: str, dataset: str, *, created: dt.datetime | None = None) -> None:
        meta: dict[str, Any] = {"name": name, "namespace": NS, "labels": {m.DATASET_LABEL: dataset}}
        if created is not None:
            meta["creationTimestamp"] = created.strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {"metadata": meta, "spec": {"schedulingGates": [{"name": m.GATE_NAME}],
                                           "containers": [{"name": "trainer", "image": "trainer:1"}]}}
        await self.call(self.core.create_namespaced_pod, NS, body)

    def gates(self, pod: str) -> list[str]:
        body = self.get("v1/pods", NS, pod) or {}
        return [g["name"] for g in (body.get("spec") or {}).get("schedulingGates") or []]

    def events(self, pod: str) -> list[dict[str, Any]]:
        return [e for e in self.all("v1/events") if e.get("involvedObject", {}).get("name") == pod]

    def jobs(self) -> list[dict[str, Any]]:
        return self.all("batch/v1/jobs")

    async def start_pod(self, job: str, log: str) -> str:
        """The Job controller and kubelet: a pod for ``job`` that has printed ``log`` so far."""
        pod = f"{job}-x1"
        body = {"metadata": {"name": pod, "namespace": NS, "labels": {JOB_NAME_LABEL: job, "job-name": job}},
                "spec": {"containers": [{"name": m.CONTAINER, "image": "cachefs:1"}]}}
        await self.call(self.core.create_namespaced_pod, NS, body)
        self.api.logs[pod] = log
        await self.call(self.batch.patch_namespaced_job_status, job, NS,
                        {"status": {"active": 1, "startTime": "2026-01-01T00:00:00Z"}})
        return pod

    async def end_job(self, job: str, *, ok: bool) -> None:
        kind = "Complete" if ok else "Failed"
        status = {"active": 0, "succeeded" if ok else "failed": 1,
                  "conditions": [{"type": kind, "status": "True"}]}
        await self.call(self.batch.patch_namespaced_job_status, job, NS, {"status": status})


def progress_line(state: str, total: int, cached: int, *, ok: bool = True, error: str | None = None) -> str:
    doc = {"state": state, "ok": ok, "error": error, "bytes_total": total, "bytes_done": cached,
           "bytes_cached": cached, "files_total": 4, "files_cached": 4 * cached // max(total, 1),
           "failures_count": 0, "changed_count": 0, "tier": "cluster"}
    return json.dumps(doc, separators=(",", ":")) + "\n"


async def eventually(check: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
    """Poll ``check`` until it is truthy; fail naming ``what`` after ``timeout_s``. A ``check`` that
    returns an awaitable is awaited (one that waits on something else than the double, which is
    served on this loop, must do so off the loop)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not reached within {timeout_s:g} s: {what} (last: {value!r})")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def running_operator(api: OperatorApiServer, **settings: Any) -> AsyncIterator[OperatorState]:
    """The operator on an event loop of its own, in a thread (the module doc says why); stopped by its
    stop flag at the end, which it must obey within ``STOP_TIMEOUT_S``, as within a pod's grace."""
    url = str(api.url).rstrip("/")
    state = OperatorState(kube=Kube(client.Configuration(host=url)), settings=OperatorSettings(**{**FAST, **settings}))

    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=url, insecure=True)

    stop = threading.Event()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="cachefs-operator", daemon=True)
    thread.start()
    operator = asyncio.run_coroutine_threadsafe(
        kopf.operator(registry=build_registry(state, login=login), clusterwide=True, standalone=True, stop_flag=stop),
        loop)

    async def ended(timeout_s: float) -> bool:
        done, _ = await asyncio.to_thread(concurrent.futures.wait, [operator], timeout_s)
        return bool(done)

    try:
        yield state
        # The double prunes what the CRD does not declare, as the API server does: nothing the
        # operator writes may be lost that way (a pruned status.warmUp.generation once restarted
        # every warm-up at every operator restart).
        lost = [entry for entry in api.pruned if entry[3] != TEST_AGENT]
        assert not lost, f"the API server would drop fields the operator writes: {lost}"
    finally:
        stop.set()
        if not await ended(STOP_TIMEOUT_S):
            operator.cancel()  # its task is cancelled; a handler's thread goes on, reported here
            loop.call_soon_threadsafe(loop.stop)
            raise AssertionError(f"the operator did not stop within {STOP_TIMEOUT_S:g} s of its stop flag")
        with contextlib.suppress(concurrent.futures.TimeoutError):  # the threads of its default executor
            await asyncio.to_thread(asyncio.run_coroutine_threadsafe(loop.shutdown_default_executor(), loop).result,
                                    STOP_TIMEOUT_S)
        loop.call_soon_threadsafe(loop.stop)
        await asyncio.to_thread(thread.join, STOP_TIMEOUT_S)
        if not thread.is_alive():
            loop.close()
        operator.result()  # what the operator raised, if anything


CLUSTER_SPEC = {
    "source": "s3://training/imagenet",
    "endpointUrl": "http://127.0.0.1:9000",
    "secretRef": {"name": "s3-keys"},
    "cache": {"ramCache": "1GiB", "diskCache": "20GiB", "attrTtl": 3600},
    "clusterTier": {"cache": "s3://cachefs-cluster/", "endpointUrl": "http://cluster-store:8333"},
    "warmUp": {"paths": ["train", "val/"], "target": {"tier": "Cluster"}},
    "gate": {"timeoutSeconds": 3600},
}


# ------------------------------------------------------------------------------------ create, warm
async def test_create_warm_up_progress_and_gate_release(api: OperatorApiServer) -> None:
    k = Cluster(api)
    async with running_operator(api):
        await k.create_dataset("imagenet", CLUSTER_SPEC)
        await k.create_gated_pod("trainer-0", "imagenet")
        (job,) = await eventually(k.jobs, "the warm-up Job")
        pv = await eventually(lambda: k.get("v1/persistentvolumes", None, "cachefs-ml.imagenet"), "the PV")
        pvc = k.get("v1/persistentvolumeclaims", NS, "imagenet")

        # The volume is the driver's, read-only, retained, pre-bound both ways, and its attributes parse.
        assert pv["spec"]["csi"]["driver"] == "csi.cachefs.io"
        assert pv["spec"]["persistentVolumeReclaimPolicy"] == "Retain"
        assert pv["spec"]["claimRef"]["name"] == "imagenet" and pvc["spec"]["volumeName"] == pv["metadata"]["name"]
        assert pv["spec"]["csi"]["nodePublishSecretRef"] == {"name": "s3-keys", "namespace": NS}
        settings = attributes.parse_volume_attributes(pv["spec"]["csi"]["volumeAttributes"])
        assert settings.cache.cluster_cache == "s3://cachefs-cluster/" and settings.cache.attr_ttl_s == 3600
        assert pvc["metadata"]["ownerReferences"][0]["kind"] == "Dataset"

        command = job["spec"]["template"]["spec"]["containers"][0]["command"]
        assert command == ["cachefs", "prefetch", "/data", "/data/train", "/data/val", "--recursive",
                           "--tier", "cluster", "--json-progress"]
        name = job["metadata"]["name"]
        await eventually(lambda: k.status("imagenet").get("phase") == "WarmingUp", "phase WarmingUp")

        # Progress: the pod's last JSON line, into status (what `kubectl get datasets` prints).
        log = progress_line("resolving", 0, 0) + progress_line("running", 1000, 400)
        await k.start_pod(name, log)
        status = await eventually(lambda: (s := k.status("imagenet")).get("cachedPercent") == 40.0 and s,
                                  "40% in status")
        assert status["cached"] == "40.0%" and status["size"] == "1000 B" and status["phase"] == "WarmingUp"
        assert status["tiers"][0] | {"state": None} == {"tier": "cluster", "job": name, "state": None,
                                                        "totalBytes": 1000, "cachedBytes": 400,
                                                        "cachedPercent": 40.0, "filesTotal": 4, "filesCached": 1}
        assert k.gates("trainer-0") == [m.GATE_NAME]  # not warm, gate timeout an hour away: still held

        # The Job ends with everything cached: Warm, and the gated pod is released with a Normal Event.
        api.logs[f"{name}-x1"] = log + progress_line("done", 1000, 1000)
        await k.end_job(name, ok=True)
        status = await eventually(lambda: (s := k.status("imagenet")).get("phase") == "Warm" and s, "phase Warm")
        warm = next(c for c in status["conditions"] if c["type"] == "Warm")
        assert warm["status"] == "True" and "100.0% cached" in warm["message"]
        assert status["lastWarmUp"]["result"] == "Succeeded" and status["cachedBytes"] == 1000
        assert "warmUp" not in status
        await eventually(lambda: k.gates("trainer-0") == [], "the gate removed")
        (event,) = await eventually(lambda: k.events("trainer-0"), "an Event on the pod")
        assert event["reason"] == "DatasetWarm" and event["type"] == "Normal"


async def test_failed_warm_up_is_not_warm_and_says_why(api: OperatorApiServer) -> None:
    k = Cluster(api)
    async with running_operator(api):
        await k.create_dataset("ds", CLUSTER_SPEC)
        (job,) = await eventually(k.jobs, "the warm-up Job")
        name = job["metadata"]["name"]
        await k.start_pod(name, progress_line("failed", 1000, 100, ok=False, error="cluster tier is down"))
        await k.end_job(name, ok=False)
        status = await eventually(lambda: (s := k.status("ds")).get("phase") == "NotWarm" and s, "phase NotWarm")
        warm = next(c for c in status["conditions"] if c["type"] == "Warm")
        assert warm["status"] == "False" and "cluster tier is down" in warm["message"]
        assert status["lastWarmUp"]["result"] == "Failed" and status["cached"] == "10.0%"
        assert any(name in e for e in status["errors"])


# ------------------------------------------------------------------------------------------ gates
async def test_gate_timeout_releases_cold_with_a_warning_event(api: OperatorApiServer) -> None:
    k = Cluster(api)
    long_ago = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=2)
    async with running_operator(api):
        await k.create_dataset("slow", {**CLUSTER_SPEC, "gate": {"timeoutSeconds": 60}})
        await eventually(k.jobs, "the warm-up Job")  # the run never ends
        await k.create_gated_pod("recent", "slow")
        await k.create_gated_pod("old", "slow", created=long_ago)
        await k.create_gated_pod("orphan", "no-such-dataset", created=long_ago)
        await eventually(lambda: k.gates("old") == [] and k.gates("orphan") == [], "old pods released")
        await eventually(lambda: k.events("old") and k.events("orphan"), "an Event on each")
        reasons = {pod: [(e["reason"], e["type"]) for e in k.events(pod)] for pod in ("old", "orphan")}
        assert reasons == {"old": [("WarmUpTimeout", "Warning")], "orphan": [("WarmUpTimeout", "Warning")]}
        (orphan,) = k.events("orphan")
        assert "no Dataset no-such-dataset" in orphan["message"]
        assert k.gates("recent") == [m.GATE_NAME]  # created now, 60 s not passed


async def test_other_gates_are_kept(api: OperatorApiServer) -> None:
    k = Cluster(api)
    async with running_operator(api):
        body = {"metadata": {"name": "p", "namespace": NS, "labels": {m.DATASET_LABEL: "x"},
                             "creationTimestamp": "2020-01-01T00:00:00Z"},
                "spec": {"schedulingGates": [{"name": "example.com/quota"}, {"name": m.GATE_NAME}],
                         "containers": [{"name": "c", "image": "i"}]}}
        await k.call(k.core.create_namespaced_pod, NS, body)
        await eventually(lambda: k.gates("p") == ["example.com/quota"], "only our gate removed")


# --------------------------------------------------------------------------------------- schedule
async def test_cron_schedule_starts_a_new_run_when_due(api: OperatorApiServer) -> None:
    k = Cluster(api)
    clock = {"now": dt.datetime(2026, 3, 1, 2, 0, tzinfo=dt.timezone.utc)}
    spec = {**CLUSTER_SPEC, "warmUp": {"target": {"tier": "Cluster"},
                                       "schedule": {"policy": "Cron", "cron": "0 3 * * *"}}}
    async with running_operator(api, now=lambda: clock["now"]):
        await k.create_dataset("nightly", spec)
        (job,) = await eventually(k.jobs, "run 1")
        assert job["metadata"]["labels"][m.RUN_LABEL] == "1"
        assert job["spec"]["template"]["spec"]["containers"][0]["command"][3:] == ["--tier", "cluster",
                                                                                   "--json-progress"]
        await k.start_pod(job["metadata"]["name"], progress_line("done", 10, 10))
        await k.end_job(job["metadata"]["name"], ok=True)
        await eventually(lambda: k.status("nightly").get("phase") == "Warm", "run 1 done")
        clock["now"] = dt.datetime(2026, 3, 1, 2, 59, tzinfo=dt.timezone.utc)  # not due yet
        await asyncio.sleep(1.0)  # several follow ticks (0.3 s) at 02:59
        assert [j["metadata"]["labels"][m.RUN_LABEL] for j in k.jobs()] == ["1"]
        clock["now"] = dt.datetime(2026, 3, 1, 3, 0, 30, tzinfo=dt.timezone.utc)
        (job2,) = await eventually(lambda: [j for j in k.jobs() if j["metadata"]["labels"][m.RUN_LABEL] == "2"],
                                   "run 2 at 03:00")
        await eventually(lambda: len(k.jobs()) == 1, "run 1's Job deleted")
        status = await eventually(lambda: (s := k.status("nightly")).get("phase") == "WarmingUp" and s,
                                  "run 2 in status")
        assert status["warmUp"]["run"] == 2 and status["warmUp"]["jobs"] == [job2["metadata"]["name"]]
        assert status["lastWarmUp"]["run"] == 1  # the finished run stays on record


# ----------------------------------------------------------------------------------- delete, nodes
async def test_node_tier_warms_each_matching_node_and_delete_cleans_up(api: OperatorApiServer) -> None:
    k = Cluster(api)
    for node, labels in (("gpu-a", {"gpu": "true"}), ("gpu-b", {"gpu": "true"}), ("cpu-c", {})):
        await k.call(k.core.create_node, {"metadata": {"name": node, "labels": labels}})
    spec = {"source": "s3://training/imagenet",
            "warmUp": {"target": {"tier": "Node", "nodeSelector": {"gpu": "true"}}, "pin": True}}
    async with running_operator(api):
        await k.create_dataset("pinned", spec)
        jobs = await eventually(lambda: len(k.jobs()) == 2 and k.jobs(), "a Job per GPU node")
        nodes = sorted(j["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
                       ["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
                       ["matchFields"][0]["values"][0] for j in jobs)
        assert nodes == ["gpu-a", "gpu-b"]
        assert all("--pin" in j["spec"]["template"]["spec"]["containers"][0]["command"] for j in jobs)
        assert all("--tier" not in j["spec"]["template"]["spec"]["containers"][0]["command"] for j in jobs)
        status = await eventually(lambda: (s := k.status("pinned")).get("tiers") and s, "tiers in status")
        assert sorted(t["node"] for t in status["tiers"]) == ["gpu-a", "gpu-b"]

        await k.call(k.custom.delete_namespaced_custom_object, m.GROUP, m.VERSION, NS, m.PLURAL, "pinned")
        await eventually(lambda: k.dataset("pinned") is None, "the Dataset gone (finalizer removed)")
        assert k.jobs() == []
        assert k.get("v1/persistentvolumeclaims", NS, "pinned") is None
        assert k.all("v1/persistentvolumes") == []
        assert len(k.all("v1/nodes")) == 3


# ---------------------------------------------------------------------------------------- bad specs
@pytest.mark.parametrize("spec, message", [
    ({"source": "s3://training/x", "warmUp": {"target": {"tier": "Cluster"}}}, "needs spec.clusterTier"),
    ({"source": "s3://training/x", "warmUp": {"paths": ["../other"], "target": {"tier": "Node"}}},
     "leads outside the dataset"),
    ({"source": "s3://training/x", "warmUp": {"target": {"tier": "Node"},
                                              "schedule": {"policy": "Cron", "cron": "61 * * * *"}}},
     "cron schedule '61 * * * *' is not valid"),
])
async def test_bad_spec_creates_nothing_and_says_why(api: OperatorApiServer, spec: dict, message: str) -> None:
    k = Cluster(api)
    async with running_operator(api):
        await k.create_dataset("bad", spec)
        status = await eventually(lambda: (s := k.status("bad")).get("phase") == "Failed" and s, "phase Failed")
        ready = next(c for c in status["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "False" and ready["reason"] == "InvalidSpec" and message in ready["message"]
        assert "pw" not in json.dumps(status)  # a credential in a URL is never quoted back
        assert k.jobs() == [] and k.all("v1/persistentvolumes") == []
        assert k.all("v1/persistentvolumeclaims") == []
        # A gated pod of an invalid Dataset is released at once: it would never warm.
        await k.create_gated_pod("p", "bad")
        await eventually(lambda: k.gates("p") == [], "released")
        (event,) = await eventually(lambda: k.events("p"), "an Event on the pod")
        assert event["reason"] == "DatasetInvalid" and event["type"] == "Warning"


@pytest.mark.parametrize("spec, field", [
    ({"source": "file:///etc", "warmUp": {"target": {"tier": "Node"}}}, "spec.source"),
    ({"source": "s3://training/x", "endpointUrl": "http://user:pw@host"}, "spec.endpointUrl"),
    ({"source": "s3://training/x", "cache": {"maxFetches": 0}}, "spec.cache.maxFetches"),
    ({"source": "s3://training/x", "warmUp": {"target": {"tier": "Everywhere"}}}, "spec.warmUp.target.tier"),
])
async def test_a_spec_the_crd_schema_refuses_never_reaches_the_operator(api: OperatorApiServer, spec: dict,
                                                                        field: str) -> None:
    """The API server validates a Dataset against the CRD's schema before storing it: such a spec is
    refused at create (422 naming the field), and the operator's own checks of it (unit-tested in
    tests/unit/test_operator_units.py) only matter where a cluster runs an older or edited CRD."""
    k = Cluster(api)
    async with running_operator(api):
        with pytest.raises(client.ApiException) as refused:
            await k.create_dataset("bad", spec)
        assert refused.value.status == 422 and field in (refused.value.body or "")
        assert k.dataset("bad") is None and k.jobs() == []


async def test_the_crd_defaults_are_what_the_operator_assumes(api: OperatorApiServer) -> None:
    """Defaults the API server writes into a stored Dataset (the CRD's ``default``s) equal the
    operator's own for an absent field: the same spec means the same thing with or without them."""
    k = Cluster(api)
    async with running_operator(api):
        tier = {"cache": "s3://cluster-store/"}
        await k.create_dataset("ds", {"source": "s3://training/x", "clusterTier": tier,
                                      "warmUp": {"target": {}, "schedule": {}}})
        stored = k.dataset("ds")["spec"]
        assert stored["capacity"] == "1Ti" and "gate" not in stored  # an absent parent gets no defaults
        warm = stored["warmUp"]
        assert warm["target"]["tier"] == "Cluster" and warm["schedule"]["policy"] == "Once"
        assert warm["pin"] is False and warm["activeDeadlineSeconds"] == 86400
        parsed = parse_spec(stored)
        bare = parse_spec({"source": "s3://training/x", "clusterTier": tier, "warmUp": {}})
        assert parsed == bare


# -------------------------------------------------------------------------------- update, resume
async def test_spec_change_starts_a_new_run_and_a_volume_change_is_refused(api: OperatorApiServer) -> None:
    k = Cluster(api)
    async with running_operator(api):
        await k.create_dataset("ds", CLUSTER_SPEC)
        (job1,) = await eventually(k.jobs, "run 1")
        patch = {"spec": {"warmUp": {"paths": ["train"], "target": {"tier": "Cluster"}}}}
        await k.call(k.custom.patch_namespaced_custom_object, m.GROUP, m.VERSION, NS, m.PLURAL, "ds", patch)
        (job2,) = await eventually(lambda: [j for j in k.jobs() if j["metadata"]["labels"][m.RUN_LABEL] == "2"],
                                   "run 2 after the change")
        assert job2["spec"]["template"]["spec"]["containers"][0]["command"][3:5] == ["/data/train", "--recursive"]
        await eventually(lambda: len(k.jobs()) == 1, "run 1's Job deleted")
        run = await eventually(lambda: (k.status("ds").get("warmUp") or {}).get("run") == 2 and k.status("ds")["warmUp"],
                               "run 2 in status")
        assert run["generation"] == 2 and run["jobs"] == [job2["metadata"]["name"]]

        # The PV's CSI attributes are immutable: a new cache size is reported, not half-applied.
        patch = {"spec": {"cache": {"ramCache": "2GiB"}}}
        await k.call(k.custom.patch_namespaced_custom_object, m.GROUP, m.VERSION, NS, m.PLURAL, "ds", patch)
        ready = await eventually(lambda: next((c for c in k.status("ds").get("conditions", [])
                                               if c["type"] == "Ready" and c["reason"] == "VolumeChanged"), None),
                                 "Ready False: VolumeChanged")
        assert ready["status"] == "False" and "delete the Dataset and create it again" in ready["message"]
        pv = k.get("v1/persistentvolumes", None, "cachefs-ml.ds")
        assert pv["spec"]["csi"]["volumeAttributes"]["ramCache"] == "1GiB"


async def test_a_restarted_operator_resumes_without_a_new_run(api: OperatorApiServer) -> None:
    k = Cluster(api)
    async with running_operator(api):
        await k.create_dataset("ds", CLUSTER_SPEC)
        await eventually(lambda: k.status("ds").get("warmUp"), "run 1 recorded in status")
    async with running_operator(api) as state:
        await eventually(lambda: ("ml", "ds") in state.datasets, "the restarted operator saw the Dataset")
        await asyncio.sleep(1.0)  # several follow ticks
        assert [j["metadata"]["labels"][m.RUN_LABEL] for j in k.jobs()] == ["1"]
        assert k.status("ds")["warmUp"]["run"] == 1


async def test_the_warm_up_image_is_the_operators_own(api: OperatorApiServer) -> None:
    from csi_driver.operator.handlers import DEFAULT_IMAGE
    from csi_driver.operator.main import build_parser, warm_up_image

    k = Cluster(api)
    await k.call(k.core.create_namespaced_pod, "cachefs", {
        "metadata": {"name": "cachefs-operator-abc", "namespace": "cachefs"},
        "spec": {"containers": [{"name": "operator", "image": "registry.example.com/cachefs-csi:9"}]}})
    kube = Kube(k.client.configuration, user_agent=TEST_AGENT)
    env = {"POD_NAME": "cachefs-operator-abc", "POD_NAMESPACE": "cachefs"}
    assert await asyncio.to_thread(warm_up_image, kube, None, env) == "registry.example.com/cachefs-csi:9"
    assert await asyncio.to_thread(warm_up_image, kube, "mine:1", env) == "mine:1"
    assert await asyncio.to_thread(warm_up_image, kube, None, {}) == DEFAULT_IMAGE

    def exit_message(environ: dict[str, str]) -> str:  # SystemExit must not cross into the event loop
        try:
            warm_up_image(kube, None, environ)
        except SystemExit as exc:
            return str(exc)
        return ""

    message = await asyncio.to_thread(exit_message, {"POD_NAME": "gone", "POD_NAMESPACE": "cachefs"})
    assert "cannot read pod cachefs/gone: HTTP 404" in message
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--follow-interval", "0"])


async def test_a_claim_of_the_same_name_is_not_taken_over(api: OperatorApiServer) -> None:
    k = Cluster(api)
    await k.call(k.core.create_namespaced_persistent_volume_claim, NS, {
        "metadata": {"name": "taken", "namespace": NS},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}})
    async with running_operator(api):
        await k.create_dataset("taken", CLUSTER_SPEC)
        status = await eventually(lambda: (s := k.status("taken")).get("phase") == "Failed" and s, "phase Failed")
        ready = next(c for c in status["conditions"] if c["type"] == "Ready")
        assert ready["reason"] == "NameTaken" and "PersistentVolumeClaim taken" in ready["message"]
        assert k.jobs() == [] and k.all("v1/persistentvolumes") == []  # nothing could bind to their claim
        await k.call(k.custom.delete_namespaced_custom_object, m.GROUP, m.VERSION, NS, m.PLURAL, "taken")
        await eventually(lambda: k.dataset("taken") is None, "the Dataset deleted")
        claim = k.get("v1/persistentvolumeclaims", NS, "taken")
        assert claim is not None and "labels" not in claim["metadata"]  # theirs: left as it was


async def test_datasets_of_two_namespaces_never_share_a_volume_name(api: OperatorApiServer) -> None:
    """``team-a/data`` and ``team/a-data``: one name with '-' between namespace and name, so the second
    Dataset failed with NameTaken (issue 34). Each gets its own PersistentVolume now."""
    k = Cluster(api)
    spec = {key: value for key, value in CLUSTER_SPEC.items() if key != "warmUp"}
    async with running_operator(api):
        for namespace, name in (("team-a", "data"), ("team", "a-data")):
            body = {"apiVersion": "cachefs.io/v1alpha1", "kind": "Dataset",
                    "metadata": {"name": name, "namespace": namespace}, "spec": spec}
            await k.call(k.custom.create_namespaced_custom_object, m.GROUP, m.VERSION, namespace, m.PLURAL, body)

        def bound(namespace: str, name: str) -> str | None:
            status = (k.get("cachefs.io/v1alpha1/datasets", namespace, name) or {}).get("status") or {}
            assert status.get("phase") != "Failed", status
            return status.get("volumeName")

        first = await eventually(lambda: bound("team-a", "data"), "team-a/data bound")
        second = await eventually(lambda: bound("team", "a-data"), "team/a-data bound")
        assert first != second
        claims = {(c["metadata"]["namespace"], c["spec"]["volumeName"]) for c in k.all("v1/persistentvolumeclaims")}
        assert claims == {("team-a", first), ("team", second)}
        refs = {(pv["spec"]["claimRef"]["namespace"], pv["metadata"]["name"]) for pv in k.all("v1/persistentvolumes")}
        assert refs == {("team-a", first), ("team", second)}


async def test_a_warm_dataset_stays_warm_across_an_operator_restart(api: OperatorApiServer) -> None:
    """On the pruning double: what the operator stores to remember a finished run survives the API server."""
    k = Cluster(api)
    async with running_operator(api):
        await k.create_dataset("ds", CLUSTER_SPEC)
        (job,) = await eventually(k.jobs, "run 1")
        await k.start_pod(job["metadata"]["name"], progress_line("done", 10, 10))
        await k.end_job(job["metadata"]["name"], ok=True)
        await eventually(lambda: k.status("ds").get("phase") == "Warm", "Warm")
    assert k.status("ds")["lastWarmUp"]["generation"] == 1  # stored, not pruned
    async with running_operator(api) as state:
        await eventually(lambda: ("ml", "ds") in state.datasets, "the restarted operator saw the Dataset")
        await k.create_gated_pod("late", "ds")
        await eventually(lambda: k.gates("late") == [], "a pod gated after the restart released: still Warm")
        await asyncio.sleep(1.0)  # several follow ticks (0.3 s)
        assert k.status("ds")["phase"] == "Warm"  # not WarmingUp again
        assert [j["metadata"]["labels"][m.RUN_LABEL] for j in k.jobs()] == ["1"]  # no new run


async def test_an_undeclared_field_is_refused_by_kubectl_and_dropped_by_other_writers(api: OperatorApiServer) -> None:
    """The CRD declares every spec field: kubectl (strict field validation) refuses a misspelt one
    naming it; a client without it loses the field, as on a real API server."""
    k = Cluster(api)
    body = {"apiVersion": "cachefs.io/v1alpha1", "kind": "Dataset", "metadata": {"name": "typo", "namespace": NS},
            "spec": {"source": "s3://training/x", "cache": {"ramcache": "1GiB"}}}
    with pytest.raises(client.ApiException) as info:
        await k.call(k.custom.create_namespaced_custom_object, m.GROUP, m.VERSION, NS, m.PLURAL, body,
                     field_validation="Strict")
    assert info.value.status == 400
    assert 'unknown field "spec.cache.ramcache"' in json.loads(info.value.body)["message"]
    await k.call(k.custom.create_namespaced_custom_object, m.GROUP, m.VERSION, NS, m.PLURAL, body)
    assert k.dataset("typo")["spec"]["cache"] == {}
    assert api.pruned[-1][:3] == ("datasets", "typo", ["spec.cache.ramcache"])


# ------------------------------------------------------------------------------------------ stopping
def hang_mount_pod_lists(api: OperatorApiServer) -> tuple[list[str], asyncio.Event]:
    """Make the double leave every list of pods in the mount namespace unanswered until the event is
    set (an API server that accepted the connection and is stuck); the list holds the path of each."""
    asked: list[str] = []
    release = asyncio.Event()

    async def stuck(request: Any) -> Any:
        asked.append(str(request.url))
        await release.wait()
        return kmock.KubernetesError(status=503, reason="ServiceUnavailable", message="released", details={})

    api[api.action.LIST, api.resource("v1/pods"), api.namespace("cachefs")] << stuck
    return asked, release


async def test_the_api_double_answers_a_connection_of_before_an_operator_stopped(api: OperatorApiServer) -> None:
    """A real API server never notices a client's exit. kopf's exit cancels every task of its event loop
    that it did not start itself: the double must not be on that loop (running_operator), or a
    connection opened while the operator ran is never answered again (kept alive, its server task
    gone), and the next request a client sends on it waits out its timeout."""
    configuration = client.Configuration(host=str(api.url).rstrip("/"))
    configuration.retries = False  # one attempt: a request left unanswered fails, not retried elsewhere
    api_client = client.ApiClient(configuration)
    core = client.CoreV1Api(api_client)
    async with running_operator(api):
        await asyncio.to_thread(core.list_namespaced_pod, NS, _request_timeout=REQUEST_TIMEOUT_S)
    pods = await asyncio.to_thread(core.list_namespaced_pod, NS, _request_timeout=REQUEST_TIMEOUT_S)
    assert pods.items == []
    pool = api_client.rest_client.pool_manager.connection_from_url(configuration.host)
    assert pool.num_connections == 1  # both requests went over the connection opened while kopf ran


async def test_an_operator_call_is_one_bounded_attempt_and_none_once_stopping(api: OperatorApiServer) -> None:
    """Each call of the operator's client is one attempt bounded by its timeout (urllib3 would retry a
    GET 3 times, each with the whole timeout), and a stopping operator asks nothing more."""
    asked, release = hang_mount_pod_lists(api)
    kube = Kube(client.Configuration(host=str(api.url).rstrip("/")), timeout_s=1.0)
    try:
        unanswered = r"^cannot list pods in cachefs: no answer from the API server \(one attempt, 1 s at most\): Read"
        with pytest.raises(KubeError, match=unanswered):
            await asyncio.to_thread(kube.list_pods, "cachefs", {"app": "cachefs-mount"})
        assert len(asked) == 1, asked
        kube.stop()
        with pytest.raises(KubeError, match=r"^cannot list nodes: not asked, the operator is stopping$"):
            await asyncio.to_thread(kube.list_nodes, {})
        assert not [r for r in list(api) if r.resource is not None and r.resource.plural == "nodes"]
    finally:
        release.set()


async def test_the_operator_stops_within_its_grace_while_the_api_server_does_not_answer(
        api: OperatorApiServer) -> None:
    """The usage timer's list of mount pods is left unanswered, and the operator is stopped meanwhile:
    kopf waits for the timer's thread, which must end within one call's timeout (no retries, no new
    call), so the operator stops inside the 30 s a pod gets between SIGTERM and SIGKILL (once it
    took four 30 s timeouts, and the stop with them)."""
    assert OPERATOR_REQUEST_TIMEOUT_S < STOP_TIMEOUT_S
    k = Cluster(api)
    asked, release = hang_mount_pod_lists(api)
    try:
        async with running_operator(api, usage_interval_s=0.3):
            await k.create_dataset("ds", CLUSTER_SPEC)
            await eventually(lambda: asked, "the usage timer's list of mount pods asked")
        # running_operator fails unless the operator stopped within STOP_TIMEOUT_S of its stop flag.
        assert len(asked) == 1, asked  # asked once: not again by the HTTP library, nor after the stop
    finally:
        release.set()
