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
from csi_driver.trust import VolumeCaps, VolumeTrust, endpoint_origin, local_address
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
    assert trust.allowed_endpoints == {"https://s3.internal.example/", "aws"}
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


# ------------------------------------------------------------------------- what a pod author can steer
def test_an_allow_list_entry_with_a_path_allows_that_path_and_below_only() -> None:
    """An entry compares the path too (issue 34: only the origin was, so any path of an allowed host passed)."""
    trust = VolumeTrust.from_flags(False, "https://gw.example/s3/,https://s3.example", "")
    for allowed in ("https://gw.example/s3", "https://gw.example/s3/", "https://gw.example:443/s3/eu/",
                    "https://s3.example/anything/at/all"):
        trust.check("v", volume(endpointUrl=allowed), KEYS)
    for other in ("https://gw.example/", "https://gw.example/s3-other/", "https://gw.example/other/s3/",
                  "https://gw.example/s3/../admin/", "https://gw.example/s3/%2e%2e/admin", "http://gw.example/s3/",
                  "https://gw.example:8443/s3/"):
        assert "not among this driver's allowed endpoints" in refused(trust, {"endpointUrl": other}, KEYS), other
    with pytest.raises(ValueError, match="--allowed-endpoints entry 'https://gw.example/a/../b'"):
        VolumeTrust.from_flags(False, "https://gw.example/a/../b", "")


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:9000", "http://127.1:9000", "http://2130706433/", "http://0x7f.0.0.1/", "http://localhost:80",
    "http://api.localhost./", "http://[::1]:9000", "http://[::ffff:127.0.0.1]/", "http://169.254.169.254/latest",
    "http://[fe80::1]/", "http://0.0.0.0:8333", "http://[::]/", "http://169.254.170.23/v1/credentials"])
def test_without_a_list_the_nodes_own_and_link_local_addresses_are_refused(url: str) -> None:
    """Issue 34: with no --allowed-endpoints a pod author's endpointUrl reached any host, port and path."""
    assert "volumes may not name" in refused(VolumeTrust(), {"endpointUrl": url}, KEYS)
    assert "volumes may not name" in refused(VolumeTrust(), {"clusterCache": "s3://cache/p", "clusterEndpointUrl": url},
                                             KEYS)
    VolumeTrust(allow_local_endpoints=True).check("v", volume(endpointUrl=url), KEYS)
    VolumeTrust.from_flags(False, url, "").check("v", volume(endpointUrl=url), KEYS)  # listed: allowed


def test_without_a_list_other_addresses_and_names_pass() -> None:
    for url in ("https://s3.example.com", "http://10.0.0.5:9000", "http://[2001:db8::1]/", "http://localhost.example/"):
        VolumeTrust().check("v", volume(endpointUrl=url), KEYS)
        assert local_address(url.split("//")[1].split("/")[0].split(":")[0].strip("[]")) is None


def test_the_cluster_store_is_never_a_volumes_source_endpoint() -> None:
    store = "http://cachefs-cluster-store.cachefs.svc:8333"
    for endpoints in ("", f"{store}/,https://s3.example/"):  # no list, and the overlay's list
        trust = VolumeTrust.from_flags(False, endpoints, "", store)
        assert "is the cluster store" in refused(trust, {"endpointUrl": store + "/x"}, KEYS)
        trust.check("v", volume(endpointUrl="https://s3.example", clusterCache="s3://cachefs-cluster/",
                                clusterEndpointUrl=store), KEYS)


CAPS = VolumeCaps(max_ram_cache_bytes=4 << 30, max_mount_pod_memory_bytes=6 << 30, max_mount_pod_cpu_milli=4000,
                  max_stop_timeout_s=120)


@pytest.mark.parametrize(("attributes", "fragment"), [
    ({"ramCache": "5GiB"}, "'ramCache' is 5368709120 bytes, above this driver's cap of 4294967296 bytes (--max-ram-cache)"),
    ({"stopTimeout": "86400"}, "'stopTimeout' is 86400 s, above this driver's cap of 120 s (--max-stop-timeout)"),
    ({"mountPodMemoryRequest": "8Gi"}, "'mountPodMemoryRequest' is 8Gi, above this driver's cap of 6144Mi"),
    ({"mountPodMemoryLimit": "7Gi"}, "'mountPodMemoryLimit' is 7Gi, above this driver's cap of 6144Mi"),
    ({"mountPodCPURequest": "8"}, "'mountPodCPURequest' is 8, above this driver's cap of 4000m (--max-mount-pod-cpu)"),
    ({"mountPodCPULimit": "4500m"}, "'mountPodCPULimit' is 4500m, above this driver's cap of 4000m"),
])
def test_a_volume_asking_above_a_cap_is_refused_naming_the_attribute_value_and_cap(attributes: dict[str, str],
                                                                                     fragment: str) -> None:
    """Issue 34: ramCache, the mount pod's requests and limits and stopTimeout were the pod author's alone."""
    trust = VolumeTrust(caps=CAPS)
    with pytest.raises(CsiError) as info:
        trust.check("v", volume(**attributes), KEYS)
    assert info.value.code is Code.INVALID_ARGUMENT and fragment in info.value.message


def test_caps_leave_what_fits_and_count_the_ram_tier_in_the_default_memory_limit() -> None:
    trust = VolumeTrust(caps=CAPS)
    trust.check("v", volume(ramCache="4GiB", stopTimeout="120", mountPodCPURequest="4", mountPodMemoryRequest="6Gi"),
                KEYS)
    tight = VolumeTrust(caps=VolumeCaps(max_mount_pod_memory_bytes=1 << 30))
    with pytest.raises(CsiError, match="its mount pod's memory limit would be 1344Mi"):
        tight.check("v", volume(), KEYS)  # the default 1 GiB RAM tier + 320 MiB does not fit in 1Gi
    tight.check("v", volume(ramCache="512MiB"), KEYS)
    tight.check("v", volume(mountPodMemoryLimit="1Gi"), KEYS)  # the volume's own limit, within the cap


def test_the_cap_flags_reach_the_driver_and_bad_ones_are_refused() -> None:
    from csi_driver.main import build_parser, volume_caps

    base = ["--endpoint", "unix:///csi/csi.sock"]
    args = build_parser().parse_args([*base, "--max-ram-cache", "8GiB", "--max-mount-pod-memory", "10Gi",
                                      "--max-mount-pod-cpu", "4", "--max-stop-timeout", "300"])
    assert volume_caps(args) == VolumeCaps(8 << 30, 10 << 30, 4000, 300.0)
    assert volume_caps(build_parser().parse_args(base)) == VolumeCaps()
    with pytest.raises(ValueError, match="--max-mount-pod-memory '10GB'"):
        volume_caps(build_parser().parse_args([*base, "--max-mount-pod-memory", "10GB"]))


def test_flex_lends_the_node_identity_only_when_told_it_goes_to_every_pod_author() -> None:
    """Issue 34: CACHEFS_FLEX_ALLOW_NODE_IDENTITY=true lent it to every inline flexVolume without a Secret;
    a FlexVolume driver cannot tell them from an admin's PersistentVolume, so 'true' is refused."""
    from csi_driver import flex

    assert not flex.lends_node_identity("") and not flex.lends_node_identity("false")
    assert flex.lends_node_identity("every-pod-author")
    with pytest.raises(ValueError, match="cannot tell a PersistentVolume an admin wrote from a volume in a pod spec"):
        flex.lends_node_identity("true")
