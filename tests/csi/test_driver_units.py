"""The driver's core without mounts or servers: attribute parsing, volume ids, redaction, and the
node and controller semantics over the in-memory doubles (``FakeMounter``, ``InMemoryBucketAdmin``)."""

from __future__ import annotations

import base64
import io
import json
import logging
from pathlib import Path

import pytest

from cachefs import admin
from csi_driver import attributes as attrs
from csi_driver import volume_id
from csi_driver.controller import ControllerOps, InMemoryBucketAdmin
from csi_driver.errors import Code, CsiError
from csi_driver.flex import FlexDriver
from csi_driver.mounter import CachefsMounter, FakeMounter, MountRequest
from csi_driver.node import NodeOps, NodeSettings, PublishRequest, cache_dir_name, check_target_path
from csi_driver.redact import MASK, RedactingFormatter, SecretRegistry, sanitize
from csi_driver.trust import VolumeTrust

SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
KEY_ID = "AKIAIOSFODNN7EXAMPLE"


def code_of(fn, *args, **kwargs) -> tuple[Code, str]:
    with pytest.raises(CsiError) as info:
        fn(*args, **kwargs)
    return info.value.code, info.value.message


# --------------------------------------------------------------------------------------- attributes
def test_volume_attributes_parse_into_typed_settings() -> None:
    settings = attrs.parse_volume_attributes({
        "source": "s3://bucket/data/train", "endpointUrl": "https://s3.example.com:9000", "region": "eu-west-1",
        "ramCache": "2GiB", "diskCache": "100GiB", "blockSize": "4MiB", "readahead": "64MiB", "maxFetches": "32",
        "attrTtl": "120", "dirTtl": "0", "readOnly": "True",
        "csi.storage.k8s.io/ephemeral": "true", "csi.storage.k8s.io/pod.name": "trainer-0",
    })
    assert settings.source == "s3://bucket/data/train"
    assert settings.endpoint_url == "https://s3.example.com:9000" and settings.region == "eu-west-1"
    assert settings.cache == attrs.CacheOptions(2 << 30, 100 << 30, 4 << 20, 64 << 20, 32, 120.0, 0.0)
    assert settings.read_only and settings.ephemeral
    assert settings.cache.cli_args() == [
        "--ram-cache", str(2 << 30), "--disk-cache", str(100 << 30), "--block-size", str(4 << 20),
        "--readahead", str(64 << 20), "--max-fetches", "32", "--attr-ttl", "120", "--dir-ttl", "0"]
    with pytest.raises(Exception):
        settings.source = "x"  # frozen


def test_every_key_kubernetes_adds_is_accepted_and_a_misspelt_attribute_still_refused() -> None:
    from tests.support.provisioner import provisioned_attributes, publish_context

    pv = provisioned_attributes({"source": "s3://bucket/pvc-1/", "ramCache": "1GiB"})
    assert pv[attrs.K8S_PROVISIONER_IDENTITY].endswith("-csi.cachefs.io")
    for values in (pv, publish_context(pv), publish_context(pv, ephemeral=True),
                   {**pv, "csi.storage.k8s.io/pvc/name": "c", "kubernetes.io/x": "1", "k8s.io/y": "2",
                    "node.k8s.io/z": "3", "a.b.kubernetes.io/w": "4"}):
        assert attrs.parse_volume_attributes(values).cache.ram_bytes == 1 << 30
    for bad in ("ramcache", "cachefs.io/ramCache", "notkubernetes.io/x", "kubernetes.io.evil.com/x",
                "xk8s.io/y"):
        code, message = code_of(attrs.parse_volume_attributes, {**publish_context(pv), bad: "1"})
        assert code is Code.INVALID_ARGUMENT and repr(bad) in message


@pytest.mark.parametrize("values, key", [
    ({}, "'source'"),
    ({"source": "s3://Bad_Bucket/x"}, "'source'"),
    ({"source": "file:///etc"}, "'source'"),
    ({"source": "s3://b12/x", "ramCache": "-1"}, "'ramCache'"),
    ({"source": "s3://b12/x", "diskCache": "10 parsecs"}, "'diskCache'"),
    ({"source": "s3://b12/x", "maxFetches": "0"}, "'maxFetches'"),
    ({"source": "s3://b12/x", "maxFetches": "\u00b2"}, "'maxFetches'"),  # a digit to str.isdigit, not to int
    ({"source": "s3://b12/x", "fuseThreads": "0"}, "'fuseThreads'"),
    ({"source": "s3://b12/x", "attrTtl": "nan"}, "'attrTtl'"),
    ({"source": "s3://b12/x", "readOnly": "yes"}, "'readOnly'"),
    ({"source": "s3://b12/x", "region": "Mars 1"}, "'region'"),
    ({"source": "s3://b12/x", "ramcache": "1GiB"}, "'ramcache'"),
    ({"source": "s3://b12/x", "blockSize": "1KiB"}, "'blockSize'"),
    ({"source": "s3://b12/x", "endpointUrl": "s3.example.com"}, "'endpointUrl'"),
    ({"source": "s3://b12/x", "clusterCache": "http://shared"}, "'clusterCache'"),
    ({"source": "s3://b12/x", "clusterCache": "s3://shared", "clusterEndpointUrl": "seaweed:8333"},
     "'clusterEndpointUrl'"),
    ({"source": "s3://b12/x", "clusterTimeout": "2"}, "'clusterCache'"),
    ({"source": "s3://b12/x", "clusterCache": "s3://shared", "clusterTimeout": "0"}, "'clusterCache'"),
    ({"source": "s3://b12/x", "writeDurability": "cluster"}, "'clusterCache'"),
    ({"source": "s3://b12/x", "clusterCache": "s3://shared", "writeDurability": "nearby"}, "'writeDurability'"),
])
def test_bad_volume_attributes_are_refused_naming_the_key(values, key) -> None:
    code, message = code_of(attrs.parse_volume_attributes, values)
    assert code is Code.INVALID_ARGUMENT and key in message


def test_cluster_tier_attributes_become_mount_options() -> None:
    settings = attrs.parse_volume_attributes({
        "source": "s3://bucket/data", "clusterCache": "s3://shared/cache",
        "clusterEndpointUrl": "http://seaweedfs.cachefs:8333", "clusterTimeout": "3"})
    assert settings.cache.cli_args() == ["--cluster-cache", "s3://shared/cache", "--cluster-endpoint-url",
                                         "http://seaweedfs.cachefs:8333", "--cluster-timeout", "3"]
    params = attrs.parse_provision_parameters({"bucket": "datasets", "clusterCache": "s3://shared/cache"})
    assert params.cache_attributes.get("clusterCache") == "s3://shared/cache"


def test_write_durability_attribute_becomes_the_mount_option() -> None:
    settings = attrs.parse_volume_attributes({"source": "s3://bucket/data", "clusterCache": "s3://shared/cache",
                                              "writeDurability": "cluster"})
    assert settings.cache.cli_args()[-2:] == ["--write-durability", "cluster"]
    assert "--write-durability" not in attrs.parse_volume_attributes({"source": "s3://bucket/data"}).cache.cli_args()


def test_direct_io_attribute_becomes_the_mount_option_and_anything_but_true_or_false_is_refused(
        tmp_path: Path) -> None:
    for value, on in (("true", True), ("True", True), ("false", False), (" FALSE ", False)):
        settings = attrs.parse_volume_attributes({"source": "s3://bucket/data", "directIo": value})
        assert settings.cache.direct_io is on
        assert ("--direct-io" in settings.cache.cli_args()) is on
    plain = attrs.parse_volume_attributes({"source": "s3://bucket/data"})
    assert plain.cache.direct_io is False and "--direct-io" not in plain.cache.cli_args()
    on = attrs.parse_volume_attributes({"source": "s3://bucket/data", "directIo": "true", "ramCache": "1GiB"})
    argv = CachefsMounter(command=["cachefs"], environ={}).mount_argv(
        MountRequest("s3://bucket/data", tmp_path / "t", tmp_path / "c", cache=on.cache))
    assert "--direct-io" in argv and argv[argv.index("--ram-cache") + 1] == str(1 << 30)
    # A StorageClass parameter: checked at CreateVolume and copied into every new volume's attributes.
    params = attrs.parse_provision_parameters({"bucket": "datasets", "directIo": "true"})
    assert params.cache_attributes == {"directIo": "true"}
    for bad in ("yes", "1", "on", "", "truee"):
        for parse, values in ((attrs.parse_volume_attributes, {"source": "s3://bucket/data", "directIo": bad}),
                              (attrs.parse_provision_parameters, {"bucket": "datasets", "directIo": bad})):
            code, message = code_of(parse, values)
            assert code is Code.INVALID_ARGUMENT and "\n" not in message
            assert message == f"volume attribute 'directIo' must be 'true' or 'false', got {bad!r}"


def test_fuse_threads_attribute_becomes_the_mount_option_and_is_refused_outside_its_range(tmp_path: Path) -> None:
    from cachefs.settings import MAX_FUSE_THREADS

    for value in ("1", "4", str(MAX_FUSE_THREADS), " 2 "):
        settings = attrs.parse_volume_attributes({"source": "s3://bucket/data", "fuseThreads": value})
        assert settings.cache.fuse_threads == int(value)
        assert settings.cache.cli_args() == ["--fuse-threads", value.strip()]
    # Left out: cachefs's own default (--fuse-threads is not repeated by the driver).
    plain = attrs.parse_volume_attributes({"source": "s3://bucket/data"})
    assert plain.cache.fuse_threads is None and "--fuse-threads" not in plain.cache.cli_args()
    four = attrs.parse_volume_attributes({"source": "s3://bucket/data", "fuseThreads": "4"})
    argv = CachefsMounter(command=["cachefs"], environ={}).mount_argv(
        MountRequest("s3://bucket/data", tmp_path / "t", tmp_path / "c", cache=four.cache))
    assert argv[argv.index("--fuse-threads") + 1] == "4"
    # A StorageClass parameter: checked at CreateVolume and copied into every new volume's attributes.
    assert attrs.parse_provision_parameters({"bucket": "datasets", "fuseThreads": "3"}).cache_attributes == {
        "fuseThreads": "3"}
    for bad in ("0", str(MAX_FUSE_THREADS + 1), "-1", "two", "2.5", "", "\u00b2", "1e1"):
        for parse, values in ((attrs.parse_volume_attributes, {"source": "s3://bucket/data", "fuseThreads": bad}),
                              (attrs.parse_provision_parameters, {"bucket": "datasets", "fuseThreads": bad})):
            code, message = code_of(parse, values)
            assert code is Code.INVALID_ARGUMENT
            assert message == (f"volume attribute 'fuseThreads' must be a whole number from 1 to {MAX_FUSE_THREADS}, "
                               f"got {bad!r}")


def test_endpoint_with_credentials_is_refused_without_echoing_them() -> None:
    code, message = code_of(attrs.parse_volume_attributes,
                            {"source": "s3://b12/x", "endpointUrl": f"https://{KEY_ID}:{SECRET}@s3.example.com"})
    assert code is Code.INVALID_ARGUMENT and SECRET not in message and KEY_ID not in message


def test_provision_parameters() -> None:
    p = attrs.parse_provision_parameters({"bucket": "datasets", "prefix": "/team-a/scratch/", "onDelete": "delete",
                                          "ramCache": "1GiB", "csi.storage.k8s.io/pvc/name": "claim"})
    assert (p.bucket, p.prefix, p.on_delete) == ("datasets", "team-a/scratch", attrs.DeletePolicy.DELETE)
    assert dict(p.cache_attributes) == {"ramCache": "1GiB"}
    assert attrs.parse_provision_parameters({"bucket": "datasets"}).on_delete is attrs.DeletePolicy.RETAIN
    for values, key in [({}, "'bucket'"), ({"bucket": "b/x"}, "'bucket'"), ({"bucket": "abc", "onDelete": "purge"},
                        "'onDelete'"), ({"bucket": "abc", "prefix": "a//b"}, "'prefix'"),
                        ({"bucket": "abc", "source": "s3://x/y"}, "'source'")]:
        code, message = code_of(attrs.parse_provision_parameters, values)
        assert code is Code.INVALID_ARGUMENT and key in message, message


def test_credentials_parse_and_never_print() -> None:
    creds = attrs.parse_credentials({"accessKeyId": KEY_ID, "secretAccessKey": SECRET, "other": "ignored"})
    assert creds is not None and creds.environ() == {"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET}
    assert SECRET not in repr(creds) and KEY_ID not in repr(creds)
    assert attrs.parse_credentials({}) is None
    for secrets, key in [({"accessKeyId": KEY_ID}, "'secretAccessKey'"), ({"secretAccessKey": SECRET}, "'accessKeyId'"),
                         ({"sessionToken": "tok"}, "'sessionToken'"),
                         ({"accessKeyId": KEY_ID, "secretAccessKey": SECRET + "\n"}, "'secretAccessKey'")]:
        code, message = code_of(attrs.parse_credentials, secrets)
        assert code is Code.INVALID_ARGUMENT and key in message and SECRET not in message


# --------------------------------------------------------------------------------------- volume ids
def test_volume_ids_round_trip_and_foreign_ids_are_not_ours() -> None:
    vol = volume_id.DynamicVolume("datasets", "team/pvc-1", attrs.DeletePolicy.DELETE, "http://127.0.0.1:8333",
                                  "us-east-1")
    encoded = vol.encode()
    assert encoded == "v1:delete:us-east-1:http%3A%2F%2F127.0.0.1%3A8333:datasets/team/pvc-1"
    assert volume_id.decode(encoded) == vol
    assert vol.source == "s3://datasets/team/pvc-1/"
    plain = volume_id.DynamicVolume("b12", "pvc-2", attrs.DeletePolicy.RETAIN)
    assert volume_id.decode(plain.encode()) == plain
    for foreign in ("imagenet-train", "csi-3f2a", "v1:purge:::b/x", "v1:delete:::b", "v1:delete:::b/", "v2:x:y:z:b/p"):
        assert volume_id.decode(foreign) is None


# --------------------------------------------------------------------------------------- redaction
def test_sanitize_masks_every_secret_field() -> None:
    from csi_driver.proto import csi_pb2

    request = csi_pb2.NodePublishVolumeRequest(volume_id="v", target_path="/t", secrets={"secretAccessKey": SECRET},
                                               volume_context={"source": "s3://b/p"})
    text = sanitize(request)
    assert SECRET not in text and MASK in text and "s3://b/p" in text and "secretAccessKey" in text
    assert request.secrets["secretAccessKey"] == SECRET  # the request itself is untouched
    for cls in (csi_pb2.CreateVolumeRequest, csi_pb2.DeleteVolumeRequest, csi_pb2.ValidateVolumeCapabilitiesRequest):
        assert SECRET not in sanitize(cls(secrets={"k": SECRET}))


def test_redacting_formatter_masks_registered_values_anywhere() -> None:
    registry = SecretRegistry()
    registry.add([SECRET, "short"])
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(RedactingFormatter("%(message)s", registry=registry))
    logger = logging.getLogger("test.redact")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.error("server said %s", f"bad signature for {SECRET}")
        try:
            raise ValueError(SECRET)
        except ValueError:
            logger.exception("boom")
    finally:
        logger.removeHandler(handler)
    out = stream.getvalue()
    assert SECRET not in out and out.count(MASK) >= 2
    assert "short" not in registry.scrub("x") and registry.scrub("short") == "short"  # too short to mask


# --------------------------------------------------------------------------------------- node ops
@pytest.fixture
def node(tmp_path: Path) -> tuple[NodeOps, FakeMounter]:
    fake = FakeMounter()
    # These tests are about mount semantics, most without a Secret: the node's identity is allowed
    # here; tests/csi/test_volume_trust.py checks the default (refused).
    return NodeOps(NodeSettings("n1", tmp_path / "cache", trust=VolumeTrust(allow_node_identity=True)), fake), fake


def publish_request(tmp_path: Path, volume: str = "vol-1", target: str = "pod1/mount", read_only: bool = False,
                    **attributes: str) -> PublishRequest:
    settings = attrs.parse_volume_attributes({"source": "s3://bucket/data", **attributes})
    return PublishRequest(volume, tmp_path / target, settings, read_only,
                          attrs.Credentials(KEY_ID, SECRET))


def test_publish_creates_target_claims_a_cache_slot_and_is_idempotent(node, tmp_path: Path) -> None:
    ops, fake = node
    request = publish_request(tmp_path)
    ops.publish(request)
    ops.publish(request)
    assert [c[0] for c in fake.calls] == ["mount"]
    mounted = fake.mounts[request.target_path]
    assert request.target_path.is_dir()
    assert mounted.cache_dir == tmp_path / "cache" / "volumes" / cache_dir_name("vol-1") / "slot-0"
    assert mounted.credentials is not None and mounted.credentials.secret_access_key == SECRET
    code, _ = code_of(ops.publish, publish_request(tmp_path, read_only=True))
    assert code is Code.ALREADY_EXISTS

    ops.unpublish("vol-1", request.target_path)
    ops.unpublish("vol-1", request.target_path)
    assert not request.target_path.exists() and fake.mounts == {}
    assert mounted.cache_dir.is_dir()  # a persistent volume's cache stays for the next pod


def test_concurrent_pods_of_one_volume_get_separate_slots(node, tmp_path: Path) -> None:
    ops, fake = node
    first, second = publish_request(tmp_path, target="p1/m"), publish_request(tmp_path, target="p2/m")
    ops.publish(first)
    ops.publish(second)
    assert fake.mounts[first.target_path].cache_dir.name == "slot-0"
    assert fake.mounts[second.target_path].cache_dir.name == "slot-1"
    ops.unpublish("vol-1", first.target_path)
    third = publish_request(tmp_path, target="p3/m")
    ops.publish(third)
    assert fake.mounts[third.target_path].cache_dir.name == "slot-0"  # freed, and warm


def test_cache_dirs_of_different_volumes_never_collide() -> None:
    names = {cache_dir_name(v) for v in ("a/b", "a_b", "a:b", "A/B", "x" * 200, "x" * 201, "..", "")}
    assert len(names) == 8
    assert all("/" not in n and not n.startswith(".") for n in names)


def test_ephemeral_volume_cache_is_removed_on_unpublish(node, tmp_path: Path) -> None:
    ops, fake = node
    request = publish_request(tmp_path, volume="csi-abc123", **{"csi.storage.k8s.io/ephemeral": "true"})
    ops.publish(request)
    cache_dir = fake.mounts[request.target_path].cache_dir
    assert cache_dir.is_dir()
    ops.unpublish("csi-abc123", request.target_path)
    assert not cache_dir.exists() and not cache_dir.parent.exists()


def test_broken_mount_is_remounted_and_unpublish_clears_it(node, tmp_path: Path) -> None:
    ops, fake = node
    request = publish_request(tmp_path)
    ops.publish(request)
    fake.break_mount(request.target_path)
    ops.publish(request)
    assert [c[0] for c in fake.calls] == ["mount", "unmount", "mount"]
    assert request.target_path not in fake.broken
    fake.break_mount(request.target_path)
    ops.unpublish("vol-1", request.target_path)
    assert fake.mounts == {} and not request.target_path.exists()


def test_publish_refuses_unusable_targets_and_reports_mount_failures(node, tmp_path: Path) -> None:
    ops, fake = node
    busy = publish_request(tmp_path, target="busy/m")
    busy.target_path.mkdir(parents=True)
    (busy.target_path / "file").write_text("x")
    assert code_of(ops.publish, busy)[0] is Code.FAILED_PRECONDITION
    file_target = publish_request(tmp_path, target="file-target")
    file_target.target_path.write_text("x")
    assert code_of(ops.publish, file_target)[0] is Code.FAILED_PRECONDITION
    fake.fail_next = CsiError(Code.INTERNAL, "bucket does not exist")
    assert code_of(ops.publish, publish_request(tmp_path, target="ok/m"))[0] is Code.INTERNAL
    ops.publish(publish_request(tmp_path, target="ok/m"))  # the retry succeeds
    for bad in ("", "relative", "/a/../b"):
        assert code_of(check_target_path, bad)[0] is Code.INVALID_ARGUMENT


def test_concurrent_operations_on_one_volume_are_aborted(node, tmp_path: Path) -> None:
    ops, _ = node
    with ops.locks.hold("volume vol-1"):
        assert code_of(ops.publish, publish_request(tmp_path))[0] is Code.ABORTED
    ops.publish(publish_request(tmp_path))


# --------------------------------------------------------------------------------------- mounter
def test_cachefs_mounter_passes_credentials_only_through_the_environment(tmp_path: Path) -> None:
    mounter = CachefsMounter(command=["cachefs"], environ={"PATH": "/bin", "AWS_PROFILE": "node",
                                                            "AWS_SESSION_TOKEN": "node-token"})
    request = MountRequest("s3://b12/x", tmp_path / "t", tmp_path / "c", endpoint_url="http://127.0.0.1:1",
                           region="eu-west-1", cache=attrs.CacheOptions(ram_bytes=1 << 30), read_only=True,
                           credentials=attrs.Credentials(KEY_ID, SECRET))
    argv = mounter.mount_argv(request)
    assert argv[:4] == ["cachefs", "mount", "s3://b12/x", str(tmp_path / "t")]
    assert "--read-only" in argv and "--allow-other" in argv and "--ram-cache" in argv
    assert not any(SECRET in a or KEY_ID in a for a in argv)
    env = mounter.child_environ(request)
    assert env["AWS_ACCESS_KEY_ID"] == KEY_ID and env["AWS_SECRET_ACCESS_KEY"] == SECRET
    assert "AWS_PROFILE" not in env and "AWS_SESSION_TOKEN" not in env  # never mixed with the node's identity
    assert env["AWS_REGION"] == "eu-west-1" and env["PATH"] == "/bin"
    writable = MountRequest("s3://b12/x", tmp_path / "t", tmp_path / "c")
    assert "--read-only" not in mounter.mount_argv(writable)
    assert mounter.child_environ(writable)["AWS_PROFILE"] == "node"  # no Secret: the node's own identity


# --------------------------------------------------------------------------------------- controller
def test_create_and_delete_volume_with_the_delete_policy() -> None:
    store = InMemoryBucketAdmin({"datasets": {"scratch/pvc-1/a", "scratch/pvc-1/b/c", "scratch/pvc-10/x", "keep"}})
    ops = ControllerOps(store, environ={})
    created = ops.create_volume("pvc-1", {"bucket": "datasets", "prefix": "scratch", "onDelete": "delete",
                                          "diskCache": "50GiB", "endpointUrl": "http://127.0.0.1:9"},
                                attrs.Credentials(KEY_ID, SECRET), required_bytes=5 << 30)
    assert created.capacity_bytes == 5 << 30
    assert created.volume_context == {"source": "s3://datasets/scratch/pvc-1/", "diskCache": "50GiB",
                                      "endpointUrl": "http://127.0.0.1:9"}
    attrs.parse_volume_attributes(created.volume_context)  # what CreateVolume returns, publish accepts
    again = ops.create_volume("pvc-1", {"bucket": "datasets", "prefix": "scratch", "onDelete": "delete",
                                        "diskCache": "50GiB", "endpointUrl": "http://127.0.0.1:9"}, None)
    assert again.volume_id == created.volume_id  # idempotent by name
    ops.delete_volume(created.volume_id, None)
    assert store.buckets["datasets"] == {"scratch/pvc-10/x", "keep"}  # only this volume's prefix
    ops.delete_volume(created.volume_id, None)  # already gone: success


def test_retain_policy_and_foreign_ids_delete_nothing() -> None:
    store = InMemoryBucketAdmin({"datasets": {"pvc-2/a"}})
    ops = ControllerOps(store, environ={})
    created = ops.create_volume("pvc-2", {"bucket": "datasets"}, None)
    ops.delete_volume(created.volume_id, None)
    ops.delete_volume("hand-written-pv", None)
    assert store.buckets["datasets"] == {"pvc-2/a"}
    assert [c[0] for c in store.calls] == ["check"]


def test_controller_errors_map_to_codes() -> None:
    store = InMemoryBucketAdmin({"datasets": set()})
    ops = ControllerOps(store, environ={})
    assert code_of(ops.create_volume, "pvc-1", {"bucket": "nosuchbucket"}, None)[0] is Code.FAILED_PRECONDITION
    store.denied = True
    assert code_of(ops.create_volume, "pvc-1", {"bucket": "datasets"}, None)[0] is Code.PERMISSION_DENIED
    assert code_of(ops.create_volume, "pvc/1", {"bucket": "datasets"}, None)[0] is Code.INVALID_ARGUMENT
    assert code_of(ops.create_volume, "pvc-1", {"bucket": "datasets"}, None, 10, 5)[0] is Code.OUT_OF_RANGE
    code, message = code_of(ops.create_volume, "pvc-" + "x" * 59, {"bucket": "b" * 60, "prefix": "p" * 60}, None)
    assert code is Code.INVALID_ARGUMENT and "128" in message
    assert code_of(ops.delete_volume, "", None)[0] is Code.INVALID_ARGUMENT
    assert code_of(ops.check_volume_exists, "unknown", {})[0] is Code.NOT_FOUND
    ops.check_volume_exists("static-pv", {"source": "s3://datasets/x"})


def test_admin_validation_matches_cachefs() -> None:
    assert admin.parse_size("2GiB") == 2 << 30
    assert admin.validate_source("s3://bucket/a/b").prefix == "a/b/"
    with pytest.raises(ValueError):
        admin.check_cache_options(ram_bytes=1024, block_size=8 << 20)


# --------------------------------------------------------------------------------------- flex
def test_flex_driver_over_the_fake_mounter(node, tmp_path: Path) -> None:
    ops, fake = node
    flex = FlexDriver(ops)
    assert flex.run(["init"]) == {"status": "Success", "capabilities": {"attach": False, "fsGroup": False}}
    target = tmp_path / "pods" / "uid" / "volumes" / "cachefs.io~cachefs" / "data"
    options = {"source": "s3://bucket/data", "ramCache": "512MiB", "kubernetes.io/readwrite": "ro",
               "kubernetes.io/fsType": "", "kubernetes.io/pvOrVolumeName": "data",
               "kubernetes.io/pod.namespace": "ml",
               "kubernetes.io/secret/accessKeyId": base64.b64encode(KEY_ID.encode()).decode(),
               "kubernetes.io/secret/secretAccessKey": base64.b64encode(SECRET.encode()).decode()}
    assert flex.run(["mount", str(target), json.dumps(options)]) == {"status": "Success"}
    mounted = fake.mounts[target]
    assert mounted.read_only and mounted.credentials.secret_access_key == SECRET
    assert mounted.cache.ram_bytes == 512 << 20
    assert flex.run(["unmount", str(target)]) == {"status": "Success"}
    assert fake.mounts == {} and not target.exists()
    assert flex.run(["attach", "{}", "node"])["status"] == "Not supported"
    bad = flex.run(["mount", str(target), json.dumps({**options, "ramCache": "many"})])
    assert bad["status"] == "Failure" and "ramCache" in bad["message"]
    bad = flex.run(["mount", str(target), json.dumps({**options, "kubernetes.io/secret/secretAccessKey": "%%%"})])
    assert bad["status"] == "Failure" and SECRET not in json.dumps(bad)


def test_flex_passes_owner_options_and_the_pods_fs_group(node, tmp_path: Path) -> None:
    ops, fake = node
    flex = FlexDriver(ops)
    target = tmp_path / "pods" / "uid2" / "volumes" / "cachefs.io~cachefs" / "data"
    options = {"source": "s3://bucket/data", "uid": "1000", "kubernetes.io/readwrite": "rw",
               "kubernetes.io/mounterArgs.FsGroup": "2000"}
    assert flex.run(["mount", str(target), json.dumps(options)]) == {"status": "Success"}
    assert fake.mounts[target].owner == attrs.OwnerOptions(1000, 2000, 0o664, 0o775)
    assert flex.run(["unmount", str(target)]) == {"status": "Success"}
    bad = flex.run(["mount", str(target), json.dumps({**options, "kubernetes.io/mounterArgs.FsGroup": "x"})])
    assert bad["status"] == "Failure" and "FsGroup" in bad["message"]


# --------------------------------------------------------------------------------------- owner
def test_owner_attributes_and_mount_flags_parse_and_merge() -> None:
    settings = attrs.parse_volume_attributes({"source": "s3://bucket/x", "uid": "1000", "fileMode": "640"})
    assert settings.owner == attrs.OwnerOptions(uid=1000, file_mode=0o640)
    flags = attrs.parse_mount_flags(["ro", "--gid=2000", "dir-mode=0750", "uid=1000"])
    assert flags.read_only and flags.owner == attrs.OwnerOptions(1000, 2000, None, 0o750)
    merged = settings.owner.merged(flags.owner, "mount option")
    assert merged == attrs.OwnerOptions(1000, 2000, 0o640, 0o750)
    assert merged.cli_args() == ["--uid", "1000", "--gid", "2000", "--file-mode", "0640", "--dir-mode", "0750"]
    assert attrs.OwnerOptions().cli_args() == []
    # fsGroup: the group, and group-writable modes where the volume set none (not on read-only mounts).
    assert attrs.OwnerOptions(uid=5).with_mount_group(7, read_only=False) == attrs.OwnerOptions(5, 7, 0o664, 0o775)
    assert attrs.OwnerOptions(file_mode=0o600).with_mount_group(7, read_only=False).file_mode == 0o600
    assert attrs.OwnerOptions().with_mount_group(7, read_only=True) == attrs.OwnerOptions(gid=7)
    assert attrs.OwnerOptions(gid=1).with_mount_group(None, read_only=False) == attrs.OwnerOptions(gid=1)
    provisioned = attrs.parse_provision_parameters({"bucket": "bucket", "uid": "1000", "dirMode": "0770"})
    assert provisioned.cache_attributes == {"uid": "1000", "dirMode": "0770"}


@pytest.mark.parametrize("call, fragment", [
    (lambda: attrs.parse_volume_attributes({"source": "s3://b12/x", "uid": "-1"}), "'uid'"),
    (lambda: attrs.parse_volume_attributes({"source": "s3://b12/x", "gid": "4294967295"}), "'gid'"),
    (lambda: attrs.parse_volume_attributes({"source": "s3://b12/x", "fileMode": "8"}), "'fileMode'"),
    (lambda: attrs.parse_provision_parameters({"bucket": "b12", "dirMode": "x"}), "'dirMode'"),
    (lambda: attrs.parse_mount_flags(["uid=1", "uid=2"]), "twice"),
    (lambda: attrs.parse_mount_flags(["gid"]), "'gid'"),
    (lambda: attrs.parse_mount_flags(["allow-other"]), "'allow-other'"),
    (lambda: attrs.OwnerOptions(uid=1).merged(attrs.OwnerOptions(uid=2), "mount option"), "disagree"),
    (lambda: attrs.parse_mount_group("-5"), "volume_mount_group"),
])
def test_bad_owner_values_are_refused(call, fragment) -> None:
    code, message = code_of(call)
    assert code is Code.INVALID_ARGUMENT and fragment in message, message


def test_cachefs_mounter_passes_the_owner_options(tmp_path: Path) -> None:
    request = MountRequest(source="s3://bucket/x", target=tmp_path / "t", cache_dir=tmp_path / "c",
                           owner=attrs.OwnerOptions(uid=65534, gid=65534, file_mode=0o664, dir_mode=0o775))
    argv = CachefsMounter(command=["cachefs"], environ={}).mount_argv(request)
    assert argv[argv.index("--uid") + 1] == "65534" and argv[argv.index("--gid") + 1] == "65534"
    assert argv[argv.index("--file-mode") + 1] == "0664" and argv[argv.index("--dir-mode") + 1] == "0775"
    assert "--allow-other" in argv


# --------------------------------------------------------------------------------------- metrics
def test_metrics_merge_labels_every_sample_and_keeps_families_together() -> None:
    from csi_driver.metrics import merge

    doc = ("# HELP cachefs_hits_total Hits.\n# TYPE cachefs_hits_total counter\n"
           'cachefs_hits_total{tier="ram"} 3.0\ncachefs_hits_total{tier="disk"} 1.0\n'
           "# HELP cachefs_up Up.\n# TYPE cachefs_up gauge\ncachefs_up 1.0\n")
    lines = merge([({"volume_id": "a"}, doc), ({"volume_id": 'b"x'}, doc)])
    assert lines == [
        "# HELP cachefs_hits_total Hits.", "# TYPE cachefs_hits_total counter",
        'cachefs_hits_total{volume_id="a",tier="ram"} 3.0', 'cachefs_hits_total{volume_id="a",tier="disk"} 1.0',
        'cachefs_hits_total{volume_id="b\\"x",tier="ram"} 3.0', 'cachefs_hits_total{volume_id="b\\"x",tier="disk"} 1.0',
        "# HELP cachefs_up Up.", "# TYPE cachefs_up gauge",
        'cachefs_up{volume_id="a"} 1.0', 'cachefs_up{volume_id="b\\"x"} 1.0',
    ]


def test_metrics_count_only_the_mounts_this_plugin_published(monkeypatch) -> None:
    from cachefs import mounts
    from csi_driver import metrics

    entries = [mounts.MountEntry("/pods/a/vol", mounts.FSTYPE, "cachefs"),
               mounts.MountEntry("/mnt/by-hand", mounts.FSTYPE, "cachefs"),
               mounts.MountEntry("/pods/b/vol", "ext4", "/dev/sda1")]
    monkeypatch.setattr(mounts, "mount_entries", lambda: entries)
    published = {"/pods/a/vol": "vol-a", "/pods/b/vol": "vol-b"}
    assert metrics.cachefs_targets(published.get) == {"/pods/a/vol": "vol-a"}


def test_existing_name_with_another_capacity_is_already_exists() -> None:
    store = InMemoryBucketAdmin({"datasets": set()})
    ops = ControllerOps(store, environ={})
    first = ops.create_volume("pvc-cap", {"bucket": "datasets", "prefix": "p"}, None, 10 << 30, 10 << 30)
    assert store.records == {"s3://datasets/p/.cachefs-volumes/pvc-cap.json":
                             b'{"capacity_bytes": 10737418240, "name": "pvc-cap"}'}
    same = ops.create_volume("pvc-cap", {"bucket": "datasets", "prefix": "p"}, None, 1 << 30, 0)
    assert (same.volume_id, same.capacity_bytes) == (first.volume_id, 10 << 30)  # the range holds 10 GiB
    code, message = code_of(ops.create_volume, "pvc-cap", {"bucket": "datasets", "prefix": "p"}, None,
                            20 << 30, 20 << 30)
    assert code is Code.ALREADY_EXISTS and "10737418240" in message
    assert code_of(ops.create_volume, "pvc-cap", {"bucket": "datasets", "prefix": "p"}, None, 0, 5 << 30)[0] \
        is Code.ALREADY_EXISTS
    ops.delete_volume(first.volume_id, None)  # retain: the objects stay, the record goes
    assert store.records == {}
    again = ops.create_volume("pvc-cap", {"bucket": "datasets", "prefix": "p"}, None, 20 << 30, 0)
    assert again.capacity_bytes == 20 << 30


def test_a_128_character_name_gets_a_short_deterministic_prefix() -> None:
    store = InMemoryBucketAdmin({"datasets": set()})
    ops = ControllerOps(store, environ={})
    name = "sanity-max-length-" + "x" * 110
    assert len(name) == 128
    created = ops.create_volume(name, {"bucket": "datasets"}, None)
    assert len(created.volume_id.encode()) <= volume_id.MAX_VOLUME_ID_BYTES
    source = created.volume_context["source"]
    assert source.startswith("s3://datasets/sanity-max-length-xxxxxxxxxxxxx-") and source.endswith("/")
    assert ops.create_volume(name, {"bucket": "datasets"}, None).volume_id == created.volume_id
    assert ops.create_volume(name[:-1] + "y", {"bucket": "datasets"}, None).volume_id != created.volume_id
    assert volume_id.decode(created.volume_id).source == source  # DeleteVolume finds it from the id
    short = ops.create_volume("pvc-" + "0" * 36, {"bucket": "datasets"}, None)
    assert short.volume_context["source"] == "s3://datasets/pvc-" + "0" * 36 + "/"  # never shortened
    assert code_of(ops.create_volume, "x" * 129, {"bucket": "datasets"}, None)[0] is Code.INVALID_ARGUMENT


# --------------------------------------------------------------------------------- staged volumes
def test_stage_publish_unpublish_unstage_share_one_mount(node, tmp_path: Path) -> None:
    import dataclasses

    ops, fake = node
    stage = publish_request(tmp_path, target="globalmount")
    staging = stage.target_path
    ops.stage(stage)
    ops.stage(stage)  # idempotent
    pod1 = publish_request(tmp_path, target="pod1/m")
    pod2 = publish_request(tmp_path, target="pod2/m", read_only=True)
    ops.publish_staged(pod1, staging)
    ops.publish_staged(pod2, staging)
    ops.publish_staged(pod2, staging)  # idempotent
    assert [c[0] for c in fake.calls] == ["mount", "bind", "bind"]  # one daemon for both pods
    assert fake.binds == {pod1.target_path: (staging, False), pod2.target_path: (staging, True)}
    assert code_of(ops.publish_staged, dataclasses.replace(pod2, read_only=False), staging)[0] is Code.ALREADY_EXISTS
    assert code_of(ops.stage, dataclasses.replace(stage, read_only=True))[0] is Code.ALREADY_EXISTS
    other_owner = dataclasses.replace(pod1, target_path=tmp_path / "pod3/m", volume=dataclasses.replace(
        pod1.volume, owner=attrs.OwnerOptions(gid=2000)))
    code, message = code_of(ops.publish_staged, other_owner, staging)
    assert code is Code.FAILED_PRECONDITION and "owner" in message
    assert code_of(ops.unstage, "vol-1", staging)[0] is Code.FAILED_PRECONDITION  # pods still use it
    ops.unpublish("vol-1", pod1.target_path)
    assert staging in fake.mounts and pod1.target_path not in fake.binds  # the bind alone went
    ops.unpublish("vol-1", pod2.target_path)
    ops.unstage("vol-1", staging)
    ops.unstage("vol-1", staging)  # already unstaged: success
    assert fake.mounts == {} and fake.binds == {}
    assert ops.records.all() == []


def test_staged_mount_is_made_by_the_first_publish_without_stage_secrets_and_recovered(node, tmp_path: Path) -> None:
    import dataclasses

    ops, fake = node
    stage = dataclasses.replace(publish_request(tmp_path, target="globalmount"), credentials=None)
    ops.stage(stage)
    assert fake.mounts == {}  # the Secret comes with the publish
    pod = publish_request(tmp_path, target="pod1/m")
    assert code_of(ops.publish_staged, pod, tmp_path / "elsewhere")[0] is Code.FAILED_PRECONDITION
    ops.publish_staged(pod, stage.target_path)
    assert fake.mounts[stage.target_path].credentials is not None
    fake.break_mount(stage.target_path)  # the daemon dies: the staged mount and its bind break
    assert fake.is_broken(pod.target_path)
    ops.publish_staged(pod, stage.target_path)  # recovers both
    # The pod's dead bind stays under the new one (a running container holds it): stacked, not replaced.
    assert [c[0] for c in fake.calls] == ["mount", "bind", "unmount", "mount", "bind"]
    assert not fake.is_broken(pod.target_path)
    # A restarted plugin (a new NodeOps on the same state) adopts the volume; a target gone meanwhile
    # is dropped from its record.
    fake.binds.clear()
    again = NodeOps(ops.settings, fake)
    (record,) = again.adopt()
    assert record.volume_id == "vol-1" and record.targets == {}
    again.unstage("vol-1", stage.target_path)
    assert fake.mounts == {}


def test_a_replaced_daemon_restores_every_pods_bind_or_leaves_it_broken_and_says_why(node, tmp_path: Path,
                                                                                      caplog) -> None:
    ops, fake = node
    stage = publish_request(tmp_path, target="globalmount")
    ops.stage(stage)
    import dataclasses

    pods = [dataclasses.replace(publish_request(tmp_path, target=f"pod{i}/m", read_only=i == 2),
                                context={attrs.K8S_POD_NAME: f"trainer-{i}", attrs.K8S_POD_NAMESPACE: "ml",
                                         attrs.K8S_POD_UID: f"uid-{i}"}) for i in (1, 2, 3)]
    told: list[tuple[str, str, str]] = []
    ops.on_unrestored = lambda volume, pod, message: told.append((volume, pod["name"], message))
    for pod in pods[:2]:
        ops.publish_staged(pod, stage.target_path)
    fake.break_mount(stage.target_path)  # the daemon (mount pod) dies: every bind answers ENOTCONN
    assert all(fake.is_broken(p.target_path) for p in pods[:2])
    ops.publish_staged(pods[2], stage.target_path)  # a new pod: a new daemon, and the old binds restored
    assert not any(fake.is_broken(p.target_path) for p in pods)
    assert fake.binds[pods[1].target_path] == (stage.target_path, True)  # read-only as it was
    assert set(ops.bound_targets()) == {str(p.target_path) for p in pods}

    fake.break_mount(stage.target_path)
    real_bind = fake.bind

    def bind_fails_for_pod1(source: Path, target: Path, read_only: bool) -> None:
        if target == pods[0].target_path:
            raise CsiError(Code.INTERNAL, f"cannot bind {source} on {target}: no such device")
        real_bind(source, target, read_only)

    fake.bind = bind_fails_for_pod1  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO, logger="csi_driver.node"):
        ops.stage(stage)  # the kubelet's next NodeStage: mounted again, pod2 and pod3 restored
    assert not fake.is_broken(pods[1].target_path) and not fake.is_broken(pods[2].target_path)
    assert fake.is_broken(pods[0].target_path)  # its dead bind left as it was, no new one: it stays failing
    assert any("cannot restore the bind at " + str(pods[0].target_path) in r.message for r in caplog.records)
    assert [(v, p) for v, p, _ in told] == [("vol-1", "trainer-1")] and "no such device" in told[0][2]


def test_a_dead_daemon_is_recovered_without_a_publish_by_stacking_binds_that_never_pile_up(node, tmp_path: Path) -> None:
    """Issue 36: the plugin mounts the volume again itself (``Mounter.relaunch``: a new daemon with the
    first one's environment) and stacks a bind on every pod's target, at most two layers however
    often the daemon dies; unpublish removes every layer; a relaunch that fails tells every pod."""
    import dataclasses

    ops, fake = node
    stage = publish_request(tmp_path, target="globalmount")
    ops.stage(stage)
    pods = [dataclasses.replace(publish_request(tmp_path, target=f"pod{i}/m", read_only=i == 2),
                                context={attrs.K8S_POD_NAME: f"loop-{i}", attrs.K8S_POD_NAMESPACE: "ml"})
            for i in (1, 2)]
    told: list[tuple[str, str]] = []
    ops.on_unrestored = lambda volume, pod, message: told.append((pod["name"], message))
    for pod in pods:
        ops.publish_staged(pod, stage.target_path)
    for death in range(3):
        fake.break_mount(stage.target_path)
        assert all(fake.is_broken(p.target_path) for p in pods)
        assert ops.recover(stage.target_path) is True
        assert not any(fake.is_broken(p.target_path) for p in pods), death
        assert [fake.layers(p.target_path) for p in pods] == [2, 2]  # the first bind and one live one
    assert fake.binds[pods[1].target_path] == (stage.target_path, True)
    assert [c for c in fake.calls if c[0] == "relaunch"] == [("relaunch", stage.target_path)] * 3
    assert told == []
    assert ops.recover(stage.target_path) is True and fake.calls[-1][0] == "bind"  # healthy: nothing to do

    fake.break_mount(stage.target_path)
    fake.fail_next = CsiError(Code.FAILED_PRECONDITION, "the Secret cachefs-mount-x is gone")
    assert ops.recover(stage.target_path) is False
    assert [name for name, _ in told] == ["loop-1", "loop-2"] and "the Secret cachefs-mount-x is gone" in told[0][1]
    for pod in pods:
        ops.unpublish(pod.volume_id, pod.target_path)
        assert fake.layers(pod.target_path) == 0 and not pod.target_path.exists()
    assert ops.recover(tmp_path / "not-staged") is False


def test_the_mounts_metric_counts_every_pods_bind_and_an_unrestored_one_as_broken(tmp_path: Path) -> None:
    """A target recorded for a pod but no longer a cachefs mount answers no scrape: broken, never healthy."""
    from csi_driver import metrics

    gone = tmp_path / "pod1" / "m"
    gone.mkdir(parents=True)
    text = metrics.render(lambda: {}, lambda: {str(gone): "vol-1"})
    assert 'cachefs_csi_mounts{state="broken"} 1' in text and 'cachefs_csi_mounts{state="healthy"} 0' in text


@pytest.mark.parametrize("address", ["127.0.0.1:nope", "127.0.0.1:70000", "127.0.0.1:"])
def test_metrics_addr_refuses_what_is_not_a_port(tmp_path: Path, address: str) -> None:
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "csi_driver.main", "--endpoint", f"unix://{tmp_path}/s.sock",
                             "--node-id", "n", "--mode", "controller", "--metrics-addr", address],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"cachefs-csi: error: --metrics-addr {address!r}: expected HOST:PORT")
