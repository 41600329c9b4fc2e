"""Issue 36, item 5: what the driver answers the kubelet reads as written in the pod's Events.

The kubelet stand-in's rule (``tests/support/kubelet.py``, ``event_message``): a failed call's gRPC
message goes through Go's fmt twice, as a format string, on its way to a ``FailedMount`` Event. The
rule is first held to what the real cluster showed, then every error a dynamic volume's id (which
carries ``%3A%2F%2F``) can reach is rendered through it against the real ``cachefs-csi`` process.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc
import pytest

from csi_driver import attributes as attrs
from csi_driver.errors import CsiError, for_kubernetes
from tests.csi.conftest import expect_rpc_error
from tests.csi.test_driver_units import node, publish_request  # noqa: F401 - fixture
from tests.support.kubelet import event_message, go_sprintf

# A dynamic volume's id as the controller makes it (csi_driver/volume_id.py): the endpoint is encoded.
DYNAMIC_ID = "v1:retain::http%3A%2F%2F10.0.0.7%3A8333:data:pvc-3f1c"
PREFIX = "MountVolume.SetUp failed for volume \"pvc-3f1c\""


def reads_as_written(details: str) -> bool:
    return event_message(PREFIX, details) == f"{PREFIX}: rpc error: desc = {details}"


def test_the_rule_reproduces_what_the_cluster_showed() -> None:
    assert go_sprintf("50%% of %d, %-5.2f and %") == "50% of %!d(MISSING), %!f(MISSING) and %!(NOVERB)"
    assert go_sprintf("%*d") == "%!(BADWIDTH)%!d(MISSING)"
    # The Event seen on the real cluster, from the old message naming the volume id as it is.
    shown = event_message(PREFIX, "volume v1:retain::http%3A%2F%2F")
    assert shown.endswith("desc = volume v1:retain::http%!!(MISSING)A(MISSING)%!!(MISSING)F(MISSING)"
                          "%!!(MISSING)F(MISSING)")
    assert not reads_as_written("volume " + DYNAMIC_ID)


def test_every_node_error_for_a_dynamic_volume_reads_as_written(csi, tmp_path: Path) -> None:
    context = {"source": "s3://data/pvc-3f1c", "endpointUrl": "http://10.0.0.7:8333"}
    staging, target = csi.target("globalmount"), csi.target()
    calls = [
        lambda: csi.publish_staged(DYNAMIC_ID, staging, target, context),  # not staged
        lambda: csi.unstage(DYNAMIC_ID, Path("relative")),  # a bad path, named with the id
        lambda: csi.publish(DYNAMIC_ID, target, {**context, "ramCache": "lots"}),  # a bad attribute
        lambda: csi.publish(DYNAMIC_ID + "%", target, context),  # no Secret (and a % that decodes to nothing)
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as info:
            call()
        details = info.value.details() or ""
        assert "%" not in details and reads_as_written(details), details
    with expect_rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "volume v1:retain::http://10.0.0.7:8333:data:pvc-3f1c"):
        calls[0]()


def test_an_owner_mismatch_names_the_owner_as_written_modes_in_octal(node, tmp_path: Path) -> None:  # noqa: F811
    ops, _ = node
    stage = publish_request(tmp_path, volume=DYNAMIC_ID, target="globalmount", gid="2000", fileMode="0664")
    ops.stage(stage)
    other = dataclasses.replace(publish_request(tmp_path, volume=DYNAMIC_ID, target="pod/m"),
                                context={attrs.K8S_POD_NAME: "p", attrs.K8S_POD_NAMESPACE: "ml"})
    with pytest.raises(CsiError) as info:
        ops.publish_staged(other, stage.target_path)
    message = for_kubernetes(info.value.message)
    assert "OwnerOptions(" not in message and "file_mode" not in message
    assert "staged with owner gid 2000, file mode 0664, this publish asks for the defaults" in message
    assert reads_as_written(message)
