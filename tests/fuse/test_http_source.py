"""An http:// source (fsspec's HTTP filesystem) through a real FUSE mount, served from 127.0.0.1.

The static server (``tests/support/httpserver.py``) serves files with ETags, ranges and
``If-Match``, and directories as HTML index pages, which is how the mount lists them. Every byte
read through the mount is compared with the file served; the server counts the GETs it answers, so
"served from the block cache" is checked at the source as well as in the daemon's own stats.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import Iterator

import pytest

from tests.fuse.conftest import MountFailed
from tests.fuse.test_read_path import DATASET, TEST_BLOCK, payload, read_all
from tests.support.httpserver import StaticHttpServer, write_file

MiB = 1024 * 1024
FAST_TTL = ["--attr-ttl", "0.2", "--dir-ttl", "0.2"]


@pytest.fixture
def www(tmp_path: Path) -> Path:
    root = tmp_path / "www"
    (root / "ds").mkdir(parents=True)
    return root


@pytest.fixture
def server(www: Path) -> Iterator[StaticHttpServer]:
    with StaticHttpServer(www) as s:
        yield s


def fill(www: Path) -> dict[str, bytes]:
    files = {key: payload(key, size) for key, size in DATASET.items()}
    for key, data in files.items():
        write_file(www / "ds" / key, data)
    (www / "ds" / "empty").mkdir()
    return files


def file_gets(server: StaticHttpServer) -> int:
    """GETs of files below /ds/ (index pages of directories not counted)."""
    return server.gets("/ds/", files_only=True)


def test_tree_bytes_and_block_cache(www: Path, server: StaticHttpServer, mounter, tmp_path: Path) -> None:
    files = fill(www)
    cache = tmp_path / "http-cache"
    source = server.url + "ds/"
    m = mounter.mount(source, "--read-only", "--block-size", TEST_BLOCK, cache_dir=cache)
    assert sorted(os.listdir(m.path)) == ["README", "empty", "train", "val"]
    assert sorted(os.listdir(m.path / "train")) == ["0001.bin", "0002.bin", "0003.bin", "shards"]
    assert os.listdir(m.path / "empty") == []
    assert (m.path / "train" / "0001.bin").stat().st_size == DATASET["train/0001.bin"]
    read_all(m.path, files)
    first = m.stats()
    sent = file_gets(server)
    assert first["object_store"]["get_requests"] > 0 and sent > 0

    read_all(m.path, files)  # the second epoch: nothing fetched again
    assert m.stats()["object_store"]["get_requests"] == first["object_store"]["get_requests"]
    assert file_gets(server) == sent

    assert m.unmount().returncode == 0
    # The daemon serves every read (no passthrough), so its disk tier counts the hits.
    again = mounter.mount(source, "--read-only", "--no-passthrough", "--block-size", TEST_BLOCK, cache_dir=cache)
    read_all(again.path, files)  # a remount reads every block from the disk tier: 0 GETs
    stats = again.stats()
    assert stats["object_store"]["get_requests"] == 0
    assert stats["tiers"]["disk"]["hits"] > 0
    assert file_gets(server) == sent


def test_a_changed_file_is_never_served_stale(www: Path, server: StaticHttpServer, mounter) -> None:
    old = payload("old", 2 * MiB)
    new = payload("new", 2 * MiB)
    write_file(www / "ds" / "f.bin", old)
    m = mounter.mount(server.url + "ds/", "--read-only", "--block-size", TEST_BLOCK, *FAST_TTL)
    assert (m.path / "f.bin").read_bytes() == old
    write_file(www / "ds" / "f.bin", new)  # same size, other bytes: a new ETag
    deadline = time.monotonic() + 20
    got = old
    while time.monotonic() < deadline:
        try:
            got = (m.path / "f.bin").read_bytes()
        except OSError as exc:  # a read caught between versions: refused, never mixed
            assert exc.errno == errno.ESTALE
            continue
        assert got in (old, new), "a read mixed bytes of two versions"
        if got == new:
            break
        time.sleep(0.1)
    assert got == new


def test_writes_are_refused(www: Path, server: StaticHttpServer, mounter) -> None:
    fill(www)
    m = mounter.mount(server.url + "ds/", "--read-only")
    for attempt in (lambda: open(m.path / "new.txt", "wb"), lambda: os.unlink(m.path / "README"),
                    lambda: os.mkdir(m.path / "d")):
        with pytest.raises(OSError) as info:
            attempt()
        assert info.value.errno == errno.EROFS
    assert (m.path / "README").read_bytes() == payload("README", 42)


def test_refusals_are_one_line(server: StaticHttpServer, mounter) -> None:
    cases = [
        ((server.url + "ds/",), "--read-only"),  # a writable mount of a read-only source
        (("ftp://127.0.0.1/ds/", "--read-only"), "version identity"),
        (("gopherish://127.0.0.1/ds/", "--read-only"), "unsupported"),
        ((server.url + "no-such-dir/", "--read-only"), "404"),
    ]
    for args, needle in cases:
        with pytest.raises(MountFailed) as info:
            mounter.mount(*args, check=False)
        result = info.value.result
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode != 0 and len(lines) == 1, result.stderr
        assert needle in lines[0], lines[0]


def test_a_server_without_etags_is_refused_at_mount_with_one_line(www: Path, server: StaticHttpServer,
                                                                  mounter) -> None:
    """Issue 24, item 3: ``python -m http.server`` sends no ETag; the mount says so on the terminal
    (one line, what to do) instead of mounting an empty tree with the reason only in its log."""
    files = fill(www)
    server.no_etag.update(f"/ds/{key}" for key in files)
    with pytest.raises(MountFailed) as info:
        mounter.mount(server.url + "ds/", "--read-only", check=False)
    err = info.value.result.stderr
    assert info.value.result.returncode != 0 and err.count("\n") == 1, err
    assert "sends no ETag" in err and "nginx" in err and "Traceback" not in err, err
