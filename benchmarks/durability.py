"""The cost of ``--write-durability cluster``: writes through a mount with ``local`` and ``cluster``,
next to a direct PUT of the same bytes to the cluster store.

One run, one machine, two SeaweedFS servers on 127.0.0.1 (the source, and the cluster store of
``--cluster-cache``), the same random bytes each time:

  write+close MiB/s   ``--files`` files of ``--size-mib`` each, written in 1 MiB writes and closed,
                      one after the other (close returns at the acknowledgement). Uploads to the
                      source are held off (``--upload-delay`` an hour) so that only the
                      acknowledgement is measured.
  fsync latency       ``--fsyncs`` times: append ``--append-kib`` to an open file, then fsync;
                      the median and 95th percentile of the fsync alone.
  direct PUT          the floor of ``cluster``: boto3 PutObject of the same bytes to the cluster
                      store (one per file; ``fsync`` row: one PUT of the appended size).

Each mode gets a fresh mount and cache directory. Run:
  .venv/bin/python -m benchmarks.durability [--size-mib 64] [--files 8] [--fsyncs 200] [--append-kib 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import write_seconds  # noqa: E402
from tests.support.s3servers import SeaweedS3  # noqa: E402

MiB, KiB = 1024 * 1024, 1024
CLI = [sys.executable, "-m", "cachefs"]


def cli(*args: str, env: dict[str, str], timeout: float = 900) -> None:
    result = subprocess.run([*CLI, *args], env={**os.environ, **env}, timeout=timeout, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"cachefs {' '.join(args)} failed (exit {result.returncode}): {result.stderr.strip()}")


def fsync_latencies(path: Path, count: int, chunk: bytes) -> list[float]:
    out: list[float] = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(count):
            os.write(fd, chunk)
            start = time.perf_counter()
            os.fsync(fd)
            out.append(time.perf_counter() - start)
    finally:
        os.close(fd)
    return out


def p95(values: list[float]) -> float:
    return sorted(values)[max(0, int(len(values) * 0.95) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--fsyncs", type=int, default=200)
    parser.add_argument("--append-kib", type=int, default=4)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    size = args.size_mib * MiB
    data = [os.urandom(size) for _ in range(min(args.files, 2))]
    chunk = os.urandom(args.append_kib * KiB)
    results: dict[str, dict[str, float]] = {}
    with (tempfile.TemporaryDirectory(prefix="cachefs-dbench-", dir=args.workdir) as tmp,
          SeaweedS3() as source, SeaweedS3() as cluster):
        work = Path(tmp)
        source.make_bucket("bench")
        cluster.make_bucket("shared")
        creds = work / "credentials"
        creds.write_text(f"[cluster]\naws_access_key_id = {cluster.access_key}\n"
                         f"aws_secret_access_key = {cluster.secret_key}\n")
        key = work / "cluster.key"  # the cluster key (--cluster-key-file), through its variable
        key.write_bytes(os.urandom(32))
        key.chmod(0o600)
        env = {**source.env(), "AWS_ENDPOINT_URL": source.endpoint_url, "AWS_SHARED_CREDENTIALS_FILE": str(creds),
               "CACHEFS_CLUSTER_KEY_FILE": str(key)}
        for mode in ("local", "cluster"):
            mnt, cache = work / f"mnt-{mode}", work / f"cache-{mode}"
            mnt.mkdir()
            cli("mount", f"s3://bench/{mode}", str(mnt), "--cache-dir", str(cache), "--upload-delay", "3600",
                "--disk-cache", f"{2 * args.files * args.size_mib + 1024}MiB",
                "--cluster-cache", "s3://shared/c", "--cluster-endpoint-url", cluster.endpoint_url,
                "--cluster-profile", "cluster", "--write-durability", mode, env=env)
            try:
                seconds = [write_seconds(mnt / f"f{i}.bin", data[i % len(data)], fsync=False) for i in range(args.files)]
                lat = fsync_latencies(mnt / "log.txt", args.fsyncs, chunk)
            finally:
                cli("unmount", str(mnt), "--force", env=env)
            results[mode] = {"write_close_mib_s": args.files * args.size_mib / sum(seconds),
                             "fsync_median_ms": statistics.median(lat) * 1000, "fsync_p95_ms": p95(lat) * 1000}
            print(f"{mode}: {results[mode]}", flush=True)
        client = cluster.client()
        start = time.perf_counter()
        for i in range(args.files):
            client.put_object(Bucket="shared", Key=f"direct/f{i}.bin", Body=data[i % len(data)])
        put_s = time.perf_counter() - start
        lat = []
        for i in range(args.fsyncs):
            start = time.perf_counter()
            client.put_object(Bucket="shared", Key=f"direct/small{i}", Body=chunk)
            lat.append(time.perf_counter() - start)
        results["direct PUT to the cluster store"] = {
            "write_close_mib_s": args.files * args.size_mib / put_s,
            "fsync_median_ms": statistics.median(lat) * 1000, "fsync_p95_ms": p95(lat) * 1000}
    print(f"\n{args.files} files of {args.size_mib} MiB; {args.fsyncs} fsyncs of {args.append_kib} KiB appends")
    print(f"  {'':<34} {'write+close MiB/s':>18} {'fsync median ms':>16} {'fsync p95 ms':>13}")
    for name, r in results.items():
        print(f"  {name:<34} {r['write_close_mib_s']:18.1f} {r['fsync_median_ms']:16.2f} {r['fsync_p95_ms']:13.2f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
