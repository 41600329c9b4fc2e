"""Mounts pinned to a manifest (``cachefs mount --manifest``): the namespace from the manifest.

``open_manifest_index`` turns a manifest (JSON lines as ``cachefs snapshot`` writes them, plain or
gzip) into a metadata index (``cachefs.fs.metaindex``) holding every directory of the dataset, and
the listing cache serves it as ``pinned``: nothing expires and the store is never listed. Each file
keeps the manifest's ETag and size, so every read is a GET with ``If-Match`` on that ETag: an object
changed in the bucket answers ESTALE (``ObjectChangedError``, logged with its key), never other bytes.

The manifest is read as a stream and loaded in one SQLite transaction into a temporary file with no
journal and no syncs (SQLite's fastest writes), which is fsynced, marked complete (the manifest's
SHA-256 in its ``meta`` table, written last) and renamed into place: a crash mid-import leaves at
most a temporary file, deleted by the next mount, which imports again, and an index without the
marker is never used. The index is named by the manifest's SHA-256, so remounting the same manifest
reuses it; the very same file (device, inode, size, mtime and ctime unchanged) is not even hashed
again. An index of another manifest is deleted first (one per source cache directory). Most lines
take a fast path (the C JSON scanner and a few cheap checks, see ``manifest_rows``): about 7 s per
million lines on a loaded core here, against 19 s for ``json.loads`` and per-line checks.

Every line must be a JSON object with ``path``, ``etag`` and ``size`` (a plain path line has no
version to pin), the path a valid mount-relative path; a path given twice, or both as a file and as a
directory of other paths, is refused. Any problem is a ``ManifestError`` naming the file and the line,
and the mount is refused: a half-read manifest would be a silently partial dataset. Files show the
manifest file's mtime (the manifest records none).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from cachefs.fs.metaindex import BULK_BATCH, DuplicateEntryError, MetadataIndex
from cachefs.manifest import MAX_SIZE, ManifestError, iter_manifest_lines, no_files_error, open_manifest, parse_line
from cachefs.names import NAME_MAX, name_problem

MANIFEST_INDEX_PREFIX = "manifest-"
# Bytes read at a time while hashing a manifest.
_HASH_CHUNK = 1 << 20
# The JSON scanner ``json.loads`` uses (the C one), called directly: ``(value, end)`` at an index.
_SCANNER: Callable[[str, int], tuple[Any, int]] = getattr(json.JSONDecoder(), "scan_once")


def manifest_digest(path: Path) -> str:
    """SHA-256 of the manifest file's bytes (compressed or not), hex."""
    digest = hashlib.sha256()
    with open_manifest(path) as handle:
        try:
            while chunk := handle.read(_HASH_CHUNK):
                digest.update(chunk)
        except OSError as exc:
            raise ManifestError(f"cannot read manifest {path}: {exc.strerror or exc}") from None
    return digest.hexdigest()


def _component_problem(path: str) -> str | None:
    if path.startswith("/"):
        return "must be relative to the mount root (no leading '/')"
    for part in path.split("/"):
        if part in ("", ".", ".."):
            return "has an empty, '.' or '..' component"
        try:
            problem = name_problem(part)
        except UnicodeEncodeError:  # a lone surrogate other than an escaped byte (\udc80-\udcff)
            return "has a \\u escape that is no character"
        if problem is not None:
            return f"is not a valid name in the mount ({problem.reason})"
    return None


Row = tuple[int, str, int | None, str | None, float | None, int]


def manifest_rows(manifest: Path, mtime: float, dirs: dict[str, int]) -> Iterator[list[Row]]:
    """Batches of ``(dir id, name, size, etag, mtime, line)`` index rows of a manifest: its files
    (dated ``mtime``), and each directory they imply (once, ``size``, ``etag`` and ``mtime`` None,
    from the first line that implies it). ``dirs`` is filled with each directory's path -> id (the
    root is 1). ``ManifestError`` on the first bad line.

    The common line (``{...}`` exactly, ``path`` a string, ``etag`` a non-empty string, ``size`` an
    int in 0..MAX_SIZE, the file name short and ASCII, its directory already seen) takes a fast path: the C
    JSON scanner ``json.loads`` uses, called without its wrappers, and a few cheap checks. Any other
    line goes through ``parse_line`` and the full name checks, which accept it or refuse it."""
    name = str(manifest)
    dirs.clear()
    dirs[""] = 1
    scan = _SCANNER
    batch: list[Row] = []
    files = False  # whether any line named a file (an empty manifest is refused: no_files_error)
    for number, text in iter_manifest_lines(name):
        try:
            doc, end = scan(text, 0) if text[:1] == "{" else (None, -1)
        except (StopIteration, ValueError, RecursionError):
            doc, end = None, -1
        if end == len(text) and type(doc) is dict:
            path, etag, size = doc.get("path"), doc.get("etag"), doc.get("size")
            if (type(path) is str and type(etag) is str and etag and type(size) is int and 0 <= size <= MAX_SIZE
                    and path[:1] not in ("/", "")):
                parent, _, base = path.rpartition("/")
                dir_id = dirs.get(parent)
                if (dir_id is not None and base.isascii() and 0 < len(base) <= NAME_MAX
                        and base not in (".", "..") and "\x00" not in base):
                    batch.append((dir_id, base, size, etag, mtime, number))
                    files = True
                    if len(batch) >= BULK_BATCH:
                        yield batch
                        batch = []
                    continue
        rows = _checked_rows(text, number, name, mtime, dirs)
        files = files or bool(rows)  # a line's rows end with its file's
        batch.extend(rows)
    if not files:
        raise no_files_error(name)
    yield batch


def _checked_rows(text: str, number: int, name: str, mtime: float, dirs: dict[str, int]) -> list[Row]:
    """The rows of one line through the full checks (a line the fast path did not take)."""
    entry = parse_line(text, number, name)
    if entry is None:
        return []
    where = f"manifest {name} line {number}"
    if entry.etag is None or entry.size is None:
        raise ManifestError(f"{where}: a pinned mount needs a JSON line with \"path\", \"etag\" and \"size\" "
                            f"(as 'cachefs snapshot' writes)")
    path = entry.path
    parent, _, base = path.rpartition("/")
    problem = _component_problem(base if parent in dirs and not path.startswith("/") else path)
    if problem is not None:
        raise ManifestError(f"{where}: path {path!r} {problem}")
    rows: list[Row] = []
    if parent not in dirs:
        parts = parent.split("/")
        for depth in range(len(parts)):
            directory = "/".join(parts[: depth + 1])
            if directory not in dirs:
                dirs[directory] = len(dirs) + 1
                up, _, leaf = directory.rpartition("/")
                rows.append((dirs[up], leaf, None, None, None, number))
    rows.append((dirs[parent], base, entry.size, entry.etag, mtime, number))
    return rows


def _stat_signature(manifest: Path) -> str:
    """What identifies the manifest file's current bytes without reading them: device, inode, size,
    mtime and ctime (the kernel sets ctime at every change of the file, and nothing can set it back)."""
    try:
        st = manifest.stat()
    except FileNotFoundError:
        raise ManifestError(f"manifest {manifest} does not exist") from None
    except OSError as exc:
        raise ManifestError(f"cannot read manifest {manifest}: {exc.strerror or exc}") from None
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def open_manifest_index(manifest: Path, cache_dir: Path) -> MetadataIndex:
    """The pinned index of ``manifest`` in ``cache_dir``: reused if this manifest was imported
    before, else imported now (``ManifestError`` naming the line of the first problem).

    A remount of the very same file (same inode, size, mtime and ctime as when it was imported or
    last hashed) opens its index at once; any other file is hashed first, and an index of the same
    bytes is reused."""
    signature = _stat_signature(manifest)
    for existing in sorted(cache_dir.glob(f"{MANIFEST_INDEX_PREFIX}*.db")):
        index = MetadataIndex(existing, max_entries=2**62)
        if index.meta("manifest_stat") == signature and index.meta("manifest") is not None:
            return index
        index.close()
    digest = manifest_digest(manifest)
    target = cache_dir / f"{MANIFEST_INDEX_PREFIX}{digest[:32]}.db"
    if target.exists():
        index = MetadataIndex(target, max_entries=2**62)
        if index.meta("manifest") == digest:
            index.set_meta("manifest_stat", signature)
            return index
        index.close()
    for old in cache_dir.glob(f"{MANIFEST_INDEX_PREFIX}*"):
        old.unlink(missing_ok=True)
    temporary = target.with_name(target.name + ".tmp")
    for suffix in ("", "-wal", "-shm", "-journal"):
        Path(f"{temporary}{suffix}").unlink(missing_ok=True)
    mtime = manifest.stat().st_mtime
    index = MetadataIndex(temporary, max_entries=2**62, bulk=True)
    try:
        try:
            dirs: dict[str, int] = {}
            index.bulk_load(manifest_rows(manifest, mtime, dirs), dirs, fetched_at=0.0)
        except DuplicateEntryError as exc:
            raise ManifestError(f"manifest {manifest} line {exc.line}: {exc.name!r} is given twice, or both as a "
                                f"file and as a directory of other paths") from None
        if _stat_signature(manifest) != signature:
            raise ManifestError(f"manifest {manifest} changed while it was imported: mount again")
        # The complete marker (set last): an index whose "manifest" is not this digest is never used.
        index.set_meta("manifest_stat", signature)
        index.set_meta("manifest", digest)
        index.close()
        # The import wrote without syncs: make it durable before it can be found under its name.
        fd = os.open(temporary, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        index.close()
        for suffix in ("", "-wal", "-shm", "-journal"):
            Path(f"{temporary}{suffix}").unlink(missing_ok=True)
        raise
    os.replace(temporary, target)
    _fsync_dir(cache_dir)
    return MetadataIndex(target, max_entries=2**62)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
