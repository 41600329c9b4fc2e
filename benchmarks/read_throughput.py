"""Sequential read throughput of one large object through a cachefs mount, next to its limits.

One run, one machine, one SeaweedFS on 127.0.0.1:

  page cache    a local file with the same bytes, read a second time (kernel page cache)
  local disk    the same file after dropping the page cache (needs root; skipped otherwise)
  raw GET       the object fetched with 16 parallel ranged GETs of one block each (cold limit)
  cold          first read through a fresh mount (object store -> disk + RAM tiers)
  warm          second read through the same mount (kernel page cache, kept across opens)
  disk tier     a fresh mount on the same cache dir after dropping the page cache

Run: .venv/bin/python -m benchmarks.read_throughput [--size-mib 1024] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support.s3servers import SeaweedS3  # noqa: E402
from tiering.blocks import DEFAULT_BLOCK_SIZE  # noqa: E402
from benchmarks.common import drop_page_cache, peak_rss_mib, raw_parallel_get, read_mib_s  # noqa: E402
from cachefs.client import call  # noqa: E402

MiB = 1024 * 1024
CLI = [sys.executable, "-m", "cachefs"]


def daemon_peak_rss_mib(mnt: Path, env: dict[str, str]) -> float:
    """Peak resident memory (VmHWM) of the daemon serving ``mnt``."""
    return peak_rss_mib(int(call(mnt, "/info")["pid"]))


def cli(*args: str, env: dict[str, str]) -> None:
    subprocess.run([*CLI, *args], check=True, env={**os.environ, **env}, timeout=300,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    size = args.size_mib * MiB
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="cachefs-bench-") as tmp, SeaweedS3() as server:
        work = Path(tmp)
        env = {**server.env(), "AWS_ENDPOINT_URL": server.endpoint_url}
        data = os.urandom(size)
        local = work / "local.bin"
        local.write_bytes(data)
        server.make_bucket("bench")
        server.put("bench", "ds/big.bin", data)
        del data
        can_drop = drop_page_cache()
        for run in range(args.repeat):
            if can_drop:
                drop_page_cache()
                results.setdefault("local disk", []).append(read_mib_s(local))
            read_mib_s(local)
            results.setdefault("page cache", []).append(read_mib_s(local))
            results.setdefault("raw GET", []).append(asyncio.run(raw_parallel_get(server, "bench", "ds/", ["big.bin"], DEFAULT_BLOCK_SIZE)))
            mnt, cache = work / f"mnt{run}", work / f"cache{run}"
            mnt.mkdir()
            ram = f"{max(args.size_mib * 2, 64)}MiB"
            cli("mount", "s3://bench/ds", str(mnt), "--cache-dir", str(cache), "--ram-cache", ram, env=env)
            try:
                results.setdefault("cold", []).append(read_mib_s(mnt / "big.bin"))
                results.setdefault("warm", []).append(read_mib_s(mnt / "big.bin"))
                results.setdefault(f"daemon peak RSS MiB (RAM tier {ram})", []).append(daemon_peak_rss_mib(mnt, env))
            finally:
                cli("unmount", str(mnt), env=env)
            if can_drop:
                drop_page_cache()
                cli("mount", "s3://bench/ds", str(mnt), "--cache-dir", str(cache), "--ram-cache", "64MiB", env=env)
                try:
                    results.setdefault("disk tier", []).append(read_mib_s(mnt / "big.bin"))
                    results.setdefault("daemon peak RSS MiB (RAM tier 64MiB)", []).append(daemon_peak_rss_mib(mnt, env))
                finally:
                    cli("unmount", str(mnt), env=env)
    medians = {name: statistics.median(values) for name, values in results.items()}
    print(f"sequential read of a {args.size_mib} MiB object, median of {args.repeat} runs (MiB/s):")
    for name, value in medians.items():
        print(f"  {name:<11} {value:9.1f}")
    print("(the RSS lines are MiB of daemon memory, not throughput)")
    print("ratios:")
    if "page cache" in medians:
        print(f"  warm / page cache      {medians['warm'] / medians['page cache']:.2f}")
    print(f"  cold / raw GET         {medians['cold'] / medians['raw GET']:.2f}")
    if "disk tier" in medians and "local disk" in medians:
        print(f"  disk tier / local disk {medians['disk tier'] / medians['local disk']:.2f}")
    print(json.dumps({k: [round(v, 1) for v in vs] for k, vs in results.items()}))


if __name__ == "__main__":
    main()
