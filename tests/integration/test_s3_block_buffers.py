"""Block buffers used again (``tiering.buffers.BufferPool``) never serve the wrong bytes.

A cold read of an object many times the RAM tier, through ``BlockCache`` on the S3 store against
SeaweedFS, with blocks large enough to be pooled mappings: every block fetched after the RAM tier is
full lands in a mapping an evicted block left, so a reuse while some view was still alive would show
up as another block's bytes here. Each range is checked against the source, and read again while an
older block's view is still held, which must keep that block's mapping out of the pool.
"""

from __future__ import annotations

import os

from tests.support.s3servers import SeaweedS3
from tiering.engine.blockcache import BlockCache
from tiering.blocks import ObjectRef
from tiering.objectstore import S3ObjectStore
from tiering.buffers import MAP_MIN_BYTES
from tiering.tiers.ram import RamTier
from tiering.settings import CacheSettings

BLOCK = MAP_MIN_BYTES  # the smallest pooled size: blocks are mappings, and the test stays small
BLOCKS = 24
DATA = os.urandom(BLOCK * BLOCKS - 12345)  # a short last block: a size of its own


async def test_reused_buffers_serve_their_own_block_only(seaweed: SeaweedS3, seaweed_bucket: str) -> None:
    seaweed.put(seaweed_bucket, "b/big.bin", DATA)
    store = S3ObjectStore(seaweed_bucket, "b/", endpoint_url=seaweed.endpoint_url, connect_timeout_s=2,
                          read_timeout_s=10, environ=seaweed.env())
    cache = BlockCache(CacheSettings(block_size=BLOCK), store, RamTier(3 * BLOCK))
    try:
        info = await store.head("big.bin")
        ref = ObjectRef(info.key, info.etag, info.size)
        held = await cache.read(ref, 0, 1000)  # a view of block 0, kept while the rest is read
        for offset in range(0, len(DATA), BLOCK // 2):
            got = await cache.read(ref, offset, BLOCK // 2, readahead_bytes=2 * BLOCK)
            assert bytes(got) == DATA[offset : offset + BLOCK // 2]
        assert bytes(held) == DATA[:1000]  # its mapping was never handed out again
        pool = store._gets.for_length(BLOCK).buffers
        assert pool.reused > 0  # the point of the pool: evicted blocks' mappings came back
        for offset in range(0, len(DATA), 3 * BLOCK + 17):  # and once more, every block refetched
            assert bytes(await cache.read(ref, offset, 5000)) == DATA[offset : offset + 5000]
    finally:
        await cache.close()
        await store.close()
