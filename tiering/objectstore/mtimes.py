"""A file's modification time in an object's user metadata: the convention rclone and s3fs-fuse share.

An object store dates each object by its upload (S3's ``LastModified``, which a LIST reports); the
time a writer gave its file (``touch -d``, ``cp -p``, ``rsync -t``, or the time of its last write) is
kept beside it in user metadata, ``x-amz-meta-mtime`` on S3 (``MTIME_KEY`` without the prefix: S3
clients add it). The value is seconds since the epoch as a decimal number:

- rclone (its S3 backend, through the swift library's float-string helpers) writes fixed-point
  seconds with up to nine fractional digits and trailing zeros dropped (``"1700000000.123456789"``,
  ``"1700000000"`` for a whole second), and reads any number of fractional digits, cut to nine;
- s3fs-fuse writes whole seconds in older releases (``"1700000000"``) and ``"<sec>.<nine digits>"``
  in newer ones when the nanoseconds are not zero.

``format_mtime`` writes rclone's form, to the microsecond: cachefs keeps a file's mtime as a float of
seconds (exact to a fraction of a microsecond at today's dates), so digits past the sixth would be
noise. ``parse_mtime`` reads all three forms and refuses anything else (an exponent, ``nan``, a date
string, a value outside what ``stat`` can show): a malformed value is ignored, never shown.
"""

from __future__ import annotations

import re
from typing import Mapping

# The user-metadata key (without ``x-amz-meta-``), as rclone and s3fs-fuse name it.
MTIME_KEY = "mtime"
# Digits kept: cachefs holds mtimes as float seconds, exact to ~0.2 us up to year 2100.
MTIME_DIGITS = 6
# Years 1 to 9999 as epoch seconds: what Python's datetime (and any sane ``stat``) can show.
_MIN_S, _MAX_S = -62135596800, 253402300799

_NUMBER = re.compile(r"(-?)([0-9]{1,12})(?:\.([0-9]{1,30}))?")


def format_mtime(mtime: float) -> str:
    """``mtime`` (seconds since the epoch) as rclone writes it: fixed point, trailing zeros dropped."""
    micros = round(mtime * 10**MTIME_DIGITS)
    sign = "-" if micros < 0 else ""
    whole, frac = divmod(abs(micros), 10**MTIME_DIGITS)
    digits = f"{frac:0{MTIME_DIGITS}d}".rstrip("0")
    return f"{sign}{whole}.{digits}" if digits else f"{sign}{whole}"


def parse_mtime(text: str) -> float | None:
    """Seconds since the epoch from an ``mtime`` metadata value; None if it is not one."""
    match = _NUMBER.fullmatch(text.strip())
    if match is None:
        return None
    sign, whole, frac = match.groups()
    magnitude = int(whole) + int(((frac or "") + "0" * 9)[:9]) / 1e9  # the fraction alone: no rounding of the whole
    seconds = -magnitude if sign else magnitude
    return seconds if _MIN_S <= seconds <= _MAX_S else None


def mtime_metadata(mtime: float) -> dict[str, str]:
    """The user metadata that carries ``mtime`` (``x-amz-meta-mtime`` on S3)."""
    return {MTIME_KEY: format_mtime(mtime)}


def metadata_mtime(metadata: Mapping[str, str]) -> float | None:
    """The mtime a writer left in an object's user metadata (names in any case), if any."""
    for name, value in metadata.items():
        if name.lower() == MTIME_KEY:
            return parse_mtime(str(value))
    return None
