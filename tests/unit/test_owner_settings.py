"""--uid/--gid/--file-mode/--dir-mode: parsed, range-checked, refused in one line naming the option,
and shown on every file and directory the filesystem reports (issue 12: non-root pods can write)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from cachefs.cli.main import build_parser, main
from cachefs.cli.mount import mount_settings
from cachefs.fs.filesystem import CacheFS
from cachefs.fs.inodes import ROOT_INODE
from cachefs.settings import MAX_ID, FsSettings, parse_id, parse_mode
from tiering.blocks import MIN_BLOCK_SIZE
from tiering.engine.blockcache import BlockCache
from tiering.objectstore.memory import InMemoryObjectStore
from tiering.tiers.ram import RamTier
from tiering.settings import CacheSettings


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    return mnt, tmp_path / "cache"


def settings_of(dirs: tuple[Path, Path], *extra: str, read_only: bool = False) -> FsSettings:
    mnt, cache = dirs
    argv = ["mount", "s3://my-bucket", str(mnt), "--cache-dir", str(cache), *extra]
    return mount_settings(build_parser().parse_args(argv + (["--read-only"] if read_only else [])), {}).fs


def test_defaults_are_the_mounting_user_and_todays_modes(dirs) -> None:
    fs = settings_of(dirs)
    assert (fs.uid, fs.gid, fs.file_mode, fs.dir_mode) == (os.getuid(), os.getgid(), 0o644, 0o755)
    ro = settings_of(dirs, read_only=True)
    assert (ro.file_mode, ro.dir_mode) == (0o444, 0o555)


def test_owner_and_modes_from_the_command_line(dirs) -> None:
    fs = settings_of(dirs, "--uid", "65534", "--gid", "65533", "--file-mode", "0664", "--dir-mode", "775")
    assert (fs.uid, fs.gid, fs.file_mode, fs.dir_mode) == (65534, 65533, 0o664, 0o775)
    top = settings_of(dirs, "--uid", str(MAX_ID), "--gid", "0", "--file-mode", "0o7777", "--dir-mode", "0")
    assert (top.uid, top.gid, top.file_mode, top.dir_mode) == (MAX_ID, 0, 0o7777, 0)
    ro = settings_of(dirs, "--file-mode", "0640", read_only=True)
    assert (ro.file_mode, ro.dir_mode) == (0o640, 0o555)


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--uid", "-1"], ["--uid", "'-1'"]),
        (["--uid", "nobody"], ["--uid", "numeric", "'nobody'"]),
        (["--gid", str(2**32 - 1)], ["--gid", str(MAX_ID)]),
        (["--gid", ""], ["--gid"]),
        (["--file-mode", "0999"], ["--file-mode", "octal", "'0999'"]),
        (["--file-mode", "rw-r--r--"], ["--file-mode", "octal"]),
        (["--dir-mode", "17777"], ["--dir-mode", "7777"]),
        (["--dir-mode", "-755"], ["--dir-mode", "octal"]),
    ],
)
def test_bad_values_get_one_line_naming_the_option(extra, needles, dirs, capsys) -> None:
    mnt, cache = dirs
    with pytest.raises(SystemExit) as exc:
        main(["mount", "s3://my-bucket", str(mnt), "--cache-dir", str(cache), *extra], environ={})
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == ""
    assert err.startswith("cachefs: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"uid": -1}, "uid must be"),
        ({"gid": 2**32 - 1}, "gid must be"),
        ({"uid": True}, "uid must be"),
        ({"file_mode": 0o10000}, "file-mode must be an octal mode from 0 to 7777, got 10000"),
        ({"dir_mode": -1}, "dir-mode must be"),
    ],
)
def test_settings_refuse_out_of_range_values(kwargs, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        FsSettings(**kwargs)


def test_parsers_accept_what_users_type() -> None:
    assert [parse_mode("m", t) for t in ("644", "0644", "0o644", " 755 ", "0")] == [0o644, 0o644, 0o644, 0o755, 0]
    assert parse_id("uid", "0") == 0 and parse_id("uid", " 1000 ") == 1000
    with pytest.raises(ValueError, match="uid must be a numeric id"):
        parse_id("uid", "1e3")


async def test_every_attribute_the_filesystem_reports_carries_the_owner_and_modes() -> None:
    store = InMemoryObjectStore()
    store.put_object("d/f.bin", b"x")
    cache = BlockCache(CacheSettings(block_size=MIN_BLOCK_SIZE, ram_bytes=4 * MIN_BLOCK_SIZE), store,
                       RamTier(4 * MIN_BLOCK_SIZE))
    fs = CacheFS(store, cache, FsSettings(uid=65534, gid=65533, file_mode=0o600, dir_mode=0o711, read_only=True))
    root = await fs.getattr(ROOT_INODE)
    d = await fs.lookup(ROOT_INODE, b"d")
    f = await fs.lookup(d.inode, b"f.bin")
    fh = await fs.opendir(d.inode)
    listed = [entry.attrs for entry in fs.readdir(fh, 0)]
    fs.releasedir(fh)
    for attrs in (root, d, f, *listed):
        assert (attrs.uid, attrs.gid) == (65534, 65533)
    assert stat.S_IMODE(root.mode) == stat.S_IMODE(d.mode) == 0o711 and stat.S_ISDIR(d.mode)
    assert stat.S_IMODE(f.mode) == 0o600 and stat.S_ISREG(f.mode)
    assert [stat.S_IMODE(a.mode) for a in listed] == [0o600]
