"""Kernel passthrough on a real mount: a file whole on the disk tier is read without the daemon.

The proof is the daemon's own count of READ requests (``filesystem.reads`` in /stats): after the
file's pages are dropped from the mount's page cache (``posix_fadvise(DONTNEED)`` on the file, never
the machine-wide drop_caches), reading it again would have to ask the daemon for every byte, unless
the kernel reads the backing file itself. Where the kernel offers passthrough and this user may
register backing files (root), these tests fail when it is not used; elsewhere they skip, saying why.
"""

from __future__ import annotations

import errno
import gzip
import mmap
import os
import platform
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cachefs.fuse.backingfiles import may_register_backing
from tests.fuse.conftest import Mount, Mounter, read_dropping_page_cache, run_cli

MiB = 1024 * 1024
BLOCK = ["--block-size", "1MiB"]
FAST_TTL = ["--attr-ttl", "0.2", "--dir-ttl", "0.2"]
# Bound on waiting for blocks to land on the disk tier after a read (written by worker threads).
SETTLE_S = 30


def kernel_passthrough_reason() -> str | None:
    """Why this machine cannot use passthrough, or None if it can (kernel and privilege)."""
    release = platform.release()
    config = None
    for path in (f"/boot/config-{release}", "/proc/config.gz"):
        try:
            raw = Path(path).read_bytes()
        except OSError:
            continue
        config = (gzip.decompress(raw) if path.endswith(".gz") else raw).decode(errors="replace")
        break
    if config is not None:
        if "CONFIG_FUSE_PASSTHROUGH=y" not in config:
            return f"kernel {release} is built without CONFIG_FUSE_PASSTHROUGH"
    else:
        major, minor = (int(part) for part in release.split(".")[:2])
        if (major, minor) < (6, 9):
            return f"kernel {release} predates FUSE passthrough (Linux 6.9)"
    if not may_register_backing():
        return "registering backing files needs CAP_SYS_ADMIN in the initial user namespace (run as root)"
    return None


@pytest.fixture
def passthrough_machine() -> None:
    reason = kernel_passthrough_reason()
    if reason is not None:
        pytest.skip(f"passthrough cannot be used here: {reason}")


def store_with(tmp_path: Path, files: dict[str, bytes]) -> Path:
    root = tmp_path / "store"
    for key, data in files.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)
    return root


def counts(mount: Mount) -> tuple[int, int]:
    """(READ requests the daemon served, passthrough opens)."""
    doc = mount.stats()
    return doc["filesystem"]["reads"], doc["fuse"]["passthrough_opens"]


def until_passed_through(mount: Mount, path: Path) -> None:
    """Open ``path`` until an open passes through (its blocks reached the disk tier); fails past SETTLE_S."""
    deadline = time.monotonic() + SETTLE_S
    while counts(mount)[1] == 0:
        assert time.monotonic() < deadline, f"no open of {path} passed through in {SETTLE_S} s: {mount.stats()['fuse']}"
        with open(path, "rb") as fh:
            fh.read(1)


def passed_through(mounter: Mounter, tmp_path: Path, name: str, data: bytes) -> tuple[Path, Mount, Path]:
    """A read-only mount of a store holding ``name`` = ``data``, read whole once, then opened until an
    open passes through: the store, the mount and the file's path in it."""
    store = store_with(tmp_path, {name: data})
    mount = mounter.mount(f"file://{store}", "--read-only", *BLOCK, *FAST_TTL)
    path = mount.path / name
    assert path.read_bytes() == data
    until_passed_through(mount, path)
    return store, mount, path


def whole_files(mount: Mount) -> list[Path]:
    return [p for p in mount.cache_dir.glob("*/whole/*/*") if p.is_file()]


def test_a_file_whole_on_the_disk_tier_is_read_with_no_read_request(
        passthrough_machine: None, mounter: Mounter, tmp_path: Path) -> None:
    data = random.Random("whole").randbytes(3 * MiB + 1234)
    store = store_with(tmp_path, {"d/a.bin": data})
    mount = mounter.mount(f"file://{store}", "--read-only", *BLOCK)
    path = mount.path / "d" / "a.bin"
    assert path.read_bytes() == data  # the cold read: blocks fetched, written to the disk tier
    assert mount.stats()["fuse"]["passthrough"] is True
    until_passed_through(mount, path)
    reads, opens = counts(mount)
    assert read_dropping_page_cache(path) == data
    assert counts(mount) == (reads, opens + 1)  # one more passthrough open, and no READ at all
    # mmap reads the backing file too.
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        assert mapped[:] == data
    assert counts(mount)[0] == reads
    assert len(whole_files(mount)) == 1


def test_a_partial_file_is_served_by_the_daemon(passthrough_machine: None, mounter: Mounter, tmp_path: Path) -> None:
    data = random.Random("partial").randbytes(48 * MiB)
    store = store_with(tmp_path, {"big.bin": data})
    mount = mounter.mount(f"file://{store}", "--read-only", *BLOCK)
    path = mount.path / "big.bin"
    for _ in range(2):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead: only the first page is read
            assert os.pread(fd, 4096, 0) == data[:4096]
        finally:
            os.close(fd)
    doc = mount.stats()
    assert doc["fuse"]["passthrough"] is True
    assert doc["fuse"]["passthrough_opens"] == 0 and whole_files(mount) == []


def test_a_changed_etag_is_never_served_from_the_old_whole_file(
        passthrough_machine: None, mounter: Mounter, tmp_path: Path) -> None:
    old = random.Random("old").randbytes(MiB + 7)
    new = random.Random("new").randbytes(MiB + 7)
    store, mount, path = passed_through(mounter, tmp_path, "f.bin", old)
    held = os.open(path, os.O_RDONLY)  # the old version, held through passthrough
    try:
        (store / "f.bin").write_bytes(new)
        os.utime(store / "f.bin", ns=(time.time_ns() + 10**9,) * 2)  # a new mtime: a new ETag
        deadline = time.monotonic() + SETTLE_S
        while True:  # until the attribute cache (0.2 s) lets the open see the new version
            assert time.monotonic() < deadline, "the new version was never seen"
            try:
                with open(path, "rb") as fh:
                    assert fh.read(16) == old[:16]
            except OSError as exc:
                # Another version while the old one is held through passthrough: refused, not old bytes.
                assert exc.errno == errno.ETXTBSY
                break
        assert mount.stats()["fuse"]["passthrough_refused"] >= 1
        assert os.pread(held, 16, 0) == old[:16]  # the holder keeps the version it opened
    finally:
        os.close(held)
    reads = counts(mount)[0]
    assert path.read_bytes() == new  # no page of the old version is kept for it
    assert read_dropping_page_cache(path) == new  # the new version: not whole on disk yet, served by the daemon
    assert counts(mount)[0] > reads


@pytest.mark.parametrize("args", [[], ["--read-only", "--no-passthrough"]], ids=["writable", "no-passthrough"])
def test_a_writable_mount_never_passes_through(passthrough_machine: None, mounter: Mounter, tmp_path: Path,
                                               args: list[str]) -> None:
    data = random.Random("rw").randbytes(MiB)
    store = store_with(tmp_path, {"w.bin": data})
    mount = mounter.mount(f"file://{store}", *BLOCK, *args)
    path = mount.path / "w.bin"
    for _ in range(3):
        assert read_dropping_page_cache(path) == data
    doc = mount.stats()
    assert doc["fuse"]["passthrough"] is False and doc["fuse"]["passthrough_opens"] == 0
    assert doc["filesystem"]["reads"] >= 3
    if not args:
        with open(path, "r+b") as fh:  # writers are unaffected
            fh.write(b"x")


def test_eviction_removes_the_whole_file(passthrough_machine: None, mounter: Mounter, tmp_path: Path) -> None:
    data = random.Random("evict").randbytes(2 * MiB)
    store = store_with(tmp_path, {"e/x.bin": data, "e/y.bin": data[::-1]})
    mount = mounter.mount(f"file://{store}", "--read-only", *BLOCK)
    for name, content in (("x.bin", data), ("y.bin", data[::-1])):
        path = mount.path / "e" / name
        assert path.read_bytes() == content
        until_passed_through(mount, path)
        assert read_dropping_page_cache(path) == content
    assert len(whole_files(mount)) == 2
    result = run_cli("evict", str(mount.path), str(mount.path / "e" / "x.bin"), env=mount.env)
    assert result.returncode == 0, result.stderr
    assert len(whole_files(mount)) == 1
    assert mount.stats()["fuse"]["whole_files"]["files"] == 1
    result = run_cli("evict", str(mount.path), env=mount.env)
    assert result.returncode == 0, result.stderr
    assert whole_files(mount) == [] and mount.stats()["fuse"]["whole_files"]["bytes"] == 0
    # Evicted: the next open is served by the daemon again, from the source.
    reads, opens = counts(mount)
    assert read_dropping_page_cache(mount.path / "e" / "x.bin") == data
    reads_after, opens_after = counts(mount)
    assert opens_after == opens and reads_after > reads


def test_the_backing_file_is_registered_once_for_many_opens(
        passthrough_machine: None, mounter: Mounter, tmp_path: Path) -> None:
    data = random.Random("once").randbytes(MiB + 99)
    store = store_with(tmp_path, {"o.bin": data})
    mount = mounter.mount(f"file://{store}", "--read-only", *BLOCK)
    path = mount.path / "o.bin"
    assert path.read_bytes() == data
    until_passed_through(mount, path)
    reads, opens = counts(mount)
    for _ in range(5):
        assert read_dropping_page_cache(path) == data
    fuse = mount.stats()["fuse"]
    assert counts(mount) == (reads, opens + 5)  # five passthrough opens, no READ
    # One registration for all of them: the id is kept between opens of the inode.
    assert fuse["backing_registrations"] == 1 and fuse["backing_ids"] == 1, fuse


def fuse_section_until(mount: Mount, check: str, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    deadline = time.monotonic() + SETTLE_S
    while not done(fuse := mount.stats()["fuse"]):
        assert time.monotonic() < deadline, f"{check}: {fuse}"
        time.sleep(0.05)
    return fuse


def test_an_evicted_or_replaced_whole_file_releases_its_backing_id(
        passthrough_machine: None, mounter: Mounter, tmp_path: Path) -> None:
    old = random.Random("kept-old").randbytes(MiB + 5)
    new = random.Random("kept-new").randbytes(MiB + 5)
    store, mount, path = passed_through(mounter, tmp_path, "k.bin", old)
    assert mount.stats()["fuse"]["backing_ids"] == 1  # kept after the last close
    # Evicted: the id that held the whole file open is closed, so its space is really freed.
    result = run_cli("evict", str(mount.path), str(path), env=mount.env)
    assert result.returncode == 0, result.stderr
    fuse_section_until(mount, "the evicted whole file's id was never closed", lambda f: f["backing_ids"] == 0)
    assert whole_files(mount) == []
    assert read_dropping_page_cache(path) == old  # from the source again, by the daemon
    registered = mount.stats()["fuse"]["backing_registrations"]
    deadline = time.monotonic() + SETTLE_S
    while mount.stats()["fuse"]["backing_registrations"] == registered:
        assert time.monotonic() < deadline, "the whole file was never registered again"
        assert read_dropping_page_cache(path) == old
    # Replaced in the bucket: the kept id of the old version is closed at the next open, whose bytes
    # are the new version's (served by the daemon until that one is whole on disk, then passed through).
    (store / "k.bin").write_bytes(new)
    os.utime(store / "k.bin", ns=(time.time_ns() + 10**9,) * 2)  # a new mtime: a new ETag
    registered = mount.stats()["fuse"]["backing_registrations"]
    deadline = time.monotonic() + SETTLE_S
    while (got := read_dropping_page_cache(path)) != new:
        assert got == old and time.monotonic() < deadline, "the new version was never seen"
        time.sleep(0.05)  # the attribute cache (0.2 s)
    deadline = time.monotonic() + SETTLE_S
    while (fuse := mount.stats()["fuse"])["backing_registrations"] == registered:
        assert time.monotonic() < deadline, f"the new version was never passed through: {fuse}"
        assert read_dropping_page_cache(path) == new
    assert fuse["backing_ids"] == 1 and fuse["passthrough_refused"] == 0, fuse
    reads = counts(mount)[0]
    assert read_dropping_page_cache(path) == new and counts(mount)[0] == reads
