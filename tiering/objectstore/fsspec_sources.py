"""Which fsspec protocols can be a cachefs source, and how their URLs are parsed (pure: no fsspec here).

A protocol qualifies only if its filesystem gives every object a *version identity*: a value that
changes whenever the object's bytes change, which ``FsspecObjectStore`` reports as the object's ETag
and checks on every ranged read (so a block cached under one version is never served for another;
``tiering.blocks``). Protocols without one (FTP, SFTP, SMB, WebDAV, ...) are refused at mount with
one line naming the protocol: cachefs could not tell a changed object from the one it cached.

This module holds the table and the URL grammar of each protocol, so that ``parse_source`` (called
by the CLI's preflight, the CSI driver's checks and the settings) can validate a URL without
importing fsspec or any of its backends; ``tiering.objectstore.fsspec_store`` does the I/O.

All fsspec sources are read-only in cachefs (``writable`` below): write-back needs an atomic
replace and a copy conditional on the source's version, which fsspec does not offer uniformly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import SplitResult, unquote



@dataclass(frozen=True, slots=True)
class FsspecProtocol:
    """One fsspec protocol cachefs mounts: what implements it and where the version comes from."""

    scheme: str
    package: str | None  # the module that implements it (None: fsspec itself)
    extra: str | None  # the pip extra of cachefs-fuse that installs ``package``
    identity: str  # where the version identity comes from (README and docs)
    # How a ranged read is pinned to the version (``fsspec_store`` module docstring):
    # "if-match" (the server refuses another version), "generation" (the read names the version),
    # "verify-after" (the version is read again after the bytes, and must not have moved).
    read: str


FSSPEC_PROTOCOLS: dict[str, FsspecProtocol] = {
    p.scheme: p
    for p in (
        FsspecProtocol("gs", "gcsfs", "gcs", "object generation", "generation"),
        FsspecProtocol("az", "adlfs", "azure", "blob ETag", "verify-after"),
        FsspecProtocol("hf", "huggingface_hub", "hf", "LFS SHA-256, else the git blob id", "verify-after"),
        FsspecProtocol("http", None, None, "strong HTTP ETag header", "if-match"),
        FsspecProtocol("https", None, None, "strong HTTP ETag header", "if-match"),
        FsspecProtocol("memory", None, None, "MD5 of the content (for tests)", "verify-after"),
    )
}
FSSPEC_SCHEMES = tuple(FSSPEC_PROTOCOLS)
# Other names fsspec gives the same backends: refused with the spelling to use, so that one source
# has one URL (its cache directory and cluster-tier identity are derived from the URL).
_ALIASES = {"gcs": "gs", "abfs": "az", "abfss": "az", "huggingface": "hf"}

# GCS bucket names: 3-63 characters (222 with dots) of lowercase letters, digits, '-', '_' and '.',
# beginning and ending with a letter or digit.
_GCS_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")
# Azure container names: 3-63 lowercase letters, digits and single hyphens, beginning with a letter
# or digit.
_AZ_CONTAINER_RE = re.compile(r"[a-z0-9](?:[a-z0-9]|-(?!-)){2,62}")
# Hugging Face repo ids: owner/name of letters, digits, '-', '_' and '.'; an optional @revision
# (a branch, tag or commit, without '/': ``refs/pr/N`` revisions are not accepted here).
_HF_PART_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_HF_REVISION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_HF_KINDS = ("datasets", "spaces", "models")
# A host[:port] of an http(s) URL (a name, IPv4 or bracketed IPv6).
_HOST_RE = re.compile(r"(?:[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?")
_MEMORY_ROOT_RE = re.compile(r"[A-Za-z0-9._-]+")


def _hf_repo(parts: SplitResult) -> tuple[str, str]:
    """``hf://datasets/org/name[@rev]/path`` -> ``("datasets/org/name[@rev]", "path/")``."""
    pieces = [parts.netloc, *parts.path.split("/")[1:]]
    if pieces and pieces[-1] == "":
        pieces.pop()
    kind = pieces[0] if pieces and pieces[0] in _HF_KINDS else None
    repo = pieces[1:3] if kind else pieces[0:2]
    if len(repo) < 2 or not repo[0] or not repo[1]:
        raise ValueError("hf:// source URL must name a repository: hf://datasets/OWNER/NAME[@REVISION][/path], "
                         "hf://OWNER/NAME for a model")
    name, _, revision = repo[1].partition("@")
    if not _HF_PART_RE.fullmatch(repo[0]) or not _HF_PART_RE.fullmatch(name):
        raise ValueError(f"hf:// repository id {repo[0]}/{name!r} is invalid (letters, digits, '-', '_', '.')")
    if "@" in repo[1] and (not _HF_REVISION_RE.fullmatch(revision) or revision == "refs"):
        raise ValueError(f"hf:// revision {revision!r} is invalid (a branch, tag or commit without '/')")
    if kind == "models":  # huggingface_hub names models without a kind prefix
        kind = None
    head = "/".join([*([kind] if kind else []), repo[0], repo[1]])
    rest = pieces[3:] if pieces and pieces[0] in _HF_KINDS else pieces[2:]
    return head, "/" + "/".join(rest)


def parse_fsspec_url(scheme: str, url: str, parts: SplitResult) -> tuple[str, str]:
    """``(bucket, path)`` of an fsspec source URL; ``ValueError`` with a one-line reason.

    ``path`` is the part below ``bucket``, for the caller to normalise into a prefix as for s3://.

    ``bucket`` is what comes before the prefix in the filesystem's own paths: a GCS bucket, an Azure
    container, a Hub repository (``datasets/org/name``), an http(s) ``host[:port]``, a memory root.
    The prefix of an http(s) URL is percent-decoded (it is how the path is written in a URL); every
    other URL's path is taken literally, as for s3://.
    """
    if not url[len(scheme) + 1:].startswith("//"):
        raise ValueError(f"{scheme} source URL must have the form {scheme}://...")
    if "@" in parts.netloc:
        # Never echo this part: it may hold credentials.
        raise ValueError(f"{scheme}:// source URL must not contain credentials or user info ('@'): "
                         "credentials come from the environment or the library's own configuration")
    if scheme == "hf":
        bucket, path = _hf_repo(parts)
    elif scheme in ("http", "https"):
        if not parts.netloc or not _HOST_RE.fullmatch(parts.netloc):
            raise ValueError(f"{scheme}:// source URL has no valid host")
        if parts.path and not parts.path.endswith("/"):
            raise ValueError(f"{scheme}:// source URL must name a directory: end it with '/'")
        bucket, path = parts.netloc, unquote(parts.path, errors="strict")
    else:
        bucket = parts.netloc
        rules = {"gs": (_GCS_BUCKET_RE, "GCS bucket"), "az": (_AZ_CONTAINER_RE, "Azure container"),
                 "memory": (_MEMORY_ROOT_RE, "memory root")}
        pattern, what = rules[scheme]
        if not bucket:
            raise ValueError(f"{scheme}:// source URL has no {what} name")
        if not pattern.fullmatch(bucket):
            raise ValueError(f"{scheme}:// {what} name {bucket!r} is invalid")
        path = parts.path
    return bucket, path


def refusal(scheme: str, known_to_fsspec: bool) -> str:
    """The one line for a scheme cachefs does not mount."""
    supported = ", ".join(("s3", "file", *FSSPEC_SCHEMES))
    if scheme in _ALIASES:
        return f"source URL scheme {scheme!r}: write {_ALIASES[scheme]}:// (the one spelling cachefs accepts)"
    if known_to_fsspec:
        return (f"source protocol {scheme!r} gives no stable version identity per object (cachefs could not "
                f"tell a changed object from the one it cached): supported are {supported}")
    return f"unsupported source URL scheme {scheme!r}: supported are {supported}"
