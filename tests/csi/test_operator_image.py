"""cachefs-operator's real entry point as the image runs it: uid 65532 with no passwd entry, a read-only root.

The kubelet stand-in (tests/support/kubelet.py) runs the pod built from the operator's Deployment, as
deploy/overlays/with-datasets renders it with real kustomize, the way a container runtime would: as
the uid the manifest declares (65532, which has no passwd entry here, as in the image), with a
runtime's environment (no USER/LOGNAME, HOME=/), ``/`` read-only, the downward API's POD_NAME. The
operator must start and act on a Dataset. (On a real 1.28 cluster it crashed in a restart loop: kopf
named itself by ``getpass.getuser()``, ``KeyError: 'getpwuid(): uid not found: 65532'``; issue 23.)

Needs root (setpriv to another uid, a mount namespace for the read-only root): skipped otherwise.
"""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from kubernetes import client

from csi_driver.operator import manifests as m
from tests.csi.conftest import driver_environ
from tests.csi.kustomize import kustomize_build
from tests.csi.test_manifests import DEPLOY
from tests.support.kubeapi import ApiDouble, OperatorApiServer
from tests.support.kubelet import Kubelet
from tests.support.s3servers import refusing_port

NODE, DRIVER_NS, NS = "node-a", "cachefs", "ml"
START_WAIT_S = 60.0  # interpreter, kubernetes client and kopf imports as another user, on a busy machine


def wait_for(check: Any, what: str, timeout_s: float = START_WAIT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def runs_as(pid: int, uid: int) -> None:
    """Once the wrappers (mount namespace, setpriv) have exec'd the command: it runs as ``uid``."""
    wait_for(lambda: f"Uid:\t{uid}\t{uid}" in Path(f"/proc/{pid}/status").read_text(), f"pid {pid} as uid {uid}")


@pytest.fixture
def workdir() -> Iterator[Path]:
    if os.geteuid() != 0 or shutil.which("setpriv") is None or shutil.which("unshare") is None:
        pytest.skip("running a pod as another uid on a read-only root needs root, setpriv and unshare")
    path = Path(tempfile.mkdtemp(prefix="opimg-", dir="/tmp"))
    path.chmod(0o755)  # the kubeconfig in it is read by uid 65532
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def operator_pod(port: int, kubeconfig: Path) -> dict[str, Any]:
    (deployment,) = [o for o in kustomize_build(DEPLOY / "overlays" / "with-datasets")
                     if o["kind"] == "Deployment" and o["metadata"]["name"] == "cachefs-operator"]
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    # Outside a cluster: the API double's kubeconfig instead of a service account, and the liveness
    # endpoint on a free loopback port instead of 8080 (other tests run beside this one).
    container["env"] = [*container.get("env", []), {"name": "KUBECONFIG", "value": str(kubeconfig)}]
    container["args"] = ["--liveness", f"http://127.0.0.1:{port}/healthz", "--follow-interval", "1"]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "cachefs-operator-7d9f-x1", "namespace": DRIVER_NS,
                         "labels": deployment["spec"]["template"]["metadata"]["labels"]},
            "spec": {**spec, "nodeName": NODE}}


@pytest.fixture
def liveness_port() -> Iterator[int]:
    """The operator's liveness port: held until the test ends, so that no other test's server takes it
    before the operator binds it (kopf's endpoint binds with ``SO_REUSEADDR`` and takes it over)."""
    with refusing_port() as port:
        yield port


def test_the_operator_runs_as_its_image_does_with_no_passwd_entry(workdir: Path, liveness_port: int) -> None:
    pod = operator_pod(liveness_port, workdir / "kubeconfig")
    (container,) = pod["spec"]["containers"]
    uid = pod["spec"]["securityContext"]["runAsUser"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    with pytest.raises(KeyError):
        pwd.getpwuid(uid)  # as in the image: the uid has no passwd entry
    api = ApiDouble(workdir, emulator=OperatorApiServer).start()
    (workdir / "kubeconfig").chmod(0o644)
    env = {k: v for k, v in driver_environ().items() if not k.startswith(("KUBE", "POD_"))}
    kubelet = Kubelet(api.client(), NODE, DRIVER_NS, workdir / "containers", env).start()
    try:
        core = api.client()
        core.create_namespaced_pod(DRIVER_NS, pod)
        running = wait_for(lambda: kubelet.running(pod["metadata"]["name"]), "the operator's container")
        runs_as(running.proc.pid, uid)
        custom = client.CustomObjectsApi(core.api_client)
        custom.create_namespaced_custom_object(m.GROUP, m.VERSION, NS, m.PLURAL, {
            "apiVersion": f"{m.GROUP}/{m.VERSION}", "kind": "Dataset", "metadata": {"name": "imagenet", "namespace": NS},
            "spec": {"source": "s3://training/imagenet", "warmUp": {"target": {"tier": "Node"}}}})

        def volume() -> bool:
            assert running.proc.poll() is None, running.log_path.read_text()[-3000:]
            return any(key[2] == m.pv_name(NS, "imagenet") and not obj.deleted
                       for key, obj in list(api.emulator.objects.items()))

        wait_for(volume, "the operator to create the Dataset's PersistentVolume")
        log = running.log_path.read_text()
        assert "Traceback" not in log and "getpwuid" not in log, log[-3000:]
    finally:
        kubelet.stop()
        api.stop()


def test_the_controller_plugin_runs_as_its_image_does_with_no_passwd_entry(workdir: Path) -> None:
    """cachefs-csi from the controller Deployment (uid 65532, read-only root, the image's ENTRYPOINT),
    answering on its socket in the pod's emptyDir."""
    import grpc

    from csi_driver.proto import csi_pb2, csi_pb2_grpc

    (deployment,) = [o for o in kustomize_build(DEPLOY / "overlays" / "example")
                     if o["kind"] == "Deployment" and o["metadata"]["name"] == "cachefs-csi-controller"]
    spec = deployment["spec"]["template"]["spec"]
    plugin = next(c for c in spec["containers"] if c["name"] == "cachefs-csi")
    assert "command" not in plugin  # the image's ENTRYPOINT
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "cachefs-csi-controller-x1", "namespace": DRIVER_NS},
           "spec": {**spec, "containers": [plugin], "nodeName": NODE}}  # the sidecar is not ours to run
    api = ApiDouble(workdir).start()
    kubelet = Kubelet(api.client(), NODE, DRIVER_NS, workdir / "containers", driver_environ()).start()
    try:
        api.client().create_namespaced_pod(DRIVER_NS, pod)
        running = wait_for(lambda: kubelet.running(pod["metadata"]["name"]), "the plugin's container")
        uid = spec["securityContext"]["runAsUser"]
        runs_as(running.proc.pid, uid)
        (socket_dir,) = (workdir / "containers" / "volumes").glob("*/socket-dir")
        channel = grpc.insecure_channel(f"unix://{socket_dir / 'csi.sock'}")

        def probed() -> bool:
            assert running.proc.poll() is None, running.log_path.read_text()[-3000:]
            try:
                return bool(csi_pb2_grpc.IdentityStub(channel).Probe(csi_pb2.ProbeRequest(), timeout=2))
            except grpc.RpcError:
                return False

        wait_for(probed, "the plugin to answer on its socket")
        channel.close()
    finally:
        kubelet.stop()
        api.stop()
