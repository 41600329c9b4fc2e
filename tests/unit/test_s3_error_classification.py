"""``classify_error``: every failure of an S3 call becomes a ``tiering.errors`` type, by type and code.

Synthetic exceptions of the kinds botocore, aiohttp and s3fs raise; the live cases (wrong secret,
missing bucket, closed port) are in ``tests/integration/test_s3_errors.py``.
"""

from __future__ import annotations

import errno

import aiohttp
import botocore.exceptions as bexc
import pytest

from tiering.errors import (
    AccessDeniedError,
    ObjectChangedError,
    ObjectNotFoundError,
    ObjectStoreError,
    ObjectStoreUnavailableError,
)
from tiering.objectstore.s3 import classify_error

SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


def client_error(code: str, status: int, message: str = "server text") -> bexc.ClientError:
    return bexc.ClientError(
        {"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "GetObject",
    )


def translated(error: BaseException, exc_type: type[OSError] = OSError) -> OSError:
    """What s3fs raises: an OSError whose cause is the original error."""
    out = exc_type(errno.EIO, "translated")
    out.__cause__ = error
    return out


CASES = [
    (client_error("NoSuchBucket", 404), ObjectNotFoundError, "bucket 'bkt' does not exist"),
    (client_error("NoSuchKey", 404), ObjectNotFoundError, "not found"),
    (client_error("404", 404), ObjectNotFoundError, "not found"),
    (translated(client_error("NoSuchKey", 404), FileNotFoundError), ObjectNotFoundError, "not found"),
    (client_error("PreconditionFailed", 412), ObjectChangedError, "changed"),
    (client_error("AccessDenied", 403), AccessDeniedError, "AccessDenied"),
    (client_error("SignatureDoesNotMatch", 403, f"StringToSign {SECRET}"), AccessDeniedError, "SignatureDoesNotMatch"),
    (client_error("InvalidAccessKeyId", 403), AccessDeniedError, "InvalidAccessKeyId"),
    (client_error("403", 403), AccessDeniedError, "denied"),
    (translated(client_error("ExpiredToken", 400), PermissionError), AccessDeniedError, "ExpiredToken"),
    (client_error("SlowDown", 503), ObjectStoreUnavailableError, "SlowDown"),
    (client_error("InternalError", 500), ObjectStoreUnavailableError, "HTTP 500"),
    (client_error("WeirdCode", 400), ObjectStoreError, "WeirdCode"),
    (bexc.EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), ObjectStoreUnavailableError, "cannot reach endpoint"),
    (bexc.ConnectTimeoutError(endpoint_url="http://127.0.0.1:1"), ObjectStoreUnavailableError, "cannot reach endpoint"),
    (bexc.ReadTimeoutError(endpoint_url="http://127.0.0.1:1"), ObjectStoreUnavailableError, "did not answer"),
    (aiohttp.ServerDisconnectedError(), ObjectStoreUnavailableError, "cannot reach endpoint"),
    (aiohttp.ClientPayloadError("cut"), ObjectStoreUnavailableError, "cannot reach endpoint"),
    (TimeoutError(), ObjectStoreUnavailableError, "did not answer"),
    (OSError(errno.ECONNREFUSED, "refused"), ObjectStoreUnavailableError, "ECONNREFUSED"),
    (bexc.NoCredentialsError(), AccessDeniedError, "credentials"),
    (bexc.PartialCredentialsError(provider="env", cred_var="AWS_SECRET_ACCESS_KEY"), AccessDeniedError, "credentials"),
    (bexc.ProfileNotFound(profile="nope"), AccessDeniedError, "credentials"),
    (RuntimeError(SECRET), ObjectStoreError, "RuntimeError"),
]


@pytest.mark.parametrize(("error", "expected", "words"), CASES, ids=[type(c[0]).__name__ + "-" + c[2] for c in CASES])
def test_classification(error: BaseException, expected: type[ObjectStoreError], words: str) -> None:
    out = classify_error(error, op="GET", where="s3://bkt/k", bucket="bkt", endpoint="http://127.0.0.1:9")
    assert type(out) is expected
    assert words in str(out)
    assert "\n" not in str(out)
    assert SECRET not in str(out)  # server text and exception text are never copied into messages


def web_page_error(status: int, headers: dict[str, str]) -> bexc.ClientError:
    """What botocore raises for an answer without an S3 error document (the code is the bare status)."""
    return bexc.ClientError({"Error": {"Code": str(status), "Message": "Not Found"},
                             "ResponseMetadata": {"RequestId": "", "HTTPStatusCode": status, "HTTPHeaders": headers}},
                            "ListObjectsV2")


def test_an_endpoint_that_answers_http_but_not_s3_is_named_as_such() -> None:
    """Issue 37, item 3: a web server on a wrong port answers a LIST with an HTML 404; that used to read
    "not found", like a typo in the prefix. The live case is in tests/integration/test_s3_errors.py."""
    page = web_page_error(404, {"server": "SimpleHTTP/0.6", "content-type": "text/html;charset=utf-8"})
    out = classify_error(page, op="LIST", where="s3://data/ds/", bucket="data", endpoint="http://127.0.0.1:9")
    assert type(out) is ObjectStoreError
    assert str(out) == ("LIST s3://data/ds/: http://127.0.0.1:9 does not speak S3 (it answered HTTP 404 without an "
                        "S3 error document): check the endpoint URL and its port")
    # An S3 server's bare 404 (a HEAD has no body; any S3 answer carries x-amz-* headers) stays "not found".
    head = classify_error(page, op="HEAD", where="s3://data/k", bucket="data", endpoint="http://127.0.0.1:9")
    s3 = web_page_error(404, {"x-amz-request-id": "1", "content-type": "text/plain"})
    for out in (head, classify_error(s3, op="GET", where="s3://data/k", bucket="data", endpoint="http://127.0.0.1:9")):
        assert type(out) is ObjectNotFoundError
