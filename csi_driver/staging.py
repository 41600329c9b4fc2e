"""Staged volumes: one shared cachefs mount per volume per node, bind-mounted into each pod.

**Stage** (NodeStageVolume) makes one cachefs mount of the volume at the kubelet's staging path, so
every pod of that volume on the node is served by one daemon with one RAM tier and one disk tier:
bytes one pod has read cost the next pod no GET. **Publish** with a staging path bind-mounts the
staged mount at the pod's target (``mount --bind``, then ``remount,ro,bind`` where the pod asks for
read-only). **Unpublish** of such a target removes the bind only; **unstage** refuses with
FAILED_PRECONDITION while a target still uses the staged mount, then flushes and unmounts it.

**Credentials.** A Secret named by ``nodeStageSecretRef`` reaches NodeStageVolume, which mounts at
once. A volume that names only ``nodePublishSecretRef`` (or none: the node's identity) is recorded at
stage and mounted by its first publish, with that request's credentials. Credentials are never
written to a record.

**Pods that differ.** What the daemon serves is shared, so it is fixed at stage: the staged mount is
writable unless the volume is read-only (a read-only access mode, the ``readOnly`` attribute, or an
``ro`` mount flag), and its owner and modes (including a pod's fsGroup) are those of the stage. A
read-only pod of a writable volume gets a read-only bind (the kernel refuses its writes with EROFS);
a writable publish of a read-only stage, or a publish whose owner options differ from the stage's,
is refused with FAILED_PRECONDITION naming the difference.

**Records.** One JSON file per staged volume under the node's state directory (``StageRecords``),
written atomically (temporary file, then rename): the staging path, the stage's read-only mode and
owner, the targets bound to it and the pods using them. The mount table is the truth for what is mounted; the records say
what it was mounted for. Because the daemons run in their own sessions (``cachefs mount`` detaches
them) and the records live on the host, a node plugin that is killed and started again finds its
staged volumes as it left them and carries on: nothing is held in memory between calls.

**A dead daemon.** Its staged mount and every bind of it answer ENOTCONN. The next stage or publish
of the volume on the node detaches the dead staged mount, mounts it again, binds its own target, and
then binds afresh every other target of the record still on the dead mount (``NodeOps._restore_binds``:
running pods read on, where their volume mount propagates from the host). The node plugin's metrics
count each broken mount and bind in ``cachefs_csi_mounts{state="broken"}`` until then, and a target
that could not be restored until its pod's unpublish.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from csi_driver.attributes import OwnerOptions

log = logging.getLogger(__name__)

RECORD_SUFFIX = ".json"


@dataclass
class StageRecord:
    volume_id: str
    staging_path: str
    read_only: bool
    owner: OwnerOptions
    source: str
    targets: dict[str, bool] = field(default_factory=dict)  # bound target -> read-only
    # bound target -> the pod using it (namespace, name, uid), where the publish named it
    # (podInfoOnMount): where a broken mount is reported as a Kubernetes Event.
    pods: dict[str, dict[str, str]] = field(default_factory=dict)

    def to_json(self) -> str:
        data = asdict(self)
        return json.dumps(data, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> StageRecord:
        data = json.loads(text)
        return cls(volume_id=str(data["volume_id"]), staging_path=str(data["staging_path"]),
                   read_only=bool(data["read_only"]), owner=OwnerOptions(**data.get("owner") or {}),
                   source=str(data.get("source", "")),
                   targets={str(k): bool(v) for k, v in (data.get("targets") or {}).items()},
                   pods={str(k): {str(a): str(b) for a, b in v.items()}
                         for k, v in (data.get("pods") or {}).items() if isinstance(v, dict)})


class StageRecords:
    """One record per staged volume, ``<state_dir>/<name><RECORD_SUFFIX>``, replaced atomically."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir

    def _path(self, name: str) -> Path:
        return self.state_dir / f"{name}{RECORD_SUFFIX}"

    def load(self, name: str) -> StageRecord | None:
        try:
            return StageRecord.from_json(self._path(name).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("stage record %s is unreadable (%s); treating the volume as not staged", self._path(name), exc)
            return None

    def save(self, name: str, record: StageRecord) -> None:
        self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self._path(name)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as out:
            out.write(record.to_json())
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)

    def remove(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    def all(self) -> list[StageRecord]:
        try:
            paths = sorted(self.state_dir.glob(f"*{RECORD_SUFFIX}"))
        except OSError:
            return []
        found = []
        for path in paths:
            record = self.load(path.name[: -len(RECORD_SUFFIX)])
            if record is not None:
                found.append(record)
        return found
