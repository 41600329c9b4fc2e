"""Mounts pinned to a manifest (``cachefs mount --manifest``): the namespace from the manifest.

``open_manifest_index`` turns a manifest (JSON lines as ``cachefs snapshot`` writes them, plain or
gzip) into a metadata index (``cachefs.fs.metaindex``) holding every directory of the dataset, and
the listing cache serves it as ``pinned``: nothing expires and the store is never listed. Each file
keeps the manifest's ETag and size, so every read is a GET with ``If-Match`` on that ETag: an object
changed in the bucket answers ESTALE (``ObjectChangedError``, logged with its key), never other bytes.

The manifest is read as a stream and loaded in one SQLite transaction into a temporary file that is
renamed into place when complete (a crash mid-import leaves no index, and the next mount imports
again). The index is named by the manifest's SHA-256, so remounting the same manifest opens it at
once; an index of another manifest is deleted first (one per source cache directory).

Every line must be a JSON object with ``path``, ``etag`` and ``size`` (a plain path line has no
version to pin), the path a valid mount-relative path; a path given twice, or both as a file and as a
directory of other paths, is refused. Any problem is a ``ManifestError`` naming the file and the line,
and the mount is refused: a half-read manifest would be a silently partial dataset. Files show the
manifest file's mtime (the manifest records none).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

from cachefs.fs.metaindex import DuplicateEntryError, Entry, MetadataIndex
from cachefs.manifest import ManifestError, iter_manifest_lines, parse_line
from cachefs.names import name_problem
from tiering.protocols import ObjectInfo

MANIFEST_INDEX_PREFIX = "manifest-"
# Bytes read at a time while hashing a manifest.
_HASH_CHUNK = 1 << 20


def manifest_digest(path: Path) -> str:
    """SHA-256 of the manifest file's bytes (compressed or not), hex."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as handle:
            while chunk := handle.read(_HASH_CHUNK):
                digest.update(chunk)
    except FileNotFoundError:
        raise ManifestError(f"manifest {path} does not exist") from None
    except IsADirectoryError:
        raise ManifestError(f"manifest {path} is a directory") from None
    except OSError as exc:
        raise ManifestError(f"cannot read manifest {path}: {exc.strerror or exc}") from None
    return digest.hexdigest()


def _component_problem(path: str) -> str | None:
    if path.startswith("/"):
        return "must be relative to the mount root (no leading '/')"
    for part in path.split("/"):
        if part in ("", ".", ".."):
            return "has an empty, '.' or '..' component"
        problem = name_problem(part)
        if problem is not None:
            return f"is not a valid name in the mount ({problem.reason})"
    return None


def manifest_rows(manifest: Path, mtime: float) -> Iterator[tuple[str, str, Entry, int]]:
    """``(dir, name, entry, line)`` rows of a manifest: its files, and each directory they imply
    (once, dated by the first line that implies it). ``ManifestError`` on the first bad line."""
    name = str(manifest)
    seen_dirs: set[str] = {""}
    for number, text in iter_manifest_lines(name):
        entry = parse_line(text, number, name)
        if entry is None:
            continue
        where = f"manifest {name} line {number}"
        if entry.etag is None or entry.size is None:
            raise ManifestError(f"{where}: a pinned mount needs a JSON line with \"path\", \"etag\" and \"size\" "
                                f"(as 'cachefs snapshot' writes)")
        path = entry.path
        parent, _, base = path.rpartition("/")
        problem = _component_problem(base if parent in seen_dirs and not path.startswith("/") else path)
        if problem is not None:
            raise ManifestError(f"{where}: path {path!r} {problem}")
        if parent not in seen_dirs:
            parts = parent.split("/")
            for depth in range(len(parts)):
                directory = "/".join(parts[: depth + 1])
                if directory not in seen_dirs:
                    seen_dirs.add(directory)
                    up, _, leaf = directory.rpartition("/")
                    yield up, leaf, None, number
        yield parent, base, ObjectInfo(path, entry.size, entry.etag, mtime), number


def open_manifest_index(manifest: Path, cache_dir: Path) -> MetadataIndex:
    """The pinned index of ``manifest`` in ``cache_dir``: reused if this manifest was imported
    before, else imported now (``ManifestError`` naming the line of the first problem)."""
    digest = manifest_digest(manifest)
    target = cache_dir / f"{MANIFEST_INDEX_PREFIX}{digest[:32]}.db"
    if target.exists():
        index = MetadataIndex(target, max_entries=2**62)
        if index.meta("manifest") == digest:
            return index
        index.close()
    for old in cache_dir.glob(f"{MANIFEST_INDEX_PREFIX}*"):
        old.unlink(missing_ok=True)
    temporary = target.with_name(target.name + ".tmp")
    for suffix in ("", "-wal", "-shm"):
        Path(f"{temporary}{suffix}").unlink(missing_ok=True)
    mtime = manifest.stat().st_mtime
    index = MetadataIndex(temporary, max_entries=2**62)
    try:
        try:
            index.bulk_load(manifest_rows(manifest, mtime), fetched_at=0.0)
        except DuplicateEntryError as exc:
            raise ManifestError(f"manifest {manifest} line {exc.line}: {exc.name!r} is given twice, or both as a "
                                f"file and as a directory of other paths") from None
        index.set_meta("manifest", digest)
    except BaseException:
        index.close()
        for suffix in ("", "-wal", "-shm"):
            Path(f"{temporary}{suffix}").unlink(missing_ok=True)
        raise
    index.close()
    for suffix in ("-wal", "-shm"):
        Path(f"{temporary}{suffix}").unlink(missing_ok=True)
    os.replace(temporary, target)
    return MetadataIndex(target, max_entries=2**62)
