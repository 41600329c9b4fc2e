"""A mount served by several reader threads (``cachefs mount --fuse-threads N``), on real mounts over
a ``file://`` store: reads and writes from many threads at once come back byte for byte, the daemon
says how many readers serve it, and an unmount ends every reader and the daemon.

The protocol's rules with several readers (which descriptor a reply goes on, interrupts across
readers, INIT) are checked without a mount in tests/unit/test_fuse_threads.py."""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.fuse.conftest import read_dropping_page_cache, run_cli

READERS = 3
FILES = 24
EXIT_WAIT_S = 30.0


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    (root / "data").mkdir(parents=True)
    for i in range(FILES):
        (root / "data" / f"f{i:02d}").write_bytes(hashlib.sha256(b"%d" % i).digest() * (1000 + 97 * i))
    (root / "big").write_bytes(os.urandom(24 << 20))
    return root


def daemon_gone(pid: int, timeout_s: float = EXIT_WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_reads_and_writes_from_many_threads_with_several_readers(store: Path, mounter) -> None:
    m = mounter.mount(f"file://{store}", "--fuse-threads", str(READERS))
    assert f"{READERS} threads read the mount's requests" in m.daemon_log_tail(200)

    def read_small(i: int) -> bool:
        return (m.path / "data" / f"f{i:02d}").read_bytes() == (store / "data" / f"f{i:02d}").read_bytes()

    def write_and_read_back(i: int) -> bool:
        body = os.urandom(300_000 + i)
        (m.path / "out" / f"w{i}").write_bytes(body)
        return read_dropping_page_cache(m.path / "out" / f"w{i}") == body

    (m.path / "out").mkdir()
    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(read_small, range(FILES)))
        assert all(pool.map(write_and_read_back, range(16)))
        # The big file in 1 MiB pieces read at once by 8 threads, each piece a READ of its own.
        big = (store / "big").read_bytes()
        fd = os.open(m.path / "big", os.O_RDONLY)
        try:
            pieces = list(pool.map(lambda k: os.pread(fd, 1 << 20, k << 20), range(24)))
        finally:
            os.close(fd)
    assert b"".join(pieces) == big
    assert sorted(os.listdir(m.path / "out")) == sorted(f"w{i}" for i in range(16))
    os.rename(m.path / "out" / "w0", m.path / "out" / "renamed")
    os.unlink(m.path / "out" / "w1")
    assert "renamed" in os.listdir(m.path / "out") and "w1" not in os.listdir(m.path / "out")

    pid = m.pid
    assert pid is not None
    result = m.unmount()
    assert result.returncode == 0, result.stderr
    assert not m.mounted
    assert daemon_gone(pid), "the daemon did not exit after the unmount: a reader kept it"
    # Written through the mount, uploaded at the unmount.
    assert (store / "out" / "renamed").stat().st_size == 300_000
    assert not (store / "out" / "w1").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="umount(8) needs root")
def test_an_unmount_by_the_kernel_ends_every_reader(store: Path, mounter) -> None:
    """umount(8) rather than ``cachefs unmount``: every reader sees ENODEV and the daemon ends."""
    m = mounter.mount(f"file://{store}", "--read-only", "--fuse-threads", "4")
    assert (m.path / "data" / "f03").read_bytes() == (store / "data" / "f03").read_bytes()
    pid = m.pid
    assert pid is not None
    subprocess.run(["umount", str(m.path)], check=True, capture_output=True, timeout=30)
    assert daemon_gone(pid), "the daemon did not exit after its mount went away"


def test_a_bad_number_of_readers_is_refused_in_one_line(store: Path, tmp_path: Path) -> None:
    (tmp_path / "mnt").mkdir()
    for bad in ("0", "33"):
        result = run_cli("mount", f"file://{store}", str(tmp_path / "mnt"), "--read-only", "--fuse-threads", bad)
        assert result.returncode != 0
        assert "--fuse-threads" in result.stderr and "between 1 and 32" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
