"""What a Dataset saved, end to end (issue 26): the operator (kopf's reactor, on the API double) reads
real cachefs daemons in mount pods run by the kubelet stand-in, on two nodes, over SeaweedFS with
the cluster tier.

The node plugin's own mounter (``HandoverMounter`` over ``PodLauncher``, one per node) mounts the
Dataset's PersistentVolume as NodeStage would: it mounts FUSE, creates the mount pod through the API
(labels of the volume, ``--stats-addr $(POD_IP):9750``, the ``stats`` port) and hands the fd over;
the kubelet stand-in gives each pod its own IP, expands ``$(POD_IP)`` and runs the daemon. (The gRPC
layer around it is tested in test_mount_pods.py.)

Node A reads the dataset cold (from the source), node B reads it from the cluster tier; the
Dataset's status must match the two daemons' counters exactly. Then, with the operator stopped,
B's daemon ends (its counters gone, its pod ended): the restarted operator keeps B's share.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import pytest
import yaml
from kmock._internal import enums
from kubernetes import client

from cachefs import mounts
from csi_driver import mountpods
from csi_driver.attributes import Credentials, parse_volume_attributes
from csi_driver.handover import HandoverMounter
from csi_driver.mounter import MountRequest
from csi_driver.mountpods import MountPodSettings, PodLauncher
from csi_driver.operator.usage import COUNTERS, counters, read_stats
from tests.conftest import unique_bucket_name
from tests.csi.conftest import driver_environ
from tests.support.clusterkeys import write_key_file
from tests.csi.test_operator import Cluster, eventually, running_operator
from tests.support.kubeapi import OperatorApiServer
from tests.support.kubelet import Kubelet
from tests.support.s3servers import SeaweedS3

pytestmark = [pytest.mark.fuse, pytest.mark.s3]

KiB = 1024
BLOCK = 128 * KiB
FILES = {f"train/part-{i}.bin": random.Random(i).randbytes(2 * BLOCK + 999 * i) for i in range(3)}
MOUNT_NS = "cachefs"
FAST = dict(follow_interval_s=0.3, gate_interval_s=0.2, usage_interval_s=0.3)
WAIT_S = 60.0
TEST_AGENT = "test-harness"
RBAC = Path(__file__).resolve().parents[2] / "deploy" / "components" / "datasets" / "rbac.yaml"


@pytest.fixture
def workdir() -> Iterator[Path]:
    """Short paths: a mount's control socket lives under its mountpoint's runtime directory."""
    path = Path(tempfile.mkdtemp(prefix="usage-", dir="/tmp"))
    try:
        yield path
    finally:
        for mnt in path.glob("mnt-*"):  # a test that failed half-way: never leave a mount behind
            detach(mnt)
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def api() -> AsyncIterator[OperatorApiServer]:
    import kmock

    async with OperatorApiServer() as server, kmock.Server(server):
        yield server


def node_mounter(k: Cluster, node: str, workdir: Path) -> HandoverMounter:
    """The node plugin's mounter in pod mode on ``node``: mount pods through the API double."""
    api = client.ApiClient(client.Configuration(host=k.client.configuration.host))
    api.user_agent = mountpods.USER_AGENT
    launcher = PodLauncher(MountPodSettings(namespace=MOUNT_NS, node_name=node, image="cachefs:test"), api)
    return HandoverMounter(launcher, workdir / f"run-{node}", command=[sys.executable, "-m", "cachefs"],
                           environ=driver_environ())


def mount_request(k: Cluster, volume: str, node: str, workdir: Path, seaweed: SeaweedS3) -> MountRequest:
    """What NodeStage would mount for the Dataset's PersistentVolume on ``node``."""
    pv = k.get("v1/persistentvolumes", None, volume)
    assert pv is not None
    vol = parse_volume_attributes(pv["spec"]["csi"]["volumeAttributes"])
    target, cache = workdir / f"mnt-{node}", workdir / f"cache-{node}"
    target.mkdir(exist_ok=True)
    return MountRequest(source=vol.source, target=target, cache_dir=cache, endpoint_url=vol.endpoint_url,
                        cache=vol.cache, read_only=True, volume_id=volume,
                        credentials=Credentials(seaweed.access_key, seaweed.secret_key))


def detach(target: Path) -> None:
    if mounts.find_mount(target) is not None:
        subprocess.run(["fusermount3", "-u", "-z", str(target)], capture_output=True, timeout=30)


def stats_pod(k: Cluster, node: str) -> dict[str, Any]:
    (pod,) = [p for p in k.all("v1/pods") if p["metadata"].get("namespace") == MOUNT_NS
              and p["spec"].get("nodeName") == node and p.get("status", {}).get("phase") == "Running"]
    return pod


async def stats_of(k: Cluster, node: str) -> dict[str, Any]:
    """The /stats of the mount pod on ``node``, read as the operator reads it; off the loop, which
    serves the API double (a read that waits must not hold up the double's answers)."""
    pod = stats_pod(k, node)
    doc = await asyncio.to_thread(read_stats, f"{pod['status']['podIP']}:{mountpods.STATS_PORT}")
    assert doc is not None, f"the mount pod on {node} does not answer"
    return dict(doc)


async def daemon_counters(k: Cluster, node: str) -> dict[str, int]:
    got = counters(await stats_of(k, node))
    assert got is not None
    return got


def operator_rbac() -> set[tuple[str, str]]:
    """(verb, resource) pairs granted by deploy/components/datasets/rbac.yaml (ClusterRole and Role)."""
    granted = set()
    for doc in yaml.safe_load_all(RBAC.read_text()):
        if doc["kind"] in ("ClusterRole", "Role"):
            granted |= {(verb, resource) for rule in doc["rules"] for resource in rule["resources"]
                        for verb in rule["verbs"]}
    return granted


def operator_calls(api: OperatorApiServer) -> set[tuple[str, str]]:
    """(verb, resource) of every request not made by the test, the node plugin or the kubelet stand-in,
    in the verbs RBAC names."""
    found = set()
    for request in list(api):
        agent = request.headers.get("User-Agent", "")
        if request.resource is None or not request.resource.plural:
            continue  # discovery: not a resource RBAC rules name
        if agent.startswith((TEST_AGENT, mountpods.USER_AGENT)):
            continue
        method = request.method.value
        if method == "GET":
            verb = "watch" if request.action == enums.action.WATCH else "get" if request.name else "list"
        else:
            verb = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}[method]
        found.add((verb, request.resource.plural + (f"/{request.subresource}" if request.subresource else "")))
    return found


async def read_all(mnt: Path) -> dict[str, bytes]:
    return {key: await asyncio.to_thread((mnt / key).read_bytes) for key in FILES}


async def test_the_status_adds_up_what_every_mount_pod_served_through_restarts(
        api: OperatorApiServer, seaweed: SeaweedS3, workdir: Path) -> None:
    bucket, shared = unique_bucket_name("usage"), unique_bucket_name("shared")
    seaweed.make_bucket(bucket)
    seaweed.make_bucket(shared)
    seaweed.put_many(bucket, FILES.items())
    k = Cluster(api)
    k.client.user_agent = TEST_AGENT  # the kubelet stand-in and the test's own calls
    # The cluster key, as the driver's Secret gives it to mount pods of clustered volumes (issue 34);
    # outside /tmp, which a mount pod sees as its own emptyDir.
    key_dir = Path(tempfile.mkdtemp(prefix="cachefs-usage-key-", dir="/var/tmp"))
    base_env = {**driver_environ(), "AWS_ENDPOINT_URL": seaweed.endpoint_url,
                "CACHEFS_CLUSTER_KEY_FILE": str(write_key_file(key_dir))}
    nodes = ("node-a", "node-b")
    kubelets = [Kubelet(k.core, node, MOUNT_NS, workdir / f"kubelet-{node}", base_env).start() for node in nodes]
    mounters = {node: node_mounter(k, node, workdir) for node in nodes}
    requests: dict[str, MountRequest] = {}
    spec = {"source": f"s3://{bucket}", "endpointUrl": seaweed.endpoint_url,
            "cache": {"blockSize": f"{BLOCK // KiB}KiB", "readahead": "0"},
            "clusterTier": {"cache": f"s3://{shared}/blocks/", "endpointUrl": seaweed.endpoint_url},
            "warmUp": {"target": {"tier": "Node"}}, "pricing": {"egressPerGB": 0.09, "requestsPerThousand": 0.4}}
    size = sum(len(d) for d in FILES.values())

    def usage_is(totals: dict[str, int]) -> dict[str, Any] | None:
        usage = k.status("imagenet").get("usage") or {}
        return usage if usage.get("totals") == totals else None

    try:
        async with running_operator(api, **FAST):
            await k.create_dataset("imagenet", spec)
            volume = await eventually(lambda: k.status("imagenet").get("volumeName"), "the Dataset's volume")
            for node in nodes:
                requests[node] = mount_request(k, volume, node, workdir, seaweed)
                await asyncio.to_thread(mounters[node].mount, requests[node])
            assert await read_all(requests["node-a"].target) == FILES  # cold: from the source
            async def a_written() -> bool:
                return bool((await stats_of(k, "node-a"))["cluster"]["write_behind"]["depth"] == 0)

            await eventually(a_written, "node A's blocks written to the cluster tier", WAIT_S)
            assert await read_all(requests["node-b"].target) == FILES  # from the cluster tier
            a, b = await daemon_counters(k, "node-a"), await daemon_counters(k, "node-b")
            assert a["sourceBytes"] == size and b["clusterBytes"] == size and b["sourceBytes"] == 0
            expected = {name: a[name] + b[name] for name in COUNTERS}
            usage = await eventually(lambda: usage_is(expected), "status.usage matching the daemons", WAIT_S)
            assert usage["sourceBytesAvoided"] == size and usage["readBytes"] == 2 * size
            assert usage["clusterHitRatio"] == 0.5 and usage["sourceHitRatio"] == 0.5 and usage["localHitRatio"] == 0
            assert usage["sourceRequestsAvoided"] == b["clusterReads"] > 0
            assert usage["estimatedCostAvoided"]["amount"] == pytest.approx(
                size / (1 << 30) * 0.09 + b["clusterReads"] / 1000 * 0.4, abs=1e-6)
            assert {d["node"] for d in usage["daemons"]} == set(nodes) and usage["unreachable"] == 0
            status = k.status("imagenet")
            assert status["hitRatio"] == "50.0%" and status["saved"] == f"{size / KiB:.1f} KiB"

        # While the operator is down, B's daemon ends with its counters (its stats unreachable). A new
        # operator must keep what B served: the totals live in the status only, and B's last-seen
        # counters stay there for when it answers again.
        b_pod = stats_pod(k, "node-b")
        b_address = f"{b_pod['status']['podIP']}:{mountpods.STATS_PORT}"
        # The mount pod's container dies (SIGKILL): a lazy unmount of the target would not end the
        # daemon, since the stand-in runs it in a mount namespace of its own (as a runtime does) that
        # still holds the mount.
        kubelets[nodes.index("node-b")].kill(b_pod["metadata"]["name"])
        async def b_gone() -> bool:
            return await asyncio.to_thread(read_stats, b_address) is None

        await eventually(b_gone, "B's daemon gone", WAIT_S)
        assert await read_all(requests["node-a"].target) == FILES  # served by A's page cache or RAM
        a2 = await daemon_counters(k, "node-a")
        later = {name: expected[name] + a2[name] - a[name] for name in COUNTERS}
        async with running_operator(api, **FAST):
            def b_unreachable() -> dict[str, Any] | None:
                usage = usage_is(later)
                return usage if usage and usage["unreachable"] == 1 else None

            usage = await eventually(b_unreachable, "totals kept with B unreachable", WAIT_S)
        assert usage["sourceBytesAvoided"] >= size and usage["clusterHitRatio"] > 0
        assert {d["node"] for d in usage["daemons"]} == set(nodes)  # B's last counters, kept
        # Every call the operator made is granted by its RBAC; reading the mount pods is one of them.
        calls = operator_calls(api)
        assert ("list", "pods") in calls
        assert calls <= operator_rbac(), f"not granted by {RBAC.name}: {sorted(calls - operator_rbac())}"
    finally:
        # The kubelets first (off the loop: the API double they call is served on this loop): they
        # end the daemons; then the mounts, lazily detached (an unstage through the API double would
        # wait out its slow answers for deleted pods).
        for kubelet in kubelets:
            await asyncio.to_thread(kubelet.stop)
        for request in requests.values():
            await asyncio.to_thread(detach, request.target)
        shutil.rmtree(key_dir, ignore_errors=True)


async def test_a_mount_pod_that_comes_and_goes_between_two_collections_is_counted(
        api: OperatorApiServer, seaweed: SeaweedS3, workdir: Path) -> None:
    """Issue 36: a trainer's mount pod came and went between two reads of the mount pods and was never
    counted. Here no collection ever reads the pod's /stats (the operator's reader answers nothing, as
    for a pod that is gone before the next collection): what it served reaches the status only through
    its daemon's last counters, written as its termination message when the node plugin stops it."""
    bucket = unique_bucket_name("brief")
    seaweed.make_bucket(bucket)
    seaweed.put_many(bucket, FILES.items())
    k = Cluster(api)
    k.client.user_agent = TEST_AGENT
    kubelet = Kubelet(k.core, "node-a", MOUNT_NS, workdir / "kubelet-node-a",
                      {**driver_environ(), "AWS_ENDPOINT_URL": seaweed.endpoint_url}).start()
    mounter = node_mounter(k, "node-a", workdir)
    request = None
    size = sum(len(d) for d in FILES.values())
    spec = {"source": f"s3://{bucket}", "endpointUrl": seaweed.endpoint_url,
            "cache": {"blockSize": f"{BLOCK // KiB}KiB", "readahead": "0"}, "warmUp": {"target": {"tier": "Node"}}}
    try:
        async with running_operator(api, **FAST, read_stats=lambda address: None):
            await k.create_dataset("trainer", spec)
            volume = await eventually(lambda: k.status("trainer").get("volumeName"), "the Dataset's volume")
            request = mount_request(k, volume, "node-a", workdir, seaweed)
            await asyncio.to_thread(mounter.mount, request)
            assert await read_all(request.target) == FILES  # cold: every byte from the source
            await asyncio.to_thread(mounter.unmount, request.target)  # unstage: the pod is stopped and deleted
            await eventually(lambda: not [p for p in k.all("v1/pods") if p["metadata"].get("namespace") == MOUNT_NS],
                             "the mount pod gone", WAIT_S)

            def counted() -> dict[str, Any] | None:
                usage = k.status("trainer").get("usage") or {}
                return usage if (usage.get("totals") or {}).get("sourceBytes") == size else None

            usage = await eventually(counted, "the ended pod's reads in status.usage", WAIT_S)
        assert usage["readBytes"] == size and usage["totals"]["sourceReads"] > 0
        assert ("watch", "pods") in operator_calls(api) and operator_calls(api) <= operator_rbac()
    finally:
        await asyncio.to_thread(kubelet.stop)
        if request is not None:
            await asyncio.to_thread(detach, request.target)
