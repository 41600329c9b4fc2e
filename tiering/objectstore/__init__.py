"""Object stores: the source of truth behind the cache, and how a source URL picks one.

``s3://bucket[/prefix]``  -> ``S3ObjectStore`` (s3fs/aiobotocore on the caller's event loop)
``file:///abs/path``      -> ``LocalObjectStore`` (a local disk or NFS mount)
``gs://``, ``az://``, ``hf://``, ``http(s)://``, ``memory://``
                          -> ``FsspecObjectStore`` (read-only; the protocols whose filesystem gives
                             each object a version identity: ``fsspec_sources``)

``InMemoryObjectStore`` and ``FailingObjectStore`` are the doubles for tests and the demo.

``parse_source`` is pure and strict: a URL that could mean two things, or that we would have to
"fix" (a relative path, ``//`` in a prefix, a query string, a bucket name S3 would refuse), is
refused with a one-line message naming the problem, never silently corrected. Keys in an S3 URL are
taken literally, not percent-decoded, as the AWS CLI does.

``S3ObjectStore`` and ``FsspecObjectStore`` are imported lazily (module ``__getattr__``), so code that
only needs the in-memory or local store does not pay for importing s3fs, aiobotocore, botocore or
fsspec; the S3 path never goes through ``FsspecObjectStore``.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping
from urllib.parse import urlsplit

from tiering.objectstore.fsspec_sources import FSSPEC_PROTOCOLS, FSSPEC_SCHEMES, parse_fsspec_url, refusal
from tiering.objectstore.keys import MAX_KEY_BYTES, key_room
from tiering.objectstore.local import LocalObjectStore
from tiering.objectstore.memory import FailingObjectStore, InMemoryObjectStore
from tiering.protocols import ObjectStore

if TYPE_CHECKING:
    from tiering.objectstore.fsspec_store import FsspecObjectStore
    from tiering.objectstore.s3 import S3ObjectStore

__all__ = [
    "FailingObjectStore",
    "FsspecObjectStore",
    "InMemoryObjectStore",
    "LocalObjectStore",
    "S3ObjectStore",
    "Source",
    "SUPPORTED_SCHEMES",
    "open_object_store",
    "CHECK_TIMEOUT_S",
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_READ_TIMEOUT_S",
    "parse_source",
    "read_only_source_problem",
]

# S3 client timeouts, the one definition for the mount, the CSI controller and the store's own
# defaults (here, not in s3.py, so that reading them does not import botocore). A loopback or
# in-region endpoint accepts a connection in milliseconds: one not established in 5 s is not coming.
# A 4 MiB block arrives in well under a second: a socket read that stalls for 30 s is treated as
# dead, which tolerates a server under heavy load before the attempt is abandoned and retried.
DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_READ_TIMEOUT_S = 30.0
# One whole ``check()`` (a mount's start-up, a CSI CreateVolume) is bounded too: the client's retries
# of the timeouts above add up, and the caller must get an answer well under 30 s (the CSI
# provisioner's own deadline is 60 s in deploy/).
CHECK_TIMEOUT_S = 20.0

SUPPORTED_SCHEMES = ("s3", "file", *FSSPEC_SCHEMES)

# S3 bucket naming rules (general purpose buckets): 3-63 characters of lowercase letters, digits,
# dots and hyphens, beginning and ending with a letter or digit, no two adjacent dots, not an IP.
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


@dataclass(frozen=True, slots=True)
class Source:
    """A parsed source URL. ``prefix`` has no leading ``/`` and is ``""`` or ends in ``/``.

    For ``file`` sources ``bucket`` is ``""`` and ``prefix`` is the absolute path without its leading
    slash (``file:///data/train`` -> ``"data/train/"``); ``path`` gives it back as a ``Path``. For the
    fsspec sources ``bucket`` is what precedes the prefix (``fsspec_sources.parse_fsspec_url``).
    """

    scheme: str
    bucket: str
    prefix: str

    @property
    def path(self) -> Path:
        return Path("/" + self.prefix)

    @property
    def url(self) -> str:
        """The canonical form of the URL."""
        if self.scheme == "file":
            return "file:///" + self.prefix
        return f"{self.scheme}://{self.bucket}/{self.prefix}"

    @property
    def writable(self) -> bool:
        """Whether cachefs can write back to this source (the fsspec sources are read-only)."""
        return self.scheme in ("s3", "file")


def _bucket_problem(bucket: str) -> str | None:
    if not bucket:
        return "has no bucket name"
    if not 3 <= len(bucket) <= 63:
        return f"bucket name {bucket!r} must be 3 to 63 characters long"
    if not _BUCKET_RE.fullmatch(bucket):
        return (f"bucket name {bucket!r} is invalid (lowercase letters, digits, dots and hyphens only, "
                "beginning and ending with a letter or digit)")
    if ".." in bucket:
        return f"bucket name {bucket!r} must not contain two adjacent dots"
    try:
        ipaddress.IPv4Address(bucket)
    except ValueError:
        return None
    return f"bucket name {bucket!r} must not be formatted as an IP address"


def _normalise_prefix(path: str, what: str) -> str:
    """``/a/b`` or ``/a/b/`` -> ``a/b/``; ``""`` or ``/`` -> ``""``; refuses empty, ``.``, ``..`` parts."""
    body = path[1:] if path.startswith("/") else path
    if body.endswith("/"):
        body = body[:-1]
    if not body:
        return ""
    for part in body.split("/"):
        if part == "":
            raise ValueError(f"{what} {path!r} has an empty path component ('//')")
        if part in (".", ".."):
            raise ValueError(f"{what} {path!r} has a {part!r} path component")
    if "\x00" in body:
        raise ValueError(f"{what} contains a NUL character")
    return body + "/"


def parse_source(url: str) -> Source:
    """Parse and validate a source URL; ``ValueError`` with a one-line message if it is not usable."""
    if not isinstance(url, str) or not url:
        raise ValueError("source URL is empty")
    if url != url.strip():
        raise ValueError("source URL has leading or trailing whitespace")
    if any(ord(ch) < 0x20 or ch == "\x7f" for ch in url):
        raise ValueError("source URL contains a control character")
    if "?" in url or "#" in url:
        raise ValueError("source URL must not have a query string or fragment ('?' or '#')")
    parts = urlsplit(url)
    scheme = parts.scheme
    if not scheme:
        raise ValueError("source URL has no scheme: use s3://bucket[/prefix] or file:///abs/path")
    if scheme not in SUPPORTED_SCHEMES:
        raise ValueError(refusal(scheme, _known_to_fsspec(scheme)))
    if scheme in FSSPEC_PROTOCOLS:
        bucket, path = parse_fsspec_url(scheme, url, parts)
        prefix = _normalise_prefix(path, f"{scheme}:// path")
        if key_room(prefix) < 1:
            raise ValueError(f"{scheme}:// path is longer than {MAX_KEY_BYTES} bytes: no room for a name below it")
        return Source(scheme, bucket, prefix)
    if scheme == "s3" and not url[len("s3:"):].startswith("//"):
        raise ValueError("s3 source URL must have the form s3://bucket[/prefix]")

    if scheme == "s3":
        if "@" in parts.netloc:
            # Never echo this part: it may hold credentials.
            raise ValueError("s3:// source URL must not contain credentials or user info ('@')")
        problem = _bucket_problem(parts.netloc)
        if problem:
            raise ValueError(f"s3:// source URL {problem}")
        prefix = _normalise_prefix(parts.path, "s3:// prefix")
        if key_room(prefix) < 1:
            raise ValueError(f"s3:// prefix is {len(prefix.encode('utf-8', 'surrogateescape'))} bytes: S3 keys are at "
                             f"most {MAX_KEY_BYTES} bytes, which leaves no room for a name below it")
        return Source("s3", parts.netloc, prefix)

    # file
    if parts.netloc:
        if "@" in parts.netloc:
            raise ValueError("file:// source URL must not have a host (use file:///abs/path)")
        raise ValueError(f"file:// source URL has a host {parts.netloc!r} (use file:///abs/path)")
    if not parts.path.startswith("/"):
        raise ValueError(f"file: source URL path {parts.path!r} is relative (use file:///abs/path)")
    return Source("file", "", _normalise_prefix(parts.path, "file:// path"))


def _known_to_fsspec(scheme: str) -> bool:
    """Whether fsspec has a filesystem for ``scheme`` (only asked to word a refusal)."""
    if not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme):
        return False
    from tiering.objectstore.fsspec_store import known_protocol

    return known_protocol(scheme)


def read_only_source_problem(url: str) -> str | None:
    """The one line refusing a writable mount of ``url``, if it is a read-only source (else None).

    A URL that does not parse gives None: ``parse_source`` reports that problem in its own words.
    """
    try:
        source = parse_source(url)
    except ValueError:
        return None
    if source.writable:
        return None
    return f"{source.scheme}:// sources are read-only in cachefs: mount with --read-only"


def open_object_store(
    url: str,
    *,
    endpoint_url: str | None,
    connect_timeout_s: float,
    read_timeout_s: float,
    environ: Mapping[str, str],
    max_pool_connections: int | None = None,
) -> ObjectStore:
    """The store for a source URL. Nothing is contacted here: call ``check()`` to verify access.

    ``environ`` is the environment the AWS credential chain reads (``AWS_ACCESS_KEY_ID``,
    ``AWS_PROFILE``, ...); credentials are never passed or logged by us.
    """
    source = parse_source(url)
    if source.scheme != "s3" and endpoint_url is not None:
        raise ValueError("an endpoint URL applies only to s3:// sources")
    if source.scheme == "file":
        return LocalObjectStore(source.path)
    if source.scheme in FSSPEC_PROTOCOLS:
        from tiering.objectstore.fsspec_store import FsspecObjectStore

        # Credentials: each protocol's own chain (environment, its config files), never arguments.
        return FsspecObjectStore(source, connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s)
    from tiering.objectstore.s3 import DEFAULT_MAX_POOL_CONNECTIONS, S3ObjectStore

    return S3ObjectStore(
        source.bucket,
        source.prefix,
        endpoint_url=endpoint_url,
        connect_timeout_s=connect_timeout_s,
        read_timeout_s=read_timeout_s,
        max_pool_connections=max_pool_connections or DEFAULT_MAX_POOL_CONNECTIONS,
        environ=environ,
    )


def __getattr__(name: str) -> Any:
    if name == "S3ObjectStore":
        from tiering.objectstore.s3 import S3ObjectStore

        return S3ObjectStore
    if name == "FsspecObjectStore":
        from tiering.objectstore.fsspec_store import FsspecObjectStore

        return FsspecObjectStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
