"""The CSI protocol stubs: committed, identical to a fresh generation, and numbered as the spec says."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from csi_driver.proto import csi_pb2, csi_pb2_grpc

PROTO_DIR = Path(__file__).resolve().parents[2] / "csi_driver" / "proto"
GENERATED = ("csi_pb2.py", "csi_pb2.pyi", "csi_pb2_grpc.py")


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")  # a test extra, pinned in pyproject.toml
    result = subprocess.run(["bash", str(PROTO_DIR / "generate.sh"), str(tmp_path)], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 0, result.stderr
    for name in GENERATED:
        assert (tmp_path / name).read_bytes() == (PROTO_DIR / name).read_bytes(), \
            f"{name} is stale: run csi_driver/proto/generate.sh and commit the result"


# (message, field, number) from the CSI v1 specification's csi.proto: a typo here would make the
# driver silently drop what a real CO sends.
SPEC_FIELDS = [
    ("GetPluginInfoResponse", "name", 1), ("GetPluginInfoResponse", "vendor_version", 2),
    ("GetPluginCapabilitiesResponse", "capabilities", 1), ("ProbeResponse", "ready", 1),
    ("CreateVolumeRequest", "name", 1), ("CreateVolumeRequest", "capacity_range", 2),
    ("CreateVolumeRequest", "volume_capabilities", 3), ("CreateVolumeRequest", "parameters", 4),
    ("CreateVolumeRequest", "secrets", 5), ("CreateVolumeRequest", "volume_content_source", 6),
    ("CreateVolumeRequest", "accessibility_requirements", 7), ("CreateVolumeResponse", "volume", 1),
    ("Volume", "capacity_bytes", 1), ("Volume", "volume_id", 2), ("Volume", "volume_context", 3),
    ("Volume", "content_source", 4), ("Volume", "accessible_topology", 5),
    ("NodeStageVolumeRequest", "volume_id", 1), ("NodeStageVolumeRequest", "publish_context", 2),
    ("NodeStageVolumeRequest", "staging_target_path", 3), ("NodeStageVolumeRequest", "volume_capability", 4),
    ("NodeStageVolumeRequest", "secrets", 5), ("NodeStageVolumeRequest", "volume_context", 6),
    ("NodeUnstageVolumeRequest", "volume_id", 1), ("NodeUnstageVolumeRequest", "staging_target_path", 2),
    ("DeleteVolumeRequest", "volume_id", 1), ("DeleteVolumeRequest", "secrets", 2),
    ("ValidateVolumeCapabilitiesRequest", "volume_id", 1), ("ValidateVolumeCapabilitiesRequest", "volume_context", 2),
    ("ValidateVolumeCapabilitiesRequest", "volume_capabilities", 3),
    ("ValidateVolumeCapabilitiesRequest", "parameters", 4), ("ValidateVolumeCapabilitiesRequest", "secrets", 5),
    ("ValidateVolumeCapabilitiesResponse", "confirmed", 1), ("ValidateVolumeCapabilitiesResponse", "message", 2),
    ("NodePublishVolumeRequest", "volume_id", 1), ("NodePublishVolumeRequest", "publish_context", 2),
    ("NodePublishVolumeRequest", "staging_target_path", 3), ("NodePublishVolumeRequest", "target_path", 4),
    ("NodePublishVolumeRequest", "volume_capability", 5), ("NodePublishVolumeRequest", "readonly", 6),
    ("NodePublishVolumeRequest", "secrets", 7), ("NodePublishVolumeRequest", "volume_context", 8),
    ("NodeUnpublishVolumeRequest", "volume_id", 1), ("NodeUnpublishVolumeRequest", "target_path", 2),
    ("NodeGetInfoResponse", "node_id", 1), ("NodeGetInfoResponse", "max_volumes_per_node", 2),
    ("NodeGetInfoResponse", "accessible_topology", 3),
    ("VolumeCapability", "block", 1), ("VolumeCapability", "mount", 2), ("VolumeCapability", "access_mode", 3),
    ("CapacityRange", "required_bytes", 1), ("CapacityRange", "limit_bytes", 2),
]


@pytest.mark.parametrize("message, field, number", SPEC_FIELDS)
def test_field_numbers_follow_the_spec(message: str, field: str, number: int) -> None:
    assert csi_pb2.DESCRIPTOR.message_types_by_name[message].fields_by_name[field].number == number


def test_enums_services_and_secret_marks_follow_the_spec() -> None:
    mode = csi_pb2.VolumeCapability.AccessMode
    assert (mode.SINGLE_NODE_WRITER, mode.MULTI_NODE_READER_ONLY, mode.MULTI_NODE_MULTI_WRITER,
            mode.SINGLE_NODE_MULTI_WRITER) == (1, 3, 5, 7)
    assert csi_pb2.ControllerServiceCapability.RPC.CREATE_DELETE_VOLUME == 1
    assert csi_pb2.NodeServiceCapability.RPC.STAGE_UNSTAGE_VOLUME == 1
    assert csi_pb2.PluginCapability.Service.CONTROLLER_SERVICE == 1
    assert csi_pb2.DESCRIPTOR.package == "csi.v1"
    services = {s.name: [m.name for m in s.methods] for s in csi_pb2.DESCRIPTOR.services_by_name.values()}
    assert services == {
        "Identity": ["GetPluginInfo", "GetPluginCapabilities", "Probe"],
        "Controller": ["CreateVolume", "DeleteVolume", "ValidateVolumeCapabilities", "ControllerGetCapabilities"],
        "Node": ["NodeStageVolume", "NodeUnstageVolume", "NodePublishVolume", "NodeUnpublishVolume",
                 "NodeGetCapabilities", "NodeGetInfo"],
    }
    assert csi_pb2.csi_secret.number == 1059
    secret_fields = sorted(f"{m.name}.{f.name}" for m in csi_pb2.DESCRIPTOR.message_types_by_name.values()
                           for f in m.fields if f.GetOptions().Extensions[csi_pb2.csi_secret])
    assert secret_fields == ["CreateVolumeRequest.secrets", "DeleteVolumeRequest.secrets",
                             "NodePublishVolumeRequest.secrets", "NodeStageVolumeRequest.secrets",
                             "ValidateVolumeCapabilitiesRequest.secrets"]
    assert hasattr(csi_pb2_grpc, "add_NodeServicer_to_server")
    assert shutil.which("bash")
