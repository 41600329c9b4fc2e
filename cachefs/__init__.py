"""cachefs: a FUSE filesystem over tiering, in floors, each importing only those below it.

    cli/      the ``cachefs`` command; talks to a running mount through ``client`` only
    admin     what the CSI driver needs besides mounting (validation, bucket administration)
    daemon/   one process per mount: wiring, control API, features (write-back, prefetch jobs,
              metrics), the /stats document
    fuse/     the kernel's FUSE protocol, spoken by cachefs itself: wire, session, adapter
    fs/       POSIX semantics: CacheFS over its inode table, listing cache, handles, rename
    loader    what a data loader calls to announce its read order (a client of the daemon)
    client, manifest, paths, names, mounts, settings, handover, backing, tuning
              small leaf modules the floors above share

The order is checked by an import-linter ``layers`` contract (pyproject.toml).

The import package is ``cachefs``; the distribution is published as ``cachefs-fuse``, because the
PyPI name ``cachefs`` belongs to an unrelated project (README, "Install the tool only").
"""

from __future__ import annotations

DISTRIBUTION = "cachefs-fuse"
UNKNOWN_VERSION = "0.0.0+unknown"


def package_version() -> str:
    """The installed distribution's version, or UNKNOWN_VERSION when run from a bare source tree."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return UNKNOWN_VERSION
