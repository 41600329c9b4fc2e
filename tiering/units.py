"""Parsing and printing byte sizes such as ``512MiB``, ``2GiB``, ``1.5G``, ``1048576``.

Binary suffixes (KiB, MiB, GiB, TiB) and the short forms (K, M, G, T, with or without a trailing B)
all mean powers of 1024: that is what users of cache tools mean by "2G" of RAM. SI suffixes
(kB, MB, GB, TB spelled with a lower-case k or as MB/GB) would be ambiguous, so plain ``MB`` is also
read as MiB, and that is documented in the CLI help.
"""

from __future__ import annotations

import re
from fractions import Fraction

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1024,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1024**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1024**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1024**4,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Return the number of bytes ``text`` names; raise ``ValueError`` with a one-line reason."""
    if not isinstance(text, str):
        raise ValueError(f"size must be a string, got {type(text).__name__}")
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"invalid size {text!r}: expected a number with an optional unit such as 512MiB or 2GiB")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"invalid size {text!r}: unknown unit {unit!r} (use B, KiB, MiB, GiB or TiB)")
    # Exact arithmetic: a float would round large or long numbers (9007199254740993.0 -> ...992)
    # and silently accept fractions too small for it to see.
    value = Fraction(number) * factor
    if value.denominator != 1:
        raise ValueError(f"invalid size {text!r}: not a whole number of bytes")
    return int(value)


def format_size(n: int) -> str:
    """Human-readable binary size, e.g. ``format_size(3 * 2**30) == '3.0 GiB'``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
