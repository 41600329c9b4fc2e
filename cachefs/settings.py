"""Typed, frozen settings of one mount, validated when built. Only the CLI reads argv and environ."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from tiering.objectstore import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_READ_TIMEOUT_S
from tiering.settings import MAX_CONCURRENT_FETCHES, CacheSettings
from tiering.writeback.settings import WriteBackSettings

# Metadata TTLs. Training datasets are written once and read for many epochs, so a minute of
# staleness costs nothing and saves a LIST per directory per minute; users who need fresher views
# lower them (0 disables caching).
DEFAULT_ATTR_TTL_S = 60.0
DEFAULT_DIR_TTL_S = 60.0
# Longest TTL accepted (a day): beyond it a "cache" is a snapshot; the CSI volume attributes use the
# same bound.
MAX_TTL_S = 86400.0
# Negative lookups (a name that does not exist) are answered from the cached listing of the parent
# for the same TTL as the listing, because they come from it.

DEFAULT_STATS_ADDR = "127.0.0.1:9750"


# Renaming a directory renames every object below it (a server-side copy and a delete each, for
# those already in the store). 10,000 entries take well under a minute against S3 with 16 copies in
# flight; beyond that a rename would hold up the caller (and the FUSE request) for minutes, so it is
# refused with E2BIG and a log line, and ``--rename-dir-limit`` raises the bound deliberately.
DEFAULT_RENAME_DIR_LIMIT = 10_000


@dataclass(frozen=True)
class FsSettings:
    attr_ttl_s: float = DEFAULT_ATTR_TTL_S
    dir_ttl_s: float = DEFAULT_DIR_TTL_S
    uid: int = field(default_factory=os.getuid)
    gid: int = field(default_factory=os.getgid)
    # None: 0o444/0o555 on a read-only mount, 0o644/0o755 on a writable one.
    file_mode: int | None = None
    dir_mode: int | None = None
    read_only: bool = False
    rename_dir_limit: int = DEFAULT_RENAME_DIR_LIMIT

    def __post_init__(self) -> None:
        for name in ("attr_ttl_s", "dir_ttl_s"):
            value = getattr(self, name)
            if not 0 <= value <= MAX_TTL_S:
                raise ValueError(f"{name.replace('_s', '').replace('_', '-')} must be between 0 and {MAX_TTL_S:g} seconds")
        if not 0 <= self.rename_dir_limit <= 10_000_000:
            raise ValueError("rename-dir-limit must be between 0 and 10000000 entries")
        if self.file_mode is None:
            object.__setattr__(self, "file_mode", 0o444 if self.read_only else 0o644)
        if self.dir_mode is None:
            object.__setattr__(self, "dir_mode", 0o555 if self.read_only else 0o755)


@dataclass(frozen=True)
class MountSettings:
    source: str
    mountpoint: Path
    cache_dir: Path
    endpoint_url: str | None = None
    cache: CacheSettings = field(default_factory=CacheSettings)
    fs: FsSettings = field(default_factory=FsSettings)
    writeback: WriteBackSettings = field(default_factory=WriteBackSettings)
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    stats_addr: str | None = None
    allow_other: bool = False
    log_level: str = "INFO"

    def source_cache_dir(self) -> Path:
        """This source's own directory inside ``cache_dir`` (mounts of other sources may share it)."""
        identity = json.dumps({"source": self.source, "endpoint": self.endpoint_url or ""}, sort_keys=True)
        return self.cache_dir / hashlib.sha256(identity.encode()).hexdigest()[:16]
