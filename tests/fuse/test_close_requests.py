"""What close() costs the daemon: nothing for a descriptor opened only to read (its open answers
FOPEN_NOFLUSH, so the kernel sends no FLUSH: one FUSE request fewer per file a training job opens,
on any mount); a read-only mount also answers a FLUSH with ENOSYS, so the kernel stops sending FLUSH
on that connection (on kernels before 5.16, which ignore FOPEN_NOFLUSH); a writable mount gets the
FLUSH of every descriptor that may have written, since close() makes written data durable there.

Real FUSE mounts over a ``file://`` store; the counts are the daemon's own (``filesystem.flushes``).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.fuse.conftest import run_cli

FILES = 12
WAIT_S = 10.0


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "store" / "small"
    root.mkdir(parents=True)
    for i in range(FILES):
        (root / f"f{i:02d}").write_bytes(bytes([i]) * (1000 + i))
    return tmp_path / "store"


def open_read_close_all(root: Path) -> None:
    for i in range(FILES):
        with open(root / "small" / f"f{i:02d}", "rb") as f:  # close() must succeed: it raises otherwise
            assert f.read() == bytes([i]) * (1000 + i)


def test_a_read_only_mount_gets_at_most_one_flush(store: Path, mounter) -> None:
    m = mounter.mount(f"file://{store}", "--read-only")
    open_read_close_all(m.path)
    open_read_close_all(m.path)
    stats = m.stats()["filesystem"]
    assert stats["opens"] >= FILES
    assert stats["flushes"] <= 1, "the kernel kept sending FLUSH after ENOSYS"


def test_a_writable_mount_gets_a_flush_only_from_writers(store: Path, mounter) -> None:
    m = mounter.mount(f"file://{store}")
    open_read_close_all(m.path)
    assert m.stats()["filesystem"]["flushes"] == 0, "read-only descriptors sent FLUSH"
    (m.path / "small" / "new").write_bytes(b"durable at close")
    with open(m.path / "small" / "f00", "r+b") as f:  # opened to write, even if it writes nothing
        assert f.read(1) == b"\0"
    assert m.stats()["filesystem"]["flushes"] == 2
    assert (m.path / "small" / "new").read_bytes() == b"durable at close"


def test_a_manifest_mount_serves_warm_files_with_no_request(store: Path, mounter, tmp_path: Path) -> None:
    """A mount pinned to a manifest (its files never change) answers the first OPEN with ENOSYS: the
    kernel then opens and closes files itself and keeps their pages, so a warm file costs the daemon
    no request (no open, read, flush or release: 0 opens, 0 reads), where before each cost an OPEN."""
    plain = mounter.mount(f"file://{store}", "--read-only")
    manifest = tmp_path / "m.jsonl"
    result = run_cli("snapshot", str(plain.path), "-o", str(manifest), env=plain.env)
    assert result.returncode == 0, result.stderr
    m = mounter.mount(f"file://{store}", "--manifest", str(manifest), "--read-only")
    open_read_close_all(m.path)  # cold: READs (through a handle the daemon opens itself), pages kept
    cold = m.stats()["filesystem"]
    assert cold["reads"] >= FILES
    open_read_close_all(m.path)
    open_read_close_all(m.path)
    warm = m.stats()["filesystem"]
    assert {k: warm[k] - cold[k] for k in ("opens", "flushes", "lookups")} == {"opens": 0, "flushes": 0, "lookups": 0}
    # READs only for pages the kernel reclaimed between the passes (proactive reclaim runs on these
    # VMs; a busy machine's memory pressure does too): without kept pages every file would read twice.
    assert warm["reads"] - cold["reads"] <= FILES // 4
    # A plain read-only mount still opens each file (its files may change in the bucket).
    before = plain.stats()["filesystem"]["opens"]
    open_read_close_all(plain.path)
    assert plain.stats()["filesystem"]["opens"] - before == FILES


def test_a_warm_file_on_a_writable_mount_costs_an_open_and_a_release(store: Path, mounter) -> None:
    """The daemon's own count of the requests the kernel sent (``fuse.requests``): a warm file on a
    writable mount reaches the daemon as one OPEN and one RELEASE (no LOOKUP, GETATTR, READ or FLUSH:
    long timeouts and kept pages). Unbuffered opens: Python's buffered ``open`` asks ``isatty``, an
    IOCTL the kernel sends on (docs/statistics.md)."""
    m = mounter.mount(f"file://{store}", "--attr-ttl", "3600", "--dir-ttl", "3600")
    open_read_close_all(m.path)  # cold: LOOKUPs, READs
    first = m.stats()["fuse"]["requests"]
    assert first["lookup"] >= FILES and first["read"] >= FILES and first["init"] == 1
    read_unbuffered(m.path)  # (the GETATTR of each file's atime, which the cold READs made stale)
    before = m.stats()["fuse"]["requests"]
    read_unbuffered(m.path)
    deadline = time.monotonic() + WAIT_S  # (the kernel may send a RELEASE after close() returned)
    while True:
        now = m.stats()["fuse"]["requests"]
        delta = {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}
        if delta.get("release", 0) >= FILES or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    delta.pop("getxattr", None)  # the stats calls themselves
    delta.pop("read", None)  # pages the kernel reclaimed meanwhile (see the manifest test above)
    assert delta == {"open": FILES, "release": FILES}


def read_unbuffered(root: Path) -> None:
    for i in range(FILES):
        with open(root / "small" / f"f{i:02d}", "rb", buffering=0) as f:
            assert f.read() == bytes([i]) * (1000 + i)
