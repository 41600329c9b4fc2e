"""Kubernetes glue for cachefs: a CSI v1 driver (Identity, Node, Controller) and a FlexVolume shim.

Layout, outermost first:

``main``        the ``cachefs-csi`` entry point: flags, logging, the gRPC server on a unix socket.
``server``      gRPC servicers: unpack a request, call one method of ``NodeOps``/``ControllerOps``,
                pack the answer; ``CsiError`` becomes a gRPC status there, and only there.
``flex``        the ``cachefs-flex`` FlexVolume driver: the same ``NodeOps`` behind kubelet's
                exec-and-JSON protocol (no gRPC).
``node``        publish/unpublish semantics: idempotency, broken-mount repair, per-volume caches.
``controller``  dynamic provisioning: a volume is a prefix in a bucket, its id says where.
``mounter``     the ``Mounter`` seam: ``CachefsMounter`` runs the ``cachefs`` CLI, ``FakeMounter``
                is the in-memory double for unit tests.
``attributes``  every volume-attribute, parameter and secret key, parsed into frozen settings.
``redact``      keeping credentials out of logs and error messages.

The driver mounts by running ``cachefs mount`` (and talks to S3 through ``cachefs.admin``); it never
imports ``tiering``. gRPC and protobuf are imported only in this package (import-linter checks both).
"""

DRIVER_NAME = "csi.cachefs.io"
