"""``parse_source``: which source URLs are accepted, how they are normalised, and why others are refused.

Every refusal is a ``ValueError`` with one line that names the problem (checked by a word that must
appear in it), and a URL carrying credentials is refused without echoing them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tiering.objectstore import (
    FsspecObjectStore,
    InMemoryObjectStore,
    LocalObjectStore,
    S3ObjectStore,
    Source,
    open_object_store,
    parse_source,
    read_only_source_problem,
)

ACCEPTED = [
    ("s3://my-bucket", Source("s3", "my-bucket", "")),
    ("s3://my-bucket/", Source("s3", "my-bucket", "")),
    ("s3://my-bucket/train", Source("s3", "my-bucket", "train/")),
    ("s3://my-bucket/train/", Source("s3", "my-bucket", "train/")),
    ("s3://my.bucket-2/a/b/c", Source("s3", "my.bucket-2", "a/b/c/")),
    ("s3://abc/with space/ü", Source("s3", "abc", "with space/ü/")),
    ("s3://abc/a%20b", Source("s3", "abc", "a%20b/")),  # taken literally, as the AWS CLI does
    ("S3://abc/x", Source("s3", "abc", "x/")),  # the scheme is case-insensitive
    ("s3://" + "a" * 63, Source("s3", "a" * 63, "")),
    ("file:///data/train", Source("file", "", "data/train/")),
    ("file:///data/train/", Source("file", "", "data/train/")),
    ("file:/data/train", Source("file", "", "data/train/")),  # RFC 8089 form without authority
    ("file:///", Source("file", "", "")),
    # fsspec sources (tiering.objectstore.fsspec_sources): read-only, each with a version identity
    ("gs://my-bucket/train", Source("gs", "my-bucket", "train/")),
    ("gs://my_bucket.v2", Source("gs", "my_bucket.v2", "")),
    ("az://container-1/a/b/", Source("az", "container-1", "a/b/")),
    ("hf://datasets/org/name", Source("hf", "datasets/org/name", "")),
    ("hf://datasets/org/name@v1.0/data/train", Source("hf", "datasets/org/name@v1.0", "data/train/")),
    ("hf://org/model-1/sub", Source("hf", "org/model-1", "sub/")),
    ("hf://models/org/model-1", Source("hf", "org/model-1", "")),
    ("https://host.example/data/", Source("https", "host.example", "data/")),
    ("http://127.0.0.1:8080/a%20b/", Source("http", "127.0.0.1:8080", "a b/")),  # http paths are decoded
    ("https://host.example", Source("https", "host.example", "")),
    ("memory://root/ds", Source("memory", "root", "ds/")),
]

REFUSED = [
    # (url, a word the message must contain)
    ("", "empty"),
    ("my-bucket/train", "no scheme"),
    ("/data/train", "no scheme"),
    ("gs://B/x", "bucket name 'B'"),
    ("gs://", "no GCS bucket"),
    ("az://a--b/x", "container name"),
    ("hf://datasets/org", "must name a repository"),
    ("hf://datasets/org/na me", "repository id"),
    ("hf://org/name@refs/pr/1", "revision"),
    ("http://host/bucket", "end it with '/'"),
    ("https://host/a//b/", "empty path component"),
    ("https://host/a/../b/", "'..'"),
    ("https://host/x/?a=1", "query"),
    ("https://", "no valid host"),
    ("memory://", "no memory root"),
    ("ftp://host/x", "'ftp' gives no stable version identity"),
    ("sftp://host/x", "'sftp'"),
    ("gcs://bucket/x", "write gs://"),
    ("abfs://container/x", "write az://"),
    ("webdav://host/x", "'webdav'"),
    ("nosuchproto://host/x", "unsupported source URL scheme 'nosuchproto'"),
    ("s3:bucket/x", "s3://bucket"),
    ("s3://", "no bucket"),
    ("s3:///prefix", "no bucket"),
    ("s3://ab", "3 to 63"),
    ("s3://" + "a" * 64, "3 to 63"),
    ("s3://My-Bucket", "invalid"),
    ("s3://my_bucket", "invalid"),
    ("s3://-bucket", "invalid"),
    ("s3://bucket-", "invalid"),
    ("s3://bucket:9000/x", "invalid"),
    ("s3://a..b", "adjacent dots"),
    ("s3://192.168.10.1", "IP address"),
    ("s3://bucket//x", "empty path component"),
    ("s3://bucket/a//b", "empty path component"),
    ("s3://bucket/./a", "'.'"),
    ("s3://bucket/a/../b", "'..'"),
    ("s3://bucket/a/..", "'..'"),
    ("s3://bucket/x?versionId=3", "query"),
    ("s3://bucket/x?", "query"),
    ("s3://bucket/x#frag", "fragment"),
    ("file://host/data", "host"),
    ("file://localhost/data", "host"),
    ("file:data/train", "relative"),
    ("file:///data//train", "empty path component"),
    ("file:///data/../etc", "'..'"),
    ("file:///data?x=1", "query"),
    (" s3://bucket", "whitespace"),
    ("s3://bucket/x\n", "whitespace"),
    ("s3://bucket/a\tb", "control character"),
]


@pytest.mark.parametrize(("url", "expected"), ACCEPTED, ids=[u or "empty" for u, _ in ACCEPTED])
def test_accepted(url: str, expected: Source) -> None:
    source = parse_source(url)
    assert source == expected
    assert source.prefix == "" or (source.prefix.endswith("/") and not source.prefix.startswith("/"))
    assert parse_source(source.url) == source  # the canonical form parses to the same source


@pytest.mark.parametrize(("url", "word"), REFUSED, ids=[u or "empty" for u, _ in REFUSED])
def test_refused_with_a_message_naming_the_problem(url: str, word: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_source(url)
    message = str(info.value)
    assert word.lower() in message.lower(), message
    assert "\n" not in message


@pytest.mark.parametrize("url", ["s3://AKIDEXAMPLE:wJalrXUtnFEMI@bucket/x", "file://user:hunter2@/data",
                                 "https://user:hunter2@host/data/", "gs://AKIDEXAMPLE:hunter2@bucket/x",
                                 "az://AKIDEXAMPLE@container/x"])
def test_credentials_in_the_url_are_refused_without_echoing_them(url: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_source(url)
    message = str(info.value)
    for secret in ("AKIDEXAMPLE", "wJalrXUtnFEMI", "hunter2"):
        assert secret not in message


def test_file_source_path() -> None:
    assert parse_source("file:///data/train").path == Path("/data/train")
    assert parse_source("file:///").path == Path("/")


def test_open_object_store_picks_the_implementation(tmp_path: Path) -> None:
    common = dict(endpoint_url=None, connect_timeout_s=1.0, read_timeout_s=1.0, environ={})
    local = open_object_store(f"file://{tmp_path}", **common)
    assert isinstance(local, LocalObjectStore) and local.root == tmp_path
    s3 = open_object_store("s3://my-bucket/a/b", **common)
    assert isinstance(s3, S3ObjectStore) and (s3.bucket, s3.prefix) == ("my-bucket", "a/b/")
    assert not isinstance(s3, InMemoryObjectStore)
    web = open_object_store("https://host.example/data/", **common)
    assert isinstance(web, FsspecObjectStore) and web.source == Source("https", "host.example", "data/")


def test_read_only_sources() -> None:
    assert read_only_source_problem("s3://my-bucket/x") is None
    assert read_only_source_problem("file:///data") is None
    assert read_only_source_problem("not a url") is None  # parse_source words that problem
    for url in ("gs://my-bucket", "az://container", "hf://datasets/org/name", "https://h/", "memory://r"):
        problem = read_only_source_problem(url)
        assert problem is not None and "--read-only" in problem and url.split(":")[0] in problem
        assert not parse_source(url).writable


@pytest.mark.parametrize(("url", "package", "extra"), [
    ("gs://my-bucket/x", "gcsfs", "gcs"), ("az://container/x", "adlfs", "azure"), ("hf://datasets/o/n", "huggingface_hub", "hf"),
])
def test_a_missing_backend_names_the_extra(url: str, package: str, extra: str) -> None:
    try:
        __import__(package)
    except ImportError:
        pass
    else:
        pytest.skip(f"{package} is installed here")
    with pytest.raises(ValueError) as info:
        open_object_store(url, endpoint_url=None, connect_timeout_s=1.0, read_timeout_s=1.0, environ={})
    message = str(info.value)
    assert f"cachefs-fuse[{extra}]" in message and package in message and "\n" not in message


@pytest.mark.parametrize(("url", "endpoint", "word"), [
    ("file:///data", "http://127.0.0.1:9000", "only to s3"),
    ("https://host/data/", "http://127.0.0.1:9000", "only to s3"),
    ("s3://my-bucket", "ftp://127.0.0.1", "http(s)"),
    ("s3://my-bucket", "http://user:secretpw@127.0.0.1:9000", "user info"),
    ("s3://my-bucket", "http://127.0.0.1:9000/?x=1", "query"),
    ("s3://my-bucket", "127.0.0.1:9000", "http(s)"),
])
def test_open_object_store_refuses_bad_endpoints(url: str, endpoint: str, word: str) -> None:
    with pytest.raises(ValueError) as info:
        open_object_store(url, endpoint_url=endpoint, connect_timeout_s=1.0, read_timeout_s=1.0, environ={})
    assert word in str(info.value)
    assert "secretpw" not in str(info.value)
