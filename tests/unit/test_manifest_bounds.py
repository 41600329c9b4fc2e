"""Manifest numbers are bounded (issue 28): a size beyond a signed 64-bit integer, or a negative one, is
refused with one line naming the line, in every place a manifest is read: the CLI's ``cachefs
prefetch --manifest`` (``read_manifest``), the daemon's ``POST /prefetch`` body, and a pinned mount
(tests/fuse/test_trust_boundaries.py, through ``--manifest`` and ``--manifest-key``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cachefs.daemon.control import ControlRequestError
from cachefs.daemon.prefetch import PrefetchRequest
from cachefs.manifest import MAX_SIZE, ManifestError, read_manifest

TOO_BIG = 99999999999999999999999


@pytest.mark.parametrize("size", [TOO_BIG, MAX_SIZE + 1, -1, 1.5, True])
def test_the_cli_refuses_a_size_out_of_range_naming_the_line(tmp_path: Path, size: object) -> None:
    manifest = tmp_path / "m.jsonl"
    manifest.write_text('{"path": "a", "size": 1}\n' + json.dumps({"path": "b", "size": size}) + "\n")
    with pytest.raises(ManifestError) as refused:
        read_manifest(str(manifest))
    assert str(refused.value) == f'manifest {manifest} line 2: "size" must be an integer from 0 to {MAX_SIZE}'


def test_the_largest_size_is_accepted(tmp_path: Path) -> None:
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"path": "b", "size": MAX_SIZE}) + "\n")
    assert read_manifest(str(manifest))[0].size == MAX_SIZE


@pytest.mark.parametrize("field,value,expected", [
    ("size", TOO_BIG, f'manifest m line 1: "size" must be an integer from 0 to {MAX_SIZE}'),
    ("line", TOO_BIG, f"manifest m entry 1: needs a string 'path' and an integer 'line' from 0 to {MAX_SIZE}"),
])
def test_the_daemon_refuses_numbers_out_of_range_in_a_prefetch_body(field: str, value: int, expected: str) -> None:
    entry = {"path": "a", "line": 1, "size": 1, field: value}
    with pytest.raises(ControlRequestError) as refused:
        PrefetchRequest.from_params({"manifest": [entry], "manifest_name": "m"})
    assert refused.value.status == 400 and str(refused.value) == expected
