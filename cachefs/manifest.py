"""Dataset manifests: what ``cachefs snapshot`` writes, ``cachefs prefetch --manifest`` reads and
``cachefs mount --manifest`` pins a mount to (``cachefs.fs.pinned``; read as a stream, gzip too).

A manifest is a text file of one entry per line, in UTF-8. Two line forms are accepted and may be
mixed:

- a plain path (relative to the mount root, or absolute inside the mountpoint), as a user would
  write by hand or produce with ``find``; it is prefetched like a PATH argument;
- a JSON object ``{"path": ..., "etag": ..., "size": ...}`` (``etag`` and ``size`` optional), as
  ``snapshot`` writes; with an ETag, prefetch verifies the file still has that version and reports it
  as changed otherwise. Other keys are ignored, so later versions may add fields.

Blank lines are skipped, up to ``MAX_BLANK_LINES``; a line is at most ``MAX_LINE_BYTES``. Both are
bounds against a file that is no manifest, a gzip "bomb" above all (100 KB of gzip that decompress
to 100 MiB of blank lines held a mount for 70 s and then mounted nothing): past either, the
manifest is refused with one line. A manifest that lists no file at all is refused by both readers
(``no_files_error``): ``mount --manifest`` would show an empty tree and ``prefetch`` would warm
nothing, and in both cases the likely cause is the wrong file or a snapshot of the wrong prefix,
which an empty success would hide. A line that starts with ``{`` is JSON; anything wrong with one (invalid
JSON, not an object, a missing or mistyped field) is a ``ManifestError`` naming the file and line
number, and nothing is prefetched: a half-read manifest would be a silent partial dataset.

``format_manifest`` writes the JSON form, one line per file, sorted by path, keys sorted, no
timestamps: the same dataset version always gives byte-identical manifests, so a manifest can be
checked in, diffed and hashed.
"""

from __future__ import annotations

import gzip
import io
import json
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator


# The tiers a prefetch may warm (``cachefs prefetch --tier``): this node's disk tier, or the shared
# cluster tier. Here, beside the manifest, because the CLI and the daemon both read it.
PREFETCH_TIERS = ("disk", "cluster")


class ManifestError(ValueError):
    """A manifest that cannot be used; one line naming the file and, where it applies, the line."""


# The largest size a manifest may give: what a signed 64-bit integer holds (SQLite's INTEGER, where a
# pinned mount keeps its namespace, and off_t). Any larger number is a typo or a hostile file, refused
# with the line, not an OverflowError that ends the mount.
MAX_SIZE = 2**63 - 1


def size_problem(size: object) -> str | None:
    """Why ``size`` is not a file size (an integer in 0..MAX_SIZE), or None when it is."""
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_SIZE:
        return f"\"size\" must be an integer from 0 to {MAX_SIZE}"
    return None


@dataclass(frozen=True)
class ManifestEntry:
    path: str
    line: int
    etag: str | None = None
    size: int | None = None


def parse_line(text: str, number: int, name: str) -> ManifestEntry | None:
    """One manifest line (without its newline): an entry, None for a blank line, or ``ManifestError``."""
    if not text.strip():
        return None
    if not text.lstrip().startswith("{"):
        return ManifestEntry(text, number)
    where = f"manifest {name} line {number}"
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
        raise ManifestError(f"{where}: invalid JSON ({exc.args[0] if exc.args else exc})") from None
    if not isinstance(doc, dict):
        raise ManifestError(f"{where}: expected a JSON object with a \"path\"")
    path, etag, size = doc.get("path"), doc.get("etag"), doc.get("size")
    if not isinstance(path, str) or not path:
        raise ManifestError(f"{where}: \"path\" must be a non-empty string")
    if etag is not None and (not isinstance(etag, str) or not etag):
        raise ManifestError(f"{where}: \"etag\" must be a non-empty string")
    if size is not None and (problem := size_problem(size)) is not None:
        raise ManifestError(f"{where}: {problem}")
    return ManifestEntry(path, number, etag, size)


def parse_manifest(lines: Iterable[str], name: str) -> list[ManifestEntry]:
    entries: list[ManifestEntry] = []
    for number, raw in enumerate(lines, start=1):
        entry = parse_line(raw.rstrip("\r\n"), number, name)
        if entry is not None:
            entries.append(entry)
    return entries


# A snapshot writes no blank line and a hand-written list has a few; 100,000 are read in well under
# a second, so a real manifest never meets the bound and a bomb of blank lines stops at once.
MAX_BLANK_LINES = 100_000
# A manifest line is one path (S3 keys are at most 1,024 bytes; JSON \u escapes make that at most
# 6 KiB), an ETag and a size: 64 KiB is far above any real line, and bounds what one line can hold
# in memory when a file without newlines is read.
MAX_LINE_BYTES = 64 * 1024


def no_files_error(name: str) -> ManifestError:
    """The refusal of a manifest that lists no file, the same for ``mount`` and ``prefetch``."""
    return ManifestError(f"manifest {name} lists no files (the wrong file, or a snapshot of an empty prefix?)")


def bare_etag(etag: str) -> str:
    """An ETag without its quotes or weak prefix: ``"abc"``, ``abc`` and ``W/"abc"`` are one version.

    S3 and HTTP give ETags quoted, while a hand-written manifest or another tool may not; every
    comparison of a manifest's ETag with the store's goes through here (the S3 store compares
    what it gets back from a ranged GET the same way)."""
    text = etag.strip()
    return text.removeprefix("W/").strip('"')


def same_etag(expected: str, current: str) -> bool:
    return bare_etag(expected) == bare_etag(current)


# Magic numbers of the compressed forms a manifest may take (``cachefs mount --manifest``).
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def open_manifest(path: str | Path) -> io.BufferedReader:
    """The manifest file opened for reading bytes; ``ManifestError`` naming the problem if it cannot be."""
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise ManifestError(f"manifest {path} does not exist") from None
    except IsADirectoryError:
        raise ManifestError(f"manifest {path} is a directory") from None
    except OSError as exc:
        raise ManifestError(f"cannot read manifest {path}: {exc.strerror or exc}") from None


def iter_manifest_lines(path: str) -> Iterator[tuple[int, str]]:
    """The lines of a manifest file, numbered from 1, read as a stream (a 10 M-line manifest is
    never held whole): plain, or gzip-compressed (stdlib). zstd is refused with one line naming the
    fix (no zstd library is a dependency). ``ManifestError`` for what cannot be read."""
    with open_manifest(path) as raw:
        yield from iter_manifest_stream(raw, path)


def iter_manifest_stream(raw: io.BufferedReader, name: str) -> Iterator[tuple[int, str]]:
    """``iter_manifest_lines`` over an open binary stream (a file, or standard input: the format is
    told by peeking at its first bytes, so a pipe works too)."""
    try:
        magic = raw.peek(4)[:4]
    except OSError as exc:
        raise ManifestError(f"cannot read manifest {name}: {exc.strerror or exc}") from None
    if magic.startswith(ZSTD_MAGIC):
        raise ManifestError(f"manifest {name} is zstd-compressed: decompress it (zstd -d) or compress it "
                            f"with gzip; zstd is not supported")
    stream: gzip.GzipFile | io.BufferedReader = gzip.GzipFile(fileobj=raw) if magic.startswith(GZIP_MAGIC) else raw
    number = blank = 0
    try:
        while line := stream.readline(MAX_LINE_BYTES + 1):
            number += 1
            if len(line) > MAX_LINE_BYTES:
                raise ManifestError(f"manifest {name} line {number}: longer than {MAX_LINE_BYTES} bytes: "
                                    f"not a manifest")
            try:
                text = line.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError:
                raise ManifestError(f"manifest {name} line {number}: not valid UTF-8") from None
            if not text.strip():
                blank += 1
                if blank > MAX_BLANK_LINES:
                    raise ManifestError(f"manifest {name}: more than {MAX_BLANK_LINES} blank lines "
                                        f"(by line {number}): not a manifest")
            yield number, text
    except (OSError, EOFError, zlib.error) as exc:
        raise ManifestError(f"manifest {name} line {number + 1}: cannot decompress ({exc})") from None


def read_manifest(path: str) -> list[ManifestEntry]:
    """Read and parse a manifest file (``-`` for standard input), plain or gzip, by the same reader
    as ``mount --manifest`` (``iter_manifest_lines``); ``ManifestError`` if it lists no file."""
    name = "<stdin>" if path == "-" else path
    stdin = getattr(sys.stdin, "buffer", None) if path == "-" else None
    if path == "-" and not isinstance(stdin, io.BufferedReader):  # a text stream put in its place
        entries = parse_manifest(sys.stdin, name)
    else:
        lines = iter_manifest_stream(stdin, name) if isinstance(stdin, io.BufferedReader) else iter_manifest_lines(path)
        entries = [entry for number, text in lines if (entry := parse_line(text, number, name)) is not None]
    if not entries:
        raise no_files_error(name)
    return entries


def manifest_line(path: str, etag: str, size: int) -> str:
    doc = {"etag": etag, "path": path, "size": size}
    line = json.dumps(doc, sort_keys=True, ensure_ascii=False)
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        # A name that is not UTF-8 (a file:// source; held as surrogate escapes) is written with
        # \u escapes, which read back to the same name, so the manifest stays valid UTF-8.
        line = json.dumps(doc, sort_keys=True, ensure_ascii=True)
    return line


def format_manifest(files: Iterable[tuple[str, str, int]]) -> str:
    """The manifest of ``(path, etag, size)`` files: sorted by path, one JSON object per line."""
    return "".join(manifest_line(p, e, s) + "\n" for p, e, s in sorted(files))
