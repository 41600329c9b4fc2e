"""The metadata index and manifest mounts through a real mount over SeaweedFS.

* A manifest written by ``cachefs snapshot`` pins a new mount: its namespace comes from the manifest
  (no directory is listed: the only LIST is the start-up check, MaxKeys=1), reads are conditional
  on the manifest's ETags, an object changed in the bucket is ESTALE with a log line naming it, and a
  manifest with a bad line is refused with one line naming it.
* A remount of a normal mount answers ``ls`` from the persisted index within ``--dir-ttl`` (no
  LIST), and lists again once the stored listings are older than that.
"""

from __future__ import annotations

import errno
import gzip
import os
import time
import uuid
from pathlib import Path

import pytest

from tests.fuse.conftest import MountFailed, run_cli

FILES = {f"train/{i:03d}.bin": os.urandom(1000 + i) for i in range(30)}
FILES.update({"val/a/x.bin": b"x" * 5000, "val/b/y.bin": b"y" * 7000, "labels.csv": b"id,label\n"})


@pytest.fixture
def dataset(seaweed) -> str:
    bucket = f"meta-{uuid.uuid4().hex[:12]}"
    seaweed.make_bucket(bucket)
    seaweed.put_many(bucket, [(f"ds/{k}", v) for k, v in FILES.items()])
    return bucket


def s3env(server) -> dict[str, str]:
    return {**server.env(), "AWS_ENDPOINT_URL": server.endpoint_url}


def walk(root: Path) -> dict[str, bytes]:
    found = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            found[str(path.relative_to(root))] = path.read_bytes()
    return found


def snapshot(seaweed, mounter, bucket: str, out: Path) -> Path:
    m = mounter.mount(f"s3://{bucket}/ds", "--read-only", env=s3env(seaweed))
    result = run_cli("snapshot", str(m.path), "-o", str(out), env=m.env)
    assert result.returncode == 0, result.stderr
    assert m.unmount().returncode == 0
    return out


def daemon_log(cache_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in cache_dir.glob("*/daemon.log"))


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
def test_a_manifest_mount_lists_nothing_and_serves_the_manifest(seaweed, mounter, dataset, tmp_path: Path,
                                                                compress: bool) -> None:
    manifest = snapshot(seaweed, mounter, dataset, tmp_path / "m.jsonl")
    if compress:
        manifest = tmp_path / "m.jsonl.gz"
        manifest.write_bytes(gzip.compress((tmp_path / "m.jsonl").read_bytes()))
    seaweed.put(dataset, "ds/extra-not-in-manifest.bin", b"new")
    m = mounter.mount(f"s3://{dataset}/ds", "--manifest", str(manifest), env=s3env(seaweed))
    assert walk(m.path) == FILES
    assert not (m.path / "extra-not-in-manifest.bin").exists()
    stats = m.stats()
    assert stats["filesystem"]["listings"] == 0
    assert stats["object_store"]["list_requests"] == 1  # the start-up check (MaxKeys=1), nothing else
    with pytest.raises(OSError) as refused:
        (m.path / "new.txt").write_bytes(b"no")
    assert refused.value.errno == errno.EROFS


def test_a_changed_object_is_estale_and_logged_by_key(seaweed, mounter, dataset, tmp_path: Path) -> None:
    manifest = snapshot(seaweed, mounter, dataset, tmp_path / "m.jsonl")
    m = mounter.mount(f"s3://{dataset}/ds", "--manifest", str(manifest), env=s3env(seaweed))
    assert (m.path / "train/001.bin").read_bytes() == FILES["train/001.bin"]
    seaweed.put(dataset, "ds/train/002.bin", os.urandom(len(FILES["train/002.bin"])))  # same size, new bytes
    with pytest.raises(OSError) as stale:
        (m.path / "train/002.bin").read_bytes()
    assert stale.value.errno == errno.ESTALE
    assert "train/002.bin" in daemon_log(m.cache_dir)
    assert (m.path / "train/003.bin").read_bytes() == FILES["train/003.bin"]  # the rest still reads


def test_a_bad_manifest_line_refuses_the_mount_naming_it(seaweed, mounter, dataset, tmp_path: Path) -> None:
    manifest = snapshot(seaweed, mounter, dataset, tmp_path / "m.jsonl")
    lines = manifest.read_text().splitlines()
    lines.insert(4, '{"path": "train/bad.bin", "size": 3}')  # no ETag: nothing to pin
    manifest.write_text("\n".join(lines) + "\n")
    with pytest.raises(MountFailed) as refused:
        mounter.mount(f"s3://{dataset}/ds", "--manifest", str(manifest), env=s3env(seaweed), check=False)
    message = refused.value.result.stderr.strip()
    assert len(message.splitlines()) == 1
    assert "line 5" in message and "etag" in message


def test_a_remount_lists_nothing_within_the_ttl_and_lists_again_after(seaweed, mounter, dataset,
                                                                         tmp_path: Path) -> None:
    env = s3env(seaweed)
    cache = tmp_path / "shared-cache"
    first = mounter.mount(f"s3://{dataset}/ds", "--read-only", "--dir-ttl", "600", env=env, cache_dir=cache)
    assert walk(first.path) == FILES
    assert first.stats()["filesystem"]["listings"] >= 5  # root, train, val, val/a, val/b
    assert first.unmount().returncode == 0

    seaweed.put(dataset, "ds/train/late.bin", b"late")  # not seen while the stored listings are fresh
    second = mounter.mount(f"s3://{dataset}/ds", "--read-only", "--dir-ttl", "600", env=env, cache_dir=cache)
    assert sorted(os.listdir(second.path)) == ["labels.csv", "train", "val"]
    assert walk(second.path) == FILES
    stats = second.stats()
    assert stats["filesystem"]["listings"] == 0
    assert stats["filesystem"]["index_listings"] >= 5
    assert stats["object_store"]["list_requests"] == 1  # the start-up check only
    assert second.unmount().returncode == 0

    time.sleep(1.5)  # the stored listings are now older than the next mount's --dir-ttl
    third = mounter.mount(f"s3://{dataset}/ds", "--read-only", "--dir-ttl", "1", env=env, cache_dir=cache)
    assert "late.bin" in os.listdir(third.path / "train")
    assert third.stats()["filesystem"]["listings"] >= 2


def test_a_manifest_stored_in_the_source_pins_the_mount(seaweed, mounter, dataset, tmp_path: Path) -> None:
    """``--manifest-key`` (the CSI volume attribute ``manifest``): fetched from the source at mount."""
    manifest = snapshot(seaweed, mounter, dataset, tmp_path / "m.jsonl")
    seaweed.put(dataset, "ds/manifests/v1.jsonl.gz", gzip.compress(manifest.read_bytes()))
    m = mounter.mount(f"s3://{dataset}/ds", "--manifest-key", "manifests/v1.jsonl.gz", env=s3env(seaweed))
    assert walk(m.path) == FILES  # the manifest object itself is not in the manifest
    assert m.stats()["filesystem"]["listings"] == 0
    with pytest.raises(MountFailed) as refused:
        mounter.mount(f"s3://{dataset}/ds", "--manifest-key", "manifests/none.jsonl", env=s3env(seaweed), check=False)
    message = refused.value.result.stderr.strip()
    assert len(message.splitlines()) == 1 and "manifests/none.jsonl" in message


def test_changes_written_through_the_mount_reach_the_index(seaweed, mounter, dataset, tmp_path: Path) -> None:
    """A writable mount patches the stored listings as its uploads land: the next mount (within the
    TTL, so nothing is listed) shows the new file and not the deleted one."""
    env = s3env(seaweed)
    cache = tmp_path / "shared-cache"
    first = mounter.mount(f"s3://{dataset}/ds", "--dir-ttl", "600", "--upload-delay", "0", env=env, cache_dir=cache)
    assert len(os.listdir(first.path / "train")) == 30  # listed, so stored in the index
    (first.path / "train" / "new.bin").write_bytes(b"fresh")
    (first.path / "train" / "000.bin").unlink()
    assert first.unmount().returncode == 0  # flushes: every change is in the store
    second = mounter.mount(f"s3://{dataset}/ds", "--dir-ttl", "600", "--read-only", env=env, cache_dir=cache)
    names = os.listdir(second.path / "train")
    assert "new.bin" in names and "000.bin" not in names and len(names) == 30
    assert (second.path / "train" / "new.bin").read_bytes() == b"fresh"
    assert second.stats()["filesystem"]["listings"] == 0
