"""The mtime a writer sets, kept in the object's metadata, on a real mount over SeaweedFS (issue 38).

``os.utime`` on a file written through the mount (before its upload) and on a multipart-sized file,
``cp -p`` into the mount, ``touch -d`` on a file only in the bucket (a server-side copy onto itself); the bucket then holds
rclone's ``x-amz-meta-mtime`` (checked with boto3), a rename keeps it, and ``stat`` shows it again
after a remount (the metadata index keeps it, even with every listing refetched: ``--dir-ttl 0``)
and after the cache directory is wiped (``--mtime-from-metadata`` reads it back with a HEAD).
Objects written by rclone (nanoseconds) and by s3fs-fuse (whole seconds) show their mtime with the
option, LastModified without it (docs/semantics.md, "Times").
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest

from tests.fuse.test_writeback import flush_ok, s3env

PREFIX = "mt"
MiB = 1024 * 1024
# A writer's mtime (2017), microseconds included: what cachefs keeps (docs/semantics.md).
SET_NS = 1_500_000_000_123_456_000
SET_TEXT = "1500000000.123456"  # rclone's form of it
# Float seconds carry a mtime to ~0.24 us at these dates: what "equal" means below.
TOLERANCE_NS = 1_000


@pytest.fixture
def bucket(seaweed) -> str:
    name = f"mt-{uuid.uuid4().hex[:12]}"
    seaweed.make_bucket(name)
    return name


def meta(seaweed, bucket: str, name: str) -> dict[str, str]:
    return seaweed.client().head_object(Bucket=bucket, Key=f"{PREFIX}/{name}")["Metadata"]


def assert_mtime(path, expected_ns: int) -> None:
    shown = os.stat(path).st_mtime_ns
    assert abs(shown - expected_ns) <= TOLERANCE_NS, f"{path}: mtime {shown} ns, expected {expected_ns} ns"


def test_a_set_mtime_is_in_the_bucket_and_survives_a_remount_and_a_cache_wipe(seaweed, bucket: str, mounter,
                                                                               tmp_path) -> None:
    seaweed.put(bucket, f"{PREFIX}/clean.bin", b"in the bucket before the mount")
    source = f"s3://{bucket}/{PREFIX}"
    cache = tmp_path / "cache"
    m = mounter.mount(source, "--upload-delay", "600", env=s3env(seaweed), cache_dir=cache)
    root = m.path
    (root / "staged.bin").write_bytes(b"written through the mount")
    os.utime(root / "staged.bin", ns=(SET_NS, SET_NS))  # after close, before the upload (rsync -t)
    (root / "big.bin").write_bytes(os.urandom(17 * MiB))  # a two-part multipart upload
    os.utime(root / "big.bin", ns=(SET_NS, SET_NS))
    (root / "written.bin").write_bytes(b"no utime: the time of its last write")
    written_ns = os.stat(root / "written.bin").st_mtime_ns
    local = tmp_path / "local.bin"
    local.write_bytes(b"copied in with cp -p")
    os.utime(local, ns=(SET_NS, SET_NS))
    subprocess.run(["cp", "-p", str(local), str(root / "cp-p.bin")], check=True, timeout=60)  # futimens on the open fd
    # Only in the bucket: touch -d is a copy onto itself.
    subprocess.run(["touch", "-d", f"@{SET_TEXT}", str(root / "clean.bin")], check=True, timeout=60)
    assert meta(seaweed, bucket, "clean.bin")["mtime"] == SET_TEXT  # done before utime returned
    os.rename(root / "clean.bin", root / "moved.bin")  # a server-side copy keeps the metadata
    flush_ok(m)
    for name in ("staged.bin", "big.bin", "moved.bin", "cp-p.bin"):
        assert meta(seaweed, bucket, name)["mtime"] == SET_TEXT, name
        assert_mtime(root / name, SET_NS)
    assert abs(float(meta(seaweed, bucket, "written.bin")["mtime"]) * 1e9 - written_ns) <= TOLERANCE_NS
    head = seaweed.client().head_object(Bucket=bucket, Key=f"{PREFIX}/big.bin")
    assert head["ETag"].strip('"').endswith("-2")
    assert m.unmount().returncode == 0

    # Remounted on the same cache, every listing fetched again: the index keeps what was set.
    m = mounter.mount(source, "--dir-ttl", "0", env=s3env(seaweed), cache_dir=cache, mountpoint=root)
    for name in ("staged.bin", "big.bin", "moved.bin", "cp-p.bin"):
        assert_mtime(root / name, SET_NS)
    assert_mtime(root / "written.bin", written_ns)
    assert m.unmount().returncode == 0

    # The cache wiped: only the metadata can tell, and --mtime-from-metadata reads it.
    shutil.rmtree(cache)
    m = mounter.mount(source, "--mtime-from-metadata", env=s3env(seaweed), cache_dir=cache, mountpoint=root)
    for name in ("staged.bin", "big.bin", "moved.bin", "cp-p.bin"):
        assert_mtime(root / name, SET_NS)
    assert_mtime(root / "written.bin", written_ns)
    assert m.stats()["filesystem"]["mtime_heads"] == 5  # one per file, none again
    assert m.unmount().returncode == 0


def test_objects_rclone_and_s3fs_wrote_show_their_mtime_with_the_option(seaweed, bucket: str, mounter) -> None:
    client = seaweed.client()
    client.put_object(Bucket=bucket, Key=f"{PREFIX}/rclone.bin", Body=b"r",
                      Metadata={"mtime": "1500000000.123456789"})  # rclone: nanoseconds, X-Amz-Meta-Mtime
    client.put_object(Bucket=bucket, Key=f"{PREFIX}/s3fs.bin", Body=b"s",
                      Metadata={"mtime": "1500000000", "mode": "33188", "uid": "0", "gid": "0"})  # s3fs-fuse
    client.put_object(Bucket=bucket, Key=f"{PREFIX}/bad.bin", Body=b"b", Metadata={"mtime": "yesterday"})
    source = f"s3://{bucket}/{PREFIX}"
    m = mounter.mount(source, "--read-only", "--mtime-from-metadata", env=s3env(seaweed))
    assert_mtime(m.path / "rclone.bin", 1_500_000_000_123_456_789)
    assert_mtime(m.path / "s3fs.bin", 1_500_000_000_000_000_000)
    last_modified = client.head_object(Bucket=bucket, Key=f"{PREFIX}/bad.bin")["LastModified"].timestamp()
    assert_mtime(m.path / "bad.bin", int(last_modified * 1e9))  # not a time: LastModified, never a wrong one
    # Without the option no HEAD is made: LastModified (rclone's --use-server-modtime).
    plain = mounter.mount(source, "--read-only", env=s3env(seaweed))
    last_modified = client.head_object(Bucket=bucket, Key=f"{PREFIX}/rclone.bin")["LastModified"].timestamp()
    assert_mtime(plain.path / "rclone.bin", int(last_modified * 1e9))
    assert plain.stats()["filesystem"]["mtime_heads"] == 0
