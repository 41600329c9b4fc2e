"""Fixtures for the CSI driver tests: the real ``cachefs-csi`` process on a real unix socket.

``driver`` starts ``cachefs-csi --mode all`` in a subprocess (once per module), with an environment
that holds *no* AWS credentials: every mount must get its key pair from the CSI secrets of its
request, which is what the tests check. Its log (DEBUG, so request fields are logged) goes to a file
the tests read. A gRPC channel and the three service stubs come with it.

Tests marked ``fuse`` need /dev/fuse: they skip with a reason where it is missing, except when
CACHEFS_REQUIRE_FUSE=1 (CI), where they fail. Every target a test publishes is unpublished (or, if
that fails, lazily unmounted) at teardown, and only daemons started by the driver under test are
ever killed, by PID.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest

from cachefs import mounts
from csi_driver.proto import csi_pb2, csi_pb2_grpc
from tests.fuse.conftest import require_fuse
from tests.support.clusterkeys import write_key_file

DRIVER_START_TIMEOUT_S = 30.0
# Deadline of one gRPC call from a test: a publish waits for `cachefs mount` (bounded at 130 s),
# but on a healthy loopback SeaweedFS it takes about a second.
CALL_TIMEOUT_S = 150.0
STOP_TIMEOUT_S = 15.0

AccessMode = csi_pb2.VolumeCapability.AccessMode


@pytest.fixture(autouse=True)
def _require_fuse(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("fuse") is not None:
        require_fuse("CSI FUSE tests")


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A working directory short enough for the unix sockets made under it (the handover, control
    and run-root sockets); pytest's tmp_path is too long. A test file may override it."""
    path = Path(tempfile.mkdtemp(prefix="csi-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def wait_for(what: str, check: Any, timeout_s: float, poll_s: float = 0.1) -> Any:
    """``check()``'s first truthy value, polled every ``poll_s``; fails the test naming ``what``
    after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll_s)
    return value


def driver_environ() -> dict[str, str]:
    """The driver's environment: no AWS credentials, no config files, no instance metadata."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update({
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
    })
    return env


def mount_capability(mode: int = AccessMode.SINGLE_NODE_WRITER, flags: tuple[str, ...] = ()) -> Any:
    return csi_pb2.VolumeCapability(
        mount=csi_pb2.VolumeCapability.MountVolume(mount_flags=list(flags)),
        access_mode=AccessMode(mode=mode),
    )


def secrets_of(server: Any) -> dict[str, str]:
    return {"accessKeyId": server.access_key, "secretAccessKey": server.secret_key}


def daemon_logs(root: Path) -> list[Path]:
    """The daemon logs under ``root``, sorted; mounts left behind are not entered (a FUSE mount whose
    daemon is gone answers ENOTCONN, which ``rglob`` raised instead of the diagnosis)."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=lambda exc: None):
        dirnames[:] = [d for d in dirnames if not os.path.ismount(os.path.join(dirpath, d))]
        found += [Path(dirpath, f) for f in filenames if f == "daemon.log"]
    return sorted(found)


@dataclass
class Driver:
    """A running ``cachefs-csi`` and a client for it."""

    proc: subprocess.Popen[bytes]
    workdir: Path
    socket: Path
    log_path: Path
    cache_root: Path
    channel: grpc.Channel
    identity: Any
    node: Any
    controller: Any
    metrics_port: int = 0
    targets: list[Path] = field(default_factory=list)

    def metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as response:
            return response.read().decode()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def target(self, name: str | None = None) -> Path:
        """A fresh target path (its parent exists, as the kubelet guarantees; the target does not)."""
        parent = self.workdir / "pods" / uuid.uuid4().hex[:8]
        parent.mkdir(parents=True)
        path = parent / (name or "mount")
        self.targets.append(path)
        return path

    def diagnosis(self) -> str:
        """What a call that ran out of time leaves to read: the plugin's log, each daemon's log, and
        where the plugin's child processes wait (the kernel's wait channel of each thread)."""
        parts = [f"--- {self.log_path} (last 4000 characters)\n{self.log_text()[-4000:]}"]
        for log in daemon_logs(self.cache_root.parent)[:4]:
            with contextlib.suppress(OSError):
                parts.append(f"--- {log} (last 2000 characters)\n{log.read_text(errors='replace')[-2000:]}")
        children = subprocess.run(["ps", "-o", "pid=,stat=,etimes=,args=", "--ppid", str(self.proc.pid)],
                                  capture_output=True, text=True, timeout=10).stdout
        parts.append(f"--- the plugin's children\n{children}")
        for line in children.splitlines():
            pid = line.split()[0]
            with contextlib.suppress(OSError):
                waits = [f"{t}: {Path(f'/proc/{pid}/task/{t}/comm').read_text().strip()} "
                         f"{Path(f'/proc/{pid}/task/{t}/wchan').read_text()}" for t in os.listdir(f"/proc/{pid}/task")]
                parts.append(f"--- threads of {pid}\n" + "\n".join(waits))
        return "\n".join(parts)

    def publish(self, volume_id: str, target: Path, context: dict[str, str], *, secrets: dict[str, str] | None = None,
                readonly: bool = False, capability: Any = None) -> Any:
        try:
            return self.node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
                volume_id=volume_id, target_path=str(target), volume_capability=capability or mount_capability(),
                readonly=readonly, secrets=secrets or {}, volume_context=context,
            ), timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.DEADLINE_EXCEEDED:  # type: ignore[attr-defined]
                raise
            raise AssertionError(f"NodePublishVolume of {volume_id} got no answer in {CALL_TIMEOUT_S:g} s\n"
                                 f"{self.diagnosis()}") from exc

    def stage(self, volume_id: str, staging: Path, context: dict[str, str], *, secrets: dict[str, str] | None = None,
              capability: Any = None) -> Any:
        return self.node.NodeStageVolume(csi_pb2.NodeStageVolumeRequest(
            volume_id=volume_id, staging_target_path=str(staging), volume_capability=capability or mount_capability(),
            secrets=secrets or {}, volume_context=context,
        ), timeout=CALL_TIMEOUT_S)

    def unstage(self, volume_id: str, staging: Path) -> Any:
        return self.node.NodeUnstageVolume(csi_pb2.NodeUnstageVolumeRequest(
            volume_id=volume_id, staging_target_path=str(staging)), timeout=CALL_TIMEOUT_S)

    def publish_staged(self, volume_id: str, staging: Path, target: Path, context: dict[str, str], *,
                       secrets: dict[str, str] | None = None, readonly: bool = False, capability: Any = None) -> Any:
        return self.node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
            volume_id=volume_id, staging_target_path=str(staging), target_path=str(target),
            volume_capability=capability or mount_capability(), readonly=readonly, secrets=secrets or {},
            volume_context=context,
        ), timeout=CALL_TIMEOUT_S)

    def unpublish(self, volume_id: str, target: Path) -> Any:
        return self.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(
            volume_id=volume_id, target_path=str(target)), timeout=CALL_TIMEOUT_S)

    def cleanup_targets(self) -> None:
        for target in reversed(self.targets):
            cleanup_mount(target)
        self.targets.clear()


def cleanup_mount(target: Path) -> None:
    """Unmount whatever a test left at ``target``: ``cachefs unmount``, then lazily if need be."""
    if mounts.find_mount(target) is None:
        return
    subprocess.run([sys.executable, "-m", "cachefs", "unmount", str(target), "--timeout", "20"],
                   capture_output=True, timeout=60)
    if mounts.find_mount(target) is not None:
        subprocess.run(["fusermount3", "-u", "-z", str(target)], capture_output=True, timeout=30)


def daemon_pid(target: Path) -> int:
    """The PID of the cachefs daemon serving ``target``, from its control API."""
    from cachefs.client import call

    return int(call(target, "/info")["pid"])


def driver_run_root(workdir: Path) -> Path:
    """The daemons' run root of the drivers over ``workdir``: short (unix socket paths), and the same
    for a driver restarted over the same workdir, as ``/run/cachefs-csi`` is on a node."""
    return Path("/tmp") / f"csi-run-{hashlib.sha256(str(workdir).encode()).hexdigest()[:12]}"


def start_driver(workdir: Path, *extra: str, env: dict[str, str] | None = None,
                 command: list[str] | None = None) -> Driver:
    """``command``: the driver's program (default this venv's ``cachefs-csi``); its interpreter also
    runs the daemons in process mode."""
    sock_dir = Path(tempfile.mkdtemp(prefix="csi-", dir="/tmp"))  # unix socket paths must stay short
    run_root = driver_run_root(workdir)
    sock = sock_dir / "csi.sock"
    log_path = workdir / "driver.log"
    cache_root = workdir / "node-cache"
    exe = Path(sys.executable).with_name("cachefs-csi")
    if command is None:
        command = [str(exe)] if exe.exists() else [sys.executable, "-m", "csi_driver.main"]
    # The cluster key, as a driver with a cluster store holds it (``--cluster-store-secret`` in pods;
    # here the daemons are the driver's children and inherit the variable).
    env = dict(env or driver_environ())
    env.setdefault("CACHEFS_CLUSTER_KEY_FILE", str(write_key_file(workdir)))
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [*command, "--endpoint", f"unix://{sock}", "--node-id", "test-node", "--mode", "all",
             "--cache-root", str(cache_root), "--run-root", str(run_root), "--log-level", "DEBUG", "--metrics-addr", "127.0.0.1:0",
             # The tests' stores listen on 127.0.0.1, which volumes may not name by default
             # (csi_driver.trust); a test of the allow-list passes its own.
             *([] if "--allowed-endpoints" in extra else ["--allow-local-endpoints"]), *extra],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
        )
    channel = grpc.insecure_channel(f"unix://{sock}")
    identity = csi_pb2_grpc.IdentityStub(channel)
    deadline = time.monotonic() + DRIVER_START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"cachefs-csi exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            identity.Probe(csi_pb2.ProbeRequest(), timeout=2)
            break
        except grpc.RpcError:
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"cachefs-csi did not answer on {sock}:\n{log_path.read_text()[-3000:]}") from None
            time.sleep(0.1)
    # Port 0: the kernel chose a free port (one found free here could be taken before the driver
    # bound it); the driver names it in its log before it serves gRPC.
    # (The log is appended to by each driver of the workdir: the last line is this one's.)
    bound = re.findall(r"serving metrics on 127\.0\.0\.1:(\d+)", log_path.read_text())
    if not bound:
        proc.kill()
        raise RuntimeError(f"cachefs-csi did not say where it serves metrics:\n{log_path.read_text()[-3000:]}")
    return Driver(proc, workdir, sock, log_path, cache_root, channel, identity,
                  csi_pb2_grpc.NodeStub(channel), csi_pb2_grpc.ControllerStub(channel), int(bound[-1]))


def stop_driver(driver: Driver) -> None:
    driver.cleanup_targets()
    driver.channel.close()
    if driver.proc.poll() is None:
        driver.proc.send_signal(signal.SIGTERM)
        try:
            driver.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            driver.proc.kill()
            driver.proc.wait(timeout=STOP_TIMEOUT_S)
    shutil.rmtree(driver.socket.parent, ignore_errors=True)
    # The daemons' run directories, once none of their daemons runs (a target cleaned up with
    # `cachefs unmount` rather than through the driver leaves its directory behind).
    from csi_driver.launchers import ProcessLauncher

    run_root = driver_run_root(driver.workdir)
    if not ProcessLauncher(run_root).names():
        shutil.rmtree(run_root, ignore_errors=True)


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Driver]:
    d = start_driver(tmp_path_factory.mktemp("csi"))
    try:
        yield d
    finally:
        stop_driver(d)


@pytest.fixture
def csi(driver: Driver) -> Iterator[Driver]:
    """The module's driver, with every target this test published cleaned up afterwards."""
    try:
        yield driver
    finally:
        driver.cleanup_targets()


@contextlib.contextmanager
def expect_rpc_error(code: grpc.StatusCode, *fragments: str) -> Iterator[list[str]]:
    details: list[str] = []
    with pytest.raises(grpc.RpcError) as info:
        yield details
    assert info.value.code() == code, f"{info.value.code()} {info.value.details()}"
    details.append(info.value.details() or "")
    for fragment in fragments:
        assert fragment in details[0], details[0]
