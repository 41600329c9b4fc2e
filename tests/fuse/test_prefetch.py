"""Prefetch, pins, snapshot, evict and the stats/metrics endpoints on a real mount over SeaweedFS.

Every assertion about fetching is made with the daemon's own counters (GET requests and bytes read
from the store), never with timings.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from aiohttp import ClientSession, UnixConnector
from prometheus_client.parser import text_string_to_metric_families

from cachefs.client import request_json
from tests.fuse.conftest import CLI, Mount, run_cli

KiB, MiB = 1024, 1024 * 1024
BLOCK = "256KiB"


def payload(key: str, size: int) -> bytes:
    return random.Random(key).randbytes(size)


def s3env(server) -> dict[str, str]:
    return {**server.env(), "AWS_ENDPOINT_URL": server.endpoint_url}


@pytest.fixture
def bucket(seaweed) -> str:
    name = f"pf-{uuid.uuid4().hex[:12]}"
    seaweed.make_bucket(name)
    return name


def upload(seaweed, bucket: str, files: dict[str, int]) -> dict[str, bytes]:
    data = {key: payload(key, size) for key, size in files.items()}
    seaweed.put_many(bucket, [(f"ds/{k}", v) for k, v in data.items()])
    return data


def cli(m: Mount, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI run from inside the mount: relative PATHs are relative to the working directory."""
    return run_cli(*args, env=m.env, cwd=m.path)


def socket_of(m: Mount) -> str:
    return os.getxattr(m.path, "user.cachefs.control").decode()


def read_stats(m: Mount) -> dict:
    """``/stats`` straight from the control socket (``cachefs stats --json`` is tested once, below)."""
    return request_json(socket_of(m), "/stats")


def store_gets(m: Mount) -> int:
    return read_stats(m)["object_store"]["get_requests"]


def in_process(capsys: pytest.CaptureFixture[str], *argv: str) -> subprocess.CompletedProcess[str]:
    """The real CLI entry point, in this process: the same code path without a Python start-up."""
    from cachefs.cli.main import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(argv), code, out, err)


def one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode != 0, result
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("cachefs: error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_prefetched_directory_reads_without_fetching(seaweed, bucket: str, mounter) -> None:
    files = {f"train/{i:02d}.bin": MiB + 1234 for i in range(8)}
    files |= {"train/sub/x.bin": 300 * KiB, "train/empty": 0, "val/v.bin": MiB, "top.txt": 10}
    data = upload(seaweed, bucket, files)
    m = mounter.mount(f"s3://{bucket}/ds", "--block-size", BLOCK, env=s3env(seaweed))
    train = {k: v for k, v in data.items() if k.startswith("train/")}

    result = cli(m, "prefetch", str(m.path), "train", "--recursive")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("cachefs: prefetched 10 of 10 files") and result.stdout.count("\n") == 1
    stats = read_stats(m)
    assert stats["warm"]["bytes"] == sum(len(v) for v in train.values())
    assert stats["tiers"]["ram"]["entries"] == 0  # prefetch does not fill RAM
    gets = stats["object_store"]["get_requests"]

    for key, expected in train.items():
        assert (m.path / key).read_bytes() == expected
    after = read_stats(m)
    assert after["object_store"]["get_requests"] == gets
    assert after["blocks"]["disk_served"] > 0

    check = cli(m, "prefetch", str(m.path), "--check", "-r", "train")
    assert check.returncode == 0 and check.stdout.startswith("cachefs: 100.0% cached"), check
    missing = cli(m, "prefetch", str(m.path), "--check", str(m.path / "val"), "-r")
    assert missing.returncode == 1
    assert missing.stdout.startswith("cachefs: 0.0% cached") and "not cached: val/v.bin" in missing.stderr
    again = cli(m, "prefetch", str(m.path), "train", "--recursive", "--json")
    doc = json.loads(again.stdout)
    assert again.returncode == 0 and doc["ok"] and doc["bytes_fetched"] == 0
    assert doc["bytes_skipped"] == doc["bytes_total"]
    assert store_gets(m) == gets


def _http(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


async def _unix_get(socket: str, route: str) -> str:
    async with ClientSession(connector=UnixConnector(path=socket)) as session:
        async with session.get(f"http://cachefs{route}") as response:
            assert response.status == 200
            return await response.text()


def _shape(value):
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    return type(value).__name__


def test_metrics_stats_and_health_endpoints(seaweed, bucket: str, mounter) -> None:
    upload(seaweed, bucket, {"a.bin": MiB, "b.bin": MiB})
    m = mounter.mount(f"s3://{bucket}/ds", "--block-size", BLOCK, "--stats-addr", "127.0.0.1:0",
                      env=s3env(seaweed))
    port = m.stats_port()
    assert port > 0
    (m.path / "a.bin").read_bytes()
    assert cli(m, "prefetch", str(m.path), "b.bin", "--pin").returncode == 0
    base = f"http://127.0.0.1:{port}"

    status, text = _http(base + "/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}

    def has(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        assert key in samples, (key, sorted(n for n, _ in samples if n.startswith(name[:20])))
        return samples[key]

    for tier in ("ram", "disk"):
        for name in ("cachefs_tier_hits_total", "cachefs_tier_misses_total", "cachefs_tier_hit_bytes_total",
                     "cachefs_tier_miss_bytes_total", "cachefs_tier_evictions_total", "cachefs_tier_used_bytes",
                     "cachefs_tier_capacity_bytes", "cachefs_tier_errors_total"):
            has(name, tier=tier)
    assert has("cachefs_object_store_requests_total", operation="get") > 0
    has("cachefs_object_store_requests_total", operation="list")
    has("cachefs_object_store_errors_total")
    assert has("cachefs_object_store_request_duration_seconds_count", operation="get") > 0
    has("cachefs_object_store_request_duration_seconds_bucket", operation="get", le="+Inf")
    assert has("cachefs_warm_bytes_total") == MiB
    assert has("cachefs_pinned_bytes") > MiB
    assert families["cachefs_tier_hits"].type == "counter"
    assert families["cachefs_object_store_request_duration_seconds"].type == "histogram"

    status, body = _http(base + "/stats")
    assert status == 200
    over_tcp = json.loads(body)
    result = cli(m, "stats", str(m.path), "--json")
    assert result.returncode == 0
    from_cli = json.loads(result.stdout)
    assert _shape(over_tcp) == _shape(from_cli)
    for section in ("object_store", "warm", "pins", "latency"):
        assert over_tcp[section] == from_cli[section], section
    for tier in ("ram", "disk"):
        for field in ("used_bytes", "capacity_bytes", "entries", "evictions"):
            assert over_tcp["tiers"][tier][field] == from_cli["tiers"][tier][field]
    assert over_tcp["blocks"]["fetched"] == from_cli["blocks"]["fetched"]

    assert _http(base + "/healthz") == (200, "ok\n")
    assert _http(base + "/prefetch")[0] == 404  # control actions are never on TCP
    assert "cachefs_tier_hits_total" in asyncio.run(_unix_get(socket_of(m), "/metrics"))


def test_interrupted_prefetch_resumes_with_only_the_rest(seaweed, bucket: str, mounter) -> None:
    files = {f"d/{i:02d}.bin": MiB for i in range(24)}
    upload(seaweed, bucket, files)
    total = 24 * MiB
    m = mounter.mount(f"s3://{bucket}/ds", "--block-size", "64KiB", env=s3env(seaweed))
    sock = socket_of(m)
    # SIGINT at its default in the CLI whatever this process inherited: a suite started in the
    # background of a non-interactive shell has it ignored, and Python keeps it so; the CLI then
    # never sees the Ctrl-C, the prefetch finishes (exit 0) and the test fails for its runner's sake.
    proc = subprocess.Popen(["env", "--default-signal=INT", *CLI, "prefetch", str(m.path), "d", "-r", "--parallel", "1"],
                            env={**os.environ, **m.env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=m.path)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            jobs = request_json(sock, "/prefetch")
            if jobs and jobs[0]["bytes_done"] >= MiB:
                break
            time.sleep(0.02)
        assert jobs and jobs[0]["state"] == "running", jobs
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "prefetch cancelled" in err and "run it again to resume" in err
    job = request_json(sock, "/prefetch")[0]
    assert job["state"] == "cancelled"
    # Loads in flight when it was cancelled still land; wait until nothing is being fetched.
    settle = time.monotonic() + 10
    while time.monotonic() < settle:
        first = read_stats(m)["warm"]["bytes"]
        time.sleep(0.2)
        if read_stats(m)["warm"]["bytes"] == first:
            break
    assert 0 < first < total

    result = cli(m, "prefetch", str(m.path), "d", "-r", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["ok"] and doc["bytes_fetched"] == total - first and doc["bytes_skipped"] == first
    stats = read_stats(m)
    assert stats["object_store"]["bytes_read"] == total  # every byte fetched exactly once
    assert stats["warm"]["bytes"] == total


def test_pinned_files_survive_eviction_pressure_and_remount(seaweed, bucket: str, mounter) -> None:
    files = {"pin/a.bin": MiB, "pin/b.bin": MiB, "big.bin": MiB}
    files |= {f"other/{i}.bin": MiB for i in range(10)}
    data = upload(seaweed, bucket, files)
    opts = ["--block-size", BLOCK, "--disk-cache", "6MiB", "--ram-cache", "1MiB", "--max-pinned", "0.4"]
    m = mounter.mount(f"s3://{bucket}/ds", *opts, env=s3env(seaweed))

    assert cli(m, "prefetch", str(m.path), "pin", "-r", "--pin").returncode == 0
    pins = read_stats(m)["pins"]
    assert pins["objects"] == 2 and pins["cached_bytes"] == pins["bytes"] > 2 * MiB
    over = cli(m, "prefetch", str(m.path), "big.bin", "--pin")
    one_line_error(over, "pin limit exceeded", "--max-pinned")
    assert over.returncode == 2 and read_stats(m)["pins"]["objects"] == 2

    for i in range(10):  # 10 MiB through a 6 MiB disk tier
        assert (m.path / f"other/{i}.bin").read_bytes() == data[f"other/{i}.bin"]
    stats = read_stats(m)
    assert stats["tiers"]["disk"]["evictions"] > 0
    assert stats["tiers"]["disk"]["pinned_bytes"] == pins["bytes"]
    evicted = cli(m, "evict", str(m.path), "--tier", "ram")
    assert evicted.returncode == 0 and read_stats(m)["tiers"]["ram"]["entries"] == 0, evicted
    gets = store_gets(m)
    for key in ("pin/a.bin", "pin/b.bin"):
        assert (m.path / key).read_bytes() == data[key]
    assert store_gets(m) == gets

    # The pins are in the cache directory: a new daemon keeps them.
    assert m.unmount().returncode == 0
    m2 = mounter.mount(f"s3://{bucket}/ds", *opts, env=s3env(seaweed), cache_dir=m.cache_dir, mountpoint=m.path)
    assert read_stats(m2)["pins"]["objects"] == 2
    check = cli(m2, "prefetch", str(m2.path), "pin", "-r", "--check")
    assert check.returncode == 0 and "100.0% cached" in check.stdout
    gets = store_gets(m2)
    for key in ("pin/a.bin", "pin/b.bin"):
        assert (m2.path / key).read_bytes() == data[key]
    assert store_gets(m2) == gets

    unpinned = cli(m2, "unpin", str(m2.path), "pin")
    assert unpinned.returncode == 0 and unpinned.stdout.startswith("cachefs: unpinned 2 files"), unpinned
    assert read_stats(m2)["pins"] == {**read_stats(m2)["pins"], "objects": 0, "bytes": 0, "cached_bytes": 0}


def test_bad_requests_get_one_line_and_a_nonzero_exit(seaweed, bucket: str, mounter, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    upload(seaweed, bucket, {"dir/f.bin": 1000})
    m = mounter.mount(f"s3://{bucket}/ds", env=s3env(seaweed))
    mnt = str(m.path)
    one_line_error(run_cli("prefetch", mnt, "dir/nope.bin", env=m.env, cwd=mnt),
                   "no such file or directory in the mount: dir/nope.bin")

    def cli(_m: Mount, *argv: str) -> subprocess.CompletedProcess[str]:  # the rest in-process, cwd in the mount
        previous = os.getcwd()
        os.chdir(mnt)
        try:
            return in_process(capsys, *argv)
        finally:
            os.chdir(previous)

    one_line_error(cli(m, "prefetch", mnt, "../../etc"), "../../etc is outside the mount")
    one_line_error(cli(m, "prefetch", mnt, "/etc/passwd"), "is outside the mount")
    one_line_error(cli(m, "prefetch", mnt, "dir"), "is a directory (use --recursive): dir")
    one_line_error(cli(m, "prefetch", mnt, "--manifest", str(tmp_path / "none.jsonl")), "none.jsonl does not exist")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"path": "dir/f.bin"}\n{"path": "dir/f.bin", "size": "big"}\n')
    one_line_error(cli(m, "prefetch", mnt, "--manifest", str(bad)), "line 2", '"size"')
    missing = tmp_path / "missing.txt"
    missing.write_text("dir/f.bin\n\ndir/gone.bin\n")
    one_line_error(cli(m, "prefetch", mnt, "--manifest", str(missing)), "line 3", "dir/gone.bin")
    not_a_mount = tmp_path / "plain"
    not_a_mount.mkdir()
    one_line_error(cli(m, "prefetch", str(not_a_mount), "x"), "is not inside a cachefs mount")
    one_line_error(cli(m, "prefetch", "/proc", "x"), "is not a cachefs mount")
    one_line_error(cli(m, "snapshot", mnt, "nope"), "no such file or directory in the mount: nope")
    one_line_error(cli(m, "evict", mnt, "nope"), "no such file or directory in the mount: nope")
    one_line_error(cli(m, "unpin", mnt, "nope"), "no such file or directory in the mount: nope")
    assert store_gets(m) == 0


def test_snapshot_then_manifest_prefetch_reports_changed_objects(seaweed, bucket: str, mounter,
                                                                 tmp_path: Path) -> None:
    files = {"set/a.bin": 600 * KiB, "set/b.bin": 600 * KiB, "set/c/d.bin": 10, "other.bin": 5}
    upload(seaweed, bucket, files)
    m = mounter.mount(f"s3://{bucket}/ds", "--block-size", BLOCK, env=s3env(seaweed))
    manifest = tmp_path / "manifest.jsonl"
    result = cli(m, "snapshot", str(m.path), "set", "-o", str(manifest))
    assert result.returncode == 0 and "wrote 3 files" in result.stderr, result
    lines = [json.loads(line) for line in manifest.read_text().splitlines()]
    assert [e["path"] for e in lines] == ["set/a.bin", "set/b.bin", "set/c/d.bin"]
    assert all(set(e) == {"path", "etag", "size"} for e in lines)
    assert cli(m, "snapshot", str(m.path), "set").stdout == manifest.read_text()  # reproducible

    seaweed.put(bucket, "ds/set/b.bin", payload("new", 600 * KiB))  # same size, new content
    result = cli(m, "prefetch", str(m.path), "--manifest", str(manifest))
    assert result.returncode == 1, result
    assert "changed since the manifest: set/b.bin (manifest line 2: ETag differs" in result.stderr
    assert "1 file(s) changed since the manifest" in result.stderr
    check = cli(m, "prefetch", str(m.path), "set/a.bin", "set/c/d.bin", "--check")
    assert check.returncode == 0, check


def test_a_manifest_over_a_mebibyte_reaches_the_daemon(seaweed, bucket: str, mounter, tmp_path: Path) -> None:
    """20,000 entries (1.6 MB of request body) crossed aiohttp's default 1 MiB limit (issue 19)."""
    names = [f"a-directory-with-a-long-name-{'x' * 20}/f{i}.bin" for i in range(10)]
    upload(seaweed, bucket, {name: 1000 for name in names})
    m = mounter.mount(f"s3://{bucket}/ds", env=s3env(seaweed))
    snapshot = cli(m, "snapshot", str(m.path))
    assert snapshot.returncode == 0, snapshot.stderr
    lines = snapshot.stdout.splitlines()
    manifest = tmp_path / "big.jsonl"
    manifest.write_text("\n".join(lines[i % len(lines)] for i in range(20_000)) + "\n")
    assert manifest.stat().st_size > 1024 * 1024
    result = cli(m, "prefetch", str(m.path), "--manifest", str(manifest))
    assert result.returncode == 0, result.stderr
    assert "cannot reach" not in result.stderr
    assert read_stats(m)["object_store"]["get_requests"] >= len(names)
