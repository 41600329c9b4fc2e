"""No credentials follow a redirect: the HTTP session aiobotocore sends S3 requests through, with
redirects off.

aiobotocore sends every request with aiohttp's default ``allow_redirects=True``. A signed request
carries its credentials in headers (``Authorization``, and ``X-Amz-Security-Token`` for temporary
credentials), and aiohttp drops only ``Authorization`` when a redirect leaves the origin: an endpoint
answering ``307 Location: http://elsewhere/`` (a hostile or misconfigured server, or anyone on the
path of a plain-http endpoint) would receive the session token at the other origin. S3 itself never
needs an HTTP-level redirect followed: a bucket in another region answers 301/307 with
``x-amz-bucket-region``, which botocore handles itself by signing a new request for that region.
So the session built here refuses every redirect; a 3xx reaches botocore as an error response and
is classified like any other (``tiering.objectstore.s3errors.classify_error``).

The presigned ranged GETs of ``tiering.objectstore.s3`` go on their own aiohttp session with
``allow_redirects=False`` for the same reason (the URL is the credential). fsspec http(s) sources
carry no credentials (a URL with user info is refused), so their HEAD may follow redirects.

One hook, ``NO_REDIRECT_CONFIG``, merged into the client's config: the S3 store passes it to s3fs's
``config_kwargs``. tests/integration/test_s3_redirects.py checks on a real 307 that nothing reaches
the other origin.
"""

from __future__ import annotations

from typing import Any

from aiobotocore.httpsession import AIOHTTPSession


class _NoRedirects:
    """The aiohttp session aiobotocore sends through (it calls only ``request``), redirects off."""

    def __init__(self, session: Any) -> None:
        self._session = session

    def request(self, method: str, url: Any, **kwargs: Any) -> Any:
        kwargs["allow_redirects"] = False
        return self._session.request(method, url, **kwargs)


class NoRedirectHTTPSession(AIOHTTPSession):
    """aiobotocore's aiohttp session, with every request sent ``allow_redirects=False``."""

    async def _get_session(self, proxy_url: Any) -> Any:
        return _NoRedirects(await super()._get_session(proxy_url))


# What the S3 store adds to its client config (``AioConfig(**config_kwargs)``).
NO_REDIRECT_CONFIG: dict[str, Any] = {"http_session_cls": NoRedirectHTTPSession}
