"""``cachefs-flex``: a FlexVolume driver for clusters that still use them, over the same node code.

The kubelet runs the driver executable (installed as
``/usr/libexec/kubernetes/kubelet-plugins/volume/exec/cachefs.io~cachefs/cachefs``) once per
operation and reads one JSON object from its output:

    cachefs-flex init                      {"status": "Success", "capabilities": {"attach": false}}
    cachefs-flex mount <dir> <json>        {"status": "Success"} or {"status": "Failure", "message": ...}
    cachefs-flex unmount <dir>             the same
    cachefs-flex <anything else>           {"status": "Not supported", ...}

``<json>`` holds the volume's ``options`` (the same keys as CSI volume attributes: ``source``,
``endpointUrl``, ``ramCache``, ...) and the kubelet's own keys: ``kubernetes.io/readwrite``
(``ro``/``rw``), ``kubernetes.io/pvOrVolumeName``, pod information, and, when the volume names a
``secretRef``, each Secret key as ``kubernetes.io/secret/<key>`` with a base64 value.

Mounting goes through ``NodeOps`` with a ``CachefsMounter``, exactly as NodePublishVolume does: the
same validation, per-volume cache directories, broken-mount repair and credential handling (the
Secret's keys reach the daemon only through its environment).

The kubelet reads stdout and stderr together, so this program writes nothing but the JSON reply to
either; its log goes to ``$CACHEFS_FLEX_LOG`` (default ``/var/log/cachefs-flex.log``), through the
redacting formatter. The cache root is ``$CACHEFS_FLEX_CACHE_ROOT`` (default
``/var/cache/cachefs-flex``); neither can be set from a volume's options, which any pod author
writes. Nor can what a volume may ask of the node (``csi_driver.trust``): the kubelet's environment
for this program sets it, ``CACHEFS_FLEX_ALLOWED_ENDPOINTS`` and ``CACHEFS_FLEX_ALLOWED_BUCKETS``
(comma-separated) and ``CACHEFS_FLEX_ALLOW_LOCAL_ENDPOINTS=true``, as the node plugin's flags of the
same names do.

**The node's identity** (``CACHEFS_FLEX_ALLOW_NODE_IDENTITY``) cannot be kept to volumes an admin
wrote, as the CSI driver keeps it from inline volumes: a FlexVolume driver is handed the same
options for a PersistentVolume and for a volume written into a pod spec (``pvOrVolumeName`` is the
PV's name or the pod's volume's name alike, and nothing else in them is out of a pod author's
reach). So lending it is lending it to every pod author who may use a flexVolume on the node, and
the variable says so: only ``every-pod-author`` lends it; ``true`` (what it took before issue 34)
is refused at every mount with a message saying why, so an install that had it fails loudly instead
of lending on. Keep it off where pod authors are not trusted (and forbid ``flexVolume`` in their pods
with the Pod Security ``restricted`` profile, or give every volume a Secret).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import json
import logging
import logging.handlers
import os
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from csi_driver.attributes import (
    FLEX_FS_GROUP,
    FLEX_FS_TYPE,
    FLEX_KEY_PREFIX,
    FLEX_READWRITE,
    FLEX_SECRET_PREFIX,
    FLEX_VOLUME_NAME,
    parse_credentials,
    parse_mount_group,
    parse_volume_attributes,
)
from csi_driver.errors import CsiError, invalid
from csi_driver.mounter import CachefsMounter, Mounter
from csi_driver.node import NodeOps, NodeSettings, PublishRequest, check_target_path
from csi_driver.trust import VolumeTrust
from csi_driver.redact import REGISTRY, RedactingFormatter

log = logging.getLogger("csi_driver.flex")

DEFAULT_CACHE_ROOT = "/var/cache/cachefs-flex"
DEFAULT_LOG = "/var/log/cachefs-flex.log"
LOG_MAX_BYTES = 10 * 1024 * 1024
FLEX_POD_NAMESPACE = "kubernetes.io/pod.namespace"
FS_TYPES = ("", "cachefs", "fuse.cachefs")

SUCCESS = "Success"
FAILURE = "Failure"
NOT_SUPPORTED = "Not supported"


def reply(status: str, message: str = "", **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"status": status}
    if message:
        out["message"] = REGISTRY.scrub(message)
    out.update(extra)
    return out


def parse_options(text: str) -> dict[str, str]:
    try:
        options = json.loads(text)
    except ValueError:
        raise invalid("the mount options are not valid JSON") from None
    if not isinstance(options, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in options.items()):
        raise invalid("the mount options must be a JSON object of strings")
    return options


def split_options(options: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """(volume attributes, decoded secrets, kubelet keys) of a FlexVolume options object."""
    attributes, secrets, kubelet = {}, {}, {}
    for key, value in options.items():
        if key.startswith(FLEX_SECRET_PREFIX):
            name = key[len(FLEX_SECRET_PREFIX):]
            try:
                secrets[name] = base64.b64decode(value, validate=True).decode()
            except (binascii.Error, UnicodeDecodeError):
                raise invalid(f"option {key!r} is not base64-encoded text") from None
        elif key.startswith(FLEX_KEY_PREFIX):
            kubelet[key] = value
        else:
            attributes[key] = value
    REGISTRY.add(secrets.values())
    return attributes, secrets, kubelet


def flex_volume_id(kubelet: Mapping[str, str], source: str, endpoint: str | None) -> str:
    """A stable id for the cache directory: namespace, volume name and what it mounts.

    An inline FlexVolume's name ("data") repeats across pods, so the source and endpoint are part of
    the id: two volumes that mount different data never share a cache directory.
    """
    name = kubelet.get(FLEX_VOLUME_NAME) or "volume"
    namespace = kubelet.get(FLEX_POD_NAMESPACE, "")
    digest = hashlib.sha256(f"{source}\n{endpoint or ''}".encode()).hexdigest()[:12]
    return f"flex:{namespace}/{name}:{digest}"


class FlexDriver:
    def __init__(self, ops: NodeOps) -> None:
        self.ops = ops

    def init(self) -> dict[str, Any]:
        # fsGroup: false - the kubelet must not chown/chmod the bucket for a pod's fsGroup (a walk of
        # every object, refused by cachefs); it passes the fsGroup in the options, and the mount
        # shows it as its group (kubernetes.io/mounterArgs.FsGroup, see mount).
        return reply(SUCCESS, capabilities={"attach": False, "fsGroup": False})

    def mount(self, target_dir: str, options_json: str) -> dict[str, Any]:
        target = check_target_path(target_dir, "mount directory")
        attributes, secrets, kubelet = split_options(parse_options(options_json))
        fs_type = kubelet.get(FLEX_FS_TYPE, "")
        if fs_type not in FS_TYPES:
            raise invalid(f"fsType {fs_type!r} is not supported (leave it empty)")
        readwrite = kubelet.get(FLEX_READWRITE, "rw")
        if readwrite not in ("rw", "ro"):
            raise invalid(f"{FLEX_READWRITE} must be 'rw' or 'ro', got {readwrite!r}")
        volume = parse_volume_attributes(attributes)
        credentials = parse_credentials(secrets)
        volume_id = flex_volume_id(kubelet, volume.source, volume.endpoint_url)
        read_only = readwrite == "ro" or volume.read_only
        group = parse_mount_group(kubelet.get(FLEX_FS_GROUP, ""), FLEX_FS_GROUP)
        volume = dataclasses.replace(volume, owner=volume.owner.with_mount_group(group, read_only=read_only))
        self.ops.publish(PublishRequest(volume_id, target, volume, read_only, credentials))
        return reply(SUCCESS)

    def unmount(self, target_dir: str) -> dict[str, Any]:
        self.ops.unpublish(None, check_target_path(target_dir, "mount directory"))
        return reply(SUCCESS)

    def run(self, argv: Sequence[str]) -> dict[str, Any]:
        if not argv:
            return reply(NOT_SUPPORTED, "no command given")
        command, args = argv[0], list(argv[1:])
        try:
            if command == "init" and not args:
                return self.init()
            if command == "mount" and len(args) == 2:
                return self.mount(args[0], args[1])
            if command == "unmount" and len(args) == 1:
                return self.unmount(args[0])
            if command in ("init", "mount", "unmount"):
                return reply(FAILURE, f"{command}: wrong number of arguments")
            return reply(NOT_SUPPORTED, f"{command} is not supported by cachefs (no attach)")
        except CsiError as exc:
            log.warning("%s failed: %s: %s", command, exc.code.name, REGISTRY.scrub(exc.message))
            return reply(FAILURE, exc.message)
        except Exception as exc:  # noqa: BLE001 - the kubelet must get JSON, never a traceback
            log.exception("%s failed", command)
            return reply(FAILURE, f"{command}: unexpected {type(exc).__name__}")


def configure_logging(path: str) -> None:
    root = logging.getLogger()
    root.handlers[:] = []
    root.setLevel(logging.INFO)
    try:
        handler: logging.Handler = logging.handlers.RotatingFileHandler(path, maxBytes=LOG_MAX_BYTES, backupCount=2)
    except OSError:
        handler = logging.NullHandler()  # never stderr: the kubelet would read it as the reply
    handler.setFormatter(RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)


# Lends the node plugin's cloud identity to volumes without a Secret; see the module docstring for
# why its only "yes" names whom it is lent to.
NODE_IDENTITY_VARIABLE = "CACHEFS_FLEX_ALLOW_NODE_IDENTITY"
LEND_TO_EVERY_POD_AUTHOR = "every-pod-author"


def lends_node_identity(value: str) -> bool:
    """``CACHEFS_FLEX_ALLOW_NODE_IDENTITY``: "" or "false" no, ``every-pod-author`` yes; ValueError else."""
    if value.strip().lower() in ("", "false"):
        return False
    if value.strip() == LEND_TO_EVERY_POD_AUTHOR:
        return True
    raise ValueError(f"{NODE_IDENTITY_VARIABLE}={value!r} is not accepted: a FlexVolume driver cannot tell a "
                     f"PersistentVolume an admin wrote from a volume in a pod spec, so the node's identity would go to "
                     f"every pod author; set it to {LEND_TO_EVERY_POD_AUTHOR!r} to lend it so, or give the volumes "
                     f"a Secret (secretRef) and unset it")


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None,
         mounter: Mounter | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ if environ is None else environ)
    configure_logging(env.get("CACHEFS_FLEX_LOG", DEFAULT_LOG))
    cache_root = Path(env.get("CACHEFS_FLEX_CACHE_ROOT", DEFAULT_CACHE_ROOT))
    try:
        trust = VolumeTrust.from_flags(lends_node_identity(env.get(NODE_IDENTITY_VARIABLE, "")),
                                       env.get("CACHEFS_FLEX_ALLOWED_ENDPOINTS", ""),
                                       env.get("CACHEFS_FLEX_ALLOWED_BUCKETS", ""),
                                       allow_local_endpoints=env.get("CACHEFS_FLEX_ALLOW_LOCAL_ENDPOINTS", "").lower()
                                       == "true")
    except ValueError as exc:
        result = {"status": FAILURE, "message": str(exc)}
    else:
        ops = NodeOps(NodeSettings(node_id=os.uname().nodename, cache_root=cache_root, trust=trust),
                      mounter or CachefsMounter(environ=trust.daemon_environ(env)))
        result = FlexDriver(ops).run(argv)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0 if result["status"] == SUCCESS else 1


if __name__ == "__main__":
    sys.exit(main())
