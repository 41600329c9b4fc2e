"""What the benchmarks share: the raw parallel ranged-GET limit, measured with the engine's own fetch path."""

from __future__ import annotations

import asyncio
import io
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from boto3.s3.transfer import TransferConfig
from botocore.exceptions import ClientError

from benchmarks.procstat import peak_rss_mib as peak_rss_mib  # one reader of VmHWM for every benchmark
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
    return (await raw_parallel_get_cost(server, bucket, prefix, keys, block, parallel))[0]


async def raw_parallel_get_cost(
    server: SeaweedS3,
    bucket: str,
    prefix: str,
    keys: Iterable[str],
    block: int,
    parallel: int = DEFAULT_MAX_CONCURRENT_FETCHES,
) -> tuple[float, float, int]:
    """``raw_parallel_get``'s MiB/s, the CPU seconds this process spent in the timed GETs, and the bytes.

    The CPU is that of the engine's own fetch code with no file system around it: the floor of what
    a daemon serving the same bytes spends.
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
        begin, cpu = time.perf_counter(), time.process_time()
        total = sum(await asyncio.gather(*(one(*r) for r in ranges)))
        elapsed, cpu = time.perf_counter() - begin, time.process_time() - cpu
    finally:
        await store.close()
    assert total == sum(info.size for info in infos)
    return total / elapsed / MiB, cpu, total


# -- shared by the side-by-side benchmark (benchmarks/bench.py) and usable by the others ---------------

# Reads and writes go in 1 MiB calls: large enough that the per-call cost of Python is noise next to
# the copy, the same size for every tool and every limit.
IO_CHUNK = 1 * MiB
# How often a poll for an object to appear in the store looks (HEAD is cheap on loopback).
STORE_POLL_S = 0.05


def read_seconds(path: Path, chunk: int = IO_CHUNK) -> tuple[int, float]:
    """Bytes read and seconds taken by one sequential read of ``path`` in ``chunk``-sized calls.

    Reads into one preallocated buffer, so what is timed is the file system, not the allocator.
    """
    buf = bytearray(chunk)
    view = memoryview(buf)
    n = 0
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as fh:
        while got := fh.readinto(view):
            n += got
    return n, time.perf_counter() - start


def read_mib_s(path: Path) -> float:
    """MiB/s of one sequential read of ``path``."""
    n, seconds = read_seconds(path)
    return n / seconds / MiB


def write_seconds(path: Path, data: bytes, *, fsync: bool, chunk: int = IO_CHUNK) -> float:
    """Seconds to write ``data`` to ``path`` in ``chunk``-sized writes (then fsync if asked) and close it."""
    view = memoryview(data)
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for offset in range(0, len(data), chunk):
            part = view[offset:offset + chunk]
            while part:
                part = part[os.write(fd, part):]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def drop_page_cache() -> bool:
    """Write back dirty pages, then drop the page cache, dentries and inodes (root only).

    False where that is not allowed: the caller reports the figure as measured with a warm cache.
    """
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False




def raw_multipart_upload(server: SeaweedS3, bucket: str, key: str, data: bytes, *,
                         part_size: int, parallel: int) -> float:
    """Seconds for boto3 to upload ``data`` from memory as a multipart upload, ``parallel`` parts in flight.

    The limit a write-back drain can at best reach: no local disk read, no file system in between.
    """
    client = server.make_client()
    config = TransferConfig(multipart_threshold=part_size, multipart_chunksize=part_size,
                            max_concurrency=parallel, use_threads=True)
    try:
        start = time.perf_counter()
        client.upload_fileobj(io.BytesIO(data), bucket, key, Config=config)
        elapsed = time.perf_counter() - start
        size = client.head_object(Bucket=bucket, Key=key)["ContentLength"]
    finally:
        client.close()
    if size != len(data):
        raise RuntimeError(f"raw multipart upload of {key}: {size} bytes stored, {len(data)} sent")
    return elapsed


def wait_stored(client: Any, bucket: str, key: str, size: int, timeout_s: float) -> float:
    """Seconds until ``key`` is in the store with ``size`` bytes (HEAD every ``STORE_POLL_S``), bounded.

    ``TimeoutError`` after ``timeout_s``, naming what was last seen.
    """
    start = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    seen: object = "nothing"
    while True:
        try:
            seen = client.head_object(Bucket=bucket, Key=key)["ContentLength"]
            if seen == size:
                return time.perf_counter() - start
        except ClientError as exc:
            seen = exc.response.get("Error", {}).get("Code", "error")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{key} not in the store with {size} bytes after {timeout_s:g} s (last: {seen})")
        time.sleep(STORE_POLL_S)
