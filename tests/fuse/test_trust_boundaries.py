"""Trust boundaries on a real mount (issue 28): what another local user can read of a cache, and
what it can plant in advance.

The mounts are made as root (as the CSI node plugin and most fstab mounts are); the other user is
uid 65534, acting in child processes (``subprocess.run(user=...)``). Each test works in a temp
directory every uid may traverse (0755), so that what keeps uid 65534 out is the cache's own modes,
and one that uid may write (1777) where it prepares directories, as it could in /tmp or in a cache
root that was once left writable. The rules under test are in ``tiering.private``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from tests.fuse.conftest import Mounter, MountFailed, run_cli
from tiering.tiers.blockformat import encode_header
from tiering.blocks import BlockKey
from tiering.objectstore.local import stat_etag

NOBODY = 65534
RUN_TIMEOUT_S = 60

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another uid needs root")


@pytest.fixture
def base() -> Iterator[Path]:
    """A temp directory every uid can traverse, with ``shared/`` (1777) that uid 65534 may write."""
    path = Path(tempfile.mkdtemp(prefix="cachefs-trust-"))
    os.chmod(path, 0o755)
    (path / "shared").mkdir()
    os.chmod(path / "shared", 0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def trust_mounter(base: Path) -> Iterator[Mounter]:
    m = Mounter(base)
    try:
        yield m
    finally:
        m.cleanup()


def as_nobody(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), user=NOBODY, group=NOBODY, extra_groups=[], cwd="/", capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S, check=False)


def bucket(base: Path) -> tuple[str, Path]:
    root = base / "bucket"
    root.mkdir()
    (root / "hello.txt").write_text("hello world")
    return f"file://{root}", root


def per_source_name(source: str) -> str:
    """The per-source directory's name (``MountSettings.source_cache_dir``), as another user can work it
    out: a hash of the source's canonical spelling (``file:///x/bucket/``, with the trailing slash)."""
    canonical = source.rstrip("/") + "/"
    identity = json.dumps({"source": canonical, "endpoint": ""}, sort_keys=True)
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def prepared_by_nobody(base: Path, name: str) -> Path:
    """A directory uid 65534 made (in ``shared/``, where it may), for the test to move into place."""
    path = base / "shared" / name
    made = as_nobody("mkdir", "-p", str(path))
    assert made.returncode == 0, made.stderr
    assert path.stat().st_uid == NOBODY
    return path


def test_nothing_in_the_cache_is_readable_by_others_after_reads_and_writes(base: Path,
                                                                         trust_mounter: Mounter) -> None:
    source, _root = bucket(base)
    cache = base / "cache"  # created by the daemon
    m = trust_mounter.mount(source, cache_dir=cache, mountpoint=base / "mnt")
    assert (m.path / "hello.txt").read_text() == "hello world"
    (m.path / "written.txt").write_text("secret written through the mount")
    # The modes the mount presents are its settings (0644 on a writable mount), not the daemon's umask.
    assert os.stat(m.path / "written.txt").st_mode & 0o777 == 0o644
    assert os.stat(m.path).st_mode & 0o777 == 0o755
    flushed = run_cli("flush", str(m.path))
    assert flushed.returncode == 0, flushed.stderr
    assert (m.path / "written.txt").read_text() == "secret written through the mount"
    found = subprocess.run(["find", str(cache), "-perm", "/o+r"], capture_output=True, text=True, check=True)
    assert found.stdout == ""
    # Stronger: no group or other bit at all, on anything (sockets, temp files, the journal included).
    found = subprocess.run(["find", str(cache), "-perm", "/077"], capture_output=True, text=True, check=True)
    assert found.stdout == ""
    blocks = sorted([*cache.rglob("*.blk"), *cache.rglob("*.pack")])  # small blocks are records of packs
    assert blocks, "the reads should have left blocks in the disk tier"
    assert all(b.stat().st_mode & 0o777 == 0o600 for b in blocks)
    for path in (blocks[0], *cache.glob("*/metadata.db"), *cache.glob("*/daemon.log")):
        read = as_nobody("cat", str(path))
        assert read.returncode != 0 and "Permission denied" in read.stderr, (path, read.stderr)
    grep = as_nobody("grep", "-ra", "secret written", str(cache))
    assert "secret written" not in grep.stdout


def test_a_cache_root_made_by_another_user_is_refused(base: Path, trust_mounter: Mounter) -> None:
    source, _root = bucket(base)
    cache = prepared_by_nobody(base, "cache")
    with pytest.raises(MountFailed) as failed:
        trust_mounter.mount(source, "--read-only", cache_dir=cache, mountpoint=base / "mnt", check=False)
    message = failed.value.result.stderr.strip()
    assert len(message.splitlines()) == 1, message
    assert f"cache directory {cache} is owned by uid {NOBODY}" in message and "chown" in message


def test_a_per_source_dir_prepared_by_another_user_is_refused_and_its_symlink_not_followed(
        base: Path, trust_mounter: Mounter) -> None:
    source, _root = bucket(base)
    victim = base / "root-owned.conf"  # a file only root may write
    victim.write_text("original\n")
    os.chmod(victim, 0o644)
    prepared = prepared_by_nobody(base, "prepared")
    planted = as_nobody("ln", "-s", str(victim), str(prepared / "source.json"))
    assert planted.returncode == 0, planted.stderr
    cache = base / "cache"
    cache.mkdir(mode=0o755)  # root's own cache root
    per_source = cache / per_source_name(source)
    os.rename(prepared, per_source)  # as if uid 65534 had made it while the root was writable
    with pytest.raises(MountFailed) as failed:
        trust_mounter.mount(source, "--read-only", cache_dir=cache, mountpoint=base / "mnt", check=False)
    message = failed.value.result.stderr.strip()
    assert len(message.splitlines()) == 1, message
    assert f"cache directory {per_source} is owned by uid {NOBODY}" in message
    assert victim.read_text() == "original\n"
    assert (per_source / "source.json").is_symlink()


def test_a_block_planted_by_another_user_is_never_served(base: Path, trust_mounter: Mounter) -> None:
    source, root = bucket(base)
    etag = stat_etag(os.stat(root / "hello.txt"))
    key = BlockKey("hello.txt", etag, 0)
    digest = key.digest()
    prepared = prepared_by_nobody(base, "planted")
    block = prepared / "blocks" / digest[:2] / f"{digest}.blk"
    forged = encode_header(key, b"HACKED-DATA") + b"HACKED-DATA"
    made = as_nobody("mkdir", "-p", str(block.parent))
    assert made.returncode == 0, made.stderr
    subprocess.run(["dd", f"of={block}", "status=none"], input=forged, check=True, user=NOBODY)
    cache = base / "cache"
    cache.mkdir(mode=0o755)
    per_source = cache / per_source_name(source)
    os.rename(prepared, per_source)
    try:
        m = trust_mounter.mount(source, "--read-only", cache_dir=cache, mountpoint=base / "mnt", check=False)
    except MountFailed as failed:
        assert f"cache directory {per_source} is owned by uid {NOBODY}" in failed.result.stderr
        return
    assert (m.path / "hello.txt").read_text() == "hello world"  # a115150 served HACKED-DATA


def test_a_runtime_dir_another_user_made_world_writable_is_refused(base: Path, trust_mounter: Mounter) -> None:
    source, _root = bucket(base)
    prepared = prepared_by_nobody(base, "runtime")
    assert as_nobody("chmod", "0777", str(prepared)).returncode == 0
    xdg = base / "xdg"
    xdg.mkdir(mode=0o755)
    os.rename(prepared, xdg / "cachefs")
    with pytest.raises(MountFailed) as failed:
        trust_mounter.mount(source, "--read-only", env={"XDG_RUNTIME_DIR": str(xdg)}, cache_dir=base / "cache",
                            mountpoint=base / "mnt", check=False)
    message = failed.value.result.stderr.strip()
    assert len(message.splitlines()) == 1, message
    assert f"runtime directory {xdg / 'cachefs'} is owned by uid {NOBODY}" in message
    assert not any((xdg / "cachefs").iterdir())  # no socket was made there


@pytest.mark.parametrize("how", ["--manifest", "--manifest-key"])
def test_a_manifest_size_beyond_64_bits_refuses_the_mount_naming_the_line(base: Path, trust_mounter: Mounter,
                                                                         how: str) -> None:
    """a115150 ended the mount with ``OverflowError: Python int too large to convert to SQLite INTEGER``."""
    source, root = bucket(base)
    etag = stat_etag(os.stat(root / "hello.txt"))
    lines = [json.dumps({"path": "hello.txt", "etag": etag, "size": 11}),
             json.dumps({"path": "huge.bin", "etag": etag, "size": 99999999999999999999999})]
    manifest = (root if how == "--manifest-key" else base) / "m.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    with pytest.raises(MountFailed) as refused:
        trust_mounter.mount(source, how, "m.jsonl" if how == "--manifest-key" else str(manifest),
                            cache_dir=base / "cache", mountpoint=base / "mnt", check=False)
    message = refused.value.result.stderr.strip()
    assert len(message.splitlines()) == 1, message
    assert "line 2" in message and f'"size" must be an integer from 0 to {2**63 - 1}' in message


def test_a_log_file_symlink_in_the_cache_is_never_written_through(base: Path, trust_mounter: Mounter) -> None:
    """Even in a directory of the user's own (planted there by root, or before a chown): the daemon's
    own files are opened without following symlinks. a115150 appended its log to the link's target."""
    source, _root = bucket(base)
    victim = base / "root-owned.conf"
    victim.write_text("original\n")
    cache = base / "cache"
    per_source = cache / per_source_name(source)
    per_source.mkdir(parents=True, mode=0o700)
    (per_source / "daemon.log").symlink_to(victim)
    with pytest.raises(MountFailed) as failed:
        trust_mounter.mount(source, "--read-only", cache_dir=cache, mountpoint=base / "mnt", check=False)
    message = failed.value.result.stderr.strip()
    assert message == f"cachefs: error: {per_source / 'daemon.log'} is a symlink; cachefs writes only its own files there: remove it"
    assert victim.read_text() == "original\n"
