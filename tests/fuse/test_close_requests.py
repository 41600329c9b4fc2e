"""What close() costs the daemon: a read-only mount answers the first FLUSH with ENOSYS, so the kernel
stops sending FLUSH on that connection (one FUSE request fewer per file a training job opens); a
writable mount gets every FLUSH, since close() makes written data durable there.

Real FUSE mounts over a ``file://`` store; the counts are the daemon's own (``filesystem.flushes``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

FILES = 12


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


def test_a_read_only_mount_gets_one_flush_then_none(store: Path, mounter) -> None:
    m = mounter.mount(f"file://{store}", "--read-only")
    open_read_close_all(m.path)
    open_read_close_all(m.path)
    stats = m.stats()["filesystem"]
    assert stats["opens"] >= FILES
    assert stats["flushes"] == 1, "the kernel kept sending FLUSH after ENOSYS"


def test_a_writable_mount_gets_a_flush_per_close(store: Path, mounter) -> None:
    m = mounter.mount(f"file://{store}")
    open_read_close_all(m.path)
    (m.path / "small" / "new").write_bytes(b"durable at close")
    assert m.stats()["filesystem"]["flushes"] >= FILES + 1
    assert (m.path / "small" / "new").read_bytes() == b"durable at close"
