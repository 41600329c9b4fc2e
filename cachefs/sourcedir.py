"""Which directory of the cache root holds a source's cache, however the source is spelt.

A source's cache directory is named by ``cachefs.settings.source_hash``: a hash of its canonical URL
and endpoint, so ``s3://b/p``, ``s3://b/p/`` and ``s3://b/p`` with AWS's endpoint spelt out share one
directory (its warm disk tier, its metadata, its staged writes). Before that, the name was a hash of
the URL exactly as typed; such a directory may hold the only copy of acknowledged changes that a
crash or ``unmount --force`` left staged. ``find_source_dir`` finds it by what it says it caches (its
``source.json``, which every daemon writes) and the mount uses it under its old name, so those changes
are replayed and uploaded by the next mount whatever spelling it uses. Nothing is moved or renamed:
the directory's name is also its volume in the cluster store's write-back journals.

Which one, when several directories cache the same source: the one holding staged changes (the
others hold only clean, re-fetchable data); with none holding any, the canonical one if it exists,
else the most recently used. Two holding staged changes is refused with one line: their changes
must be uploaded one directory at a time, and the line says how.

Only directories that can be trusted are read: real directories (not symlinks) owned by the user,
``source.json`` opened without following a symlink and read to a bounded size (``tiering.private``).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from cachefs.settings import legacy_source_hash, source_hash, source_identity
from tiering.private import open_private
from tiering.writeback.journal import RECORD_SUFFIX, RECORDS_DIR

# The write-back staging area inside a source's directory (cachefs.daemon.writeback uses this name).
STAGING_DIRNAME = "staging"
SOURCE_FILENAME = "source.json"
# source.json is two short fields; anything larger is not one of ours.
MAX_SOURCE_FILE_BYTES = 64 * 1024


class SourceDirError(ValueError):
    """Several directories hold staged changes of one source. One-line message."""


def staged_changes(directory: Path) -> int:
    """How many journaled changes (one per object key) ``directory``, a source's cache directory,
    holds that are not in the object store yet."""
    return staged_records(directory / STAGING_DIRNAME)


def staged_records(staging: Path) -> int:
    """The records of the write-back journal in ``staging`` (a source cache directory's ``staging/``)."""
    try:
        with os.scandir(staging / RECORDS_DIR) as entries:
            return sum(1 for entry in entries if entry.name.endswith(RECORD_SUFFIX))
    except OSError:
        return 0


def has_staged_changes(directory: Path) -> bool:
    """Whether ``directory`` (a source's cache directory) holds journaled changes not yet uploaded."""
    return staged_changes(directory) > 0


def recorded_identity(directory: Path) -> str | None:
    """The identity of the source ``directory``'s ``source.json`` names, or None if it names none."""
    try:
        fd = open_private(directory / SOURCE_FILENAME, os.O_RDONLY)
    except OSError:
        return None
    try:
        data = os.read(fd, MAX_SOURCE_FILE_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(data) > MAX_SOURCE_FILE_BYTES:
        return None
    try:
        body = json.loads(data)
        source, endpoint = body["source"], body.get("endpoint_url")
    except (ValueError, TypeError, KeyError):
        return None
    if not isinstance(source, str) or not (endpoint is None or isinstance(endpoint, str)):
        return None
    return source_identity(source, endpoint)


def _own_directories(root: Path) -> list[Path]:
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    found = []
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
            found.append(Path(entry.path))
    return found


def find_source_dir(root: Path, source: str, endpoint_url: str | None) -> str:
    """The name of the directory in the cache root ``root`` that caches ``source`` (see the module's
    docstring); ``source_hash`` when there is none yet. Raises ``SourceDirError``."""
    canonical = source_hash(source, endpoint_url)
    identity = source_identity(source, endpoint_url)
    exact_legacy = legacy_source_hash(source, endpoint_url)
    candidates = []
    for directory in _own_directories(root):
        if directory.name == canonical:
            candidates.append(directory)
        elif directory.name == exact_legacy or recorded_identity(directory) == identity:
            candidates.append(directory)
    if not candidates:
        return canonical
    staged = [d for d in candidates if has_staged_changes(d)]
    if len(staged) > 1:
        names = " and ".join(str(d) for d in sorted(staged))
        raise SourceDirError(
            f"{names} both hold changes staged for {source} (under two spellings of it, by an older cachefs); "
            f"upload them one at a time: move all but one out of {root}, mount, unmount, then move the next back")
    if staged:
        return staged[0].name
    if any(d.name == canonical for d in candidates):
        return canonical
    return max(candidates, key=_last_used).name


def _last_used(directory: Path) -> float:
    try:
        return (directory / SOURCE_FILENAME).stat().st_mtime
    except OSError:
        return 0.0
