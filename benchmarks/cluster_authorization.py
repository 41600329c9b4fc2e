"""Extra source requests of the cluster tier's source check, on shuffled epochs of small files.

A cluster hit is served only once the volume's own source credentials have shown they may read the
object (``tiering.engine.authorize``: a one-byte GET per object version, remembered). This counts what that
costs where it costs most: many small files (one block each), read in a shuffled order, epoch after
epoch, by a fresh node whose RAM tier is far smaller than the dataset and which has no disk tier, so
every epoch goes to the cluster tier. A first node fills the cluster store from the source. The
stores are in memory: the figures are request counts, exact, not timings.
Run: .venv/bin/python -m benchmarks.cluster_authorization [--files 1000] [--size-kib 100] [--epochs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tiering.blocks import ObjectRef  # noqa: E402
from tiering.clusterkey import ClusterKey  # noqa: E402
from tiering.engine.blockcache import BlockCache  # noqa: E402
from tiering.objectstore.memory import InMemoryObjectStore  # noqa: E402
from tiering.settings import CacheSettings  # noqa: E402
from tiering.tiers.cluster import ClusterTier  # noqa: E402
from tiering.tiers.ram import RamTier  # noqa: E402

MiB = 1024 * 1024
RAM = 4 * MiB  # far below the dataset: every epoch reaches the cluster tier
DRAIN_EVERY = 32  # files between write-behind drains while filling (a full queue drops blocks)


async def run(files: int, size: int, epochs: int, *, quiet: bool = False) -> list[dict[str, int]]:
    """Per epoch: the source's HEADs and GETs, the proofs made, and the blocks the cluster tier served."""
    source, store = InMemoryObjectStore(), InMemoryObjectStore()
    key = ClusterKey(os.urandom(32))
    refs = []
    for i in range(files):
        data = random.Random(i).randbytes(size)
        info = await source.put(f"f{i:06d}", size, lambda s, e, d=data: d[s:e])
        refs.append(ObjectRef(f"f{i:06d}", info.etag, size))
    settings = CacheSettings(block_size=MiB, ram_bytes=RAM)

    def node() -> BlockCache:
        tier = ClusterTier(store, source_id="s3://bench/", block_size=MiB, key=key, timeout_s=5)
        return BlockCache(settings, source, RamTier(RAM), cluster=tier)

    first = node()
    for i, ref in enumerate(refs):
        await first.read(ref, 0, size)
        if i % DRAIN_EVERY == DRAIN_EVERY - 1:
            assert first.write_behind is not None and await first.write_behind.drain(60)
    assert first.write_behind is not None and await first.write_behind.drain(60)
    second = node()
    if not quiet:
        print(f"{files} files of {size // 1024} KiB, shuffled, read whole by a fresh node through the cluster tier")
    out: list[dict[str, int]] = []
    for epoch in range(epochs):
        order = refs[:]
        random.Random(epoch).shuffle(order)
        heads, gets = source.stats.head_requests, source.stats.get_requests
        proofs, served = second.stats.cluster_authorizations, second.stats.cluster_served
        for ref in order:
            await second.read(ref, 0, size)
        out.append({"epoch": epoch + 1, "files": files, "source_heads": source.stats.head_requests - heads,
                    "source_gets": source.stats.get_requests - gets,
                    "proofs": second.stats.cluster_authorizations - proofs,
                    "cluster_blocks": second.stats.cluster_served - served})
        if not quiet:
            print(f"  epoch {epoch + 1}: source HEADs {out[-1]['source_heads']}, source GETs {out[-1]['source_gets']}, "
                  f"proofs {out[-1]['proofs']}, blocks from the cluster tier {out[-1]['cluster_blocks']}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--size-kib", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(run(args.files, args.size_kib * 1024, args.epochs))


if __name__ == "__main__":
    main()
