"""The lean SigV4 query signer gives, byte for byte, the URL botocore's ``S3SigV4QueryAuth`` gives.

Both sign the same URL at the same instant (botocore's clock is pinned) with the same credentials,
for keys that exercise the quoting rules (spaces, ``+``, ``=``, ``~``, non-ASCII, ``%``), with and
without a session token, on a port and on a default port. SeaweedFS checks real signatures in
tests/integration/test_s3_presigned_get.py; this pins the two signers to each other.
"""

from __future__ import annotations

import datetime

import botocore.auth
import pytest
from botocore.auth import S3SigV4QueryAuth
from botocore.awsrequest import AWSRequest
from botocore.credentials import ReadOnlyCredentials
from botocore.utils import percent_encode

from tiering.objectstore.s3presign import KEY_SAFE_CHARS, SigningKeys, sigv4_query, url_host

NOW = datetime.datetime(2026, 11, 25, 19, 40, 1)
KEYS = ["plain.bin", "dir/with space+plus=eq~tilde.bin", "dïr/ünï€ode", "100%/a&b?c#d", "a//b/"]


@pytest.mark.parametrize("token", [None, "FwoGZXIvYXdzE+/token=="])
@pytest.mark.parametrize("base", ["http://127.0.0.1:8333/bucket/", "https://bucket.s3.eu-west-3.amazonaws.com/"])
def test_the_same_url_as_botocore(monkeypatch: pytest.MonkeyPatch, token: str | None, base: str) -> None:
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: NOW)
    credentials = ReadOnlyCredentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    keys = SigningKeys()
    for key in KEYS:
        url = base + percent_encode(key, safe=KEY_SAFE_CHARS)
        request = AWSRequest(method="GET", url=url)
        S3SigV4QueryAuth(credentials, "s3", "eu-west-3", expires=900).add_auth(request)
        expected = request.prepare().url
        got = sigv4_query(url, url_host(url), credentials, "eu-west-3", "s3", 900,
                          NOW.replace(tzinfo=datetime.timezone.utc), keys)
        assert got == expected


def test_the_host_header_drops_default_ports_only() -> None:
    assert url_host("https://Bucket.S3.amazonaws.com:443/k") == "bucket.s3.amazonaws.com"
    assert url_host("http://127.0.0.1:80/b/k") == "127.0.0.1"
    assert url_host("http://127.0.0.1:8333/b/k") == "127.0.0.1:8333"
    assert url_host("http://[::1]:8333/b/k") == "[::1]:8333"


def test_one_second_shares_its_query_but_not_across_credentials_or_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-second parts are reused only for the same credentials and second: a rotated key or
    token, or the next second, signs as botocore does for them (never with the previous ones)."""
    keys = SigningKeys()
    url = "http://127.0.0.1:8333/bucket/" + percent_encode("k.bin", safe=KEY_SAFE_CHARS)
    first = ReadOnlyCredentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", "token-1")
    later = NOW + datetime.timedelta(seconds=1)
    for credentials, now in [(first, NOW),
                             (first, later),  # each case differs from the one before in one thing
                             (ReadOnlyCredentials("AKIDEXAMPLE", "another-secret", "token-1"), later),
                             (ReadOnlyCredentials("AKIDEXAMPLE", "another-secret", "token-2"), later),
                             (ReadOnlyCredentials("AKIDOTHER", "another-secret", "token-2"), later),
                             (ReadOnlyCredentials("AKIDOTHER", "another-secret", "token-2"), later + datetime.timedelta(days=1))]:
        monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda now=now: now)
        request = AWSRequest(method="GET", url=url)
        S3SigV4QueryAuth(credentials, "s3", "eu-west-3", expires=900).add_auth(request)
        got = sigv4_query(url, url_host(url), credentials, "eu-west-3", "s3", 900,
                          now.replace(tzinfo=datetime.timezone.utc), keys)
        assert got == request.prepare().url
