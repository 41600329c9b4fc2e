"""Passthrough through the node plugin's broker, end to end: ``cachefs-csi --mount-mode process`` over
its gRPC socket, a read-only volume on SeaweedFS, its daemon run as uid 65534 with no capability.

The daemon cannot register backing files itself (both ioctls need CAP_SYS_ADMIN); the plugin's broker
(csi_driver.backing) does it for it. The proof is the daemon's own count of READ requests
(``filesystem.reads``): a file whole on the disk tier, its pages dropped from the mount's page cache,
is read again with none. And the plugin holds no /dev/fuse descriptor: killing the daemon still ends
the connection, readers get ENOTCONN.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import sys
import sysconfig
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from cachefs.client import call
from tests.csi.conftest import (
    Driver,
    daemon_pid,
    driver_environ,
    driver_run_root,
    mount_capability,
    secrets_of,
    start_driver,
    stop_driver,
)
from tests.csi.test_node_service import context_for
from tests.fuse.conftest import read_dropping_page_cache
from tests.fuse.test_passthrough import kernel_passthrough_reason
from tests.support.kubelet import runtime_environ

pytestmark = [pytest.mark.fuse, pytest.mark.s3]

MiB = 1024 * 1024
NOBODY = 65534
# Bound on the blocks of a cold read reaching the disk tier (worker threads write them).
SETTLE_S = 30.0
WAIT_S = 60.0


@pytest.fixture
def process_driver(workdir: Path) -> Iterator[tuple[Driver, dict[str, str], list[str]]]:
    reason = kernel_passthrough_reason()
    if reason is not None:
        pytest.skip(f"passthrough cannot be used here: {reason}")
    # The daemon, a host process of uid 65534, must reach its cache slot and run directory (as on a
    # node, where /var/lib and /run are traversable); pytest's and mkdtemp's directories are 0700.
    workdir.chmod(0o755)
    (workdir / "node-cache").mkdir(mode=0o755)
    driver_run_root(workdir).mkdir(mode=0o755)
    # The interpreter of the test lives under /root (0700), which uid 65534 may not execute: the
    # driver, and so its daemons, run on the system's python3.X of the same version, with the test's
    # packages on PYTHONPATH (as tests/csi/test_handover.py does), in a container runtime's environment.
    system = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
    if not system.exists():
        pytest.skip(f"{system} is not installed: no interpreter uid {NOBODY} may run")
    env = {**runtime_environ(driver_environ(), NOBODY),
           "PYTHONPATH": f"{os.getcwd()}:{sysconfig.get_paths()['purelib']}"}
    command = [str(system), "-m", "csi_driver.main"]
    d = start_driver(workdir, "--mount-mode", "process", "--daemon-uid", str(NOBODY), env=env, command=command)
    try:
        yield d, env, command
    finally:
        stop_driver(d)


def counts(target: Path) -> tuple[int, int]:
    doc = call(target, "/stats")
    return doc["filesystem"]["reads"], doc["fuse"]["passthrough_opens"]


def why(daemon_log: Path) -> str:
    """The daemon's passthrough lines, for a failure's message."""
    return "\n".join(line for line in daemon_log.read_text().splitlines() if "passthrough" in line)


def fuse_fds(pid: int) -> list[str]:
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == "/dev/fuse":
                found.append(fd)
        except OSError:
            continue  # closed meanwhile
    return found


def test_a_file_whole_on_the_disk_tier_is_read_without_the_unprivileged_daemon(
        process_driver: tuple[Driver, dict[str, str], list[str]], workdir: Path, seaweed) -> None:
    driver, driver_env, driver_command = process_driver
    bucket = f"broker-{uuid.uuid4().hex[:12]}"
    seaweed.make_bucket(bucket)
    data = random.Random("broker").randbytes(3 * MiB + 1234)
    seaweed.put_many(bucket, [("train/a.bin", data), ("train/b.txt", b"hello\n")])
    target = driver.target()
    driver.publish("vol-broker", target, context_for(seaweed, bucket, blockSize="1MiB"),
                   secrets=secrets_of(seaweed), readonly=True, capability=mount_capability())
    pid = daemon_pid(target)
    (daemon_log,) = driver.cache_root.rglob("daemon.log")
    assert os.stat(f"/proc/{pid}").st_uid == NOBODY
    status = Path(f"/proc/{pid}/status").read_text()
    assert "CapEff:\t0000000000000000" in status  # it could not register a backing file itself
    path = target / "a.bin"

    assert path.read_bytes() == data  # cold: blocks fetched and written to the disk tier
    assert call(target, "/stats")["fuse"]["passthrough"] is True, why(daemon_log)  # the broker answered at INIT
    deadline = time.monotonic() + SETTLE_S
    while counts(target)[1] == 0:
        assert time.monotonic() < deadline, f"no passthrough open in {SETTLE_S} s: {why(daemon_log)}"
        with open(path, "rb") as fh:
            fh.read(1)
    reads, opens = counts(target)
    assert read_dropping_page_cache(path) == data
    assert counts(target) == (reads, opens + 1), why(daemon_log)  # one more passthrough open, no READ at all
    assert "backing files are registered by the node plugin's broker" in daemon_log.read_text()

    # The plugin is SIGKILLed and started again: it serves the mount's broker again (adopt), and the
    # daemon, whose connection to the old one broke, reaches the new one.
    driver.proc.kill()  # the driver this test started
    driver.proc.wait(timeout=WAIT_S)
    restarted = start_driver(workdir, "--mount-mode", "process", "--daemon-uid", str(NOBODY), env=driver_env,
                             command=driver_command)
    try:
        reads, opens = counts(target)
        assert read_dropping_page_cache(path) == data
        assert counts(target) == (reads, opens + 1), why(daemon_log)
        assert "passthrough: " not in daemon_log.read_text().split("registered by the node plugin's broker")[-1]
        # That open used the id the daemon kept from before the restart. Evicted, the file's id is
        # closed through the new plugin's broker (resumed: it may close the earlier plugin's ids), so
        # the whole file is let go; read again, it is registered anew through the new broker.
        fuse = call(target, "/stats")["fuse"]
        assert fuse["backing_ids"] == 1, fuse
        call(target, "/evict", method="POST", body={"paths": ["a.bin"], "tier": "all"})
        deadline = time.monotonic() + SETTLE_S
        while (fuse := call(target, "/stats")["fuse"])["backing_ids"] != 0:
            assert time.monotonic() < deadline, f"the evicted file's id was never closed: {fuse}"
            time.sleep(0.05)
        assert "closing backing id" not in daemon_log.read_text(), why(daemon_log)
        registered = fuse["backing_registrations"]
        deadline = time.monotonic() + SETTLE_S
        while (fuse := call(target, "/stats")["fuse"])["backing_registrations"] == registered:
            assert time.monotonic() < deadline, f"never registered again: {fuse} {why(daemon_log)}"
            assert read_dropping_page_cache(path) == data
        assert fuse["passthrough"] is True and fuse["backing_ids"] == 1, fuse

        # The plugin holds no descriptor of the connection: the daemon is its only holder.
        assert fuse_fds(restarted.proc.pid) == []
        kill_daemon_and_see_enotconn(pid, target)
        restarted.unpublish("vol-broker", target)
    finally:
        stop_driver(restarted)


def kill_daemon_and_see_enotconn(pid: int, target: Path) -> None:
    os.kill(pid, signal.SIGKILL)  # the daemon the test's driver started, by its PID
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            os.statvfs(target)
        except OSError as exc:
            assert exc.errno in (errno.ENOTCONN, errno.ECONNABORTED), exc
            break
        assert time.monotonic() < deadline, f"{target} did not break after its daemon was killed"
        time.sleep(0.05)
    with pytest.raises(OSError) as info:
        (target / "b.txt").read_bytes()
    assert info.value.errno in (errno.ENOTCONN, errno.ECONNABORTED)
