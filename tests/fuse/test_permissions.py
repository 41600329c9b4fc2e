"""Owner and modes on a real mount: a non-root user the mount belongs to writes, and the kernel keeps
everyone else to the mode bits (issue 12: non-root pods can write).

The mount is made as root (as the CSI node plugin makes it) with ``--allow-other`` and
``--uid/--gid``; the operations run in child processes with another uid and gid, and no
supplementary groups (``subprocess.run(user=..., group=..., extra_groups=[])``). Permission checks
are the kernel's (FUSE ``default_permissions``): cachefs only reports owners and modes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from tests.fuse.conftest import Mounter

NOBODY = 65534
OTHER = 65533  # a second unprivileged uid, in neither the owner nor the group
GROUP = 2000  # an fsGroup-style shared group
RUN_TIMEOUT_S = 60

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting for other users and switching uid need root")


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory every uid can traverse (pytest's tmp_path is 0700 root)."""
    path = Path(tempfile.mkdtemp(prefix="cachefs-perms-"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def perm_mounter(base: Path) -> Iterator[Mounter]:
    m = Mounter(base)
    try:
        yield m
    finally:
        m.cleanup()


def as_user(uid: int, gid: int, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), user=uid, group=gid, extra_groups=[], cwd="/", capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S, check=False)


def ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, result.stderr


def denied(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode != 0 and "Permission denied" in result.stderr, (result.returncode, result.stderr)


def write(uid: int, gid: int, path: Path, text: str) -> subprocess.CompletedProcess[str]:
    return as_user(uid, gid, "sh", "-c", 'printf %s "$1" > "$2"', "sh", text, str(path))


def source(base: Path) -> str:
    root = base / "bucket"
    (root / "data").mkdir(parents=True)
    (root / "data" / "seed.txt").write_text("seed")
    return f"file://{root}"


def test_the_owner_writes_mkdirs_renames_and_reads_others_get_eacces(base: Path, perm_mounter: Mounter) -> None:
    m = perm_mounter.mount(source(base), "--allow-other", "--uid", str(NOBODY), "--gid", str(NOBODY),
                           "--file-mode", "0644", "--dir-mode", "0755", mountpoint=base / "mnt")
    root = m.path
    st = os.stat(root / "data" / "seed.txt")
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (NOBODY, NOBODY, 0o644)
    assert (os.stat(root).st_uid, os.stat(root).st_mode & 0o7777) == (NOBODY, 0o755)

    # The owner: everything a training job's checkpoint writer does.
    ok(write(NOBODY, NOBODY, root / "data" / "ckpt.tmp", "step-1"))
    ok(as_user(NOBODY, NOBODY, "mkdir", str(root / "runs")))
    ok(as_user(NOBODY, NOBODY, "mv", str(root / "data" / "ckpt.tmp"), str(root / "runs" / "ckpt")))
    read = as_user(NOBODY, NOBODY, "cat", str(root / "runs" / "ckpt"))
    assert read.returncode == 0 and read.stdout == "step-1", read.stderr
    ok(write(NOBODY, NOBODY, root / "data" / "seed.txt", "rewritten"))
    assert os.stat(root / "runs" / "ckpt").st_uid == NOBODY

    # Anyone else: the mode bits (0644/0755) let them read and nothing more.
    read = as_user(OTHER, OTHER, "cat", str(root / "runs" / "ckpt"))
    assert read.returncode == 0 and read.stdout == "step-1", read.stderr
    denied(write(OTHER, OTHER, root / "runs" / "ckpt", "overwritten"))
    denied(write(OTHER, OTHER, root / "runs" / "new", "x"))
    denied(as_user(OTHER, OTHER, "mkdir", str(root / "runs" / "sub")))
    denied(as_user(OTHER, OTHER, "mv", str(root / "runs" / "ckpt"), str(root / "runs" / "moved")))
    assert (root / "runs" / "ckpt").read_text() == "step-1"
    assert not (root / "runs" / "moved").exists() and not (root / "runs" / "sub").exists()


def test_a_shared_group_with_group_writable_modes_lets_members_write(base: Path, perm_mounter: Mounter) -> None:
    """What the CSI driver does with a pod's fsGroup: gid = fsGroup, modes 0664/0775."""
    m = perm_mounter.mount(source(base), "--allow-other", "--gid", str(GROUP), "--file-mode", "664",
                           "--dir-mode", "775", mountpoint=base / "mnt")
    root = m.path
    st = os.stat(root / "data")
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (0, GROUP, 0o775)  # the mounting user: root
    ok(write(OTHER, GROUP, root / "data" / "out.bin", "by-group"))
    ok(as_user(OTHER, GROUP, "mkdir", str(root / "data" / "sub")))
    ok(as_user(OTHER, GROUP, "mv", str(root / "data" / "out.bin"), str(root / "data" / "sub" / "out.bin")))
    assert (root / "data" / "sub" / "out.bin").read_text() == "by-group"
    # Outside the group: read only.
    denied(write(NOBODY, NOBODY, root / "data" / "sub" / "out.bin", "x"))
    denied(as_user(NOBODY, NOBODY, "mkdir", str(root / "data" / "other")))
