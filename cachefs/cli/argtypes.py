"""Argument types of the command line: sizes, durations, addresses, refused with a one-line reason.

Each raises ``argparse.ArgumentTypeError``, so argparse prints ``cachefs: error: argument ...: why``.
"""

from __future__ import annotations

import argparse

from cachefs.settings import parse_id, parse_mode
from tiering.units import parse_size


def size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: expected seconds, e.g. 30 or 0.5") from None
    if value < 0 or value != value:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: must not be negative")
    return value


def fraction_or_size(text: str) -> tuple[str, float | int]:
    """``0.5`` or ``50%`` (a fraction of --disk-cache) or ``20GiB`` (a size); a bare integer above 1
    is ambiguous (bytes? a typo for a fraction?) and refused."""
    body = text.strip()
    try:
        if body.endswith("%"):
            value = float(body[:-1]) / 100
        elif body.replace(".", "", 1).isdigit() and ("." in body or body in ("0", "1")):
            value = float(body)
        elif body.isdigit():
            raise ValueError(f"ambiguous pin limit {text!r}: use a fraction such as 0.5 or a size such as 20GiB")
        else:
            return ("bytes", parse_size(body))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"invalid fraction {text!r}: expected 0 to 1 (or 0% to 100%)")
    return ("fraction", value)


def address(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"invalid address {text!r}: expected HOST:PORT, e.g. 127.0.0.1:9750")
    return f"{host or '127.0.0.1'}:{int(port)}"


def user_id(text: str) -> int:
    """``--uid``/``--gid``: a numeric id (the option name is added by argparse)."""
    try:
        return parse_id("id", text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("id ")) from None


def mode(text: str) -> int:
    """``--file-mode``/``--dir-mode``: octal permission bits."""
    try:
        return parse_mode("mode", text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("mode ")) from None
