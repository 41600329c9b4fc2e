"""``writeDurability: cluster`` through the Node service over its real unix socket: the node is lost,
``cachefs recover`` finishes the volume's writes.

A volume published writable with ``clusterCache`` and ``writeDurability: cluster``; a pod (this test)
writes, renames and deletes through the target and acknowledges with close and fsync; the volume's
daemon is killed with SIGKILL and its cache directory deleted. ``cachefs recover`` then brings every
acknowledged change to the source. The cluster store is a second bucket of the session's SeaweedFS:
the driver runs its daemons as processes here, which take the store's credentials from the volume
(one SeaweedFS identity) and the cluster key from the driver's environment (mount pods get both
from the driver's Secret instead: tests/csi/test_cluster_store_pods.py).

The driver of this module runs with ``CACHEFS_UPLOAD_DELAY=3600`` (uploads held off, so nothing has
reached the source at the kill) and ``CACHEFS_WRITE_LEASE_TTL=3`` (a short lease to wait for) in its
environment, which the mounts it starts inherit as ``cachefs mount`` options.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from cachefs.client import call
from tests.support.clusterkeys import write_key_file
from tests.csi.conftest import Driver, daemon_pid, driver_environ, secrets_of, start_driver, stop_driver

pytestmark = [pytest.mark.fuse, pytest.mark.s3]

LEASE_TTL_S = 3
RECOVER_TIMEOUT_S = 150


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Driver]:
    root = tmp_path_factory.mktemp("csi-durability")
    # The cluster key, as the driver's mount pods get it from the driver's Secret (never the volume's).
    env = {**driver_environ(), "CACHEFS_UPLOAD_DELAY": "3600", "CACHEFS_WRITE_LEASE_TTL": str(LEASE_TTL_S),
           "CACHEFS_CLUSTER_KEY_FILE": str(write_key_file(root))}
    d = start_driver(root, env=env)
    try:
        yield d
    finally:
        stop_driver(d)


def objects(seaweed, bucket: str, prefix: str = "") -> dict[str, bytes]:
    client = seaweed.client()
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            out[obj["Key"]] = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
    return out


def test_a_lost_nodes_volume_writes_reach_the_source_through_cachefs_recover(driver: Driver, seaweed) -> None:
    bucket, shared = f"dur-{uuid.uuid4().hex[:10]}", f"shr-{uuid.uuid4().hex[:10]}"
    seaweed.make_bucket(bucket)
    seaweed.make_bucket(shared)
    seaweed.put(bucket, "vol/old.txt", b"deleted through the mount")
    context = {"source": f"s3://{bucket}/vol", "endpointUrl": seaweed.endpoint_url, "diskCache": "256MiB",
               "clusterCache": f"s3://{shared}/", "clusterEndpointUrl": seaweed.endpoint_url,
               "writeDurability": "cluster"}
    target = driver.target()
    driver.publish("vol-durable", target, context, secrets=secrets_of(seaweed))
    data = os.urandom(2 * 1024 * 1024 + 3)
    (target / "model.bin").write_bytes(data)
    (target / "ckpt.tmp").write_bytes(b"saved by rename")
    os.rename(target / "ckpt.tmp", target / "ckpt.pt")
    os.unlink(target / "old.txt")
    log = os.open(target / "train.log", os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(log, b"epoch 1\n")
    os.fsync(log)
    cache_dir = Path(call(target, "/info")["cache_dir"])
    os.kill(daemon_pid(target), signal.SIGKILL)  # the node is gone, with the file still open
    try:
        os.close(log)
    except OSError:
        pass  # the mount's daemon is dead
    shutil.rmtree(cache_dir.parent)
    assert objects(seaweed, bucket) == {"vol/old.txt": b"deleted through the mount"}

    env = {**os.environ, **seaweed.env(), "CACHEFS_CLUSTER_KEY_FILE": str(driver.workdir / "cluster.key")}
    recover = [sys.executable, "-m", "cachefs", "recover", f"s3://{bucket}/vol", "--endpoint-url", seaweed.endpoint_url,
               "--cluster-cache", f"s3://{shared}/", "--cluster-endpoint-url", seaweed.endpoint_url]
    # As a periodic Job would: every journal whose lease ran out (the dead daemon's, once its
    # LEASE_TTL_S has passed; until then it is "held" and skipped, which is no error).
    deadline = time.monotonic() + RECOVER_TIMEOUT_S
    while True:
        result = subprocess.run([*recover, "--expired", "--json"], capture_output=True, text=True, env=env,
                                timeout=RECOVER_TIMEOUT_S)
        assert result.returncode == 0, result.stdout + result.stderr
        [report] = json.loads(result.stdout)
        if report["state"] == "recovered":
            break
        assert report["state"] == "held" and time.monotonic() < deadline, report
        time.sleep(1)
    prefix = report["prefix"]
    assert objects(seaweed, bucket) == {"vol/model.bin": data, "vol/ckpt.pt": b"saved by rename",
                                        "vol/train.log": b"epoch 1\n"}
    assert list(objects(seaweed, shared, "writeback/")) == [f"{prefix}lease"]
    driver.unpublish("vol-durable", target)  # a dead mount is detached, not an error
