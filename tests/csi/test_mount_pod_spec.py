"""Unit tests of the mount pod's manifest, its Secret, the mountPod* attributes and API error codes."""

from __future__ import annotations

import base64
import dataclasses
import json
from pathlib import Path

import pytest

from csi_driver.attributes import MountPodResources, parse_provision_parameters, parse_volume_attributes
from csi_driver.errors import Code, CsiError
from csi_driver.launchers import DaemonSpec, daemon_name
from csi_driver.mountpods import (
    APP,
    LABEL_APP,
    LABEL_NODE,
    LABEL_VOLUME,
    MountPodSettings,
    PodState,
    api_error,
    build_pod,
    build_secret,
    label_value,
    pod_name,
)

SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
KEY_ID = "AKIAIOSFODNN7EXAMPLE"
SETTINGS = MountPodSettings(namespace="cachefs", node_name="gpu-node-7.example.internal", image="img:1",
                            priority_class="cachefs-mount")


def spec(**changes) -> DaemonSpec:
    target = Path("/var/lib/kubelet/plugins/kubernetes.io/csi/csi.cachefs.io/abc/globalmount")
    values = dict(
        name=daemon_name(target), volume_id="v1:retain:::bucket/volumes/pvc-1", target=target,
        args=("mount", "s3://bucket/volumes/pvc-1", str(target), "--fuse-fd-socket", "/run/x/fuse.sock"),
        env={"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_REGION": "us-east-1"},
        cache_dir=Path("/var/cache/cachefs-csi/volumes/v/slot-0"), run_dir=Path("/var/cache/cachefs-csi/run/x"),
    )
    values.update(changes)
    return DaemonSpec(**values)


def test_the_pod_spec_holds_no_credential_and_grants_no_privilege() -> None:
    pod = build_pod(SETTINGS, spec())
    text = json.dumps(pod)
    assert SECRET not in text and KEY_ID not in text
    (container,) = pod["spec"]["containers"]
    assert container["securityContext"] == {"privileged": False, "allowPrivilegeEscalation": False,
                                             "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": True}
    assert "lifecycle" not in container  # no preStop: deleting the pod never unmounts
    assert all("valueFrom" in var and "value" not in var for var in container["env"])
    assert {var["name"] for var in container["env"]} == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION",
                                                         "POD_IP"}
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["nodeName"] == SETTINGS.node_name
    assert pod["spec"]["priorityClassName"] == "cachefs-mount"
    assert pod["spec"]["securityContext"]["runAsUser"] == 0
    assert container["command"][:2] == ["cachefs", "mount"]
    # hostPaths mounted at their own paths: every path in the argv is the host's
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"] if m["name"] != "tmp"}
    paths = {v["name"]: v["hostPath"]["path"] for v in pod["spec"]["volumes"] if "hostPath" in v}
    assert mounts == paths and set(paths.values()) == {"/var/cache/cachefs-csi/volumes/v/slot-0",
                                                       "/var/cache/cachefs-csi/run/x"}


def test_the_secret_carries_the_environment_and_the_pod_reads_it_by_reference() -> None:
    secret = build_secret(SETTINGS, spec())
    pod = build_pod(SETTINGS, spec())
    assert secret["metadata"]["name"] == pod["metadata"]["name"]
    decoded = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert decoded["AWS_SECRET_ACCESS_KEY"] == SECRET
    refs = {var["valueFrom"]["secretKeyRef"]["key"] for var in pod["spec"]["containers"][0]["env"]
            if "secretKeyRef" in var["valueFrom"]}
    assert refs == set(decoded)


def test_names_labels_and_annotations() -> None:
    a, b = spec(), spec(target=Path("/other/globalmount"), name=daemon_name(Path("/other/globalmount")))
    pod = build_pod(SETTINGS, a)
    name = pod["metadata"]["name"]
    assert len(name) <= 63 and name == pod_name(SETTINGS.node_name, a.name)
    assert name != build_pod(SETTINGS, b)["metadata"]["name"]
    other_node = MountPodSettings(namespace="cachefs", node_name="gpu-node-8", image="img:1")
    assert build_pod(other_node, a)["metadata"]["name"] != name  # the same staging path on another node
    labels = pod["metadata"]["labels"]
    assert labels[LABEL_APP] == APP and labels[LABEL_NODE] == SETTINGS.node_name
    assert len(labels[LABEL_VOLUME]) <= 63  # a hash: volume ids may be 128 bytes of anything
    assert pod["metadata"]["annotations"]["cachefs.io/volume-id"] == a.volume_id
    assert SETTINGS.node_selector() == f"{LABEL_APP}={APP},{LABEL_NODE}={SETTINGS.node_name}"


@pytest.mark.parametrize("text", ["a" * 64, "node_with/slash", "-lead", "x" * 253])
def test_label_values_always_fit(text: str) -> None:
    value = label_value(text)
    assert len(value) <= 63 and value[0].isalnum() and value[-1].isalnum()
    assert label_value(text + "x") != value


def test_resources_from_attributes_and_defaults() -> None:
    volume = parse_volume_attributes({"source": "s3://bucket/p", "mountPodCPURequest": "500m", "mountPodCPULimit": "2",
                                      "mountPodMemoryRequest": "2Gi", "mountPodMemoryLimit": "4Gi"})
    pod = build_pod(SETTINGS, spec(pod_resources=volume.mount_pod))
    assert pod["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "500m", "memory": "2Gi"},
                                                         "limits": {"cpu": "2", "memory": "4Gi"}}
    default = build_pod(SETTINGS, spec(ram_cache_bytes=512 << 20))["spec"]["containers"][0]["resources"]
    # A memory limit by default (issue 34: none, so a 64Mi request could carry a 20 GiB RAM tier).
    assert default == {"requests": {"cpu": "100m", "memory": "832Mi"}, "limits": {"memory": "832Mi"}}
    only_requests = parse_volume_attributes({"source": "s3://bucket/p", "ramCache": "2GiB", "mountPodMemoryRequest": "64Mi"})
    pod = build_pod(SETTINGS, spec(ram_cache_bytes=2 << 30, pod_resources=only_requests.mount_pod))
    assert pod["spec"]["containers"][0]["resources"] == {"requests": {"memory": "64Mi"}, "limits": {"memory": "2368Mi"}}
    capped = dataclasses.replace(SETTINGS, default_cpu_limit="4000m")  # --max-mount-pod-cpu 4
    assert build_pod(capped, spec())["spec"]["containers"][0]["resources"]["limits"] == {"cpu": "4000m",
                                                                                         "memory": "1344Mi"}
    assert parse_provision_parameters({"bucket": "bucket", "mountPodMemoryLimit": "8Gi"}).cache_attributes == {
        "mountPodMemoryLimit": "8Gi"}


def test_the_grace_period_covers_the_volumes_stop_timeout() -> None:
    """A deleted or evicted mount pod gets SIGTERM, uploads for --stop-timeout, then exits: the grace
    period before SIGKILL is that plus a margin (Kubernetes' own 30 s by default)."""
    assert build_pod(SETTINGS, spec())["spec"]["terminationGracePeriodSeconds"] == 30
    volume = parse_volume_attributes({"source": "s3://bucket/p", "stopTimeout": "90", "uploadMaxDelay": "10"})
    assert volume.cache.cli_args() == ["--upload-max-delay", "10", "--stop-timeout", "90"]
    assert parse_volume_attributes({"source": "s3://bucket/p", "uploadDelay": "600"}).cache.cli_args() == [
        "--upload-delay", "600"]
    pod = build_pod(SETTINGS, spec(stop_timeout_s=volume.cache.stop_timeout_s))
    assert pod["spec"]["terminationGracePeriodSeconds"] == 95
    assert parse_provision_parameters({"bucket": "bucket", "stopTimeout": "60"}).cache_attributes == {
        "stopTimeout": "60"}
    with pytest.raises(CsiError) as info:
        parse_volume_attributes({"source": "s3://bucket/p", "uploadMaxDelay": "1"})  # below the 2 s upload delay
    assert info.value.code is Code.INVALID_ARGUMENT and "'uploadMaxDelay'" in info.value.message
    with pytest.raises(CsiError) as info:
        parse_volume_attributes({"source": "s3://bucket/p", "stopTimeout": "soon"})
    assert "'stopTimeout' must be a number of seconds" in info.value.message


@pytest.mark.parametrize("attrs, fragment", [
    ({"mountPodCPURequest": "lots"}, "'mountPodCPURequest' must be a CPU quantity"),
    ({"mountPodCPURequest": "0"}, "more than 0"),
    ({"mountPodCPULimit": "1.5m"}, "CPU quantity"),
    ({"mountPodMemoryRequest": "1e9"}, "memory quantity"),
    ({"mountPodMemoryLimit": "16Mi"}, "at least 64Mi"),
    ({"mountPodMemoryRequest": "2Gi", "mountPodMemoryLimit": "1Gi"}, "is more than 'mountPodMemoryLimit'"),
    ({"mountPodCPURequest": "2", "mountPodCPULimit": "500m"}, "is more than 'mountPodCPULimit'"),
    ({"mountPodCpu": "1"}, "unknown volume attribute 'mountPodCpu'"),
])
def test_bad_mount_pod_attributes_are_refused_in_one_line(attrs: dict[str, str], fragment: str) -> None:
    with pytest.raises(CsiError) as info:
        parse_volume_attributes({"source": "s3://bucket/p", **attrs})
    assert info.value.code is Code.INVALID_ARGUMENT
    assert fragment in info.value.message and "\n" not in info.value.message


def test_api_errors_become_clear_codes() -> None:
    from kubernetes.client.rest import ApiException
    from urllib3.exceptions import MaxRetryError

    forbidden = ApiException(status=403, reason="Forbidden")
    forbidden.body = json.dumps({"message": 'pods is forbidden: User "system:serviceaccount:cachefs:x" cannot '
                                            'create resource "pods"'})
    assert api_error(forbidden, "creating mount pod p").code is Code.PERMISSION_DENIED
    assert "RBAC" in api_error(forbidden, "creating mount pod p").message
    assert api_error(ApiException(status=503, reason="Unavailable"), "x").code is Code.UNAVAILABLE
    assert api_error(ApiException(status=429, reason="Too Many"), "x").code is Code.UNAVAILABLE
    assert api_error(ApiException(status=422, reason="Invalid"), "x").code is Code.INTERNAL
    assert api_error(MaxRetryError(None, "/api"), "listing").code is Code.UNAVAILABLE


def test_pod_state_reads_a_dead_container() -> None:
    from kubernetes.client import (V1ContainerState, V1ContainerStateTerminated, V1ContainerStatus, V1ObjectMeta,
                                   V1Pod, V1PodStatus)

    pod = V1Pod(metadata=V1ObjectMeta(name="p", uid="u", annotations={"cachefs.io/target": "/t"}),
                status=V1PodStatus(phase="Running", container_statuses=[V1ContainerStatus(
                    name="cachefs", image="i", image_id="i", ready=False, restart_count=0,
                    state=V1ContainerState(terminated=V1ContainerStateTerminated(exit_code=137, reason="OOMKilled")))]))
    state = PodState.of(pod)
    assert state.dead and not state.running and state.terminated == "OOMKilled, exit code 137"
    assert state.target == "/t"
    assert MountPodResources().requests() == {}


@pytest.mark.parametrize("version", ["1.30.0", "latest"])
def test_the_mount_pod_and_its_secret_are_valid_kubernetes(version: str) -> None:
    import kubernetes_validate

    if version == "latest":
        version = kubernetes_validate.latest_version()
    volume = parse_volume_attributes({"source": "s3://bucket/p", "mountPodCPULimit": "2", "mountPodMemoryLimit": "4Gi"})
    for manifest in (build_pod(SETTINGS, spec(uid=1000, gid=1000, pod_resources=volume.mount_pod)),
                     build_pod(MountPodSettings(namespace="n", node_name="x", image="i:1", service_account="sa"),
                               spec()),
                     build_secret(SETTINGS, spec())):
        kubernetes_validate.validate(json.loads(json.dumps(manifest)), version, strict=True)


class _Launcher:
    """What BrokenMountReporter uses of a PodLauncher: its settings and ``event``."""

    settings = SETTINGS

    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []

    def event(self, namespace: str, pod: str, uid: str, reason: str, message: str) -> None:
        self.events.append((namespace, pod, reason))


def _state(uid: str = "u1", *, dead: bool = True) -> PodState:
    return PodState(name="cachefs-mount-x", uid=uid, daemon="cachefs-d", volume_id="vol", target="/stage/vol",
                    phase="Failed" if dead else "Running", terminated="Error, exit code 137" if dead else None,
                    deleting=False)


def test_a_dead_mount_pod_is_reported_once_on_it_and_on_every_workload_pod() -> None:
    from csi_driver.podwatch import BrokenMountReporter, WorkloadPod

    launcher, mounted, broken = _Launcher(), {"/stage/vol"}, {"/stage/vol"}
    seen: list[str] = []
    reporter = BrokenMountReporter(launcher, lambda path: str(path) in mounted,  # type: ignore[arg-type]
                                   lambda path: str(path) in broken,
                                   lambda volume_id: [WorkloadPod("ml", "trainer-0"), WorkloadPod("ml", "trainer-1")],
                                   seen.append, settle_s=0.0)
    reporter.observe("MODIFIED", _state(dead=False))  # running: nothing to say
    reporter.join(10)
    assert launcher.events == [] and seen == []
    reporter.observe("MODIFIED", _state())
    reporter.observe("ADDED", _state())  # the same pod seen again by a relist: reported once
    reporter.join(10)
    assert launcher.events == [("cachefs", "cachefs-mount-x", "MountPodDied"), ("ml", "trainer-0", "CachefsMountBroken"),
                               ("ml", "trainer-1", "CachefsMountBroken")]
    assert seen == ["vol"]
    broken.clear()  # a mount that still answers (a new pod serves it) is not news
    reporter.observe("MODIFIED", _state("u2"))
    mounted.clear()  # nor is a pod that exited after unstage unmounted its mount
    reporter.observe("DELETED", _state("u3", dead=False))
    reporter.join(10)
    assert len(launcher.events) == 3


def test_a_container_that_cannot_start_is_not_running() -> None:
    pulling = PodState("p", "u", "d", "v", "/t", "Pending", None, False, "ErrImagePull: pull access denied")
    creating = PodState("p", "u", "d", "v", "/t", "Pending", None, False, "ContainerCreating")
    assert not pulling.running and pulling.stuck and "ErrImagePull" in pulling.describe()
    assert creating.running and not creating.stuck


def test_the_daemon_serves_its_stats_on_the_pod_ip() -> None:
    """The operator (csi_driver.operator.usage) and Prometheus read /stats and /metrics there (issue 26)."""
    (container,) = build_pod(SETTINGS, spec())["spec"]["containers"]
    assert container["command"][-4:-2] == ["--stats-addr", "$(POD_IP):9750"]
    # The node names the daemon (its durability journal's prefix), not the pod (issue 36).
    command = container["command"]
    assert command[command.index("--node-id") + 1] == "gpu-node-7.example.internal"
    # Its last counters, at exit, as the termination message (issue 36: short-lived pods counted too).
    assert container["command"][-2:] == ["--exit-stats-file", container["terminationMessagePath"]]
    assert container["terminationMessagePolicy"] == "File"
    assert any(container["terminationMessagePath"].startswith(m["mountPath"] + "/") for m in container["volumeMounts"])
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in container["env"]
    assert container["ports"] == [{"name": "stats", "containerPort": 9750, "protocol": "TCP"}]


def test_a_variable_reference_in_an_attribute_reaches_the_daemon_as_written() -> None:
    """The kubelet expands ``$(VAR)`` in a container's args from its environment: a source naming
    ``$(AWS_SECRET_ACCESS_KEY)`` would otherwise put the daemon's secret in its argv (issue 34)."""
    from tests.support.kubelet import expand

    source = "s3://bucket/$(AWS_SECRET_ACCESS_KEY)/$$x"
    volume = parse_volume_attributes({"source": source, "endpointUrl": "https://s3.example/$(AWS_ACCESS_KEY_ID)"})
    target = Path("/var/lib/kubelet/t")
    args = ("mount", volume.source, str(target), "--endpoint-url", volume.endpoint_url or "")
    (container,) = build_pod(SETTINGS, spec(args=args))["spec"]["containers"]
    env = {"AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ACCESS_KEY_ID": KEY_ID, "POD_IP": "10.0.0.7"}
    argv = [expand(arg, env) for arg in container["command"]]
    assert argv[1:6] == list(args)
    assert SECRET not in " ".join(argv) and KEY_ID not in " ".join(argv)
    assert argv[argv.index("--stats-addr") + 1] == "10.0.0.7:9750"  # the driver's own reference is still expanded
