"""The mount table parser and the mountpoint checks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cachefs import mounts
from cachefs.mounts import FSTYPE, MountEntry, check_mountpoint, find_mount, mount_entries, other_views

MOUNTINFO = r"""22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
36 22 0:32 / /proc rw,nosuid,nodev,noexec,relatime shared:5 - proc proc rw
80 22 0:45 / /mnt/my\040data rw,nosuid,nodev,relatime shared:40 - fuse.cachefs s3://bucket/prefix rw,user_id=0,group_id=0
81 22 0:46 / /mnt/plain rw,relatime - fuse.sshfs user@host:/srv rw
82 81 0:47 / /mnt/plain rw,relatime master:3 - fuse.cachefs s3://other rw
85 22 0:45 / /pods/a/vol rw,nosuid,nodev,relatime shared:41 - fuse.cachefs s3://bucket/prefix rw,user_id=0,group_id=0
83 22 0:48 / /mnt/tab\011and\134slash rw - tmpfs tmp\040fs rw
this line is garbage
84 22 0:49 / /incomplete rw -
"""


@pytest.fixture
def mountinfo(tmp_path: Path) -> Path:
    path = tmp_path / "mountinfo"
    path.write_text(MOUNTINFO)
    return path


def test_mount_entries_parses_and_unescapes(mountinfo: Path) -> None:
    entries = mount_entries(mountinfo)
    assert entries == [
        MountEntry("/", "ext4", "/dev/sda1"),
        MountEntry("/proc", "proc", "proc"),
        MountEntry("/mnt/my data", FSTYPE, "s3://bucket/prefix"),
        MountEntry("/mnt/plain", "fuse.sshfs", "user@host:/srv"),
        MountEntry("/mnt/plain", FSTYPE, "s3://other"),
        MountEntry("/pods/a/vol", FSTYPE, "s3://bucket/prefix"),
        MountEntry("/mnt/tab\tand\\slash", "tmpfs", "tmp fs"),
    ]


def test_find_mount_matches_the_exact_path(mountinfo: Path) -> None:
    entry = find_mount(Path("/mnt/my data"), mountinfo)
    assert entry is not None and entry.fstype == FSTYPE and entry.source == "s3://bucket/prefix"
    assert find_mount(Path("/mnt/my data/sub"), mountinfo) is None
    assert find_mount(Path("/mnt/my"), mountinfo) is None
    assert find_mount(Path("/mnt/my data/"), mountinfo) is not None  # normalised
    assert find_mount(Path("/mnt/other/../my data"), mountinfo) is not None


def test_other_views_are_the_binds_of_the_same_connection(mountinfo: Path) -> None:
    staged = find_mount(Path("/mnt/my data"), mountinfo)
    bind = find_mount(Path("/pods/a/vol"), mountinfo)
    assert staged is not None and bind is not None and staged.device == bind.device == "0:45"
    assert other_views(staged, mountinfo) == ["/pods/a/vol"]
    assert other_views(bind, mountinfo) == ["/mnt/my data"]
    alone = find_mount(Path("/mnt/plain"), mountinfo)
    assert alone is not None and other_views(alone, mountinfo) == []


def test_find_mount_returns_the_top_of_a_stack(mountinfo: Path) -> None:
    entry = find_mount(Path("/mnt/plain"), mountinfo)
    assert entry == MountEntry("/mnt/plain", FSTYPE, "s3://other")


def test_the_real_mount_table_parses() -> None:
    entries = mount_entries()
    assert any(e.mountpoint == "/" for e in entries)


def test_check_mountpoint_missing(tmp_path: Path) -> None:
    problem = check_mountpoint(tmp_path / "nope")
    assert problem is not None and "does not exist" in problem and str(tmp_path / "nope") in problem


def test_check_mountpoint_file(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    problem = check_mountpoint(target)
    assert problem is not None and "not a directory" in problem


def test_check_mountpoint_non_empty(tmp_path: Path) -> None:
    (tmp_path / "something").write_text("x")
    problem = check_mountpoint(tmp_path)
    assert problem is not None and "not empty" in problem


def test_check_mountpoint_hidden_file_counts(tmp_path: Path) -> None:
    (tmp_path / ".hidden").write_text("x")
    assert check_mountpoint(tmp_path) is not None


def test_check_mountpoint_empty_dir_is_fine(tmp_path: Path) -> None:
    target = tmp_path / "mnt"
    target.mkdir()
    assert check_mountpoint(target) is None


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any directory")
def test_check_mountpoint_unreadable(tmp_path: Path) -> None:
    target = tmp_path / "locked"
    target.mkdir()
    target.chmod(0)
    try:
        problem = check_mountpoint(target)
    finally:
        target.chmod(0o755)
    assert problem is not None and "not readable" in problem


def test_check_mountpoint_of_a_mounted_path() -> None:
    problem = check_mountpoint(Path("/proc"))
    assert problem is not None and "already mounted" in problem


def test_mount_users_finds_a_process_by_its_working_directory_or_open_file(tmp_path) -> None:
    """Issue 24, item 6: the processes named when an unmount is refused as busy."""
    import subprocess
    import sys
    import time

    from cachefs.mounts import mount_users

    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_text("x")
    by_cwd = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], cwd=tmp_path / "d",
                              stdin=subprocess.PIPE)
    by_fd = subprocess.Popen([sys.executable, "-c", f"f = open({str(tmp_path / 'f')!r}); import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:  # the second child opens its file after it starts
            users = mount_users(tmp_path)
            pids = {pid for pid, _ in users.processes}
            if {by_cwd.pid, by_fd.pid} <= pids or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert {by_cwd.pid, by_fd.pid} <= pids
        assert f"pid {by_cwd.pid} (python" in users.describe()
        in_d = {pid for pid, _ in mount_users(tmp_path / "d").processes}
        assert by_cwd.pid in in_d and by_fd.pid not in in_d
        assert not mount_users(tmp_path / "nothing-here").processes
    finally:
        for child in (by_cwd, by_fd):
            child.stdin.close()
            child.wait(timeout=30)


def test_process_waits_names_the_state_and_where_the_threads_wait() -> None:
    """`cachefs unmount`'s line about a daemon that does not exit says where it is (issue 37)."""
    import subprocess
    import sys
    import time

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        where = ""
        while time.monotonic() < deadline:
            where = mounts.process_waits(child.pid)
            if where.startswith("state S"):
                break
            time.sleep(0.05)
        assert where.startswith("state S, threads: 1 in "), where
        assert "running" not in where, where
    finally:
        child.kill()
        child.wait(timeout=10)
    assert mounts.process_waits(child.pid) == ""  # gone (reaped)
