"""What a volume may ask of the node plugin: whose cloud identity, which endpoints, which buckets.

Whoever may create a pod may write a volume's attributes (an inline ephemeral volume is part of the
pod spec), so the attributes are the pod author's, not the cluster admin's. These rules, set once
per driver install by the admin (node plugin flags, see ``deploy/README.md``), keep a pod author from
using the node plugin as a confused deputy:

- **The node's identity is not lent by default.** Without a Secret, a daemon would run with the
  node plugin's own cloud identity: ``AWS_ROLE_ARN``/``AWS_WEB_IDENTITY_TOKEN_FILE`` (IRSA), the
  container credentials of EKS Pod Identity, or the instance profile. Any pod author could then
  mount any bucket that identity reads. A mount without a Secret is refused (PERMISSION_DENIED)
  unless the admin passed ``--allow-node-identity``; without it the node plugin also strips those
  variables from every daemon's environment, points the AWS config and credentials files at
  /dev/null and turns off the instance metadata lookup, so a volume with a Secret can never fall
  back to them either (``daemon_environ``).
- **An inline ephemeral volume always needs a Secret**, flag or not: it names its bucket and
  endpoint in the pod spec itself, with no PersistentVolume an admin had to create.
- **Endpoints (and optionally buckets) come from an allow-list** (``--allowed-endpoints``,
  ``--allowed-buckets``). A daemon signs every request with the credentials it holds; pointed at a
  server the pod author runs, it hands that server signed requests and any session token, and the
  mount's error tells a closed port, a 403 and a 404 apart (a probe of the cluster's network from
  the driver's namespace). An entry is ``http(s)://host[:port]/path/`` (``aws`` for the default AWS
  endpoint): it allows an endpoint of that origin whose path is the entry's or below it, segment by
  segment (``https://gw.example/s3/`` allows ``https://gw.example/s3/`` and ``.../s3/eu/``, not
  ``.../s3-other/`` nor ``.../other/``); an entry without a path (or ``/``) allows the whole origin.
  An endpoint path with a ``.``/``..`` segment, a ``%`` escape or a backslash is never allowed by a
  path entry: the server, not this check, would decide what it means. The cluster-tier endpoint is
  checked like the source's. The shipped overlays set a list (deploy/README.md).
- **The cluster store is never a source.** The origins of ``--cluster-store-endpoint`` may be a
  volume's ``clusterEndpointUrl`` (where listed), never its ``endpointUrl``, list or no list: the
  store holds every tenant's cached blocks, and a mount pod may hold the store's own key.
- **No list: any endpoint but the node's own addresses.** Without ``--allowed-endpoints`` a volume
  may not name a loopback address (127.0.0.0/8, ::1, ``localhost``), a link-local one
  (169.254.0.0/16, the cloud metadata services among them; fe80::/10) or the unspecified address
  (0.0.0.0, ::, which reaches this host), in any spelling the resolver accepts (``127.1``,
  ``0x7f.0.0.1``, ``2130706433``, ``::ffff:127.0.0.1``). ``--allow-local-endpoints`` lifts this
  rule (a one-node cluster whose store runs on the node; the tests). Host names are not resolved: a
  name can resolve to a public address now and to 169.254.169.254 when the daemon connects (DNS
  rebinding), so a check of its address here would prove nothing; where pod authors are not
  trusted, the allow-list is the control (and a NetworkPolicy on the driver's namespace the one
  that also holds for names at connect time).
- **Admin caps on what a volume may make a node spend** (``--max-ram-cache``,
  ``--max-mount-pod-memory``, ``--max-mount-pod-cpu``, ``--max-stop-timeout``): a volume asking for
  more (``ramCache``, a ``mountPod*`` request or limit, ``stopTimeout``, or a ``ramCache`` whose mount
  pod's default memory limit, ``ramCache`` + the daemon's overhead, would pass the memory cap) is
  refused with INVALID_ARGUMENT naming the attribute, its value and the cap. No cap: as before.

A refusal is a ``CsiError`` (PERMISSION_DENIED; INVALID_ARGUMENT for a cap) with a one-line message
naming the volume's value and the flag that would allow it; the kubelet shows it in the pod's ``FailedMount`` Event. The check runs where a daemon is
about to be started with the request's credentials (``NodeOps``), so a stage without secrets (whose
first publish mounts) and a direct publish are checked the same way. Separate from
``csi_driver.attributes``, which parses keys; this module judges them.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import Mapping
from urllib.parse import urlsplit

from csi_driver.attributes import (
    ATTR_MOUNT_POD_CPU_LIMIT,
    ATTR_MOUNT_POD_CPU_REQUEST,
    ATTR_MOUNT_POD_MEMORY_LIMIT,
    ATTR_MOUNT_POD_MEMORY_REQUEST,
    ATTR_RAM_CACHE,
    ATTR_STOP_TIMEOUT,
    Credentials,
    VolumeSettings,
    cpu_milli,
    memory_bytes,
    mount_pod_memory_bytes,
)
from csi_driver.errors import Code, CsiError, invalid

# How an allow-list names the default AWS S3 endpoint (a volume without ``endpointUrl``).
AWS_DEFAULT_ENDPOINT = "aws"
# The node plugin's own identity, as the AWS SDKs find it: web identity (IRSA), container
# credentials (EKS Pod Identity, ECS), shared config profiles. The instance profile has no variable:
# AWS_EC2_METADATA_DISABLED turns its lookup off.
NODE_IDENTITY_VARIABLES = (
    "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_SESSION_NAME",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN", "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
    "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE",
)


def endpoint_origin(url: str | None) -> str:
    """``scheme://host[:port]`` of an endpoint URL, lower-cased; ``aws`` for None (the default)."""
    if not url:
        return AWS_DEFAULT_ENDPOINT
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"
    default_port = {"http": 80, "https": 443}.get(parts.scheme)
    port = "" if parts.port in (None, default_port) else f":{parts.port}"
    return f"{parts.scheme.lower()}://{host}{port}"


def endpoint_path(url: str) -> str | None:
    """The path of an endpoint URL ending in ``/`` (``/`` for none); None where a server could read it
    otherwise than segment by segment (a ``.``/``..`` segment, a ``%`` escape, a backslash)."""
    path = urlsplit(url).path or "/"
    if "%" in path or "\\" in path or any(part in (".", "..") for part in path.split("/")):
        return None
    return path if path.endswith("/") else path + "/"


def local_address(host: str) -> str | None:
    """Why ``host`` (a URL's host) is this node's own or its link's ("loopback", ...), else None.

    Literal addresses in every form the C resolver takes (``inet_aton``: ``127.1``, ``0x7f.1``,
    ``2130706433``), IPv4 in IPv6 (``::ffff:127.0.0.1``), and the ``localhost`` names; other names
    are not resolved (see the module docstring)."""
    host = host.lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return "loopback"
    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        try:
            address = ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link-local"
    if address.is_unspecified:
        return "unspecified (this host)"
    return None


def _bucket(source: str) -> str:
    return urlsplit(source).netloc


@dataclass(frozen=True)
class VolumeCaps:
    """The most a volume may ask for (node plugin flags); None: no cap."""

    max_ram_cache_bytes: int | None = None
    max_mount_pod_memory_bytes: int | None = None
    max_mount_pod_cpu_milli: int | None = None
    max_stop_timeout_s: float | None = None

    def check(self, volume_id: str, volume: VolumeSettings) -> None:
        """Refuse (INVALID_ARGUMENT naming the attribute, its value and the cap) what passes a cap."""
        def refuse(key: str, value: str, cap: str, flag: str) -> CsiError:
            return invalid(f"volume {volume_id}: volume attribute {key!r} is {value}, above this driver's cap of "
                           f"{cap} ({flag}); ask for less, or the admin may raise the cap")

        ram = volume.cache.ram_bytes
        if self.max_ram_cache_bytes is not None and ram is not None and ram > self.max_ram_cache_bytes:
            raise refuse(ATTR_RAM_CACHE, f"{ram} bytes", f"{self.max_ram_cache_bytes} bytes", "--max-ram-cache")
        stop = volume.cache.stop_timeout_s
        if self.max_stop_timeout_s is not None and stop is not None and stop > self.max_stop_timeout_s:
            raise refuse(ATTR_STOP_TIMEOUT, f"{stop:g} s", f"{self.max_stop_timeout_s:g} s", "--max-stop-timeout")
        pod = volume.mount_pod
        if self.max_mount_pod_memory_bytes is not None:
            cap = self.max_mount_pod_memory_bytes
            for key, value in ((ATTR_MOUNT_POD_MEMORY_REQUEST, pod.memory_request),
                               (ATTR_MOUNT_POD_MEMORY_LIMIT, pod.memory_limit)):
                if value is not None and memory_bytes(key, value) > cap:
                    raise refuse(key, value, f"{cap >> 20}Mi", "--max-mount-pod-memory")
            if pod.memory_limit is None and mount_pod_memory_bytes(ram) > cap:
                raise refuse(ATTR_RAM_CACHE, f"{ram if ram is not None else 'the default'} bytes (its mount pod's "
                             f"memory limit would be {mount_pod_memory_bytes(ram) >> 20}Mi)",
                             f"{cap >> 20}Mi", "--max-mount-pod-memory")
        if self.max_mount_pod_cpu_milli is not None:
            for key, value in ((ATTR_MOUNT_POD_CPU_REQUEST, pod.cpu_request), (ATTR_MOUNT_POD_CPU_LIMIT, pod.cpu_limit)):
                if value is not None and cpu_milli(key, value) > self.max_mount_pod_cpu_milli:
                    raise refuse(key, value, f"{self.max_mount_pod_cpu_milli}m", "--max-mount-pod-cpu")


@dataclass(frozen=True)
class VolumeTrust:
    """The admin's answers (node plugin flags). The defaults are the safe ones."""

    allow_node_identity: bool = False
    # "origin/path/" entries (endpoint_origin + endpoint_path), or "aws"; None: any but local ones
    allowed_endpoints: frozenset[str] | None = None
    allowed_buckets: frozenset[str] | None = None  # None: any
    cluster_store_origins: frozenset[str] = frozenset()  # never a source's endpoint
    caps: VolumeCaps = VolumeCaps()
    allow_local_endpoints: bool = False  # loopback/link-local without a list (a one-node test cluster)

    @classmethod
    def from_flags(cls, allow_node_identity: bool, endpoints: str, buckets: str, cluster_store: str = "",
                   caps: VolumeCaps = VolumeCaps(), allow_local_endpoints: bool = False) -> "VolumeTrust":
        """From the comma-separated flag values (empty: no list). ``ValueError`` naming a bad entry."""
        allowed_endpoints = None
        if endpoints.strip():
            allowed_endpoints = frozenset(_endpoint_entry(e.strip()) for e in endpoints.split(",") if e.strip())
        allowed_buckets = None
        if buckets.strip():
            allowed_buckets = frozenset(b.strip() for b in buckets.split(",") if b.strip())
        stores = frozenset(endpoint_origin(e.strip()) for e in cluster_store.split(",")
                           if e.strip() and _endpoint_entry(e.strip(), "--cluster-store-endpoint"))
        return cls(allow_node_identity, allowed_endpoints, allowed_buckets, stores, caps, allow_local_endpoints)

    def endpoint_allowed(self, url: str | None) -> bool:
        """Whether a list entry allows ``url`` (its origin, and its path at or below the entry's)."""
        assert self.allowed_endpoints is not None
        if not url:
            return AWS_DEFAULT_ENDPOINT in self.allowed_endpoints
        origin, path = endpoint_origin(url), endpoint_path(url)
        for entry in self.allowed_endpoints:
            if entry == origin + "/":
                return True
            if path is not None and entry.startswith(origin + "/") and (origin + path).startswith(entry):
                return True
        return False

    def daemon_environ(self, environ: Mapping[str, str]) -> dict[str, str]:
        """The environment daemons inherit: without the node's identity unless it may be lent."""
        if self.allow_node_identity:
            return dict(environ)
        env = {key: value for key, value in environ.items() if key not in NODE_IDENTITY_VARIABLES}
        env["AWS_EC2_METADATA_DISABLED"] = "true"  # the instance profile
        # Not the default ~/.aws files either (profiles, credential_process, source_profile).
        env["AWS_CONFIG_FILE"] = env["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull
        return env

    def check(self, volume_id: str, volume: VolumeSettings, credentials: Credentials | None) -> None:
        """Refuse (``CsiError``, PERMISSION_DENIED) a mount these rules do not allow."""
        if credentials is None and volume.ephemeral:
            raise CsiError(Code.PERMISSION_DENIED,
                           f"volume {volume_id}: an inline ephemeral volume needs a Secret with accessKeyId and "
                           f"secretAccessKey (nodePublishSecretRef); it never runs with the node's identity")
        if credentials is None and not self.allow_node_identity:
            raise CsiError(Code.PERMISSION_DENIED,
                           f"volume {volume_id} has no Secret, and this driver does not lend the node plugin's "
                           f"cloud identity to volumes: give the volume a Secret with accessKeyId and "
                           f"secretAccessKey (nodePublishSecretRef), or start the node plugin with "
                           f"--allow-node-identity")
        endpoints = [("endpointUrl", volume.endpoint_url)]
        if volume.cache.cluster_cache is not None:
            endpoints.append(("clusterEndpointUrl", volume.cache.cluster_endpoint_url))
        for key, url in endpoints:
            self._check_endpoint(volume_id, key, url)
        self.caps.check(volume_id, volume)
        if self.allowed_buckets is not None:
            buckets = [("source", _bucket(volume.source))]
            if volume.cache.cluster_cache is not None:
                buckets.append(("clusterCache", _bucket(volume.cache.cluster_cache)))
            for key, bucket in buckets:
                if bucket not in self.allowed_buckets:
                    raise CsiError(Code.PERMISSION_DENIED,
                                   f"volume {volume_id}: {key} bucket {bucket!r} is not among this driver's allowed "
                                   f"buckets; the admin may add it to --allowed-buckets")


    def _check_endpoint(self, volume_id: str, key: str, url: str | None) -> None:
        if key == "endpointUrl" and url and endpoint_origin(url) in self.cluster_store_origins:
            raise CsiError(Code.PERMISSION_DENIED,
                           f"volume {volume_id}: endpointUrl {endpoint_origin(url)} is the cluster store "
                           f"(--cluster-store-endpoint), which a volume may name only as its clusterEndpointUrl")
        if self.allowed_endpoints is not None:
            if not self.endpoint_allowed(url):
                shown = url if url else "the default AWS S3 endpoint (aws)"
                raise CsiError(Code.PERMISSION_DENIED,
                               f"volume {volume_id}: {key} {shown} is not among this driver's allowed endpoints "
                               f"({', '.join(sorted(self.allowed_endpoints))}); the admin may add it to "
                               f"--allowed-endpoints")
            return
        if not url:
            return
        why = None if self.allow_local_endpoints else local_address(urlsplit(url).hostname or "")
        if why is not None:
            raise CsiError(Code.PERMISSION_DENIED,
                           f"volume {volume_id}: {key} {endpoint_origin(url)} is a {why} address, which volumes may "
                           f"not name unless the admin lists it in --allowed-endpoints")


def _endpoint_entry(entry: str, flag: str = "--allowed-endpoints") -> str:
    """An allow-list entry, normalized: ``aws``, or origin + path ending in ``/``."""
    if entry == AWS_DEFAULT_ENDPOINT:
        return entry
    try:
        parts = urlsplit(entry)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        parts = urlsplit("")
    path = endpoint_path(entry) if parts.scheme else None
    if (parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment
            or parts.username is not None or path is None):
        raise ValueError(f"{flag} entry {entry!r}: expected http(s)://host[:port][/path/] or {AWS_DEFAULT_ENDPOINT}")
    return endpoint_origin(entry) + path
