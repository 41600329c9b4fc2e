"""The S3 store against servers that never finish: listings without end and answers a byte a second.

A tiny misbehaving HTTP server on 127.0.0.1 (``tests/support/hostile_s3.py``) plays the store; nothing else is
needed, since what is tested is what the store does with what it is sent (issue 34):

- a ListObjectsV2 that says ``IsTruncated`` on every page, with a new continuation token each time,
  or the same one every time: the listing ends with an error naming the directory (EIO at the FUSE
  edge) after ``max_list_pages`` pages, at the first repeated token, or at ``list_deadline_s``;
- a GET answered one byte a second (the headers, or the body after them): the caller's deadline ends
  the request, its worker thread is freed at once (the server sees the connection closed), and a
  process whose deadline passed exits promptly instead of waiting on the worker forever.
"""

from __future__ import annotations

import asyncio
import errno
import subprocess
import sys
import textwrap
import time

import pytest

from tests.support.hostile_s3 import BUCKET, ENVIRON, WAIT_S, HostileS3
from tiering.errors import ObjectStoreError
from tiering.objectstore import S3ObjectStore

pytestmark = [pytest.mark.timeout(120)]

async def listing_error(server: HostileS3, **limits: float) -> ObjectStoreError:
    store = S3ObjectStore(BUCKET, "", endpoint_url=server.endpoint_url, environ=ENVIRON, **limits)  # type: ignore[arg-type]
    try:
        with pytest.raises(ObjectStoreError) as caught:
            await store.list_dir("d/")
    finally:
        await store.close()
    return caught.value


def test_a_listing_with_new_tokens_forever_ends_at_the_page_cap() -> None:
    with HostileS3("new-token") as server:
        error = asyncio.run(listing_error(server, max_list_pages=20))
    assert server.pages == 20
    assert error.errno == errno.EIO
    assert "s3://hostile/d/" in str(error) and "more than 20 pages" in str(error)


def test_a_listing_with_the_same_token_forever_ends_at_the_second_page() -> None:
    with HostileS3("same-token") as server:
        error = asyncio.run(listing_error(server))
    assert server.pages == 2
    assert error.errno == errno.EIO
    assert "s3://hostile/d/" in str(error) and "continuation token a second time" in str(error)


def test_a_listing_ends_at_its_deadline() -> None:
    with HostileS3("new-token", page_delay_s=0.2) as server:
        started = time.monotonic()
        error = asyncio.run(listing_error(server, list_deadline_s=1.0))
        took = time.monotonic() - started
    assert "s3://hostile/d/" in str(error) and "not finished after 1 s" in str(error)
    assert took < 1.0 + WAIT_S


@pytest.mark.parametrize("mode", ["trickle-headers", "trickle-body"])
def test_a_trickling_get_frees_its_worker_at_the_callers_deadline(mode: str) -> None:
    async def fetch(server: HostileS3) -> None:
        store = S3ObjectStore(BUCKET, "", endpoint_url=server.endpoint_url, environ=ENVIRON)
        try:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(1.5):  # the engine's fetch deadline
                    await store.get_range("k", '"e"', 0, 1048576)
            # Freed at once, not at the end of the answer (never) nor of a read timeout (never: a byte
            # comes every second): the server sees the connection end while the store is still open.
            assert await asyncio.to_thread(server.gone.wait, WAIT_S), "the GET worker is still reading"
        finally:
            await store.close()

    with HostileS3(mode) as server:
        asyncio.run(fetch(server))


SCRIPT = textwrap.dedent("""
    import asyncio, sys
    from tiering.objectstore import S3ObjectStore
    env = dict(arg.split("=", 1) for arg in sys.argv[2:])

    async def main():
        store = S3ObjectStore("hostile", "", endpoint_url=sys.argv[1], environ=env)
        try:
            async with asyncio.timeout(1.0):
                await store.get_range("k", '"e"', 0, 1048576)
        except TimeoutError:
            print("deadline", flush=True)
        # No close(): a daemon that stops on a signal may not get there either.

    asyncio.run(main())
""")


def test_a_process_whose_get_was_abandoned_exits_promptly() -> None:
    """The interpreter joins the GET pool's threads at exit: a worker pinned by a trickling server kept
    the daemon alive after its unmount (issue 34)."""
    with HostileS3("trickle-headers") as server:
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-c", SCRIPT, server.endpoint_url,
                               *(f"{k}={v}" for k, v in ENVIRON.items())],
                              capture_output=True, text=True, timeout=60, check=False)
        took = time.monotonic() - started
    assert done.returncode == 0 and done.stdout.strip() == "deadline", done.stderr[-2000:]
    assert took < 1.0 + WAIT_S, f"exited {took:.1f} s after start"
