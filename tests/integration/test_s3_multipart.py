"""Multipart uploads: a caller's deadline holds when one is cut short, and user metadata travels with them.

The store stops answering in the middle of a multipart upload (a ``LoopbackProxy`` in front of
SeaweedFS freezes when the second part is read): the caller's ``asyncio.timeout`` cancels the put, and
the error must reach it then. The abort of the multipart upload is a courtesy against a store that
does not answer (up to ``ABORT_TIMEOUT_S``): it runs in the background, and ``close`` waits for it,
bounded. Before, the cancelled put awaited it first, so write durability's documented close deadline
(15 s + size at 8 MiB/s) was overrun by 10 s for files above the 16 MiB part size (issue 38, finding 6).
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from tests.fuse.writeback_support import LoopbackProxy
from tests.support.s3servers import SeaweedS3
from tiering.objectstore import S3ObjectStore
from tiering.objectstore.s3 import ABORT_TIMEOUT_S, DEFAULT_PART_SIZE

DEADLINE_S = 3.0


async def test_a_cancelled_multipart_upload_fails_at_the_callers_deadline(seaweed: SeaweedS3,
                                                                           seaweed_bucket: str) -> None:
    proxy = LoopbackProxy(int(seaweed.endpoint_url.rsplit(":", 1)[1]))
    store = S3ObjectStore(seaweed_bucket, "mp/", endpoint_url=proxy.endpoint_url, connect_timeout_s=2,
                          read_timeout_s=30, environ=seaweed.env())
    size = 2 * DEFAULT_PART_SIZE + 1
    data = os.urandom(size)

    def read(start: int, end: int) -> bytes:
        if start >= DEFAULT_PART_SIZE:
            proxy.freeze()  # the upload is created and a part is on its way: the store goes silent
        return data[start:end]

    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(DEADLINE_S):
                await store.put("big.bin", size, read)
        elapsed = time.monotonic() - started
        # The error came at the deadline (plus scheduling), not after an abort of up to ABORT_TIMEOUT_S.
        assert elapsed < DEADLINE_S + ABORT_TIMEOUT_S / 2, f"the put failed after {elapsed:.1f} s"
    finally:
        closing = time.monotonic()
        await store.close()  # waits for the background abort, bounded
        assert time.monotonic() - closing < ABORT_TIMEOUT_S + 5
        proxy.close()


@pytest.mark.parametrize("size", [1000, 2 * DEFAULT_PART_SIZE + 7], ids=["single-put", "multipart"])
async def test_user_metadata_of_a_conditional_put_comes_back_from_head(seaweed: SeaweedS3, seaweed_bucket: str,
                                                                       size: int) -> None:
    """The writer's upload tag (write durability cluster) is user metadata on PutObject or on
    CreateMultipartUpload; SeaweedFS returns it on HEAD (names in lower case), and CopyObject keeps it."""
    store = S3ObjectStore(seaweed_bucket, "meta/", endpoint_url=seaweed.endpoint_url, connect_timeout_s=2,
                          read_timeout_s=30, environ=seaweed.env())
    data = os.urandom(size)
    tag = {"cachefs-writer": "writeback/v/n/i/", "cachefs-seq": "42"}
    try:
        put = await store.put_if("tagged.bin", size, lambda s, e: data[s:e], metadata=tag)
        info, metadata = await store.head_metadata("tagged.bin")
        assert info.etag == put.etag and metadata == tag
        copied = await store.copy("tagged.bin", put.etag, "copied.bin")
        assert (await store.head_metadata("copied.bin"))[1] == tag and copied.size == size
        await store.put("plain.bin", 3, lambda s, e: b"abc"[s:e])
        assert (await store.head_metadata("plain.bin"))[1] == {}
    finally:
        await store.close()
