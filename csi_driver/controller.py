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
import json
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

    def read_record(self, url: str, endpoint_url: str | None, environ: Mapping[str, str]) -> bytes | None:
        """The small object at ``url`` (``s3://bucket/key``), or None if there is none."""

    def write_record(self, url: str, data: bytes, endpoint_url: str | None, environ: Mapping[str, str]) -> None:
        """Store ``data`` at ``url``."""

    def delete_record(self, url: str, endpoint_url: str | None, environ: Mapping[str, str]) -> None:
        """Delete the object at ``url``; absent is success."""


class CachefsBucketAdmin:
    """``BucketAdmin`` over ``cachefs.admin`` (the object stores cachefs itself uses)."""

    def check(self, source: str, endpoint_url: str | None, environ: Mapping[str, str]) -> None:
        asyncio.run(admin.check_source_access(source, endpoint_url=endpoint_url, environ=environ))

    def delete_prefix(self, source: str, endpoint_url: str | None, environ: Mapping[str, str]) -> int:
        return asyncio.run(admin.delete_prefix(source, endpoint_url=endpoint_url, environ=environ))

    def read_record(self, url: str, endpoint_url: str | None, environ: Mapping[str, str]) -> bytes | None:
        return asyncio.run(admin.read_small_object(url, endpoint_url=endpoint_url, environ=environ))

    def write_record(self, url: str, data: bytes, endpoint_url: str | None, environ: Mapping[str, str]) -> None:
        asyncio.run(admin.write_small_object(url, data, endpoint_url=endpoint_url, environ=environ))

    def delete_record(self, url: str, endpoint_url: str | None, environ: Mapping[str, str]) -> None:
        asyncio.run(admin.delete_small_object(url, endpoint_url=endpoint_url, environ=environ))


@dataclass
class InMemoryBucketAdmin:
    """A ``BucketAdmin`` over a dict of bucket -> set of keys, for unit tests.

    Capacity records are kept apart, in ``records`` (url -> bytes), so ``buckets`` and ``calls``
    show what happened to the volumes' data alone.
    """

    buckets: dict[str, set[str]] = field(default_factory=dict)
    denied: bool = False
    calls: list[tuple[str, str]] = field(default_factory=list)
    records: dict[str, bytes] = field(default_factory=dict)

    def read_record(self, url: str, endpoint_url: str | None, environ: Mapping[str, str]) -> bytes | None:
        return self.records.get(url)

    def write_record(self, url: str, data: bytes, endpoint_url: str | None, environ: Mapping[str, str]) -> None:
        self.records[url] = data

    def delete_record(self, url: str, endpoint_url: str | None, environ: Mapping[str, str]) -> None:
        self.records.pop(url, None)

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
        volume = None
        for shortened in (False, True):
            leaf = volume_ids.prefix_name(name, shortened)
            path = f"{settings.prefix}/{leaf}" if settings.prefix else leaf
            volume = volume_ids.DynamicVolume(settings.bucket, path, settings.on_delete, settings.endpoint_url,
                                              settings.region)
            vid = volume.encode()
            if len(vid.encode()) <= volume_ids.MAX_VOLUME_ID_BYTES:
                break
        else:
            raise invalid(f"the volume id for bucket {settings.bucket!r}, prefix {settings.prefix!r} and this "
                          f"endpoint would be {len(vid.encode())} bytes, over the CSI limit of "
                          f"{volume_ids.MAX_VOLUME_ID_BYTES}: use a shorter prefix or endpoint URL")
        environ = self._environ(credentials, settings.region)
        try:
            self.bucket_admin.check(volume.source, settings.endpoint_url, environ)
            capacity = self._claim_capacity(volume, name, required_bytes, limit_bytes, environ)
        except admin.AdminError as exc:
            raise store_error(exc, f"cannot provision {volume.source}") from None
        context = {ATTR_SOURCE: volume.source, **settings.cache_attributes}
        if settings.endpoint_url:
            context[ATTR_ENDPOINT_URL] = settings.endpoint_url
        if settings.region:
            context[ATTR_REGION] = settings.region
        log.info("provisioned volume %s at %s (on delete: %s)", name, volume.source, settings.on_delete.value)
        return CreatedVolume(vid, capacity, context)

    def _claim_capacity(self, volume: volume_ids.DynamicVolume, name: str, required_bytes: int, limit_bytes: int,
                        environ: Mapping[str, str]) -> int:
        """The volume's capacity: the recorded one if the name exists (ALREADY_EXISTS if it does not
        satisfy this request's range), else what was asked for, recorded.

        An S3 prefix has no size limit; the capacity is what the claim asked for, so it binds as
        requested, and it is remembered only to answer a repeated CreateVolume as the spec says.
        """
        raw = self.bucket_admin.read_record(volume.record_source, volume.endpoint_url, environ)
        if raw is not None:
            try:
                recorded = int(json.loads(raw)["capacity_bytes"])
            except (ValueError, KeyError, TypeError):
                log.warning("volume %s: its capacity record %s is unreadable; writing it again", name,
                            volume.record_source)
            else:
                if recorded < required_bytes or (limit_bytes and recorded > limit_bytes):
                    raise CsiError(Code.ALREADY_EXISTS,
                                   f"volume {name} already exists with capacity {recorded} bytes, outside the "
                                   f"requested range ({required_bytes}, {limit_bytes or 'no limit'})")
                return recorded
        capacity = required_bytes or limit_bytes
        record = json.dumps({"name": name, "capacity_bytes": capacity}, sort_keys=True).encode()
        self.bucket_admin.write_record(volume.record_source, record, volume.endpoint_url, environ)
        return capacity

    def delete_volume(self, volume_id: str, credentials: Credentials | None) -> None:
        if not volume_id:
            raise invalid("volume_id is required")
        volume = volume_ids.decode(volume_id)
        if volume is None:
            log.warning("DeleteVolume %s: not a volume this driver provisioned; nothing deleted", volume_id)
            return
        environ = self._environ(credentials, volume.region)
        if volume.on_delete is DeletePolicy.RETAIN:
            log.info("DeleteVolume %s: onDelete is retain; the objects under %s are kept", volume_id, volume.source)
        else:
            try:
                count = self.bucket_admin.delete_prefix(volume.source, volume.endpoint_url, environ)
            except admin.AdminNotFound:
                log.info("DeleteVolume %s: the bucket is gone; nothing to delete", volume_id)
                return
            except admin.AdminError as exc:
                raise store_error(exc, f"cannot delete the objects under {volume.source}") from None
            log.info("DeleteVolume %s: deleted %d objects under %s", volume_id, count, volume.source)
        try:  # last: a DeleteVolume that failed above is retried and still finds its record
            self.bucket_admin.delete_record(volume.record_source, volume.endpoint_url, environ)
        except admin.AdminNotFound:
            pass
        except admin.AdminError as exc:
            raise store_error(exc, f"cannot delete the capacity record {volume.record_source}") from None

    def check_volume_exists(self, volume_id: str, volume_context: Mapping[str, str]) -> None:
        """For ValidateVolumeCapabilities: NOT_FOUND unless the id or the context names a volume."""
        if not volume_id:
            raise invalid("volume_id is required")
        if volume_context.get(ATTR_SOURCE):
            parse_volume_attributes(volume_context)
            return
        if volume_ids.decode(volume_id) is None:
            raise CsiError(Code.NOT_FOUND, f"volume {volume_id} is unknown (no 'source' in its context)")
