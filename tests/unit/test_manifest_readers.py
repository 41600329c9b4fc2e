"""Issue 24, item 9: ``prefetch --manifest`` and ``mount --manifest`` read manifests the same way:
gzip for both, an unquoted ETag is the same version as the quoted one the store gives, a gzip bomb
of blank lines (or one endless line) is refused at once, and a manifest that lists no file is
refused by both."""

from __future__ import annotations

import gzip
import time
from pathlib import Path

import pytest

from cachefs.fs.pinned import open_manifest_index
from cachefs.manifest import MAX_BLANK_LINES, ManifestError, format_manifest, read_manifest, same_etag
from tests.unit.test_prefetch_jobs import make, run, store  # noqa: F401 - the fixture is used by name

FILES = [("train/a.bin", '"0a1b"', 10), ("train/b.bin", '"2c3d"', 20)]
# Refusing a bomb is a bounded read, not a 70 s one: far above the milliseconds it takes, far below 70 s.
BOMB_BOUND_S = 10.0


def test_prefetch_reads_the_gzipped_snapshot_that_mount_reads(tmp_path: Path) -> None:
    plain = tmp_path / "m.jsonl"
    plain.write_text(format_manifest(FILES))
    packed = tmp_path / "m.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert read_manifest(str(packed)) == read_manifest(str(plain))
    assert [(e.path, e.etag, e.size) for e in read_manifest(str(packed))] == FILES


def test_etags_compare_without_quotes_or_weak_prefix() -> None:
    assert same_etag("0a1b", '"0a1b"') and same_etag('"0a1b"', "0a1b") and same_etag('W/"0a1b"', '"0a1b"')
    assert not same_etag("0a1b", '"0a1c"')


async def test_prefetch_accepts_an_unquoted_etag_as_the_mount_does(tmp_path: Path, store) -> None:  # noqa: F811
    manager = make(tmp_path, store)
    info = store._objects["train/a.bin"].info
    assert info.etag.startswith('"')
    doc = await run(manager, manifest=[{"path": "train/a.bin", "line": 1, "etag": info.etag.strip('"'),
                                        "size": info.size}])
    assert doc["ok"] and doc["changed"] == [] and doc["files_cached"] == 1, doc


@pytest.mark.parametrize("body", [b"\n" * (MAX_BLANK_LINES + 5), b"x" * (1 << 20)], ids=["blank-lines", "one-line"])
def test_a_gzip_bomb_is_refused_by_both_readers_at_once(tmp_path: Path, body: bytes) -> None:
    bomb = tmp_path / "bomb.gz"
    bomb.write_bytes(gzip.compress(body + b"\n" + b"\n" * 10_000_000, compresslevel=9))  # 10 MB more behind
    for read in (lambda: read_manifest(str(bomb)), lambda: open_manifest_index(bomb, tmp_path)):
        started = time.monotonic()
        with pytest.raises(ManifestError) as refused:
            read()
        assert time.monotonic() - started < BOMB_BOUND_S
        message = str(refused.value)
        assert "\n" not in message and "not a manifest" in message, message


@pytest.mark.parametrize("text", ["", "\n\n  \n"], ids=["empty", "blank"])
def test_an_empty_manifest_is_refused_by_both_readers(tmp_path: Path, text: str) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text(text)
    for read in (lambda: read_manifest(str(empty)), lambda: open_manifest_index(empty, tmp_path)):
        with pytest.raises(ManifestError, match="lists no files"):
            read()


def test_prefetch_reads_a_gzipped_manifest_from_a_pipe(tmp_path: Path) -> None:
    """``cachefs snapshot MNT | gzip | cachefs prefetch MNT --manifest -``: standard input is told
    apart by its first bytes too (a pipe cannot be rewound)."""
    import subprocess
    import sys

    packed = gzip.compress(format_manifest(FILES).encode())
    code = ("from cachefs.manifest import read_manifest; "
            "print([(e.path, e.etag, e.size) for e in read_manifest('-')])")
    result = subprocess.run([sys.executable, "-c", code], input=packed, capture_output=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.decode().strip() == repr(FILES)
