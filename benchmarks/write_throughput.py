"""Writing one large file through a cachefs mount (write-back), next to its limits.

One run, one machine, one SeaweedFS on 127.0.0.1, the same bytes (random, generated once) each time:

  local write     write the file to the local disk in 1 MiB writes, fsync, close
  mount write     the same through a fresh mount (write-back): write, close. close() returns once the
                  data is durable in the local staging area (fsync'd and journaled), before upload
  drain           `cachefs flush` right after that close: the upload of the staged file to the store
  raw multipart   boto3 upload of the same bytes from memory, multipart with parallel parts, the same
                  part size and parallelism as cachefs's uploader (16 MiB parts, 8 in flight)
  write + drain   mount write and drain together: when the bytes are in the bucket

Each figure is the median of ``--repeat`` runs (each on a fresh mount and cache directory). The
disk tier is sized so that the whole file fits in staging (``--disk-cache`` 4x the file): this
measures the data path, not back-pressure.

Run: .venv/bin/python -m benchmarks.write_throughput [--size-mib 1024] [--repeat 3]
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

from benchmarks.common import raw_multipart_upload, write_seconds  # noqa: E402
from benchmarks.peers import PART_SIZE, PARTS_IN_FLIGHT  # noqa: E402
from tests.support.s3servers import SeaweedS3  # noqa: E402

MiB = 1024 * 1024
CLI = [sys.executable, "-m", "cachefs"]


def cli(*args: str, env: dict[str, str], timeout: float = 900) -> float:
    start = time.perf_counter()
    result = subprocess.run([*CLI, *args], env={**os.environ, **env}, timeout=timeout, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"cachefs {' '.join(args)} failed (exit {result.returncode}): {result.stderr.strip()}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", default=None, help="where the local file and the cache go (default: a temp dir)")
    args = parser.parse_args()
    size = args.size_mib * MiB
    seconds: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="cachefs-wbench-", dir=args.workdir) as tmp, SeaweedS3() as server:
        work = Path(tmp)
        env = {**server.env(), "AWS_ENDPOINT_URL": server.endpoint_url}
        server.make_bucket("bench")
        data = os.urandom(size)
        for run in range(args.repeat):
            local = work / "local.bin"
            seconds.setdefault("local write (write+fsync+close)", []).append(write_seconds(local, data, fsync=True))
            local.unlink()

            mnt, cache = work / f"mnt{run}", work / f"cache{run}"
            mnt.mkdir()
            cli("mount", f"s3://bench/run{run}", str(mnt), "--cache-dir", str(cache),
                "--disk-cache", f"{4 * args.size_mib}MiB", env=env)
            try:
                wrote = write_seconds(mnt / "big.bin", data, fsync=False)
                drained = cli("flush", str(mnt), "--timeout", "900", env=env)
            finally:
                cli("unmount", str(mnt), env=env)
            head = server.client().head_object(Bucket="bench", Key=f"run{run}/big.bin")
            assert head["ContentLength"] == size, head
            seconds.setdefault("mount write (write+close)", []).append(wrote)
            seconds.setdefault("drain (cachefs flush)", []).append(drained)
            seconds.setdefault("mount write + drain", []).append(wrote + drained)
            seconds.setdefault("raw multipart upload", []).append(raw_multipart_upload(server, "bench", f"raw{run}.bin", data, part_size=PART_SIZE, parallel=PARTS_IN_FLIGHT))
            print(f"run {run + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in seconds.items()), flush=True)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    print(f"\nwriting a {args.size_mib} MiB file, median of {args.repeat} runs:")
    for name, value in medians.items():
        print(f"  {name:<32} {value:8.2f} s  {args.size_mib / value:8.1f} MiB/s")
    print("ratios:")
    print(f"  mount write / local write      {medians['mount write (write+close)'] / medians['local write (write+fsync+close)']:.2f}x the time")
    print(f"  drain / raw multipart upload   {medians['drain (cachefs flush)'] / medians['raw multipart upload']:.2f}x the time")
    print(json.dumps({k: [round(v, 3) for v in vs] for k, vs in seconds.items()}))


if __name__ == "__main__":
    main()
