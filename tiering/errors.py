"""Domain errors of the data engine. Each carries the errno the filesystem edge should answer with.

Errors become errno once, at the FUSE edge (``cachefs.fuse.adapter``); below it code raises these.
"""

from __future__ import annotations

import errno


class CacheError(Exception):
    """Base class: every engine error knows its errno."""

    errno: int = errno.EIO


class ObjectStoreError(CacheError):
    """The object store failed (network, server error, timeout)."""

    errno = errno.EIO


class ObjectStoreUnavailableError(ObjectStoreError):
    """The endpoint could not be reached, or did not answer within the bounded timeout."""

    errno = errno.EIO


class ObjectNotFoundError(ObjectStoreError):
    """The key (or the bucket) does not exist."""

    errno = errno.ENOENT


class AccessDeniedError(ObjectStoreError):
    """Credentials are missing, wrong, or lack permission."""

    errno = errno.EACCES


class ObjectChangedError(ObjectStoreError):
    """The object's ETag is no longer the one the caller asked for (it was overwritten)."""

    errno = errno.ESTALE


class ReadOnlySourceError(ObjectStoreError):
    """A write to a source cachefs only reads (the fsspec sources: ``tiering.objectstore.fsspec_store``)."""

    errno = errno.EROFS


class InvalidRangeError(CacheError):
    """A read asked for bytes outside the object."""

    errno = errno.EINVAL


class TierError(CacheError):
    """A cache tier failed. Never reaches a reader: the engine turns it into a miss."""

    errno = errno.EIO
