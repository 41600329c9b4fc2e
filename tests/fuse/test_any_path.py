"""Commands take any path inside a mount (issue 37, item 2), on a real mount over moto.

``prefetch``, ``stats``, ``flush``, ``evict`` and ``status`` find the mount by walking up from the
path they are given, as ``juicefs`` and ``rclone`` commands do; a path that does not exist says it
is missing (it used to say "is not a mountpoint"). The README's quick-start ``prefetch`` and
``stats`` lines are run exactly as written, with only the README's mountpoint replaced by the test's.
"""

from __future__ import annotations

import json
import re
import shlex
import uuid
from pathlib import Path

from tests.fuse.conftest import run_cli

README = Path(__file__).resolve().parents[2] / "README.md"
README_MOUNTPOINT = "/mnt/data"


def s3env(server) -> dict[str, str]:
    return {**server.env(), "AWS_ENDPOINT_URL": server.endpoint_url}


def readme_quick_start() -> list[str]:
    """The ``cachefs`` command lines of the README's quick start block, comments stripped."""
    text = README.read_text()
    section = text[text.index("## Quick start with a real bucket"):]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block is not None, "the README's quick start has no sh block"
    joined = block.group(1).replace("\\\n", " ")
    return [line.split("#", 1)[0].strip() for line in joined.splitlines() if line.strip().startswith("cachefs ")]


def _mounted(moto, mounter, *extra: str):
    bucket = f"any-{uuid.uuid4().hex[:12]}"
    moto.make_bucket(bucket)
    moto.put_many(bucket, [("ds/train/a.bin", b"a" * 5000), ("ds/train/sub/b.bin", b"b" * 7000),
                           ("ds/val/c.bin", b"c" * 300)])
    env = s3env(moto)
    return mounter.mount(f"s3://{bucket}/ds", *extra, env=env), env


def test_the_readme_prefetch_and_stats_examples_run_as_written(moto, mounter) -> None:
    lines = readme_quick_start()
    prefetch = [line for line in lines if line.startswith("cachefs prefetch ")]
    stats = [line for line in lines if line.startswith("cachefs stats ")]
    assert prefetch and stats, lines
    m, env = _mounted(moto, mounter, "--read-only")
    for line in prefetch + stats:
        argv = [arg.replace(README_MOUNTPOINT, str(m.path), 1) if arg.startswith(README_MOUNTPOINT) else arg
                for arg in shlex.split(line)[1:]]
        result = run_cli(*argv, env=env)
        assert result.returncode == 0, f"README line {line!r} failed: {result.stderr}"
        if argv[0] == "prefetch":
            assert "prefetched 2 of 2 files" in result.stdout + result.stderr, result
    doc = m.stats()
    assert doc["tiers"]["disk"]["used_bytes"] >= 12000  # train/ warmed, both files


def test_stats_flush_evict_and_status_take_any_path_inside_the_mount(moto, mounter) -> None:
    m, env = _mounted(moto, mounter)
    (m.path / "train" / "new.txt").write_bytes(b"new")
    for argv, cwd in ((["stats", "a.bin", "--json"], m.path / "train"), (["stats", "train/sub"], m.path),
                      (["flush", "."], m.path / "train" / "sub"), (["flush", str(m.path / "val" / "c.bin")], None)):
        result = run_cli(*argv, env=env, cwd=cwd)
        assert result.returncode == 0, (argv, result.stderr)
    assert run_cli("stats", str(m.path / "val"), "--json", env=env).stdout.startswith("{")
    status = run_cli("status", "new.txt", "--json", env=env, cwd=m.path / "train")
    assert status.returncode == 0 and json.loads(status.stdout)[0]["stage"] == "clean", status
    evict = run_cli("evict", str(m.path / "train" / "sub"), "--json", env=env)
    assert evict.returncode == 0, evict.stderr
    missing = m.path / "train" / "nope"
    for argv in (["stats", str(missing)], ["flush", str(missing)]):
        result = run_cli(*argv, env=env)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result
        assert f"{missing}: no such file or directory" in result.stderr and "mountpoint" not in result.stderr
    result = run_cli("prefetch", str(missing), env=env)
    assert result.returncode == 2 and "no such file or directory in the mount: train/nope" in result.stderr, result
