"""Owner, modes and fsGroup over the real gRPC socket, on real FUSE mounts of a SeaweedFS bucket.

Volume attributes (``uid``, ``gid``, ``fileMode``, ``dirMode``) and mount options (``uid=``, ...)
set what every entry shows; a pod's fsGroup arrives as ``volume_mount_group`` and becomes the group,
with group-writable modes on a writable mount. Writes run as unprivileged users in child processes,
so the kernel's permission checks (FUSE default_permissions) are what is tested (issue 12).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from csi_driver.proto import csi_pb2
from tests.csi.conftest import AccessMode, expect_rpc_error, mount_capability, secrets_of

pytestmark = [pytest.mark.fuse, pytest.mark.s3,
              pytest.mark.skipif(os.geteuid() != 0, reason="the node plugin mounts as root")]

NOBODY, OTHER, FS_GROUP = 65534, 65533, 2000
RUN_TIMEOUT_S = 60


@pytest.fixture
def bucket(seaweed) -> str:
    name = f"csi-own-{uuid.uuid4().hex[:10]}"
    seaweed.make_bucket(name)
    seaweed.put(name, "ds/seed.txt", b"seed")
    return name


@pytest.fixture
def pods(csi) -> Iterator[Path]:
    """A pods directory every uid can traverse (pytest's tmp dirs are 0700 root)."""
    path = Path(tempfile.mkdtemp(prefix="csi-owner-"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        csi.cleanup_targets()
        shutil.rmtree(path, ignore_errors=True)


def target_in(csi, pods: Path) -> Path:
    target = pods / uuid.uuid4().hex[:8] / "mount"
    target.parent.mkdir()
    target.parent.chmod(0o755)  # whatever the umask: every pod uid traverses it
    csi.targets.append(target)
    return target


def context(seaweed, bucket: str, **extra: str) -> dict[str, str]:
    return {"source": f"s3://{bucket}/ds", "endpointUrl": seaweed.endpoint_url, "diskCache": "256MiB", **extra}


def capability(*flags: str, group: str = "", mode: int = AccessMode.SINGLE_NODE_WRITER):
    cap = mount_capability(mode, flags)
    cap.mount.volume_mount_group = group
    return cap


def as_user(uid: int, gid: int, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), user=uid, group=gid, extra_groups=[], cwd="/", capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S, check=False)


def write(uid: int, gid: int, path: Path, text: str) -> subprocess.CompletedProcess[str]:
    return as_user(uid, gid, "sh", "-c", 'printf %s "$1" > "$2"', "sh", text, str(path))


def owner(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_uid, st.st_gid, st.st_mode & 0o7777


def test_node_advertises_volume_mount_group(csi) -> None:
    caps = csi.node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest(), timeout=10).capabilities
    assert [c.rpc.type for c in caps] == [csi_pb2.NodeServiceCapability.RPC.STAGE_UNSTAGE_VOLUME,
                                      csi_pb2.NodeServiceCapability.RPC.VOLUME_MOUNT_GROUP]


def test_owner_from_volume_attributes_writes_others_get_eacces(csi, seaweed, bucket, pods) -> None:
    target = target_in(csi, pods)
    csi.publish("vol-owner", target, context(seaweed, bucket, uid=str(NOBODY), gid=str(NOBODY),
                                             fileMode="0644", dirMode="0755"), secrets=secrets_of(seaweed))
    assert owner(target) == (NOBODY, NOBODY, 0o755)
    assert owner(target / "seed.txt") == (NOBODY, NOBODY, 0o644)
    assert write(NOBODY, NOBODY, target / "ckpt", "step-1").returncode == 0
    assert as_user(NOBODY, NOBODY, "mkdir", str(target / "runs")).returncode == 0
    assert as_user(NOBODY, NOBODY, "mv", str(target / "ckpt"), str(target / "runs" / "ckpt")).returncode == 0
    assert as_user(OTHER, OTHER, "cat", str(target / "runs" / "ckpt")).stdout == "step-1"
    for result in (write(OTHER, OTHER, target / "runs" / "ckpt", "x"),
                   as_user(OTHER, OTHER, "mkdir", str(target / "other"))):
        assert result.returncode != 0 and "Permission denied" in result.stderr, result.stderr


def test_fs_group_becomes_the_group_with_group_writable_modes(csi, seaweed, bucket, pods) -> None:
    target = target_in(csi, pods)
    csi.publish("vol-fsgroup", target, context(seaweed, bucket), secrets=secrets_of(seaweed),
                capability=capability(group=str(FS_GROUP)))
    assert owner(target) == (0, FS_GROUP, 0o775)
    assert owner(target / "seed.txt") == (0, FS_GROUP, 0o664)
    # A pod with runAsUser 65533 and fsGroup 2000: its processes carry the group.
    assert write(OTHER, FS_GROUP, target / "out.bin", "by-pod").returncode == 0
    assert as_user(OTHER, FS_GROUP, "mkdir", str(target / "sub")).returncode == 0
    assert (target / "out.bin").read_text() == "by-pod"
    denied = write(NOBODY, NOBODY, target / "out.bin", "x")
    assert denied.returncode != 0 and "Permission denied" in denied.stderr

    # Modes set by the volume are kept; a read-only publish keeps the read-only modes.
    kept = target_in(csi, pods)
    csi.publish("vol-fsgroup-modes", kept, context(seaweed, bucket, fileMode="0640", dirMode="0750"),
                secrets=secrets_of(seaweed), capability=capability(group=str(FS_GROUP)))
    assert owner(kept) == (0, FS_GROUP, 0o750) and owner(kept / "seed.txt") == (0, FS_GROUP, 0o640)
    ro = target_in(csi, pods)
    csi.publish("vol-fsgroup-ro", ro, context(seaweed, bucket), secrets=secrets_of(seaweed), readonly=True,
                capability=capability(group=str(FS_GROUP), mode=AccessMode.MULTI_NODE_READER_ONLY))
    assert owner(ro) == (0, FS_GROUP, 0o555) and owner(ro / "seed.txt") == (0, FS_GROUP, 0o444)


def test_owner_from_mount_options(csi, seaweed, bucket, pods) -> None:
    target = target_in(csi, pods)
    csi.publish("vol-flags", target, context(seaweed, bucket, uid=str(NOBODY)), secrets=secrets_of(seaweed),
                capability=capability(f"uid={NOBODY}", "--gid=3000", "file-mode=600", "dir-mode=0700", "rw"))
    assert owner(target) == (NOBODY, 3000, 0o700) and owner(target / "seed.txt") == (NOBODY, 3000, 0o600)
    assert as_user(OTHER, 3000, "cat", str(target / "seed.txt")).returncode != 0  # 0700 dir, 0600 file


def test_bad_owner_values_are_refused_naming_them(csi, seaweed, bucket, pods) -> None:
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    cases = [
        (context(seaweed, bucket, uid="nobody"), capability(), "'uid'"),
        (context(seaweed, bucket, gid=str(2**32 - 1)), capability(), "'gid'"),
        (context(seaweed, bucket, fileMode="0999"), capability(), "'fileMode'"),
        (context(seaweed, bucket, dirMode="17777"), capability(), "'dirMode'"),
        (context(seaweed, bucket), capability("uid=abc"), "'uid'"),
        (context(seaweed, bucket), capability("file-mode=rwx"), "'file-mode'"),
        (context(seaweed, bucket), capability("noatime"), "'noatime'"),
        (context(seaweed, bucket, uid="1000"), capability("uid=1001"), "disagree"),
        (context(seaweed, bucket), capability(group="staff"), "volume_mount_group"),
    ]
    for ctx, cap, fragment in cases:
        target = target_in(csi, pods)
        with expect_rpc_error(invalid, fragment):
            csi.publish("vol-bad-owner", target, ctx, secrets=secrets_of(seaweed), capability=cap)
        assert not target.exists() or not os.path.ismount(target)
