"""Mount pods of volumes with a cluster tier get the driver's cluster-store Secret (issue 34): the
store's credentials and the cluster key come from the driver's namespace, never from a volume's Secret."""

from __future__ import annotations

import dataclasses
import json

from csi_driver.mountpods import CLUSTER_STORE_DIR, MountPodSettings, build_pod, build_secret
from tests.csi.test_mount_pod_spec import KEY_ID, SECRET, SETTINGS, spec

CLUSTERED = ("--cluster-cache", "s3://cachefs-cluster/", "--cluster-endpoint-url", "http://store:8333")


def _container(pod: dict) -> dict:
    [container] = pod["spec"]["containers"]
    return container


def test_a_clustered_volume_mounts_the_drivers_secret_and_names_its_files_only() -> None:
    settings = dataclasses.replace(SETTINGS, cluster_store_secret="cachefs-cluster-store")
    the_spec = spec(args=spec().args + CLUSTERED)
    pod = build_pod(settings, the_spec)
    [volume] = [v for v in pod["spec"]["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == "cachefs-cluster-store"
    [mount] = [m for m in _container(pod)["volumeMounts"] if m["name"] == volume["name"]]
    assert mount == {"name": volume["name"], "mountPath": CLUSTER_STORE_DIR, "readOnly": True}
    plain = {e["name"]: e["value"] for e in _container(pod)["env"] if "value" in e}
    assert plain == {"AWS_SHARED_CREDENTIALS_FILE": f"{CLUSTER_STORE_DIR}/credentials",
                     "CACHEFS_CLUSTER_PROFILE": "cluster", "CACHEFS_CLUSTER_KEY_FILE": f"{CLUSTER_STORE_DIR}/key"}
    text = json.dumps(pod)
    assert SECRET not in text and KEY_ID not in text  # the volume's credentials stay in its own Secret
    # The per-pod Secret holds the volume's environment only: nothing of the cluster store.
    assert set(build_secret(settings, the_spec)["data"]) == set(the_spec.env)


def test_a_volume_without_a_cluster_tier_or_a_driver_without_the_secret_gets_nothing() -> None:
    with_secret = dataclasses.replace(SETTINGS, cluster_store_secret="cachefs-cluster-store")
    for settings, args in ((with_secret, spec().args), (SETTINGS, spec().args + CLUSTERED)):
        pod = build_pod(settings, spec(args=args))
        assert not [v for v in pod["spec"]["volumes"] if "secret" in v]
        assert not [e for e in _container(pod)["env"] if "value" in e]
    assert MountPodSettings(namespace="n", node_name="x", image="i").cluster_store_secret == ""
