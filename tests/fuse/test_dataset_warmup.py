"""A Dataset warmed for real: the operator on the API double, its warm-up Job's command run as a local
process against a real cachefs mount over SeaweedFS, a gated pod released when the data is warm.

``Kubelet`` plays the node: for each warm-up Job the operator creates, it mounts the Job's claim the
way the CSI node plugin would (the bound PersistentVolume's volume attributes, parsed by the driver's
own parser, become ``cachefs mount`` options; the SeaweedFS keys stand in for the Dataset's Secret),
creates the Job's pod in the API, runs the container's command with ``/data`` pointing at that mount
(``cachefs`` is this checkout's CLI), streams its stdout into the pod's log, and sets the Job's status
from the exit code, as the Job controller does. So the operator reads progress that a real
``cachefs prefetch --json-progress`` printed, and the test checks on the mount itself that the data
is on the disk tier.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from pathlib import Path
from typing import Any

import pytest

from csi_driver import attributes
from csi_driver.operator import manifests as m
from tests.csi.test_operator import NS, Cluster, eventually, running_operator
from tests.fuse.conftest import CLI, Mounter, run_cli
from tests.support.kubeapi import OperatorApiServer

pytestmark = [pytest.mark.fuse, pytest.mark.s3]
FILES = {"train/a.bin": 3 << 20, "train/b.bin": 1 << 20, "train/sub/c.bin": 700_000, "val/v.bin": 2 << 20,
         "other/not-warmed.bin": 1 << 20}
WARMED = {k: v for k, v in FILES.items() if not k.startswith("other/")}
# One warm-up Job here: a few MiB from a local SeaweedFS. Bounds the stand-in's wait on the command.
JOB_TIMEOUT_S = 120


class Kubelet:
    """Runs the pods of warm-up Jobs as local processes on one real mount per claim."""

    def __init__(self, cluster: Cluster, mounter: Mounter, env: dict[str, str]) -> None:
        self.cluster = cluster
        self.mounter = mounter
        self.env = env
        self.mounts: dict[str, Path] = {}
        self.started: set[str] = set()
        self.commands: list[list[str]] = []
        self.exit_codes: dict[str, int] = {}

    def mount_claim(self, claim: str) -> Path:
        if claim in self.mounts:
            return self.mounts[claim]
        pvc = self.cluster.get("v1/persistentvolumeclaims", NS, claim)
        assert pvc is not None, f"the Job names claim {claim}, which does not exist"
        pv = self.cluster.get("v1/persistentvolumes", None, pvc["spec"]["volumeName"])
        assert pv is not None and pv["spec"]["claimRef"]["name"] == claim
        volume = attributes.parse_volume_attributes(pv["spec"]["csi"]["volumeAttributes"])
        options = ["--endpoint-url", volume.endpoint_url or "", *volume.cache.cli_args()]
        if volume.read_only:
            options.append("--read-only")
        mount = self.mounter.mount(volume.source, *options, env=self.env)
        self.mounts[claim] = mount.path
        return mount.path

    async def run_job(self, job: dict[str, Any]) -> None:
        name = job["metadata"]["name"]
        spec = job["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"]
                  if "persistentVolumeClaim" in v}
        (data_mount,) = [vm for vm in container["volumeMounts"] if vm["name"] in claims]
        local = await asyncio.to_thread(self.mount_claim, claims[data_mount["name"]])
        prefix = data_mount["mountPath"]
        command = [arg if not (arg == prefix or arg.startswith(prefix + "/")) else str(local) + arg[len(prefix):]
                   for arg in container["command"]]
        assert command[0] == "cachefs"
        command = [*CLI, *command[1:]]
        self.commands.append(command)
        pod = await self.cluster.start_pod(name, "")
        process = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE,
                                                       stderr=asyncio.subprocess.PIPE, env=self.env)
        assert process.stdout is not None

        async def pump() -> None:
            assert process.stdout is not None
            while line := await process.stdout.readline():
                self.cluster.api.logs[pod] = self.cluster.api.logs.get(pod, "") + line.decode()

        try:
            await asyncio.wait_for(asyncio.gather(pump(), process.wait()), timeout=JOB_TIMEOUT_S)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        self.exit_codes[name] = process.returncode or 0
        await self.cluster.end_job(name, ok=process.returncode == 0)

    async def serve(self, stop: asyncio.Event) -> None:
        tasks = []
        while not stop.is_set():
            for job in self.cluster.jobs():
                if job["metadata"]["name"] not in self.started:
                    self.started.add(job["metadata"]["name"])
                    tasks.append(asyncio.create_task(self.run_job(job)))
            await asyncio.sleep(0.1)
        await asyncio.gather(*tasks)


async def test_dataset_warms_a_real_mount_and_releases_the_gated_pod(seaweed, mounter: Mounter) -> None:
    bucket = f"ds-{uuid.uuid4().hex[:12]}"
    seaweed.make_bucket(bucket)
    seaweed.put_many(bucket, [(f"imagenet/{k}", random.Random(k).randbytes(n)) for k, n in FILES.items()])
    env = {**seaweed.env(), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}

    async with OperatorApiServer() as api:
        import kmock

        async with kmock.Server(api):
            k = Cluster(api)
            kubelet = Kubelet(k, mounter, env)
            stop = asyncio.Event()
            node_task = asyncio.create_task(kubelet.serve(stop))
            try:
                await k.call(k.core.create_node, {"metadata": {"name": "node-a", "labels": {"gpu": "true"}}})
                async with running_operator(api):
                    spec = {"source": f"s3://{bucket}/imagenet", "endpointUrl": seaweed.endpoint_url,
                            "cache": {"diskCache": "64MiB", "ramCache": "16MiB", "blockSize": "256KiB"},
                            "warmUp": {"paths": ["train", "val"],
                                       "target": {"tier": "Node", "nodeSelector": {"gpu": "true"}}}}
                    await k.create_dataset("imagenet", spec)
                    await k.create_gated_pod("trainer-0", "imagenet")
                    status = await eventually(lambda: (s := k.status("imagenet")).get("phase") in ("Warm", "NotWarm")
                                              and s, "the warm-up run ended", timeout_s=JOB_TIMEOUT_S)
                    assert status["phase"] == "Warm", (status, {j: api.logs.get(f"{j}-x1") for j in kubelet.started})
                    assert status["totalBytes"] == status["cachedBytes"] == sum(WARMED.values())
                    assert status["cached"] == "100.0%" and status["lastWarmUp"]["result"] == "Succeeded"
                    (tier,) = status["tiers"]
                    assert tier["tier"] == "disk" and tier["node"] == "node-a" and tier["filesCached"] == len(WARMED)
                    await eventually(lambda: k.gates("trainer-0") == [], "the gated pod released")

                    # The command the Job ran was the real prefetch, printing JSON lines the operator read.
                    (command,) = kubelet.commands
                    assert command[len(CLI):len(CLI) + 1] == ["prefetch"] and "--json-progress" in command
                    (log,) = [api.logs[p] for p in api.logs if p.startswith("imagenet-warm-1")]
                    last = json.loads(log.strip().splitlines()[-1])
                    assert last["state"] == "done" and last["ok"] is True

                    # On the mount itself: everything asked for is on the disk tier, the rest is not.
                    (mount,) = kubelet.mounts.values()
                    check = await asyncio.to_thread(run_cli, "prefetch", str(mount), f"{mount}/train", f"{mount}/val",
                                                    "--recursive", "--check", "--json", env=env)
                    assert check.returncode == 0, check.stderr
                    assert json.loads(check.stdout)["bytes_cached"] == sum(WARMED.values())
                    other = await asyncio.to_thread(run_cli, "prefetch", str(mount), f"{mount}/other", "--recursive",
                                                    "--check", "--json", env=env)
                    assert json.loads(other.stdout)["bytes_cached"] == 0

                    # Delete: the volume, claim and Job go; the bucket keeps every object.
                    await k.call(k.custom.delete_namespaced_custom_object, m.GROUP, m.VERSION, NS, m.PLURAL,
                                 "imagenet")
                    await eventually(lambda: k.dataset("imagenet") is None, "the Dataset deleted")
                    assert k.jobs() == [] and k.all("v1/persistentvolumes") == []
                    listed = seaweed.client().list_objects_v2(Bucket=bucket, Prefix="imagenet/")
                    assert sorted(o["Key"] for o in listed["Contents"]) == sorted(f"imagenet/{k}" for k in FILES)
            finally:
                stop.set()
                await asyncio.wait_for(node_task, timeout=JOB_TIMEOUT_S)
