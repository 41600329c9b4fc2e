"""cachefs: a tiered (RAM -> local disk -> object store) FUSE cache for ML training data.

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
