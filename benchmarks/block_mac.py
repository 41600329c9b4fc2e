"""CPU-seconds per GiB of the block checksum (CRC-32) against a keyed BLAKE2b over the data.

This is the measurement behind the decision in ``tiering.private`` not to authenticate block files
with a key kept in the cache directory: every block read from or written to the disk tier is checked
in full on the busiest path, so a MAC over the data is paid per byte read. (A MAC over the header
alone would not help: the header's data checksum is a CRC, which anyone can match with chosen data.)
Run: .venv/bin/python -m benchmarks.block_mac [--block-mib 4] [--gib 1]
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tiering.checksum import crc32  # noqa: E402

MiB = 1024 * 1024


def cpu_s_per_gib(fn, block: bytes, gib: float) -> float:
    rounds = max(1, int(gib * 1024 * MiB / len(block)))
    start = time.process_time()
    for _ in range(rounds):
        fn(block)
    return (time.process_time() - start) / (rounds * len(block) / (1024 * MiB))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--block-mib", type=float, default=4)
    parser.add_argument("--gib", type=float, default=1)
    args = parser.parse_args()
    block = os.urandom(int(args.block_mib * MiB))
    key = os.urandom(32)
    candidates = {
        "crc32 (tiering.checksum)": crc32,
        "blake2b(key=32 B), 32 B digest": lambda b: hashlib.blake2b(b, key=key, digest_size=32).digest(),
        "blake2s(key=32 B)": lambda b: hashlib.blake2s(b, key=key).digest(),
        "hmac-sha256 (OpenSSL one-shot)": lambda b: hmac.digest(key, b, "sha256"),
    }
    print(f"{args.block_mib:g} MiB blocks, {args.gib:g} GiB each, CPU-seconds per GiB (one thread)")
    for name, fn in candidates.items():
        print(f"  {name:34s} {cpu_s_per_gib(fn, block, args.gib):6.3f}")


if __name__ == "__main__":
    main()
