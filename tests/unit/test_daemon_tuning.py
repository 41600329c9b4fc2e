"""The daemon's FUSE connection tuning through fusectl, on a stand-in directory (no kernel involved)."""

from __future__ import annotations

import os
from pathlib import Path

from cachefs.tuning import FUSE_CONGESTION_THRESHOLD, FUSE_MAX_BACKGROUND, set_max_background


def test_max_background_is_written_to_the_connection_named_by_the_kernel_device_number(tmp_path: Path) -> None:
    dev = os.makedev(0, 57)
    connection = tmp_path / "57"  # anonymous devices (major 0), as FUSE mounts are: the minor number
    connection.mkdir()
    (connection / "max_background").write_text("12\n")
    (connection / "congestion_threshold").write_text("9\n")
    assert set_max_background(dev, tmp_path)
    assert int((connection / "max_background").read_text()) == FUSE_MAX_BACKGROUND
    assert int((connection / "congestion_threshold").read_text()) == FUSE_CONGESTION_THRESHOLD
    assert FUSE_CONGESTION_THRESHOLD < FUSE_MAX_BACKGROUND


def test_a_device_with_a_major_number_is_encoded_as_the_kernel_does(tmp_path: Path) -> None:
    connection = tmp_path / str((8 << 20) | 3)
    connection.mkdir()
    assert set_max_background(os.makedev(8, 3), tmp_path)
    assert int((connection / "max_background").read_text()) == FUSE_MAX_BACKGROUND


def test_without_fusectl_the_mount_keeps_the_defaults_and_says_so(tmp_path: Path, caplog) -> None:
    caplog.set_level("INFO", logger="cachefs.tuning")
    assert not set_max_background(os.makedev(0, 99), tmp_path / "not-mounted")
    assert "max_background left at the kernel's default" in caplog.text
