"""The shared cluster tier on real mounts: two private SeaweedFS servers, one the source, one the cluster store.

Each server can be stopped on its own (its PID only, restarted in a ``finally``). The cluster store's
credentials reach the daemon through a named profile (``--cluster-profile``) in a credentials file
the test writes, as a deployment would: never through argv. Every wait is bounded (the write-behind
queue's drain is polled through ``/stats``); no duration is asserted.
"""

from __future__ import annotations

import itertools
import random
import time
from pathlib import Path
from typing import Iterator

import pytest

from tests.fuse.conftest import Mount, Mounter, run_cli
from tests.fuse.writeback_support import LoopbackProxy, bounded, s3env
from tests.support.clusterkeys import write_key_file
from tests.support.s3servers import SeaweedS3, refusing_port

pytestmark = [pytest.mark.fuse, pytest.mark.s3]

KiB, MiB = 1024, 1024 * 1024
BLOCK = 256 * KiB
SOURCE_BUCKET = "source"
CLUSTER_BUCKET = "shared"
CLUSTER_PREFIX = "cache/"
FILES = {f"data/part-{i}.bin": random.Random(i).randbytes(BLOCK * 3 + 1234 * i) for i in range(4)}
DRAIN_BOUND_S = 60
READ_BOUND_S = 60
# Short deadlines keep the test quick when the cluster store is stopped: a cluster request fails at
# once (connection refused) or within 2 s; the source's fetch deadline is well above it.
CLUSTER_TIMEOUT_S = 2


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[SeaweedS3, SeaweedS3]]:
    with SeaweedS3() as source, SeaweedS3() as cluster:
        source.make_bucket(SOURCE_BUCKET)
        for key, data in FILES.items():
            source.put(SOURCE_BUCKET, key, data)
        cluster.make_bucket(CLUSTER_BUCKET)
        yield source, cluster


@pytest.fixture
def cluster_env(servers: tuple[SeaweedS3, SeaweedS3], tmp_path: Path) -> dict[str, str]:
    """The mount's environment: the source's keys in the AWS variables, the cluster store's in a
    profile of a credentials file."""
    source, cluster = servers
    creds = tmp_path / "credentials"
    creds.write_text(f"[cluster]\naws_access_key_id = {cluster.access_key}\n"
                     f"aws_secret_access_key = {cluster.secret_key}\n")
    creds.chmod(0o600)
    # The cluster key through its variable, as the CSI driver's mount pods get it.
    return {**s3env(source), "AWS_SHARED_CREDENTIALS_FILE": str(creds),
            "CACHEFS_CLUSTER_KEY_FILE": str(write_key_file(tmp_path))}


def cluster_args(cluster: SeaweedS3, *extra: str) -> list[str]:
    return ["--cluster-cache", f"s3://{CLUSTER_BUCKET}/{CLUSTER_PREFIX}", "--cluster-endpoint-url",
            cluster.endpoint_url, "--cluster-profile", "cluster", "--cluster-timeout", str(CLUSTER_TIMEOUT_S),
            "--block-size", str(BLOCK), "--read-only", *extra]


def clear_cluster(cluster: SeaweedS3) -> None:
    client = cluster.client()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=CLUSTER_BUCKET, Prefix=CLUSTER_PREFIX):
        for obj in page.get("Contents", []):
            client.delete_object(Bucket=CLUSTER_BUCKET, Key=obj["Key"])


def cluster_keys(cluster: SeaweedS3) -> list[str]:
    client = cluster.client()
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=CLUSTER_BUCKET, Prefix=CLUSTER_PREFIX):
        keys.extend(obj["Key"] for obj in page.get("Contents", []))
    return keys


def wait_drained(mount: Mount) -> dict:
    """Poll ``/stats`` until the write-behind queue is empty (bounded); the cluster section."""
    deadline = time.monotonic() + DRAIN_BOUND_S
    while True:
        section = mount.stats()["cluster"]
        if section["write_behind"]["depth"] == 0:
            return section
        assert time.monotonic() < deadline, f"write-behind did not drain: {section}"
        time.sleep(0.1)


def read_all(mount: Mount) -> dict[str, bytes]:
    return {key: bounded(lambda k=key: (mount.path / k).read_bytes(), READ_BOUND_S, f"reading {key}")
            for key in FILES}


def fill_cluster(mounter: Mounter, servers: tuple[SeaweedS3, SeaweedS3], env: dict[str, str]) -> None:
    source, cluster = servers
    clear_cluster(cluster)
    first = mounter.mount(f"s3://{SOURCE_BUCKET}", *cluster_args(cluster), env=env)
    assert read_all(first) == FILES
    section = wait_drained(first)
    blocks = sum(-(-len(d) // BLOCK) for d in FILES.values())
    assert section["write_behind"]["written"] == blocks and section["write_behind"]["dropped"] == 0
    assert section["misses"] == blocks and section["errors"] == 0
    assert len(cluster_keys(cluster)) == blocks
    assert first.unmount().returncode == 0


def test_a_second_node_reads_everything_from_the_cluster_with_the_source_stopped(
        mounter: Mounter, servers: tuple[SeaweedS3, SeaweedS3], cluster_env: dict[str, str]) -> None:
    source, cluster = servers
    fill_cluster(mounter, servers, cluster_env)
    # A second node: its own, empty cache dir. It lists and stats while the source is up (metadata
    # comes from the source only) and reads a byte of each file, which proves to the source that
    # this volume may read it (one one-byte GET per file: a cluster hit is served only after it), then reads
    # every byte with the source stopped.
    second = mounter.mount(f"s3://{SOURCE_BUCKET}", *cluster_args(cluster), "--attr-ttl", "600",
                           "--dir-ttl", "600", env=cluster_env)
    for key in FILES:
        assert (second.path / key).stat().st_size == len(FILES[key])
        with open(second.path / key, "rb") as f:
            assert f.read(1) == FILES[key][:1]
    source.stop_keep_data()
    try:
        assert read_all(second) == FILES
        stats = second.stats()
    finally:
        source.start()
    assert stats["object_store"]["get_requests"] == len(FILES)  # the proofs, made before the source stopped
    assert stats["blocks"]["cluster_served"] == stats["cluster"]["hits"] > 0
    assert stats["cluster"]["corrupt_blocks"] == stats["cluster"]["errors"] == 0
    assert stats["cluster"]["authorization_requests"] == len(FILES)  # once per file, not per block
    assert stats["cluster"]["authorization_refused"] == 0


def test_a_corrupted_cluster_block_gives_correct_bytes_and_is_counted(
        mounter: Mounter, servers: tuple[SeaweedS3, SeaweedS3], cluster_env: dict[str, str]) -> None:
    source, cluster = servers
    fill_cluster(mounter, servers, cluster_env)
    client = cluster.client()
    keys = sorted(cluster_keys(cluster))
    good = client.get_object(Bucket=CLUSTER_BUCKET, Key=keys[0])["Body"].read()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    client.put_object(Bucket=CLUSTER_BUCKET, Key=keys[0], Body=bytes(bad))  # one flipped data byte
    client.put_object(Bucket=CLUSTER_BUCKET, Key=keys[1], Body=b"not a block")  # foreign, truncated
    second = mounter.mount(f"s3://{SOURCE_BUCKET}", *cluster_args(cluster), env=cluster_env)
    assert read_all(second) == FILES
    section = wait_drained(second)
    assert section["corrupt_blocks"] == 2
    assert second.stats()["blocks"]["fetched"] == 2  # only the two bad blocks came from the source
    # The write-behind put the good blocks back in their place.
    assert client.get_object(Bucket=CLUSTER_BUCKET, Key=keys[0])["Body"].read() == good


def test_the_cluster_store_stopped_in_the_middle_of_reads(
        mounter: Mounter, servers: tuple[SeaweedS3, SeaweedS3], cluster_env: dict[str, str]) -> None:
    source, cluster = servers
    fill_cluster(mounter, servers, cluster_env)
    second = mounter.mount(f"s3://{SOURCE_BUCKET}", *cluster_args(cluster), env=cluster_env)
    keys = sorted(FILES)
    half = keys[: len(keys) // 2]
    for key in half:
        assert (second.path / key).read_bytes() == FILES[key]
    cluster.stop_keep_data()
    try:
        for key in keys:
            got = bounded(lambda k=key: (second.path / k).read_bytes(), READ_BOUND_S, f"reading {key}")
            assert got == FILES[key]
        stats = second.stats()
    finally:
        cluster.start()
    assert stats["cluster"]["errors"] >= 1
    assert stats["blocks"]["fetched"] > 0


@pytest.mark.parametrize(("url", "needle"), [
    ("http://shared", "--cluster-cache"),
    ("s3://Not_A_Bucket", "Not_A_Bucket"),
    ("file:///tmp/cluster", "--cluster-cache must be s3://"),
])
def test_bad_cluster_urls_are_refused_with_one_line(
        url: str, needle: str, tmp_path: Path, servers: tuple[SeaweedS3, SeaweedS3],
        cluster_env: dict[str, str]) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    result = run_cli("mount", f"s3://{SOURCE_BUCKET}", str(mnt), "--cache-dir", str(tmp_path / "c"),
                     "--cluster-cache", url, env=cluster_env)
    assert result.returncode != 0
    assert result.stderr.count("\n") == 1 and needle in result.stderr, result.stderr


def test_a_missing_cluster_bucket_is_refused_at_mount_with_one_line(
        tmp_path: Path, servers: tuple[SeaweedS3, SeaweedS3], cluster_env: dict[str, str]) -> None:
    """The store answers, with an error: a misconfiguration, refused (issue 24, item 1)."""
    source, cluster = servers
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    result = run_cli("mount", f"s3://{SOURCE_BUCKET}", str(mnt), "--cache-dir", str(tmp_path / "c"),
                     "--cluster-cache", "s3://no-such-bucket/x", "--cluster-endpoint-url", cluster.endpoint_url,
                     "--cluster-profile", "cluster", env=cluster_env)
    assert result.returncode != 0
    assert result.stderr.count("\n") == 1, result.stderr
    assert "cluster cache" in result.stderr and "Traceback" not in result.stderr
    assert cluster.secret_key not in result.stderr


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


def test_a_cluster_store_down_at_mount_is_a_miss_and_is_used_again_once_it_answers(
        mounter: Mounter, servers: tuple[SeaweedS3, SeaweedS3], cluster_env: dict[str, str]) -> None:
    """Issue 24, item 1: the cluster store stopped before the mount never stops it; reads come from
    the source, the tier's circuit shows in /stats and /metrics, and the tier is written again once
    the store is back, with no restart."""
    import urllib.request

    source, cluster = servers
    clear_cluster(cluster)
    keys = sorted(FILES)
    cluster.stop_keep_data()
    try:
        mount = mounter.mount(f"s3://{SOURCE_BUCKET}", *cluster_args(cluster), "--stats-addr", "127.0.0.1:0",
                              "--dir-ttl", "0",
                              env=cluster_env)
        port = mount.stats_port()
        assert "cachefs: warning: cluster cache" in mount.stderr and "unreachable" in mount.stderr, mount.stderr
        assert read_all(mount) == FILES
        stats = mount.stats()
        assert stats["cluster"]["state"] == "down" and stats["cluster"]["health"]["outages"] >= 1
        assert stats["blocks"]["fetched"] > 0 and stats["cluster"]["hits"] == 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            text = answer.read().decode()
        assert _metric(text, "cachefs_tier_state", tier="cluster", state="down") == 1.0
    finally:
        cluster.start()
    # The circuit's probe runs when a read finds it open (one per probe interval). Reads of objects
    # new to the mount reach the daemon (the kernel's page cache holds the others): read new ones
    # until the probe has found the store, then one more, which is written to the tier again.
    deadline = time.monotonic() + READ_BOUND_S
    healthy = False
    client = source.client()
    try:
        for n in itertools.count():
            data = random.Random(100 + n).randbytes(BLOCK + n)
            client.put_object(Bucket=SOURCE_BUCKET, Key=f"later/{n}.bin", Body=data)
            assert (mount.path / "later" / f"{n}.bin").read_bytes() == data
            if healthy:
                break
            healthy = mount.stats()["cluster"]["state"] == "healthy"
            assert time.monotonic() < deadline, f"the cluster tier did not come back: {mount.stats()['cluster']}"
            if not healthy:
                time.sleep(0.5)
        section = wait_drained(mount)
        assert section["write_behind"]["written"] > 0 and cluster_keys(cluster)
    finally:  # the other tests read and warm exactly FILES
        for m in range(n + 1):
            client.delete_object(Bucket=SOURCE_BUCKET, Key=f"later/{m}.bin")


def test_a_frozen_cluster_store_at_mount_is_taken_as_down_within_the_check_bound(
        mounter: Mounter, servers: tuple[SeaweedS3, SeaweedS3], cluster_env: dict[str, str]) -> None:
    """Issue 24, item 1: a cluster store that accepts connections and never answers (a silent
    partition) does not stop the mount either; the start-up check gives up after its bound."""
    source, cluster = servers
    with LoopbackProxy(int(cluster.endpoint_url.rsplit(":", 1)[1])) as proxy:
        proxy.freeze()
        args = cluster_args(cluster)
        args[args.index(cluster.endpoint_url)] = proxy.endpoint_url
        mount = mounter.mount(f"s3://{SOURCE_BUCKET}", *args, env=cluster_env)
        assert "cachefs: warning: cluster cache" in mount.stderr and "unreachable" in mount.stderr, mount.stderr
        assert read_all(mount) == FILES
        section = mount.stats()["cluster"]
        assert section["state"] == "down" and section["hits"] == 0, section
        assert mount.unmount().returncode == 0


def test_prefetch_tier_cluster_warms_the_cluster_once_for_every_node(
        mounter: Mounter, servers: tuple[SeaweedS3, SeaweedS3], cluster_env: dict[str, str]) -> None:
    source, cluster = servers
    clear_cluster(cluster)
    warmer = mounter.mount(f"s3://{SOURCE_BUCKET}", *cluster_args(cluster), env=cluster_env)
    check = run_cli("prefetch", str(warmer.path), "--check", "--tier", "cluster", env=cluster_env)
    assert check.returncode == 1 and "0.0% cached in the cluster tier" in check.stdout, check.stdout + check.stderr
    warm = run_cli("prefetch", str(warmer.path), "--tier", "cluster", env=cluster_env)
    assert warm.returncode == 0, warm.stderr
    check = run_cli("prefetch", str(warmer.path), "--check", "--tier", "cluster", env=cluster_env)
    assert check.returncode == 0 and "100.0% cached in the cluster tier" in check.stdout, check.stdout
    stats = warmer.stats()
    assert stats["tiers"]["disk"]["entries"] == 0 and stats["tiers"]["ram"]["entries"] == 0
    blocks = sum(-(-len(d) // BLOCK) for d in FILES.values())
    assert stats["cluster"]["inserts"] == len(cluster_keys(cluster)) == blocks
    # Another node reads everything at in-cluster speed: no GET of data from the source, only the
    # one-byte proof per file that this volume may read it.
    reader = mounter.mount(f"s3://{SOURCE_BUCKET}", *cluster_args(cluster), env=cluster_env)
    assert read_all(reader) == FILES
    stats = reader.stats()
    assert stats["object_store"]["get_requests"] == stats["cluster"]["authorization_requests"] == len(FILES)
    assert stats["blocks"]["cluster_served"] == blocks


def test_cluster_gc_deletes_the_oldest_blocks_down_to_the_size(
        mounter: Mounter, servers: tuple[SeaweedS3, SeaweedS3], cluster_env: dict[str, str]) -> None:
    source, cluster = servers
    fill_cluster(mounter, servers, cluster_env)
    client = cluster.client()
    objects = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=CLUSTER_BUCKET, Prefix=CLUSTER_PREFIX):
        objects.extend(page.get("Contents", []))
    total = sum(o["Size"] for o in objects)
    keep = total // 2
    gc = ["cluster", "gc", "--cluster-cache", f"s3://{CLUSTER_BUCKET}/{CLUSTER_PREFIX}", "--cluster-endpoint-url",
          cluster.endpoint_url, "--cluster-profile", "cluster", "--max-size", str(keep)]
    dry = run_cli(*gc, "--dry-run", "--json", env=cluster_env)
    assert dry.returncode == 0, dry.stderr
    assert len(cluster_keys(cluster)) == len(objects)  # a dry run deletes nothing
    result = run_cli(*gc, env=cluster_env)
    assert result.returncode == 0 and "deleted" in result.stdout, result.stderr
    left = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=CLUSTER_BUCKET, Prefix=CLUSTER_PREFIX):
        left.extend(page.get("Contents", []))
    assert 0 < len(left) < len(objects) and sum(o["Size"] for o in left) <= keep
    newest_deleted = max(o["LastModified"] for o in objects if o["Key"] not in {x["Key"] for x in left})
    assert all(o["LastModified"] >= newest_deleted for o in left)
    with refusing_port() as nobody:
        bad = run_cli("cluster", "gc", "--cluster-cache", f"s3://{CLUSTER_BUCKET}", "--cluster-endpoint-url",
                      f"http://127.0.0.1:{nobody}", "--cluster-profile", "cluster", "--max-size", "1GiB",
                      env=cluster_env)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "cluster gc" in bad.stderr, bad.stderr


def read_direct(path: Path) -> bytes:
    """Read ``path`` one block per read with O_DIRECT: no page cache and no kernel read-ahead, so
    every read reaches the daemon exactly once, as one request for one block."""
    import mmap
    import os

    buf = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT needs
    out = bytearray()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        while True:
            n = os.preadv(fd, [buf], len(out))
            out += buf[:n]
            if n < BLOCK:
                return bytes(out)
    finally:
        os.close(fd)


def test_traffic_counts_where_every_byte_came_from_exactly(
        mounter: Mounter, servers: tuple[SeaweedS3, SeaweedS3], cluster_env: dict[str, str]) -> None:
    """What the cache saved (issue 26), counted on a real mount: a cold read comes from the source,
    a re-read after dropping RAM from disk, a second node's read from the cluster tier. Without
    passthrough: the daemon serves (and counts) every read."""
    source, cluster = servers
    clear_cluster(cluster)
    key = "data/part-1.bin"
    data, blocks = FILES[key], -(-len(FILES[key]) // BLOCK)
    first = mounter.mount(f"s3://{SOURCE_BUCKET}", *cluster_args(cluster, "--readahead", "0", "--no-passthrough"), env=cluster_env)
    before = first.stats()["traffic"]
    assert bounded(lambda: read_direct(first.path / key), READ_BOUND_S, "cold read") == data
    wait_drained(first)
    t = first.stats()["traffic"]
    assert t["served_bytes"] == {"ram": 0, "disk": 0, "cluster": 0, "source": len(data)}
    assert t["served_blocks"] == {"ram": 0, "disk": 0, "cluster": 0, "source": blocks}
    assert t["avoided_source_bytes"] == t["avoided_source_requests"] == 0
    assert t["source"]["read_requests"] - before["source"]["read_requests"] == blocks
    assert t["source"]["read_bytes"] - before["source"]["read_bytes"] == len(data)
    assert t["source"]["upload_requests"] == t["source"]["uploaded_bytes"] == 0
    # The cluster store: one lookup per block (a miss: one GET answered 404, nothing read; issue 25
    # made every lookup a single GET), one upload per block.
    stored = sum(obj["Size"] for obj in cluster.client().list_objects_v2(
        Bucket=CLUSTER_BUCKET, Prefix=CLUSTER_PREFIX)["Contents"])  # the blocks, each framed
    assert t["cluster_store"]["read_requests"] == blocks and t["cluster_store"]["read_bytes"] == 0
    assert t["cluster_store"]["upload_requests"] == blocks
    assert t["cluster_store"]["uploaded_bytes"] == stored > len(data)
    assert t["hit_ratios"] == {"local": 0.0, "cluster": 0.0, "source": 1.0}

    assert run_cli("evict", str(first.path), "--tier", "ram", env=cluster_env).returncode == 0
    assert bounded(lambda: read_direct(first.path / key), READ_BOUND_S, "re-read") == data
    t = first.stats()["traffic"]
    assert t["served_bytes"] == {"ram": 0, "disk": len(data), "cluster": 0, "source": len(data)}
    assert t["avoided_source_bytes"] == len(data) and t["avoided_source_requests"] == blocks
    assert t["source"]["read_bytes"] - before["source"]["read_bytes"] == len(data)  # no new GET
    assert t["hit_ratios"] == {"local": 0.5, "cluster": 0.0, "source": 0.5}

    second = mounter.mount(f"s3://{SOURCE_BUCKET}", *cluster_args(cluster, "--readahead", "0", "--no-passthrough"), env=cluster_env)
    assert bounded(lambda: read_direct(second.path / key), READ_BOUND_S, "second node") == data
    s = second.stats()
    t = s["traffic"]
    assert t["served_bytes"] == {"ram": 0, "disk": 0, "cluster": len(data), "source": 0}
    assert t["avoided_source_bytes"] == len(data) and t["avoided_source_requests"] == blocks
    # The one-byte GET proving this volume may read the object before its first cluster hit is a
    # source request of one byte, counted as any other.
    assert t["source"]["read_requests"] == t["source"]["read_bytes"] == 1
    # A hit costs one GET of the framed block (no HEAD first).
    assert t["cluster_store"]["read_requests"] == blocks
    assert t["cluster_store"]["read_bytes"] == stored
    assert t["hit_ratios"] == {"local": 0.0, "cluster": 1.0, "source": 0.0}
    assert s["volume"] == first.stats()["volume"] and len(s["volume"]) == 16  # one label per source

