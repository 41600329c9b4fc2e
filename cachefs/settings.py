"""Typed, frozen settings of one mount, validated when built. Only the CLI reads argv and environ."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from tiering.objectstore import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_READ_TIMEOUT_S, parse_source
from tiering.settings import (
    DEFAULT_CLUSTER_TIMEOUT_S,
    DEFAULT_WRITE_BEHIND_BLOCKS,
    DEFAULT_WRITE_BEHIND_BYTES,
    MAX_CONCURRENT_FETCHES,
    CacheSettings,
)
from tiering.writeback.settings import DURABILITY_CLUSTER, WriteBackSettings
# Re-exported for the CSI driver's mount pods (their grace period), which may not import tiering.
from tiering.writeback.settings import DEFAULT_STOP_TIMEOUT_S as DEFAULT_STOP_TIMEOUT_S
from tiering.writeback.settings import STOP_MARGIN_S as STOP_MARGIN_S

# Metadata TTLs. Training datasets are written once and read for many epochs, so a minute of
# staleness costs nothing and saves a LIST per directory per minute; users who need fresher views
# lower them (0 disables caching).
DEFAULT_ATTR_TTL_S = 60.0
DEFAULT_DIR_TTL_S = 60.0
# Longest TTL accepted (a day): beyond it a "cache" is a snapshot; the CSI volume attributes use the
# same bound.
MAX_TTL_S = 86400.0
# Threads that read and answer one mount's requests (``cachefs mount --fuse-threads``), each on its
# own clone of the /dev/fuse descriptor; 1: the asyncio loop reads them. 2 by default: measured on the
# 2-core VM (benchmarks/fuse_clone.py --daemon, docs/dataplane.md "Several readers of one mount"), 2
# halve the busiest thread's CPU per warm file, per GiB re-read and per GiB of page-cache refill in
# every round, at about the same total (rates moved both ways, mostly up): what moves to the second
# core is the system calls (they release the GIL). Every FUSE, CSI and integration suite that mounts
# has run with 2. At most 32: the Python work of all of them is one thread's at a time (the GIL and
# the state lock), so past a few more readers only wait.
DEFAULT_FUSE_THREADS = 2
MAX_FUSE_THREADS = 32
# Negative lookups (a name that does not exist) are answered from the cached listing of the parent
# for the same TTL as the listing, because they come from it.

# Metadata deadline: each store request a listing or an attribute refresh makes (botocore's retries
# included) must answer within this, or the store is taken as unreachable and the cached (stale)
# listing is served, or EIO where there is none. A LIST page or HEAD answers in tens of milliseconds
# in-region and well under a second from a loaded store; 5 s tolerates that while a frozen store
# (connections accepted, never answered) costs a stat or an ls at most 5 s, once per outage.
DEFAULT_METADATA_TIMEOUT_S = 5.0

DEFAULT_STATS_ADDR = "127.0.0.1:9750"


# Renaming a directory renames every object below it (a server-side copy and a delete each, for
# those already in the store). 10,000 entries take well under a minute against S3 with 16 copies in
# flight; beyond that a rename would hold up the caller (and the FUSE request) for minutes, so it is
# refused with E2BIG and a log line, and ``--rename-dir-limit`` raises the bound deliberately.
DEFAULT_RENAME_DIR_LIMIT = 10_000


# Owner and modes every file and directory shows (``--uid``/``--gid``/``--file-mode``/``--dir-mode``,
# the names mount-s3 uses). An object store keeps no owners or modes, so the mount shows one owner and
# one mode per kind; the kernel checks access against them (FUSE ``default_permissions``). The
# largest id is 2^32 - 2: 2^32 - 1 is ``(uid_t) -1``, which chown(2) reads as "leave unchanged".
MAX_ID = 2**32 - 2
MAX_MODE = 0o7777
DEFAULT_FILE_MODE, DEFAULT_DIR_MODE = 0o644, 0o755
READ_ONLY_FILE_MODE, READ_ONLY_DIR_MODE = 0o444, 0o555


def check_id(name: str, value: object) -> int:
    """``value`` as a uid or gid, or ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_ID:
        raise ValueError(f"{name} must be a whole number from 0 to {MAX_ID}, got {value!r}")
    return value


def check_mode(name: str, value: object) -> int:
    """``value`` as permission bits (0 to 0o7777), or ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_MODE:
        shown = f"{value:o}" if isinstance(value, int) and not isinstance(value, bool) else repr(value)
        raise ValueError(f"{name} must be an octal mode from 0 to 7777, got {shown}")
    return value


def parse_mode(name: str, text: str) -> int:
    """An octal mode as users type it (``644``, ``0644``, ``0o644``), or ``ValueError`` naming ``name``."""
    body = text.strip().lower().removeprefix("0o")
    if not body or any(ch not in "01234567" for ch in body):
        raise ValueError(f"{name} must be an octal mode such as 0644, got {text!r}")
    return check_mode(name, int(body, 8))


def parse_id(name: str, text: str) -> int:
    """A numeric uid or gid, or ``ValueError`` naming ``name`` (names are not looked up: a pod's user
    often exists only in its image)."""
    body = text.strip()
    if not body.isdigit():
        raise ValueError(f"{name} must be a numeric id from 0 to {MAX_ID}, got {text!r}")
    return check_id(name, int(body))


@dataclass(frozen=True)
class FsSettings:
    attr_ttl_s: float = DEFAULT_ATTR_TTL_S
    dir_ttl_s: float = DEFAULT_DIR_TTL_S
    uid: int = field(default_factory=os.getuid)  # the owner every entry shows (default: the mounting user)
    gid: int = field(default_factory=os.getgid)
    # None: 0o444/0o555 on a read-only mount, 0o644/0o755 on a writable one.
    file_mode: int | None = None
    dir_mode: int | None = None
    read_only: bool = False
    # Every open answers FUSE with direct_io: reads and writes bypass the mount's page cache, and every
    # read reaches the daemon (``--direct-io``; docs/configuration.md says when that pays).
    direct_io: bool = False
    # A read-only mount lets the kernel read files whole on the disk tier itself (FUSE passthrough,
    # where the kernel and the privilege allow it); ``--no-passthrough`` has the daemon serve every read.
    passthrough: bool = True
    rename_dir_limit: int = DEFAULT_RENAME_DIR_LIMIT
    metadata_timeout_s: float = DEFAULT_METADATA_TIMEOUT_S
    # A listed file's mtime is read from its ``mtime`` metadata by a HEAD, once per version
    # (``--mtime-from-metadata``); off: the writer's mtime only where this mount set or saw it.
    mtime_from_metadata: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.metadata_timeout_s <= 600:
            raise ValueError(f"--metadata-timeout {self.metadata_timeout_s:g} must be more than 0 and at most 600 seconds")
        for name in ("attr_ttl_s", "dir_ttl_s"):
            value = getattr(self, name)
            if not 0 <= value <= MAX_TTL_S:
                raise ValueError(f"--{name.replace('_s', '').replace('_', '-')} {value:g} must be between 0 and "
                                 f"{MAX_TTL_S:g} seconds")
        if not 0 <= self.rename_dir_limit <= 10_000_000:
            raise ValueError(f"--rename-dir-limit {self.rename_dir_limit} must be between 0 and 10000000 entries")
        check_id("uid", self.uid)
        check_id("gid", self.gid)
        if self.file_mode is None:
            object.__setattr__(self, "file_mode", READ_ONLY_FILE_MODE if self.read_only else DEFAULT_FILE_MODE)
        if self.dir_mode is None:
            object.__setattr__(self, "dir_mode", READ_ONLY_DIR_MODE if self.read_only else DEFAULT_DIR_MODE)
        check_mode("file-mode", self.file_mode)
        check_mode("dir-mode", self.dir_mode)


# Every object of a cluster store is authenticated with the cluster key (``tiering.clusterkey``).
MISSING_CLUSTER_KEY = ("--cluster-cache needs --cluster-key-file FILE (or CACHEFS_CLUSTER_KEY_FILE): a secret of at "
                       "least 32 random bytes that only the mounts sharing the cluster store hold, e.g. "
                       "`head -c 32 /dev/urandom > FILE` (docs/security.md, 'Multi-tenant clusters')")


@dataclass(frozen=True)
class ClusterSettings:
    """The shared cluster tier (``--cluster-cache``): a second S3 store, its own endpoint and profile.

    Credentials come from the AWS chain (or the named profile), never from here."""

    url: str  # s3://BUCKET[/PREFIX]
    endpoint_url: str | None = None
    profile: str | None = None
    timeout_s: float = DEFAULT_CLUSTER_TIMEOUT_S
    write_behind_bytes: int = DEFAULT_WRITE_BEHIND_BYTES
    write_behind_blocks: int = DEFAULT_WRITE_BEHIND_BLOCKS
    # The cluster key (``tiering.clusterkey``): every object of the store is authenticated with it.
    # A path, never the key: the daemon reads it at start-up. Required to mount with a cluster tier.
    key_file: Path | None = None

    def __post_init__(self) -> None:
        if not self.url.startswith("s3://"):
            raise ValueError(f"--cluster-cache must be s3://BUCKET[/PREFIX], got {self.url!r}")
        try:
            parse_source(self.url)
        except ValueError as exc:
            raise ValueError(f"--cluster-cache: {exc}") from None
        if self.endpoint_url is not None and not self.endpoint_url.startswith(("http://", "https://")):
            raise ValueError(f"invalid cluster endpoint URL {self.endpoint_url!r}: expected http:// or https://")
        if self.profile is not None and (not self.profile.strip() or any(c.isspace() for c in self.profile)):
            raise ValueError(f"invalid --cluster-profile {self.profile!r}: expected a profile name")
        if not 0 < self.timeout_s <= 600:
            raise ValueError(f"--cluster-timeout {self.timeout_s:g} must be more than 0 and at most 600 seconds")
        if self.write_behind_bytes < 1 or self.write_behind_blocks < 1:
            raise ValueError("the cluster write-behind queue needs room for at least one block")

    def environ(self, environ: dict[str, str]) -> dict[str, str]:
        """The environment the cluster store's credential chain reads: the mount's, with the named
        profile (and without the mount's key variables, which would win over any profile)."""
        env = dict(environ)
        if self.profile is not None:
            for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
                env.pop(name, None)
            env["AWS_PROFILE"] = self.profile
        return env


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
    exit_stats_file: Path | None = None  # the last counters, written at exit (--exit-stats-file)
    allow_other: bool = False
    log_level: str = "INFO"
    cluster: ClusterSettings | None = None
    # A /dev/fuse descriptor already mounted at ``mountpoint`` by a privileged process and handed to
    # this daemon (``cachefs mount --fuse-fd-socket``, ``cachefs.handover``); None: the daemon mounts.
    fuse_fd: int | None = None
    # Clones of that descriptor's connection the privileged process opened for this daemon's readers
    # (``--fuse-threads``): used before the session opens any itself (a mount pod has no /dev/fuse).
    fuse_clones: tuple[int, ...] = ()
    # The node plugin's backing-file broker for passthrough (``cachefs mount --backing-broker``,
    # ``cachefs.backing``), used when this daemon may not register backing files itself.
    backing_broker: Path | None = None
    # A mount pinned to a manifest (cachefs.fs.pinned): a local file, or a key in the source itself
    # (fetched at mount; the CSI volume attribute ``manifest``). Read-only.
    manifest: Path | None = None
    manifest_key: str | None = None
    # This node's name in the cluster store's write-back journals (--write-durability cluster).
    node_id: str = "node"
    # The name of this source's directory inside ``cache_dir`` when it is not ``source_label()``: one an
    # older cachefs named after another spelling of the source (``cachefs.sourcedir``, found by the CLI).
    source_dir_name: str | None = None
    # Threads reading the mount's requests, each on a clone of the /dev/fuse descriptor (``--fuse-threads``).
    fuse_threads: int = DEFAULT_FUSE_THREADS

    def __post_init__(self) -> None:
        if not 1 <= self.fuse_threads <= MAX_FUSE_THREADS:
            raise ValueError(f"--fuse-threads {self.fuse_threads} must be between 1 and {MAX_FUSE_THREADS}")
        if self.writeback.durability == DURABILITY_CLUSTER:
            if self.fs.read_only:
                raise ValueError("--write-durability cluster applies to writable mounts only")
            if self.cluster is None:
                raise ValueError("--write-durability cluster needs a cluster tier: give --cluster-cache "
                                 "s3://BUCKET[/PREFIX]")
        if not self.node_id or any(not (c.isalnum() or c in "-_.") for c in self.node_id) or len(self.node_id) > 128:
            raise ValueError(f"--node-id must be 1-128 letters, digits, '-', '_' or '.', got {self.node_id!r}")
        if self.manifest is not None and self.manifest_key is not None:
            raise ValueError("give --manifest or --manifest-key, not both")
        if (self.manifest is not None or self.manifest_key is not None) and not self.fs.read_only:
            raise ValueError("a mount pinned to a manifest is read-only")
        if self.manifest_key is not None and (not self.manifest_key or self.manifest_key.startswith("/")
                                              or self.manifest_key.endswith("/")):
            raise ValueError(f"--manifest-key must be an object key relative to the source, got {self.manifest_key!r}")
        if self.cluster is not None and self.cluster.timeout_s >= self.cache.fetch_timeout_s:
            raise ValueError(f"--cluster-timeout ({self.cluster.timeout_s:g} s) must be shorter than --fetch-timeout "
                             f"({self.cache.fetch_timeout_s:g} s): a slow cluster store must leave time for the source")
        if self.cluster is not None and self.cluster.key_file is None:
            raise ValueError(MISSING_CLUSTER_KEY)

    def source_identity(self) -> str:
        """What names this source in the shared cluster tier: its URL and endpoint."""
        return source_identity(self.source, self.endpoint_url)

    def source_label(self) -> str:
        """A short name of this source (16 hex digits of a hash of its identity): the ``volume`` label
        of the per-volume metrics and the name of its cache directory. Every node mounting the same
        source gets the same value, so series sum across nodes; a daemon has exactly one."""
        return source_hash(self.source, self.endpoint_url)

    def source_cache_dir(self) -> Path:
        """This source's own directory inside ``cache_dir`` (mounts of other sources may share it)."""
        return self.cache_dir / (self.source_dir_name or self.source_label())


# The spellings of AWS's own S3 endpoint in the standard partition (global, regional, dual-stack,
# the legacy dash form). A general-purpose bucket name is unique across the partition and every one of
# these endpoints reaches the same bucket, so spelling one out names the same source as giving none.
# China (amazonaws.com.cn) and GovCloud are other partitions, with buckets of their own: not listed.
_AWS_S3_HOST = re.compile(r"s3(?:[.-](?:dualstack\.)?[a-z]{2}-[a-z]+-\d)?\.amazonaws\.com")
_DEFAULT_PORTS = {"http": 80, "https": 443}


def canonical_endpoint(endpoint_url: str | None) -> str:
    """The one spelling of an S3 endpoint: ``""`` for AWS's own (given or not), else
    ``scheme://host[:port][/path]`` with the scheme and host lowercased, the scheme's default port
    and any trailing ``/`` dropped. A URL that does not parse is returned as given (the mount
    refuses it with its own message)."""
    if not endpoint_url:
        return ""
    try:
        parts = urlsplit(endpoint_url.strip())
        scheme, host, port = parts.scheme.lower(), (parts.hostname or "").lower(), parts.port
    except ValueError:
        return endpoint_url
    if scheme not in _DEFAULT_PORTS or not host:
        return endpoint_url
    path = parts.path.rstrip("/")
    if scheme == "https" and port in (None, 443) and not path and _AWS_S3_HOST.fullmatch(host):
        return ""
    netloc = f"[{host}]" if ":" in host else host
    if port is not None and port != _DEFAULT_PORTS[scheme]:
        netloc += f":{port}"
    return f"{scheme}://{netloc}{path}"


def canonical_source(source: str) -> str:
    """The one spelling of a source URL (``tiering.objectstore.Source.url``): ``s3://b``, ``s3://b/``
    and ``s3://b//`` alike are ``s3://b/``; ``s3://b/p`` and ``s3://b/p/`` are ``s3://b/p/``. A URL
    that does not parse is returned as given (the mount refuses it with its own message)."""
    try:
        return parse_source(source).url
    except ValueError:
        return source


def source_identity(source: str, endpoint_url: str | None) -> str:
    """What names a source, however it was spelt: its canonical URL and canonical endpoint. The
    endpoint counts only for s3:// sources (the others ignore it)."""
    canonical = canonical_source(source)
    endpoint = canonical_endpoint(endpoint_url) if canonical.startswith("s3://") else ""
    return json.dumps({"source": canonical, "endpoint": endpoint}, sort_keys=True)


def source_hash(source: str, endpoint_url: str | None) -> str:
    """The short name of a source: its cache directory, the ``volume`` label of its metrics, and its
    volume in the cluster store's write-back journals (``cachefs recover`` finds them by it). Every
    spelling of one source (``canonical_source``, ``canonical_endpoint``) has the same hash."""
    return hashlib.sha256(source_identity(source, endpoint_url).encode()).hexdigest()[:16]


def legacy_source_hash(source: str, endpoint_url: str | None) -> str:
    """The name cachefs gave a source's cache directory before ``source_hash`` canonicalized the
    URL: a hash of the URL exactly as typed (``cachefs.sourcedir`` still finds such directories)."""
    identity = json.dumps({"source": source, "endpoint": endpoint_url or ""}, sort_keys=True)
    return hashlib.sha256(identity.encode()).hexdigest()[:16]
