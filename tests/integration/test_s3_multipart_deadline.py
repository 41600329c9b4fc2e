"""A multipart upload cut short by its caller's deadline fails at that deadline, not after the abort.

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
