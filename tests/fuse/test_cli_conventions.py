"""Issue 12 on a real mount over moto: what a first-time user sees at mount and from inside a mount.

The mount line names the log file; an empty prefix gets a warning line, not a refusal; a second
mount of a mounted source is refused without writing into the live mount's log; ``cachefs status``
and ``cachefs prefetch`` take paths relative to the working directory; a bare ``prefetch MOUNT``
warms the whole mount; ``CACHEFS_*`` variables reach the daemon.
"""

from __future__ import annotations

import json
import uuid

from cachefs import mounts
from tests.fuse.conftest import run_cli


def s3env(server) -> dict[str, str]:
    return {**server.env(), "AWS_ENDPOINT_URL": server.endpoint_url}


def fresh_bucket(server) -> str:
    name = f"ux-{uuid.uuid4().hex[:12]}"
    server.make_bucket(name)
    return name


def test_mount_line_names_the_log_and_an_empty_prefix_warns(moto, mounter, tmp_path) -> None:
    bucket = fresh_bucket(moto)
    moto.put(bucket, "data/a.txt", b"a")
    env = s3env(moto)
    mnt, cache = tmp_path / "typo", tmp_path / "cache"
    mnt.mkdir()
    result = run_cli("mount", f"s3://{bucket}/dta", str(mnt), "--cache-dir", str(cache), "--read-only", env=env)
    try:
        assert result.returncode == 0, result.stderr
        lines = result.stderr.splitlines()
        assert lines[0] == f"cachefs: warning: s3://{bucket}/dta holds no objects yet (check the prefix for a typo)"
        assert lines[1].startswith(f"cachefs: mounted s3://{bucket}/dta at {mnt} (pid ") and "log: " in lines[1]
        log_file = lines[1].rsplit("log: ", 1)[1].rstrip(")")
        assert "holds no objects yet" in open(log_file).read()
    finally:
        if mounts.find_mount(mnt) is not None:
            assert run_cli("unmount", str(mnt), env=env).returncode == 0

    m = mounter.mount(f"s3://{bucket}/data", "--read-only", env=env)
    log_file = m.cache_dir.glob("*/daemon.log").__next__()
    before = log_file.read_text()
    assert "holds no objects" not in before
    other = tmp_path / "other"
    other.mkdir()
    second = run_cli("mount", f"s3://{bucket}/data", str(other), "--cache-dir", str(m.cache_dir), "--read-only",
                     env=env)
    assert second.returncode != 0 and second.stderr.count("\n") == 1, second.stderr
    assert f"s3://{bucket}/data is already mounted" in second.stderr
    assert log_file.read_text() == before  # the live mount's log is untouched
    assert (m.path / "a.txt").read_bytes() == b"a"


def test_paths_from_inside_the_mount_and_a_bare_prefetch(moto, mounter) -> None:
    bucket = fresh_bucket(moto)
    moto.put_many(bucket, [("ds/out/hello.txt", b"hello"), ("ds/train/a.bin", b"a" * 5000),
                           ("ds/train/sub/b.bin", b"b" * 7000)])
    env = s3env(moto)
    m = mounter.mount(f"s3://{bucket}/ds", "--read-only", env={**env, "CACHEFS_RAM_CACHE": "64MiB"})
    assert m.stats()["tiers"]["ram"]["capacity_bytes"] == 64 * 1024 * 1024  # CACHEFS_* reached the daemon
    status = run_cli("status", "hello.txt", "--json", env=env, cwd=m.path / "out")
    assert status.returncode == 0, status.stderr
    [doc] = json.loads(status.stdout)
    assert doc["stage"] == "clean" and doc["argument"] == "hello.txt"

    # From outside the mount a relative PATH is taken from the mount root (issue 37, item 2); a
    # directory named as a PATH still needs -r, and the refusal says so in one line.
    outside = run_cli("prefetch", str(m.path), "train", env=env, cwd=m.path.parent)
    assert outside.returncode == 2 and outside.stderr.count("\n") == 1, outside
    assert "is a directory (use --recursive): train" in outside.stderr, outside.stderr
    climbing = run_cli("prefetch", str(m.path), "../train", env=env, cwd=m.path.parent)
    assert climbing.returncode == 2 and climbing.stderr == f"cachefs: error: ../train is outside the mount {m.path}\n"
    one = run_cli("prefetch", str(m.path), "a.bin", env=env, cwd=m.path / "train")
    assert one.returncode == 0 and "prefetched 1 of 1 files" in one.stdout, one

    whole = run_cli("prefetch", str(m.path), "--json", env=env, cwd=m.path.parent)
    assert whole.returncode == 0, whole.stderr
    job = json.loads(whole.stdout)
    assert job["files_total"] == 3 and job["recursive"] is True and job["ok"] is True
    assert job["bytes_total"] == 5 + 5000 + 7000
