"""Controller semantics: dynamic provisioning of volumes as prefixes of a bucket.

A StorageClass names a bucket (and optionally a prefix inside it); each PersistentVolumeClaim of that
class gets the prefix ``<prefix>/<pv-name>/``. Creating a volume stores nothing: S3 has no
directories, and an empty prefix is an empty volume. CreateVolume checks, with the provisioner's
credentials, that the bucket exists and may be listed, so a wrong bucket name or key fails the
claim at once with a clear event instead of failing every pod that mounts it later.

The volume id encodes bucket, prefix, endpoint, region and the deletion policy (``volume_id.py``),
so the controller keeps no state: DeleteVolume with ``onDelete: delete`` removes every object under
the volume's prefix; with ``retain`` (the default, because a training dataset or its checkpoints
are usually worth more than the claim that wrote them) it leaves them where they are. A volume id
this controller did not make (a hand-written PersistentVolume) is never touched.

Store access goes through a ``BucketAdmin`` (``cachefs.admin`` in production, ``InMemoryBucketAdmin``
in unit tests), with credentials handed over only as an ``environ`` mapping.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from typing import Mapping, Protocol

from cachefs import admin
from csi_driver import volume_id as volume_ids
from csi_driver.attributes import (
    ATTR_ENDPOINT_URL,
    ATTR_REGION,
    ATTR_SOURCE,
    Credentials,
    DeletePolicy,
    check_volume_name,
    parse_provision_parameters,
    parse_volume_attributes,
)
from csi_driver.errors import Code, CsiError, invalid
from csi_driver.mounter import AWS_CREDENTIAL_VARIABLES

log = logging.getLogger(__name__)


class BucketAdmin(Protocol):
    def check(self, source: str, endpoint_url: str | None, environ: Mapping[str, str]) -> None:
        """Raise ``admin.AdminError`` unless the bucket of ``source`` exists and its prefix may be listed."""

    def delete_prefix(self, source: str, endpoint_url: str | None, environ: Mapping[str, str]) -> int:
        """Delete every object under ``source``'s prefix; return how many. Idempotent."""


class CachefsBucketAdmin:
    """``BucketAdmin`` over ``cachefs.admin`` (the object stores cachefs itself uses)."""

    def check(self, source: str, endpoint_url: str | None, environ: Mapping[str, str]) -> None:
        asyncio.run(admin.check_source_access(source, endpoint_url=endpoint_url, environ=environ))

    def delete_prefix(self, source: str, endpoint_url: str | None, environ: Mapping[str, str]) -> int:
        return asyncio.run(admin.delete_prefix(source, endpoint_url=endpoint_url, environ=environ))


@dataclass
class InMemoryBucketAdmin:
    """A ``BucketAdmin`` over a dict of bucket -> set of keys, for unit tests."""

    buckets: dict[str, set[str]] = field(default_factory=dict)
    denied: bool = False
    calls: list[tuple[str, str]] = field(default_factory=list)

    def _split(self, source: str) -> tuple[str, str]:
        info = admin.validate_source(source)
        if info.bucket not in self.buckets:
            raise admin.AdminNotFound(f"bucket {info.bucket!r} does not exist")
        if self.denied:
            raise admin.AdminAccessDenied(f"LIST s3://{info.bucket}/{info.prefix}: access denied")
        return info.bucket, info.prefix

    def check(self, source: str, endpoint_url: str | None, environ: Mapping[str, str]) -> None:
        self.calls.append(("check", source))
        self._split(source)

    def delete_prefix(self, source: str, endpoint_url: str | None, environ: Mapping[str, str]) -> int:
        self.calls.append(("delete", source))
        bucket, prefix = self._split(source)
        doomed = {key for key in self.buckets[bucket] if key.startswith(prefix)}
        self.buckets[bucket] -= doomed
        return len(doomed)


@dataclass(frozen=True)
class CreatedVolume:
    volume_id: str
    capacity_bytes: int
    volume_context: dict[str, str]


def store_error(exc: admin.AdminError, doing: str) -> CsiError:
    """An ``AdminError`` as the CSI code a CO acts on (retry, or report to the user)."""
    if isinstance(exc, admin.AdminNotFound):
        return CsiError(Code.FAILED_PRECONDITION, f"{doing}: {exc}")
    if isinstance(exc, admin.AdminAccessDenied):
        return CsiError(Code.PERMISSION_DENIED, f"{doing}: {exc}")
    if isinstance(exc, admin.AdminUnavailable):
        return CsiError(Code.UNAVAILABLE, f"{doing}: {exc}")
    return CsiError(Code.INTERNAL, f"{doing}: {exc}")


class ControllerOps:
    """CreateVolume / DeleteVolume / ValidateVolumeCapabilities semantics."""

    def __init__(self, bucket_admin: BucketAdmin, environ: Mapping[str, str] | None = None) -> None:
        self.bucket_admin = bucket_admin
        self.environ = dict(os.environ if environ is None else environ)

    def _environ(self, credentials: Credentials | None, region: str | None) -> dict[str, str]:
        env = dict(self.environ)
        if credentials is not None:
            for name in AWS_CREDENTIAL_VARIABLES:
                env.pop(name, None)
            env.update(credentials.environ())
        if region:
            env["AWS_REGION"] = env["AWS_DEFAULT_REGION"] = region
        return env

    def create_volume(self, name: str, parameters: Mapping[str, str], credentials: Credentials | None,
                      required_bytes: int = 0, limit_bytes: int = 0) -> CreatedVolume:
        check_volume_name(name)
        settings = parse_provision_parameters(parameters)
        if required_bytes < 0 or limit_bytes < 0 or (limit_bytes and required_bytes > limit_bytes):
            raise CsiError(Code.OUT_OF_RANGE, "capacity_range is invalid (negative, or required > limit)")
        path = f"{settings.prefix}/{name}" if settings.prefix else name
        volume = volume_ids.DynamicVolume(settings.bucket, path, settings.on_delete, settings.endpoint_url,
                                          settings.region)
        vid = volume.encode()
        if len(vid.encode()) > volume_ids.MAX_VOLUME_ID_BYTES:
            raise invalid(f"the volume id for bucket {settings.bucket!r}, prefix {settings.prefix!r} and this "
                          f"endpoint would be {len(vid.encode())} bytes, over the CSI limit of "
                          f"{volume_ids.MAX_VOLUME_ID_BYTES}: use a shorter prefix or endpoint URL")
        try:
            self.bucket_admin.check(volume.source, settings.endpoint_url, self._environ(credentials, settings.region))
        except admin.AdminError as exc:
            raise store_error(exc, f"cannot provision {volume.source}") from None
        context = {ATTR_SOURCE: volume.source, **settings.cache_attributes}
        if settings.endpoint_url:
            context[ATTR_ENDPOINT_URL] = settings.endpoint_url
        if settings.region:
            context[ATTR_REGION] = settings.region
        log.info("provisioned volume %s at %s (on delete: %s)", name, volume.source, settings.on_delete.value)
        # An S3 prefix has no size limit; report what was asked for so the claim binds as requested.
        return CreatedVolume(vid, required_bytes or limit_bytes, context)

    def delete_volume(self, volume_id: str, credentials: Credentials | None) -> None:
        if not volume_id:
            raise invalid("volume_id is required")
        volume = volume_ids.decode(volume_id)
        if volume is None:
            log.warning("DeleteVolume %s: not a volume this driver provisioned; nothing deleted", volume_id)
            return
        if volume.on_delete is DeletePolicy.RETAIN:
            log.info("DeleteVolume %s: onDelete is retain; the objects under %s are kept", volume_id, volume.source)
            return
        try:
            count = self.bucket_admin.delete_prefix(volume.source, volume.endpoint_url,
                                                    self._environ(credentials, volume.region))
        except admin.AdminNotFound:
            log.info("DeleteVolume %s: the bucket is gone; nothing to delete", volume_id)
            return
        except admin.AdminError as exc:
            raise store_error(exc, f"cannot delete the objects under {volume.source}") from None
        log.info("DeleteVolume %s: deleted %d objects under %s", volume_id, count, volume.source)

    def check_volume_exists(self, volume_id: str, volume_context: Mapping[str, str]) -> None:
        """For ValidateVolumeCapabilities: NOT_FOUND unless the id or the context names a volume."""
        if not volume_id:
            raise invalid("volume_id is required")
        if volume_context.get(ATTR_SOURCE):
            parse_volume_attributes(volume_context)
            return
        if volume_ids.decode(volume_id) is None:
            raise CsiError(Code.NOT_FOUND, f"volume {volume_id} is unknown (no 'source' in its context)")
