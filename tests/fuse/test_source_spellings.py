"""One cache per source however it is spelt (issue 37, item 1), through real mounts on SeaweedFS.

A change staged under one spelling of a source (``s3://b/out`` or ``s3://b/out/``), left behind by
a daemon killed with SIGKILL, is uploaded by the next mount made with the other spelling: the cache
directory is the same (``cachefs.settings.source_hash``), or, for a directory an older cachefs named
after the URL as typed, found by what it caches (``cachefs.sourcedir``). Before, the second mount
used a second, empty cache directory, ``cachefs flush`` said everything was in the object store, and
the change was not in the bucket. The second mount does not warn that the prefix "holds no objects
yet (check the prefix for a typo)" when it is about to upload pending changes there (item 5).
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

import pytest

from cachefs.settings import legacy_source_hash
from tests.fuse.conftest import run_cli
from tests.fuse.writeback_support import clear_dead_mount, flush_ok, get_bytes, kill9, list_keys, s3env

pytestmark = [pytest.mark.fuse, pytest.mark.s3]

# Long enough that nothing is uploaded before the kill: the change stays staged, journaled only.
HOLD = ["--upload-delay", "3600", "--upload-max-delay", "3600"]


@pytest.mark.parametrize("first, second", [("out", "out/"), ("out/", "out")], ids=["no-slash-then-slash",
                                                                                 "slash-then-no-slash"])
def test_a_change_staged_under_one_spelling_is_uploaded_by_a_mount_with_the_other(mounter, seaweed, tmp_path: Path,
                                                                                  first: str, second: str) -> None:
    bucket = f"spell-{uuid.uuid4().hex[:10]}"
    seaweed.make_bucket(bucket)
    env = s3env(seaweed)
    cache = tmp_path / "cache"
    data = os.urandom(300_000)

    m1 = mounter.mount(f"s3://{bucket}/{first}", *HOLD, env=env, cache_dir=cache)
    (m1.path / "ckpt.bin").write_bytes(data)
    kill9(m1)
    clear_dead_mount(m1)
    client = seaweed.client()
    assert "out/ckpt.bin" not in list_keys(client, bucket, "out/"), "uploaded before the kill: nothing was staged"
    # The directory as a cachefs that hashed the URL as typed would have named it.
    [made] = [p for p in cache.iterdir() if p.is_dir()]
    old_name = legacy_source_hash(f"s3://{bucket}/{first}", seaweed.endpoint_url)
    made.rename(cache / old_name)

    # The other spelling, and the endpoint spelt with a trailing slash.
    m2 = mounter.mount(f"s3://{bucket}/{second}", "--endpoint-url", seaweed.endpoint_url + "/",
                       env=env, cache_dir=cache)
    assert (m2.path / "ckpt.bin").read_bytes() == data
    flush_ok(m2)
    assert get_bytes(client, bucket, "out/ckpt.bin") == data
    assert [p.name for p in cache.iterdir() if p.is_dir()] == [old_name], "a second cache directory was made"
    assert "holds no objects yet" not in m2.stderr, m2.stderr  # it was about to upload there (item 5)


def test_unmount_says_when_changes_are_still_staged_and_how_to_upload_them(mounter, seaweed, tmp_path: Path) -> None:
    """Issue 37, item 5: ``unmount --force``, and clearing the mount of a killed daemon, used to print
    only "unmounted" while changes stayed staged (only daemon.log said so)."""
    bucket = f"left-{uuid.uuid4().hex[:10]}"
    seaweed.make_bucket(bucket)
    env = s3env(seaweed)
    cache = tmp_path / "cache"
    source = f"s3://{bucket}/out"

    m1 = mounter.mount(source, *HOLD, env=env, cache_dir=cache)
    (m1.path / "a.bin").write_bytes(b"a" * 1000)
    forced = run_cli("unmount", str(m1.path), "--force", env=env)
    assert forced.returncode == 0 and forced.stderr.count("\n") == 1, forced
    assert f"1 change is still staged in {cache}/" in forced.stderr, forced.stderr
    assert f"mount {source} again (writable) to upload it" in forced.stderr

    m2 = mounter.mount(source, *HOLD, env=env, cache_dir=cache)
    (m2.path / "b.bin").write_bytes(b"b" * 1000)
    kill9(m2)
    cleared = run_cli("unmount", str(m2.path), env=env)
    assert cleared.returncode == 0 and not m2.mounted, cleared
    # b.bin at least (the second mount may have uploaded a.bin, which it replayed, before the kill).
    assert re.search(r"\(its daemon was not running\); (1 change is|2 changes are) still staged in ", cleared.stderr), \
        cleared.stderr

    m3 = mounter.mount(source, env=env, cache_dir=cache)
    flush_ok(m3)
    done = m3.unmount()
    assert done.returncode == 0 and "still staged" not in done.stderr, done.stderr
    client = seaweed.client()
    assert get_bytes(client, bucket, "out/a.bin") == b"a" * 1000 and get_bytes(client, bucket, "out/b.bin") == b"b" * 1000
