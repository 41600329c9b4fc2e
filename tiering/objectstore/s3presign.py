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

The signature of the later keys is computed here (``sigv4_query``), not by botocore's
``S3SigV4QueryAuth``: that one rebuilds the request, parses its own query string back and derives the
signing key (four HMACs) for every URL, ~0.13 ms per key, which a cold small file paid on the event
loop (27% of the loop's GIL samples in a cold read of 100 KiB files, ``benchmarks/dataplane.py``).
The canonical request is the one botocore builds for a presigned S3 GET (the key path as quoted in
the URL, the ``X-Amz-*`` parameters sorted, ``host`` the only signed header, ``UNSIGNED-PAYLOAD``),
and the signing key is derived once per day, region, service and secret. Everything but the key's
path is the same for every URL signed in one second (the ``X-Amz-*`` parameters, their sorted
canonical form, the scope), so it is built once per second and credentials (``SigningKeys.query_parts``):
a URL then costs one SHA-256 and one HMAC: ``UrlSigner.sign`` 7 us per key against 37 us when each
URL built its own query and parsed its own path back (measured on the 2-core VM, issue 35). A unit test pins the URL, byte for byte, to the one
``S3SigV4QueryAuth`` gives for the same instant, keys and token, also across rotated credentials
and the next second.

``fast_timestamp`` is botocore's timestamp parser for responses with a fast path for ISO 8601
(``LastModified`` in listings): dateutil, botocore's default, costs ~77 us per timestamp, which a
listing of 10,000 files pays 10,000 times.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

from botocore.utils import parse_timestamp, percent_encode, percent_encode_sequence

# botocore quotes an S3 key in the URL path with these characters left as they are.
KEY_SAFE_CHARS = "/~"
SIGV4_TIMESTAMP = "%Y%m%dT%H%M%SZ"  # botocore's X-Amz-Date format
_DEFAULT_PORTS = {"http": 80, "https": 443}


def url_host(url: str) -> str:
    """The ``host`` header SigV4 signs for ``url``: lower-case host, its port unless the default."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"  # an IPv6 literal
    if parts.port is not None and parts.port != _DEFAULT_PORTS.get(parts.scheme):
        host = f"{host}:{parts.port}"
    return host


class SigningKeys:
    """SigV4 signing keys, derived once per (secret, day, region, service) and kept for the last few;
    and the parts of a presigned query that every key signed in the same second shares."""

    def __init__(self) -> None:
        self._keys: dict[tuple[str, str, str, str], bytes] = {}
        self._second: tuple[tuple[object, ...], _QueryParts] | None = None

    def get(self, secret: str, day: str, region: str, service: str) -> bytes:
        which = (secret, day, region, service)
        keys = self._keys  # read once: another thread may replace it meanwhile
        key = keys.get(which)
        if key is None:
            key = ("AWS4" + secret).encode("utf-8")
            for part in (day, region, service, "aws4_request"):
                key = hmac.new(key, part.encode("utf-8"), hashlib.sha256).digest()
            # A new day or rotated credentials: the old ones are done. Replaced whole, not cleared, so
            # a thread reading the old dict never sees it change under it.
            self._keys = {**keys, which: key} if len(keys) < 4 else {which: key}
        return key

    def query_parts(self, credentials: Any, now: datetime.datetime, region: str, service: str,
                    expires_s: int) -> "_QueryParts":
        """The query, canonical query, scope and signing key of URLs signed in the second of ``now``:
        the same for every key, so built once per second, not once per URL (the last second's are
        kept: a shuffled epoch signs hundreds of URLs a second)."""
        which = (credentials.access_key, credentials.secret_key, credentials.token,
                 now.replace(microsecond=0), region, service, expires_s)
        second = self._second  # read once: another thread may replace it meanwhile
        if second is not None and second[0] == which:
            return second[1]
        timestamp = now.strftime(SIGV4_TIMESTAMP)
        day = timestamp[:8]
        scope = f"{day}/{region}/{service}/aws4_request"
        params = {
            "X-Amz-Algorithm": "AWS4-HMAC-SHA256",
            "X-Amz-Credential": f"{credentials.access_key}/{scope}",
            "X-Amz-Date": timestamp,
            "X-Amz-Expires": expires_s,
            "X-Amz-SignedHeaders": "host",
        }
        if credentials.token is not None:
            params["X-Amz-Security-Token"] = credentials.token
        query = percent_encode_sequence(params)
        canonical_query = "&".join("=".join(kv) for kv in sorted(tuple(p.split("=", 1)) for p in query.split("&")))
        parts = _QueryParts(query, canonical_query, f"AWS4-HMAC-SHA256\n{timestamp}\n{scope}\n",
                            self.get(credentials.secret_key, day, region, service))
        self._second = (which, parts)
        return parts


@dataclass(frozen=True)
class _QueryParts:
    query: str  # the X-Amz-* parameters as they appear in the URL
    canonical_query: str  # the same, sorted, as the canonical request has them
    to_sign_head: str  # the string to sign up to the canonical request's hash
    key: bytes  # the signing key of the day


def sigv4_query(url: str, host: str, credentials: Any, region: str, service: str, expires_s: int,
                now: datetime.datetime, keys: SigningKeys) -> str:
    """``url`` (no query, path already quoted) presigned for GET, as ``S3SigV4QueryAuth`` signs it."""
    parts = keys.query_parts(credentials, now, region, service, expires_s)
    path = url[url.find("/", url.find("//") + 2):]  # the URL has no query: what follows the authority
    canonical = f"GET\n{path}\n{parts.canonical_query}\nhost:{host}\n\nhost\nUNSIGNED-PAYLOAD"
    to_sign = parts.to_sign_head + hashlib.sha256(canonical.encode("utf-8")).hexdigest()
    # hmac.new, not the one-shot hmac.digest: that one releases the GIL around OpenSSL's HMAC (3.11),
    # and on the event loop a release costs a wait for the GIL to come back from the worker threads
    # (measured with 6 threads hashing: 20 us of wall time per call against 4 us).
    signature = hmac.new(parts.key, to_sign.encode("utf-8"), hashlib.sha256).hexdigest()
    return f"{url}?{parts.query}&X-Amz-Signature={signature}"


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
        self._host = ""
        self._keys = SigningKeys()
        self.direct = 0  # URLs signed here, not by the client (tests, benchmarks)

    async def sign_later(self, full_key: str) -> Callable[[], str] | None:
        """What signs the GET URL of ``full_key`` when called, in any thread (a GET worker: off the
        event loop), once the URL's shape is learned; None before that (``sign`` then). The
        credentials are taken now, on the loop (botocore refreshes them there); the URL is signed for
        the moment it is called. ``SigningKeys`` is shared by the threads that call these: its caches
        are replaced whole, never updated in place, so a race costs a second derivation, never a
        wrong key."""
        if self._base is None or self.credentials is None:
            return None
        frozen = await self.credentials.get_frozen_credentials()
        base, host, region, service = self._base, self._host, self._region, self._service
        expires_s, keys = self.expires_s, self._keys
        self.direct += 1

        def signed() -> str:
            return sigv4_query(base + percent_encode(full_key, safe=KEY_SAFE_CHARS), host, frozen, region, service,
                               expires_s, datetime.datetime.now(datetime.timezone.utc), keys)
        return signed

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
        url = sigv4_query(self._base + percent_encode(full_key, safe=KEY_SAFE_CHARS), self._host, frozen,
                          self._region, self._service, self.expires_s,
                          datetime.datetime.now(datetime.timezone.utc), self._keys)
        self.direct += 1
        return url

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
        self._host = url_host(url)
