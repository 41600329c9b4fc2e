"""How a failed S3 call becomes a ``tiering.errors`` type: by exception type and S3 error code, never
by the text of a message (split from ``tiering.objectstore.s3``, which raises what ``classify_error``
returns).

Messages carry only the operation, the object, the bucket, the endpoint, the S3 error code and the
HTTP status: never the server's message text, request details or credentials. An error answer that
did not come from an S3 server at all (a web page from a wrong port) is named as such
(``not_s3_answer``), not read as "not found".
"""

from __future__ import annotations

import asyncio
import errno

import aiohttp
import botocore.exceptions as bexc

from tiering.errors import (
    AccessDeniedError,
    ObjectChangedError,
    ObjectNotFoundError,
    ObjectStoreError,
    ObjectStoreUnavailableError,
)

# S3 error codes, grouped by what they mean to a reader.
NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
_NO_BUCKET_CODES = frozenset({"NoSuchBucket"})
_DENIED_CODES = frozenset({
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
    "TokenRefreshRequired", "AllAccessDisabled", "AccountProblem", "InvalidSecurity",
    "AuthorizationHeaderMalformed", "RequestTimeTooSkewed", "403", "Forbidden", "401",
})
_CHANGED_CODES = frozenset({"PreconditionFailed", "412"})
_UNAVAILABLE_CODES = frozenset({
    "SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling",
    "ThrottlingException", "RequestLimitExceeded", "BadGateway", "GatewayTimeout",
})
INVALID_RANGE_CODES = frozenset({"InvalidRange", "416"})
_UNAVAILABLE_ERRNOS = frozenset({
    errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EHOSTUNREACH,
    errno.ENETUNREACH, errno.ENETDOWN, errno.EHOSTDOWN, errno.EPIPE,
})
# botocore: any failure to get an answer (connection refused, DNS, TLS, timeouts, dropped streams).
_UNAVAILABLE_TYPES: tuple[type[BaseException], ...] = (
    bexc.ConnectionError,  # EndpointConnectionError, ConnectTimeoutError, SSLError, ProxyConnectionError
    bexc.HTTPClientError,  # ReadTimeoutError, ConnectionClosedError, ResponseStreamingError
    bexc.IncompleteReadError,
    aiohttp.ClientError,
    asyncio.TimeoutError,
    TimeoutError,
)
_CREDENTIAL_TYPES: tuple[type[BaseException], ...] = (
    bexc.NoCredentialsError,
    bexc.PartialCredentialsError,
    bexc.CredentialRetrievalError,
    bexc.ProfileNotFound,
    bexc.UnknownCredentialError,
)


def chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes (s3fs re-raises ClientErrors as OSErrors with the original as cause)."""
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in out and len(out) < 10:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def client_error_code(exc: BaseException) -> tuple[str, int] | None:
    """``(code, http_status)`` of the first botocore ClientError in the chain, if any."""
    for e in chain(exc):
        if isinstance(e, bexc.ClientError):
            response = e.response or {}
            code = str(response.get("Error", {}).get("Code", ""))
            status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            return code, status
    return None


def not_s3_answer(exc: BaseException) -> int | None:
    """The HTTP status of an error answer that did not come from an S3 server, else None: botocore
    found no S3 error code in it (none, or the bare status), it carries no ``x-amz-*``
    header, and a content type that is not XML. Every S3 implementation (AWS, MinIO, SeaweedFS, Ceph, moto) answers a failed
    request with an XML error document; a web server on a wrong port answers with an HTML page. Only
    meaningful for requests whose errors have a body (not HEAD)."""
    for e in chain(exc):
        if isinstance(e, bexc.ClientError):
            response = e.response or {}
            code = str(response.get("Error", {}).get("Code", ""))
            meta = response.get("ResponseMetadata", {})
            headers = {str(k).lower(): str(v) for k, v in (meta.get("HTTPHeaders") or {}).items()}
            status = int(meta.get("HTTPStatusCode") or 0)
            if (code and not code.isdigit()) or any(name.startswith("x-amz-") for name in headers):
                return None
            kind = headers.get("content-type", "")
            if not kind or "xml" in kind or meta.get("RequestId"):
                return None
            return status
    return None


def not_s3_error(op: str, where: str, endpoint: str, answer: str) -> ObjectStoreError:
    return ObjectStoreError(f"{op} {where}: {endpoint} does not speak S3 ({answer}): check the endpoint URL "
                            f"and its port")


def changed_error(where: str) -> ObjectChangedError:
    return ObjectChangedError(f"{where} changed on the server (its ETag no longer matches)")


def classify_error(exc: BaseException, *, op: str, where: str, bucket: str, endpoint: str) -> ObjectStoreError:
    """Map any failure of an S3 call to a ``tiering.errors`` type, by exception type and error code.

    ``op`` names the operation (``"GET"``), ``where`` the object (``"s3://b/k"``). Messages carry
    only these, the bucket, the endpoint, the S3 error code and the HTTP status: never the server's
    message text, request details or credentials.
    """
    if isinstance(exc, ObjectStoreError):
        return exc
    coded = client_error_code(exc)
    if coded is not None and op != "HEAD" and (plain := not_s3_answer(exc)) is not None:
        return not_s3_error(op, where, endpoint, f"it answered HTTP {plain} without an S3 error document")
    if coded is not None:
        code, status = coded
        detail = f"{code or 'error'} (HTTP {status})" if status else code or "error"
        if code in _NO_BUCKET_CODES:
            return ObjectNotFoundError(f"bucket {bucket!r} does not exist at {endpoint}")
        if code in _CHANGED_CODES or status == 412:
            return changed_error(where)
        if code in NOT_FOUND_CODES or status == 404:
            return ObjectNotFoundError(f"{op} {where}: not found")
        if code in _DENIED_CODES or status in (401, 403):
            return AccessDeniedError(f"{op} {where}: access denied: {detail}")
        if code in _UNAVAILABLE_CODES or status >= 500 or status == 429:
            return ObjectStoreUnavailableError(f"{op} {where}: {endpoint} unavailable: {detail}")
        return ObjectStoreError(f"{op} {where}: S3 error {detail}")
    for e in chain(exc):
        if isinstance(e, _CREDENTIAL_TYPES):
            return AccessDeniedError(
                f"{op} {where}: no usable AWS credentials ({type(e).__name__}); "
                "set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE"
            )
        if isinstance(e, (bexc.ReadTimeoutError, asyncio.TimeoutError, TimeoutError)):
            return ObjectStoreUnavailableError(f"{op} {where}: endpoint {endpoint} did not answer in time")
        if isinstance(e, _UNAVAILABLE_TYPES):
            return ObjectStoreUnavailableError(f"{op} {where}: cannot reach endpoint {endpoint} ({type(e).__name__})")
    for e in chain(exc):
        if isinstance(e, OSError) and e.errno is not None:
            if e.errno == errno.ENOENT:
                return ObjectNotFoundError(f"{op} {where}: not found")
            if e.errno in (errno.EACCES, errno.EPERM):
                return AccessDeniedError(f"{op} {where}: access denied")
            if e.errno in _UNAVAILABLE_ERRNOS:
                return ObjectStoreUnavailableError(f"{op} {where}: cannot reach endpoint {endpoint} "
                                                   f"({errno.errorcode.get(e.errno, e.errno)})")
    return ObjectStoreError(f"{op} {where}: unexpected {type(exc).__name__}")
