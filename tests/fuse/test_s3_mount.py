"""S3-specific behaviour through a real mount: the object view, outages, refusals and secrets."""

from __future__ import annotations

import errno
import os
import socket
import time
import uuid
from pathlib import Path

import pytest

from tests.fuse.conftest import MountFailed, run_cli
from tests.fuse.writeback_support import kill9

MiB = 1024 * 1024


@pytest.fixture
def bucket(seaweed) -> str:
    name = f"view-{uuid.uuid4().hex[:12]}"
    seaweed.make_bucket(name)
    return name


def s3env(server) -> dict[str, str]:
    return {**server.env(), "AWS_ENDPOINT_URL": server.endpoint_url}


def test_object_view_prefix_markers_and_bad_keys(moto, mounter) -> None:
    # moto, because SeaweedFS refuses to store keys with empty or dot components at all; a bucket
    # written by other tools (or AWS itself) can hold them, and the mount must skip them safely.
    bucket = f"view-{uuid.uuid4().hex[:12]}"
    moto.make_bucket(bucket)
    good = {"data/a.txt": b"a", "data/sub/b.txt": b"bb", "data/sub2/": b"", "data/sub2/c": b"ccc"}
    outside = {"data2/x": b"x", "other/y": b"y", "datafile": b"z"}
    bad = {"data/x//y": b"1", "data/./dot": b"2", "data/../escape": b"3", "data/" + "n" * 256: b"4"}
    for key, value in {**good, **outside, **bad}.items():
        moto.put(bucket, key, value)
    m = mounter.mount(f"s3://{bucket}/data", env=s3env(moto))
    found = {}
    for dirpath, _, filenames in os.walk(m.path):
        for name in filenames:
            path = Path(dirpath) / name
            found[str(path.relative_to(m.path))] = path.read_bytes()
    assert found == {"a.txt": b"a", "sub/b.txt": b"bb", "sub2/c": b"ccc"}
    for name in ("escape", "dot", "y", "n" * 200):
        assert not (m.path / name).exists()
    # "data/x//y" has an empty component: "x" is listed as a directory but holds nothing valid.
    assert not (m.path / "x" / "y").exists()
    assert sorted(os.listdir(m.path)) == ["a.txt", "sub", "sub2", "x"]
    assert m.stats()["filesystem"]["skipped_keys"] >= 2


def test_store_outage_serves_cached_and_fails_uncached_with_eio(tmp_path: Path, mounter) -> None:
    from tests.support.s3servers import SeaweedS3

    with SeaweedS3() as server:
        bucket = f"outage-{uuid.uuid4().hex[:8]}"
        server.make_bucket(bucket)
        cached = os.urandom(3 * MiB)
        uncached = os.urandom(3 * MiB)
        server.put(bucket, "ds/cached.bin", cached)
        server.put(bucket, "ds/uncached.bin", uncached)
        m = mounter.mount(
            f"s3://{bucket}/ds",
            "--fetch-timeout", "3", "--connect-timeout", "1", "--read-timeout", "2", "--readahead", "0",
            env=s3env(server),
        )
        assert (m.path / "cached.bin").read_bytes() == cached
        assert sorted(os.listdir(m.path)) == ["cached.bin", "uncached.bin"]
        server.stop_keep_data()
        try:
            # Cached bytes keep flowing; listing is served from cache.
            assert (m.path / "cached.bin").read_bytes() == cached
            assert sorted(os.listdir(m.path)) == ["cached.bin", "uncached.bin"]
            with pytest.raises(OSError) as info:
                (m.path / "uncached.bin").read_bytes()
            assert info.value.errno == errno.EIO
            # The session survived the failure.
            assert (m.path / "cached.bin").read_bytes()[:10] == cached[:10]
        finally:
            server.start()
        # Once the store is back, the same read succeeds.
        deadline = time.monotonic() + 30
        while True:
            try:
                assert (m.path / "uncached.bin").read_bytes() == uncached
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _refused(mounter, source: str, env: dict[str, str], *extra: str) -> str:
    with pytest.raises(MountFailed) as info:
        mounter.mount(source, *extra, env=env, check=False)
    result = info.value.result
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def test_mount_refusals_name_the_problem(seaweed, bucket: str, mounter) -> None:
    env = s3env(seaweed)
    secret = seaweed.secret_key
    msg = _refused(mounter, f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}", env)
    assert "does not exist" in msg and secret not in msg
    msg = _refused(mounter, f"s3://{bucket}", {**env, "AWS_SECRET_ACCESS_KEY": "wrong-secret-value"})
    assert ("denied" in msg.lower() or "credential" in msg.lower() or "signature" in msg.lower())
    assert "wrong-secret-value" not in msg and secret not in msg
    closed = f"http://127.0.0.1:{_closed_port()}"  # AWS_ENDPOINT_URL_S3 wins over AWS_ENDPOINT_URL, as for botocore
    msg = _refused(mounter, f"s3://{bucket}", {**env, "AWS_ENDPOINT_URL": closed, "AWS_ENDPOINT_URL_S3": closed},
                   "--connect-timeout", "1")
    assert "reach" in msg.lower() or "connect" in msg.lower()
    msg = _refused(mounter, "ftp://host/x", env)
    assert "'ftp'" in msg and "version identity" in msg


def test_already_mounted_is_refused(seaweed, bucket: str, mounter) -> None:
    seaweed.put(bucket, "k", b"v")
    m = mounter.mount(f"s3://{bucket}", env=s3env(seaweed))
    result = run_cli("mount", f"s3://{bucket}", str(m.path), "--cache-dir", str(m.cache_dir), env=s3env(seaweed))
    assert result.returncode != 0
    assert "already mounted" in result.stderr
    assert (m.path / "k").read_bytes() == b"v"
    # Issue 24 (item 10): after a kill -9 of the daemon the mount is broken, and the refusal says so
    # and what to do, as `cachefs stats` does.
    kill9(m)
    result = run_cli("mount", f"s3://{bucket}", str(m.path), "--cache-dir", str(m.cache_dir), env=s3env(seaweed))
    assert result.returncode != 0 and result.stderr.count("\n") == 1, result.stderr
    assert "broken" in result.stderr and f"cachefs unmount {m.path}" in result.stderr, result.stderr
    assert run_cli("unmount", str(m.path)).returncode == 0


def test_secrets_never_in_logs_or_command_lines(seaweed, bucket: str, mounter) -> None:
    seaweed.put(bucket, "x/file", os.urandom(100_000))
    m = mounter.mount(f"s3://{bucket}/x", "--log-level", "DEBUG", env=s3env(seaweed))
    (m.path / "file").read_bytes()
    os.listdir(m.path)
    cmdline = Path(f"/proc/{m.pid}/cmdline").read_bytes().decode(errors="replace")
    assert seaweed.secret_key not in cmdline
    assert seaweed.access_key not in cmdline
    logs = "".join(p.read_text(errors="replace") for p in m.cache_dir.rglob("*.log"))
    assert logs, "the daemon wrote no log"
    assert seaweed.secret_key not in logs
    stats = m.stats()
    assert seaweed.secret_key not in str(stats)
