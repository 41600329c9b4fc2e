"""Listings that cross a page boundary on a directory marker, against a real SeaweedFS.

SeaweedFS (4.48) answers a recursive ListObjectsV2 (no delimiter) whose page of 1,000 keys ends
exactly on a directory marker ``a/t13/`` that is the last entry of its parent with
``IsTruncated: false``: every key below the marker is left out. The write-back crash test lists its
bucket that way, and once reported a whole trial directory as lost although every file was uploaded.
``list_keys`` (the write-back tests' bucket listing) does not trust a full page that says it is the
last; cachefs itself only lists with a delimiter (``S3ObjectStore.list_dir``), where a marker that
ends a page is a common prefix and nothing below it is due in that listing anyway.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import unique_bucket_name
from tests.fuse.writeback_support import LIST_PAGE_KEYS, list_keys
from tests.support.s3servers import SeaweedS3
from tiering.objectstore import S3ObjectStore

pytestmark = [pytest.mark.s3, pytest.mark.timeout(300)]

BELOW_LAST_MARKER = 97  # keys below the marker that ends the first page (as in the failed crash trial)


def fill(server: SeaweedS3, keys_before_marker: int) -> tuple[str, list[str]]:
    """A bucket where ``top/`` holds directories t01..t12 (each with its marker) whose keys, markers
    included, number ``keys_before_marker``, then the last directory t13 (marker and files)."""
    bucket = unique_bucket_name()
    server.make_bucket(bucket)
    client = server.client()
    files = keys_before_marker - 12
    keys: list[str] = []
    for t in range(1, 13):
        keys.append(f"top/t{t:02d}/")
        keys += [f"top/t{t:02d}/f{i:04d}" for i in range(files // 12 + (1 if t <= files % 12 else 0))]
    keys.append("top/t13/")
    keys += [f"top/t13/f{i:04d}" for i in range(BELOW_LAST_MARKER)]
    for marker in (k for k in keys if k.endswith("/")):
        client.put_object(Bucket=bucket, Key=marker, Body=b"")
    server.put_many(bucket, [(k, b"x") for k in keys if not k.endswith("/")])
    return bucket, keys


@pytest.mark.parametrize("keys_before_marker", [LIST_PAGE_KEYS - 2, LIST_PAGE_KEYS - 1, LIST_PAGE_KEYS])
def test_list_keys_finds_every_key_when_a_page_ends_on_the_last_marker(seaweed: SeaweedS3,
                                                                       keys_before_marker: int) -> None:
    bucket, keys = fill(seaweed, keys_before_marker)
    listed = list_keys(seaweed.client(), bucket, "top/")
    missing = sorted(set(keys) - set(listed))
    assert not missing, f"{len(missing)} keys not listed, first {missing[:3]}"
    assert set(listed) == set(keys)


@pytest.mark.parametrize("keys_before_marker", [LIST_PAGE_KEYS - 1])
def test_list_dir_sees_every_entry_across_that_boundary(seaweed: SeaweedS3, keys_before_marker: int) -> None:
    bucket, keys = fill(seaweed, keys_before_marker)

    async def listings() -> tuple[set[str], set[str], dict[str, object]]:
        store = S3ObjectStore(bucket, "", endpoint_url=seaweed.endpoint_url, environ=seaweed.env())
        try:
            top = await store.list_dir("top/")
            last = await store.list_dir("top/t13/")
            t12 = await store.list_dir("top/t12/")
        finally:
            await store.close()
        return top.dirs, set(last.files), dict(t12.files)

    top_dirs, t13_files, t12_files = asyncio.run(listings())
    assert top_dirs == {f"t{t:02d}" for t in range(1, 14)}
    assert t13_files == {f"f{i:04d}" for i in range(BELOW_LAST_MARKER)}
    assert set(t12_files) == {k.rpartition("/")[2] for k in keys if k.startswith("top/t12/f")}
