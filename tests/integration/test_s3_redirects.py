"""No credentials follow an HTTP redirect to another origin (issue 28).

An "endpoint" on 127.0.0.1 answers every request with ``307 Location: <another 127.0.0.1 port>``;
the other port records what reaches it. The store holds temporary credentials (a session token), and
each kind of request is tried: the start-up check (ListObjectsV2), HEAD, and a ranged GET (first on a
presigned URL, then through botocore). a115150 followed the 307 through aiobotocore and sent the
signed headers, ``X-Amz-Security-Token`` among them, to the other port.
"""

from __future__ import annotations

import pytest
from aiohttp import web

from tiering.errors import ObjectStoreError
from tiering.objectstore import S3ObjectStore

pytestmark = pytest.mark.timeout(60)

TOKEN = "SESSION-TOKEN-THAT-MUST-NOT-LEAK"


async def serve(handler) -> tuple[web.AppRunner, int]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, port


async def test_a_307_to_another_origin_is_never_followed_with_credentials() -> None:
    seen: list[dict[str, str]] = []

    async def elsewhere(request: web.Request) -> web.Response:
        seen.append(dict(request.headers) | {"query": request.query_string})
        return web.Response(status=200, body=b"x" * 10)

    other, other_port = await serve(elsewhere)

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(f"http://127.0.0.1:{other_port}{request.path_qs}")

    endpoint, port = await serve(redirect)
    environ = {"AWS_ACCESS_KEY_ID": "AKIDEXAMPLE", "AWS_SECRET_ACCESS_KEY": "secret", "AWS_SESSION_TOKEN": TOKEN,
               "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    store = S3ObjectStore("bucket", "p/", endpoint_url=f"http://127.0.0.1:{port}", connect_timeout_s=2,
                          read_timeout_s=5, environ=environ)
    raised: list[BaseException | None] = []
    try:
        for call in (store.check(), store.head("obj.bin"), store.get_range("obj.bin", '"etag"', 0, 10),
                     store.get_range("obj.bin", '"etag"', 0, 10)):
            try:
                await call
                raised.append(None)
            except Exception as exc:  # noqa: BLE001 - checked below, after what reached the other port
                raised.append(exc)
    finally:
        await store.close()
        await endpoint.cleanup()
        await other.cleanup()
    assert not any(TOKEN in str(headers) for headers in seen)
    assert seen == []  # nothing at all went to the other origin
    # A redirect is a failed request, classified like any other: one line, no traceback for the user.
    assert all(isinstance(exc, ObjectStoreError) for exc in raised), raised
