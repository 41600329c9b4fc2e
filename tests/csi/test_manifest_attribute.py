"""The volume attribute ``manifest``: an object key in the volume's source, passed to ``cachefs mount``
as ``--manifest-key`` (which makes the mount read-only and pinned to that manifest)."""

from __future__ import annotations

import pytest

from cachefs.cli.main import build_parser
from cachefs.cli.mount import mount_settings
from csi_driver import attributes as attrs
from csi_driver.errors import Code, CsiError


def test_the_manifest_attribute_becomes_a_pinned_read_only_mount() -> None:
    settings = attrs.parse_volume_attributes({"source": "s3://bucket/data", "manifest": "manifests/v3.jsonl.gz"})
    argv = settings.cache.cli_args()
    assert argv == ["--manifest-key", "manifests/v3.jsonl.gz"]
    args = build_parser().parse_args(["mount", "s3://bucket/data", "/mnt/x", *argv])
    mount = mount_settings(args, {})
    assert mount.manifest_key == "manifests/v3.jsonl.gz" and mount.manifest is None
    assert mount.fs.read_only


def test_no_manifest_attribute_adds_nothing() -> None:
    assert attrs.parse_volume_attributes({"source": "s3://bucket/data"}).cache.cli_args() == []


@pytest.mark.parametrize("value", ["", "/abs/key", "dir/", "a\x00b", "k" * 1025])
def test_a_bad_manifest_key_is_refused_naming_the_attribute(value: str) -> None:
    with pytest.raises(CsiError) as refused:
        attrs.parse_volume_attributes({"source": "s3://bucket/data", "manifest": value})
    assert refused.value.code == Code.INVALID_ARGUMENT
    assert "'manifest'" in refused.value.message and "\n" not in refused.value.message
