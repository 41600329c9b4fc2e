"""The ``mtime`` metadata convention (``tiering.objectstore.mtimes``): rclone's and s3fs-fuse's forms."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiering.objectstore.mtimes import format_mtime, metadata_mtime, mtime_metadata, parse_mtime


@pytest.mark.parametrize("mtime, text", [
    (1_700_000_000.0, "1700000000"),  # a whole second: no point, as rclone writes it
    (1_700_000_000.5, "1700000000.5"),  # trailing zeros dropped
    (1_700_000_000.123456, "1700000000.123456"),
    (0.25, "0.25"),
    (-1.5, "-1.5"),  # before the epoch
])
def test_format_is_rclones(mtime: float, text: str) -> None:
    assert format_mtime(mtime) == text


@pytest.mark.parametrize("text, seconds", [
    ("1700000000.123456789", 1_700_000_000.123456789),  # rclone: nanoseconds
    ("1700000000", 1_700_000_000.0),  # s3fs-fuse (older releases), rclone on a whole second
    ("1700000000.000000001", 1_700_000_000.000000001),  # s3fs-fuse (newer): nine digits, zeros kept
    ("1700000000.1234567891234", 1_700_000_000.123456789),  # more than nine digits: cut, as rclone does
    (" 1700000000.5\n", 1_700_000_000.5),
])
def test_parse_reads_every_writers_form(text: str, seconds: float) -> None:
    assert parse_mtime(text) == pytest.approx(seconds, abs=1e-9)


@pytest.mark.parametrize("text", ["", "1.7e9", "nan", "inf", "2023-05-11T17:54:11Z", "12.", ".5", "0x10",
                                  "99999999999999", "1700000000,5"])
def test_parse_refuses_anything_else(text: str) -> None:
    assert parse_mtime(text) is None


def test_metadata_names_are_case_insensitive() -> None:
    assert metadata_mtime({"Mtime": "1600000000"}) == 1_600_000_000.0  # rclone's old "Mtime" key
    assert metadata_mtime({"other": "1"}) is None
    assert metadata_mtime(mtime_metadata(1_600_000_000.25)) == 1_600_000_000.25


@given(st.integers(min_value=-10**15, max_value=253_402_300_799 * 10**6))
def test_round_trip_to_the_microsecond(micros: int) -> None:
    mtime = micros / 1e6
    parsed = parse_mtime(format_mtime(mtime))
    assert parsed is not None
    assert abs(parsed - mtime) <= 1e-6 + abs(mtime) * 1e-15
