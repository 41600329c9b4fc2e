"""Volume ids of dynamically provisioned volumes: everything DeleteVolume needs, in the id itself.

DeleteVolume receives only the volume id and the provisioner's secrets, not the StorageClass, so a
stateless controller must be able to find the objects and the deletion policy from the id alone.
The id is::

    v1:<onDelete>:<region>:<endpoint, percent-encoded>:<bucket>/<prefix>/<name>

for example ``v1:delete:::datasets/scratch/pvc-5b0e...`` (AWS, default region) or
``v1:retain::http%3A%2F%2Fs3.local%3A8333:train/pvc-5b0e...``. Fields before the bucket never contain
``:`` (the endpoint is percent-encoded), so the id splits unambiguously; the version tag lets a
later format coexist with volumes created by this one.

The CSI spec caps string fields at 128 bytes; CreateVolume refuses (INVALID_ARGUMENT) a StorageClass
whose ids would exceed that, naming what to shorten, rather than returning an id the CO may reject.

Static volumes (a PersistentVolume written by hand, an inline ephemeral volume) have ids of their
operator's or the kubelet's choosing; their ``source`` is in the volume attributes and this module
is not involved. ``decode`` returns None for any id it did not make, and DeleteVolume then leaves
the store alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote, unquote

from csi_driver.attributes import DeletePolicy

VERSION = "v1"
MAX_VOLUME_ID_BYTES = 128  # CSI spec, "Size Limits": string fields SHALL NOT exceed 128 bytes


@dataclass(frozen=True)
class DynamicVolume:
    bucket: str
    path: str  # the volume's prefix inside the bucket, without leading or trailing "/"
    on_delete: DeletePolicy
    endpoint_url: str | None = None
    region: str | None = None

    @property
    def source(self) -> str:
        """The ``cachefs mount`` source URL of the volume."""
        return f"s3://{self.bucket}/{self.path}/"

    def encode(self) -> str:
        endpoint = quote(self.endpoint_url or "", safe="")
        return f"{VERSION}:{self.on_delete.value}:{self.region or ''}:{endpoint}:{self.bucket}/{self.path}"


def decode(volume_id: str) -> DynamicVolume | None:
    """The volume an id names, or None if the id was not made by ``DynamicVolume.encode``."""
    parts = volume_id.split(":", 4)
    if len(parts) != 5 or parts[0] != VERSION:
        return None
    _, policy, region, endpoint, location = parts
    bucket, sep, path = location.partition("/")
    if not sep or not bucket or not path or path.startswith("/") or path.endswith("/"):
        return None
    try:
        on_delete = DeletePolicy(policy)
    except ValueError:
        return None
    return DynamicVolume(bucket, path, on_delete, unquote(endpoint) or None, region or None)
