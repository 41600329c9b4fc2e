"""The rules of ``tiering.private`` (issue 28): directories another user owns or may write are refused
with one line naming the path and the fix; the daemon's own files are 0600 and never opened through a
symlink. The real-mount side (uid 65534 preparing directories) is tests/fuse/test_trust_boundaries.py.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from cachefs.daemon import control
from tiering.private import UnsafePathError, check_cache_dirs, check_private_dir, open_private, write_private_file

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def test_a_missing_directory_is_created_0700_with_its_parents(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        path = check_private_dir(tmp_path / "a" / "b", "cache directory")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o700


def test_a_group_or_other_writable_directory_is_refused_with_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "wide"
    path.mkdir()
    os.chmod(path, 0o777)
    with pytest.raises(UnsafePathError) as refused:
        check_private_dir(path, "cache directory")
    assert refused.value.strerror == (f"cache directory {path} is writable by group or others (mode 0777), so other "
                                      f"users could plant files there: `chmod go-w {path}`, or choose another path")


def test_a_readable_directory_of_ours_is_narrowed_only_when_cachefs_names_it(tmp_path: Path) -> None:
    ours, users = tmp_path / "ours", tmp_path / "users"
    for path in (ours, users):
        path.mkdir()
        os.chmod(path, 0o755)
    check_private_dir(ours, "cache directory")
    check_private_dir(users, "cache directory", narrow=False)
    assert stat.S_IMODE(ours.stat().st_mode) == 0o700 and stat.S_IMODE(users.stat().st_mode) == 0o755


def test_a_symlink_is_refused_where_cachefs_names_the_directory_and_followed_for_the_users_root(
        tmp_path: Path) -> None:
    real = tmp_path / "ssd"
    real.mkdir(mode=0o700)
    link = tmp_path / "cache"
    link.symlink_to(real)
    with pytest.raises(UnsafePathError, match="is a symlink"):
        check_private_dir(link, "cache directory")
    check_cache_dirs(link, link / "source")  # --cache-dir may point at another disk
    assert (real / "source").is_dir()


@needs_root
def test_a_directory_owned_by_another_uid_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "theirs"
    path.mkdir(mode=0o700)
    os.chown(path, NOBODY, NOBODY)
    with pytest.raises(UnsafePathError) as refused:
        check_private_dir(path, "cache directory")
    assert f"is owned by uid {NOBODY}, not by uid 0" in refused.value.strerror
    assert f"`chown 0 {path}`" in refused.value.strerror


@needs_root
def test_the_tmp_runtime_dir_made_0777_by_another_uid_is_refused(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """XDG_RUNTIME_DIR unset and not root: ``/tmp/cachefs-<uid>``, a name anyone can take first."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    uid = 4321
    monkeypatch.setattr(os, "geteuid", lambda: uid)
    planted = tmp_path / f"cachefs-{uid}"
    planted.mkdir()
    os.chmod(planted, 0o777)
    os.chown(planted, NOBODY, NOBODY)
    with pytest.raises(UnsafePathError, match=f"runtime directory {planted} is owned by uid {NOBODY}"):
        control.runtime_dir()
    os.chown(planted, uid, uid)  # the user's own, but still writable by everyone
    with pytest.raises(UnsafePathError, match="writable by group or others"):
        control.runtime_dir()
    os.chmod(planted, 0o755)
    assert control.runtime_dir() == planted and stat.S_IMODE(planted.stat().st_mode) == 0o700


def test_own_files_are_0600_and_never_opened_through_a_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("original")
    (tmp_path / "lock").symlink_to(victim)
    with pytest.raises(UnsafePathError, match="is a symlink"):
        open_private(tmp_path / "lock", os.O_RDWR | os.O_CREAT)
    (tmp_path / "source.json").symlink_to(victim)
    write_private_file(tmp_path / "source.json", b"{}\n")  # replaces the link, never writes through it
    assert victim.read_text() == "original"
    written = tmp_path / "source.json"
    assert not written.is_symlink() and written.read_bytes() == b"{}\n"
    assert stat.S_IMODE(written.stat().st_mode) == 0o600
