"""The mount's metadata index: listings on disk, or the namespace of a pinned manifest.

A normal mount opens (or creates) ``metadata.db`` in its source cache directory
(``cachefs.fs.metaindex``): listings from earlier mounts answer while younger than ``--dir-ttl``.
A mount with ``--manifest FILE`` imports the manifest into its own index (``cachefs.fs.pinned``)
before the kernel mount; with ``--manifest-key KEY`` the manifest is first fetched from the source
itself (one HEAD and ranged GETs pinned to the ETag the HEAD saw), which is what the CSI volume
attribute ``manifest`` asks for. Any problem with the manifest refuses the mount with one line.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
from pathlib import Path

from cachefs.daemon.errors import SetupError
from cachefs.fs.metaindex import INDEX_FILENAME, MetadataIndex
from cachefs.fs.pinned import open_manifest_index
from cachefs.manifest import ManifestError
from cachefs.settings import MountSettings
from tiering.errors import CacheError
from tiering.protocols import ObjectStore

log = logging.getLogger(__name__)

# A manifest fetched from the source is read in ranges of this size (8 MiB: a few GETs for a
# 1 M-line manifest, little memory) and must answer each within the store's usual read deadline.
MANIFEST_CHUNK = 8 * 1024 * 1024
# Where a fetched manifest is kept in the source cache dir (replaced at every such mount).
FETCHED_MANIFEST = "manifest.fetched"


async def fetch_manifest(store: ObjectStore, key: str, target: Path) -> Path:
    """Copy object ``key`` of the source to ``target`` (through a temporary file); SetupError if not."""
    try:
        info = await store.head(key)
        temporary = target.with_name(target.name + ".tmp")
        with open(temporary, "wb") as out:
            for start in range(0, info.size, MANIFEST_CHUNK):
                data = await store.get_range(key, info.etag, start, min(info.size, start + MANIFEST_CHUNK))
                await asyncio.to_thread(out.write, data)
        os.replace(temporary, target)
    except CacheError as exc:
        raise SetupError(f"cannot fetch manifest {key!r} from the source: {exc}") from exc
    except OSError as exc:
        raise SetupError(f"cannot store manifest {key!r} in {target.parent}: {exc.strerror or exc}") from exc
    return target


# Meta key of a normal mount's index: "1" when the daemon that last used it stopped cleanly with no
# write-back change left to upload. Set to "0" while a daemon runs.
CLEAN_EXIT_KEY = "clean_exit"


def _trust_only_a_clean_exit(index: MetadataIndex) -> None:
    """Drop the stored listings unless the last daemon stopped cleanly with nothing left to upload.

    A daemon killed (kill -9, OOM, a node crash) may have uploaded changes whose patch never reached
    the index, and the next daemon uploads what the dead one left staged before the filesystem (and
    so the index's patching) is up: listings stored before either would hide objects the bucket
    holds until --dir-ttl ran out. After a clean stop the index matches every upload it knew of.
    """
    stored = index.directories()
    if index.meta(CLEAN_EXIT_KEY) != "1" and stored:
        log.info("metadata index: the last daemon did not stop cleanly or left uploads pending; its %d stored "
                 "listings are listed again", stored)
        index.forget_under("")
    index.set_meta(CLEAN_EXIT_KEY, "0")


def mark_clean_exit(index: MetadataIndex) -> None:
    """Record that this daemon stopped cleanly with nothing left to upload (see ``open_index``)."""
    index.set_meta(CLEAN_EXIT_KEY, "1")


async def open_index(settings: MountSettings, store: ObjectStore, cache_dir: Path) -> tuple[MetadataIndex | None, bool]:
    """The mount's index (None: its file cannot be written) and whether it is pinned to a manifest.
    SetupError for a bad manifest."""
    manifest = settings.manifest
    if settings.manifest_key is not None:
        manifest = await fetch_manifest(store, settings.manifest_key, cache_dir / FETCHED_MANIFEST)
    if manifest is None:
        index = await asyncio.to_thread(MetadataIndex, cache_dir / INDEX_FILENAME)
        try:
            await asyncio.to_thread(_trust_only_a_clean_exit, index)
        except sqlite3.OperationalError as exc:
            # Its file cannot be written (a full disk): listings come from the store this time. An
            # index is an optimisation; the mount must come up, not least to upload pending writes.
            log.warning("metadata index %s cannot be written (%s): this mount lists from the store only",
                        cache_dir / INDEX_FILENAME, exc)
            await asyncio.to_thread(index.close)
            return None, False
        return index, False
    try:
        index = await asyncio.to_thread(open_manifest_index, manifest, cache_dir)
    except ManifestError as exc:
        raise SetupError(str(exc)) from None
    log.info("pinned to manifest %s: %d entries", settings.manifest_key or manifest, index.total_entries)
    return index, True
