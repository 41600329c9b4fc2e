"""``cachefs mount`` and ``cachefs unmount``.

``cachefs mount`` without ``--foreground`` starts the same command with ``--foreground`` as a
detached child (its own session, output to a log file), and waits until the child reports through a
pipe that the mount is live, or why it is not: ``WARN <line>`` lines (shown as
``cachefs: warning: ...``), then ``OK`` or ``ERR <reason>``. On success it prints one line naming
the source, the mountpoint and the daemon's log file. Before starting a daemon it refuses, with one
line each, caches that cannot fit (``cachefs.cli.resources``) and a source whose cache directory
another daemon holds, so a refused second mount never writes into the live mount's log. Credentials reach the child only through the
inherited environment (the standard AWS variables and config files), never through its arguments.
The foreground command runs the daemon (``cachefs.daemon.main.serve``), imported only then: it
brings the FUSE session, the filesystem and the engine, which no other command needs.

``cachefs mount --fuse-fd-socket PATH`` serves a mount that a privileged process (the CSI node plugin)
has already made: it receives the mounted ``/dev/fuse`` descriptor on the unix socket PATH
(``cachefs.handover``), runs in the foreground, reports its start-up on that connection, and needs no
privilege. It leaves the unmount to the process that mounted.

``cachefs unmount`` flushes written data first (through the daemon's control API), then unmounts
with ``fusermount3`` and waits for the daemon to exit (which uploads what was written meanwhile, within
its ``--stop-timeout``: ``cachefs.daemon.stopping``); ``--force`` skips both. A busy mount's refusal
names the processes using it (``cachefs.mounts.mount_users``) and suggests ``--lazy``, which detaches
it at once (``fusermount3 -u -z``, MNT_DETACH): the daemon serves the processes still using it and
exits when the last one lets go.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import logging.handlers
import os
import select
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from cachefs import mounts
from cachefs.client import UsageError, call
from cachefs.cli.argtypes import address, fraction_or_size, mode, seconds, size, user_id
from cachefs.cli.resources import check_resources
from cachefs.daemon.errors import SetupError
from cachefs.handover import HandoverError, receive_fd
from cachefs.settings import (DEFAULT_ATTR_TTL_S, DEFAULT_DIR_TTL_S, DEFAULT_FUSE_THREADS, DEFAULT_METADATA_TIMEOUT_S,
                              DEFAULT_RENAME_DIR_LIMIT, MAX_FUSE_THREADS, MISSING_CLUSTER_KEY, ClusterSettings,
                              FsSettings, MountSettings)
from tiering.objectstore import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_READ_TIMEOUT_S, read_only_source_problem
from tiering.private import PRIVATE_UMASK, UnsafePathError, open_private
from tiering.settings import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CLUSTER_TIMEOUT_S,
    DEFAULT_DISK_BYTES,
    DEFAULT_FETCH_TIMEOUT_S,
    DEFAULT_MAX_CONCURRENT_FETCHES,
    DEFAULT_RAM_BYTES,
    DEFAULT_MAX_PINNED_FRACTION,
    DEFAULT_READAHEAD_MAX_BYTES,
    CacheSettings,
)
from tiering.units import format_size
from tiering.writeback.settings import (
    DEFAULT_LEASE_TTL_S,
    DEFAULT_MAX_UPLOADS,
    DEFAULT_SPACE_WAIT_S,
    DEFAULT_STOP_TIMEOUT_S,
    DEFAULT_UPLOAD_DELAY_S,
    DEFAULT_UPLOAD_MAX_DELAY_S,
    STOP_MARGIN_S,
    DURABILITIES,
    DURABILITY_LOCAL,
    WriteBackSettings,
)

log = logging.getLogger("cachefs")

# How long `cachefs mount` waits for the daemon to report. The daemon's own start-up check is
# bounded at 20 s (cachefs.daemon.main); this leaves room for scanning a large disk tier on start
# and for importing a --manifest (13 s per million lines on an idle 2-core machine, 8 min for 10 M lines on a busy one).
MOUNT_WAIT_S = 900.0
DEFAULT_UNMOUNT_TIMEOUT_S = 30.0
# How long `--fuse-fd-socket` waits for the descriptor: the plugin listens before it starts the daemon.
HANDOVER_WAIT_S = 30.0
# `cachefs unmount` flushes first and waits this long for the backlog to reach the store before it
# refuses: a minute drains gigabytes on a healthy link, and a store that is down is reported to the
# user (who may retry, flush longer, or --force) instead of holding the command for many minutes.
DEFAULT_UNMOUNT_FLUSH_TIMEOUT_S = 60.0
# Logs of a background daemon: rotated so a long-lived mount cannot fill the disk with them.
LOG_MAX_BYTES = 10 * 1024 * 1024
LOG_BACKUPS = 3
NOISY_LOGGERS = ("botocore", "aiobotocore", "s3fs", "fsspec", "urllib3", "aiohttp.access")


MOUNT_EPILOG = """\
examples:
  cachefs mount s3://my-bucket/train /mnt/train --read-only --disk-cache 200GiB
  cachefs mount s3://my-bucket/out /mnt/out --cache-dir /nvme/cachefs          # writable, write-back
  cachefs mount http://files.example.com/ds/ /mnt/ds --read-only              # a server sending ETags
  CACHEFS_RAM_CACHE=8GiB cachefs mount s3://my-bucket /mnt/b --read-only

Each option above may come from its CACHEFS_* variable (--disk-cache is CACHEFS_DISK_CACHE); a flag
wins. Credentials: the AWS chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, instance
roles); AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL and the config file's endpoint_url apply to s3://
sources, in botocore's order. The daemon's log is daemon.log in the cache dir.
"""


# Every scheme parse_source accepts (SUPPORTED_SCHEMES), as `mount --help` names them; a test keeps
# the two in step.
SOURCE_HELP = ("s3://bucket[/prefix] or file:///path (writable), or read-only (--read-only): gs://bucket[/prefix], "
               "az://container[/prefix], hf://datasets/OWNER/NAME[/path], http://HOST/dir/, https://HOST/dir/, "
               "memory://ROOT (docs/configuration.md, Sources)")


def default_cache_dir(environ: dict[str, str]) -> Path:
    if os.geteuid() == 0:
        return Path("/var/cache/cachefs")
    home = environ.get("HOME") or str(Path.home())
    return Path(environ.get("XDG_CACHE_HOME") or Path(home) / ".cache") / "cachefs"


def register(sub: Any) -> None:
    m = sub.add_parser("mount", help="mount a bucket (or prefix) as a directory", epilog=MOUNT_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    m.add_argument("source", help=SOURCE_HELP)
    m.add_argument("mountpoint", type=Path, help="an existing, empty directory")
    m.add_argument("--endpoint-url", help="S3-compatible endpoint of an s3:// source (default: $AWS_ENDPOINT_URL_S3, "
                                           "$AWS_ENDPOINT_URL, the AWS config file's endpoint_url, else AWS)")
    m.add_argument("--cache-dir", type=Path, default=None, help="local cache directory (default: /var/cache/cachefs as root, else ~/.cache/cachefs)")
    m.add_argument("--ram-cache", type=size, default=DEFAULT_RAM_BYTES, metavar="SIZE",
                   help=f"RAM tier capacity, e.g. 2GiB (default {format_size(DEFAULT_RAM_BYTES)}; 0 disables)")
    m.add_argument("--disk-cache", type=size, default=DEFAULT_DISK_BYTES, metavar="SIZE",
                   help=f"disk tier capacity (default {format_size(DEFAULT_DISK_BYTES)}; 0 disables)")
    m.add_argument("--min-free-space", type=size, default=0, metavar="SIZE",
                   help="the disk tier evicts clean blocks to keep this much free on its filesystem "
                        "(default 0: only --disk-cache bounds it)")
    m.add_argument("--block-size", type=size, default=DEFAULT_BLOCK_SIZE, metavar="SIZE",
                   help=f"cache block size (default {format_size(DEFAULT_BLOCK_SIZE)})")
    m.add_argument("--readahead", type=size, default=DEFAULT_READAHEAD_MAX_BYTES, metavar="SIZE",
                   help=f"largest sequential read-ahead window (default {format_size(DEFAULT_READAHEAD_MAX_BYTES)}; 0 disables)")
    m.add_argument("--max-fetches", type=int, default=DEFAULT_MAX_CONCURRENT_FETCHES, metavar="N",
                   help=f"parallel ranged GETs (default {DEFAULT_MAX_CONCURRENT_FETCHES})")
    m.add_argument("--fetch-timeout", type=seconds, default=DEFAULT_FETCH_TIMEOUT_S, metavar="S",
                   help=f"fail an uncached read with EIO after this long (default {DEFAULT_FETCH_TIMEOUT_S:g})")
    m.add_argument("--attr-ttl", type=seconds, default=DEFAULT_ATTR_TTL_S, metavar="S",
                   help=f"how long file attributes are cached (default {DEFAULT_ATTR_TTL_S:g})")
    m.add_argument("--dir-ttl", type=seconds, default=DEFAULT_DIR_TTL_S, metavar="S",
                   help=f"how long listings and negative lookups are cached (default {DEFAULT_DIR_TTL_S:g})")
    m.add_argument("--metadata-timeout", type=seconds, default=DEFAULT_METADATA_TIMEOUT_S, metavar="S",
                   help=f"a listing or attribute refresh the store does not answer within this serves the cached "
                        f"(stale) entry, or EIO if there is none (default {DEFAULT_METADATA_TIMEOUT_S:g})")
    m.add_argument("--mtime-from-metadata", action="store_true",
                   help="show each file's mtime from its 'mtime' metadata (rclone, s3fs-fuse and cachefs "
                        "write it): one HEAD per file version listed, remembered in the metadata index; "
                        "without it, LastModified except for files this cache saw written or touched")
    m.add_argument("--connect-timeout", type=seconds, default=DEFAULT_CONNECT_TIMEOUT_S, metavar="S",
                   help=argparse.SUPPRESS)
    m.add_argument("--read-timeout", type=seconds, default=DEFAULT_READ_TIMEOUT_S, metavar="S",
                   help=argparse.SUPPRESS)
    m.add_argument("--max-pinned", type=fraction_or_size, default=None, metavar="FRACTION|SIZE",
                   help=f"most data 'cachefs prefetch --pin' may pin: a fraction of --disk-cache "
                        f"(default {DEFAULT_MAX_PINNED_FRACTION:g}) or a size such as 20GiB")
    m.add_argument("--stats-addr", type=address, default=None, metavar="HOST:PORT",
                   help="also serve /stats and /healthz over HTTP here (loopback unless a host is given)")
    m.add_argument("--exit-stats-file", type=Path, default=None, metavar="PATH",
                   help="write the last counters (the traffic section of /stats) here as JSON when the daemon "
                        "exits (a mount pod's termination message)")
    m.add_argument("--allow-other", action="store_true",
                   help="let other users use the mount (the kernel checks them against --uid/--gid and the modes)")
    m.add_argument("--uid", type=user_id, default=None, metavar="UID",
                   help="owner of every file and directory (default: the mounting user)")
    m.add_argument("--gid", type=user_id, default=None, metavar="GID",
                   help="group of every file and directory (default: the mounting user's group)")
    m.add_argument("--file-mode", type=mode, default=None, metavar="MODE",
                   help="permission bits of every file, in octal (default 0644; 0444 with --read-only)")
    m.add_argument("--dir-mode", type=mode, default=None, metavar="MODE",
                   help="permission bits of every directory, in octal (default 0755; 0555 with --read-only)")
    m.add_argument("--read-only", action="store_true", default=False,
                   help="read-only mount: every change answers EROFS (default: writable, with write-back)")
    m.add_argument("--direct-io", action="store_true", default=False,
                   help="bypass the mount's page cache: faster cold streaming reads, but every re-read costs the "
                        "daemon CPU and shared mmap fails with ENODEV (default: off, see docs/configuration.md)")
    m.add_argument("--no-passthrough", dest="passthrough", action="store_false", default=True,
                   help="on a read-only mount, serve every read through the daemon, also of files whole on the disk "
                        "tier that the kernel could read itself (default: passthrough where the kernel and root allow)")
    m.add_argument("--fuse-threads", type=int, default=DEFAULT_FUSE_THREADS, metavar="N",
                   help="threads that read and answer the mount's requests, each on a clone of the FUSE "
                        f"descriptor (1-{MAX_FUSE_THREADS}, default {DEFAULT_FUSE_THREADS}; 1: the daemon's loop "
                        "reads them; see docs/configuration.md)")
    m.add_argument("--write-through", action="store_true", default=False,
                   help="close() and fsync() return only once the upload succeeded, and report its failure")
    m.add_argument("--write-durability", choices=list(DURABILITIES), default=DURABILITY_LOCAL,
                   help="when close() and fsync() return: 'local' once the data is on this node's disk (default), "
                        "'cluster' once it is also in the cluster store (--cluster-cache), so that 'cachefs "
                        "recover' can finish the uploads if the node is lost (see docs/durability.md)")
    m.add_argument("--write-lease-ttl", type=seconds, default=DEFAULT_LEASE_TTL_S, metavar="S",
                   help=f"with --write-durability cluster: how long this mount's journal in the cluster store stays "
                        f"its own without a renewal; after it, 'cachefs recover' may take it "
                        f"(default {DEFAULT_LEASE_TTL_S:g})")
    m.add_argument("--node-id", default=None, metavar="NAME",
                   help="this node's name in the cluster store's write-back journals (default: the host name)")
    m.add_argument("--upload-delay", type=seconds, default=DEFAULT_UPLOAD_DELAY_S, metavar="S",
                   help=f"wait this long after a file is closed before uploading it, so quick rewrites and "
                        f"renames are uploaded once (default {DEFAULT_UPLOAD_DELAY_S:g})")
    m.add_argument("--upload-max-delay", type=seconds, default=None, metavar="S",
                   help=f"upload an acknowledged version at most this long after it was closed, even while the "
                        f"file keeps changing (default: the larger of {DEFAULT_UPLOAD_MAX_DELAY_S:g} and --upload-delay)")
    m.add_argument("--stop-timeout", type=seconds, default=DEFAULT_STOP_TIMEOUT_S, metavar="S",
                   help=f"when stopped (SIGTERM, SIGINT, any unmount), go on uploading what is pending for up to "
                        f"this long before exiting; the rest stays journaled for the next mount "
                        f"(default {DEFAULT_STOP_TIMEOUT_S:g}: a pod's 30 s grace period less a margin)")
    m.add_argument("--max-uploads", type=int, default=DEFAULT_MAX_UPLOADS, metavar="N",
                   help=f"objects uploaded at once (default {DEFAULT_MAX_UPLOADS})")
    m.add_argument("--dirty-wait", type=seconds, default=DEFAULT_SPACE_WAIT_S, metavar="S",
                   help=f"when staged data fills the disk cache, a writer waits this long for uploads to make "
                        f"room before failing with ENOSPC (default {DEFAULT_SPACE_WAIT_S:g})")
    m.add_argument("--rename-dir-limit", type=int, default=DEFAULT_RENAME_DIR_LIMIT, metavar="N",
                   help=f"largest directory (entries below it) rename may move; beyond it rename fails with "
                        f"E2BIG (default {DEFAULT_RENAME_DIR_LIMIT})")
    m.add_argument("--cluster-cache", default=None, metavar="s3://BUCKET[/PREFIX]",
                   help="a shared cluster tier between the disk cache and the source: an S3 store inside the "
                        "cluster that every node reads blocks from and writes fetched blocks to")
    m.add_argument("--cluster-endpoint-url", default=None, metavar="URL",
                   help="endpoint of the cluster store (default: the source's endpoint, --endpoint-url or "
                        "$AWS_ENDPOINT_URL, else AWS)")
    m.add_argument("--cluster-profile", default=None, metavar="NAME",
                   help="AWS profile whose credentials the cluster store uses (default: the standard chain)")
    m.add_argument("--cluster-key-file", default=None, metavar="FILE",
                   help="with --cluster-cache: the cluster key (at least 32 random bytes) every object of the "
                        "cluster store is authenticated with; only the mounts sharing the store hold it, never "
                        "a tenant (docs/security.md, 'Multi-tenant clusters')")
    m.add_argument("--cluster-timeout", type=seconds, default=DEFAULT_CLUSTER_TIMEOUT_S, metavar="S",
                   help=f"a cluster-tier request not answered within this is a miss, and the block comes from the "
                        f"source (default {DEFAULT_CLUSTER_TIMEOUT_S:g}; must be below --fetch-timeout)")
    # Pinned mounts (cachefs.fs.pinned): kept together, apart from the other options, on purpose.
    m.add_argument("--manifest", type=Path, default=None, metavar="FILE",
                   help="pin the mount to a manifest from 'cachefs snapshot' (JSON lines, plain or gzip): "
                        "read-only, no LISTs, every read checked against the manifest's ETag (ESTALE if changed)")
    m.add_argument("--manifest-key", default=None, metavar="KEY",
                   help="as --manifest, with the manifest stored in the source itself at KEY (fetched at mount)")
    m.add_argument("--foreground", "-f", action="store_true", help="stay in the foreground (for containers)")
    m.add_argument("--log-level", default="INFO", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log level (default INFO)")
    m.add_argument("--log-file", type=Path, default=None,
                   help="log file of a background mount (default: daemon.log in the cache dir)")
    m.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    m.add_argument("--fuse-fd-socket", type=Path, default=None, metavar="PATH",
                   help="serve a mount made by a privileged process (the CSI node plugin): receive its /dev/fuse "
                        "descriptor on this unix socket instead of mounting; needs no privilege; implies --foreground")
    m.add_argument("--backing-broker", type=Path, default=None, metavar="PATH", help="the CSI node plugin's unix socket "
                   "that registers backing files for kernel passthrough, which this daemon may not do itself")

    u = sub.add_parser("unmount", aliases=["umount"], help="unmount a cachefs mount")
    u.add_argument("mountpoint", type=Path)
    u.add_argument("--timeout", type=seconds, default=DEFAULT_UNMOUNT_TIMEOUT_S, metavar="S",
                   help="how long to wait for the daemon to exit (without --force: at least its --stop-timeout "
                        "plus 5 s, as it uploads what was written since the flush)")
    u.add_argument("--flush-timeout", type=seconds, default=DEFAULT_UNMOUNT_FLUSH_TIMEOUT_S, metavar="S",
                   help=f"how long to wait for written data to reach the object store before refusing "
                        f"(default {DEFAULT_UNMOUNT_FLUSH_TIMEOUT_S:g})")
    u.add_argument("--force", action="store_true",
                   help="unmount without flushing (the daemon uploads nothing more either); staged data stays in "
                        "the cache dir and the next mount uploads it")
    u.add_argument("--lazy", action="store_true",
                   help="detach a busy mount now (fusermount3 -u -z): new opens fail at once, processes using it "
                        "keep their files, and the daemon exits once the last one lets go")



def _pin_limit(value: tuple[str, float | int] | None, disk_bytes: int) -> int | None:
    if value is None:
        return None
    kind, amount = value
    return int(amount * disk_bytes) if kind == "fraction" else int(amount)


def mount_settings(args: argparse.Namespace, environ: dict[str, str]) -> MountSettings:
    if args.manifest is not None or args.manifest_key is not None:
        args.read_only = True  # a mount pinned to a manifest is read-only
    try:
        cache = CacheSettings(
            block_size=args.block_size,
            ram_bytes=args.ram_cache,
            disk_bytes=args.disk_cache,
            max_concurrent_fetches=args.max_fetches,
            readahead_max_bytes=args.readahead,
            fetch_timeout_s=args.fetch_timeout,
            max_pinned_bytes=_pin_limit(args.max_pinned, args.disk_cache),
            disk_min_free_bytes=args.min_free_space,
        )
        owner = {name: getattr(args, name) for name in ("uid", "gid", "file_mode", "dir_mode")
                 if getattr(args, name) is not None}
        fs = FsSettings(attr_ttl_s=args.attr_ttl, dir_ttl_s=args.dir_ttl, read_only=args.read_only,
                        direct_io=args.direct_io, passthrough=args.passthrough,
                        rename_dir_limit=args.rename_dir_limit, metadata_timeout_s=args.metadata_timeout,
                        mtime_from_metadata=args.mtime_from_metadata, **owner)
        writeback = WriteBackSettings(upload_delay_s=args.upload_delay, max_uploads=args.max_uploads,
                                      space_wait_s=args.dirty_wait, write_through=args.write_through,
                                      upload_max_delay_s=args.upload_max_delay, stop_timeout_s=args.stop_timeout,
                                      durability=args.write_durability, lease_ttl_s=args.write_lease_ttl)
        cluster = _cluster_settings(args, _endpoint_url(args.source, args.endpoint_url, environ))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not args.read_only and (problem := read_only_source_problem(args.source)):
        raise UsageError(problem)
    if not args.read_only and args.disk_cache == 0:
        raise UsageError("a writable mount stages writes in the disk cache: give --disk-cache a size, or use --read-only")
    if not args.read_only and args.disk_cache < args.block_size:
        raise UsageError(f"--disk-cache {format_size(args.disk_cache)} is smaller than one block (--block-size "
                         f"{format_size(args.block_size)}): a writable mount stages writes there; give it at least "
                         f"one block")
    if args.read_only and args.write_through:
        raise UsageError("--write-through applies to writable mounts only (drop --read-only or --write-through)")
    if args.connect_timeout <= 0 or args.read_timeout <= 0:
        raise UsageError("timeouts must be positive")
    endpoint = _endpoint_url(args.source, args.endpoint_url, environ)
    try:
        return _mount_settings(args, environ, endpoint, cache, fs, writeback, cluster)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _endpoint_url(source: str, given: str | None, environ: dict[str, str]) -> str | None:
    """The source's endpoint: ``--endpoint-url``, else the one botocore would find for S3
    (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, the AWS config file's ``endpoint_url``:
    ``tiering.objectstore.s3.configured_endpoint_url``), for s3:// sources only. It is part of the
    source's identity (cache directory, cluster-tier keys), so it is resolved here and given to the
    store, which uses exactly it.

    These are environment-wide AWS settings (a shell that also talks to a local S3 server has them):
    they say nothing about an http:// or file:// source, which ignores them. An explicit
    ``--endpoint-url`` with such a source is a mistake, refused with one line."""
    from tiering.objectstore import parse_source

    try:
        scheme = parse_source(source).scheme
    except ValueError:
        return given or None  # preflight reports the source in its own words
    if scheme != "s3":
        if given:
            raise UsageError(f"--endpoint-url applies only to s3:// sources, not {scheme}:// (drop it)")
        return None
    if given:
        return given
    from tiering.objectstore.s3 import configured_endpoint_url

    try:
        return configured_endpoint_url(environ)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _cluster_settings(args: argparse.Namespace, source_endpoint: str | None) -> ClusterSettings | None:
    """The cluster tier's settings. Its endpoint defaults to the source's (``--endpoint-url``, else
    ``$AWS_ENDPOINT_URL``): a cluster store beside an S3-compatible source is most often a bucket of the
    same kind of server, and the mount's credentials then go nowhere they did not already go."""
    if args.cluster_cache is None:
        if args.cluster_endpoint_url is not None or args.cluster_profile is not None:
            raise ValueError("--cluster-endpoint-url and --cluster-profile need --cluster-cache s3://BUCKET[/PREFIX]")
        # A cluster key without a cluster tier is unused, not an error: CACHEFS_CLUSTER_KEY_FILE is
        # set in every mount pod of a driver that has one, whatever the volume.
        return None
    return ClusterSettings(url=args.cluster_cache, endpoint_url=args.cluster_endpoint_url or source_endpoint,
                           profile=args.cluster_profile, timeout_s=args.cluster_timeout,
                           key_file=cluster_key_file(args.cluster_key_file) if args.cluster_key_file else None)


def cluster_key_file(given: str | None) -> Path:
    """The cluster key file, checked now (readable, long enough): a bad one is a start-up error."""
    from tiering.clusterkey import ClusterKey

    if not given:
        raise ValueError(MISSING_CLUSTER_KEY)
    path = Path(os.path.abspath(given))
    ClusterKey.from_file(path)  # ClusterKeyError is a ValueError naming the file
    return path


def _mount_settings(args: argparse.Namespace, environ: dict[str, str], endpoint: str | None, cache: CacheSettings,
                    fs: FsSettings, writeback: WriteBackSettings, cluster: ClusterSettings | None) -> MountSettings:
    from cachefs.sourcedir import SourceDirError, find_source_dir

    cache_dir = Path(os.path.abspath(args.cache_dir or default_cache_dir(environ)))
    try:  # the cache directory an older spelling of this source left, if any (cachefs.sourcedir)
        source_dir = find_source_dir(cache_dir, args.source, endpoint)
    except SourceDirError as exc:
        raise UsageError(str(exc)) from None
    return MountSettings(
        source=args.source,
        mountpoint=Path(os.path.abspath(args.mountpoint)),
        cache_dir=cache_dir,
        source_dir_name=source_dir,
        endpoint_url=endpoint,
        cache=cache,
        fs=fs,
        writeback=writeback,
        connect_timeout_s=args.connect_timeout,
        read_timeout_s=args.read_timeout,
        stats_addr=args.stats_addr,
        exit_stats_file=Path(os.path.abspath(args.exit_stats_file)) if args.exit_stats_file is not None else None,
        allow_other=args.allow_other, log_level=args.log_level,
        backing_broker=Path(os.path.abspath(args.backing_broker)) if args.backing_broker is not None else None,
        cluster=cluster,
        manifest=Path(os.path.abspath(args.manifest)) if args.manifest is not None else None,
        manifest_key=args.manifest_key,
        node_id=args.node_id or socket.gethostname(),
        fuse_threads=args.fuse_threads,
    )


def preflight(settings: MountSettings, *, check_mountpoint: bool = True) -> tuple[MountSettings, str | None]:
    """Checks that need no store: URL syntax, mountpoint, cache dir. Raises UsageError. Returns the
    settings to mount with and a warning: a disk cache that does not fit is refused, except over
    pending writes, which are uploaded by a mount with the disk cache that fits (``resources.fit_disk``).

    ``check_mountpoint=False`` for a handed-over mount: its mountpoint is already mounted (and
    answers nothing until this daemon serves it), or not even visible to the daemon."""
    from tiering.tiers.disk import check_cache_dir
    from tiering.private import check_cache_dirs
    from tiering.objectstore import parse_source

    try:
        parse_source(settings.source)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if settings.endpoint_url and not settings.endpoint_url.startswith(("http://", "https://")):
        raise UsageError(f"invalid endpoint URL {settings.endpoint_url!r}: expected http:// or https://")
    problem = mounts.check_mountpoint(settings.mountpoint) if check_mountpoint else None
    if problem:
        raise UsageError(problem)
    try:
        check_cache_dirs(settings.cache_dir, settings.source_cache_dir())
        check_cache_dir(settings.cache_dir)
    except OSError as exc:
        raise UsageError(exc.strerror or f"cache dir {settings.cache_dir} is not usable") from None
    fit = check_resources(settings)
    if fit.problem:
        raise UsageError(fit.problem)
    if settings.manifest is not None and not settings.manifest.is_file():
        raise UsageError(f"manifest {settings.manifest} is not a file")
    if fit.disk_bytes is not None:
        settings = dataclasses.replace(settings, cache=dataclasses.replace(settings.cache, disk_bytes=fit.disk_bytes))
    return settings, fit.notice


def refuse_if_in_use(settings: MountSettings) -> None:
    """Refuse a source whose cache directory a running daemon holds, before any log file is opened."""
    directory = settings.source_cache_dir()
    holder = mounts.cache_dir_holder(directory)
    if holder is not None:
        raise UsageError(f"{settings.source} is already mounted: cache dir {directory} is in use by another "
                         f"cachefs mount (pid {holder})")


def _open_log(path: str, flags: int) -> int:
    """``open``'s opener for the daemon's log: 0600, never through a symlink (tiering.private)."""
    return open_private(Path(path), flags)


class PrivateLogHandler(logging.handlers.RotatingFileHandler):
    """The rotating log file, opened (and reopened after each rotation) by ``_open_log``."""

    def _open(self) -> Any:
        return open(self.baseFilename, self.mode, encoding=self.encoding, errors=self.errors, opener=_open_log)


def configure_logging(level: str, log_file: Path | None) -> None:
    handler: logging.Handler
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handler = PrivateLogHandler(log_file, maxBytes=LOG_MAX_BYTES, backupCount=LOG_BACKUPS)
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Client libraries log request details (signed headers among them) at DEBUG: keep them quiet.
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def run_foreground(settings: MountSettings, ready_fd: int | None, log_file: Path | None, environ: dict[str, str]) -> int:
    from cachefs.daemon.main import serve  # the FUSE session and the engine: only the daemon needs them

    configure_logging(settings.log_level, log_file)
    reported = False

    def warn(message: str) -> None:
        if ready_fd is None:
            print(f"cachefs: warning: {message}", file=sys.stderr)
            return
        try:
            os.write(ready_fd, f"WARN {message}\n".encode())
        except OSError:
            pass

    def ready(error: str | None) -> None:
        nonlocal reported
        if ready_fd is not None and not reported:
            reported = True
            message = "OK\n" if error is None else f"ERR {error}\n"
            try:
                os.write(ready_fd, message.encode())
                os.close(ready_fd)
            except OSError:
                pass

    os.chdir("/")
    try:
        serve(settings, ready, environ, warn)
    except SetupError as exc:
        log.error("mount failed: %s", exc)
        ready(str(exc))
        if ready_fd is None:
            print(f"cachefs: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - report, never a bare traceback to the user
        log.exception("daemon failed")
        ready(f"daemon failed: {exc.__class__.__name__}: {exc}")
        if ready_fd is None:
            print(f"cachefs: error: daemon failed: {exc}", file=sys.stderr)
        return 1
    return 0


def spawn_daemon(argv: Sequence[str], settings: MountSettings, log_file: Path) -> int:
    log_file.parent.mkdir(parents=True, exist_ok=True)
    try:
        out = open(log_file, "ab", opener=_open_log)
    except OSError as exc:
        raise UsageError(exc.strerror if isinstance(exc, UnsafePathError) else
                         f"cannot open the log file {log_file}: {exc.strerror or exc}") from None
    read_fd, write_fd = os.pipe()
    child_argv = [sys.executable, "-m", "cachefs", *argv, "--foreground", "--ready-fd", str(write_fd),
                  "--log-file", str(log_file)]
    with out:
        proc = subprocess.Popen(
            child_argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            pass_fds=(write_fd,),
            start_new_session=True,
            close_fds=True,
        )
    os.close(write_fd)
    text = _read_report(read_fd)
    if text == "OK":
        print(f"cachefs: mounted {settings.source} at {settings.mountpoint} (pid {proc.pid}, log: {log_file})",
              file=sys.stderr)
        return 0
    if text.startswith("ERR "):
        print(f"cachefs: error: {text[4:]}", file=sys.stderr)
        _reap(proc)
        return 1
    if proc.poll() is None:
        proc.terminate()  # our own child, by its PID
        _reap(proc)
        print(f"cachefs: error: mount did not become ready within {MOUNT_WAIT_S:g} s; see {log_file}", file=sys.stderr)
    else:
        print(f"cachefs: error: daemon exited with code {proc.returncode}; see {log_file}", file=sys.stderr)
    return 1


def _read_report(read_fd: int) -> str:
    """The daemon's final report (``OK``, ``ERR ...``, or ``""`` if none came in time); ``WARN`` lines
    before it are shown as they arrive."""
    deadline = time.monotonic() + MOUNT_WAIT_S
    buffer = b""
    try:
        while time.monotonic() < deadline:
            readable, _, _ = select.select([read_fd], [], [], max(0.0, min(1.0, deadline - time.monotonic())))
            if not readable:
                continue
            chunk = os.read(read_fd, 4096)
            if not chunk:
                break
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                text = line.decode(errors="replace").strip()
                if text.startswith("WARN "):
                    print(f"cachefs: warning: {text[5:]}", file=sys.stderr)
                else:
                    return text
    finally:
        os.close(read_fd)
    return buffer.decode(errors="replace").strip()


def _reap(proc: subprocess.Popen[bytes]) -> None:
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def run_handed_over(args: argparse.Namespace, environ: dict[str, str]) -> int:
    """``--fuse-fd-socket``: take the mounted /dev/fuse descriptor (and clones for the readers) from the
    socket and serve it in the foreground, reporting start-up (``WARN``/``OK``/``ERR``, or ``BAD`` for
    refused arguments) on the same connection (``cachefs.handover``)."""
    try:
        fuse_fd, clones, conn = receive_fd(Path(os.path.abspath(args.fuse_fd_socket)), HANDOVER_WAIT_S,
                                           max_clones=min(args.fuse_threads, MAX_FUSE_THREADS) - 1)
    except HandoverError as exc:
        print(f"cachefs: error: {exc}", file=sys.stderr)
        return 1
    report_fd = os.dup(conn.fileno())
    conn.close()
    try:
        settings = dataclasses.replace(mount_settings(args, environ), fuse_fd=fuse_fd, fuse_clones=tuple(clones))
        settings, notice = preflight(settings, check_mountpoint=False)
        refuse_if_in_use(settings)
    except (UsageError, ValueError) as exc:
        try:
            os.write(report_fd, f"BAD {exc}\n".encode())
        except OSError:
            pass
        os.close(report_fd)
        for fd in (fuse_fd, *clones):
            os.close(fd)
        raise UsageError(str(exc)) from None
    if notice:
        print(f"cachefs: warning: {notice}", file=sys.stderr)
        try:
            os.write(report_fd, f"WARN {notice}\n".encode())
        except OSError:
            pass
    return run_foreground(settings, report_fd, args.log_file, environ)


def cmd_mount(args: argparse.Namespace, argv: Sequence[str], environ: dict[str, str]) -> int:
    # Before anything is created: the cache and runtime directories, the log and every file of the
    # daemon (a child inherits it) are the mounting user's alone (tiering.private).
    os.umask(PRIVATE_UMASK)
    if args.fuse_fd_socket is not None:
        return run_handed_over(args, environ)
    settings = mount_settings(args, environ)
    if args.ready_fd is None:  # the child re-runs these checks only through the daemon itself
        settings, notice = preflight(settings)
        refuse_if_in_use(settings)
        if notice:
            print(f"cachefs: warning: {notice}", file=sys.stderr)
            # The daemon is this command again: the disk cache that fits overrides the one asked for.
            argv = [*argv, "--disk-cache", str(settings.cache.disk_bytes)]
    log_file = args.log_file
    if args.foreground:
        return run_foreground(settings, args.ready_fd, log_file, environ)
    return spawn_daemon(argv, settings, log_file or settings.source_cache_dir() / "daemon.log")


def cmd_unmount(args: argparse.Namespace) -> int:
    path = Path(os.path.abspath(args.mountpoint))
    entry = mounts.find_mount(path)
    if entry is None:
        raise UsageError(f"{path} is not mounted")
    if entry.fstype != mounts.FSTYPE:
        raise UsageError(f"{path} is not a cachefs mount (it is {entry.fstype})")
    pid = None
    info: dict[str, Any] = {}
    try:
        info = call(path, "/info")
        pid = int(info["pid"])
    except (UsageError, KeyError, ValueError, TypeError):
        pass  # a dead daemon: unmount the stale mount anyway
    if pid is not None and not args.force and not _flushed_for_unmount(path, args.flush_timeout, info):
        return 1
    fusermount = shutil.which("fusermount3") or shutil.which("fusermount")
    if fusermount is None:
        raise UsageError("fusermount3 not found (install the fuse3 package)")
    if args.lazy:
        return _detach(fusermount, path, args.timeout)
    if pid is not None and args.force:
        _ask_daemon_to_drain(path, False)  # an unmount drains (cachefs.daemon.stopping): --force does not
    result = subprocess.run([fusermount, "-u", str(path)], capture_output=True, text=True, timeout=args.timeout)
    if result.returncode != 0 and pid is not None and args.force:
        _ask_daemon_to_drain(path, True)
    if result.returncode != 0:
        detail = (result.stderr.strip().splitlines() or ["unknown error"])[-1]
        if pid is not None and (users := mounts.mount_users(path).describe()):
            detail += f"; in use by {users}: stop them, or detach it now with 'cachefs unmount --lazy {path}'"
        if pid is None:  # the daemon is gone: detach the dead mount lazily
            lazy = subprocess.run([fusermount, "-u", "-z", str(path)], capture_output=True, text=True, timeout=args.timeout)
            if lazy.returncode == 0:
                print(f"cachefs: unmounted {path} (its daemon was not running){_still_staged(path, info)}",
                      file=sys.stderr)
                return 0
        print(f"cachefs: error: cannot unmount {path}: {detail}", file=sys.stderr)
        return 1
    still_served = mounts.other_views(entry)
    if still_served:  # a bind of a staged mount (CSI), or the mount under binds: the daemon serves on
        print(f"cachefs: unmounted {path}; its daemon goes on serving {', '.join(still_served)}", file=sys.stderr)
        return 0
    # The daemon uploads what was written since the flush before it exits, for up to its --stop-timeout.
    wait_s = args.timeout if args.force else max(args.timeout, _stop_timeout(info) + STOP_MARGIN_S)
    if pid is not None and not _wait_exit(pid, wait_s):
        where = mounts.process_waits(pid)
        print(f"cachefs: error: unmounted {path}, but daemon pid {pid} did not exit within {wait_s:g} s"
              f"{f' ({where})' if where else ''}",
              file=sys.stderr)
        return 1
    dead = " (its daemon was not running)" if pid is None else ""
    print(f"cachefs: unmounted {path}{dead}{_still_staged(path, info)}", file=sys.stderr)
    return 0


def _still_staged(path: Path, info: dict[str, Any]) -> str:
    """``; N changes are still staged ...`` when the stopped daemon (``info``: its /info, or for a dead
    one the record it left, ``cachefs.mounts.last_record``) left changes that are not in the object
    store (``--force``, a crash, a stop deadline), with how to get them uploaded; else ``""``."""
    from cachefs.sourcedir import staged_changes

    known = info or mounts.last_record(path)
    cache_dir, source = known.get("cache_dir"), known.get("source")
    if not isinstance(cache_dir, str) or not isinstance(source, str):
        return ""
    left = staged_changes(Path(cache_dir))
    if not left:
        return ""
    what = "1 change is" if left == 1 else f"{left} changes are"
    return (f"; {what} still staged in {cache_dir}, not in the object store: mount {source} again "
            f"(writable) to upload {'it' if left == 1 else 'them'}")


def _detach(fusermount: str, path: Path, timeout_s: float) -> int:
    """``--lazy``: take the mount out of the namespace now; its users keep it until they let go."""
    users = mounts.mount_users(path).describe()
    result = subprocess.run([fusermount, "-u", "-z", str(path)], capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        detail = (result.stderr.strip().splitlines() or ["unknown error"])[-1]
        print(f"cachefs: error: cannot detach {path}: {detail}", file=sys.stderr)
        return 1
    after = f"; its daemon exits once {users} let go" if users else ""
    print(f"cachefs: detached {path}{after}", file=sys.stderr)
    return 0


def _stop_timeout(info: dict[str, Any]) -> float:
    try:
        return float(info.get("stop_timeout_s", 0.0))
    except (TypeError, ValueError):
        return 0.0


def _ask_daemon_to_drain(path: Path, drain: bool) -> None:
    """Whether the daemon uploads what is pending when its session ends (a daemon that cannot be asked
    is stopping or gone: nothing to change)."""
    try:
        call(path, "/stop", method="POST", body={"drain": drain})
    except UsageError:
        pass


def _flushed_for_unmount(path: Path, timeout_s: float, info: dict[str, Any]) -> bool:
    """Flush before unmounting; False (with the reason on stderr) when something is still pending."""
    from cachefs.cli.writeback import flush_mount, print_pending

    staging = Path(str(info.get("cache_dir", "the cache directory"))) / "staging"
    try:
        report = flush_mount(path, timeout_s)
    except UsageError as exc:
        print(f"cachefs: error: not unmounting {path}: cannot flush it ({exc}); use --force to unmount anyway "
              f"(staged data stays in {staging} and the next mount uploads it)", file=sys.stderr)
        return False
    if report.get("ok"):
        return True
    pending = report.get("pending", [])
    print_pending(pending, sys.stderr)
    print(f"cachefs: error: not unmounting {path}: {len(pending)} changes are not in the object store after "
          f"{timeout_s:g} s (listed above). Retry, run 'cachefs flush {path}' with a longer --timeout, or use "
          f"--force (staged data stays in {staging} and the next mount uploads it)", file=sys.stderr)
    return False


def _wait_exit(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        if _is_zombie(pid):  # exited, not yet reaped by its parent (the CSI plugin that started it)
            return True
        time.sleep(0.05)
    return False


def _is_zombie(pid: int) -> bool:
    fields = mounts.process_stat(pid)
    return fields is not None and fields[:1] == ["Z"]


