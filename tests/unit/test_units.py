"""parse_size / format_size: exact byte counts, one-line refusals that name the input."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiering.units import format_size, parse_size

KiB, MiB, GiB, TiB = 1024, 1024**2, 1024**3, 1024**4


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 * MiB),
        ("2GiB", 2 * GiB),
        ("1048576", 1048576),
        ("0", 0),
        ("1.5G", 3 * GiB // 2),
        ("4k", 4 * KiB),
        ("4K", 4 * KiB),
        ("4KiB", 4 * KiB),
        ("4kb", 4 * KiB),
        ("10B", 10),
        ("1T", TiB),
        ("1tib", TiB),
        ("0.5k", 512),
        ("1.25KiB", 1280),
        ("64 MiB", 64 * MiB),
        ("  2G ", 2 * GiB),
        ("3MB", 3 * MiB),  # documented: MB is read as MiB
    ],
)
def test_parse_size_accepts(text: str, expected: int) -> None:
    value = parse_size(text)
    assert value == expected
    assert isinstance(value, int)


@pytest.mark.parametrize("text", ["", "abc", "-1", "12XB", "1.3B", "1.5", "0.1k", "1e3", "G", "1 2G", "1.G", ".5G"])
def test_parse_size_rejects_naming_the_input(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_size(text)
    message = str(info.value)
    assert repr(text) in message
    assert "\n" not in message


def test_parse_size_rejects_non_strings() -> None:
    with pytest.raises(ValueError, match="string"):
        parse_size(1024)  # type: ignore[arg-type]


def test_unknown_unit_is_named() -> None:
    with pytest.raises(ValueError, match="XB"):
        parse_size("12XB")


UNITS = {"": 1, "B": 1, "k": KiB, "KiB": KiB, "M": MiB, "MiB": MiB, "G": GiB, "GiB": GiB, "gib": GiB, "T": TiB, "TiB": TiB}


@given(n=st.integers(min_value=0, max_value=10**30), unit=st.sampled_from(sorted(UNITS)))
def test_whole_numbers_are_exact(n: int, unit: str) -> None:
    factor = UNITS[unit]
    assert parse_size(f"{n}{unit}") == n * factor
    # A fractional spelling of a whole number means the same number of bytes, however large.
    assert parse_size(f"{n}.0{unit}") == n * factor


@given(n=st.integers(min_value=0, max_value=10**20))
def test_half_bytes_are_refused(n: int) -> None:
    with pytest.raises(ValueError, match="whole number"):
        parse_size(f"{n}.5B")


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, "0 B"),
        (1, "1 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (4 * MiB, "4.0 MiB"),
        (3 * GiB, "3.0 GiB"),
        (2 * TiB, "2.0 TiB"),
        (5000 * TiB, "5000.0 TiB"),
    ],
)
def test_format_size(n: int, expected: str) -> None:
    assert format_size(n) == expected


@given(n=st.integers(min_value=1, max_value=1023), unit=st.sampled_from(["KiB", "MiB", "GiB", "TiB"]))
def test_format_then_parse_round_trips(n: int, unit: str) -> None:
    size = n * UNITS[unit]
    text = format_size(size)
    assert text == f"{n}.0 {unit}"
    assert parse_size(text) == size


def test_tiny_fractions_are_not_rounded_away() -> None:
    with pytest.raises(ValueError, match="whole number"):
        parse_size("1.00000000000000000001K")
