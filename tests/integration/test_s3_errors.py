"""How ``S3ObjectStore`` reports failures, against a real SeaweedFS (which checks signatures).

Each failure must arrive quickly (bounded connect/read timeouts and attempts; no test asserts a
time, the pytest timeout below catches a hang) as the right ``tiering.errors`` type, with a one-line
message that never contains the secret key, anywhere in the chained exceptions either.
"""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
import traceback
from typing import Iterator

import pytest

from tests.conftest import unique_bucket_name
from tests.support.s3servers import SeaweedS3
from tiering.errors import (
    AccessDeniedError,
    ObjectChangedError,
    ObjectNotFoundError,
    ObjectStoreError,
    ObjectStoreUnavailableError,
)
from tiering.objectstore import S3ObjectStore, open_object_store

pytestmark = [pytest.mark.s3, pytest.mark.timeout(60)]

# Short timeouts: everything here is on loopback, and the unreachable/hung cases should fail fast.
CONNECT_TIMEOUT_S = 1.0
READ_TIMEOUT_S = 1.0


def make_store(server: SeaweedS3, bucket: str, *, environ: dict[str, str] | None = None,
               endpoint_url: str | None = None, prefix: str = "") -> S3ObjectStore:
    return S3ObjectStore(
        bucket, prefix,
        endpoint_url=endpoint_url or server.endpoint_url,
        connect_timeout_s=CONNECT_TIMEOUT_S,
        read_timeout_s=READ_TIMEOUT_S,
        environ=server.env() if environ is None else environ,
    )


def assert_clean(exc: BaseException, *secrets: str) -> None:
    """One line, and no secret in the message or anywhere in the formatted chain."""
    message = str(exc)
    assert message and "\n" not in message
    formatted = "".join(traceback.format_exception(exc))
    for secret in secrets:
        assert secret not in message
        assert secret not in formatted


@pytest.fixture
def closed_port() -> int:
    """A port on 127.0.0.1 with nothing listening (bound then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port on 127.0.0.1 that accepts connections and never answers (a hung server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield s.getsockname()[1]


async def test_check_passes_with_good_credentials(seaweed: SeaweedS3, seaweed_bucket: str) -> None:
    store = make_store(seaweed, seaweed_bucket)
    try:
        await store.check()
    finally:
        await store.close()


async def test_missing_bucket_is_not_found(seaweed: SeaweedS3) -> None:
    bucket = unique_bucket_name("absent")
    store = make_store(seaweed, bucket)
    try:
        with pytest.raises(ObjectNotFoundError) as info:
            await store.check()
        assert f"bucket {bucket!r} does not exist" in str(info.value)
        assert_clean(info.value, seaweed.secret_key)
    finally:
        await store.close()


async def test_wrong_secret_is_access_denied(seaweed: SeaweedS3, seaweed_bucket: str) -> None:
    seaweed.put(seaweed_bucket, "k", b"v")
    wrong = "WRONG" + seaweed.secret_key[5:]
    store = make_store(seaweed, seaweed_bucket, environ={**seaweed.env(), "AWS_SECRET_ACCESS_KEY": wrong})
    try:
        with pytest.raises(AccessDeniedError) as info:
            await store.check()
        assert "SignatureDoesNotMatch" in str(info.value)
        assert_clean(info.value, seaweed.secret_key, wrong)
        # Every method goes through the same classification.
        with pytest.raises(AccessDeniedError) as info:
            await store.list_dir("")
        assert_clean(info.value, seaweed.secret_key, wrong)
        with pytest.raises(AccessDeniedError) as info:
            await store.head("k")
        assert_clean(info.value, seaweed.secret_key, wrong)
        with pytest.raises(AccessDeniedError) as info:
            await store.get_range("k", '"whatever"', 0, 1)
        assert_clean(info.value, seaweed.secret_key, wrong)
        assert store.stats.errors == 4
    finally:
        await store.close()


async def test_unknown_access_key_is_access_denied(seaweed: SeaweedS3, seaweed_bucket: str) -> None:
    env = {**seaweed.env(), "AWS_ACCESS_KEY_ID": "AKNOBODY0000000000"}
    store = make_store(seaweed, seaweed_bucket, environ=env)
    try:
        with pytest.raises(AccessDeniedError) as info:
            await store.check()
        assert_clean(info.value, seaweed.secret_key)
    finally:
        await store.close()


async def test_no_credentials_at_all_is_access_denied(seaweed: SeaweedS3, seaweed_bucket: str) -> None:
    env = {k: v for k, v in seaweed.env().items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    store = make_store(seaweed, seaweed_bucket, environ=env)
    try:
        with pytest.raises(AccessDeniedError) as info:
            await store.check()
        assert "credentials" in str(info.value)
    finally:
        await store.close()


async def test_unreachable_endpoint_is_unavailable(seaweed: SeaweedS3, closed_port: int) -> None:
    endpoint = f"http://127.0.0.1:{closed_port}"
    store = make_store(seaweed, "some-bucket", endpoint_url=endpoint)
    try:
        with pytest.raises(ObjectStoreUnavailableError) as info:
            await store.check()
        assert f"cannot reach endpoint {endpoint}" in str(info.value)
        assert_clean(info.value, seaweed.secret_key)
        with pytest.raises(ObjectStoreUnavailableError):
            await store.get_range("k", '"e"', 0, 10)
    finally:
        await store.close()


async def test_hung_endpoint_times_out_as_unavailable(seaweed: SeaweedS3, silent_port: int) -> None:
    endpoint = f"http://127.0.0.1:{silent_port}"
    store = make_store(seaweed, "some-bucket", endpoint_url=endpoint)
    try:
        with pytest.raises(ObjectStoreUnavailableError) as info:
            await store.check()
        assert endpoint in str(info.value)
        assert_clean(info.value, seaweed.secret_key)
    finally:
        await store.close()


async def test_store_from_process_environment(seaweed: SeaweedS3, seaweed_bucket: str, aws_env) -> None:
    """The CLI passes os.environ: the standard chain must find credentials there too."""
    aws_env(seaweed)
    seaweed.put(seaweed_bucket, "data/obj", b"hello")
    store = open_object_store(
        f"s3://{seaweed_bucket}/data", endpoint_url=seaweed.endpoint_url,
        connect_timeout_s=CONNECT_TIMEOUT_S, read_timeout_s=READ_TIMEOUT_S, environ=os.environ,
    )
    try:
        await store.check()
        info = await store.head("obj")
        assert await store.get_range("obj", info.etag, 0, 5) == b"hello"
    finally:
        await store.close()


async def test_server_stopped_mid_read_then_back(tmp_path) -> None:
    """A store outlives a server restart: reads fail as unavailable while it is down, then resume."""
    with SeaweedS3() as server:
        bucket = unique_bucket_name("restart")
        server.make_bucket(bucket)
        data = os.urandom(1 << 20)
        server.put(bucket, "obj", data)
        store = make_store(server, bucket)
        try:
            etag = (await store.head("obj")).etag
            assert await store.get_range("obj", etag, 0, 1000) == data[:1000]
            server.stop_keep_data()
            with pytest.raises(ObjectStoreUnavailableError) as info:
                await store.get_range("obj", etag, 1000, 2000)
            assert_clean(info.value, server.secret_key)
            server.start()
            assert await store.get_range("obj", etag, 1000, 2000) == data[1000:2000]
            server.put(bucket, "obj", os.urandom(1 << 20))
            with pytest.raises(ObjectChangedError):
                await store.get_range("obj", etag, 0, 10)
        finally:
            await store.close()


def test_errors_are_object_store_errors() -> None:
    for cls in (AccessDeniedError, ObjectNotFoundError, ObjectStoreUnavailableError, ObjectChangedError):
        assert issubclass(cls, ObjectStoreError)


class _WebPages(http.server.BaseHTTPRequestHandler):
    """A plain web server: an HTML 404 for every path but ``/data``, which gets an HTML 200."""

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        found = self.path.split("?")[0].rstrip("/") == "/data"
        body = b"<html><body>%s</body></html>" % (b"hello" if found else b"Not Found")
        self.send_response(200 if found else 404)
        self.send_header("Content-Type", "text/html;charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def web_server() -> Iterator[str]:
    """A plain HTTP server (not S3) on 127.0.0.1: what a wrong port often answers with."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _WebPages)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join(10)
        server.server_close()


@pytest.mark.parametrize("bucket", ["ds-missing", "data"], ids=["html-404", "html-200"])
async def test_an_endpoint_that_answers_http_but_not_s3_says_so(seaweed: SeaweedS3, web_server: str,
                                                              bucket: str) -> None:
    """Issue 37, item 3: a LIST answered by a web page is "does not speak S3", not "not found" (which
    reads like a typo in the prefix) and not an empty prefix."""
    store = make_store(seaweed, bucket, endpoint_url=web_server, prefix="ds/")
    try:
        with pytest.raises(ObjectStoreError) as info:
            await store.check()
        assert not isinstance(info.value, ObjectNotFoundError)
        assert f"{web_server} does not speak S3" in str(info.value) and "check the endpoint URL" in str(info.value)
        assert_clean(info.value, seaweed.secret_key)
    finally:
        await store.close()


def test_a_mount_on_an_endpoint_that_is_not_s3_says_so_in_one_line(seaweed: SeaweedS3, web_server: str,
                                                                   tmp_path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    result = subprocess.run([sys.executable, "-m", "cachefs", "mount", "s3://ds-missing/ds", str(mnt), "--read-only",
                             "--cache-dir", str(tmp_path / "cache"), "--endpoint-url", web_server],
                            capture_output=True, text=True, timeout=50, env={**os.environ, **seaweed.env()})
    assert result.returncode == 1, result
    assert result.stderr.count("\n") == 1 and "does not speak S3" in result.stderr, result.stderr
    assert "not found" not in result.stderr
