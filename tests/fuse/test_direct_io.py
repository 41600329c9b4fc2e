"""``cachefs mount --direct-io`` on a real mount (file:// store): every read reaches the daemon, re-reads
included, the bytes are right, writes and read-backs work, and mmap behaves as docs/configuration.md says.

Without the option the kernel's page cache answers a re-read with no FUSE request at all
(tests/fuse/test_read_path.py ``test_second_epoch_served_from_cache``); with it, the daemon's
``filesystem.reads`` counter grows on every read, and the RAM tier, not the object store, serves it.
"""

from __future__ import annotations

import errno
import mmap
import os
import random
from pathlib import Path

import pytest

from cachefs.client import call
from tests.fuse.conftest import run_cli

MiB = 1024 * 1024
BLOCK = ["--block-size", "256KiB"]


def payload(seed: str, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    (root / "train").mkdir(parents=True)
    return root


def reads(m) -> tuple[int, int, int]:
    """The daemon's FUSE read requests, the bytes they returned, and the object store's GETs (asked of
    the control socket in this process: no CLI start-up between a read and its re-read)."""
    stats = call(m.path, "/stats")
    return stats["filesystem"]["reads"], stats["filesystem"]["read_bytes"], stats["object_store"]["get_requests"]


# Re-reads of the mount without --direct-io: the kernel may reclaim the mount's pages between a read
# and its re-read (these VMs run DAMON's proactive reclaim, which takes pages idle for a while, and a
# loaded machine stretches every gap), so the page cache is given this many read/re-read pairs to
# answer one re-read; a mount whose page cache never answers (direct_io set on it) fails them all.
CACHED_ATTEMPTS = 3


def test_every_read_reaches_the_daemon_and_the_re_read_comes_from_the_ram_tier(store: Path, mounter) -> None:
    data = payload("shard", 3 * MiB + 17)
    (store / "train" / "shard.bin").write_bytes(data)
    direct = mounter.mount(f"file://{store}", "--read-only", "--direct-io", *BLOCK)
    cached = mounter.mount(f"file://{store}", "--read-only", *BLOCK)

    # With --direct-io the re-read is sent to the daemon again, all of it, and no block is fetched
    # again (the RAM tier holds them).
    assert (direct.path / "train" / "shard.bin").read_bytes() == data
    first = reads(direct)
    assert (direct.path / "train" / "shard.bin").read_bytes() == data
    second = reads(direct)
    assert second[0] > first[0]
    assert second[1] - first[1] == len(data)
    assert second[2] == first[2]

    # Without it the page cache of the mount answers the re-read: the daemon sees nothing, or a few
    # pages the kernel reclaimed meanwhile, where the --direct-io mount was sent every byte again.
    seen = []
    for _ in range(CACHED_ATTEMPTS):
        assert (cached.path / "train" / "shard.bin").read_bytes() == data
        before = reads(cached)
        assert (cached.path / "train" / "shard.bin").read_bytes() == data
        again = reads(cached)[1] - before[1]
        seen.append(again)
        if again <= len(data) // 4:
            break
    assert min(seen) <= len(data) // 4, f"bytes of {len(data)} read again through the daemon, per attempt: {seen}"


def test_write_and_read_back_through_a_writable_direct_io_mount(store: Path, mounter) -> None:
    m = mounter.mount(f"file://{store}", "--direct-io", *BLOCK)
    body = payload("written", 2 * MiB + 333)
    path = m.path / "out" / "file.bin"
    path.parent.mkdir()
    path.write_bytes(body)
    assert path.read_bytes() == body
    # Unaligned writes and reads (direct I/O in FUSE has no alignment rule, unlike O_DIRECT on a disk).
    patch = payload("patch", 4097)
    fd = os.open(path, os.O_RDWR)
    try:
        assert os.pwrite(fd, patch, 12345) == len(patch)
        expected = body[:12345] + patch + body[12345 + len(patch):]
        assert os.pread(fd, 10_000, 12_000) == expected[12_000:22_000]
    finally:
        os.close(fd)
    with open(path, "ab") as fh:
        fh.write(b"tail")
    expected += b"tail"
    before = reads(m)
    assert path.read_bytes() == expected
    assert reads(m)[0] > before[0]  # read back through the daemon, not the page cache
    flushed = run_cli("flush", str(m.path), "--timeout", "60", env=m.env, timeout=120)
    assert flushed.returncode == 0, flushed.stdout + flushed.stderr
    assert (store / "out" / "file.bin").read_bytes() == expected


def test_private_mmap_reads_and_shared_mmap_is_refused(store: Path, mounter) -> None:
    """MAP_PRIVATE works on a direct-I/O file. MAP_SHARED, read-only included (Python's
    ``mmap.ACCESS_READ``, ``numpy.memmap(mode="r")``), is refused with ENODEV: the kernel allows it
    (6.6 and later) only where INIT asked for FUSE_DIRECT_IO_ALLOW_MMAP, which cachefs.fuse.session
    does not (as libfuse 3.14, the library of earlier releases, did not)."""
    data = payload("mapped", MiB + 5)
    (store / "train" / "mapped.bin").write_bytes(data)
    m = mounter.mount(f"file://{store}", "--read-only", "--direct-io", *BLOCK)
    with open(m.path / "train" / "mapped.bin", "rb") as fh:
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) as private:
            assert private[:] == data
            assert private[MiB:] == data[MiB:]
        with pytest.raises(OSError) as info:
            mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        assert info.value.errno == errno.ENODEV
