"""The read path through a real FUSE mount, run on a real S3 server (SeaweedFS) and a file:// store.

The same test bodies run on both backends (the ``backend`` fixture): what a training job sees must
not depend on where the bytes live. Every byte read through the mount is compared with the source.
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

MiB = 1024 * 1024
# Small blocks, so files of a few MiB span many blocks and block boundaries get exercised.
TEST_BLOCK = "256KiB"
FAST_TTL = ["--attr-ttl", "0.2", "--dir-ttl", "0.2"]


def payload(seed: str, size: int) -> bytes:
    rng = random.Random(seed)
    return rng.randbytes(size)


@dataclass
class Backend:
    name: str
    source: str
    env: dict[str, str]
    put: Callable[[str, bytes], None]
    delete: Callable[[str], None]


@pytest.fixture(params=["s3", "file"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "file":
        root = tmp_path / "store"
        root.mkdir()

        def put(key: str, data: bytes) -> None:
            path = root / key
            if key.endswith("/"):
                path.mkdir(parents=True, exist_ok=True)
                return
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp-write")
            tmp.write_bytes(data)
            os.replace(tmp, path)

        def delete(key: str) -> None:
            (root / key).unlink()

        return Backend("file", f"file://{root}", {}, put, delete)
    seaweed = request.getfixturevalue("seaweed")
    bucket = f"fuse-{uuid.uuid4().hex[:12]}"
    seaweed.make_bucket(bucket)
    prefix = "data/"
    return Backend(
        "s3",
        f"s3://{bucket}/{prefix.rstrip('/')}",
        {**seaweed.env(), "AWS_ENDPOINT_URL": seaweed.endpoint_url},
        lambda key, data: seaweed.put(bucket, prefix + key, data),
        lambda key: seaweed.delete(bucket, prefix + key),
    )


DATASET = {
    "train/0001.bin": 3 * MiB + 17,
    "train/0002.bin": 1,
    "train/0003.bin": 0,
    "train/shards/shard-000.bin": 5 * MiB + 12345,
    "val/a.txt": 1000,
    "README": 42,
}


def fill(backend: Backend) -> dict[str, bytes]:
    files = {key: payload(key, size) for key, size in DATASET.items()}
    for key, data in files.items():
        backend.put(key, data)
    backend.put("empty/", b"")  # a directory marker alone makes an empty directory
    return files


def read_all(root: Path, files: dict[str, bytes]) -> None:
    for key, data in files.items():
        got = (root / key).read_bytes()
        assert got == data, f"{key}: {len(got)} bytes read, {len(data)} expected, content differs"


def test_tree_and_bytes(backend: Backend, mounter) -> None:
    files = fill(backend)
    m = mounter.mount(backend.source, "--block-size", TEST_BLOCK, env=backend.env)
    seen_files, seen_dirs = set(), set()
    for dirpath, dirnames, filenames in os.walk(m.path):
        rel = Path(dirpath).relative_to(m.path)
        seen_dirs.update(str(rel / d) for d in dirnames)
        seen_files.update(str(rel / f) for f in filenames)
    assert seen_files == set(files)
    assert seen_dirs == {"train", "train/shards", "val", "empty"}
    for key, data in files.items():
        st = os.stat(m.path / key)
        assert st.st_size == len(data)
    read_all(m.path, files)
    assert os.listdir(m.path / "empty") == []


def test_random_ranges_and_concurrent_readers(backend: Backend, mounter) -> None:
    files = fill(backend)
    m = mounter.mount(backend.source, "--block-size", TEST_BLOCK, env=backend.env)
    key = "train/shards/shard-000.bin"
    data = files[key]
    rng = random.Random(7)
    fd = os.open(m.path / key, os.O_RDONLY)
    try:
        for _ in range(200):
            offset = rng.randrange(0, len(data) + 100)
            length = rng.randrange(0, 600_000)
            assert os.pread(fd, length, offset) == data[offset : offset + length]
    finally:
        os.close(fd)

    errors: list[str] = []

    def reader(seed: int) -> None:
        r = random.Random(seed)
        keys = list(files)
        for _ in range(20):
            k = r.choice(keys)
            with open(m.path / k, "rb") as fh:
                if r.random() < 0.5:
                    got = fh.read()
                    if got != files[k]:
                        errors.append(f"whole {k}")
                else:
                    off = r.randrange(0, max(1, len(files[k])))
                    fh.seek(off)
                    got = fh.read(r.randrange(1, 2 * MiB))
                    if got != files[k][off : off + len(got)] or (len(got) == 0 and off < len(files[k])):
                        errors.append(f"range {k}@{off}")

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


def test_second_epoch_served_from_cache(backend: Backend, mounter) -> None:
    files = fill(backend)
    m = mounter.mount(backend.source, "--block-size", TEST_BLOCK, env=backend.env)
    read_all(m.path, files)
    first = m.stats()
    assert first["object_store"]["get_requests"] > 0
    # Nothing fetched again, and with keep_cache the kernel page cache served the re-read. Not
    # necessarily every page: the kernel may reclaim clean pages between the epochs (this VM runs
    # DAMON's proactive reclaim; one CI-like run saw 14 reads against 13, and two test runs side by
    # side 7 of 13), so up to three epochs are read and one must be served by the page cache. Without
    # keep_cache each open drops the file's pages and every re-read asks for all of them again.
    repeated, done = [], first
    for _ in range(3):
        read_all(m.path, files)
        now = m.stats()
        repeated.append(now["filesystem"]["reads"] - done["filesystem"]["reads"])
        assert now["object_store"]["get_requests"] == first["object_store"]["get_requests"]
        done = now
        if repeated[-1] <= first["filesystem"]["reads"] // 4:
            break
    assert min(repeated) <= first["filesystem"]["reads"] // 4, f"{repeated} of {first['filesystem']['reads']} reads repeated"


def test_remount_reuses_disk_cache(backend: Backend, mounter, tmp_path: Path) -> None:
    files = fill(backend)
    cache = tmp_path / "shared-cache"
    m1 = mounter.mount(backend.source, "--block-size", TEST_BLOCK, env=backend.env, cache_dir=cache)
    read_all(m1.path, files)
    assert m1.gets() > 0
    assert m1.unmount().returncode == 0
    m2 = mounter.mount(backend.source, "--block-size", TEST_BLOCK, env=backend.env, cache_dir=cache)
    read_all(m2.path, files)
    stats = m2.stats()
    assert stats["object_store"]["get_requests"] == 0
    assert stats["tiers"]["disk"]["hits"] > 0


def test_small_files_on_the_disk_tier_are_answered_without_a_ram_copy(backend: Backend, mounter,
                                                                       tmp_path: Path) -> None:
    """After a remount, a READ that asks for a small file's whole block is served from the disk tier
    by the FUSE reader thread itself (``tiering.engine.diskhit``): the right bytes, every one a
    disk-tier hit, and none of them copied into the RAM tier."""
    from tests.fuse.conftest import read_dropping_page_cache

    files = {f"small/{i:03d}": payload(f"small-{i}", size)
             for i, size in enumerate([1, 4095, 4096, 50_000, 100 * 1024, 100 * 1024 + 1])}
    for key, data in files.items():
        backend.put(key, data)
    cache = tmp_path / "shared-cache"
    m1 = mounter.mount(backend.source, "--block-size", TEST_BLOCK, env=backend.env, cache_dir=cache)
    for key, data in files.items():
        assert (m1.path / key).read_bytes() == data
    assert m1.unmount().returncode == 0
    m2 = mounter.mount(backend.source, "--block-size", TEST_BLOCK, env=backend.env, cache_dir=cache)
    for key, data in files.items():
        assert read_dropping_page_cache(m2.path / key) == data
    stats = m2.stats()
    assert stats["object_store"]["get_requests"] == 0
    assert stats["blocks"]["disk_served"] == len(files)
    assert stats["tiers"]["ram"]["entries"] == 0 and stats["tiers"]["ram"]["inserts"] == 0


def test_changed_object_same_size_is_never_served_stale(backend: Backend, mounter) -> None:
    key = "train/0001.bin"
    old = payload("old", 2 * MiB)
    new = payload("new", 2 * MiB)
    backend.put(key, old)
    m = mounter.mount(backend.source, "--block-size", TEST_BLOCK, *FAST_TTL, env=backend.env)
    assert (m.path / key).read_bytes() == old
    if backend.name == "file":
        time.sleep(0.01)  # a new mtime_ns, so the local store's ETag changes
    backend.put(key, new)
    deadline = time.monotonic() + 20
    got = old
    while time.monotonic() < deadline:
        got = (m.path / key).read_bytes()
        assert got in (old, new), "a read mixed bytes of two versions"
        if got == new:
            break
        time.sleep(0.1)
    assert got == new


def test_writes_are_refused_read_only(backend: Backend, mounter) -> None:
    fill(backend)
    m = mounter.mount(backend.source, "--read-only", env=backend.env)
    attempts = [
        lambda: open(m.path / "new.txt", "wb"),
        lambda: open(m.path / "README", "r+b"),
        lambda: os.mkdir(m.path / "newdir"),
        lambda: os.unlink(m.path / "README"),
        lambda: os.rename(m.path / "README", m.path / "README2"),
        lambda: os.truncate(m.path / "README", 0),
        lambda: os.rmdir(m.path / "empty"),
    ]
    for attempt in attempts:
        with pytest.raises(OSError) as info:
            attempt()
        assert info.value.errno == errno.EROFS
    assert (m.path / "README").read_bytes() == payload("README", 42)


def test_o_direct_reads_keep_the_session_alive(backend: Backend, mounter) -> None:
    files = fill(backend)
    m = mounter.mount(backend.source, "--block-size", TEST_BLOCK, env=backend.env)
    key = "train/0001.bin"
    fd = os.open(m.path / key, os.O_RDONLY | os.O_DIRECT)
    try:
        import mmap

        buf = mmap.mmap(-1, 1 * MiB)  # page-aligned buffer, as O_DIRECT wants
        n = os.preadv(fd, [buf], 0)
        assert buf[:n] == files[key][:n] and n > 0
        # An unaligned read must either work or fail cleanly, never break the mount.
        try:
            assert os.pread(fd, 1000, 3) == files[key][3:1003]
        except OSError as exc:
            assert exc.errno == errno.EINVAL
    finally:
        os.close(fd)
    read_all(m.path, files)


def test_unmount_leaves_mountpoint_empty_and_daemon_gone(backend: Backend, mounter) -> None:
    fill(backend)
    m = mounter.mount(backend.source, env=backend.env)
    assert m.mounted
    result = m.unmount()
    assert result.returncode == 0, result.stderr
    assert not m.mounted
    assert os.listdir(m.path) == []
    with pytest.raises(ProcessLookupError):
        for _ in range(100):  # the unmount waited for the daemon; it must be gone now
            os.kill(m.pid, 0)
            time.sleep(0.05)
