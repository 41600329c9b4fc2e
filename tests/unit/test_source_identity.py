"""One cache identity per source however it is spelt (issue 37, item 1): the canonical URL and
endpoint (``cachefs.settings``) and the directory a mount uses (``cachefs.sourcedir``), including one
an older cachefs named after the URL exactly as typed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cachefs.settings import MountSettings, canonical_endpoint, legacy_source_hash, source_hash, source_identity
from cachefs.sourcedir import SourceDirError, find_source_dir, has_staged_changes

SAME_SOURCE = [
    [("s3://out/run2", None), ("s3://out/run2/", None), ("s3://out/run2", "https://s3.amazonaws.com"),
     ("s3://out/run2/", "https://s3.eu-west-1.amazonaws.com/"), ("s3://out/run2", "HTTPS://S3.amazonaws.com:443")],
    [("s3://bkt", None), ("s3://bkt/", None)],
    [("s3://bkt/p", "http://127.0.0.1:8333"), ("s3://bkt/p/", "http://127.0.0.1:8333/"),
     ("s3://bkt/p", "HTTP://127.0.0.1:8333")],
    [("s3://bkt/p", "http://minio.local"), ("s3://bkt/p/", "http://minio.local:80/")],
    [("file:///data/train", None), ("file:///data/train/", None)],
]


@pytest.mark.parametrize("spellings", SAME_SOURCE, ids=lambda s: s[0][0])
def test_every_spelling_of_one_source_has_one_identity(spellings):
    assert len({source_identity(s, e) for s, e in spellings}) == 1
    assert len({source_hash(s, e) for s, e in spellings}) == 1


@pytest.mark.parametrize("a, b", [
    (("s3://bkt/p", None), ("s3://bkt/q", None)),
    (("s3://bkt/p", None), ("s3://bkt/p", "http://127.0.0.1:8333")),
    (("s3://bkt/p", "http://127.0.0.1:8333"), ("s3://bkt/p", "http://127.0.0.1:8334")),
    (("s3://bkt/p", "http://127.0.0.1"), ("s3://bkt/p", "https://127.0.0.1")),
    (("s3://bkt/p", None), ("s3://bkt/p", "https://s3.cn-north-1.amazonaws.com.cn")),  # another partition
])
def test_different_sources_keep_different_identities(a, b):
    assert source_hash(*a) != source_hash(*b)


def test_the_canonical_spelling_keeps_the_name_older_versions_gave_it():
    """A cache directory made under the canonical spelling is found without any scan."""
    assert source_hash("s3://bkt/p/", None) == legacy_source_hash("s3://bkt/p/", None)
    assert source_hash("s3://bkt/p", "http://127.0.0.1:8333") == legacy_source_hash("s3://bkt/p/", "http://127.0.0.1:8333")


def test_canonical_endpoint():
    assert canonical_endpoint(None) == ""
    assert canonical_endpoint("https://s3.us-east-1.amazonaws.com") == ""
    assert canonical_endpoint("https://s3.dualstack.us-west-2.amazonaws.com/") == ""
    assert canonical_endpoint("http://Host.Example:9000/") == "http://host.example:9000"
    assert canonical_endpoint("https://host:443") == "https://host"
    assert canonical_endpoint("http://[::1]:8333") == "http://[::1]:8333"


def _old_dir(root: Path, source: str, endpoint: str | None, *, staged: bool) -> Path:
    """A source directory as an older cachefs left it: named after the URL as typed."""
    directory = root / legacy_source_hash(source, endpoint)
    directory.mkdir(parents=True, mode=0o700)
    (directory / "source.json").write_text(json.dumps({"source": source, "endpoint_url": endpoint}))
    if staged:
        records = directory / "staging" / "records"
        records.mkdir(parents=True)
        (records / ("0" * 32 + ".rec")).write_text("x")
    return directory


def test_a_directory_an_older_spelling_left_is_found(tmp_path):
    old = _old_dir(tmp_path, "s3://out/run2", None, staged=True)
    assert old.name != source_hash("s3://out/run2", None)
    for spelling in ("s3://out/run2/", "s3://out/run2"):
        assert find_source_dir(tmp_path, spelling, None) == old.name
    assert find_source_dir(tmp_path, "s3://out/run2", "https://s3.amazonaws.com") == old.name
    assert find_source_dir(tmp_path, "s3://out/run3", None) == source_hash("s3://out/run3", None)


def test_the_directory_with_staged_changes_wins_over_the_canonical_one(tmp_path):
    canonical = tmp_path / source_hash("s3://out/run2/", None)
    canonical.mkdir(mode=0o700)
    old = _old_dir(tmp_path, "s3://out/run2", None, staged=True)
    assert has_staged_changes(old) and not has_staged_changes(canonical)
    assert find_source_dir(tmp_path, "s3://out/run2/", None) == old.name
    (old / "staging" / "records" / ("0" * 32 + ".rec")).unlink()
    assert find_source_dir(tmp_path, "s3://out/run2/", None) == canonical.name


def test_two_directories_with_staged_changes_are_refused_with_the_way_out(tmp_path):
    _old_dir(tmp_path, "s3://out/run2", None, staged=True)
    _old_dir(tmp_path, "s3://out/run2", "https://s3.amazonaws.com", staged=True)
    with pytest.raises(SourceDirError, match=r"both hold changes staged for s3://out/run2/.*one at a time"):
        find_source_dir(tmp_path, "s3://out/run2/", None)


def test_a_symlinked_or_foreign_directory_is_not_read(tmp_path):
    elsewhere = _old_dir(tmp_path / "elsewhere", "s3://out/run2", None, staged=True)
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(elsewhere, root / elsewhere.name)
    assert find_source_dir(root, "s3://out/run2/", None) == source_hash("s3://out/run2/", None)


def test_mount_settings_use_the_directory_found(tmp_path):
    old = _old_dir(tmp_path, "s3://out/run2", None, staged=True)
    settings = MountSettings(source="s3://out/run2/", mountpoint=tmp_path / "m", cache_dir=tmp_path,
                             source_dir_name=find_source_dir(tmp_path, "s3://out/run2/", None))
    assert settings.source_cache_dir() == old
    assert settings.source_label() == source_hash("s3://out/run2", None)  # metrics: one label per source


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_a_directory_another_user_owns_is_not_adopted(tmp_path):
    """Another user may prepare a directory under an older spelling's name with a source.json naming our
    source: it is never adopted (its blocks and staged changes could be anyone's)."""
    planted = _old_dir(tmp_path, "s3://out/run2", None, staged=True)
    for path in (planted, *planted.rglob("*")):
        os.chown(path, 65534, 65534, follow_symlinks=False)
    assert find_source_dir(tmp_path, "s3://out/run2/", None) == source_hash("s3://out/run2/", None)
