"""The FlexVolume driver called exactly as the kubelet calls it: the executable, argv, one JSON
options argument with base64 Secret values, and one JSON reply read from stdout+stderr together."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from cachefs import mounts
from tests.csi.conftest import cleanup_mount, daemon_pid, driver_environ

MiB = 1024 * 1024


def flex_command() -> list[str]:
    exe = Path(sys.executable).with_name("cachefs-flex")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "csi_driver.flex"]


def run_flex(env: dict[str, str], *argv: str) -> tuple[int, dict]:
    # The kubelet runs the driver with CombinedOutput: stderr is part of the reply it parses.
    result = subprocess.run([*flex_command(), *argv], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env, timeout=180, text=True)
    return result.returncode, json.loads(result.stdout)


@pytest.fixture
def flex_env(tmp_path: Path) -> dict[str, str]:
    return {**driver_environ(), "CACHEFS_FLEX_CACHE_ROOT": str(tmp_path / "flex-cache"),
            "CACHEFS_FLEX_LOG": str(tmp_path / "flex.log"), "CACHEFS_FLEX_ALLOW_LOCAL_ENDPOINTS": "true"}


def test_init_and_unsupported_calls(flex_env) -> None:
    assert run_flex(flex_env, "init") == (0, {"status": "Success", "capabilities": {"attach": False, "fsGroup": False}})
    for argv in (["attach", "{}", "node-1"], ["getvolumename", "{}"], ["mountdevice", "/x", "/y", "{}"]):
        code, reply = run_flex(flex_env, *argv)
        assert code == 1 and reply["status"] == "Not supported"
    code, reply = run_flex(flex_env, "mount", "/tmp/x")
    assert code == 1 and reply["status"] == "Failure"


@pytest.mark.fuse
@pytest.mark.s3
def test_mount_read_unmount_as_the_kubelet_does(flex_env, seaweed, tmp_path: Path) -> None:
    bucket = f"flex-{uuid.uuid4().hex[:12]}"
    seaweed.make_bucket(bucket)
    data = os.urandom(2 * MiB + 3)
    seaweed.put(bucket, "ds/shard-0.bin", data)
    pod_dir = tmp_path / "pods" / str(uuid.uuid4()) / "volumes" / "cachefs.io~cachefs"
    target = pod_dir / "dataset"
    target.mkdir(parents=True)  # the kubelet creates the directory before calling mount
    options = {
        "source": f"s3://{bucket}/ds", "endpointUrl": seaweed.endpoint_url, "ramCache": "64MiB",
        "kubernetes.io/fsType": "", "kubernetes.io/readwrite": "ro",
        "kubernetes.io/pod.name": "trainer-0", "kubernetes.io/pod.namespace": "ml",
        "kubernetes.io/pod.uid": str(uuid.uuid4()), "kubernetes.io/pvOrVolumeName": "dataset",
        "kubernetes.io/serviceAccount.name": "default",
        "kubernetes.io/secret/accessKeyId": base64.b64encode(seaweed.access_key.encode()).decode(),
        "kubernetes.io/secret/secretAccessKey": base64.b64encode(seaweed.secret_key.encode()).decode(),
    }
    try:
        assert run_flex(flex_env, "mount", str(target), json.dumps(options)) == (0, {"status": "Success"})
        assert (target / "shard-0.bin").read_bytes() == data
        pid = daemon_pid(target)
        assert seaweed.secret_key not in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
        # Mounting again (a kubelet retry) is a success, not a second mount.
        assert run_flex(flex_env, "mount", str(target), json.dumps(options)) == (0, {"status": "Success"})
        assert daemon_pid(target) == pid
        assert run_flex(flex_env, "unmount", str(target)) == (0, {"status": "Success"})
        assert mounts.find_mount(target) is None and not target.exists()
        assert run_flex(flex_env, "unmount", str(target)) == (0, {"status": "Success"})

        # A bad option fails with a message naming it, and the reply is still one JSON object.
        target.mkdir()
        code, reply = run_flex(flex_env, "mount", str(target), json.dumps({**options, "diskCache": "huge"}))
        assert code == 1 and reply["status"] == "Failure" and "diskCache" in reply["message"]
        wrong = {**options, "kubernetes.io/secret/secretAccessKey": base64.b64encode(b"WRONG-secret-value").decode()}
        code, reply = run_flex(flex_env, "mount", str(target), json.dumps(wrong))
        assert code == 1 and reply["status"] == "Failure" and "WRONG-secret-value" not in reply["message"]
    finally:
        cleanup_mount(target)
    log = Path(flex_env["CACHEFS_FLEX_LOG"]).read_text()
    assert "published volume" in log
    for value in (seaweed.secret_key, seaweed.access_key, "WRONG-secret-value"):
        assert value not in log


def test_the_node_identity_is_not_lent_to_inline_volumes_on_a_true(flex_env, tmp_path: Path) -> None:
    """Issue 34: with CACHEFS_FLEX_ALLOW_NODE_IDENTITY=true every inline flexVolume without a Secret got the
    node's identity. A FlexVolume driver cannot tell such a volume from an admin's PersistentVolume (the
    kubelet hands both the same options), so 'true' now fails every mount, saying why."""
    target = tmp_path / "pods" / "p1" / "volumes" / "cachefs.io~cachefs" / "inline"
    target.mkdir(parents=True)
    options = {"source": "s3://some-bucket/ds", "kubernetes.io/readwrite": "ro",
               "kubernetes.io/pvOrVolumeName": "inline", "kubernetes.io/pod.name": "p1"}
    code, reply = run_flex({**flex_env, "CACHEFS_FLEX_ALLOW_NODE_IDENTITY": "true"}, "mount", str(target),
                           json.dumps(options))
    assert code == 1 and reply["status"] == "Failure"
    assert "CACHEFS_FLEX_ALLOW_NODE_IDENTITY='true' is not accepted" in reply["message"]
    assert "every-pod-author" in reply["message"] and not os.path.ismount(target)
