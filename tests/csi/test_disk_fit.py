"""Issue 36, item 2: a disk cache that fits the node, and a refusal that is said once, clearly.

The default StorageClass asked 50 GiB of a node with 48.4 GiB free: every kubelet retry created a
mount pod that refused to start, and each left a ``MountPodDied`` Event. Now ``diskCache`` may be a
share of the room on the node's cache disk (``"50%"``, the default StorageClass's), sized by the node
plugin at mount time; a size that does not fit is refused by the plugin itself, before any mount
pod, with the same message on every retry (so the kubelet's Events fold into one); and a mount pod
that ends before it ever served is that mount's failure, never a ``MountPodDied``.
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
import yaml

from csi_driver import attributes as attrs
from csi_driver.errors import CsiError
from tests.csi.conftest import expect_rpc_error, secrets_of, stop_driver
from tests.csi.test_mount_pods import (  # noqa: F401 - fixtures
    NAMESPACE,
    cluster,
    dataset,
    events,
    mount_pods,
    start_pod_driver,
    wait_for,
)
from tests.csi.test_node_service import context_for

ROOT = Path(__file__).resolve().parents[2]


def test_a_share_of_the_node_disk_parses_and_nonsense_is_refused() -> None:
    assert attrs.parse_cache_options({"diskCache": "50%"}).disk_share_percent == 50.0
    assert attrs.parse_cache_options({"diskCache": "50%"}).disk_bytes is None
    assert attrs.parse_cache_options({"diskCache": "2GiB"}).disk_bytes == 2 << 30
    for bad in ("0%", "101%", "half%", "%"):
        with pytest.raises(CsiError, match="from 1% to 100%"):
            attrs.parse_cache_options({"diskCache": bad})


def test_the_default_storage_class_asks_a_share_not_a_size() -> None:
    (sc,) = [d for d in yaml.safe_load_all((ROOT / "deploy/base/storageclass.yaml").read_text())]
    assert sc["parameters"]["diskCache"].endswith("%")
    attrs.parse_cache_options({"diskCache": sc["parameters"]["diskCache"]})


@pytest.mark.fuse
@pytest.mark.s3
def test_a_disk_cache_that_cannot_fit_is_refused_once_per_retry_alike_and_no_mount_pod_is_made(
        cluster, seaweed, dataset, workdir) -> None:
    api, _ = cluster
    core = api.client()
    bucket, files = dataset
    driver = start_pod_driver(workdir, api)
    try:
        staging = driver.target("globalmount")
        context = context_for(seaweed, bucket, diskCache="900TiB")
        said = []
        for _ in range(2):  # the kubelet retries
            with expect_rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "diskCache 921600.0 GiB does not fit",
                                  "a share of the free space in percent") as details:
                driver.stage("vol-big", staging, context, secrets=secrets_of(seaweed))
            said += details
        assert said[0] == said[1], "the same message on every retry, so the Events fold into one"
        # What it advises can be copied from the Event: no '%' (which the kubelet garbles, so the
        # driver shows it as a fullwidth sign that no StorageClass accepts).
        assert "%" not in said[0] and "\uff05" not in said[0], said[0]
        assert mount_pods(core) == [] and ("create", "pods", NAMESPACE) not in api.calls("cachefs-csi-node")
        assert core.list_namespaced_secret(NAMESPACE).items == []

        # A share: sized by the plugin, passed to the mount pod as a size that fits.
        shared = context_for(seaweed, bucket, diskCache="50%")
        driver.stage("vol-share", staging, shared, secrets=secrets_of(seaweed))
        (pod,) = mount_pods(core)
        args = pod.spec.containers[0].command
        size = int(args[args.index("--disk-cache") + 1])
        st = os.statvfs(staging.parent)
        assert 256 << 20 <= size <= st.f_bavail * st.f_frsize
        name, data = sorted(files.items())[0]
        assert (staging / name).read_bytes() == data
        driver.unstage("vol-share", staging)
    finally:
        stop_driver(driver)


@pytest.mark.fuse
@pytest.mark.s3
def test_a_mount_pod_that_ends_before_it_serves_is_no_mount_pod_death(cluster, seaweed, dataset, workdir) -> None:
    api, _ = cluster
    core = api.client()
    bucket, _ = dataset
    driver = start_pod_driver(workdir, api)
    try:
        staging = driver.target("globalmount")
        # More RAM than the machine has: the daemon in the mount pod refuses to start (exit 2).
        context = context_for(seaweed, bucket, ramCache="64TiB", diskCache="1GiB")
        with expect_rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "more than this machine's memory"):
            driver.stage("vol-ram", staging, context, secrets=secrets_of(seaweed))
        wait_for("the plugin to see the pod end", lambda: "ended before it served" in driver.log_text()
                 or not mount_pods(core))
        assert events(core, NAMESPACE, "MountPodDied") == [] and events(core, "ml", "CachefsMountBroken") == []
        assert "is broken" not in driver.log_text()
    finally:
        stop_driver(driver)
