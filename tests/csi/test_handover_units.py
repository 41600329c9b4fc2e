"""Units of the FUSE fd handover: mount options, passing the fd (SCM_RIGHTS), the start-up report,
the daemon's description (no secret in its argv), and ProcessLauncher on real (non-FUSE) processes."""

from __future__ import annotations

import dataclasses

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from cachefs import handover
from cachefs.handover import HandoverError, receive_fd
from csi_driver import fusefd, launchers
from csi_driver.attributes import CacheOptions, Credentials, OwnerOptions
from csi_driver.errors import Code, CsiError
from csi_driver.handover import HandoverMounter, _chown_tree
from csi_driver.launchers import NAME_PREFIX, DaemonSpec, FakeLauncher, ProcessLauncher, daemon_name
from csi_driver.mounter import MountRequest

SECRET = "wJalrXUtnFEMI-handover-unit-secret"


# ------------------------------------------------------------------------------------------ options
def test_mount_options_match_what_libfuse_passes() -> None:
    assert fusefd.mount_options(7, 0o40000) == \
        "fd=7,rootmode=40000,user_id=0,group_id=0,default_permissions,allow_other"
    assert fusefd.mount_options(3, 0o40000, user_id=5, group_id=6, allow_other=False, default_permissions=False) == \
        "fd=3,rootmode=40000,user_id=5,group_id=6"


def test_mount_flags() -> None:
    assert fusefd.mount_flags(read_only=False) == fusefd.MS_NOSUID | fusefd.MS_NODEV
    assert fusefd.mount_flags(read_only=True) & fusefd.MS_RDONLY


def test_daemon_name_is_a_stable_dns_label() -> None:
    name = daemon_name(Path("/var/lib/kubelet/plugins/x/globalmount"))
    assert name == daemon_name(Path("/var/lib/kubelet/plugins/x/globalmount"))
    assert name != daemon_name(Path("/var/lib/kubelet/plugins/y/globalmount"))
    assert name.startswith(NAME_PREFIX) and len(name) <= 63 and name == name.lower()
    assert all(c.isalnum() or c == "-" for c in name)


# ------------------------------------------------------------------------------------ fd passing
def _open_fuse() -> int:
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse")
    return os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)


def test_send_fd_over_a_socketpair_arrives_as_the_same_device() -> None:
    fd = _open_fuse()
    left, right = socket.socketpair()
    try:
        handover.send_fd(left, fd)
        message, fds, _, _ = socket.recv_fds(right, 64, 1)
        assert message == handover.FD_MESSAGE and len(fds) == 1
        assert fds[0] != fd and handover.is_fuse_device(fds[0])
        assert os.fstat(fds[0]).st_rdev == os.fstat(fd).st_rdev
        os.close(fds[0])
    finally:
        os.close(fd)
        left.close()
        right.close()


def test_handover_socket_gives_the_daemon_the_fd(tmp_path: Path) -> None:
    fd = _open_fuse()
    path = tmp_path / "fuse.sock"
    received: list[object] = []

    def daemon() -> None:
        try:
            received.append(receive_fd(path, 10))
        except HandoverError as exc:
            received.append(exc)

    try:
        with fusefd.HandoverSocket(path) as listener:
            assert (os.stat(path).st_mode & 0o777) == 0o600
            thread = threading.Thread(target=daemon)
            thread.start()
            conn = listener.hand_over(fd, time.monotonic() + 10, lambda: True)
            thread.join(10)
        assert not path.exists()  # the socket is removed once the handover is done
        got_fd, clones, daemon_conn = received[0]  # type: ignore[misc]
        assert handover.is_fuse_device(got_fd) and clones == []
        daemon_conn.sendall(b"WARN empty prefix\nOK\n")
        with conn:
            assert fusefd.read_report(conn, time.monotonic() + 10, lambda: True) == (["empty prefix"], None, False)
        os.close(got_fd)
        daemon_conn.close()
    finally:
        os.close(fd)


def test_clones_of_a_mounted_connection_travel_with_it_up_to_what_the_daemon_takes(tmp_path: Path) -> None:
    """The plugin opens clones for the daemon's reader threads (a mount pod has no /dev/fuse); a daemon
    that takes fewer (an older one takes none) gets the first ones, the kernel drops the rest."""
    if os.geteuid() != 0:
        pytest.skip("mounting /dev/fuse needs root")
    _open_fuse()  # (skips where there is none)
    target = tmp_path / "mnt"
    target.mkdir()
    fd = fusefd.mount_fuse(target, read_only=True, source="s3://bucket/x")
    try:
        clones = handover.clone_fuse(fd, 3)
        assert len(clones) == 3 and all(handover.is_fuse_device(c) for c in clones)
        for max_clones, expected in ((3, 3), (1, 1), (0, 0)):
            path = tmp_path / f"fuse-{max_clones}.sock"
            received: list[object] = []
            thread = threading.Thread(target=lambda: received.append(receive_fd(path, 10, max_clones)))
            with fusefd.HandoverSocket(path) as listener:
                thread.start()
                listener.hand_over(fd, time.monotonic() + 10, lambda: True, clones).close()
                thread.join(10)
            got_fd, got_clones, conn = received[0]  # type: ignore[misc]
            assert len(got_clones) == expected and all(handover.is_fuse_device(c) for c in got_clones)
            for own in (got_fd, *got_clones):
                os.close(own)
            conn.close()
        for clone in clones:
            os.close(clone)
        # An unmounted descriptor has no connection to clone: none, and no error.
        unmounted = _open_fuse()
        assert handover.clone_fuse(unmounted, 2) == []
        os.close(unmounted)
    finally:
        os.close(fd)
        fusefd.unmount(target, lazy=True)


def test_receive_refuses_a_descriptor_that_is_not_dev_fuse(tmp_path: Path) -> None:
    path = tmp_path / "fuse.sock"
    read_end, write_end = os.pipe()
    errors: list[HandoverError] = []

    def daemon() -> None:
        with pytest.raises(HandoverError, match="did not hand over a /dev/fuse descriptor") as info:
            receive_fd(path, 10)
        errors.append(info.value)

    try:
        with fusefd.HandoverSocket(path) as listener:
            thread = threading.Thread(target=daemon)
            thread.start()
            listener.hand_over(read_end, time.monotonic() + 10, lambda: True).close()
            thread.join(10)
        assert len(errors) == 1
    finally:
        os.close(read_end)
        os.close(write_end)


def test_receive_without_a_listener_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(HandoverError, match="cannot receive the FUSE descriptor"):
        receive_fd(tmp_path / "nobody.sock", 1)


def test_hand_over_gives_up_when_the_daemon_is_gone(tmp_path: Path) -> None:
    with fusefd.HandoverSocket(tmp_path / "fuse.sock") as listener:
        with pytest.raises(HandoverError, match="exited before taking the mount"):
            listener.hand_over(0, time.monotonic() + 60, lambda: False)
        with pytest.raises(fusefd.HandoverTimeout):
            listener.hand_over(0, time.monotonic() - 1, lambda: True)


def test_socket_paths_too_long_are_refused(tmp_path: Path) -> None:
    with pytest.raises(HandoverError, match="longer than"):
        fusefd.HandoverSocket(tmp_path / ("x" * 120))


# ----------------------------------------------------------------------------------------- report
@pytest.mark.parametrize("lines, expected", [
    (b"OK\n", ([], None, False)),
    (b"WARN a\nWARN b\nERR bucket not found\n", (["a", "b"], "bucket not found", False)),
    (b"BAD --disk-cache is smaller than one block\n", ([], "--disk-cache is smaller than one block", True)),
])
def test_read_report(lines: bytes, expected: tuple) -> None:
    left, right = socket.socketpair()
    with left, right:
        left.sendall(lines)
        assert fusefd.read_report(right, time.monotonic() + 10, lambda: True) == expected


def test_read_report_of_a_daemon_that_closed_or_died() -> None:
    left, right = socket.socketpair()
    with right:
        left.sendall(b"WARN x\n")
        left.close()
        with pytest.raises(HandoverError, match="exited during start-up"):
            fusefd.read_report(right, time.monotonic() + 10, lambda: True)
    left, right = socket.socketpair()
    with left, right:
        with pytest.raises(HandoverError, match="exited during start-up"):
            fusefd.read_report(right, time.monotonic() + 60, lambda: False)
        with pytest.raises(fusefd.HandoverTimeout):
            fusefd.read_report(right, time.monotonic() - 1, lambda: True)


# -------------------------------------------------------------------------------------- the spec
@pytest.fixture
def run_root(workdir: Path) -> Path:
    """A run root short enough for unix socket paths (``workdir``, tests/csi/conftest.py)."""
    return workdir


def _request(tmp_path: Path, **kw: object) -> MountRequest:
    values: dict = dict(source="s3://bucket/train", target=tmp_path / "globalmount", cache_dir=tmp_path / "slot-0",
                        endpoint_url="http://127.0.0.1:9000", region="eu-west-1",
                        cache=CacheOptions(ram_bytes=1 << 30, disk_bytes=2 << 30),
                        credentials=Credentials("AKIAHANDOVER", SECRET), volume_id="vol-1",
                        context={"csi.storage.k8s.io/pod.name": "trainer-0"})
    values.update(kw)
    return MountRequest(**values)


def test_spec_carries_credentials_in_env_only(tmp_path: Path, run_root: Path) -> None:
    mounter = HandoverMounter(FakeLauncher(), run_root, command=["cachefs"],
                              environ={"PATH": "/bin", "AWS_PROFILE": "node", "AWS_CA_BUNDLE": "/ca.pem"})
    spec = mounter.spec_for(_request(tmp_path))
    assert spec.name == daemon_name(tmp_path / "globalmount")
    assert spec.args[:3] == ("mount", "s3://bucket/train", str(tmp_path / "globalmount"))
    assert spec.args[-2:] == ("--fuse-fd-socket", str(run_root / spec.name / "fuse.sock"))
    assert spec.handover_socket == run_root / spec.name / "fuse.sock"
    assert "--allow-other" in spec.args and "--foreground" not in spec.args
    assert not any(SECRET in arg or "AKIAHANDOVER" in arg for arg in spec.args)
    assert SECRET not in repr(spec)
    assert spec.env["AWS_SECRET_ACCESS_KEY"] == SECRET and spec.env["AWS_ACCESS_KEY_ID"] == "AKIAHANDOVER"
    assert "AWS_PROFILE" not in spec.env  # the volume's own pair is used alone
    assert spec.env["AWS_CA_BUNDLE"] == "/ca.pem" and spec.env["AWS_REGION"] == "eu-west-1"
    assert "PATH" not in spec.env and spec.env["XDG_RUNTIME_DIR"] == str(spec.run_dir)
    assert (spec.volume_id, spec.ram_cache_bytes, spec.disk_cache_bytes) == ("vol-1", 1 << 30, 2 << 30)
    assert spec.context == {"csi.storage.k8s.io/pod.name": "trainer-0"} and spec.uid is None


def test_spec_without_volume_credentials_carries_the_node_identity(tmp_path: Path, run_root: Path) -> None:
    mounter = HandoverMounter(FakeLauncher(), run_root, command=["cachefs"],
                              environ={"AWS_ACCESS_KEY_ID": "AKIANODE", "AWS_SECRET_ACCESS_KEY": "node-secret"})
    spec = mounter.spec_for(_request(tmp_path, credentials=None))
    assert spec.env["AWS_ACCESS_KEY_ID"] == "AKIANODE" and spec.env["AWS_SECRET_ACCESS_KEY"] == "node-secret"


def test_unprivileged_daemon_keeps_the_plugins_owner_unless_the_volume_names_one(tmp_path: Path, run_root: Path) -> None:
    mounter = HandoverMounter(FakeLauncher(), run_root, command=["cachefs"], daemon_uid=1000, daemon_gid=1000)
    spec = mounter.spec_for(_request(tmp_path))
    args = list(spec.args)
    assert args[args.index("--uid") + 1] == str(os.geteuid()) and args[args.index("--gid") + 1] == str(os.getegid())
    assert (spec.uid, spec.gid) == (1000, 1000)
    spec = mounter.spec_for(_request(tmp_path, owner=OwnerOptions(uid=7, gid=8)))
    args = list(spec.args)
    assert args[args.index("--uid") + 1] == "7" and args[args.index("--gid") + 1] == "8"


def test_a_run_root_too_long_for_sockets_is_refused(tmp_path: Path) -> None:
    mounter = HandoverMounter(FakeLauncher(), tmp_path / ("r" * 80), command=["cachefs"])
    with pytest.raises(CsiError) as info:
        mounter.spec_for(_request(tmp_path))
    assert info.value.code == Code.FAILED_PRECONDITION and "too long" in info.value.message


def test_chown_tree_gives_the_cache_to_the_daemon_user(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown needs root")
    (tmp_path / "slot" / "abc" / "blocks").mkdir(parents=True)
    (tmp_path / "slot" / "abc" / "lock").write_text("1")
    _chown_tree(tmp_path / "slot", 65534, 65534)
    for path in (tmp_path / "slot", tmp_path / "slot/abc", tmp_path / "slot/abc/blocks", tmp_path / "slot/abc/lock"):
        assert (os.stat(path).st_uid, os.stat(path).st_gid) == (65534, 65534)


# --------------------------------------------------------------------------------- ProcessLauncher
SLEEPER = "import json, os, sys, time; json.dump(dict(os.environ), open(sys.argv[1], 'w')); time.sleep(120)"


def _sleeper_spec(tmp_path: Path, name: str) -> DaemonSpec:
    return DaemonSpec(name=name, volume_id="v", target=tmp_path / "t", args=(str(tmp_path / f"{name}.env"),),
                      env={"AWS_SECRET_ACCESS_KEY": SECRET}, cache_dir=tmp_path / "cache",
                      run_dir=tmp_path / "run" / name)


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + 30
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_process_launcher_starts_finds_again_and_stops(tmp_path: Path) -> None:
    command = [sys.executable, "-c", SLEEPER]
    launcher = ProcessLauncher(tmp_path / "run", command=command,
                               environ={"PATH": os.environ.get("PATH", "/bin"), "AWS_PROFILE": "node"})
    name = NAME_PREFIX + "a" * 20
    spec = _sleeper_spec(tmp_path, name)
    launcher.start(spec)
    pid = json.loads((tmp_path / "run" / name / "daemon.json").read_text())["pid"]
    try:
        _wait_for(tmp_path / f"{name}.env")
        env = json.loads((tmp_path / f"{name}.env").read_text())
        assert env["AWS_SECRET_ACCESS_KEY"] == SECRET and "AWS_PROFILE" not in env
        assert SECRET not in Path(f"/proc/{pid}/cmdline").read_text()
        assert os.getsid(pid) == pid  # its own session: a plugin's death does not reach it
        assert launcher.is_running(name) and launcher.names() == [name]
        with pytest.raises(CsiError) as info:
            launcher.start(spec)
        assert info.value.code == Code.ALREADY_EXISTS

        restarted = ProcessLauncher(tmp_path / "run", command=command)  # a new plugin, same run root
        assert restarted.is_running(name) and restarted.names() == [name]
        assert f"pid {pid}" in restarted.describe(name)
        restarted.stop(name, 10)
        assert not restarted.is_running(name) and not launcher.is_running(name)
        assert restarted.names() == [] and not (tmp_path / "run" / name / "daemon.json").exists()
        restarted.stop(name, 10)  # stopping what is gone is success
    finally:
        try:
            os.kill(pid, signal.SIGKILL)  # the sleeper this test started, by its PID
        except ProcessLookupError:
            pass


# Writes its file once ready, then on SIGTERM "uploads" for 1.5 s and exits 0 (a daemon's stop).
SLOW_STOPPER = ("import json, os, signal, sys, time\n"
                "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1.5), sys.exit(0)))\n"
                "json.dump({}, open(sys.argv[1], 'w'))\n"
                "time.sleep(120)\n")


@pytest.mark.parametrize("stop_timeout_s, killed", [(None, True), (1.0, False)])
def test_process_launcher_stop_waits_for_the_daemons_own_stop_timeout(tmp_path: Path, stop_timeout_s: float | None,
                                                                        killed: bool) -> None:
    """A plugin-wide stop of 0.5 s must not SIGKILL a daemon whose volume asked for a longer stopTimeout
    (its uploads after SIGTERM): the launcher waits that plus the exit margin, as a mount pod's
    terminationGracePeriodSeconds does; a daemon without one is killed after the caller's timeout."""
    launcher = ProcessLauncher(tmp_path / "run", command=[sys.executable, "-c", SLOW_STOPPER],
                               environ={"PATH": os.environ.get("PATH", "/bin")})
    name = NAME_PREFIX + "d" * 20
    launcher.start(dataclasses.replace(_sleeper_spec(tmp_path, name), stop_timeout_s=stop_timeout_s))
    child = launcher._children[name]
    try:
        _wait_for(tmp_path / f"{name}.env")
        launcher.stop(name, 0.5)
        assert child.wait(10) == (-signal.SIGKILL if killed else 0)
    finally:
        if child.poll() is None:
            child.kill()  # the process this test started


def test_process_launcher_ignores_a_reused_pid(tmp_path: Path) -> None:
    name = NAME_PREFIX + "b" * 20
    record = tmp_path / "run" / name / "daemon.json"
    record.parent.mkdir(parents=True)
    # Our own pid with another start time: a record left by a daemon whose pid was reused since.
    record.write_text(json.dumps({"pid": os.getpid(), "started": "1", "log": "x"}))
    launcher = ProcessLauncher(tmp_path / "run")
    assert not launcher.is_running(name) and launcher.names() == []
    launcher.stop(name, 1)  # must not signal this process
    assert not record.exists()


def test_process_launcher_reaps_a_child_that_exited(tmp_path: Path) -> None:
    launcher = ProcessLauncher(tmp_path / "run", command=[sys.executable, "-c", "import sys; sys.exit(3)"])
    name = NAME_PREFIX + "c" * 20
    launcher.start(_sleeper_spec(tmp_path, name))
    deadline = time.monotonic() + 30
    while launcher.is_running(name):  # a zombie would still answer kill(pid, 0)
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _late_start_times(monkeypatch: pytest.MonkeyPatch, late: int) -> None:
    """The launcher's first ``late`` reads of a start time come after the child has exited, as when
    the plugin's thread is descheduled between the fork and the read (a full test run's load)."""
    original = launchers._start_time
    reads: list[int] = []

    def read(pid: int) -> str | None:
        if len(reads) < late:
            reads.append(pid)
            deadline = time.monotonic() + 10
            while original(pid) is not None and time.monotonic() < deadline:
                time.sleep(0.01)
        return original(pid)

    monkeypatch.setattr(launchers, "_start_time", read)


def test_a_daemon_dead_before_its_start_time_is_read_is_not_taken_for_running(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dead pid's start time reads None; a record holding None must not match it, or the handover
    waits its whole deadline for a daemon that is gone (the CSI broker test's 150 s hang)."""
    _late_start_times(monkeypatch, late=2)
    launcher = ProcessLauncher(tmp_path / "run", command=[sys.executable, "-c", "import sys; sys.exit(3)"])
    name = NAME_PREFIX + "e" * 20
    with pytest.raises(CsiError) as info:
        launcher.start(_sleeper_spec(tmp_path, name))
    assert info.value.code == Code.INTERNAL
    assert "exited as it started, twice (exit status 3" in info.value.message, info.value.message
    assert not launcher.is_running(name) and launcher.names() == []

    record = tmp_path / "run" / name / "daemon.json"  # a record an older plugin wrote that way
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"pid": 2 ** 22 + 1, "started": None, "log": "x"}))
    assert not ProcessLauncher(tmp_path / "run").is_running(name)


ONCE_DEAD = ("import os, sys, time\n"
             "if not os.path.exists(sys.argv[1] + '.tried'):\n"
             "    open(sys.argv[1] + '.tried', 'w').close(); sys.exit(3)\n"
             "open(sys.argv[1], 'w').write('{}'); time.sleep(120)\n")


def test_a_daemon_that_dies_as_it_starts_is_started_once_more(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    _late_start_times(monkeypatch, late=1)
    launcher = ProcessLauncher(tmp_path / "run", command=[sys.executable, "-c", ONCE_DEAD])
    name = NAME_PREFIX + "f" * 20
    with caplog.at_level(logging.WARNING, logger="csi_driver.launchers"):
        launcher.start(_sleeper_spec(tmp_path, name))
    child = launcher._children[name]
    try:
        _wait_for(tmp_path / f"{name}.env")
        assert launcher.is_running(name)
        assert "exited as it started (exit status 3" in caplog.text and "starting it once more" in caplog.text
        launcher.stop(name, 10)
        assert not launcher.is_running(name)
        assert "not running (killed by SIGTERM)" in launcher.describe(name)
    finally:
        if child.poll() is None:
            child.kill()  # the process this test started


# ------------------------------------------------------------------------------ the daemon's side
def test_cachefs_mount_without_a_handover_listener_fails_in_one_line(tmp_path: Path) -> None:
    import subprocess

    result = subprocess.run(
        [sys.executable, "-m", "cachefs", "mount", "s3://bucket/prefix", str(tmp_path / "mnt"),
         "--cache-dir", str(tmp_path / "cache"), "--fuse-fd-socket", str(tmp_path / "none.sock")],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cachefs: error: cannot receive the FUSE descriptor"), lines
    assert not (tmp_path / "mnt").exists()  # it neither mounted nor created anything there


def test_a_read_only_mount_names_its_passthrough_broker(tmp_path: Path, run_root: Path) -> None:
    mounter = HandoverMounter(FakeLauncher(), run_root, command=["cachefs"], daemon_uid=65534, daemon_gid=65534)
    spec = mounter.spec_for(_request(tmp_path, read_only=True))
    assert spec.args[-4:] == ("--fuse-fd-socket", str(run_root / spec.name / "fuse.sock"),
                              "--backing-broker", str(run_root / spec.name / "backing.sock"))
    assert "--backing-broker" not in mounter.spec_for(_request(tmp_path)).args  # writable: no passthrough


def test_a_restarted_plugin_serves_the_brokers_of_live_read_only_mounts(tmp_path: Path, run_root: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    mounter = HandoverMounter(FakeLauncher(), run_root, command=["cachefs"], daemon_uid=65534, daemon_gid=65534)
    live = mounter.spec_for(_request(tmp_path, read_only=True))
    dead = mounter.spec_for(_request(tmp_path, read_only=True, target=tmp_path / "dead"))
    writable = mounter.spec_for(_request(tmp_path, target=tmp_path / "rw"))
    for spec in (live, dead, writable):
        spec.run_dir.mkdir(parents=True)
        mounter._save_spec(spec)
    monkeypatch.setattr(mounter, "is_mounted", lambda target: True)
    monkeypatch.setattr(mounter, "is_broken", lambda target: target == dead.target)
    mounter.resume()
    try:
        assert set(mounter.brokers) == {live.target}  # not the dead mount's, not the writable one's
        sock = live.run_dir / "backing.sock"
        st = os.stat(sock)
        assert (st.st_uid, st.st_mode & 0o777) == (65534, 0o600)
        assert mounter.brokers[live.target].cache_dir == os.path.realpath(live.cache_dir)
        assert mounter.brokers[live.target].resumed  # it may close the earlier plugin's ids
        broker = mounter.brokers[live.target]
        mounter.resume()  # again: the same broker
        assert mounter.brokers[live.target] is broker
    finally:
        mounter._stop_broker(live.target)
    assert mounter.brokers == {} and not sock.exists()


def test_a_mount_that_fails_leaves_no_broker(tmp_path: Path, run_root: Path) -> None:
    target = tmp_path / "not-a-directory"
    target.write_bytes(b"")
    mounter = HandoverMounter(FakeLauncher(), run_root, command=["cachefs"])
    with pytest.raises(CsiError) as info:
        mounter.mount(_request(tmp_path, target=target, read_only=True))
    assert "is not a directory" in info.value.message
    assert mounter.brokers == {} and not (run_root / daemon_name(target) / "backing.sock").exists()
