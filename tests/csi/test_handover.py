"""The FUSE fd handover on real FUSE mounts of SeaweedFS: the node plugin mounts /dev/fuse and hands
the fd to an unprivileged daemon; the daemon serves on after the plugin is SIGKILLed; the daemon's
death leaves ENOTCONN, which the next publish of the volume recovers; a daemon that cannot start
leaves neither a mount nor a process behind.

The daemon runs as uid/gid 65532, the image's uid, which has no passwd entry (as in the image), with a
container runtime's environment (no USER/LOGNAME, HOME=/), through the system's python3.X of the same
version as the test's, with the test's packages on PYTHONPATH: the test interpreter itself lives under /root (mode
0700), which no other user may execute. Where no such interpreter can import the daemon, it runs as
root with an empty capability set (``setpriv --bounding-set=-all``) instead. Either way it holds no
capability: it could not mount, unmount, or write sysfs."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from cachefs import mounts
from cachefs.client import call
from cachefs.tuning import FUSE_READ_AHEAD_KB
from csi_driver import fusefd
from csi_driver.attributes import CacheOptions, Credentials, parse_volume_attributes
from csi_driver.errors import Code, CsiError
from csi_driver.handover import HandoverMounter
from csi_driver.launchers import FakeLauncher, ProcessLauncher, daemon_name
from csi_driver.mounter import MountRequest
from csi_driver.node import NodeOps, NodeSettings, PublishRequest
from csi_driver.trust import VolumeTrust
from tests.csi.conftest import driver_environ
from tests.csi.test_node_service import context_for, read_tree
from tests.support.kubelet import runtime_environ

pytestmark = [pytest.mark.fuse, pytest.mark.s3]

MiB = 1024 * 1024
WAIT_S = 60.0
NO_CAPS = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--ambient-caps=-all", "--no-new-privs", "--"]
# The uid the manifests run cachefs as (deploy/): no passwd entry here, as in the image (issue 23).
DAEMON_UID = 65532

# The "node plugin": stages and publishes one volume through HandoverMounter + ProcessLauncher, says
# READY, and waits to be killed. Its credentials come through its environment, never its argv.
PLUGIN = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    from csi_driver.attributes import Credentials, parse_volume_attributes
    from csi_driver.handover import HandoverMounter
    from csi_driver.launchers import ProcessLauncher
    from csi_driver.node import NodeOps, NodeSettings, PublishRequest
    from csi_driver.trust import VolumeTrust

    cfg = json.loads(sys.stdin.read())
    env = {k: v for k, v in os.environ.items() if k not in ("TEST_KEY", "TEST_SECRET")}
    launcher = ProcessLauncher(Path(cfg["run_root"]), command=cfg["daemon_command"], environ=env)
    # The test's store listens on 127.0.0.1, as a one-node cluster's might (csi_driver.trust).
    ops = NodeOps(NodeSettings("node", Path(cfg["cache_root"]), 0, Path(cfg["state_dir"]),
                               VolumeTrust(allow_local_endpoints=True)),
                  HandoverMounter(launcher, Path(cfg["run_root"]), environ=env, daemon_uid=cfg["uid"],
                                  daemon_gid=cfg["uid"]))
    creds = Credentials(os.environ["TEST_KEY"], os.environ["TEST_SECRET"])
    volume = parse_volume_attributes(cfg["context"])
    ops.stage(PublishRequest("vol-h", Path(cfg["staging"]), volume, False, creds))
    ops.publish_staged(PublishRequest("vol-h", Path(cfg["pod"]), volume, False, creds), Path(cfg["staging"]))
    print("READY", flush=True)
    time.sleep(600)
""")


@pytest.fixture
def node_dirs() -> Iterator[dict[str, Path]]:
    # Short (unix socket paths), and traversable by the daemon's user (pytest's tmp dirs are 0700).
    base = Path(tempfile.mkdtemp(prefix="hv-", dir="/tmp"))
    base.chmod(0o755)
    dirs = {"run_root": base / "run", "cache_root": base / "cache", "state_dir": base / "state",
            "staging": base / "staging" / "globalmount", "pod": base / "pod" / "mount"}
    dirs["pod"].parent.mkdir(parents=True)
    try:
        yield dirs
    finally:
        for target in (dirs["pod"], dirs["staging"]):
            while mounts.find_mount(target) is not None:
                subprocess.run(["umount", "-l", str(target)], capture_output=True, timeout=30)
        launcher = ProcessLauncher(dirs["run_root"])
        for name in launcher.names():  # only daemons started under this test's run root
            launcher.stop(name, 10)
        shutil.rmtree(base, ignore_errors=True)


def unprivileged_daemon() -> tuple[list[str], int | None, str]:
    """(command, uid, PYTHONPATH) of a daemon that holds no capability: as DAEMON_UID where the system
    interpreter of this Python version can import the daemon, else as root with no capabilities."""
    packages = sysconfig.get_paths()["purelib"]
    pythonpath = f"{os.getcwd()}:{packages}"
    system = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
    if system.exists() and shutil.which("setpriv"):
        probe = subprocess.run(
            ["setpriv", f"--reuid={DAEMON_UID}", f"--regid={DAEMON_UID}", "--clear-groups", str(system), "-c",
             "import cachefs.daemon.main"],
            capture_output=True, timeout=60, cwd="/", env={"PATH": "/usr/bin:/bin", "PYTHONPATH": pythonpath})
        if probe.returncode == 0:
            return [str(system), "-m", "cachefs"], DAEMON_UID, pythonpath
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    return [*NO_CAPS, sys.executable, "-m", "cachefs"], None, pythonpath


@pytest.fixture
def dataset(seaweed) -> tuple[str, dict[str, bytes]]:
    bucket = f"handover-{uuid.uuid4().hex[:12]}"
    seaweed.make_bucket(bucket)
    files = {"train/a.bin": os.urandom(2 * MiB + 5), "train/sub/b.txt": b"hello\n"}
    seaweed.put_many(bucket, files.items())
    return bucket, {key.removeprefix("train/"): data for key, data in files.items()}


def mountinfo_lines(*targets: Path) -> list[tuple[str, str, str, str, str]]:
    """(mountpoint, major:minor, fstype, source, super options) of each mount at ``targets``."""
    wanted = {str(t) for t in targets}
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if fields[4] in wanted:
            found.append((fields[4], fields[2], tail[0], tail[1], tail[2]))
    return found


def capabilities(pid: int) -> dict[str, int]:
    caps = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("CapEff", "CapPrm", "CapBnd"):
            caps[key] = int(value.strip(), 16)
    return caps


def wait_broken(path: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            os.statvfs(path)
        except OSError as exc:
            assert exc.errno in (errno.ENOTCONN, errno.ECONNABORTED), exc
            return
        assert time.monotonic() < deadline, f"{path} did not break"
        time.sleep(0.05)


def test_unprivileged_daemon_serves_on_after_the_plugin_is_killed(seaweed, dataset, node_dirs) -> None:
    bucket, files = dataset
    staging, pod, run_root = node_dirs["staging"], node_dirs["pod"], node_dirs["run_root"]
    context = context_for(seaweed, bucket, fuseThreads="3")
    daemon_command, uid, pythonpath = unprivileged_daemon()
    config = {**{k: str(v) for k, v in node_dirs.items()}, "context": context,
              "daemon_command": daemon_command, "uid": uid}
    env = {**runtime_environ(driver_environ(), uid or 0), "PYTHONPATH": pythonpath, "TEST_KEY": seaweed.access_key,
           "TEST_SECRET": seaweed.secret_key}
    plugin = subprocess.Popen([sys.executable, "-c", PLUGIN], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=env, text=True)
    try:
        out, err = "", ""
        assert plugin.stdin is not None and plugin.stdout is not None
        plugin.stdin.write(json.dumps(config))
        plugin.stdin.close()
        line = plugin.stdout.readline()  # READY, or EOF if the plugin failed
        if line.strip() != "READY":
            plugin.wait(timeout=WAIT_S)
            pytest.fail(f"the plugin failed: {plugin.stderr.read() if plugin.stderr else ''}")

        # One FUSE connection for the volume: the staged mount and the pod's bind share one device,
        # and the mount table shows what a `cachefs mount` by hand shows: the bucket URL as the source.
        lines = mountinfo_lines(staging, pod)
        assert len(lines) == 2 and len({device for _, device, *_ in lines}) == 1, lines
        for _, _, fstype, source, options in lines:
            assert (fstype, source) == ("fuse.cachefs", context["source"])
            assert options.split(",")[1:] == ["user_id=0", "group_id=0", "default_permissions", "allow_other"]
        names = ProcessLauncher(run_root).names()
        assert names == [daemon_name(staging)]
        record = json.loads((run_root / names[0] / "daemon.json").read_text())
        daemon = int(record["pid"])
        assert int(call(pod, "/info")["pid"]) == daemon
        caps = capabilities(daemon)
        assert caps["CapEff"] == 0 and caps["CapPrm"] == 0, caps  # no CAP_SYS_ADMIN, nor any other
        # fuseThreads 3: the plugin handed the daemon two clones of the connection with the mounted fd
        # (the daemon may not open /dev/fuse: root's alone here, absent from a mount pod's /dev), one
        # reader thread each.
        (daemon_log,) = node_dirs["cache_root"].rglob("daemon.log")
        assert "3 threads read the mount's requests" in daemon_log.read_text()
        assert "cannot clone" not in daemon_log.read_text()
        if uid is not None:
            assert os.stat(f"/proc/{daemon}").st_uid == uid  # runs as the image's uid
            assert os.stat(run_root / names[0]).st_uid == uid
            # Files keep the plugin's owner, not the daemon's.
            assert (os.stat(pod / "a.bin").st_uid, os.stat(pod / "a.bin").st_gid) == (os.geteuid(), os.getegid())
        else:
            assert caps["CapBnd"] == 0, caps
        assert seaweed.secret_key not in Path(f"/proc/{daemon}/cmdline").read_text()
        assert os.getsid(daemon) == daemon  # its own session, not the plugin's
        # The plugin tuned the connection (sysfs), which the daemon without capabilities could not.
        dev = os.stat(staging).st_dev
        read_ahead = Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")
        if read_ahead.exists():
            assert int(read_ahead.read_text()) == FUSE_READ_AHEAD_KB

        # A pod reads on while the plugin is SIGKILLed.
        stop, reads, errors = threading.Event(), [0], []

        def reader() -> None:
            while not stop.is_set() and reads[0] < 1_000_000:
                try:
                    assert (pod / "sub" / "b.txt").read_bytes() == files["sub/b.txt"]
                    reads[0] += 1
                except (OSError, AssertionError) as exc:
                    errors.append(exc)
                    return

        thread = threading.Thread(target=reader)
        thread.start()
        try:
            plugin.send_signal(signal.SIGKILL)  # the plugin this test started, after its handover
            plugin.wait(timeout=WAIT_S)
        finally:
            reads_at_kill = reads[0]
            time.sleep(0.5)  # let the pod read on after the plugin is gone (not a timing assertion)
            stop.set()
            thread.join(WAIT_S)
        assert errors == [] and reads[0] > reads_at_kill, (errors, reads)
        assert read_tree(pod) == files  # the daemon holds the only fd: it serves on
        (pod / "written-after-kill.txt").write_bytes(b"still here\n")
        flushed = subprocess.run([sys.executable, "-m", "cachefs", "flush", str(pod), "--timeout", "60"],
                                 capture_output=True, text=True, timeout=90)
        assert flushed.returncode == 0, flushed.stderr

        # The daemon dies: with no other holder of the fd the kernel ends the connection.
        os.kill(daemon, signal.SIGKILL)  # the daemon this test's plugin started, by its PID
        wait_broken(pod)
        wait_broken(staging)

        # A restarted plugin: reports the broken volume, and the next publish recovers it.
        restarted_env = {**runtime_environ(driver_environ(), uid or 0), "PYTHONPATH": pythonpath}
        launcher = ProcessLauncher(run_root, command=daemon_command, environ=restarted_env)
        ops = NodeOps(NodeSettings("node", node_dirs["cache_root"], 0, node_dirs["state_dir"],
                                   VolumeTrust(allow_local_endpoints=True)),
                      HandoverMounter(launcher, run_root, environ=restarted_env, daemon_uid=uid, daemon_gid=uid))
        assert [r.volume_id for r in ops.adopt()] == ["vol-h"]
        creds = Credentials(seaweed.access_key, seaweed.secret_key)
        volume = parse_volume_attributes(context)
        ops.publish_staged(PublishRequest("vol-h", pod, volume, False, creds), staging)
        assert read_tree(pod) == {**files, "written-after-kill.txt": b"still here\n"}
        assert int(call(pod, "/info")["pid"]) != daemon
        # The new daemon got its clones too: the saved spec keeps fuseThreads.
        assert daemon_log.read_text().count("3 threads read the mount's requests") == 2
        # The pod's new bind is stacked on its dead one (a running container holds the first and sees
        # only what is mounted on top of it: issue 36); the top and the staged mount share one device.
        lines = mountinfo_lines(staging, pod)
        (staged,) = [line for line in lines if line[0] == str(staging)]
        layers = [line for line in lines if line[0] == str(pod)]
        assert len(layers) == 2 and layers[-1][1] == staged[1] != layers[0][1], lines

        ops.unpublish("vol-h", pod)
        ops.unstage("vol-h", staging)
        assert mounts.find_mount(staging) is None and mounts.find_mount(pod) is None
        assert launcher.names() == [] and not (run_root / daemon_name(staging)).exists()
    finally:
        if plugin.poll() is None:
            plugin.kill()  # the plugin this test started
            plugin.wait(timeout=WAIT_S)


def test_a_daemon_that_cannot_start_leaves_no_mount_and_no_process(seaweed, node_dirs) -> None:
    run_root, target = node_dirs["run_root"], node_dirs["staging"]
    target.mkdir(parents=True)
    launcher = ProcessLauncher(run_root, environ=driver_environ())
    mounter = HandoverMounter(launcher, run_root, environ=driver_environ(), mount_timeout_s=WAIT_S)
    creds = Credentials(seaweed.access_key, seaweed.secret_key)
    base = MountRequest(source=f"s3://missing-{uuid.uuid4().hex[:10]}/x", target=target,
                        cache_dir=node_dirs["cache_root"] / "slot-0", endpoint_url=seaweed.endpoint_url,
                        credentials=creds, cache=CacheOptions(ram_bytes=16 * MiB, disk_bytes=64 * MiB))

    with pytest.raises(CsiError) as info:  # the store refuses: the daemon reports ERR
        mounter.mount(base)
    assert info.value.code == Code.INTERNAL and "missing-" in info.value.message, info.value.message
    assert seaweed.secret_key not in info.value.message
    assert mounts.find_mount(target) is None and launcher.names() == []
    assert not (run_root / daemon_name(target)).exists()

    invalid = MountRequest(**{**base.__dict__, "cache": CacheOptions(disk_bytes=0)})
    with pytest.raises(CsiError) as info:  # cachefs refuses its arguments: the daemon reports BAD
        mounter.mount(invalid)
    assert info.value.code == Code.INVALID_ARGUMENT and "disk cache" in info.value.message, info.value.message
    assert mounts.find_mount(target) is None and launcher.names() == []


def test_fusefd_mount_looks_like_a_cachefs_mount_and_aborts_with_its_last_fd(tmp_path: Path) -> None:
    target = tmp_path / "mnt"
    target.mkdir()
    fd = fusefd.mount_fuse(target, read_only=True, source="s3://user:secret@bucket/prefix?x=1")
    try:
        lines = mountinfo_lines(target)
        assert len(lines) == 1 and lines[0][2:4] == ("fuse.cachefs", "s3://bucket/prefix")
        assert mounts.find_mount(target) is not None and mounts.is_cachefs_mount(target)
        assert "ro" in lines[0][4].split(",")
    finally:
        os.close(fd)  # nobody holds the connection now: every access fails at once, none hangs
    try:
        wait_broken(target)
    finally:
        fusefd.unmount(target, lazy=True)
    assert mounts.find_mount(target) is None


class _NeverConnects(FakeLauncher):
    """Starts nothing, and says after a few looks that the daemon is gone."""

    def __init__(self) -> None:
        super().__init__()
        self.looks = 0

    def is_running(self, name: str) -> bool:
        self.looks += 1
        return self.looks < 3 and super().is_running(name)


@pytest.mark.parametrize("launcher", [FakeLauncher, _NeverConnects])
@pytest.mark.parametrize("read_only", [False, True])
def test_a_launch_that_fails_leaves_no_mount(node_dirs, launcher, read_only: bool) -> None:
    target = node_dirs["staging"]
    target.mkdir(parents=True)
    fake = launcher()
    if type(fake) is FakeLauncher:
        fake.fail_next = CsiError(Code.UNAVAILABLE, "the API server is down")
    mounter = HandoverMounter(fake, node_dirs["run_root"], environ={}, mount_timeout_s=WAIT_S)
    request = MountRequest(source="s3://bucket/x", target=target, cache_dir=node_dirs["cache_root"] / "slot-0",
                           read_only=read_only)
    with pytest.raises(CsiError) as info:
        mounter.mount(request)
    assert mounts.find_mount(target) is None  # the plugin's own mount was undone
    assert mounter.brokers == {}  # nor a passthrough broker left serving
    assert not (node_dirs["run_root"] / daemon_name(target)).exists()
    assert ("stop", daemon_name(target)) in fake.calls
    if type(fake) is FakeLauncher:
        assert info.value.code == Code.UNAVAILABLE
    else:
        assert "exited before taking the mount" in info.value.message
