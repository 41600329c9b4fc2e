"""Measure ranged-GET throughput against a local SeaweedFS for several block sizes.

This is how the default block size (tiering.blocks.DEFAULT_BLOCK_SIZE) was chosen: it reads one
object with the engine's own fetch path (S3ObjectStore.get_range, N in flight) once per block size
and prints MiB/s. Run: .venv/bin/python -m benchmarks.blocksize [--size-mib 512] [--parallel 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support.s3servers import SeaweedS3  # noqa: E402
from benchmarks.common import raw_parallel_get  # noqa: E402

MiB = 1024 * 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--parallel", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    size = args.size_mib * MiB
    with SeaweedS3() as server:
        os.environ.update(server.env())
        server.make_bucket("bench")
        server.put("bench", "obj", os.urandom(size))
        print(f"object {args.size_mib} MiB, {args.parallel} GETs in flight, median of {args.repeat}")
        for block_mib in (0.25, 1, 2, 4, 8, 16):
            block = int(block_mib * MiB)
            rates = sorted(asyncio.run(raw_parallel_get(server, "bench", "", ["obj"], block, args.parallel))
                           for _ in range(args.repeat))
            print(f"  block {block_mib:>5} MiB: {rates[len(rates) // 2]:8.1f} MiB/s")


if __name__ == "__main__":
    main()
