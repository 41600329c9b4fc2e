"""What the benchmarks share: the raw parallel ranged-GET limit, measured with the engine's own fetch path."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

from tests.support.s3servers import SeaweedS3
from tiering.objectstore.s3 import S3ObjectStore
from tiering.settings import DEFAULT_MAX_CONCURRENT_FETCHES

MiB = 1024 * 1024


async def raw_parallel_get(
    server: SeaweedS3,
    bucket: str,
    prefix: str,
    keys: Iterable[str],
    block: int,
    parallel: int = DEFAULT_MAX_CONCURRENT_FETCHES,
) -> float:
    """MiB/s of fetching every object once in ``block``-sized ranged GETs, ``parallel`` in flight.

    The bytes are discarded: this is the limit a cold read or a prefetch can at best reach.
    """
    store = S3ObjectStore(bucket, prefix, endpoint_url=server.endpoint_url, connect_timeout_s=5,
                          read_timeout_s=60, max_pool_connections=parallel * 2, environ=server.env())
    try:
        infos = [await store.head(key) for key in keys]
        slots = asyncio.Semaphore(parallel)

        async def one(key: str, etag: str, start: int, end: int) -> int:
            async with slots:
                return len(await store.get_range(key, etag, start, end))

        ranges = [(info.key, info.etag, start, min(start + block, info.size))
                  for info in infos for start in range(0, info.size, block)]
        begin = time.perf_counter()
        total = sum(await asyncio.gather(*(one(*r) for r in ranges)))
        elapsed = time.perf_counter() - begin
    finally:
        await store.close()
    assert total == sum(info.size for info in infos)
    return total / elapsed / MiB
