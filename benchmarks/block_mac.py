"""CPU-seconds per GiB of the block checksum (CRC-32) against the MACs a block could carry.

Two decisions rest on it. ``tiering.private``: block files of the disk tier are not authenticated with
a key kept in the cache directory (every block read is checked in full on the busiest path, so a MAC
over the data is paid per byte read; a MAC over the header alone would not help, the header's data
checksum being a CRC anyone can match with chosen data). ``tiering.clusterkey``: the cluster tier's
frames carry keyed BLAKE3, the cheapest MAC measured, and ``--frames`` adds the frame code as used
(check and write, a copy included) for both of its formats.
Run: .venv/bin/python -m benchmarks.block_mac [--block-mib 4] [--gib 1] [--frames]
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import sys
import time

import blake3

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tiering.checksum import crc32  # noqa: E402
from tiering.clusterkey import ClusterKey  # noqa: E402
from tiering.tiers.clusterframe import MAGIC, MAGIC_HMAC, FrameKeys, decode_frame, encode_frame  # noqa: E402

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
    parser.add_argument("--frames", action="store_true", help="also the cluster frame's check and write")
    args = parser.parse_args()
    block = os.urandom(int(args.block_mib * MiB))
    key = os.urandom(32)
    candidates = {
        "crc32 (tiering.checksum)": crc32,
        "blake2b(key=32 B), 32 B digest": lambda b: hashlib.blake2b(b, key=key, digest_size=32).digest(),
        "blake2s(key=32 B)": lambda b: hashlib.blake2s(b, key=key).digest(),
        "hmac-sha256 (OpenSSL one-shot)": lambda b: hmac.digest(key, b, "sha256"),
        "blake3(key=32 B), one thread": lambda b: blake3.blake3(b, key=key, max_threads=1).digest(),
    }
    if args.frames:
        keys = FrameKeys.of(ClusterKey(os.urandom(32)))
        token = b"s3://bucket/\x008388608\x00key\x00etag\x000"
        for magic, name in ((MAGIC, "keyed BLAKE3"), (MAGIC_HMAC, "HMAC-SHA256")):
            blob = encode_frame(keys, token, block, magic=magic)
            candidates[f"frame check, {name}"] = lambda b, blob=blob: decode_frame(keys, blob, token)
            candidates[f"frame write, {name}"] = lambda b, magic=magic: encode_frame(keys, token, b, magic=magic)
    print(f"{args.block_mib:g} MiB blocks, {args.gib:g} GiB each, CPU-seconds per GiB (one thread)")
    for name, fn in candidates.items():
        print(f"  {name:34s} {cpu_s_per_gib(fn, block, args.gib):6.3f}")


if __name__ == "__main__":
    main()
