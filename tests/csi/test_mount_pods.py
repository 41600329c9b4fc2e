"""``--mount-mode pod`` end to end: the node plugin against an API double (kmock) with a kubelet
stand-in that runs each mount pod's command as a local process, on real FUSE mounts of SeaweedFS.

What is measured: two publishes share one daemon (one mount pod, one device); the second pod reads
with the store unreachable; pods read on, without one error, while the plugin process is killed
with SIGKILL and while the plugin's whole cgroup (its "container") is killed through
``cgroup.kill``; a restarted plugin adopts the mount pod and then unpublishes and unstages (pod and
Secret deleted); a killed mount pod is detected, reported (log, metric, Events on the mount pod and
on the workload pods) and recovered by the next publish; start-up deletes strays and orphans.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from cachefs import mounts
from tests.csi.conftest import (
    Driver,
    daemon_pid,
    driver_environ,
    driver_run_root,
    expect_rpc_error,
    secrets_of,
    start_driver,
    stop_driver,
)
from tests.csi.test_node_service import context_for
from tests.csi import conftest as csi_conftest
from csi_driver.mountpods import USER_AGENT, pod_name
from tests.support.kubeapi import ApiDouble
from tests.support.kubelet import Kubelet

pytestmark = [pytest.mark.fuse, pytest.mark.s3]

NAMESPACE = "cachefs"
NODE = "test-node"
MiB = 1024 * 1024
WAIT_S = 60.0
CGROUP_V2 = Path("/sys/fs/cgroup/unified")
READERS = 4


def wait_for(what: str, check, timeout_s: float = WAIT_S):
    return csi_conftest.wait_for(what, check, timeout_s)


@pytest.fixture
def cluster(workdir: Path) -> Iterator[tuple[ApiDouble, Kubelet]]:
    tmp_path = workdir
    api = ApiDouble(tmp_path).start()
    kubelet = Kubelet(api.client(), NODE, NAMESPACE, tmp_path / "containers", driver_environ()).start()
    try:
        yield api, kubelet
    finally:
        kubelet.stop()
        api.stop()


@pytest.fixture
def dataset(seaweed) -> tuple[str, dict[str, bytes]]:
    bucket = f"pods-{uuid.uuid4().hex[:12]}"
    seaweed.make_bucket(bucket)
    files = {f"train/part-{i}.bin": os.urandom(MiB + i) for i in range(4)}
    files["train/sub/b.txt"] = b"hello\n"
    seaweed.put_many(bucket, files.items())
    return bucket, {key.removeprefix("train/"): data for key, data in files.items()}


def start_pod_driver(workdir: Path, api: ApiDouble,
                     image: tuple[str, ...] = ("--mount-pod-image", "ghcr.io/cachefs/cachefs-csi:test"),
                     extra: tuple[str, ...] = ()) -> Driver:
    # --daemon-uid 0: the kubelet stand-in runs a mount pod as a host process, and uid 65534 (the
    # driver's default in pod mode) can run neither this interpreter (under /root) nor reach the 0700
    # temp directories a real pod sees as its own hostPath mounts. tests/csi/test_handover.py runs the
    # daemon as 65534; test_the_mount_pod_runs_as_nobody_by_default checks the spec.
    return start_driver(workdir, "--mount-mode", "pod", "--namespace", NAMESPACE, "--node-name", NODE, *image,
                        "--mount-pod-priority-class", "system-node-critical", "--kubeconfig", str(api.kubeconfig),
                        "--mount-pod-watch-seconds", "1", "--daemon-uid", "0", *extra)


def node_rbac() -> dict[str, set[tuple[str, str]]]:
    """(verb, resource) pairs of the node plugin's Role and ClusterRole in deploy/base/node-rbac.yaml."""
    import yaml

    path = Path(__file__).resolve().parents[2] / "deploy" / "base" / "node-rbac.yaml"
    rules: dict[str, set[tuple[str, str]]] = {}
    for doc in yaml.safe_load_all(path.read_text()):
        if doc["kind"] in ("Role", "ClusterRole"):
            rules.setdefault(doc["kind"], set()).update(
                (verb, resource) for rule in doc["rules"] for resource in rule["resources"] for verb in rule["verbs"])
    return rules


def mountinfo_devices() -> dict[str, str]:
    """Mountpoint -> the major:minor of its filesystem, from /proc/self/mountinfo."""
    found = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        found[fields[4].replace("\\040", " ")] = fields[2]
    return found


def pod_info(name: str) -> dict[str, str]:
    return {"csi.storage.k8s.io/pod.name": name, "csi.storage.k8s.io/pod.namespace": "ml",
            "csi.storage.k8s.io/pod.uid": str(uuid.uuid5(uuid.NAMESPACE_DNS, name)),
            "csi.storage.k8s.io/serviceAccount.name": "default"}


def mount_pods(core) -> list:
    return [p for p in core.list_namespaced_pod(NAMESPACE).items
            if (p.metadata.labels or {}).get("app.kubernetes.io/name") == "cachefs-mount"]


def events(core, namespace: str, reason: str) -> list:
    return [e for e in core.list_namespaced_event(namespace).items if e.reason == reason]


class Readers:
    """Threads that read every file of their targets again and again (the file's page cache dropped
    first, ``POSIX_FADV_DONTNEED``), checking every byte, counting reads and errors."""

    def __init__(self, targets: list[Path], files: dict[str, bytes]) -> None:
        self.targets, self.files = targets, files
        self.reads = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(targets[i % len(targets)], i), daemon=True)
                         for i in range(READERS)]

    def _run(self, root: Path, index: int) -> None:
        names = sorted(self.files)
        i = index
        while not self._stop.is_set():
            name = names[i % len(names)]
            i += 1
            try:
                fd = os.open(root / name, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    data = b""
                    while chunk := os.read(fd, 1 << 20):
                        data += chunk
                finally:
                    os.close(fd)
                ok = data == self.files[name]
            except OSError as exc:
                ok, data = False, f"{exc}".encode()
            with self._lock:
                self.reads += 1
                if not ok:
                    self.errors.append(f"{root / name}: {data[:100]!r}")

    def __enter__(self) -> Readers:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)

    def count(self) -> int:
        with self._lock:
            return self.reads

    def wait_reads(self, n: int) -> None:
        start = self.count()
        wait_for(f"{n} more reads", lambda: self.count() >= start + n)


def reads(target: Path, name: str, data: bytes) -> bool:
    """Whether ``target/name`` reads as ``data`` (False while the mount answers ENOTCONN)."""
    try:
        return (target / name).read_bytes() == data
    except OSError:
        return False


def as_the_kubelet_retries(call) -> None:
    """``call()`` again while it is answered ABORTED (another operation on the volume in progress, here
    the plugin's own recovery), as the kubelet retries it; bounded by WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            return call()
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.ABORTED or time.monotonic() > deadline:
                raise
        time.sleep(0.5)


def kill_cgroup(group: Path) -> None:
    (group / "cgroup.kill").write_text("1")
    wait_for("the cgroup to empty", lambda: not (group / "cgroup.procs").read_text().strip(), 30)


@contextlib.contextmanager
def cgroup_for(pid: int) -> Iterator[Path | None]:
    """A cgroup v2 sub-cgroup holding ``pid`` (the plugin's "container"), or None where none can be made."""
    group = CGROUP_V2 / f"cachefs-plugin-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
        (group / "cgroup.procs").write_text(str(pid))
    except OSError:
        with contextlib.suppress(OSError):
            group.rmdir()
        yield None
        return
    try:
        yield group
    finally:
        with contextlib.suppress(OSError):
            if (group / "cgroup.procs").read_text().strip():
                kill_cgroup(group)
            group.rmdir()


def test_mount_pod_shared_survives_plugin_death_and_recovers(cluster, seaweed, dataset, workdir) -> None:
    tmp_path = workdir
    api, kubelet = cluster
    core = api.client()
    bucket, files = dataset
    from tests.fuse.writeback_support import LoopbackProxy

    proxy = LoopbackProxy(int(seaweed.endpoint_url.rsplit(":", 1)[1]))
    context = context_for(seaweed, bucket, endpointUrl=proxy.endpoint_url, attrTtl="3600", dirTtl="3600",
                          mountPodMemoryRequest="512Mi", mountPodCPURequest="250m")
    secrets = secrets_of(seaweed)
    driver = start_pod_driver(tmp_path, api)
    drivers = [driver]
    try:
        staging, pod1, pod2 = driver.target("globalmount"), driver.target(), driver.target()
        driver.stage("vol-pods", staging, context, secrets=secrets)
        driver.publish_staged("vol-pods", staging, pod1, {**context, **pod_info("trainer-0")}, secrets=secrets)
        driver.publish_staged("vol-pods", staging, pod2, {**context, **pod_info("trainer-1")}, secrets=secrets,
                              readonly=True)

        # One mount pod, as specified; its Secret holds the credentials, the pod spec none.
        (pod,) = mount_pods(core)
        assert pod.spec.node_name == NODE and pod.spec.priority_class_name == "system-node-critical"
        assert pod.spec.restart_policy == "Never"
        container = pod.spec.containers[0]
        assert container.security_context.privileged is False and container.lifecycle is None
        assert container.resources.requests == {"memory": "512Mi", "cpu": "250m"}
        assert pod.metadata.annotations["cachefs.io/volume-id"] == "vol-pods"
        text = json.dumps(core.api_client.sanitize_for_serialization(pod))
        assert seaweed.secret_key not in text and seaweed.access_key not in text
        secret = core.read_namespaced_secret(pod.metadata.name, NAMESPACE)
        assert not secret.metadata.owner_references  # it outlives the pod while the volume is staged
        assert seaweed.secret_key not in " ".join(kubelet.running(pod.metadata.name).proc.args)

        # Two publishes, one daemon: the same device everywhere, and it is the mount pod's process.
        devices = mountinfo_devices()
        assert devices[str(pod1)] == devices[str(pod2)] == devices[str(staging)]
        assert os.stat(pod1).st_dev == os.stat(pod2).st_dev == os.stat(staging).st_dev
        assert daemon_pid(pod1) == daemon_pid(pod2)
        status = Path(f"/proc/{daemon_pid(pod1)}/status").read_text()
        assert "CapEff:\t0000000000000000" in status and "NoNewPrivs:\t1" in status  # no privilege at all
        for name, data in files.items():
            assert (pod1 / name).read_bytes() == data
        proxy.close()  # the store is gone: the second pod reads from the shared cache
        for name, data in files.items():
            assert (pod2 / name).read_bytes() == data

        with Readers([pod1, pod2], files) as readers:
            readers.wait_reads(20)
            # 1. SIGKILL of the plugin process.
            driver.proc.send_signal(signal.SIGKILL)
            driver.proc.wait(timeout=30)
            readers.wait_reads(50)
            driver = start_pod_driver(tmp_path, api)
            drivers.append(driver)
            assert "1 adopted" in driver.log_text()
            (again,) = mount_pods(core)
            assert again.metadata.uid == pod.metadata.uid  # adopted, not replaced
            readers.wait_reads(50)
            after_sigkill = readers.count()

            # 2. "Container death": every process of the plugin's cgroup killed at once.
            with cgroup_for(driver.proc.pid) as group:
                if group is not None:
                    kill_cgroup(group)
                else:  # no cgroup v2 here: the plugin's whole process group instead
                    os.killpg(driver.proc.pid, signal.SIGKILL)
                driver.proc.wait(timeout=30)
                readers.wait_reads(50)
            driver = start_pod_driver(tmp_path, api)
            drivers.append(driver)
            readers.wait_reads(50)
        print(f"\nreads during plugin SIGKILL and restart: {after_sigkill}; in all, through the cgroup kill and "
              f"restart too: {readers.reads}; errors: {len(readers.errors)}; cgroup.kill used: {group is not None}")
        assert readers.errors == []
        assert (mount_pods(core)[0]).metadata.uid == pod.metadata.uid
        # The staged mount and both pods' binds, each counted.
        assert 'cachefs_csi_mounts{state="healthy"} 3' in driver.metrics()

        # 3. The mount pod dies: detected, reported (Events on the mount pod and on both workload
        # pods) and recovered by the plugin itself, without a new pod or publish (issue 36; before,
        # the binds stayed broken until another pod of the volume came): a new mount pod, with the
        # Secret of the first, and a bind stacked on each pod's target. The store is back first.
        # tests/csi/test_mount_pod_recovery.py measures it inside the pods' own mount namespaces.
        proxy = LoopbackProxy(int(seaweed.endpoint_url.rsplit(":", 1)[1]), port=proxy.port)
        kubelet.kill(pod.metadata.name)
        wait_for("the Event on the mount pod", lambda: events(core, NAMESPACE, "MountPodDied"))
        workload_events = wait_for("Events on both workload pods",
                                   lambda: len(events(core, "ml", "CachefsMountBroken")) >= 2 and
                                   events(core, "ml", "CachefsMountBroken"))
        assert {e.involved_object.name for e in workload_events} == {"trainer-0", "trainer-1"}
        assert "is broken" in driver.log_text()
        def reads(target: Path) -> bool:
            try:
                return (target / "sub" / "b.txt").read_bytes() == files["sub/b.txt"]
            except OSError:  # ENOTCONN until the new mount pod serves
                return False

        wait_for("both pods reading again", lambda: reads(pod1) and reads(pod2))
        (new,) = mount_pods(core)
        assert new.metadata.uid != pod.metadata.uid and new.metadata.name == pod.metadata.name
        pod3 = driver.target()  # a new pod of the volume arrives on the node: served by the new mount pod
        driver.publish_staged("vol-pods", staging, pod3, {**context, **pod_info("trainer-2")}, secrets=secrets)
        assert [p.metadata.uid for p in mount_pods(core)] == [new.metadata.uid]
        for target in (pod1, pod2, pod3):  # the two running pods' binds restored, byte-exact
            assert {name: (target / name).read_bytes() for name in files} == files, target
        with pytest.raises(OSError) as info:
            (pod2 / "nope.txt").write_bytes(b"x")  # pod2's bind is read-only again
        assert info.value.errno == errno.EROFS
        assert "restored the bind at " + str(pod2) in driver.log_text()
        assert 'cachefs_csi_mounts{state="healthy"} 4' in driver.metrics()
        assert 'cachefs_csi_mounts{state="broken"} 0' in driver.metrics()

        # 4. Unpublish and unstage: the mount pod and its Secret are deleted.
        driver.unpublish("vol-pods", pod1)
        driver.unpublish("vol-pods", pod2)
        driver.unpublish("vol-pods", pod3)
        driver.unstage("vol-pods", staging)
        assert mounts.find_mount(staging) is None
        assert mount_pods(core) == []
        assert core.list_namespaced_secret(NAMESPACE).items == []
        kubelet.wait_gone(new.metadata.name)

        # Every call the plugin made is allowed by its RBAC in deploy/base/node-rbac.yaml, and the
        # Role's rules are all used: least privilege, as measured.
        calls = api.calls(USER_AGENT)
        allowed = node_rbac()
        in_namespace = {(verb, resource) for verb, resource, ns in calls if ns == NAMESPACE}
        assert in_namespace - allowed["ClusterRole"] == allowed["Role"]
        assert {(verb, resource) for verb, resource, ns in calls if ns != NAMESPACE} <= allowed["ClusterRole"]
        assert ("create", "events", "ml") in calls and ("create", "events", NAMESPACE) in calls
    finally:
        proxy.close()
        targets = list(drivers[0].targets)  # every target and staging path, cleaned up once
        for d in drivers:
            d.targets = []
        drivers[-1].targets = targets
        for d in drivers:
            stop_driver(d)


def test_start_up_deletes_stray_mount_pods_and_orphan_secrets(cluster, workdir) -> None:
    tmp_path = workdir
    api, _ = cluster
    core = api.client()
    labels = {"app.kubernetes.io/name": "cachefs-mount", "cachefs.io/node": NODE}
    stray = {"metadata": {"name": "cachefs-mount-stray", "labels": labels,
                          "annotations": {"cachefs.io/target": str(tmp_path / "gone"), "cachefs.io/volume-id": "v"}},
             "spec": {"nodeName": "elsewhere-not-run", "containers": [{"name": "cachefs", "image": "x"}]}}
    other = {"metadata": {"name": "cachefs-mount-other-node",
                          "labels": {**labels, "cachefs.io/node": "other-node"}},
             "spec": {"nodeName": "other-node", "containers": [{"name": "cachefs", "image": "x"}]}}
    core.create_namespaced_pod(NAMESPACE, stray)
    core.create_namespaced_pod(NAMESPACE, other)
    # Orphan Secrets: the stray pod's, and one of a daemon this node has a run directory for but no pod
    # (found by name: the plugin may not list Secrets). A Secret the plugin knows nothing of stays.
    (driver_run_root(tmp_path) / "daemon-gone").mkdir(parents=True, exist_ok=True)
    for name in ("cachefs-mount-stray", pod_name(NODE, "daemon-gone"), "someone-elses"):
        core.create_namespaced_secret(NAMESPACE, {"metadata": {"name": name, "labels": labels}})
    plugin = {"metadata": {"name": "cachefs-csi-node-x1"}, "spec": {"nodeName": "not-this-kubelet", "containers": [
        {"name": "registrar", "image": "registrar:1"}, {"name": "cachefs-csi", "image": "site/cachefs-csi:9"}]}}
    core.create_namespaced_pod(NAMESPACE, plugin)
    driver = start_pod_driver(tmp_path, api, image=("--pod-name", "cachefs-csi-node-x1"))
    try:
        assert "1 deleted" in driver.log_text()
        # The stray is being deleted: bound to a node no kubelet serves, it stays so, as on a cluster.
        pods = core.list_namespaced_pod(NAMESPACE).items
        assert sorted(p.metadata.name for p in pods if p.metadata.deletion_timestamp is None) == [
            "cachefs-csi-node-x1", "cachefs-mount-other-node"]
        assert [p.metadata.name for p in pods if p.metadata.deletion_timestamp is not None] == ["cachefs-mount-stray"]
        assert [s.metadata.name for s in core.list_namespaced_secret(NAMESPACE).items] == ["someone-elses"]
        # The mount pods' image is the plugin's own (as an overlay's `images:` renamed it).
        assert "image site/cachefs-csi:9" in driver.log_text()
    finally:
        stop_driver(driver)


def test_pod_mode_refuses_missing_flags(tmp_path) -> None:
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "csi_driver.main", "--endpoint", f"unix://{tmp_path}/s.sock",
                             "--node-id", NODE, "--mode", "node", "--cache-root", str(tmp_path / "c"),
                             "--mount-mode", "pod", "--namespace", NAMESPACE],
                            capture_output=True, text=True, timeout=60, env=driver_environ())
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "cachefs-csi: error: --mount-mode pod needs --mount-pod-image (or --pod-name/$POD_NAME to use this pod's image)")


def test_a_mount_pod_that_cannot_start_fails_the_stage_at_once_and_leaves_nothing(cluster, seaweed, dataset,
                                                                                   workdir) -> None:
    api, _ = cluster
    core = api.client()
    bucket, _ = dataset
    driver = start_pod_driver(workdir, api, image=("--mount-pod-image", "unpullable/cachefs:0"))
    try:
        staging = driver.target("globalmount")
        # INTERNAL with the reason, not DEADLINE_EXCEEDED after the whole 130 s mount timeout
        with expect_rpc_error(grpc.StatusCode.INTERNAL, "ErrImagePull", "pull access denied"):
            driver.stage("vol-stuck", staging, context_for(seaweed, bucket), secrets=secrets_of(seaweed))
        assert mounts.find_mount(staging) is None
        assert mount_pods(core) == [] and core.list_namespaced_secret(NAMESPACE).items == []
    finally:
        stop_driver(driver)


def test_an_api_server_away_at_start_up_does_not_stop_the_plugin(workdir) -> None:
    """The plugin serves (unpublish and unstage need no API) and takes over its mount pods once the
    API answers."""
    from tests.support.s3servers import refusing_port

    with refusing_port() as port:  # refused until the double listens there (it binds with SO_REUSEADDR)
        api_away_at_start_up(workdir, port)


def api_away_at_start_up(workdir, port: int) -> None:
    api = ApiDouble(workdir, port=port)
    config = {"apiVersion": "v1", "kind": "Config", "current-context": "c",
              "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
              "users": [{"name": "u", "user": {"token": "t"}}],
              "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}
    api.kubeconfig.write_text(json.dumps(config))
    driver = start_pod_driver(workdir, api)
    try:
        wait_for("the warning", lambda: "cannot take over this node's mount pods yet" in driver.log_text())
        api.start()
        api.client().create_namespaced_pod(NAMESPACE, {
            "metadata": {"name": "cachefs-mount-stray", "labels": {"app.kubernetes.io/name": "cachefs-mount",
                                                                 "cachefs.io/node": NODE}},
            "spec": {"nodeName": "nowhere", "containers": [{"name": "cachefs", "image": "x"}]}})
        wait_for("the take-over", lambda: "0 adopted (-), 1 deleted" in driver.log_text())
        # Being deleted: its node has no kubelet to finish that.
        pods = api.client().list_namespaced_pod(NAMESPACE).items
        assert [p.metadata.deletion_timestamp is not None for p in pods] == [True]
        assert driver.proc.poll() is None
    finally:
        stop_driver(driver)
        api.stop()


def test_a_mount_pod_deleted_by_hand_is_reported_and_recovered(cluster, seaweed, dataset, workdir) -> None:
    api, kubelet = cluster
    core = api.client()
    bucket, files = dataset
    context = {**context_for(seaweed, bucket), **pod_info("notebook-0")}
    driver = start_pod_driver(workdir, api)
    try:
        staging, target = driver.target("globalmount"), driver.target()
        driver.stage("vol-del", staging, context, secrets=secrets_of(seaweed))
        driver.publish_staged("vol-del", staging, target, context, secrets=secrets_of(seaweed))
        assert (target / "sub" / "b.txt").read_bytes() == b"hello\n"
        (pod,) = mount_pods(core)
        core.delete_namespaced_pod(pod.metadata.name, NAMESPACE)  # `kubectl delete pod`: no unmount first
        kubelet.wait_gone(pod.metadata.name)
        (event,) = wait_for("the Event on the workload pod", lambda: events(core, "ml", "CachefsMountBroken"))
        assert event.involved_object.name == "notebook-0" and "was deleted" in event.message
        # The plugin recovers it without a publish: a new mount pod with the Secret of the first, kept
        # (issue 36; before, the Secret went with its owner and only the next publish could).
        wait_for("the pod reading again", lambda: reads(target, "part-0.bin", files["part-0.bin"]))
        (new,) = mount_pods(core)
        assert new.metadata.uid != pod.metadata.uid
        assert [s.metadata.name for s in core.list_namespaced_secret(NAMESPACE).items] == [pod.metadata.name]
        as_the_kubelet_retries(lambda: driver.publish_staged("vol-del", staging, target, context,
                                                             secrets=secrets_of(seaweed)))  # idempotent
        assert [p.metadata.uid for p in mount_pods(core)] == [new.metadata.uid]
        driver.unpublish("vol-del", target)
        driver.unstage("vol-del", staging)
        assert mount_pods(core) == []
    finally:
        stop_driver(driver)


def test_a_deleted_mount_pod_uploads_first_and_reports_what_it_could_not(cluster, seaweed, workdir) -> None:
    """``kubectl delete pod`` / a drain's eviction of a mount pod: the kubelet sends SIGTERM and waits
    the grace period (stopTimeout + 5 s here). The daemon uploads what is pending before it exits; with
    the store frozen past stopTimeout, it exits leaving the change journaled, and the plugin says so
    (an Event on the workload pod and a counter); the next mount of the volume uploads it."""
    from tests.fuse.writeback_support import LoopbackProxy

    api, kubelet = cluster
    core = api.client()
    bucket = f"podstop-{uuid.uuid4().hex[:10]}"
    seaweed.make_bucket(bucket)
    client = seaweed.client()
    proxy = LoopbackProxy(seaweed.s3_port)
    # uploadDelay 600: nothing is uploaded by itself, only by the stop (or the replay of a new mount).
    context = {**context_for(seaweed, bucket), "endpointUrl": proxy.endpoint_url, "uploadDelay": "600",
               "stopTimeout": "3", **pod_info("writer-0")}
    driver = start_pod_driver(workdir, api)
    try:
        staging, target = driver.target("globalmount"), driver.target()
        driver.stage("vol-stop", staging, context, secrets=secrets_of(seaweed))
        driver.publish_staged("vol-stop", staging, target, context, secrets=secrets_of(seaweed))
        (target / "out.txt").write_bytes(b"written just before the pod was deleted")
        (pod,) = mount_pods(core)
        assert pod.spec.termination_grace_period_seconds == 8  # stopTimeout 3 + the 5 s margin
        core.delete_namespaced_pod(pod.metadata.name, NAMESPACE)
        kubelet.wait_gone(pod.metadata.name)
        assert client.get_object(Bucket=bucket, Key="train/out.txt")["Body"].read() == (
            b"written just before the pod was deleted")

        # The plugin starts a new mount pod by itself (issue 36): the pod writes on through it.
        wait_for("the new mount pod serving", lambda: reads(target, "out.txt",
                                                           b"written just before the pod was deleted"))
        (target / "late.txt").write_bytes(b"written while the store is frozen")
        (pod,) = [p for p in mount_pods(core) if p.metadata.deletion_timestamp is None]
        proxy.freeze()
        core.delete_namespaced_pod(pod.metadata.name, NAMESPACE)
        kubelet.wait_gone(pod.metadata.name)
        (event,) = wait_for("the staged-writes Event on the workload pod",
                            lambda: events(core, "ml", "CachefsWritesStaged"))
        assert event.involved_object.name == "writer-0" and "1 written changes not in the bucket" in event.message
        assert "cachefs_csi_mount_pods_ended_with_staged_writes_total 1" in driver.metrics()
        assert events(core, "ml", "CachefsWritesStaged") == [event], "the first pod (all uploaded) was reported"

        proxy.thaw()  # the plugin's next mount pod (its own recovery) uploads what the last one left
        wait_for("the next mount to upload the journaled change",
                 lambda: "train/late.txt" in {o["Key"] for o in client.list_objects_v2(
                     Bucket=bucket, Prefix="train/").get("Contents", [])})
        as_the_kubelet_retries(lambda: driver.unpublish("vol-stop", target))  # ABORTED while the plugin recovers
        driver.unstage("vol-stop", staging)
    finally:
        stop_driver(driver)
        proxy.close()


def test_the_cache_of_a_deleted_volume_is_removed_from_the_node(cluster, seaweed, dataset, workdir) -> None:
    """A persistent volume's cache stays on the node after unstage (the next pod starts warm) while its
    PersistentVolume exists; once the PV is deleted, the plugin's sweep removes it and says why."""
    from csi_driver.main import DRIVER_NAME
    from csi_driver.node import cache_dir_name

    api, kubelet = cluster
    core = api.client()
    bucket, files = dataset
    context = {**context_for(seaweed, bucket), **pod_info("reader-0")}
    core.create_persistent_volume({
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "pv-gc"},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
                 "csi": {"driver": DRIVER_NAME, "volumeHandle": "vol-gc"}}})
    driver = start_pod_driver(workdir, api, extra=("--cache-sweep-seconds", "1"))
    try:
        staging, target = driver.target("globalmount"), driver.target()
        driver.stage("vol-gc", staging, context, secrets=secrets_of(seaweed))
        driver.publish_staged("vol-gc", staging, target, context, secrets=secrets_of(seaweed))
        assert (target / "part-1.bin").read_bytes() == files["part-1.bin"]
        driver.unpublish("vol-gc", target)
        driver.unstage("vol-gc", staging)
        cache = driver.cache_root / "volumes" / cache_dir_name("vol-gc")
        assert cache.is_dir()
        wait_for("a sweep with the PersistentVolume present",
                 lambda: ("list", "persistentvolumes", None) in api.calls(USER_AGENT))
        time.sleep(1.5)  # one more round (every second here) with the PV present
        assert cache.is_dir(), "the cache of a volume that still exists was removed"
        core.delete_persistent_volume("pv-gc")
        wait_for("the deleted volume's cache to go", lambda: not cache.exists(), 30)
        assert "removed the cache of volume vol-gc" in driver.log_text()
    finally:
        stop_driver(driver)
