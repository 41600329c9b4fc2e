"""Ranged GETs on presigned URLs (``S3ObjectStore._presigned_get``), against a real SeaweedFS.

The fast path must return exactly what botocore would, hand every answer it cannot read back to
botocore (so errors stay classified as before), and never let the URL (signature, key ID) reach a
log line or an error.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

import pytest

from tests.support.s3servers import SeaweedS3
from tiering.handoff import AfterReceive
from tiering.errors import AccessDeniedError, ObjectChangedError, ObjectNotFoundError
from tiering.objectstore import S3ObjectStore
from tiering.objectstore import s3 as s3_module
from tiering.objectstore.s3session import proxied

pytestmark = [pytest.mark.s3, pytest.mark.timeout(60)]

DATA = os.urandom(300_000)


def make_store(server: SeaweedS3, bucket: str, environ: dict[str, str] | None = None) -> S3ObjectStore:
    return S3ObjectStore(bucket, "p/", endpoint_url=server.endpoint_url, connect_timeout_s=2,
                         read_timeout_s=5, environ=server.env() if environ is None else environ)


def tamper(url: str) -> str:
    """The same URL with a wrong signature: the server must refuse it (403)."""
    head, sep, signature = url.rpartition("X-Amz-Signature=")
    assert sep, "a SigV4 presigned URL ends with its signature"
    return head + sep + ("0" if signature[0] != "0" else "1") + signature[1:]


async def test_ranges_come_from_presigned_urls(seaweed: SeaweedS3, seaweed_bucket: str) -> None:
    seaweed.put(seaweed_bucket, "p/obj.bin", DATA)
    store = make_store(seaweed, seaweed_bucket)
    try:
        etag = (await store.head("obj.bin")).etag
        ranges = [(0, 1), (0, len(DATA)), (4096, 70_000), (len(DATA) - 10, len(DATA))]
        for start, end in ranges:
            assert await store.get_range("obj.bin", etag, start, end) == DATA[start:end]
        assert await store.get_range("obj.bin", etag, len(DATA) + 5, len(DATA) + 10) == b""
        assert store.stats.presigned_gets == len(ranges)
        assert store.stats.presigned_fallbacks == 0
        assert store.stats.get_requests == len(ranges) + 1
        assert store.stats.bytes_read == sum(end - start for start, end in ranges)

        seaweed.put(seaweed_bucket, "p/obj.bin", DATA[::-1])  # a new version: 412 on the old ETag
        with pytest.raises(ObjectChangedError, match="obj.bin"):
            await store.get_range("obj.bin", etag, 0, 10)
    finally:
        await store.close()


async def test_the_receiving_worker_runs_after_only_on_bytes_it_returns(
        seaweed: SeaweedS3, seaweed_bucket: str) -> None:
    """``after`` (tiering.handoff) is claimed and run by the GET engine's thread (a small range:
    libcurl's) for an answer returned from the fast path; a fallback through botocore or a changed
    object leaves it to the caller."""
    seaweed.put(seaweed_bucket, "p/obj.bin", DATA)
    store = make_store(seaweed, seaweed_bucket)
    ran: list[tuple[str, bytes]] = []

    def work(data: object) -> int:
        ran.append((threading.current_thread().name, bytes(data)))  # type: ignore[call-overload]
        return len(ran)

    try:
        etag = (await store.head("obj.bin")).etag
        after = AfterReceive(work)
        assert await store.get_range("obj.bin", etag, 10, 5000, after=after) == DATA[10:5000]
        assert after.claimed and await after.result() == 1
        assert ran[0][0] == "cachefs-curl" and ran[0][1] == DATA[10:5000]

        url, until = store._presigned["obj.bin"]
        store._presigned["obj.bin"] = (tamper(url), until)  # refused: botocore repeats the GET
        refused = AfterReceive(work)
        assert await store.get_range("obj.bin", etag, 0, 100, after=refused) == DATA[:100]
        assert store.stats.presigned_fallbacks == 1 and not refused.claimed

        seaweed.put(seaweed_bucket, "p/obj.bin", DATA[::-1])
        changed = AfterReceive(work)
        with pytest.raises(ObjectChangedError):
            await store.get_range("obj.bin", etag, 0, 10, after=changed)
        assert not changed.claimed and len(ran) == 1
    finally:
        await store.close()


async def test_small_ranges_go_to_libcurl_and_large_ones_to_the_threads(
        seaweed: SeaweedS3, seaweed_bucket: str) -> None:
    """A small file's block through libcurl's thread, a block of ``CURL_MAX_BYTES`` or more through
    ``RangedGetter``'s (one copy per byte, the GIL released while it arrives): both exact."""
    from tiering.objectstore.curlget import CURL_MAX_BYTES

    big = os.urandom(CURL_MAX_BYTES + 4096)
    seaweed.put(seaweed_bucket, "p/big.bin", big)
    store = make_store(seaweed, seaweed_bucket)
    ran: list[str] = []

    def work(data: object) -> None:
        ran.append(threading.current_thread().name)

    try:
        etag = (await store.head("big.bin")).etag
        for start, end in ((0, CURL_MAX_BYTES - 1), (1, CURL_MAX_BYTES + 1), (0, len(big))):
            after = AfterReceive(work)
            assert await store.get_range("big.bin", etag, start, end, after=after) == big[start:end]
            await after.result()
        assert [name.split("_")[0] for name in ran] == ["cachefs-curl", "cachefs-get", "cachefs-get"]
        assert store.stats.presigned_gets == 3 and store.stats.presigned_fallbacks == 0
    finally:
        await store.close()


# Keys whose quoting in the URL path differs from the plain name: the URLs signed without the
# client (every key after the first) must be accepted exactly like the client's own.
AWKWARD_KEYS = ["first.bin", "dir/sub dir/a+b=c.bin", "tilde~and%percent", "ünïcødé/ñ.jpg", "x/.hidden", "q?&#.bin"]


async def test_urls_signed_without_the_client_are_accepted(seaweed: SeaweedS3, seaweed_bucket: str) -> None:
    for i, key in enumerate(AWKWARD_KEYS):
        seaweed.put(seaweed_bucket, "p/" + key, DATA[i:i + 1000])
    store = make_store(seaweed, seaweed_bucket)
    try:
        for i, key in enumerate(AWKWARD_KEYS):
            info = await store.head(key)
            assert await store.get_range(key, info.etag, 0, 1000) == DATA[i:i + 1000]
        assert store.stats.presigned_gets == len(AWKWARD_KEYS)
        assert store.stats.presigned_fallbacks == 0
        assert store._signer is not None and store._signer.direct == len(AWKWARD_KEYS) - 1
    finally:
        await store.close()


async def test_urls_after_the_first_are_signed_in_the_get_worker(
        seaweed: SeaweedS3, seaweed_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Signing a URL is a hash and an HMAC per file: done by the GET engine's thread as it sends the
    request (libcurl's, for these small ranges), not on the event loop that answers FUSE (issue 35)."""
    from tiering.objectstore import s3presign

    for i, key in enumerate(AWKWARD_KEYS):
        seaweed.put(seaweed_bucket, "p/" + key, DATA[i:i + 1000])
    signed_in: list[str] = []
    real = s3presign.sigv4_query

    def recording(*args: object, **kwargs: object) -> str:
        signed_in.append(threading.current_thread().name)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(s3presign, "sigv4_query", recording)
    store = make_store(seaweed, seaweed_bucket)
    try:
        for i, key in enumerate(AWKWARD_KEYS):
            info = await store.head(key)
            assert await store.get_range(key, info.etag, 0, 1000) == DATA[i:i + 1000]
        assert store.stats.presigned_gets == len(AWKWARD_KEYS) and store.stats.presigned_fallbacks == 0
    finally:
        await store.close()
    assert len(signed_in) == len(AWKWARD_KEYS) - 1  # the first is the client's
    assert all(name == "cachefs-curl" for name in signed_in), signed_in


def test_fast_timestamp_matches_botocore() -> None:
    from botocore.utils import parse_timestamp

    from tiering.objectstore.s3presign import fast_timestamp

    for text in ["2026-11-24T02:38:25.123Z", "2026-11-24T02:38:25Z", "2026-11-24T02:38:25.000+00:00",
                 "Tue, 24 Nov 2026 02:38:25 GMT", "2026-11-24T02:38:25", 1764000000, "1764000000"]:
        assert fast_timestamp(text) == parse_timestamp(text), text


async def test_a_refused_url_is_retried_through_botocore_and_never_logged(
        seaweed: SeaweedS3, seaweed_bucket: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    seaweed.put(seaweed_bucket, "p/obj.bin", DATA)
    env = seaweed.env()
    store = make_store(seaweed, seaweed_bucket, env)
    try:
        etag = (await store.head("obj.bin")).etag
        assert await store.get_range("obj.bin", etag, 0, 100) == DATA[:100]
        url, until = store._presigned["p/obj.bin".removeprefix("p/")]
        store._presigned["obj.bin"] = (tamper(url), until)
        assert await store.get_range("obj.bin", etag, 100, 200) == DATA[100:200]
        assert store.stats.presigned_fallbacks == 1
        assert store.stats.presigned_gets == 1
        # The refused URL was dropped: the next GET presigns again and takes the fast path.
        assert await store.get_range("obj.bin", etag, 200, 300) == DATA[200:300]
        assert store.stats.presigned_gets == 2
        with pytest.raises(ObjectNotFoundError) as missing:
            await store.get_range("gone.bin", etag, 0, 10)  # 404 goes to botocore, classified there
        assert "gone.bin" in str(missing.value)
    finally:
        await store.close()
    # Our own log lines (botocore's DEBUG output is silenced by the daemon, cachefs/cli/mount.py).
    ours = [r.getMessage() for r in caplog.records if r.name.startswith(("tiering", "cachefs"))]
    assert any("presigned GET" in line for line in ours), "the fallback is logged (without the URL)"
    text = "\n".join(ours) + str(missing.value)
    assert "X-Amz-Signature" not in text and "X-Amz-Credential" not in text
    assert env["AWS_SECRET_ACCESS_KEY"] not in text and env["AWS_ACCESS_KEY_ID"] not in text


async def test_a_store_that_keeps_refusing_urls_stops_presigning(
        seaweed: SeaweedS3, seaweed_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seaweed.put(seaweed_bucket, "p/obj.bin", DATA)
    store = make_store(seaweed, seaweed_bucket)
    try:
        etag = (await store.head("obj.bin")).etag
        signer = await store._url_signer()
        real, real_later = signer.sign, signer.sign_later

        async def refused(full_key: str) -> str:
            return tamper(await real(full_key))

        async def refused_later(full_key: str) -> Callable[[], str] | None:
            later = await real_later(full_key)
            return None if later is None else lambda: tamper(later())

        monkeypatch.setattr(signer, "sign", refused)
        monkeypatch.setattr(signer, "sign_later", refused_later)
        for i in range(s3_module.PRESIGN_MAX_FALLBACKS + 5):
            assert await store.get_range("obj.bin", etag, i, i + 50) == DATA[i:i + 50]
        assert store.stats.presigned_fallbacks == s3_module.PRESIGN_MAX_FALLBACKS
        assert store.stats.presigned_gets == 0
    finally:
        await store.close()


async def test_without_credentials_gets_go_through_botocore(seaweed: SeaweedS3, seaweed_bucket: str) -> None:
    seaweed.put(seaweed_bucket, "p/obj.bin", DATA)
    env = {k: v for k, v in seaweed.env().items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    store = make_store(seaweed, seaweed_bucket, env)
    try:
        with pytest.raises(AccessDeniedError):
            await store.get_range("obj.bin", '"0"', 0, 10)
        assert store.stats.presigned_gets == 0
    finally:
        await store.close()


def test_proxy_detection(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy",
                 "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    assert not proxied("https://bucket.s3.amazonaws.com/k?X-Amz-Signature=1")
    monkeypatch.setenv("https_proxy", "http://127.0.0.1:9")
    assert proxied("https://bucket.s3.amazonaws.com/k")
    assert not proxied("http://127.0.0.1:8333/k")  # only https is proxied
    monkeypatch.setenv("no_proxy", "amazonaws.com")
    assert not proxied("https://bucket.s3.amazonaws.com/k")
