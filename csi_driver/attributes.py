"""Every key the driver reads from Kubernetes, in one place, parsed into frozen, validated settings.

Three sources of keys:

- **Volume attributes** (``PersistentVolume.spec.csi.volumeAttributes``, an inline volume's
  ``volumeAttributes``, and the ``volume_context`` that CreateVolume returns): what to mount and how
  (``source``, ``endpointUrl``, cache sizes, ``readOnly``, ``directIo``). Parsed by ``parse_volume_attributes``.
- **StorageClass parameters** (CreateVolume): where dynamically provisioned volumes live
  (``bucket``, ``prefix``), what DeleteVolume does (``onDelete``), and the same endpoint and cache
  keys, which are copied into each new volume's context. Parsed by ``parse_provision_parameters``.
- **Mount options** (``PersistentVolume.spec.mountOptions``, the capability's ``mount_flags``):
  ``ro``/``rw`` and the owner options under mount-s3's names, ``uid=N``, ``gid=N``,
  ``file-mode=0644``, ``dir-mode=0755`` (a leading ``--`` is accepted). Parsed by ``parse_mount_flags``.
- **Secrets** (CSI secrets, FlexVolume ``kubernetes.io/secret/*`` options): ``accessKeyId``,
  ``secretAccessKey``, optional ``sessionToken``. Parsed by ``parse_credentials``.

Parsing is strict: an unknown key (a typo such as ``ramcache``) or a bad value is refused with an
``INVALID_ARGUMENT`` error naming the key, never ignored or corrected. Keys whose prefix is one that
Kubernetes reserves for itself (``kubernetes.io/``, ``k8s.io/`` and every subdomain of them) are
Kubernetes' own and are skipped: the kubelet adds ``csi.storage.k8s.io/pod.name`` and the rest of the
pod info (``podInfoOnMount``) and ``csi.storage.k8s.io/ephemeral``; external-provisioner adds
``storage.kubernetes.io/csiProvisionerIdentity`` to the attributes of every PersistentVolume it
creates, and those attributes are immutable, so refusing the key would leave every dynamically
provisioned volume unmountable for good (issue 23). A cachefs attribute never has a prefix, so a
misspelt one is still refused. Secret values are never put in a message or a ``repr``.

Cache options left out mean "``cachefs mount``'s default": the driver does not repeat those defaults.

**Owner and modes** (``uid``, ``gid``, ``fileMode``, ``dirMode`` attributes, or the same as mount
options; the two may not disagree): what every file and directory of the mount shows; the kernel
checks pods against them. A pod's ``fsGroup`` reaches the driver as the capability's
``volume_mount_group`` (the driver advertises ``VOLUME_MOUNT_GROUP``, so the kubelet delegates instead
of chowning every file): it becomes the gid, and a writable mount becomes group-writable (0664/0775)
unless the volume sets its modes (``with_mount_group``).
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping
from urllib.parse import urlsplit

from cachefs import admin
from cachefs.settings import MAX_CONCURRENT_FETCHES, MAX_FUSE_THREADS, MAX_TTL_S, ClusterSettings
from csi_driver.errors import invalid

# ---------------------------------------------------------------------------------- volume attributes
ATTR_SOURCE = "source"  # s3://bucket[/prefix]
ATTR_ENDPOINT_URL = "endpointUrl"  # http(s)://host[:port] of an S3-compatible store; default AWS
ATTR_REGION = "region"  # AWS region (AWS_REGION of the mount)
ATTR_RAM_CACHE = "ramCache"  # --ram-cache
ATTR_DISK_CACHE = "diskCache"  # --disk-cache
ATTR_BLOCK_SIZE = "blockSize"  # --block-size
ATTR_READAHEAD = "readahead"  # --readahead
ATTR_MAX_FETCHES = "maxFetches"  # --max-fetches
ATTR_ATTR_TTL = "attrTtl"  # --attr-ttl (seconds)
ATTR_DIR_TTL = "dirTtl"  # --dir-ttl (seconds)
ATTR_READ_ONLY = "readOnly"  # "true": always mount read-only, whatever the pod asks
ATTR_DIRECT_IO = "directIo"  # "true": --direct-io, reads and writes bypass the mount's page cache
ATTR_FUSE_THREADS = "fuseThreads"  # --fuse-threads: threads that read and answer the mount's requests
ATTR_UID = "uid"  # --uid: owner of every file and directory (default: root, the node plugin)
ATTR_GID = "gid"  # --gid (a pod's fsGroup, when it has one, takes its place)
ATTR_FILE_MODE = "fileMode"  # --file-mode, octal
ATTR_DIR_MODE = "dirMode"  # --dir-mode, octal
# The shared cluster tier (README "Shared cluster tier"). In mount pods its store's credentials and
# the cluster key come from the driver's Secret (csi_driver.mountpods, --cluster-store-secret).
ATTR_CLUSTER_CACHE = "clusterCache"  # --cluster-cache s3://BUCKET[/PREFIX]
ATTR_CLUSTER_ENDPOINT_URL = "clusterEndpointUrl"  # --cluster-endpoint-url
ATTR_CLUSTER_TIMEOUT = "clusterTimeout"  # --cluster-timeout (seconds)
# Write-back timing (docs/stopping.md): the longest an acknowledged version waits for its upload while
# the file keeps changing, and how long a stopping daemon goes on uploading (a mount pod's
# terminationGracePeriodSeconds is this plus a margin).
ATTR_UPLOAD_DELAY = "uploadDelay"  # --upload-delay (seconds): the coalescing delay after a close
ATTR_UPLOAD_MAX_DELAY = "uploadMaxDelay"  # --upload-max-delay (seconds)
ATTR_STOP_TIMEOUT = "stopTimeout"  # --stop-timeout (seconds)
# --write-durability local|cluster (docs/durability.md): "cluster" needs clusterCache.
ATTR_WRITE_DURABILITY = "writeDurability"
WRITE_DURABILITIES = ("local", "cluster")
# The mount pod's resources (``--mount-mode pod``): Kubernetes quantities, e.g. "500m", "2Gi".
ATTR_MOUNT_POD_CPU_REQUEST = "mountPodCPURequest"
ATTR_MOUNT_POD_CPU_LIMIT = "mountPodCPULimit"
ATTR_MOUNT_POD_MEMORY_REQUEST = "mountPodMemoryRequest"
ATTR_MOUNT_POD_MEMORY_LIMIT = "mountPodMemoryLimit"
# --manifest-key: pin the volume to a manifest from `cachefs snapshot`, stored as an object in the
# volume's own source (a key relative to it, e.g. "manifests/v3.jsonl.gz"), fetched at every mount.
# An object key rather than a node path: the user has the bucket at hand, not the nodes' disks.
ATTR_MANIFEST = "manifest"

# -------------------------------------------------------------------------- StorageClass parameters
PARAM_BUCKET = "bucket"
PARAM_PREFIX = "prefix"  # volumes are created as <prefix>/<pv-name>/; default: the bucket root
PARAM_ON_DELETE = "onDelete"  # "retain" (default) or "delete": what DeleteVolume does to the objects

# ------------------------------------------------------------------------------------------- secrets
SECRET_ACCESS_KEY_ID = "accessKeyId"
SECRET_SECRET_ACCESS_KEY = "secretAccessKey"
SECRET_SESSION_TOKEN = "sessionToken"

# ------------------------------------------------------------------------------ set by Kubernetes
K8S_KEY_PREFIX = "csi.storage.k8s.io/"
# The prefixes Kubernetes reserves for its own keys (labels, annotations, CSI attributes alike): a key
# "DOMAIN/NAME" whose DOMAIN is one of these or a subdomain of one is never ours to refuse.
K8S_RESERVED_DOMAINS = ("kubernetes.io", "k8s.io")
# What external-provisioner (v1 to v5) adds to every PersistentVolume it creates from CreateVolume's
# volume_context: "<start time in ms>-<random>-<driver name>".
K8S_PROVISIONER_IDENTITY = "storage.kubernetes.io/csiProvisionerIdentity"
K8S_EPHEMERAL = "csi.storage.k8s.io/ephemeral"  # "true" for inline ephemeral volumes
K8S_POD_NAME = "csi.storage.k8s.io/pod.name"
K8S_POD_NAMESPACE = "csi.storage.k8s.io/pod.namespace"
K8S_POD_UID = "csi.storage.k8s.io/pod.uid"
K8S_SERVICE_ACCOUNT = "csi.storage.k8s.io/serviceAccount.name"
# The pod info a publish carries (podInfoOnMount): handed to the daemon's launcher, for its Events.
POD_INFO_KEYS = frozenset({K8S_POD_NAME, K8S_POD_NAMESPACE, K8S_POD_UID, K8S_SERVICE_ACCOUNT})

# FlexVolume: kubelet passes the PV/pod volume options plus its own keys under kubernetes.io/.
FLEX_KEY_PREFIX = "kubernetes.io/"
FLEX_SECRET_PREFIX = "kubernetes.io/secret/"  # + accessKeyId etc., values base64-encoded
FLEX_READWRITE = "kubernetes.io/readwrite"  # "rw" or "ro"
FLEX_FS_TYPE = "kubernetes.io/fsType"
FLEX_VOLUME_NAME = "kubernetes.io/pvOrVolumeName"
FLEX_POD_UID = "kubernetes.io/pod.uid"
FLEX_FS_GROUP = "kubernetes.io/mounterArgs.FsGroup"  # the pod's fsGroup (Kubernetes 1.15 and later)

# Mount options (PersistentVolume mountOptions), named as mount-s3 names them.
FLAG_READ_ONLY, FLAG_READ_WRITE = "ro", "rw"
FLAG_UID, FLAG_GID, FLAG_FILE_MODE, FLAG_DIR_MODE = "uid", "gid", "file-mode", "dir-mode"
OWNER_FLAGS = (FLAG_UID, FLAG_GID, FLAG_FILE_MODE, FLAG_DIR_MODE)
# Modes of a writable mount shared through a pod's fsGroup: the group may write, as on volumes the
# kubelet chowns for an fsGroup.
MOUNT_GROUP_FILE_MODE, MOUNT_GROUP_DIR_MODE = 0o664, 0o775

CACHE_KEYS = (ATTR_RAM_CACHE, ATTR_DISK_CACHE, ATTR_BLOCK_SIZE, ATTR_READAHEAD, ATTR_MAX_FETCHES,
              ATTR_ATTR_TTL, ATTR_DIR_TTL, ATTR_CLUSTER_CACHE, ATTR_CLUSTER_ENDPOINT_URL, ATTR_CLUSTER_TIMEOUT,
              ATTR_UPLOAD_DELAY, ATTR_UPLOAD_MAX_DELAY, ATTR_STOP_TIMEOUT, ATTR_WRITE_DURABILITY, ATTR_DIRECT_IO,
              ATTR_FUSE_THREADS)
OWNER_KEYS = (ATTR_UID, ATTR_GID, ATTR_FILE_MODE, ATTR_DIR_MODE)
MOUNT_POD_KEYS = (ATTR_MOUNT_POD_CPU_REQUEST, ATTR_MOUNT_POD_CPU_LIMIT, ATTR_MOUNT_POD_MEMORY_REQUEST,
                  ATTR_MOUNT_POD_MEMORY_LIMIT)
VOLUME_ATTRIBUTE_KEYS = frozenset({ATTR_SOURCE, ATTR_ENDPOINT_URL, ATTR_REGION, ATTR_READ_ONLY, *CACHE_KEYS,
                                   *OWNER_KEYS, *MOUNT_POD_KEYS, ATTR_MANIFEST})
PROVISION_PARAMETER_KEYS = frozenset({PARAM_BUCKET, PARAM_PREFIX, PARAM_ON_DELETE, ATTR_ENDPOINT_URL,
                                      ATTR_REGION, ATTR_READ_ONLY, *CACHE_KEYS, *OWNER_KEYS, *MOUNT_POD_KEYS})
SECRET_KEYS = frozenset({SECRET_ACCESS_KEY_ID, SECRET_SECRET_ACCESS_KEY, SECRET_SESSION_TOKEN})

# Mount pod quantities: plain decimal CPU ("2", "0.5") or millicores ("500m"); memory in bytes with an
# optional binary or decimal suffix ("2Gi", "512Mi", "1G"). Exponent forms ("1e9") are refused: rare,
# and easy to misread. A daemon needs ~150 MiB before any cache, so less than 64 MiB cannot be right.
_CPU_RE = re.compile(r"(?P<num>[0-9]+(?:\.[0-9]{1,3})?)(?P<milli>m?)")
_MEMORY_RE = re.compile(r"(?P<num>[0-9]+)(?P<unit>Ki|Mi|Gi|Ti|k|M|G|T)?")
_MEMORY_UNITS = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
                 "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
MIN_MOUNT_POD_MEMORY = 64 << 20
# A mount pod's memory when its volume sets none (its request, and its limit unless the volume sets
# one): the RAM tier (cachefs's default 1 GiB, which also counts the blocks being received) plus the
# interpreter and S3 client (~80 MiB at rest), idle block buffers and blocks still being written to
# disk, with room to spare (`make bench`'s run of record: 1,120 MiB of RSS at a 1 GiB RAM tier).
DEFAULT_RAM_CACHE_BYTES = 1 << 30
DAEMON_OVERHEAD_BYTES = 320 << 20
MAX_MOUNT_POD_CPU_MILLI = 1024 * 1000  # 1024 cores: anything above is a typo

# Limits of values we check ourselves (cachefs checks the rest when it builds its settings).
_REGION_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,30}[a-z0-9]")
# A prefix segment and a volume name: what is safe in an S3 key, a path and a log line alike.
_SEGMENT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
# Longest value quoted back in an error message (values of non-secret keys only).
_QUOTE_MAX = 80


def _quote(value: str) -> str:
    text = value if len(value) <= _QUOTE_MAX else value[:_QUOTE_MAX] + "..."
    return repr(text)


class DeletePolicy(enum.Enum):
    RETAIN = "retain"
    DELETE = "delete"


@dataclass(frozen=True)
class CacheOptions:
    """Per-volume cache options; None leaves ``cachefs mount``'s default in force."""

    ram_bytes: int | None = None
    disk_bytes: int | None = None
    block_size: int | None = None
    readahead_bytes: int | None = None
    max_fetches: int | None = None
    attr_ttl_s: float | None = None
    dir_ttl_s: float | None = None
    cluster_cache: str | None = None
    cluster_endpoint_url: str | None = None
    cluster_timeout_s: float | None = None
    manifest_key: str | None = None
    upload_delay_s: float | None = None
    upload_max_delay_s: float | None = None
    stop_timeout_s: float | None = None
    write_durability: str | None = None
    direct_io: bool = False
    # diskCache given as a share ("50%"): of the cache filesystem's room on the node (its free space
    # plus what the volume's cache already holds there), sized by the node plugin at mount time
    # (csi_driver.node.NodeOps._sized_cache), which then sets disk_bytes.
    disk_share_percent: float | None = None
    fuse_threads: int | None = None

    def cli_args(self) -> list[str]:
        """The ``cachefs mount`` options for these values (sizes in plain bytes)."""
        out: list[str] = ["--direct-io"] if self.direct_io else []
        for flag, value in (("--ram-cache", self.ram_bytes), ("--disk-cache", self.disk_bytes),
                            ("--block-size", self.block_size), ("--readahead", self.readahead_bytes),
                            ("--max-fetches", self.max_fetches), ("--attr-ttl", self.attr_ttl_s),
                            ("--dir-ttl", self.dir_ttl_s), ("--cluster-cache", self.cluster_cache),
                            ("--cluster-endpoint-url", self.cluster_endpoint_url),
                            ("--cluster-timeout", self.cluster_timeout_s), ("--manifest-key", self.manifest_key),
                            ("--upload-delay", self.upload_delay_s), ("--upload-max-delay", self.upload_max_delay_s),
                            ("--stop-timeout", self.stop_timeout_s), ("--write-durability", self.write_durability),
                            ("--fuse-threads", self.fuse_threads)):
            if value is not None:
                out += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
        return out


@dataclass(frozen=True)
class OwnerOptions:
    """Owner and modes of every entry of the mount; None leaves ``cachefs mount``'s default."""

    uid: int | None = None
    gid: int | None = None
    file_mode: int | None = None
    dir_mode: int | None = None

    def cli_args(self) -> list[str]:
        out: list[str] = []
        for flag, value, fmt in (("--uid", self.uid, "d"), ("--gid", self.gid, "d"),
                                 ("--file-mode", self.file_mode, "04o"), ("--dir-mode", self.dir_mode, "04o")):
            if value is not None:
                out += [flag, format(value, fmt)]
        return out

    def merged(self, other: OwnerOptions, what: str) -> OwnerOptions:
        """These options plus ``other``'s (mount options); a value set differently in both is refused."""
        values = {}
        for name, key, flag in zip(("uid", "gid", "file_mode", "dir_mode"), OWNER_KEYS, OWNER_FLAGS):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine is not None and theirs is not None and mine != theirs:
                raise invalid(f"volume attribute {key!r} and {what} {flag!r} disagree; set one of them")
            values[name] = mine if mine is not None else theirs
        return OwnerOptions(**values)

    def with_mount_group(self, group: int | None, *, read_only: bool) -> OwnerOptions:
        """The pod's fsGroup as the gid; a writable mount's modes group-writable unless set."""
        if group is None:
            return self
        if read_only:
            return OwnerOptions(self.uid, group, self.file_mode, self.dir_mode)
        return OwnerOptions(self.uid, group,
                            MOUNT_GROUP_FILE_MODE if self.file_mode is None else self.file_mode,
                            MOUNT_GROUP_DIR_MODE if self.dir_mode is None else self.dir_mode)


@dataclass(frozen=True)
class MountPodResources:
    """The mount pod's requests and limits, as validated Kubernetes quantities; None: not set."""

    cpu_request: str | None = None
    cpu_limit: str | None = None
    memory_request: str | None = None
    memory_limit: str | None = None

    def requests(self) -> dict[str, str]:
        return {k: v for k, v in (("cpu", self.cpu_request), ("memory", self.memory_request)) if v is not None}

    def limits(self) -> dict[str, str]:
        return {k: v for k, v in (("cpu", self.cpu_limit), ("memory", self.memory_limit)) if v is not None}


@dataclass(frozen=True)
class MountFlags:
    """What a capability's ``mount_flags`` (PersistentVolume mountOptions) ask for."""

    read_only: bool = False
    owner: OwnerOptions = field(default_factory=OwnerOptions)


@dataclass(frozen=True)
class VolumeSettings:
    """What NodePublishVolume (or a FlexVolume mount) mounts, from the volume's attributes."""

    source: str
    endpoint_url: str | None = None
    region: str | None = None
    cache: CacheOptions = field(default_factory=CacheOptions)
    read_only: bool = False  # the volume's own readOnly attribute (the request may add read-only)
    ephemeral: bool = False
    owner: OwnerOptions = field(default_factory=OwnerOptions)
    mount_pod: MountPodResources = field(default_factory=MountPodResources)


@dataclass(frozen=True)
class ProvisionSettings:
    """Where CreateVolume puts a new volume, from the StorageClass parameters."""

    bucket: str
    prefix: str = ""  # "" or "a/b" (no leading or trailing slash)
    endpoint_url: str | None = None
    region: str | None = None
    on_delete: DeletePolicy = DeletePolicy.RETAIN
    cache_attributes: Mapping[str, str] = field(default_factory=dict)  # copied into volume_context


@dataclass(frozen=True)
class Credentials:
    """An S3 key pair from a Kubernetes Secret. Never printed: ``repr`` shows no value."""

    access_key_id: str = field(repr=False)
    secret_access_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)

    def environ(self) -> dict[str, str]:
        """The standard AWS variables for a child process (the only way credentials reach a mount)."""
        env = {"AWS_ACCESS_KEY_ID": self.access_key_id, "AWS_SECRET_ACCESS_KEY": self.secret_access_key}
        if self.session_token:
            env["AWS_SESSION_TOKEN"] = self.session_token
        return env

    def values(self) -> tuple[str, ...]:
        """Every secret value, for the log redactor."""
        return tuple(v for v in (self.access_key_id, self.secret_access_key, self.session_token) if v)


# ---------------------------------------------------------------------------------- value parsers
def parse_bool(key: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    raise invalid(f"volume attribute {key!r} must be 'true' or 'false', got {_quote(value)}")


def parse_endpoint_url(key: str, value: str) -> str:
    """An http(s)://host[:port][/path] URL without user info, query or fragment."""
    try:
        parts = urlsplit(value)
        port_ok = parts.port is None or 0 < parts.port < 65536
    except ValueError:
        parts, port_ok = None, False
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        # A URL with user info may carry a secret: never quote it back.
        shown = "" if "@" in value else f", got {_quote(value)}"
        raise invalid(f"volume attribute {key!r} must be an http:// or https:// URL{shown}")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise invalid(f"volume attribute {key!r} must not contain user info or credentials "
                      f"(put credentials in the volume's Secret)")
    if parts.query or parts.fragment or any(ord(ch) < 0x21 for ch in value):
        raise invalid(f"volume attribute {key!r} must not have a query string, fragment or whitespace")
    return value


def _parse_size(key: str, value: str) -> int:
    try:
        size = admin.parse_size(value)
    except ValueError as exc:
        raise invalid(f"volume attribute {key!r}: {exc}") from None
    return size


def _parse_share(key: str, value: str) -> float:
    """``"50%"``: a share from 1 to 100 percent."""
    number = value.strip()[:-1].strip()
    try:
        share = float(number)
    except ValueError:
        share = math.nan
    if not 1 <= share <= 100:
        raise invalid(f"volume attribute {key!r}: a share of the node's cache disk must be from 1% to 100%, "
                      f"got {_quote(value)}")
    return share


def _parse_int(key: str, value: str, low: int, high: int) -> int:
    # (ASCII digits only: "²" is a digit to str.isdigit and no number to int)
    if not (value.strip().isascii() and value.strip().isdigit()) or not low <= int(value) <= high:
        raise invalid(f"volume attribute {key!r} must be a whole number from {low} to {high}, got {_quote(value)}")
    return int(value)


def _parse_seconds(key: str, value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 0 <= seconds <= MAX_TTL_S:  # also refuses NaN
        raise invalid(f"volume attribute {key!r} must be a number of seconds from 0 to {MAX_TTL_S:g}, "
                      f"got {_quote(value)}")
    return seconds


def _parse_region(key: str, value: str) -> str:
    if not _REGION_RE.fullmatch(value):
        raise invalid(f"volume attribute {key!r} is not an AWS region name, got {_quote(value)}")
    return value


def _parse_manifest_key(value: str) -> str:
    if (not value or value.startswith("/") or value.endswith("/") or "\x00" in value
            or len(value.encode("utf-8", "surrogateescape")) > 1024):
        raise invalid(f"volume attribute {ATTR_MANIFEST!r} must be an object key relative to the volume's source "
                      f"(e.g. manifests/v1.jsonl), got {_quote(value)}")
    return value


def parse_cache_options(values: Mapping[str, str]) -> CacheOptions:
    """The cache keys of ``values``, each checked, then the combination checked as cachefs will."""
    def get(key: str) -> str | None:
        return values.get(key)

    options = CacheOptions(
        ram_bytes=_parse_size(ATTR_RAM_CACHE, v) if (v := get(ATTR_RAM_CACHE)) is not None else None,
        disk_bytes=_parse_size(ATTR_DISK_CACHE, v) if (v := get(ATTR_DISK_CACHE)) is not None
        and not v.strip().endswith("%") else None,
        disk_share_percent=_parse_share(ATTR_DISK_CACHE, v) if (v := get(ATTR_DISK_CACHE)) is not None
        and v.strip().endswith("%") else None,
        block_size=_parse_size(ATTR_BLOCK_SIZE, v) if (v := get(ATTR_BLOCK_SIZE)) is not None else None,
        readahead_bytes=_parse_size(ATTR_READAHEAD, v) if (v := get(ATTR_READAHEAD)) is not None else None,
        max_fetches=_parse_int(ATTR_MAX_FETCHES, v, 1, MAX_CONCURRENT_FETCHES) if (v := get(ATTR_MAX_FETCHES)) is not None else None,
        attr_ttl_s=_parse_seconds(ATTR_ATTR_TTL, v) if (v := get(ATTR_ATTR_TTL)) is not None else None,
        dir_ttl_s=_parse_seconds(ATTR_DIR_TTL, v) if (v := get(ATTR_DIR_TTL)) is not None else None,
        cluster_cache=get(ATTR_CLUSTER_CACHE) or None,
        cluster_endpoint_url=(parse_endpoint_url(ATTR_CLUSTER_ENDPOINT_URL, v)
                              if (v := get(ATTR_CLUSTER_ENDPOINT_URL)) else None),
        cluster_timeout_s=_parse_seconds(ATTR_CLUSTER_TIMEOUT, v) if (v := get(ATTR_CLUSTER_TIMEOUT)) else None,
        manifest_key=_parse_manifest_key(v) if (v := get(ATTR_MANIFEST)) is not None else None,
        upload_delay_s=_parse_seconds(ATTR_UPLOAD_DELAY, v) if (v := get(ATTR_UPLOAD_DELAY)) is not None else None,
        upload_max_delay_s=(_parse_seconds(ATTR_UPLOAD_MAX_DELAY, v)
                            if (v := get(ATTR_UPLOAD_MAX_DELAY)) is not None else None),
        stop_timeout_s=_parse_seconds(ATTR_STOP_TIMEOUT, v) if (v := get(ATTR_STOP_TIMEOUT)) is not None else None,
        write_durability=v if (v := get(ATTR_WRITE_DURABILITY)) is not None else None,
        direct_io=parse_bool(ATTR_DIRECT_IO, v) if (v := get(ATTR_DIRECT_IO)) is not None else False,
        fuse_threads=_parse_int(ATTR_FUSE_THREADS, v, 1, MAX_FUSE_THREADS) if (v := get(ATTR_FUSE_THREADS)) is not None
        else None,
    )
    if options.write_durability is not None and options.write_durability not in WRITE_DURABILITIES:
        raise invalid(f"volume attribute {ATTR_WRITE_DURABILITY!r} must be one of {', '.join(WRITE_DURABILITIES)}, "
                      f"got {_quote(options.write_durability)}")
    if options.write_durability == "cluster" and options.cluster_cache is None:
        raise invalid(f"volume attribute {ATTR_WRITE_DURABILITY!r} 'cluster' needs {ATTR_CLUSTER_CACHE!r}")
    if options.cluster_cache is None and (options.cluster_endpoint_url or options.cluster_timeout_s is not None):
        raise invalid(f"volume attributes {ATTR_CLUSTER_ENDPOINT_URL!r} and {ATTR_CLUSTER_TIMEOUT!r} need "
                      f"{ATTR_CLUSTER_CACHE!r}")
    if options.cluster_cache is not None:
        try:
            if options.cluster_timeout_s is None:
                ClusterSettings(url=options.cluster_cache, endpoint_url=options.cluster_endpoint_url)
            else:
                ClusterSettings(url=options.cluster_cache, endpoint_url=options.cluster_endpoint_url,
                                timeout_s=options.cluster_timeout_s)
        except ValueError as exc:
            raise invalid(f"volume attribute {ATTR_CLUSTER_CACHE!r}: {exc}") from None
    try:
        admin.check_writeback_options(upload_delay_s=options.upload_delay_s,
                                      upload_max_delay_s=options.upload_max_delay_s,
                                      stop_timeout_s=options.stop_timeout_s)
    except ValueError as exc:
        timing = "/".join(repr(k) for k in (ATTR_UPLOAD_DELAY, ATTR_UPLOAD_MAX_DELAY, ATTR_STOP_TIMEOUT) if k in values)
        raise invalid(f"volume attributes {timing}: {exc}") from None
    try:
        admin.check_cache_options(ram_bytes=options.ram_bytes, disk_bytes=options.disk_bytes,
                                  block_size=options.block_size, readahead_bytes=options.readahead_bytes,
                                  max_fetches=options.max_fetches)
    except ValueError as exc:
        keys = ", ".join(repr(k) for k in (ATTR_RAM_CACHE, ATTR_DISK_CACHE, ATTR_BLOCK_SIZE) if k in values)
        raise invalid(f"volume attributes {keys or 'cache options'}: {exc}") from None
    return options


def mount_pod_memory_bytes(ram_bytes: int | None) -> int:
    """The memory a mount pod gets by default for a RAM tier of ``ram_bytes`` (None: the default)."""
    return (DEFAULT_RAM_CACHE_BYTES if ram_bytes is None else ram_bytes) + DAEMON_OVERHEAD_BYTES


def cpu_milli(key: str, value: str, what: str | None = None) -> int:
    """Millicores of a CPU quantity; INVALID_ARGUMENT naming ``what`` (default: the attribute ``key``)."""
    what = what or f"volume attribute {key!r}"
    match = _CPU_RE.fullmatch(value)
    if match is None or (match["milli"] and "." in match["num"]):
        raise invalid(f"{what} must be a CPU quantity such as '500m' or '2', got {_quote(value)}")
    milli = int(match["num"]) if match["milli"] else round(float(match["num"]) * 1000)
    if not 0 < milli <= MAX_MOUNT_POD_CPU_MILLI:
        raise invalid(f"{what} must be more than 0 and at most {MAX_MOUNT_POD_CPU_MILLI // 1000} "
                      f"cores, got {_quote(value)}")
    return milli


def memory_bytes(key: str, value: str, what: str | None = None) -> int:
    """Bytes of a memory quantity; INVALID_ARGUMENT naming ``what`` (default: the attribute ``key``)."""
    what = what or f"volume attribute {key!r}"
    match = _MEMORY_RE.fullmatch(value)
    if match is None:
        raise invalid(f"{what} must be a memory quantity such as '512Mi' or '2Gi', "
                      f"got {_quote(value)}")
    size = int(match["num"]) * _MEMORY_UNITS[match["unit"]]
    if size < MIN_MOUNT_POD_MEMORY:
        raise invalid(f"{what} must be at least 64Mi (a cachefs daemon needs more), "
                      f"got {_quote(value)}")
    return size


def parse_mount_pod_resources(values: Mapping[str, str]) -> MountPodResources:
    """The ``mountPod*`` keys of ``values``: each a valid quantity, each request at most its limit."""
    cpu = {key: cpu_milli(key, values[key]) for key in (ATTR_MOUNT_POD_CPU_REQUEST, ATTR_MOUNT_POD_CPU_LIMIT)
           if key in values}
    memory = {key: memory_bytes(key, values[key])
              for key in (ATTR_MOUNT_POD_MEMORY_REQUEST, ATTR_MOUNT_POD_MEMORY_LIMIT) if key in values}
    for numbers, request, limit in ((cpu, ATTR_MOUNT_POD_CPU_REQUEST, ATTR_MOUNT_POD_CPU_LIMIT),
                                    (memory, ATTR_MOUNT_POD_MEMORY_REQUEST, ATTR_MOUNT_POD_MEMORY_LIMIT)):
        if request in numbers and limit in numbers and numbers[request] > numbers[limit]:
            raise invalid(f"volume attribute {request!r} ({values[request]}) is more than {limit!r} ({values[limit]})")
    return MountPodResources(values.get(ATTR_MOUNT_POD_CPU_REQUEST), values.get(ATTR_MOUNT_POD_CPU_LIMIT),
                             values.get(ATTR_MOUNT_POD_MEMORY_REQUEST), values.get(ATTR_MOUNT_POD_MEMORY_LIMIT))


def parse_owner_options(values: Mapping[str, str]) -> OwnerOptions:
    """The ``uid``/``gid``/``fileMode``/``dirMode`` keys of ``values``, each checked."""
    def parsed(key: str, parse: Callable[[str, str], int]) -> int | None:
        if key not in values:
            return None
        try:
            return parse(f"volume attribute {key!r}", values[key])
        except ValueError as exc:
            raise invalid(str(exc)) from None

    return OwnerOptions(parsed(ATTR_UID, admin.parse_id), parsed(ATTR_GID, admin.parse_id),
                        parsed(ATTR_FILE_MODE, admin.parse_mode), parsed(ATTR_DIR_MODE, admin.parse_mode))


def parse_mount_flags(flags: Iterable[str]) -> MountFlags:
    """``ro``/``rw`` and ``uid=``/``gid=``/``file-mode=``/``dir-mode=``; anything else is refused."""
    read_only = False
    owner: dict[str, int] = {}
    parsers = {FLAG_UID: ("uid", admin.parse_id), FLAG_GID: ("gid", admin.parse_id),
               FLAG_FILE_MODE: ("file_mode", admin.parse_mode), FLAG_DIR_MODE: ("dir_mode", admin.parse_mode)}
    unknown = []
    for flag in flags:
        name, sep, value = flag.removeprefix("--").partition("=")
        if flag == FLAG_READ_ONLY:
            read_only = True
        elif flag == FLAG_READ_WRITE:
            pass
        elif sep and name in parsers:
            field_name, parse = parsers[name]
            try:
                number = parse(f"mount option {name!r}", value)
            except ValueError as exc:
                raise invalid(str(exc)) from None
            if owner.setdefault(field_name, number) != number:
                raise invalid(f"mount option {name!r} is given twice with different values")
        else:
            unknown.append(flag)
    if unknown:
        raise invalid(f"mount options {', '.join(map(_quote, unknown))} are not supported (only 'ro', 'rw', "
                      f"{', '.join(f'{n}=' for n in OWNER_FLAGS)}); set cache options as volume attributes")
    return MountFlags(read_only, OwnerOptions(**owner))


def parse_mount_group(value: str, what: str = "volume_capability.mount.volume_mount_group") -> int | None:
    """A pod's fsGroup as the CO passes it ("" when the pod has none)."""
    if not value:
        return None
    try:
        return admin.parse_id(what, value)
    except ValueError as exc:
        raise invalid(str(exc)) from None


def is_kubernetes_key(key: str) -> bool:
    """True for a key under a prefix Kubernetes reserves (``*.k8s.io/``, ``*.kubernetes.io/``)."""
    domain, slash, _ = key.partition("/")
    return bool(slash) and any(domain == d or domain.endswith("." + d) for d in K8S_RESERVED_DOMAINS)


def _check_keys(values: Mapping[str, str], allowed: frozenset[str], what: str) -> None:
    for key in sorted(values):
        if is_kubernetes_key(key):
            continue
        if key not in allowed:
            raise invalid(f"unknown {what} {key!r} (known: {', '.join(sorted(allowed))})")


# ------------------------------------------------------------------------------------ entry points
def parse_volume_attributes(values: Mapping[str, str]) -> VolumeSettings:
    """Volume attributes -> ``VolumeSettings``; ``CsiError(INVALID_ARGUMENT)`` naming the bad key."""
    _check_keys(values, VOLUME_ATTRIBUTE_KEYS, "volume attribute")
    source = values.get(ATTR_SOURCE, "")
    if not source:
        raise invalid(f"volume attribute {ATTR_SOURCE!r} is required (e.g. s3://bucket/prefix)")
    try:
        info = admin.validate_source(source)
    except ValueError as exc:
        raise invalid(f"volume attribute {ATTR_SOURCE!r}: {exc}") from None
    if info.scheme != "s3":
        # A file:// source would let any pod read the node's own files through the privileged
        # node plugin: only object-store sources are served to Kubernetes.
        raise invalid(f"volume attribute {ATTR_SOURCE!r} must be an s3:// URL (file:// is not served to pods)")
    endpoint = values.get(ATTR_ENDPOINT_URL) or None
    region = values.get(ATTR_REGION) or None
    return VolumeSettings(
        source=source,
        endpoint_url=parse_endpoint_url(ATTR_ENDPOINT_URL, endpoint) if endpoint else None,
        region=_parse_region(ATTR_REGION, region) if region else None,
        cache=parse_cache_options(values),
        read_only=parse_bool(ATTR_READ_ONLY, values[ATTR_READ_ONLY]) if ATTR_READ_ONLY in values else False,
        ephemeral=values.get(K8S_EPHEMERAL, "").lower() == "true",
        owner=parse_owner_options(values),
        mount_pod=parse_mount_pod_resources(values),
    )


def parse_provision_parameters(values: Mapping[str, str]) -> ProvisionSettings:
    """StorageClass parameters -> ``ProvisionSettings``; INVALID_ARGUMENT naming the bad key."""
    _check_keys(values, PROVISION_PARAMETER_KEYS, "StorageClass parameter")
    bucket = values.get(PARAM_BUCKET, "")
    if not bucket:
        raise invalid(f"StorageClass parameter {PARAM_BUCKET!r} is required")
    try:
        info = admin.validate_source(f"s3://{bucket}/")
    except ValueError as exc:
        raise invalid(f"StorageClass parameter {PARAM_BUCKET!r}: {exc}") from None
    if info.bucket != bucket:
        raise invalid(f"StorageClass parameter {PARAM_BUCKET!r} must be a bucket name only, got {_quote(bucket)}")
    prefix = values.get(PARAM_PREFIX, "").strip("/")
    if prefix and not all(_SEGMENT_RE.fullmatch(part) for part in prefix.split("/")):
        raise invalid(f"StorageClass parameter {PARAM_PREFIX!r} must be '/'-separated names of letters, digits, "
                      f"'.', '_' and '-', got {_quote(values[PARAM_PREFIX])}")
    policy_text = values.get(PARAM_ON_DELETE, DeletePolicy.RETAIN.value)
    try:
        policy = DeletePolicy(policy_text)
    except ValueError:
        raise invalid(f"StorageClass parameter {PARAM_ON_DELETE!r} must be 'retain' or 'delete', "
                      f"got {_quote(policy_text)}") from None
    endpoint = values.get(ATTR_ENDPOINT_URL) or None
    region = values.get(ATTR_REGION) or None
    parse_cache_options(values)  # refuse bad cache values now, not at every publish
    parse_owner_options(values)
    parse_mount_pod_resources(values)
    if ATTR_READ_ONLY in values:
        parse_bool(ATTR_READ_ONLY, values[ATTR_READ_ONLY])
    copied = {k: values[k] for k in (*CACHE_KEYS, ATTR_READ_ONLY, *OWNER_KEYS, *MOUNT_POD_KEYS) if k in values}
    return ProvisionSettings(
        bucket=bucket,
        prefix=prefix,
        endpoint_url=parse_endpoint_url(ATTR_ENDPOINT_URL, endpoint) if endpoint else None,
        region=_parse_region(ATTR_REGION, region) if region else None,
        on_delete=policy,
        cache_attributes=copied,
    )


def parse_credentials(secrets: Mapping[str, str]) -> Credentials | None:
    """CSI secrets -> ``Credentials``, or None when the Secret carries no key pair.

    Without credentials the mount uses the node plugin's own AWS identity (IRSA, instance role).
    Other keys in the Secret are ignored: Secrets are often shared with other consumers.
    """
    key_id = secrets.get(SECRET_ACCESS_KEY_ID, "")
    secret = secrets.get(SECRET_SECRET_ACCESS_KEY, "")
    token = secrets.get(SECRET_SESSION_TOKEN, "") or None
    if not key_id and not secret:
        if token:
            raise invalid(f"secret key {SECRET_SESSION_TOKEN!r} needs {SECRET_ACCESS_KEY_ID!r} and "
                          f"{SECRET_SECRET_ACCESS_KEY!r}")
        return None
    if not key_id:
        raise invalid(f"secret key {SECRET_ACCESS_KEY_ID!r} is missing (it goes with {SECRET_SECRET_ACCESS_KEY!r})")
    if not secret:
        raise invalid(f"secret key {SECRET_SECRET_ACCESS_KEY!r} is missing (it goes with {SECRET_ACCESS_KEY_ID!r})")
    for name, value in ((SECRET_ACCESS_KEY_ID, key_id), (SECRET_SECRET_ACCESS_KEY, secret),
                        (SECRET_SESSION_TOKEN, token or "")):
        if any(ord(ch) < 0x20 or ch == "\x7f" for ch in value) or value != value.strip():
            raise invalid(f"secret key {name!r} contains whitespace or control characters")  # value not shown
    return Credentials(key_id, secret, token)


# CreateVolume names: the CSI spec allows 128 bytes (csi-sanity creates one that long). A name whose
# volume id would not fit is shortened deterministically for its prefix (volume_id.prefix_name).
_VOLUME_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_volume_name(name: str) -> str:
    """A CreateVolume name usable as the last component of an S3 prefix (``pvc-<uid>`` in Kubernetes)."""
    if not _VOLUME_NAME_RE.fullmatch(name):
        raise invalid(f"volume name {_quote(name)} must be 1 to 128 letters, digits, '.', '_' or '-', "
                      "starting with a letter or digit")
    return name
