"""Dynamic provisioning end to end over the real socket, on SeaweedFS: CreateVolume, publish, write,
unpublish, DeleteVolume (objects gone with ``onDelete: delete``, kept with ``retain``), and the
controller's error codes."""

from __future__ import annotations

import uuid

import grpc
import pytest

from csi_driver.proto import csi_pb2
from tests.csi.conftest import CALL_TIMEOUT_S, AccessMode, expect_rpc_error, mount_capability, secrets_of
from tests.support.provisioner import provisioned_attributes, publish_context

pytestmark = [pytest.mark.s3]


@pytest.fixture
def bucket(seaweed) -> str:
    name = f"dyn-{uuid.uuid4().hex[:12]}"
    seaweed.make_bucket(name)
    return name


def keys(seaweed, bucket: str, prefix: str = "") -> set[str]:
    pages = seaweed.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {item["Key"] for page in pages for item in page.get("Contents", ())}


def create(csi, seaweed, name: str, **parameters: str):
    return csi.controller.CreateVolume(csi_pb2.CreateVolumeRequest(
        name=name, capacity_range=csi_pb2.CapacityRange(required_bytes=10 << 30),
        volume_capabilities=[mount_capability(AccessMode.MULTI_NODE_MULTI_WRITER)],
        parameters={"endpointUrl": seaweed.endpoint_url, **parameters}, secrets=secrets_of(seaweed),
    ), timeout=CALL_TIMEOUT_S).volume


def delete(csi, seaweed, volume_id: str) -> None:
    csi.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=volume_id, secrets=secrets_of(seaweed)),
                                timeout=CALL_TIMEOUT_S)


@pytest.mark.fuse
def test_dynamic_volume_create_publish_write_unpublish_delete(csi, seaweed, bucket) -> None:
    seaweed.put(bucket, "scratch/pvc-other/keep.txt", b"another volume's data")
    volume = create(csi, seaweed, "pvc-0001", bucket=bucket, prefix="scratch", onDelete="delete", ramCache="64MiB")
    assert volume.capacity_bytes == 10 << 30
    assert volume.volume_context["source"] == f"s3://{bucket}/scratch/pvc-0001/"
    assert volume.volume_context["ramCache"] == "64MiB"
    again = create(csi, seaweed, "pvc-0001", bucket=bucket, prefix="scratch", onDelete="delete", ramCache="64MiB")
    assert again.volume_id == volume.volume_id  # idempotent by name

    confirmed = csi.controller.ValidateVolumeCapabilities(csi_pb2.ValidateVolumeCapabilitiesRequest(
        volume_id=volume.volume_id, volume_context=volume.volume_context,
        volume_capabilities=[mount_capability(AccessMode.SINGLE_NODE_WRITER)]), timeout=30)
    assert confirmed.HasField("confirmed")

    # What the kubelet hands the node: the PV's attributes as external-provisioner wrote them (its
    # csiProvisionerIdentity key included) to NodeStage, plus the pod's info to NodePublish.
    pv_attributes = provisioned_attributes(volume.volume_context)
    writer = mount_capability(AccessMode.SINGLE_NODE_WRITER)
    staging, target = csi.target("globalmount"), csi.target()
    csi.stage(volume.volume_id, staging, pv_attributes, secrets=secrets_of(seaweed), capability=writer)
    csi.publish_staged(volume.volume_id, staging, target, publish_context(pv_attributes),
                       secrets=secrets_of(seaweed), capability=writer)
    assert list(target.iterdir()) == []  # a new volume is empty
    (target / "checkpoints").mkdir()
    (target / "checkpoints" / "epoch-1.pt").write_bytes(b"w" * 100_000)
    (target / "hello.txt").write_text("hello from a pod\n")
    csi.unpublish(volume.volume_id, target)
    csi.unstage(volume.volume_id, staging)  # flushes: the objects are in the bucket afterwards

    stored = keys(seaweed, bucket, "scratch/pvc-0001/")
    assert {"scratch/pvc-0001/hello.txt", "scratch/pvc-0001/checkpoints/epoch-1.pt"} <= stored
    body = seaweed.client().get_object(Bucket=bucket, Key="scratch/pvc-0001/hello.txt")["Body"].read()
    assert body == b"hello from a pod\n"

    delete(csi, seaweed, volume.volume_id)
    assert keys(seaweed, bucket, "scratch/pvc-0001/") == set()
    assert keys(seaweed, bucket) == {"scratch/pvc-other/keep.txt"}  # nothing outside the volume
    delete(csi, seaweed, volume.volume_id)  # already deleted: success


def test_delete_policy_removes_exactly_the_volume_prefix(csi, seaweed, bucket) -> None:
    volume = create(csi, seaweed, "pvc-0003", bucket=bucket, prefix="team/a", onDelete="delete")
    inside = {f"team/a/pvc-0003/{k}" for k in ("", "x.bin", "d/", "d/y.bin", "d/e/z.bin")}
    outside = {"team/a/pvc-00030/x.bin", "team/a/pvc-0003.bin", "team/a/keep.txt", "pvc-0003/x.bin"}
    seaweed.put_many(bucket, [(key, b"data" if not key.endswith("/") else b"") for key in inside | outside])
    delete(csi, seaweed, volume.volume_id)
    assert keys(seaweed, bucket) == outside


def test_retain_policy_keeps_the_objects(csi, seaweed, bucket) -> None:
    volume = create(csi, seaweed, "pvc-0002", bucket=bucket)  # onDelete defaults to retain
    seaweed.put(bucket, "pvc-0002/model.bin", b"precious")
    delete(csi, seaweed, volume.volume_id)
    assert keys(seaweed, bucket) == {"pvc-0002/model.bin"}
    # A hand-written PersistentVolume's id is not ours: DeleteVolume succeeds and touches nothing.
    delete(csi, seaweed, "imagenet-static")


def test_controller_error_codes(csi, seaweed, bucket) -> None:
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    ctl = csi.controller
    cap = [mount_capability()]
    cases = [
        (dict(name="", volume_capabilities=cap, parameters={"bucket": bucket}), invalid, "name"),
        (dict(name="pvc-1", parameters={"bucket": bucket}), invalid, "volume_capabilities"),
        (dict(name="pvc-1", volume_capabilities=cap), invalid, "'bucket'"),
        (dict(name="pvc-1", volume_capabilities=cap, parameters={"bucket": bucket, "onDelete": "purge"}),
         invalid, "'onDelete'"),
        (dict(name="pvc-1", volume_capabilities=[csi_pb2.VolumeCapability(
            block=csi_pb2.VolumeCapability.BlockVolume(),
            access_mode=csi_pb2.VolumeCapability.AccessMode(mode=AccessMode.SINGLE_NODE_WRITER))],
            parameters={"bucket": bucket}), invalid, "block"),
    ]
    for fields, code, fragment in cases:
        with expect_rpc_error(code, fragment):
            ctl.CreateVolume(csi_pb2.CreateVolumeRequest(**fields), timeout=30)
    with expect_rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "does not exist"):
        create(csi, seaweed, "pvc-1", bucket=f"{bucket}-missing")
    wrong = {"accessKeyId": seaweed.access_key, "secretAccessKey": "WRONG" + seaweed.secret_key[5:]}
    with expect_rpc_error(grpc.StatusCode.PERMISSION_DENIED) as details:
        ctl.CreateVolume(csi_pb2.CreateVolumeRequest(
            name="pvc-1", volume_capabilities=cap, secrets=wrong,
            parameters={"bucket": bucket, "endpointUrl": seaweed.endpoint_url}), timeout=60)
    assert wrong["secretAccessKey"] not in details[0] and wrong["secretAccessKey"] not in csi.log_text()
    with expect_rpc_error(invalid, "volume_id"):
        ctl.DeleteVolume(csi_pb2.DeleteVolumeRequest(), timeout=10)
    with expect_rpc_error(grpc.StatusCode.NOT_FOUND):
        ctl.ValidateVolumeCapabilities(csi_pb2.ValidateVolumeCapabilitiesRequest(
            volume_id="nobody-knows", volume_capabilities=cap), timeout=10)
    unsupported = ctl.ValidateVolumeCapabilities(csi_pb2.ValidateVolumeCapabilitiesRequest(
        volume_id="static", volume_context={"source": f"s3://{bucket}/x"},
        volume_capabilities=[csi_pb2.VolumeCapability(
            block=csi_pb2.VolumeCapability.BlockVolume(),
            access_mode=csi_pb2.VolumeCapability.AccessMode(mode=AccessMode.SINGLE_NODE_WRITER))]), timeout=10)
    assert not unsupported.HasField("confirmed") and "block" in unsupported.message
    caps = ctl.ControllerGetCapabilities(csi_pb2.ControllerGetCapabilitiesRequest(), timeout=10)
    assert [c.rpc.type for c in caps.capabilities] == [csi_pb2.ControllerServiceCapability.RPC.CREATE_DELETE_VOLUME]


def test_csi_sanity_capacity_conflict_and_maximum_length_name(csi, seaweed, bucket) -> None:
    """csi-sanity's two CreateVolume specs, over the socket with the record in a real bucket."""
    def create_sized(name: str, size: int):
        return csi.controller.CreateVolume(csi_pb2.CreateVolumeRequest(
            name=name, capacity_range=csi_pb2.CapacityRange(required_bytes=size, limit_bytes=size),
            volume_capabilities=[mount_capability()], parameters={"bucket": bucket, "endpointUrl": seaweed.endpoint_url},
            secrets=secrets_of(seaweed)), timeout=CALL_TIMEOUT_S).volume

    first = create_sized("sanity-cap", 10 << 30)
    assert create_sized("sanity-cap", 10 << 30).volume_id == first.volume_id
    with expect_rpc_error(grpc.StatusCode.ALREADY_EXISTS, "already exists"):
        create_sized("sanity-cap", 20 << 30)
    assert keys(seaweed, bucket) == {".cachefs-volumes/sanity-cap.json"}  # beside the volumes, never inside one
    delete(csi, seaweed, first.volume_id)
    assert keys(seaweed, bucket) == set()

    name = "CreateVolume-MaxName-" + "n" * 107
    assert len(name) == 128
    longest = create_sized(name, 1 << 30)
    assert len(longest.volume_id.encode()) <= 128
    assert create_sized(name, 1 << 30).volume_id == longest.volume_id
    delete(csi, seaweed, longest.volume_id)
    assert keys(seaweed, bucket) == set()
