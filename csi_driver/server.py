"""The gRPC servicers: Identity, Node and Controller, each a translator and nothing more.

Every handler checks the request's required fields first (INVALID_ARGUMENT naming the field), then
calls one method of ``NodeOps`` or ``ControllerOps`` and packs the answer. The ``rpc`` decorator is
the single edge where errors become gRPC statuses: a ``CsiError`` keeps its code; anything else is
logged with its traceback and answered INTERNAL. It also logs every call: the request, with each
field the CSI proto marks secret masked (``redact.sanitize``), at DEBUG; the outcome and duration at
INFO. Every secret value a request carries is registered with the log redactor before anything is
logged, and error messages are scrubbed before they leave.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

# Before grpc is imported, which reads it once: no fork handlers. With gRPC's fork support on (its
# core's default in these wheels), every fork() runs its handlers in the child, and the plugin forks
# (rather than vforks) each process daemon, since the daemon starts as another user: 2-7 in 3,000
# such children died of SIGABRT or SIGSEGV before their exec while calls were in flight, and CI's
# broker test saw one (the daemon "exited as it started", log empty). The plugin forks only to exec,
# which needs none of what those handlers protect; with them off, 0 in 6,000 (tests/csi/test_spawning.py).
os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "0"

import grpc  # noqa: E402  (after the line above, on purpose)
from google.protobuf import wrappers_pb2

from cachefs import package_version
from csi_driver import DRIVER_NAME, metrics
from csi_driver.attributes import (
    POD_INFO_KEYS,
    Credentials,
    MountFlags,
    VolumeSettings,
    parse_credentials,
    parse_mount_flags,
    parse_mount_group,
    parse_volume_attributes,
)
from csi_driver.controller import ControllerOps
from csi_driver.errors import Code, CsiError, for_kubernetes, invalid
from csi_driver.node import NodeOps, PublishRequest, check_target_path, check_volume_id
from csi_driver.proto import csi_pb2, csi_pb2_grpc
from csi_driver.redact import REGISTRY, sanitize

log = logging.getLogger(__name__)

AccessMode = csi_pb2.VolumeCapability.AccessMode
# Access modes that make a publish read-only whatever its readonly flag says.
READ_ONLY_MODES = frozenset({AccessMode.SINGLE_NODE_READER_ONLY, AccessMode.MULTI_NODE_READER_ONLY})
SUPPORTED_MODES = frozenset({
    AccessMode.SINGLE_NODE_WRITER, AccessMode.SINGLE_NODE_READER_ONLY, AccessMode.MULTI_NODE_READER_ONLY,
    AccessMode.MULTI_NODE_SINGLE_WRITER, AccessMode.MULTI_NODE_MULTI_WRITER,
})
# fs_type values accepted in a mount capability ("" is the CO's "unspecified").
FS_TYPES = frozenset({"", "cachefs", "fuse.cachefs"})
# Mount flags (PersistentVolume mountOptions): ro/rw and the owner options (attributes.parse_mount_flags).
# Calls the sidecars make every few seconds (liveness probes, registration): their successes are
# logged at DEBUG so the INFO log shows volume operations.
QUIET_METHODS = frozenset({"Probe", "GetPluginInfo", "GetPluginCapabilities", "NodeGetCapabilities",
                           "NodeGetInfo", "ControllerGetCapabilities"})


# ------------------------------------------------------------------------------------------- edge
def rpc(method: Callable[..., Any]) -> Callable[..., Any]:
    """Log the call, register its secrets, and turn failures into gRPC statuses."""
    name = method.__name__

    @functools.wraps(method)
    def handler(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        secrets = getattr(request, "secrets", None)
        if secrets:
            REGISTRY.add(secrets.values())
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s request: %s", name, sanitize(request))
        start = time.monotonic()
        try:
            response = method(self, request, context)
        except CsiError as exc:
            message = REGISTRY.scrub(exc.message)
            log.warning("%s failed after %.3f s: %s: %s", name, time.monotonic() - start, exc.code.name, message)
            metrics.record(name, exc.code.name)
            context.abort(getattr(grpc.StatusCode, exc.code.name), for_kubernetes(message))
        except Exception as exc:  # noqa: BLE001 - nothing escapes a handler unreported
            log.exception("%s failed after %.3f s", name, time.monotonic() - start)
            metrics.record(name, "INTERNAL")
            context.abort(grpc.StatusCode.INTERNAL, f"{name}: unexpected {type(exc).__name__}")
        log.log(logging.DEBUG if name in QUIET_METHODS else logging.INFO, "%s ok in %.3f s", name,
                time.monotonic() - start)
        metrics.record(name, "OK")
        return response

    return handler


def _credentials(secrets: Mapping[str, str]) -> Credentials | None:
    return parse_credentials(dict(secrets))


def capability_problem(capability: Any) -> str | None:
    """Why this driver cannot serve a ``VolumeCapability``, or None if it can."""
    if not capability.HasField("access_mode") or capability.access_mode.mode == AccessMode.UNKNOWN:
        return "volume_capability.access_mode is required"
    mode = capability.access_mode.mode
    if mode not in SUPPORTED_MODES:
        return f"access mode {AccessMode.Mode.Name(mode)} is not supported"
    kind = capability.WhichOneof("access_type")
    if kind == "block":
        return "block volumes are not supported: cachefs is a filesystem (use volumeMode: Filesystem)"
    if kind != "mount":
        return "volume_capability must have access_type mount"
    if capability.mount.fs_type not in FS_TYPES:
        return f"fs_type {capability.mount.fs_type!r} is not supported (leave it empty)"
    try:
        parse_mount_flags(capability.mount.mount_flags)
        parse_mount_group(capability.mount.volume_mount_group)
    except CsiError as exc:
        return exc.message
    return None


def _check_capability(capability: Any, field: str) -> None:
    problem = capability_problem(capability)
    if problem:
        raise invalid(problem if problem.startswith(field) else f"{field}: {problem}")


def _is_read_only(capability: Any, flags: MountFlags) -> bool:
    return capability.access_mode.mode in READ_ONLY_MODES or flags.read_only


# --------------------------------------------------------------------------------------- services
@dataclass(frozen=True)
class DriverInfo:
    name: str = DRIVER_NAME
    version: str = ""
    serves_controller: bool = False
    serves_node: bool = False


class IdentityServicer(csi_pb2_grpc.IdentityServicer):
    def __init__(self, info: DriverInfo, probe: Callable[[], None] | None = None) -> None:
        self.info = info
        self.probe = probe

    @rpc
    def GetPluginInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        return csi_pb2.GetPluginInfoResponse(name=self.info.name, vendor_version=self.info.version or package_version())

    @rpc
    def GetPluginCapabilities(self, request: Any, context: grpc.ServicerContext) -> Any:
        capabilities = []
        if self.info.serves_controller:
            capabilities.append(csi_pb2.PluginCapability(service=csi_pb2.PluginCapability.Service(
                type=csi_pb2.PluginCapability.Service.CONTROLLER_SERVICE)))
        return csi_pb2.GetPluginCapabilitiesResponse(capabilities=capabilities)

    @rpc
    def Probe(self, request: Any, context: grpc.ServicerContext) -> Any:
        if self.probe is not None:
            self.probe()
        return csi_pb2.ProbeResponse(ready=wrappers_pb2.BoolValue(value=True))


def node_probe() -> None:
    """The node plugin is healthy when it can mount FUSE at all."""
    if not os.path.exists("/dev/fuse"):
        raise CsiError(Code.FAILED_PRECONDITION, "/dev/fuse is missing in the node plugin container")
    if shutil.which("fusermount3") is None and shutil.which("fusermount") is None:
        raise CsiError(Code.FAILED_PRECONDITION, "fusermount3 is not installed in the node plugin image")


class NodeServicer(csi_pb2_grpc.NodeServicer):
    def __init__(self, ops: NodeOps) -> None:
        self.ops = ops

    def _mount_request(self, request: Any, path_field: str, *, readonly: bool) -> PublishRequest:
        """A stage or publish request's fields, checked, as one ``PublishRequest`` for ``path_field``."""
        volume_id = check_volume_id(request.volume_id)
        path = check_target_path(getattr(request, path_field), path_field)
        if not request.HasField("volume_capability"):
            raise invalid("volume_capability is required")
        _check_capability(request.volume_capability, "volume_capability")
        volume: VolumeSettings = parse_volume_attributes(dict(request.volume_context))
        credentials = _credentials(request.secrets)
        flags = parse_mount_flags(request.volume_capability.mount.mount_flags)
        read_only = readonly or volume.read_only or _is_read_only(request.volume_capability, flags)
        # The pod's fsGroup, delegated to the driver (VOLUME_MOUNT_GROUP): the mount's group.
        group = parse_mount_group(request.volume_capability.mount.volume_mount_group)
        owner = volume.owner.merged(flags.owner, "mount option").with_mount_group(group, read_only=read_only)
        volume = dataclasses.replace(volume, owner=owner)
        context = {key: value for key, value in request.volume_context.items() if key in POD_INFO_KEYS}
        return PublishRequest(volume_id, path, volume, read_only, credentials, context)

    @rpc
    def NodeStageVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.ops.stage(self._mount_request(request, "staging_target_path", readonly=False))
        return csi_pb2.NodeStageVolumeResponse()

    @rpc
    def NodeUnstageVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        volume_id = check_volume_id(request.volume_id)
        self.ops.unstage(volume_id, check_target_path(request.staging_target_path, "staging_target_path"))
        return csi_pb2.NodeUnstageVolumeResponse()

    @rpc
    def NodePublishVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        publish = self._mount_request(request, "target_path", readonly=request.readonly)
        if request.staging_target_path:
            staging = check_target_path(request.staging_target_path, "staging_target_path")
            self.ops.publish_staged(publish, staging)
        else:  # a CO that does not stage: a daemon of its own at the target
            self.ops.publish(publish)
        return csi_pb2.NodePublishVolumeResponse()

    @rpc
    def NodeUnpublishVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        volume_id = check_volume_id(request.volume_id)
        target = check_target_path(request.target_path)
        self.ops.unpublish(volume_id, target)
        return csi_pb2.NodeUnpublishVolumeResponse()

    @rpc
    def NodeGetCapabilities(self, request: Any, context: grpc.ServicerContext) -> Any:
        # STAGE_UNSTAGE_VOLUME: one shared cachefs mount per volume per node, bound into each pod
        # (staging.py). VOLUME_MOUNT_GROUP: the kubelet passes a pod's fsGroup to the driver (with
        # the CSIDriver's fsGroupPolicy: File) instead of chowning every file of the bucket itself.
        rpc_type = csi_pb2.NodeServiceCapability.RPC
        return csi_pb2.NodeGetCapabilitiesResponse(capabilities=[
            csi_pb2.NodeServiceCapability(rpc=rpc_type(type=rpc_type.STAGE_UNSTAGE_VOLUME)),
            csi_pb2.NodeServiceCapability(rpc=rpc_type(type=rpc_type.VOLUME_MOUNT_GROUP)),
        ])

    @rpc
    def NodeGetInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        return csi_pb2.NodeGetInfoResponse(node_id=self.ops.settings.node_id,
                                           max_volumes_per_node=self.ops.settings.max_volumes_per_node)


class ControllerServicer(csi_pb2_grpc.ControllerServicer):
    def __init__(self, ops: ControllerOps) -> None:
        self.ops = ops

    @rpc
    def CreateVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        if not request.name:
            raise invalid("name is required")
        if not request.volume_capabilities:
            raise invalid("volume_capabilities is required")
        for i, capability in enumerate(request.volume_capabilities):
            _check_capability(capability, f"volume_capabilities[{i}]")
        if request.HasField("volume_content_source"):
            raise invalid("volume_content_source is not supported (no snapshots or clones)")
        created = self.ops.create_volume(
            request.name, dict(request.parameters), _credentials(request.secrets),
            request.capacity_range.required_bytes, request.capacity_range.limit_bytes,
        )
        return csi_pb2.CreateVolumeResponse(volume=csi_pb2.Volume(
            volume_id=created.volume_id, capacity_bytes=created.capacity_bytes,
            volume_context=created.volume_context,
        ))

    @rpc
    def DeleteVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        if not request.volume_id:
            raise invalid("volume_id is required")
        self.ops.delete_volume(request.volume_id, _credentials(request.secrets))
        return csi_pb2.DeleteVolumeResponse()

    @rpc
    def ValidateVolumeCapabilities(self, request: Any, context: grpc.ServicerContext) -> Any:
        if not request.volume_id:
            raise invalid("volume_id is required")
        if not request.volume_capabilities:
            raise invalid("volume_capabilities is required")
        self.ops.check_volume_exists(request.volume_id, dict(request.volume_context))
        for capability in request.volume_capabilities:
            problem = capability_problem(capability)
            if problem:
                return csi_pb2.ValidateVolumeCapabilitiesResponse(message=problem)
        return csi_pb2.ValidateVolumeCapabilitiesResponse(confirmed=csi_pb2.ValidateVolumeCapabilitiesResponse.Confirmed(
            volume_context=dict(request.volume_context),
            volume_capabilities=list(request.volume_capabilities),
            parameters=dict(request.parameters),
        ))

    @rpc
    def ControllerGetCapabilities(self, request: Any, context: grpc.ServicerContext) -> Any:
        rpc_type = csi_pb2.ControllerServiceCapability.RPC
        return csi_pb2.ControllerGetCapabilitiesResponse(capabilities=[
            csi_pb2.ControllerServiceCapability(rpc=rpc_type(type=rpc_type.CREATE_DELETE_VOLUME)),
        ])


def build_server(*, info: DriverInfo, node: NodeOps | None, controller: ControllerOps | None,
                 max_workers: int) -> grpc.Server:
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="csi"))
    csi_pb2_grpc.add_IdentityServicer_to_server(
        IdentityServicer(info, probe=node_probe if node is not None else None), server)
    if node is not None:
        csi_pb2_grpc.add_NodeServicer_to_server(NodeServicer(node), server)
    if controller is not None:
        csi_pb2_grpc.add_ControllerServicer_to_server(ControllerServicer(controller), server)
    return server
