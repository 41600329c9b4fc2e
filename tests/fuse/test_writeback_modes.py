"""The mount options and edges of write-back that a user sees, each through a real mount.

- ``--write-through``: close() returns once the object is in the bucket (no flush needed), and an
  upload error (credentials that may read but not write: AccessDenied) is reported by close() and
  shows in ``cachefs status``, ``cachefs flush`` and the stats; ``cachefs unmount`` then refuses,
  ``--force`` unmounts and keeps the staged data, and the next mount uploads it.
- ``--read-only``: every change answers EROFS and nothing reaches the bucket.
- ``--rename-dir-limit``: renaming a directory with more entries fails with E2BIG and moves nothing.
- ``utimens`` on a file written through the mount is shown by ``stat`` before any upload.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import uuid
from pathlib import Path

import pytest

from tests.fuse.conftest import run_cli
from tests.fuse.writeback_support import bounded, flush, flush_ok, list_keys, read_bucket, s3env
from tests.support.s3servers import SeaweedS3


def _bucket(seaweed, tag: str) -> str:
    name = f"{tag}-{uuid.uuid4().hex[:10]}"
    seaweed.make_bucket(name)
    return name


class SeaweedWithReader(SeaweedS3):
    """SeaweedFS with a second identity that may only read and list: its uploads get AccessDenied."""

    def __init__(self) -> None:
        super().__init__()
        self.reader_key = "AK" + secrets.token_hex(9).upper()
        self.reader_secret = secrets.token_urlsafe(30)

    def _write_identities(self) -> None:
        super()._write_identities()
        doc = json.loads(self.config_path.read_text())
        doc["identities"].append({
            "name": "cachefs-reader",
            "credentials": [{"accessKey": self.reader_key, "secretKey": self.reader_secret}],
            "actions": ["Read", "List"],
        })
        self.config_path.write_text(json.dumps(doc))

    def reader_env(self) -> dict[str, str]:
        return {**s3env(self), "AWS_ACCESS_KEY_ID": self.reader_key, "AWS_SECRET_ACCESS_KEY": self.reader_secret}


def test_write_through_upload_errors_and_unmount_force(mounter, tmp_path: Path) -> None:
    """--write-through: close() returns after the upload, and reports its failure (AccessDenied), which
    also shows in status, flush and the stats. unmount refuses while data is pending; --force unmounts
    and keeps the staged data, which the next mount (with credentials that may write) uploads."""
    cache = tmp_path / "cache"
    with SeaweedWithReader() as server:
        bucket = f"wbwt-{uuid.uuid4().hex[:10]}"
        server.make_bucket(bucket)
        client = server.client()
        source = f"s3://{bucket}"
        m = mounter.mount(source, "--write-through", env=s3env(server), cache_dir=cache)
        data = os.urandom(300 * 1024)
        (m.path / "ok.bin").write_bytes(data)  # returns after close()
        assert read_bucket(client, bucket, "")[0] == {"ok.bin": data}, "close() returned before the upload"
        assert m.unmount().returncode == 0

        m = mounter.mount(source, "--write-through", env=server.reader_env(), cache_dir=cache)
        with pytest.raises(OSError) as info:
            bounded(lambda: (m.path / "denied.bin").write_bytes(b"not uploaded"), 120, "close() of a refused upload")
        assert info.value.errno in (errno.EACCES, errno.EPERM, errno.EIO), info.value
        assert (m.path / "denied.bin").read_bytes() == b"not uploaded"  # staged, not lost
        status = run_cli("status", str(m.path / "denied.bin"), env=m.env)
        assert "dirty" in status.stdout and "AccessDenied" in status.stdout, status.stdout + status.stderr
        assert "AccessDenied" in (m.stats()["writeback"].get("last_error") or "")
        flushed = flush(m, 3)
        assert flushed.returncode != 0 and "denied.bin" in flushed.stdout and "AccessDenied" in flushed.stdout, (
            flushed.stdout + flushed.stderr)
        refused = run_cli("unmount", str(m.path), "--flush-timeout", "3", env=m.env)
        assert refused.returncode != 0 and m.mounted, "unmount went ahead with data pending"
        assert "denied.bin" in refused.stdout + refused.stderr
        forced = run_cli("unmount", str(m.path), "--force", env=m.env)
        assert forced.returncode == 0 and not m.mounted, forced.stderr
        assert "denied.bin" not in list_keys(client, bucket, "")

        m = mounter.mount(source, env=s3env(server), cache_dir=cache)
        assert (m.path / "denied.bin").read_bytes() == b"not uploaded"
        flush_ok(m)
        assert read_bucket(client, bucket, "")[0] == {"ok.bin": data, "denied.bin": b"not uploaded"}


def test_read_only_mount_refuses_every_change(seaweed, mounter) -> None:
    bucket = _bucket(seaweed, "wbro")
    seaweed.put(bucket, "d/f.txt", b"hello")
    m = mounter.mount(f"s3://{bucket}", "--read-only", env=s3env(seaweed))
    attempts = {
        "create": lambda: (m.path / "new.txt").write_bytes(b"x"),
        "overwrite": lambda: (m.path / "d" / "f.txt").write_bytes(b"x"),
        "append": lambda: open(m.path / "d" / "f.txt", "ab").close(),
        "truncate": lambda: os.truncate(m.path / "d" / "f.txt", 0),
        "unlink": lambda: os.unlink(m.path / "d" / "f.txt"),
        "mkdir": lambda: os.mkdir(m.path / "e"),
        "rmdir": lambda: os.rmdir(m.path / "d"),
        "rename": lambda: os.rename(m.path / "d" / "f.txt", m.path / "g.txt"),
    }
    for what, attempt in attempts.items():
        with pytest.raises(OSError) as info:
            attempt()
        assert info.value.errno == errno.EROFS, f"{what}: {info.value}"
    assert (m.path / "d" / "f.txt").read_bytes() == b"hello"
    assert set(list_keys(seaweed.client(), bucket, "")) == {"d/f.txt"}


def test_directory_rename_beyond_the_limit_is_refused(seaweed, mounter) -> None:
    bucket = _bucket(seaweed, "wbrn")
    m = mounter.mount(f"s3://{bucket}", "--rename-dir-limit", "4", env=s3env(seaweed))
    (m.path / "big").mkdir()
    for i in range(6):
        (m.path / "big" / f"f{i}").write_bytes(b"%d" % i)
    (m.path / "small").mkdir()
    (m.path / "small" / "x").write_bytes(b"x")
    flush_ok(m)  # some renames then work on objects in the store, not only on staged files
    (m.path / "big" / "f6").write_bytes(b"6")
    with pytest.raises(OSError) as info:
        os.rename(m.path / "big", m.path / "moved")
    assert info.value.errno == errno.E2BIG
    assert sorted(os.listdir(m.path)) == ["big", "small"]
    assert sorted(os.listdir(m.path / "big")) == [f"f{i}" for i in range(7)]
    os.rename(m.path / "small", m.path / "small2")
    assert (m.path / "small2" / "x").read_bytes() == b"x"
    flush_ok(m)
    files, markers = read_bucket(seaweed.client(), bucket, "")
    assert files == {**{f"big/f{i}": b"%d" % i for i in range(7)}, "small2/x": b"x"}
    assert "small" not in markers


def test_utime_of_a_written_file_is_shown(seaweed, mounter, tmp_path: Path) -> None:
    bucket = _bucket(seaweed, "wbut")
    m = mounter.mount(f"s3://{bucket}", env=s3env(seaweed))
    path = m.path / "f.txt"
    path.write_bytes(b"data")
    os.utime(path, (1_600_000_000, 1_600_000_000))
    assert path.stat().st_mtime == 1_600_000_000
    assert path.read_bytes() == b"data"
