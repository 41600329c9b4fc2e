"""Presigned GetObject URLs for many keys at botocore's signing cost, without its per-call machinery.

``client.generate_presigned_url`` costs about 0.36 ms of CPU per key (measured on SeaweedFS over
loopback: parameter validation, endpoint-ruleset resolution and event hooks around the signature),
which a shuffled epoch of small files pays once per file. The signature itself (botocore's
``S3SigV4QueryAuth``) is less than half of that. So ``UrlSigner`` asks the client once, for the first
key, and learns from that URL where objects live (the endpoint, path or virtual-host addressing)
and the credential scope (region, service) botocore chose; every later key gets the same URL shape
signed by ``S3SigV4QueryAuth`` with the session's current credentials (refreshed by botocore as
usual). A first URL whose shape cannot be read back (a key that is not its last path part, no
SigV4 scope) keeps every key on ``generate_presigned_url``: slower, never wrong.

The URLs carry credentials: nothing here logs or formats them.

``fast_timestamp`` is botocore's timestamp parser for responses with a fast path for ISO 8601
(``LastModified`` in listings): dateutil, botocore's default, costs ~77 us per timestamp, which a
listing of 10,000 files pays 10,000 times.
"""

from __future__ import annotations

import datetime
from typing import Any
from urllib.parse import parse_qs, urlsplit

from botocore.auth import S3SigV4QueryAuth
from botocore.awsrequest import AWSRequest
from botocore.utils import parse_timestamp, percent_encode

# botocore quotes an S3 key in the URL path with these characters left as they are.
KEY_SAFE_CHARS = "/~"


def fast_timestamp(value: Any) -> datetime.datetime:
    """botocore's ``parse_timestamp``, with ``datetime.fromisoformat`` first for ISO 8601 strings."""
    if isinstance(value, str) and len(value) >= 20 and value[4] == "-" and value[10] == "T":
        try:
            parsed = datetime.datetime.fromisoformat(value)
        except ValueError:
            pass
        else:
            if parsed.tzinfo is not None:
                return parsed
    return parse_timestamp(value)


class UrlSigner:
    """Presigns GetObject URLs of one bucket for one aiobotocore client (see the module docstring)."""

    def __init__(self, client: Any, credentials: Any, bucket: str, expires_s: int) -> None:
        self.client = client
        self.credentials = credentials  # the session's (possibly refreshable) credentials, or None
        self.bucket = bucket
        self.expires_s = expires_s
        self._base: str | None = None  # the URL up to the quoted key
        self._region = ""
        self._service = ""
        self._learned = False
        self.direct = 0  # URLs signed here, not by the client (tests, benchmarks)

    async def sign(self, full_key: str) -> str:
        """A presigned GET URL for ``full_key`` (the bucket key, prefix included)."""
        if self._base is None or self.credentials is None:
            url: str = await self.client.generate_presigned_url(
                "get_object", Params={"Bucket": self.bucket, "Key": full_key}, ExpiresIn=self.expires_s)
            if not self._learned:
                self._learned = True
                self._learn(url, full_key)
            return url
        frozen = await self.credentials.get_frozen_credentials()
        request = AWSRequest(method="GET", url=self._base + percent_encode(full_key, safe=KEY_SAFE_CHARS))
        S3SigV4QueryAuth(frozen, self._service, self._region, expires=self.expires_s).add_auth(request)
        self.direct += 1
        return str(request.prepare().url)

    def _learn(self, url: str, full_key: str) -> None:
        parts = urlsplit(url)
        quoted = percent_encode(full_key, safe=KEY_SAFE_CHARS)
        if not parts.path.endswith("/" + quoted):
            return
        scope = parse_qs(parts.query).get("X-Amz-Credential", [""])[0].split("/")
        # <key id>/<date>/<region>/<service>/aws4_request
        if len(scope) != 5 or scope[4] != "aws4_request" or not scope[2] or not scope[3]:
            return
        self._region, self._service = scope[2], scope[3]
        self._base = f"{parts.scheme}://{parts.netloc}{parts.path[:len(parts.path) - len(quoted)]}"
