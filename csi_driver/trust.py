"""What a volume may ask of the node plugin: whose cloud identity, which endpoints, which buckets.

Whoever may create a pod may write a volume's attributes (an inline ephemeral volume is part of the
pod spec), so the attributes are the pod author's, not the cluster admin's. Three rules, set once
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
  server the pod author runs, it hands that server signed requests and any session token. The list
  holds origins (``https://s3.example:9000``; ``aws`` for the default AWS endpoint); the cluster-tier
  endpoint is checked like the source's. No list: any endpoint, as before.

A refusal is a ``CsiError`` with a one-line message naming the volume's value and the flag that would
allow it; the kubelet shows it in the pod's ``FailedMount`` Event. The check runs where a daemon is
about to be started with the request's credentials (``NodeOps``), so a stage without secrets (whose
first publish mounts) and a direct publish are checked the same way. Separate from
``csi_driver.attributes``, which parses keys; this module judges them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping
from urllib.parse import urlsplit

from csi_driver.attributes import Credentials, VolumeSettings
from csi_driver.errors import Code, CsiError

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


def _bucket(source: str) -> str:
    return urlsplit(source).netloc


@dataclass(frozen=True)
class VolumeTrust:
    """The admin's answers (node plugin flags). The defaults are the safe ones."""

    allow_node_identity: bool = False
    allowed_endpoints: frozenset[str] | None = None  # origins, or "aws"; None: any
    allowed_buckets: frozenset[str] | None = None  # None: any

    @classmethod
    def from_flags(cls, allow_node_identity: bool, endpoints: str, buckets: str) -> "VolumeTrust":
        """From the comma-separated flag values (empty: no list). ``ValueError`` naming a bad entry."""
        allowed_endpoints = None
        if endpoints.strip():
            allowed_endpoints = frozenset(_endpoint_entry(e.strip()) for e in endpoints.split(",") if e.strip())
        allowed_buckets = None
        if buckets.strip():
            allowed_buckets = frozenset(b.strip() for b in buckets.split(",") if b.strip())
        return cls(allow_node_identity, allowed_endpoints, allowed_buckets)

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
        if self.allowed_endpoints is not None:
            for key, url in endpoints:
                origin = endpoint_origin(url)
                if origin not in self.allowed_endpoints:
                    shown = origin if url else "the default AWS S3 endpoint (aws)"
                    raise CsiError(Code.PERMISSION_DENIED,
                                   f"volume {volume_id}: {key} {shown} is not among this driver's allowed endpoints "
                                   f"({', '.join(sorted(self.allowed_endpoints))}); the admin may add it to "
                                   f"--allowed-endpoints")
        if self.allowed_buckets is not None:
            buckets = [("source", _bucket(volume.source))]
            if volume.cache.cluster_cache is not None:
                buckets.append(("clusterCache", _bucket(volume.cache.cluster_cache)))
            for key, bucket in buckets:
                if bucket not in self.allowed_buckets:
                    raise CsiError(Code.PERMISSION_DENIED,
                                   f"volume {volume_id}: {key} bucket {bucket!r} is not among this driver's allowed "
                                   f"buckets; the admin may add it to --allowed-buckets")


def _endpoint_entry(entry: str) -> str:
    if entry == AWS_DEFAULT_ENDPOINT:
        return entry
    parts = urlsplit(entry)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") or parts.query:
        raise ValueError(f"--allowed-endpoints entry {entry!r}: expected http(s)://host[:port] or {AWS_DEFAULT_ENDPOINT}")
    return endpoint_origin(entry)
