"""What a volume may ask of the node plugin (``csi_driver.trust``, issue 28): no borrowing of the node's
cloud identity unless the admin allows it, a Secret for every inline ephemeral volume, endpoints and
buckets from the admin's allow-lists.

The first tests drive the real ``cachefs-csi`` over gRPC (the kubelet turns the refusal into the pod's
``FailedMount`` Event, with the message as it is here); on a115150 the Secret-less publish went on to
start a daemon with the node plugin's identity. The rest check the rules one by one without a mount.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import grpc
import pytest

from csi_driver.attributes import Credentials, parse_volume_attributes
from csi_driver.errors import Code, CsiError
from csi_driver.trust import VolumeTrust, endpoint_origin
from tests.csi.conftest import Driver, expect_rpc_error, start_driver, stop_driver

ATTACKER = "http://127.0.0.1:9"  # nothing listens on the discard port; nothing may try it either
KEYS = Credentials("AKIDEXAMPLE", "secret")


@pytest.fixture(scope="module")
def strict_driver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Driver]:
    """The driver as deployed: the node's identity not lent, one allowed endpoint."""
    d = start_driver(tmp_path_factory.mktemp("csi-trust"), "--allowed-endpoints", "https://s3.internal.example")
    try:
        yield d
    finally:
        stop_driver(d)


def test_a_secret_less_volume_pointing_at_another_endpoint_is_refused(strict_driver: Driver) -> None:
    target = strict_driver.target()
    with expect_rpc_error(grpc.StatusCode.PERMISSION_DENIED, "has no Secret", "--allow-node-identity"):
        strict_driver.publish("vol-borrow", target, {"source": "s3://node-bucket/data", "endpointUrl": ATTACKER})
    assert not target.exists()  # refused before anything was prepared or started
    assert "PERMISSION_DENIED" in strict_driver.log_text()


def test_an_endpoint_outside_the_allow_list_is_refused_even_with_a_secret(strict_driver: Driver) -> None:
    target = strict_driver.target()
    with expect_rpc_error(grpc.StatusCode.PERMISSION_DENIED,
                          "endpointUrl http://127.0.0.1:9 is not among this driver's allowed endpoints"):
        strict_driver.publish("vol-elsewhere", target, {"source": "s3://bkt/data", "endpointUrl": ATTACKER},
                              secrets={"accessKeyId": "AKIDEXAMPLE", "secretAccessKey": "secret"})


def test_an_inline_ephemeral_volume_needs_a_secret_even_where_the_node_identity_is_allowed(
        strict_driver: Driver) -> None:
    with expect_rpc_error(grpc.StatusCode.PERMISSION_DENIED, "inline ephemeral volume needs a Secret"):
        strict_driver.publish("csi-inline-1", strict_driver.target(),
                              {"source": "s3://bkt/data", "endpointUrl": "https://s3.internal.example",
                               "csi.storage.k8s.io/ephemeral": "true"})


def volume(**attributes: str):
    return parse_volume_attributes({"source": "s3://bkt/p", **attributes})


def refused(trust: VolumeTrust, attributes: dict[str, str], credentials: Credentials | None) -> str:
    with pytest.raises(CsiError) as info:
        trust.check("v", volume(**attributes), credentials)
    assert info.value.code is Code.PERMISSION_DENIED
    return info.value.message


def test_the_node_identity_is_lent_only_when_allowed_and_never_to_inline_volumes() -> None:
    refused(VolumeTrust(), {}, None)
    VolumeTrust(allow_node_identity=True).check("v", volume(), None)
    VolumeTrust().check("v", volume(), KEYS)
    assert "inline ephemeral" in refused(VolumeTrust(allow_node_identity=True),
                                         {"csi.storage.k8s.io/ephemeral": "true"}, None)


def test_allow_lists_cover_the_source_and_the_cluster_tier() -> None:
    trust = VolumeTrust.from_flags(False, "https://S3.internal.example:443/, aws", "bkt,shared")
    assert trust.allowed_endpoints == {"https://s3.internal.example", "aws"}
    trust.check("v", volume(), KEYS)  # the default AWS endpoint, named "aws"
    trust.check("v", volume(endpointUrl="https://s3.internal.example"), KEYS)
    assert "endpointUrl http://127.0.0.1:9" in refused(trust, {"endpointUrl": ATTACKER}, KEYS)
    assert "clusterEndpointUrl" in refused(trust, {"clusterCache": "s3://shared/c", "clusterEndpointUrl": ATTACKER},
                                           KEYS)
    assert "bucket 'other-bucket'" in refused(trust, {"clusterCache": "s3://other-bucket/c"}, KEYS)
    assert "the default AWS S3 endpoint" in refused(VolumeTrust.from_flags(False, "https://x.example", ""), {}, KEYS)
    with pytest.raises(ValueError, match="--allowed-endpoints entry 'ftp://x'"):
        VolumeTrust.from_flags(False, "ftp://x", "")
    assert endpoint_origin("http://[::1]:80/path") == "http://[::1]"


def test_daemons_inherit_no_node_identity_unless_it_is_allowed() -> None:
    plugin = {"AWS_ROLE_ARN": "arn:aws:iam::1:role/node", "AWS_WEB_IDENTITY_TOKEN_FILE": "/var/run/token",
              "AWS_CONTAINER_CREDENTIALS_FULL_URI": "http://169.254.170.23/v1/credentials",
              "AWS_REGION": "eu-west-1", "PATH": "/usr/bin"}
    env = VolumeTrust().daemon_environ(plugin)
    assert env == {"AWS_REGION": "eu-west-1", "PATH": "/usr/bin", "AWS_EC2_METADATA_DISABLED": "true",
                   "AWS_CONFIG_FILE": "/dev/null", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null"}
    assert VolumeTrust(allow_node_identity=True).daemon_environ(plugin) == plugin


def test_the_mount_pod_runs_as_nobody_by_default(tmp_path: Path) -> None:
    """a115150 built the HandoverMounter without a daemon uid: mount pods ran as root (runAsUser 0)."""
    from csi_driver.launchers import ProcessLauncher
    from csi_driver.main import DEFAULT_MOUNT_POD_UID, build_mounter, build_parser, daemon_user
    from csi_driver.mounter import MountRequest
    from csi_driver.mountpods import MountPodSettings, build_pod

    base = ["--endpoint", "unix:///csi/csi.sock", "--node-id", "n1"]
    assert daemon_user(build_parser().parse_args([*base, "--mount-mode", "pod"])) == DEFAULT_MOUNT_POD_UID == 65534
    assert daemon_user(build_parser().parse_args([*base, "--mount-mode", "pod", "--daemon-uid", "0"])) is None
    assert daemon_user(build_parser().parse_args(base)) is None  # process mode: the plugin's children
    # What the plugin then asks of the API: a pod running as that uid (the launcher is not called).
    run_root = Path("/run/cachefs")  # only named in the spec: nothing is created
    mounter = build_mounter("pod", run_root, {}, "INFO", ProcessLauncher(tmp_path), DEFAULT_MOUNT_POD_UID)
    request = MountRequest(source="s3://bucket/p", target=tmp_path / "t", cache_dir=tmp_path / "c")
    spec = mounter.spec_for(request)  # type: ignore[attr-defined]
    pod = build_pod(MountPodSettings(namespace="ns", node_name="n1", image="img:1"), spec)
    assert pod["spec"]["securityContext"]["runAsUser"] == 65534
    assert pod["spec"]["securityContext"]["runAsGroup"] == 65534
