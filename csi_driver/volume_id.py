"""Volume ids of dynamically provisioned volumes: everything DeleteVolume needs, in the id itself.

DeleteVolume receives only the volume id and the provisioner's secrets, not the StorageClass, so a
stateless controller must be able to find the objects and the deletion policy from the id alone.
The id is::

    v1:<onDelete>:<region>:<endpoint, percent-encoded>:<bucket>/<prefix>/<name>

for example ``v1:delete:::datasets/scratch/pvc-5b0e...`` (AWS, default region) or
``v1:retain::http%3A%2F%2Fs3.local%3A8333:train/pvc-5b0e...``. Fields before the bucket never contain
``:`` (the endpoint is percent-encoded), so the id splits unambiguously; the version tag lets a
later format coexist with volumes created by this one.

The CSI spec caps string fields at 128 bytes, names included. A name whose id would exceed that
(csi-sanity asks for a 128-character name) gets a shortened, deterministic last prefix component
(``prefix_name``: its first characters and a hash of the whole name), so a repeated CreateVolume
finds the same prefix; Kubernetes names (``pvc-<uid>``, 40 characters) are never shortened.
CreateVolume refuses (INVALID_ARGUMENT) a StorageClass whose ids would exceed the limit even then,
naming what to shorten, rather than returning an id the CO may reject.

**Capacity records.** The spec wants CreateVolume with an existing name and an incompatible capacity
answered ALREADY_EXISTS, which a controller can only decide by remembering the first capacity. The
record lives in the bucket, beside the volumes and never inside one:
``<prefix>/.cachefs-volumes/<name>.json`` (``record_source``), holding ``{"capacity_bytes": N}``;
DeleteVolume removes it whatever the ``onDelete`` policy (the volume is gone, its objects may stay).

Static volumes (a PersistentVolume written by hand, an inline ephemeral volume) have ids of their
operator's or the kubelet's choosing; their ``source`` is in the volume attributes and this module
is not involved. ``decode`` returns None for any id it did not make, and DeleteVolume then leaves
the store alone.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from urllib.parse import quote, unquote

from csi_driver.attributes import DeletePolicy

VERSION = "v1"
MAX_VOLUME_ID_BYTES = 128  # CSI spec, "Size Limits": string fields SHALL NOT exceed 128 bytes
# A shortened name: this many leading characters (readable in a listing) and 16 hex digits of the
# name's SHA-256 (64 bits: no two names of one StorageClass collide in practice).
SHORT_NAME_KEEP = 31
RECORD_DIR = ".cachefs-volumes"


def prefix_name(name: str, shortened: bool) -> str:
    """The last component of a volume's prefix: the name itself, or its deterministic short form."""
    if not shortened:
        return name
    return f"{name[:SHORT_NAME_KEEP]}-{hashlib.sha256(name.encode()).hexdigest()[:16]}"


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

    @property
    def record_source(self) -> str:
        """``s3://bucket/<prefix>/.cachefs-volumes/<name>.json``: the volume's capacity record."""
        parent, _, name = self.path.rpartition("/")
        return f"s3://{self.bucket}/{parent + '/' if parent else ''}{RECORD_DIR}/{name}.json"

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
