"""``--write-durability cluster`` on a real mount: the node is lost, ``cachefs recover`` finishes its writes.

Two SeaweedFS servers: the source (the session's), and the cluster store (a private one, stopped in one test) (``--cluster-cache``), whose
credentials reach the daemon and the recoverer through a named profile, never argv. SeaweedFS 4.x
evaluates ``If-Match``/``If-None-Match`` on PUT and DELETE, which the leases and the recovery use.

The writer acknowledges every change (close, fsync on a file left open, rename, unlink, mkdir) with
uploads held off (``--upload-delay`` an hour), so nothing has reached the source when the daemon is
killed with SIGKILL and its whole cache directory deleted: the node is gone. Meanwhile another
writer rewrites one of the objects in the source. ``cachefs recover`` (another process, with nothing
but the two stores) must then bring every acknowledged change to the source byte for byte, in order,
and leave the rewritten object as it is. Waits are bounded; no duration is asserted.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from tests.fuse.conftest import Mounter, run_cli
from tests.fuse.writeback_support import clear_dead_mount, kill9, s3env
from tests.support.clusterkeys import write_key_file
from tests.support.s3servers import SeaweedS3

pytestmark = [pytest.mark.fuse, pytest.mark.s3]

SOURCE_BUCKET = f"durable-{uuid.uuid4().hex[:10]}"  # in the session's SeaweedFS, shared with other tests
CLUSTER_BUCKET = "shared"
CLUSTER_PREFIX = "cache/"
LEASE_TTL_S = 3  # short, so the recoverer's wait for the dead writer's lease is short
RECOVER_WAIT_S = 60  # bound of that wait (the lease runs out after LEASE_TTL_S)


@pytest.fixture(scope="module")
def servers(seaweed: SeaweedS3) -> Iterator[tuple[SeaweedS3, SeaweedS3]]:
    """The session's SeaweedFS as the source; a private one as the cluster store (it is stopped)."""
    seaweed.make_bucket(SOURCE_BUCKET)
    with SeaweedS3() as cluster:
        cluster.make_bucket(CLUSTER_BUCKET)
        yield seaweed, cluster


@pytest.fixture
def env(servers: tuple[SeaweedS3, SeaweedS3], tmp_path: Path) -> dict[str, str]:
    source, cluster = servers
    creds = tmp_path / "credentials"
    creds.write_text(f"[cluster]\naws_access_key_id = {cluster.access_key}\n"
                     f"aws_secret_access_key = {cluster.secret_key}\n")
    creds.chmod(0o600)
    # The cluster key through its variable, as the CSI driver's mount pods get it.
    return {**s3env(source), "AWS_SHARED_CREDENTIALS_FILE": str(creds),
            "CACHEFS_CLUSTER_KEY_FILE": str(write_key_file(tmp_path))}


def cluster_args(cluster: SeaweedS3) -> list[str]:
    return ["--cluster-cache", f"s3://{CLUSTER_BUCKET}/{CLUSTER_PREFIX}", "--cluster-endpoint-url",
            cluster.endpoint_url, "--cluster-profile", "cluster"]


def source_objects(source: SeaweedS3) -> dict[str, bytes]:
    client = source.client()
    out: dict[str, bytes] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=SOURCE_BUCKET):
        for obj in page.get("Contents", []):
            out[obj["Key"]] = client.get_object(Bucket=SOURCE_BUCKET, Key=obj["Key"])["Body"].read()
    return out


def cluster_keys(cluster: SeaweedS3) -> list[str]:
    client = cluster.client()
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=CLUSTER_BUCKET, Prefix=CLUSTER_PREFIX):
        keys.extend(obj["Key"] for obj in page.get("Contents", []))
    return keys


def test_a_lost_nodes_acknowledged_writes_reach_the_source_through_cachefs_recover(
        mounter: Mounter, servers: tuple[SeaweedS3, SeaweedS3], env: dict[str, str]) -> None:
    source, cluster = servers
    rng = random.Random(27)
    source.put(SOURCE_BUCKET, "old.txt", b"deleted through the mount")
    source.put(SOURCE_BUCKET, "shared.txt", b"version 0")
    source.put(SOURCE_BUCKET, "edited.txt", b"0123456789")
    m = mounter.mount(f"s3://{SOURCE_BUCKET}", *cluster_args(cluster), "--write-durability", "cluster",
                      "--write-lease-ttl", str(LEASE_TTL_S), "--node-id", "node-a", "--upload-delay", "3600",
                      env=env)
    expected = {"edited.txt": b"01234-ours-", "shared.txt": b"version 1, ours, acknowledged"}
    big = rng.randbytes(3 * 1024 * 1024 + 5)
    (m.path / "big.bin").write_bytes(big)
    expected["big.bin"] = big
    (m.path / "twice.txt").write_bytes(b"first version")
    (m.path / "twice.txt").write_bytes(b"second version, the last acknowledged")
    expected["twice.txt"] = b"second version, the last acknowledged"
    (m.path / "ckpt.tmp").write_bytes(b"checkpoint, saved by rename")
    os.rename(m.path / "ckpt.tmp", m.path / "ckpt.pt")
    expected["ckpt.pt"] = b"checkpoint, saved by rename"
    (m.path / "scratch").write_bytes(b"made and deleted")
    os.unlink(m.path / "scratch")
    os.unlink(m.path / "old.txt")
    os.mkdir(m.path / "results")
    (m.path / "results" / "metrics.json").write_text('{"loss": 0.1}')
    expected["results/metrics.json"] = b'{"loss": 0.1}'
    with open(m.path / "edited.txt", "r+b") as f:
        f.seek(5)
        f.write(b"-ours-")
    (m.path / "shared.txt").write_bytes(b"version 1, ours, acknowledged")
    open_file = open(m.path / "open.log", "wb")  # fsync'd, never closed before the kill
    open_file.write(b"fsync'd line\n")
    open_file.flush()
    os.fsync(open_file.fileno())
    expected["open.log"] = b"fsync'd line\n"

    status = run_cli("status", str(m.path / "big.bin"), str(m.path / "results"), "--json", env=env)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)[0]["durable_in"] == "cluster"
    assert set(source_objects(source)) == {"old.txt", "shared.txt", "edited.txt"}  # nothing uploaded yet

    kill9(m)  # the node is gone: its daemon, and its cache directory with every staged byte
    try:
        open_file.close()
    except OSError:
        pass
    clear_dead_mount(m)
    shutil.rmtree(m.cache_dir)
    source.put(SOURCE_BUCKET, "shared.txt", b"version 2, written elsewhere after the loss")
    expected["shared.txt"] = b"version 2, written elsewhere after the loss"

    base = ["recover", f"s3://{SOURCE_BUCKET}", *cluster_args(cluster)]
    listed = run_cli(*base, "--list", env=env)
    assert listed.returncode == 0, listed.stderr
    [line] = listed.stdout.splitlines()
    prefix = line.split()[0]
    assert "/node-a/" in prefix and "writer writer:node-a" in line
    done = run_cli(*base, "--prefix", prefix, "--wait", str(RECOVER_WAIT_S), "--json", env=env,
                   timeout=RECOVER_WAIT_S + 90)
    assert done.returncode == 0, done.stdout + done.stderr
    [report] = json.loads(done.stdout)
    assert report["state"] == "recovered" and report["kept_newer"] == ["shared.txt"], report
    assert report["failed"] == []

    objects = source_objects(source)
    assert "results/" in objects and objects.pop("results/") == b""  # the directory marker
    assert objects == expected  # byte for byte; deletes and the rename's source applied
    journal = [k for k in cluster_keys(cluster) if k.startswith(f"{CLUSTER_PREFIX}writeback/")]
    assert journal == [f"{CLUSTER_PREFIX}{prefix}lease"]  # only the tombstone is left (blocks are the read tier's)
    again = run_cli(*base, "--prefix", prefix, "--assume-dead", env=env)
    assert again.returncode == 0 and "already" in again.stdout  # done, and never replayed twice


def test_write_durability_cluster_is_refused_in_one_line_without_a_cluster_tier_or_read_only(
        mounter: Mounter, servers: tuple[SeaweedS3, SeaweedS3], env: dict[str, str], tmp_path: Path) -> None:
    source, cluster = servers
    for extra, needle in ((["--write-durability", "cluster"], "needs a cluster tier"),
                          (["--write-durability", "cluster", "--read-only", *cluster_args(cluster)],
                           "writable mounts only"),
                          (["--write-durability", "nearby"], "invalid choice")):
        result = run_cli("mount", f"s3://{SOURCE_BUCKET}", str(tmp_path / "mnt"), "--cache-dir",
                         str(tmp_path / "cache"), *extra, env=env)
        assert result.returncode != 0 and needle in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_close_fails_with_eio_while_the_cluster_store_is_down_and_nothing_falls_back_to_local(
        mounter: Mounter, servers: tuple[SeaweedS3, SeaweedS3], env: dict[str, str]) -> None:
    source, cluster = servers
    m = mounter.mount(f"s3://{SOURCE_BUCKET}", *cluster_args(cluster), "--write-durability", "cluster",
                      "--node-id", "node-b", "--upload-delay", "0", env=env)
    cluster.stop_keep_data()
    try:
        f = open(m.path / "unsaved.bin", "wb")
        f.write(b"not durable in the cluster store")
        with pytest.raises(OSError) as info:
            f.close()  # flush -> the acknowledgement, refused: the cluster store is unreachable
        assert info.value.errno == errno.EIO
    finally:
        cluster.start()
    # Never acknowledged, so its bytes are never uploaded. The name may be, empty, once the cluster
    # store is back (docs/semantics.md: a new file whose close failed reverts to an empty file).
    assert source_objects(source).get("unsaved.bin", b"") == b""
    (m.path / "saved.bin").write_bytes(b"acknowledged once the cluster store is back")
    flushed = run_cli("flush", str(m.path), env=env)
    assert flushed.returncode == 0, flushed.stderr
    assert source_objects(source)["saved.bin"] == b"acknowledged once the cluster store is back"
    assert m.unmount().returncode == 0
    # The refused bytes were never made durable anywhere: not in the cluster journal either (the
    # file itself reverts to empty, as on a local-durability mount whose close failed).
    client = cluster.client()
    stored = [client.get_object(Bucket=CLUSTER_BUCKET, Key=k)["Body"].read()
              for k in cluster_keys(cluster) if "/node-b/" in k and "/data/" in k]
    assert b"not durable in the cluster store" not in stored


@pytest.mark.parametrize("then_delete", [False, True], ids=["saved", "saved-then-deleted"])
def test_a_checkpoint_renamed_over_one_that_was_renamed_into_place_survives_the_loss_of_the_node(
        mounter: Mounter, servers: tuple[SeaweedS3, SeaweedS3], env: dict[str, str], then_delete: bool) -> None:
    """How training jobs save: write a temporary file, rename it over the last checkpoint. When that
    last checkpoint was itself renamed into place after both were uploaded (a server-side copy), the
    next save's journal record must carry the copy's ETag as its base: with the ETag of the version
    the copy replaced, ``recover`` took the writer's own copy for someone else's newer version and
    kept it, and the acknowledged checkpoint (or its deletion) was lost (issue 38, finding 1)."""
    source, cluster = servers
    prefix_in_source = f"ckpt-{uuid.uuid4().hex[:8]}"
    m = mounter.mount(f"s3://{SOURCE_BUCKET}/{prefix_in_source}", *cluster_args(cluster), "--write-durability",
                      "cluster", "--write-lease-ttl", str(LEASE_TTL_S), "--node-id", "ckpt",
                      "--upload-delay", "3600", env=env)
    (m.path / "X").write_bytes(b"checkpoint 1")
    (m.path / "F").write_bytes(b"checkpoint 2")
    flushed = run_cli("flush", str(m.path), "--timeout", "60", env=env, timeout=120)
    assert flushed.returncode == 0, flushed.stdout + flushed.stderr  # both uploaded by this mount
    os.rename(m.path / "F", m.path / "X")  # only in the store: a server-side copy over X
    (m.path / "T").write_bytes(b"checkpoint 3, acknowledged")
    os.rename(m.path / "T", m.path / "X")  # staged: acknowledged, journaled, not uploaded
    if then_delete:
        os.unlink(m.path / "X")
    stored = {k.removeprefix(prefix_in_source + "/"): v for k, v in source_objects(source).items()
              if k.startswith(prefix_in_source + "/")}
    assert stored == {"X": b"checkpoint 2", "F": b"checkpoint 2"}  # the copy landed; F's delete and T wait

    kill9(m)
    clear_dead_mount(m)
    shutil.rmtree(m.cache_dir)

    base = ["recover", f"s3://{SOURCE_BUCKET}/{prefix_in_source}", *cluster_args(cluster)]
    listed = run_cli(*base, "--list", env=env)
    prefixes = [line.split()[0] for line in listed.stdout.splitlines()]
    assert listed.returncode == 0 and len(prefixes) == 1, listed.stdout + listed.stderr
    done = run_cli(*base, "--prefix", prefixes[0], "--wait", str(RECOVER_WAIT_S), "--json", env=env,
                   timeout=RECOVER_WAIT_S + 90)
    assert done.returncode == 0, done.stdout + done.stderr
    [report] = json.loads(done.stdout)
    assert report["kept_newer"] == [] and report["failed"] == [], report  # nobody else wrote
    stored = {k.removeprefix(prefix_in_source + "/"): v for k, v in source_objects(source).items()
              if k.startswith(prefix_in_source + "/")}
    assert stored == ({} if then_delete else {"X": b"checkpoint 3, acknowledged"})


# Kill trials: how many, and the writer's pace. One trial by default (the suite's time budget);
# CACHEFS_DURABLE_TRIALS=N runs more.
TRIALS = int(os.environ.get("CACHEFS_DURABLE_TRIALS", "1"))
KEYS = 6


def _writer(root: Path, rng: random.Random, acked: dict[str, bytes | None], inflight: dict[str, bytes | None],
            stop: threading.Event, ops: list[int],
            history: dict[str, list[tuple[str, bytes | None]]] | None = None) -> None:
    """Rewrite, replace-by-rename and delete a few files until the mount dies; ``acked`` holds what each
    key is once its operation returned, ``inflight`` the operation started and not seen returning."""
    try:
        while not stop.is_set():
            key = f"k{rng.randrange(KEYS)}"
            roll = rng.random()
            if roll < 0.15 and acked.get(key) is not None:
                inflight[key] = None
                if history is not None:
                    history.setdefault(key, []).append(("unlink", None))
                os.unlink(root / key)
            else:
                data = rng.randbytes(rng.choice([0, 100, 70_000, 300_000]))
                inflight[key] = data
                if history is not None:
                    history.setdefault(key, []).append(("rename" if roll < 0.4 else "write", data))
                if roll < 0.4:
                    (root / f"{key}.tmp").write_bytes(data)
                    os.rename(root / f"{key}.tmp", root / key)
                else:
                    (root / key).write_bytes(data)
            acked[key] = inflight.pop(key)
            ops[0] += 1
    except OSError:
        return  # the daemon was killed


def _diagnose(source: SeaweedS3, prefix: str, keys: set[str], acked: dict[str, bytes | None],
              inflight: dict[str, bytes | None], history: dict[str, list[tuple[str, bytes | None]]]) -> str:
    """For a failing trial: per key, which of its versions the source holds, with the upload tag."""
    client = source.client()
    lines = []
    for key in sorted(keys):
        ops = history.get(key, [])
        try:
            head = client.head_object(Bucket=SOURCE_BUCKET, Key=f"{prefix}/{key}")
            body = client.get_object(Bucket=SOURCE_BUCKET, Key=f"{prefix}/{key}")["Body"].read()
            held = [i for i, (_, data) in enumerate(ops) if data == body]
            what = f"version(s) {held} of {len(ops)} operations, tag {head.get('Metadata')}"
        except client.exceptions.ClientError:
            what = f"nothing (absent) after {len(ops)} operations"
        lines.append(f"{key}: the source holds {what}; last operations {[op for op, _ in ops[-4:]]}; "
                     f"acknowledged last: {'deleted' if acked.get(key) is None else 'written'}; "
                     f"in flight at the kill: {key in inflight}")
    return "; ".join(lines)


def _freezer(cluster: SeaweedS3, rng: random.Random, stop: threading.Event, freezes: list[float]) -> None:
    """SIGSTOP the cluster store (the process this module started) for 0.2-4 s at random moments
    until ``stop``; always SIGCONT on the way out. Operations caught by a freeze finish late or fail
    with EIO past their deadline (not acknowledged); requests sent before it may run after it."""
    pid = cluster.pid
    assert pid is not None
    try:
        while not stop.wait(rng.uniform(0.1, 1.0)):
            os.kill(pid, signal.SIGSTOP)
            length = rng.uniform(0.2, 4.0)
            freezes.append(length)
            stop.wait(length)
            os.kill(pid, signal.SIGCONT)
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize("freeze", [False, True], ids=["steady", "store-frozen-at-random"])
@pytest.mark.parametrize("trial", range(TRIALS))
def test_kill_9_while_writing_loses_nothing_acknowledged_once_recovered(
        mounter: Mounter, servers: tuple[SeaweedS3, SeaweedS3], env: dict[str, str], trial: int,
        freeze: bool) -> None:
    source, cluster = servers
    rng = random.Random(f"durable-{trial}-{freeze}")
    prefix_in_source = f"trial-{uuid.uuid4().hex[:8]}"
    m = mounter.mount(f"s3://{SOURCE_BUCKET}/{prefix_in_source}", *cluster_args(cluster), "--write-durability",
                      "cluster", "--write-lease-ttl", str(LEASE_TTL_S), "--node-id", f"trial-{trial}",
                      "--upload-delay", "0.3", env=env)  # uploads run while writing: their races too
    acked: dict[str, bytes | None] = {}
    inflight: dict[str, bytes | None] = {}
    history: dict[str, list[tuple[str, bytes | None]]] = {}  # per key: (operation, content) in order
    stop = threading.Event()
    ops = [0]
    writer = threading.Thread(target=_writer, args=(m.path, rng, acked, inflight, stop, ops, history), daemon=True)
    writer.start()
    freezes: list[float] = []
    unfreeze = threading.Event()
    freezer = threading.Thread(target=_freezer, args=(cluster, random.Random(trial), unfreeze, freezes), daemon=True)
    if freeze:
        freezer.start()
    time.sleep(rng.uniform(1.5, 4.0) + (rng.uniform(2.0, 6.0) if freeze else 0.0))
    unfreeze.set()
    if freeze:
        freezer.join(10)  # the store answers again (requests sent during a freeze may run now) ...
    kill9(m)  # ... and the node is lost
    stop.set()
    writer.join(60)
    assert not writer.is_alive(), "the writer still blocks 60 s after the kill"
    clear_dead_mount(m)
    shutil.rmtree(m.cache_dir)

    base = ["recover", f"s3://{SOURCE_BUCKET}/{prefix_in_source}", *cluster_args(cluster)]
    listed = run_cli(*base, "--list", env=env)
    prefixes = [line.split()[0] for line in listed.stdout.splitlines()]
    assert listed.returncode == 0 and len(prefixes) == 1, listed.stdout + listed.stderr
    done = run_cli(*base, "--prefix", prefixes[0], "--wait", str(RECOVER_WAIT_S), "--json", env=env,
                   timeout=RECOVER_WAIT_S + 90)
    assert done.returncode == 0, done.stdout + done.stderr
    [report] = json.loads(done.stdout)
    assert report["failed"] == [], report

    stored = {k.removeprefix(prefix_in_source + "/"): v for k, v in source_objects(source).items()
              if k.startswith(prefix_in_source + "/")}
    lost = []
    for key, data in acked.items():
        allowed = [data] + ([inflight[key]] if key in inflight else [])
        if stored.get(key) not in allowed:
            lost.append(key)
    diagnosis = _diagnose(source, prefix_in_source, set(lost) | set(report["kept_newer"]), acked, inflight, history)
    assert not lost, f"acknowledged state lost for {lost} ({len(acked)} keys acknowledged): {diagnosis}"
    # Nobody else wrote: every record whose operation was acknowledged is applied. A key whose last
    # operation never returned (the kill, or EIO under a frozen store) may keep its acknowledged state.
    assert set(report["kept_newer"]) <= set(inflight), f"kept as newer: {report['kept_newer']}: {diagnosis}"
    extra = set(stored) - set(acked) - set(inflight) - {f"{k}.tmp" for k in inflight}
    assert not extra, f"objects nobody acknowledged: {extra}"
    print(f"durable kill trial {trial}: {ops[0]} operations acknowledged on {len(acked)} keys, recovered {len(report['uploaded'])} "
          f"uploads and {len(report['deleted'])} deletes; cluster store frozen {len(freezes)} times")
