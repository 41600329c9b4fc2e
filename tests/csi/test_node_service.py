"""The Node service over a real unix socket: real FUSE mounts of a real SeaweedFS bucket.

Publish, read every byte back, unpublish; idempotency; separate caches per volume; a broken mount
(its daemon killed with SIGKILL) repaired by the next publish and cleared by unpublish; credentials
absent from the driver's log, the daemon's log and the daemon's command line.
"""

from __future__ import annotations

import errno
import os
import signal
import time
import uuid
from pathlib import Path

import grpc
import pytest

from cachefs import mounts
from csi_driver.proto import csi_pb2
from tests.csi.conftest import AccessMode, daemon_pid, expect_rpc_error, mount_capability, secrets_of

pytestmark = [pytest.mark.fuse, pytest.mark.s3]

MiB = 1024 * 1024


@pytest.fixture
def dataset(seaweed) -> tuple[str, dict[str, bytes]]:
    bucket = f"csi-{uuid.uuid4().hex[:12]}"
    seaweed.make_bucket(bucket)
    files = {"train/a.bin": os.urandom(3 * MiB + 17), "train/sub/b.txt": b"hello\n", "train/c.bin": os.urandom(1000)}
    seaweed.put_many(bucket, files.items())
    seaweed.put(bucket, "other/outside.txt", b"not in the volume")
    return bucket, {key.removeprefix("train/"): data for key, data in files.items()}


def context_for(seaweed, bucket: str, **extra: str) -> dict[str, str]:
    return {"source": f"s3://{bucket}/train", "endpointUrl": seaweed.endpoint_url, "ramCache": "64MiB",
            "diskCache": "256MiB", **extra}


def read_tree(root: Path) -> dict[str, bytes]:
    found = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            found[str(path.relative_to(root))] = path.read_bytes()
    return found


def test_publish_read_unpublish(csi, seaweed, dataset) -> None:
    bucket, files = dataset
    target = csi.target()
    csi.publish("vol-read", target, context_for(seaweed, bucket), secrets=secrets_of(seaweed), readonly=True,
                capability=mount_capability(AccessMode.MULTI_NODE_READER_ONLY))
    entry = mounts.find_mount(target)
    assert entry is not None and entry.fstype == mounts.FSTYPE
    assert read_tree(target) == files
    with pytest.raises(OSError) as info:
        (target / "new.txt").write_bytes(b"x")
    assert info.value.errno == errno.EROFS
    # The node's metrics endpoint carries the mount's own metrics, labelled with the volume.
    text = csi.metrics()
    assert 'cachefs_csi_mounts{state="healthy"} 1' in text
    assert 'cachefs_csi_operations_total{method="NodePublishVolume",code="OK"}' in text
    assert any(line.startswith("cachefs_") and 'volume_id="vol-read"' in line for line in text.splitlines())
    # The volume's cache lives in its own directory under the node cache root.
    slots = list((csi.cache_root / "volumes").glob("vol-read-*/slot-0"))
    assert len(slots) == 1 and any(slots[0].iterdir())

    csi.unpublish("vol-read", target)
    assert mounts.find_mount(target) is None
    assert not target.exists()


def test_publish_and_unpublish_are_idempotent(csi, seaweed, dataset) -> None:
    bucket, files = dataset
    target = csi.target()
    context = context_for(seaweed, bucket)
    csi.publish("vol-idem", target, context, secrets=secrets_of(seaweed), readonly=True)
    pid = daemon_pid(target)
    csi.publish("vol-idem", target, context, secrets=secrets_of(seaweed), readonly=True)
    assert daemon_pid(target) == pid  # the same mount, not a second one stacked on it
    assert sum(1 for e in mounts.mount_entries() if e.mountpoint == str(target)) == 1
    # The same target asked for read-write now: incompatible with what is mounted there.
    with expect_rpc_error(grpc.StatusCode.ALREADY_EXISTS):
        csi.publish("vol-idem", target, context, secrets=secrets_of(seaweed), readonly=False)
    assert (target / "sub" / "b.txt").read_bytes() == files["sub/b.txt"]

    csi.unpublish("vol-idem", target)
    csi.unpublish("vol-idem", target)  # already gone: still success
    csi.unpublish("vol-never", csi.target())  # never published: success
    assert not target.exists()


def test_volumes_never_share_a_cache(csi, seaweed, dataset) -> None:
    bucket, files = dataset
    context = context_for(seaweed, bucket)
    t1, t2, t3 = csi.target(), csi.target(), csi.target()
    csi.publish("vol-a", t1, context, secrets=secrets_of(seaweed), readonly=True)
    csi.publish("vol-a", t2, context, secrets=secrets_of(seaweed), readonly=True)  # a second pod, same node
    csi.publish("vol-b", t3, context, secrets=secrets_of(seaweed), readonly=True)
    for target in (t1, t2, t3):
        assert read_tree(target) == files
    volumes = csi.cache_root / "volumes"
    a_dirs = sorted(p.name for p in volumes.glob("vol-a-*/slot-*"))
    b_dirs = sorted(p.name for p in volumes.glob("vol-b-*/slot-*"))
    assert a_dirs == ["slot-0", "slot-1"] and b_dirs == ["slot-0"]
    for target in (t1, t2, t3):
        csi.unpublish("vol-a" if target != t3 else "vol-b", target)
    # The persistent volume's caches stay for the next pods on this node (slot reuse: unit tests).
    assert sorted(p.name for p in volumes.glob("vol-a-*/slot-*")) == ["slot-0", "slot-1"]


def test_broken_mount_is_repaired_by_publish_and_cleared_by_unpublish(csi, seaweed, dataset) -> None:
    bucket, files = dataset
    target = csi.target()
    context = context_for(seaweed, bucket)
    csi.publish("vol-broken", target, context, secrets=secrets_of(seaweed), readonly=True)
    pid = daemon_pid(target)
    os.kill(pid, signal.SIGKILL)  # the daemon this test's driver started, by its PID
    deadline = time.monotonic() + 10
    while True:
        try:
            os.statvfs(target)  # a plain stat may still be answered from the kernel's attribute cache
        except OSError as exc:
            assert exc.errno in (errno.ENOTCONN, errno.ECONNABORTED)  # the daemon is gone
            break
        assert time.monotonic() < deadline, "the mount did not break after SIGKILL"
        time.sleep(0.05)

    csi.publish("vol-broken", target, context, secrets=secrets_of(seaweed), readonly=True)  # repairs
    assert daemon_pid(target) != pid
    assert read_tree(target) == files

    os.kill(daemon_pid(target), signal.SIGKILL)
    time.sleep(0.2)
    csi.unpublish("vol-broken", target)  # a broken mount is detached, not an error
    assert mounts.find_mount(target) is None
    assert not target.exists()
    assert "broken" in csi.log_text()


def test_credentials_never_in_logs_errors_or_command_lines(csi, seaweed, dataset) -> None:
    bucket, files = dataset
    target = csi.target()
    secrets = secrets_of(seaweed)
    csi.publish("vol-secret", target, context_for(seaweed, bucket), secrets=secrets, readonly=True)
    assert read_tree(target) == files
    pid = daemon_pid(target)
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    assert "cachefs" in cmdline
    for value in secrets.values():
        assert value not in cmdline
    # ...because they travel in the environment, the only channel.
    assert f"AWS_SECRET_ACCESS_KEY={seaweed.secret_key}" in environ.split("\0")

    # A wrong secret: the mount fails, and neither the error nor any log repeats the secret.
    wrong = {"accessKeyId": seaweed.access_key, "secretAccessKey": "WRONG" + seaweed.secret_key[5:]}
    with expect_rpc_error(grpc.StatusCode.INTERNAL, "access denied") as details:
        csi.publish("vol-wrong", csi.target(), context_for(seaweed, bucket), secrets=wrong, readonly=True)
    assert wrong["secretAccessKey"] not in details[0]
    csi.unpublish("vol-secret", target)

    logs = csi.log_text()
    assert "NodePublishVolume request" in logs and "secretAccessKey" in logs  # requests are logged...
    for value in (*secrets.values(), wrong["secretAccessKey"]):
        assert value not in logs  # ...with their secrets masked
    for log_file in csi.cache_root.rglob("daemon.log"):
        text = log_file.read_text(errors="replace")
        for value in (*secrets.values(), wrong["secretAccessKey"]):
            assert value not in text


def test_bad_requests_get_the_right_codes(csi, seaweed, dataset) -> None:
    bucket, _ = dataset
    good = context_for(seaweed, bucket)
    node = csi.node
    invalid = grpc.StatusCode.INVALID_ARGUMENT

    def publish(**fields):
        request = dict(volume_id="vol-bad", target_path=str(csi.target()), volume_capability=mount_capability(),
                       readonly=True, secrets=secrets_of(seaweed), volume_context=good)
        request.update(fields)
        return node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(**request), timeout=60)

    cases = [
        (dict(volume_id=""), invalid, "volume_id"),
        (dict(target_path=""), invalid, "target_path"),
        (dict(target_path="relative/path"), invalid, "absolute"),
        (dict(volume_capability=None), invalid, "volume_capability"),
        (dict(volume_capability=csi_pb2.VolumeCapability(
            block=csi_pb2.VolumeCapability.BlockVolume(),
            access_mode=csi_pb2.VolumeCapability.AccessMode(mode=AccessMode.SINGLE_NODE_WRITER))), invalid, "block"),
        (dict(volume_capability=csi_pb2.VolumeCapability(mount=csi_pb2.VolumeCapability.MountVolume())),
         invalid, "access_mode"),
        (dict(volume_capability=mount_capability(flags=("noatime",))), invalid, "noatime"),
        (dict(volume_context={**good, "source": ""}), invalid, "'source'"),
        (dict(volume_context={**good, "source": "file:///etc"}), invalid, "'source'"),
        (dict(volume_context={**good, "ramCache": "lots"}), invalid, "'ramCache'"),
        (dict(volume_context={**good, "ramcache": "1GiB"}), invalid, "'ramcache'"),
        (dict(volume_context={**good, "endpointUrl": "ftp://x"}), invalid, "'endpointUrl'"),
        (dict(secrets={"accessKeyId": seaweed.access_key}), invalid, "'secretAccessKey'"),
    ]
    for fields, code, fragment in cases:
        with expect_rpc_error(code, fragment):
            publish(**fields)

    busy = csi.target()
    busy.mkdir()
    (busy / "someone-elses-file").write_text("x")
    with expect_rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "not empty"):
        publish(target_path=str(busy))
    with expect_rpc_error(grpc.StatusCode.INTERNAL, "does not exist"):
        publish(volume_context={**good, "source": f"s3://{bucket}-missing/x"})
    with expect_rpc_error(invalid, "volume_id"):
        node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(target_path=str(busy)), timeout=10)
    with expect_rpc_error(invalid, "target_path"):
        node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(volume_id="v"), timeout=10)
    # Nothing was mounted by any of these.
    assert not [e for e in mounts.mount_entries() if e.mountpoint.startswith(str(csi.workdir))]


def test_identity_and_node_info(csi) -> None:
    info = csi.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=10)
    assert info.name == "csi.cachefs.io" and info.vendor_version
    caps = csi.identity.GetPluginCapabilities(csi_pb2.GetPluginCapabilitiesRequest(), timeout=10)
    assert [c.service.type for c in caps.capabilities] == [csi_pb2.PluginCapability.Service.CONTROLLER_SERVICE]
    assert csi.identity.Probe(csi_pb2.ProbeRequest(), timeout=10).ready.value is True
    assert csi.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=10).node_id == "test-node"
    caps = csi.node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest(), timeout=10).capabilities
    # STAGE_UNSTAGE_VOLUME (one shared mount per volume per node) and VOLUME_MOUNT_GROUP (fsGroup delegation).
    assert [c.rpc.type for c in caps] == [csi_pb2.NodeServiceCapability.RPC.STAGE_UNSTAGE_VOLUME,
                                      csi_pb2.NodeServiceCapability.RPC.VOLUME_MOUNT_GROUP]


def test_a_cluster_store_that_is_down_never_stops_a_publish(csi, seaweed, dataset) -> None:
    """Issue 24, item 1: the volume attribute ``clusterCache`` naming a store nobody answers on (a
    port with nothing listening) mounts; every byte comes from the source, and the tier's circuit is
    open in the mount's /stats."""
    from cachefs.client import call
    from tests.support.s3servers import refusing_port

    bucket, files = dataset
    target = csi.target()
    with refusing_port() as nobody:
        context = context_for(seaweed, bucket, clusterCache="s3://shared/cache",
                              clusterEndpointUrl=f"http://127.0.0.1:{nobody}", clusterTimeout="2")
        csi.publish("vol-cluster-down", target, context, secrets=secrets_of(seaweed), readonly=True,
                    capability=mount_capability(AccessMode.MULTI_NODE_READER_ONLY))
        assert read_tree(target) == files
        cluster = call(target, "/stats")["cluster"]
    assert cluster["state"] == "down" and cluster["hits"] == 0, cluster
    csi.unpublish("vol-cluster-down", target)
    assert mounts.find_mount(target) is None
