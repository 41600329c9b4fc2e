"""Staged volumes over the real socket, on real FUSE mounts of SeaweedFS: one shared daemon per
volume per node, bound into each pod; read-only binds; unstage refused while a pod uses the volume;
the daemons outlive a SIGKILLed node plugin, which a restarted plugin takes up again; a killed
daemon is reported broken and recovered by the next publish."""

from __future__ import annotations

import errno
import os
import signal
import time
import uuid

import grpc
import pytest

from cachefs import mounts
from cachefs.client import call
from tests.csi.conftest import (
    AccessMode,
    daemon_pid,
    expect_rpc_error,
    mount_capability,
    secrets_of,
    start_driver,
    stop_driver,
)
from tests.csi.test_node_service import context_for, read_tree

pytestmark = [pytest.mark.fuse, pytest.mark.s3]

MiB = 1024 * 1024
BREAK_TIMEOUT_S = 10.0


@pytest.fixture
def dataset(seaweed) -> tuple[str, dict[str, bytes]]:
    bucket = f"stage-{uuid.uuid4().hex[:12]}"
    seaweed.make_bucket(bucket)
    files = {"train/a.bin": os.urandom(2 * MiB + 5), "train/sub/b.txt": b"hello\n"}
    seaweed.put_many(bucket, files.items())
    return bucket, {key.removeprefix("train/"): data for key, data in files.items()}


def store_gets(path) -> int:
    return int(call(path, "/stats")["object_store"]["get_requests"])


def wait_broken(path) -> None:
    deadline = time.monotonic() + BREAK_TIMEOUT_S
    while True:
        try:
            os.statvfs(path)
        except OSError as exc:
            assert exc.errno in (errno.ENOTCONN, errno.ECONNABORTED)
            return
        assert time.monotonic() < deadline, f"{path} did not break"
        time.sleep(0.05)


def test_two_pods_share_one_daemon_and_one_cache(csi, seaweed, dataset) -> None:
    bucket, files = dataset
    context = context_for(seaweed, bucket)
    staging, pod1, pod2 = csi.target("globalmount"), csi.target(), csi.target()
    csi.stage("vol-shared", staging, context, secrets=secrets_of(seaweed))
    csi.stage("vol-shared", staging, context, secrets=secrets_of(seaweed))  # idempotent
    assert mounts.find_mount(staging).fstype == mounts.FSTYPE
    csi.publish_staged("vol-shared", staging, pod1, context, secrets=secrets_of(seaweed))
    csi.publish_staged("vol-shared", staging, pod2, context, secrets=secrets_of(seaweed), readonly=True)
    csi.publish_staged("vol-shared", staging, pod2, context, secrets=secrets_of(seaweed), readonly=True)  # again
    with expect_rpc_error(grpc.StatusCode.ALREADY_EXISTS):
        csi.publish_staged("vol-shared", staging, pod2, context, secrets=secrets_of(seaweed), readonly=False)

    # One daemon: the same device for both targets and the staging path, one daemon pid.
    assert os.stat(pod1).st_dev == os.stat(pod2).st_dev == os.stat(staging).st_dev
    assert daemon_pid(pod1) == daemon_pid(pod2) == daemon_pid(staging)
    assert read_tree(pod1) == files
    gets = store_gets(staging)
    assert gets > 0
    assert read_tree(pod2) == files  # the second pod: every byte from the shared cache
    assert store_gets(staging) == gets

    # The writable pod writes; the read-only pod sees it and cannot write.
    (pod1 / "from-pod1.txt").write_bytes(b"written by pod 1\n")
    assert (pod2 / "from-pod1.txt").read_bytes() == b"written by pod 1\n"
    with pytest.raises(OSError) as info:
        (pod2 / "nope.txt").write_bytes(b"x")
    assert info.value.errno == errno.EROFS

    with expect_rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "still published"):
        csi.unstage("vol-shared", staging)
    csi.unpublish("vol-shared", pod1)
    assert daemon_pid(pod2) == daemon_pid(staging)  # removing one bind leaves the daemon serving
    assert (pod2 / "sub" / "b.txt").read_bytes() == b"hello\n"
    csi.unpublish("vol-shared", pod2)
    csi.unpublish("vol-shared", pod2)  # already gone: success
    assert not pod1.exists() and not pod2.exists()
    csi.unstage("vol-shared", staging)  # flushes: the written file reaches the bucket
    csi.unstage("vol-shared", staging)  # not staged: success
    assert mounts.find_mount(staging) is None
    body = seaweed.client().get_object(Bucket=bucket, Key="train/from-pod1.txt")["Body"].read()
    assert body == b"written by pod 1\n"


def test_read_only_volume_and_publish_secrets(csi, seaweed, dataset) -> None:
    """A read-only stage refuses a writable publish; a volume whose Secret reaches only
    NodePublishVolume is mounted by its first publish."""
    bucket, files = dataset
    context = context_for(seaweed, bucket)
    ro_cap = mount_capability(AccessMode.MULTI_NODE_READER_ONLY)
    staging, pod = csi.target("globalmount"), csi.target()
    csi.stage("vol-ro", staging, context, capability=ro_cap)  # no stage Secret: not mounted yet
    assert mounts.find_mount(staging) is None
    csi.publish_staged("vol-ro", staging, pod, context, secrets=secrets_of(seaweed), readonly=True,
                       capability=ro_cap)
    assert mounts.find_mount(staging) is not None and read_tree(pod) == files
    with pytest.raises(OSError) as info:
        (staging / "x").write_bytes(b"x")
    assert info.value.errno == errno.EROFS  # the staged mount itself is read-only
    with expect_rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "read-only"):
        csi.publish_staged("vol-ro", staging, csi.target(), context, secrets=secrets_of(seaweed),
                           capability=mount_capability(AccessMode.SINGLE_NODE_WRITER))
    with expect_rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "not staged"):
        csi.publish_staged("vol-other", staging, csi.target(), context, secrets=secrets_of(seaweed))
    csi.unpublish("vol-ro", pod)
    csi.unstage("vol-ro", staging)
    assert mounts.find_mount(staging) is None


def test_daemons_outlive_a_killed_plugin_and_a_dead_daemon_is_recovered(seaweed, dataset, tmp_path) -> None:
    bucket, files = dataset
    context = context_for(seaweed, bucket)
    driver = start_driver(tmp_path)
    try:
        staging, pod = driver.target("globalmount"), driver.target()
        driver.stage("vol-live", staging, context, secrets=secrets_of(seaweed))
        driver.publish_staged("vol-live", staging, pod, context, secrets=secrets_of(seaweed))
        assert read_tree(pod) == files
        pid = daemon_pid(pod)

        driver.proc.send_signal(signal.SIGKILL)  # the plugin process this test started
        driver.proc.wait(timeout=30)
        assert read_tree(pod) == files  # the pod reads on, with no error
        (pod / "after-kill.txt").write_bytes(b"still here\n")
        assert daemon_pid(pod) == pid

        restarted = start_driver(tmp_path)  # same cache root and state directory, a new socket
        try:
            assert "adopted staged volume vol-live" in restarted.log_text()
            assert 'cachefs_csi_mounts{state="healthy"} 2' in restarted.metrics()  # staged mount and bind
            # The daemon dies: detected, reported, and recovered by the next publish.
            os.kill(pid, signal.SIGKILL)  # the daemon this test's driver started, by its PID
            wait_broken(pod)
            assert 'cachefs_csi_mounts{state="broken"} 2' in restarted.metrics()
            restarted.publish_staged("vol-live", staging, pod, context, secrets=secrets_of(seaweed))
            assert daemon_pid(pod) != pid and read_tree(pod)["after-kill.txt"] == b"still here\n"
            assert "broken" in restarted.log_text()
            assert 'cachefs_csi_mounts{state="healthy"} 2' in restarted.metrics()
            restarted.unpublish("vol-live", pod)
            restarted.unstage("vol-live", staging)
            assert mounts.find_mount(staging) is None and mounts.find_mount(pod) is None
        finally:
            restarted.targets = driver.targets
            stop_driver(restarted)
    finally:
        stop_driver(driver)


def test_a_reinstall_that_reuses_disk_caches_says_so(tmp_path) -> None:
    """An uninstall leaves the disk caches on the node (deploy/README.md, "Uninstall"): a plugin that
    finds some from an earlier install says so in its log, naming where they are."""
    leftover = tmp_path / "node-cache" / "volumes" / "v1-bucket-abc-0123456789ab" / "slot-0"
    leftover.mkdir(parents=True)
    (leftover / "block").write_bytes(b"x" * 4096)
    driver = start_driver(tmp_path)
    try:
        log = driver.log_text()
        assert "reusing the disk caches of 1 volume(s)" in log and str(tmp_path / "node-cache" / "volumes") in log
    finally:
        stop_driver(driver)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    driver = start_driver(fresh)
    try:
        assert "reusing the disk caches" not in driver.log_text()
    finally:
        stop_driver(driver)
