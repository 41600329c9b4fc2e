"""Prefetch throughput of a >= 1 GiB dataset, next to the raw parallel-GET throughput of the same server.

One run, one machine, one SeaweedFS on 127.0.0.1, a dataset of large files plus small ones (by
default 64 x 16 MiB + 256 x 64 KiB = 1.02 GiB):

  raw GET         every object fetched with 16 parallel ranged GETs of one block (8 MiB) each, bytes
                  thrown away: the most a client with the same concurrency can get from this server
  prefetch        `cachefs prefetch MNT --recursive` on a fresh mount and cache dir: the store is
                  listed, every block is fetched with the same 16 fetch slots and written to the disk
                  tier; timed from the CLI's start to its exit (listing and CLI start-up included)
  prefetch (job)  the same run, timed by the daemon's job (listing to last block on disk)
  resume          the same command again: everything is on disk, nothing is fetched (index lookups)

Each is repeated ``--repeat`` times (fresh mount and cache dir each time); the medians are printed.

Run: .venv/bin/python -m benchmarks.prefetch_throughput [--large 64] [--large-mib 16] [--small 256] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support.s3servers import SeaweedS3  # noqa: E402
from tiering.blocks import DEFAULT_BLOCK_SIZE  # noqa: E402
from benchmarks.common import raw_parallel_get  # noqa: E402
from tiering.settings import DEFAULT_MAX_CONCURRENT_FETCHES  # noqa: E402

MiB = 1024 * 1024
KiB = 1024
CLI = [sys.executable, "-m", "cachefs"]
BUCKET = "bench"
PREFIX = "ds"


async def raw_get(server: SeaweedS3, objects: dict[str, int], parallel: int = DEFAULT_MAX_CONCURRENT_FETCHES) -> float:
    """MiB/s of fetching every object once, ``parallel`` ranged GETs of one block each in flight."""
    return await raw_parallel_get(server, BUCKET, PREFIX + "/", list(objects), DEFAULT_BLOCK_SIZE, parallel)


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([*CLI, *args], env={**os.environ, **env}, timeout=900, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"cachefs {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def drop_page_cache() -> None:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass  # not root: the page cache just stays warm (it only holds the previous run's disk tier)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--large", type=int, default=64, help="number of large files")
    parser.add_argument("--large-mib", type=int, default=16, help="size of each large file in MiB")
    parser.add_argument("--small", type=int, default=256, help="number of 64 KiB files")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    objects = {f"large/{i:03d}.bin": args.large_mib * MiB for i in range(args.large)}
    objects |= {f"small/{i:04d}.bin": 64 * KiB for i in range(args.small)}
    total = sum(objects.values())
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="cachefs-bench-") as tmp, SeaweedS3() as server:
        work = Path(tmp)
        env = {**server.env(), "AWS_ENDPOINT_URL": server.endpoint_url}
        server.make_bucket(BUCKET)
        chunk = os.urandom(args.large_mib * MiB)
        begin = time.perf_counter()
        # Distinct bytes per object (a prefix of the shared random chunk would let a deduplicating
        # store cheat): the index is written into the first bytes.
        server.put_many(BUCKET, ((f"{PREFIX}/{key}", key.encode().ljust(64, b"\0") + chunk[64:size])
                                 for key, size in objects.items()))
        print(f"dataset: {len(objects)} files, {total / MiB:.0f} MiB, uploaded in {time.perf_counter() - begin:.1f} s",
              flush=True)
        for run in range(args.repeat):
            drop_page_cache()
            results.setdefault("raw GET", []).append(asyncio.run(raw_get(server, objects)))
            mnt, cache = work / f"mnt{run}", work / f"cache{run}"
            mnt.mkdir()
            cli("mount", f"s3://{BUCKET}/{PREFIX}", str(mnt), "--cache-dir", str(cache),
                "--disk-cache", f"{2 * total // MiB + 64}MiB", env=env)
            try:
                begin = time.perf_counter()
                job = json.loads(cli("prefetch", str(mnt), "--recursive", "--json", env=env).stdout)
                wall = time.perf_counter() - begin
                assert job["ok"] and job["bytes_fetched"] == total, job
                results.setdefault("prefetch", []).append(total / wall / MiB)
                results.setdefault("prefetch (job)", []).append(total / job["elapsed_s"] / MiB)
                begin = time.perf_counter()
                again = json.loads(cli("prefetch", str(mnt), "--recursive", "--json", env=env).stdout)
                assert again["ok"] and again["bytes_fetched"] == 0, again
                results.setdefault("resume, all cached (s)", []).append(time.perf_counter() - begin)
            finally:
                cli("unmount", str(mnt), env=env)
            shutil.rmtree(cache, ignore_errors=True)
            print(f"run {run + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in results.items()), flush=True)
    medians = {name: statistics.median(values) for name, values in results.items()}
    print(f"prefetch of {len(objects)} files, {total / MiB:.0f} MiB, median of {args.repeat} runs (MiB/s):")
    for name, value in medians.items():
        print(f"  {name:<24} {value:9.1f}")
    print(f"ratio prefetch / raw GET        {medians['prefetch'] / medians['raw GET']:.2f}")
    print(f"ratio prefetch (job) / raw GET  {medians['prefetch (job)'] / medians['raw GET']:.2f}")
    print(json.dumps({k: [round(v, 2) for v in vs] for k, vs in results.items()}))


if __name__ == "__main__":
    main()
