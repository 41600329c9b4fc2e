"""Issue 24, item 2: a mount by a non-root user that the kernel or fusermount3 refuses names their
reason on the terminal, not only in daemon.log.

``cachefs mount`` runs as uid 65534 (nobody) through the system's python3.X of the test's version
with the test's packages on PYTHONPATH (the test interpreter lives under /root, mode 0700, which
nobody may execute; as ``tests/csi/test_handover.py`` does). Nothing on the machine is changed:
/dev/fuse and /etc/fuse.conf are only read, to know which refusal to expect: where /dev/fuse is not
open to other users (mode 0600, as on this project's CI machines), the session's
``failed to open /dev/fuse: Permission denied`` (the words libfuse used); where it is, ``--allow-other`` without
``user_allow_other`` in /etc/fuse.conf, fusermount3's own words."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from cachefs import mounts

pytestmark = [pytest.mark.fuse, pytest.mark.skipif(os.geteuid() != 0, reason="switching to uid 65534 needs root")]

NOBODY = 65534
RUN_TIMEOUT_S = 120


def expected_refusal() -> str:
    mode = os.stat("/dev/fuse").st_mode
    if mode & (stat.S_IROTH | stat.S_IWOTH) != (stat.S_IROTH | stat.S_IWOTH):
        return "failed to open /dev/fuse: Permission denied"
    try:
        conf = Path("/etc/fuse.conf").read_text()
    except OSError:
        conf = ""
    if any(line.strip() == "user_allow_other" for line in conf.splitlines()):
        pytest.skip("/dev/fuse is open to all and /etc/fuse.conf has user_allow_other: nothing refuses nobody")
    return "user_allow_other"


def nobody_python() -> tuple[str, str]:
    system = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
    pythonpath = f"{os.getcwd()}:{sysconfig.get_paths()['purelib']}"
    if not system.exists():
        pytest.skip(f"{system} is not installed: nobody has no interpreter to run cachefs with")
    probe = subprocess.run([str(system), "-c", "import cachefs.daemon.main"], user=NOBODY, group=NOBODY,
                           extra_groups=[], cwd="/", capture_output=True, timeout=RUN_TIMEOUT_S,
                           env={"PATH": "/usr/bin:/bin", "PYTHONPATH": pythonpath})
    if probe.returncode != 0:
        pytest.skip(f"{system} cannot import cachefs as nobody")
    return str(system), pythonpath


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cachefs-nobody-"))
    for name in ("src", "mnt", "cache"):
        (path / name).mkdir()
    (path / "src" / "f").write_bytes(b"hello\n")
    for item in (path, *path.iterdir(), path / "src" / "f"):
        os.chown(item, NOBODY, NOBODY)
    try:
        yield path
    finally:
        if mounts.find_mount(path / "mnt") is not None:  # only if the test failed the wrong way
            subprocess.run(["fusermount3", "-u", "-z", str(path / "mnt")], capture_output=True, timeout=30)
        shutil.rmtree(path, ignore_errors=True)


def test_a_refused_non_root_mount_names_the_reason_on_the_terminal(base: Path) -> None:
    needle = expected_refusal()
    python, pythonpath = nobody_python()
    result = subprocess.run(
        [python, "-m", "cachefs", "mount", f"file://{base}/src/", str(base / "mnt"), "--read-only",
         "--cache-dir", str(base / "cache"), "--allow-other"],
        user=NOBODY, group=NOBODY, extra_groups=[], cwd="/", capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": pythonpath, "HOME": str(base)})
    err = result.stderr
    assert result.returncode == 1 and err.count("\n") == 1 and err.startswith("cachefs: error: cannot mount"), err
    assert needle in err and "fuse_session_mount failed" not in err, err
    assert mounts.find_mount(base / "mnt") is None
